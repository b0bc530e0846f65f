"""`catsproto eval` end to end on a small slice: table, JSON, plots, usage errors."""

from __future__ import annotations

import json

import pytest

from catsproto import cli
from catsproto.adapters.report import raw_event_bytes
from catsproto.adapters.trace import (
    TraceFormatError,
    find_trace,
    parse_trace_line,
    read_trace,
)

TRACE = str(find_trace())


def test_eval_report(tmp_path, capsys):
    out = tmp_path / "rep"
    status = cli.main(
        [
            "eval",
            "--trace",
            TRACE,
            "--limit",
            "120",
            "--speedup",
            "2",
            "--policies",
            "nearest",
            "catsproto",
            "oracle",
            "--report",
            str(out),
            "--sweep-limit",
            "40",
            "--set",
            "target_fpr=0.02",
        ]
    )
    assert status == 0
    captured = capsys.readouterr()
    assert "catsproto" in captured.out and "hit %" in captured.out
    assert "%" in captured.err  # the progress bar
    doc = json.loads((out / "results.json").read_text())
    assert doc["scenario"]["target_fpr"] == 0.02
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"nearest", "catsproto", "oracle"}
    cats = rows["catsproto"]
    assert cats["requests"] == 120 and cats["adv_bytes"] > 0 and cats["raw_event_bytes"] > 0
    assert cats["adv_share_of_raw"] == pytest.approx(cats["adv_bytes"] / cats["raw_event_bytes"])
    assert 0 <= rows["oracle"]["hit_rate"] <= 1
    for name in ("ttft_cdf_x2.png", "sweep_update_interval_ms.png", "sweep_target_fpr.png"):
        assert (out / name).stat().st_size > 1000
    assert "| catsproto |" in (out / "summary.md").read_text()
    assert len(doc["sweeps"]["target_fpr"]) == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "bogus"], "unknown policy"),
        (["--set", "nonsense=1"], "no such key"),
        (["--set", "rtt_ms.A-Z=3"], "rtt_ms key"),
        (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
        (["--speedup", "0"], "speedup"),
    ],
)
def test_eval_usage_errors(argv, message, capsys):
    assert cli.main(["eval", "--limit", "5", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_trace_reader():
    reqs = read_trace(TRACE, limit=3)
    assert len(reqs) == 3 and reqs[0].hash_ids[:3] == (0, 1, 2)
    assert reqs[0].input_length == 6758
    with pytest.raises(TraceFormatError, match="line 7"):
        parse_trace_line('{"timestamp": 0, "input_length": 5}', 7)
    with pytest.raises(TraceFormatError, match="hash_ids"):
        parse_trace_line('{"timestamp": 0, "input_length": 5, "hash_ids": [-1]}', 1)


def test_raw_event_bytes_counts_token_ids():
    one = raw_event_bytes({"batches": 1, "events": 1, "stored_blocks": 1}, 512)
    two = raw_event_bytes({"batches": 1, "events": 1, "stored_blocks": 2}, 512)
    # a stored block costs its hash (9 bytes) and 512 token ids of 3 bytes each
    assert two - one == 9 + 512 * 3
    removed = raw_event_bytes({"batches": 1, "events": 1, "removed_blocks": 1}, 512)
    assert removed < one

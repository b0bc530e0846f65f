"""`catsproto eval` end to end on a small slice: table, JSON, plots, usage errors; the
seed study (`--seeds`, `--jobs`) against single-seed runs, and its aggregation by hand."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys

import pytest

from catsproto import cli
from catsproto.adapters.report import headline, raw_event_bytes, seed_aggregate
from catsproto.adapters.trace import (
    TraceFormatError,
    find_trace,
    parse_trace_line,
    read_trace,
)
from catsproto.commands.eval import parse_seeds

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
    # the progress display: captured (not a terminal), so a line per finished run
    assert "catsproto x2               done" in captured.err and "\r" not in captured.err
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


# --- the seed study: catsproto eval --seeds ---------------------------------------------

SEED_ARGS = ["--trace", TRACE, "--limit", "200", "--speedup", "4", "--policies", "catsproto"]
SEED_ARGS += ["oracle", "--sweep-limit", "0"]


def _json_of(argv: list[str]) -> object:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["eval", *argv]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def single_seed_rows() -> dict[int, dict[str, dict]]:
    """What `catsproto eval --set seed=N --json` gives for seeds 1 and 2, by policy."""
    rows = {}
    for seed in (1, 2):
        doc = _json_of([*SEED_ARGS, "--set", f"seed={seed}", "--json", "--quiet"])
        rows[seed] = {r["policy"]: r for r in doc}
    return rows


@pytest.fixture(scope="module")
def seed_study() -> dict:
    return _json_of([*SEED_ARGS, "--seeds", "1-2", "--json", "--quiet"])


def test_seed_study_equals_single_seed_runs(seed_study, single_seed_rows):
    assert seed_study["seeds"] == [1, 2]
    runs = seed_study["runs"]
    assert [(r["policy"], r["seed"]) for r in runs] == [
        ("catsproto", 1),
        ("catsproto", 2),
        ("oracle", 1),
        ("oracle", 2),
    ]
    for r in runs:
        row = dict(r)
        seed = row.pop("seed")
        assert row == single_seed_rows[seed][row["policy"]]  # every field, exact floats
    agg = {a["policy"]: a for a in seed_study["aggregate"]}
    c1, c2 = (single_seed_rows[s]["catsproto"] for s in (1, 2))
    o1, o2 = (single_seed_rows[s]["oracle"] for s in (1, 2))
    cats = agg["catsproto"]
    assert cats["seeds"] == 2 and cats["speedup"] == 4
    assert cats["ttft_mean_ms"] == (c1["ttft_mean_ms"] + c2["ttft_mean_ms"]) / 2
    assert cats["ttft_min_ms"] == min(c1["ttft_mean_ms"], c2["ttft_mean_ms"])
    assert cats["ttft_max_ms"] == max(c1["ttft_mean_ms"], c2["ttft_mean_ms"])
    assert cats["hit_rate"] == (c1["hit_rate"] + c2["hit_rate"]) / 2
    spread = abs(c1["ttft_mean_ms"] - c2["ttft_mean_ms"])
    assert spread > 0  # the scenario seed does move catsproto
    assert cats["ttft_std_ms"] == pytest.approx(spread / math.sqrt(2), rel=1e-12)
    d1 = c1["ttft_mean_ms"] - o1["ttft_mean_ms"]
    d2 = c2["ttft_mean_ms"] - o2["ttft_mean_ms"]
    assert cats["reference"] == "oracle" and cats["paired_seeds"] == 2
    assert cats["diff_mean_ms"] == (d1 + d2) / 2
    assert cats["diff_se_ms"] == pytest.approx(abs(d1 - d2) / 2, rel=1e-12)
    assert cats["at_or_below"] == (d1 <= 0) + (d2 <= 0)
    oracle = agg["oracle"]
    # the oracle reads no advertisements: the scenario seed leaves it alone
    assert oracle["ttft_std_ms"] == 0 and oracle["ttft_mean_ms"] == o1["ttft_mean_ms"]
    assert oracle["reference"] is None and oracle["diff_mean_ms"] is None


def test_seed_study_two_jobs_equal_one(seed_study, capsys):
    assert cli.main(["eval", *SEED_ARGS, "--seeds", "1-2", "--json", "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == seed_study  # same rows, same order
    assert "runs done 4/4" in captured.err  # the progress line


def test_seed_study_table_and_report(tmp_path, capsys):
    out = tmp_path / "seeds"
    argv = [*SEED_ARGS, "--speedup", "2", "4", "--seeds", "2,5", "--quiet", "--report", str(out)]
    assert cli.main(["eval", *argv]) == 0
    table = capsys.readouterr().out
    assert "− oracle ms" in table and "≤ oracle" in table and " of 2" in table
    doc = json.loads((out / "seeds.json").read_text())
    assert len(doc["runs"]) == 2 * 2 * 2  # policies x speedups x seeds
    assert sorted({r["seed"] for r in doc["runs"]}) == [2, 5]
    assert all("ttft_p99_ms" in r and "hit_rate" in r for r in doc["runs"])
    assert [(a["policy"], a["speedup"]) for a in doc["aggregate"]] == [
        ("catsproto", 2),
        ("oracle", 2),
        ("catsproto", 4),
        ("oracle", 4),
    ]
    assert doc["meta"]["seeds"] == [2, 5] and "seed" not in doc["scenario"]
    md = (out / "seeds.md").read_text()
    assert "| catsproto | 4 | 2 |" in md and "![seeds_x4](seeds_x4.png)" in md
    for name in ("seeds_x2.png", "seeds_x4.png"):
        assert (out / name).stat().st_size > 5000
    assert not (out / "results.json").exists()  # not the single-seed report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", ""], "is not a seed"),
        (["--seeds", "one"], "is not a seed"),
        (["--seeds", "1-"], "is not a seed"),
        (["--seeds=-3"], "is not a seed"),
        (["--seeds", "1.5"], "is not a seed"),
        (["--seeds", "1,,2"], "is not a seed"),
        (["--seeds", "5-1"], "range '5-1' is empty"),
        (["--seeds", "1,1"], "seed 1 is given twice"),
        (["--seeds", "1-5,3"], "seed 3 is given twice"),
        (["--seeds", "1-2", "--set", "seed=3"], "leave out --set seed"),
        (["--seeds", "1-2", "--jobs", "0"], "--jobs must be at least 1"),
        (["--jobs", "2"], "--jobs needs --seeds"),
        (["--seeds", "1", "--policies", "oracle", "oracle"], "--policies: oracle is given twice"),
        (["--seeds", "1", "--speedup", "4", "4.0"], "--speedup: 4 is given twice"),
    ],
)
def test_seed_study_usage_errors(argv, message, capsys):
    assert cli.main(["eval", "--limit", "5", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_parse_seeds():
    assert parse_seeds("1-5,9") == [1, 2, 3, 4, 5, 9]
    assert parse_seeds("3, 1") == [3, 1]
    assert parse_seeds("0") == [0]
    assert parse_seeds("7-7") == [7]


def _row(policy: str, speedup: float, seed: int, ttft: float, hit: float) -> dict:
    return {
        "policy": policy,
        "speedup": speedup,
        "seed": seed,
        "ttft_mean_ms": ttft,
        "hit_rate": hit,
    }


def test_seed_aggregate_by_hand():
    rows = [
        _row("catsproto", 4, 1, 11.0, 0.25),
        _row("catsproto", 4, 2, 12.0, 0.5),
        _row("catsproto", 4, 3, 16.0, 0.75),
        _row("oracle", 4, 1, 11.0, 0.5),
        _row("oracle", 4, 2, 13.0, 0.5),
        _row("oracle", 4, 3, 13.0, 0.5),
        _row("nearest", 1, 1, 20.0, 0.125),  # one seed: no spread, no standard error
        _row("oracle", 1, 1, 19.0, 0.5),
    ]
    cats, oracle, nearest, oracle1 = seed_aggregate(rows)
    assert (cats["policy"], cats["speedup"], cats["seeds"]) == ("catsproto", 4, 3)
    assert cats["ttft_mean_ms"] == 13.0
    assert cats["ttft_std_ms"] == pytest.approx(math.sqrt(7))  # (4 + 1 + 9) / 2
    assert (cats["ttft_min_ms"], cats["ttft_max_ms"]) == (11.0, 16.0)
    assert cats["hit_rate"] == 0.5
    # per seed: 0, -1, +3 ms against the oracle; mean 2/3, sample std sqrt(39)/3
    assert cats["diff_mean_ms"] == pytest.approx(2 / 3)
    assert cats["diff_se_ms"] == pytest.approx(math.sqrt(39) / 3 / math.sqrt(3))
    assert cats["at_or_below"] == 2 and cats["paired_seeds"] == 3
    assert oracle["ttft_std_ms"] == pytest.approx(math.sqrt(4 / 3))
    assert oracle["diff_mean_ms"] is None and oracle["at_or_below"] is None
    assert nearest["speedup"] == 1 and nearest["seeds"] == 1
    # the x1 oracle ran on seed 1 too, so nearest pairs there: one seed, no error
    assert nearest["diff_mean_ms"] == 1.0 and nearest["diff_se_ms"] is None
    assert nearest["ttft_std_ms"] is None and oracle1["ttft_mean_ms"] == 19.0
    # only the seeds both ran are paired
    partial = seed_aggregate(rows[:5])
    assert partial[0]["paired_seeds"] == 2 and partial[0]["diff_mean_ms"] == -0.5
    with pytest.raises(ValueError, match="two rows for catsproto x4 seed 1"):
        seed_aggregate([*rows, rows[0]])


def test_headline_compares_catsproto_with_nearest_and_the_oracle():
    rows = [
        {"policy": "nearest", "speedup": 1.0, "hit_rate": 0.10, "ttft_mean_ms": 600.0},
        {"policy": "catsproto", "speedup": 1.0, "hit_rate": 0.25, "ttft_mean_ms": 480.0},
        {"policy": "oracle", "speedup": 1.0, "hit_rate": 0.24, "ttft_mean_ms": 482.5},
        {"policy": "catsproto", "speedup": 4.0, "hit_rate": 0.2, "ttft_mean_ms": 500.0},
        {"policy": "oracle", "speedup": 4.0, "hit_rate": 0.2, "ttft_mean_ms": 498.0},
        {"policy": "random", "speedup": 8.0, "hit_rate": 0.05, "ttft_mean_ms": 900.0},
    ]
    assert headline(rows) == [
        "x1: catsproto hit 25.0%, mean TTFT 480.0 ms; against nearest 2.5x the hit rate "
        "(10.0%) and 20.0% less TTFT (600.0 ms); 2.5 ms below the oracle (482.5 ms, hit 24.0%)",
        "x4: catsproto hit 20.0%, mean TTFT 500.0 ms; 2.0 ms above the oracle (498.0 ms, "
        "hit 20.0%)",
    ]
    assert headline(rows[1:2]) == []  # nothing to compare with


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_redraws_on_a_terminal_and_writes_one_line_to_a_file(monkeypatch, tty):
    from catsproto.commands.eval import _Bar, _SeedProgress

    err = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", err)
    bar = _Bar("catsproto x4", 200, True)
    for done in range(1, 201):
        bar(done)
    seeds = _SeedProgress(2, True)
    for i in range(2):
        seeds.start(i, f"seed {i + 1}")
        seeds.percent(i, 50)
        seeds.finish(i)
    text = err.getvalue()
    if tty:
        assert text.count("\r") >= 100 + 6 and "[#########################] 100%" in text
    else:
        assert "\r" not in text
        assert text.splitlines() == [
            "catsproto x4               done",
            "runs done 1/2: seed 1",
            "runs done 2/2: seed 2",
        ]

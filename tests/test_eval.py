"""`catsproto eval` end to end on a small slice: table, JSON, plots, usage errors; the
seed study (`--seeds`, `--jobs`) against single-seed runs, and its aggregation by hand."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from catsproto import cli
from catsproto.adapters.report import headline, raw_event_bytes, seed_aggregate, summary_rows
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
            "--jobs",
            "1",
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


def test_eval_in_two_workers_equals_one_process(tmp_path, capsys):
    """The main table and the sweeps, run in two worker processes (catsproto's runs
    first), give the rows, sweep points and report of the same command in one process."""
    args = [
        "eval", "--trace", TRACE, "--limit", "90", "--speedup", "1", "3",
        "--policies", "nearest", "catsproto", "oracle", "--sweep-limit", "30", "--json",
    ]  # fmt: skip
    docs = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        assert cli.main([*args, "--report", str(out), "--jobs", jobs]) == 0
        captured = capsys.readouterr()
        docs[jobs] = (json.loads(captured.out), json.loads((out / "results.json").read_text()))
        if jobs == "2":
            assert "runs done 14/14" in captured.err  # 6 runs + 8 sweep points
    (rows1, report1), (rows2, report2) = docs["1"], docs["2"]
    assert rows1 == rows2 and [r["policy"] for r in rows2][:3] == ["nearest", "catsproto", "oracle"]
    assert report1["results"] == report2["results"] and report1["sweeps"] == report2["sweeps"]
    assert report1["meta"]["jobs"] == 1 and report2["meta"]["jobs"] == 2


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
        (["--seeds", "1-2", "--jobs", "0"], "--jobs 0: must be at least 1"),
        (["--jobs", "-1"], "--jobs -1: must be at least 1"),
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


# --- bad input: limits, overrides, trace lines and where the trace is looked for ---------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--limit", "0"], "--limit 0: the number of requests must be at least 1"),
        (["--limit", "-5"], "--limit -5: the number of requests must be at least 1"),
        (["--sweep-limit", "-3"], "--sweep-limit -3: must be >= 0 (0: no sweeps)"),
        (["--set", "speedup=2"], "--set speedup=2: the speedup is set by --speedup"),
        (["--set", "sharded=False"], "sharded must be true or false, not 'False'"),
        (["--set", "physical_arrival=yes"], "physical_arrival must be true or false, not 'yes'"),
    ],
)
def test_eval_refuses_bad_limits_and_overrides(argv, message, capsys):
    assert cli.main(["eval", "--trace", TRACE, "--quiet", "--limit", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "has no requests" not in err


@pytest.mark.parametrize(
    "line, column, at_end",
    [
        ('{"timestamp": 0, "input_length": 5,\n', 36, True),  # cut short after a comma
        ('{"timestamp": 0, "input_length"\n', 32, True),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1, 2]\r\n', 55, True),
        ('{"timestamp": 0 "input_length": 5}\n', 17, False),  # a comma missing inside
        ("   {x}\n", 5, False),
    ],
)
def test_a_trace_parse_error_names_the_column_on_the_line(line, column, at_end):
    with pytest.raises(TraceFormatError) as caught:
        parse_trace_line(line, 3)
    text = str(caught.value)
    assert text.startswith("trace line 3: not JSON: ")
    assert f" at column {column}" in text
    assert ("(the end of the line: cut short?)" in text) is at_end


def test_a_truncated_trace_file_points_at_its_last_line(tmp_path, capsys):
    with open(TRACE, encoding="utf-8") as f:
        whole = f.readline()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(whole + whole[:60] + "\n")
    assert cli.main(["eval", "--trace", str(cut), "--quiet", "--policies", "nearest"]) == 2
    err = capsys.readouterr().err
    assert "trace line 2: not JSON: " in err and "at column 61 (the end of the line" in err


def test_the_trace_search_names_each_place_once(monkeypatch, tmp_path):
    from catsproto.adapters import trace as trace_io

    # $CATSPROTO_TRACES is the checkout's own folder: it is tried once, then the cache
    monkeypatch.setenv("CATSPROTO_TRACES", str(trace_io.CHECKOUT_TRACES))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    places = trace_io.trace_folders()
    assert places == [trace_io.CHECKOUT_TRACES, tmp_path / "cache" / "catsproto" / "traces"]
    with pytest.raises(trace_io.TraceNotFound) as caught:
        trace_io.find_trace("no-such-trace.jsonl")
    text = str(caught.value)
    # the tried places, split out whole: one path may be the tail of another
    tried = text.split("(tried ", 1)[1].split("; set CATSPROTO_TRACES)", 1)[0].split(", ")
    assert tried == [str(p / "no-such-trace.jsonl") for p in places]
    assert text.count("no-such-trace.jsonl") == len(places) + 1  # each place and the name
    assert caught.value.places == places


def test_a_missing_catsproto_traces_folder_is_refused(monkeypatch, tmp_path, capsys):
    from catsproto.adapters import trace as trace_io

    missing = tmp_path / "nowhere"
    monkeypatch.setenv("CATSPROTO_TRACES", str(missing))
    with pytest.raises(TraceFormatError, match=r"CATSPROTO_TRACES is .*nowhere.*not a folder"):
        trace_io.find_trace()
    assert cli.main(["eval", "--quiet", "--limit", "5", "--policies", "nearest"]) == 2
    assert "not a folder" in capsys.readouterr().err
    folder = tmp_path / "traces"
    folder.mkdir()
    with open(TRACE, encoding="utf-8") as f:
        (folder / trace_io.MOONCAKE).write_text(f.readline())
    monkeypatch.setenv("CATSPROTO_TRACES", str(folder))
    assert trace_io.find_trace() == folder / trace_io.MOONCAKE  # first in the order


def test_the_trace_help_states_the_search_order():
    from catsproto.adapters.trace import SEARCH_ORDER

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["eval"].format_help().split())
    assert " ".join(SEARCH_ORDER.split()) in text
    assert SEARCH_ORDER.startswith("$CATSPROTO_TRACES, then the checkout's data/traces")


# --- rates, the headline, the report folder ---------------------------------------------


def test_rates_over_a_span_too_short_read_n_a(capsys):
    """One request spans 0 s: its advertisement bytes are no rate (it printed 8112000 B/s
    over a 1 ms floor); from RATE_MIN_SPAN_S of span on they are bytes over the span."""
    from catsproto.sim.engine import RATE_MIN_SPAN_S

    args = ["--trace", TRACE, "--speedup", "1", "--policies", "catsproto", "nearest"]
    (one, _) = _json_of([*args, "--limit", "1", "--json", "--quiet"])
    assert one["duration_s"] == 0.0 and one["adv_bytes"] > 0
    assert one["adv_bytes_per_s"] is None and one["raw_event_bytes_per_s"] is None
    assert one["adv_share_of_raw"] == pytest.approx(one["adv_bytes"] / one["raw_event_bytes"])
    assert cli.main(["eval", *args, "--limit", "1", "--quiet"]) == 0
    table = capsys.readouterr().out.splitlines()
    end = table[0].index("adv B/s") + len("adv B/s")  # the columns are right-aligned
    cats, nearest = (table[i][:end].split()[-1] for i in (1, 2))
    assert table[1].split()[0] == "catsproto" and cats == "n/a" and nearest == "–"
    (row, _) = _json_of([*args, "--limit", "200", "--json", "--quiet"])
    assert row["duration_s"] >= RATE_MIN_SPAN_S
    assert row["adv_bytes_per_s"] == pytest.approx(row["adv_bytes"] / row["duration_s"])
    assert row["raw_event_bytes_per_s"] == pytest.approx(row["raw_event_bytes"] / row["duration_s"])


def test_headline_says_more_when_catsproto_is_slower_and_reads_without_hits():
    rows = [
        {"policy": "nearest", "speedup": 4.0, "hit_rate": 0.0, "ttft_mean_ms": 400.0},
        {"policy": "catsproto", "speedup": 4.0, "hit_rate": 0.05, "ttft_mean_ms": 440.0},
        {"policy": "oracle", "speedup": 4.0, "hit_rate": 0.06, "ttft_mean_ms": 440.0},
        {"policy": "nearest", "speedup": 1.0, "hit_rate": 0.0, "ttft_mean_ms": 300.0},
        {"policy": "catsproto", "speedup": 1.0, "hit_rate": 0.0, "ttft_mean_ms": 300.0},
    ]
    assert headline(rows) == [
        "x1: catsproto hit 0.0%, mean TTFT 300.0 ms; against nearest the same hit rate "
        "(0.0%) and 0.0% less TTFT (300.0 ms)",
        "x4: catsproto hit 5.0%, mean TTFT 440.0 ms; against nearest a hit rate of 5.0% "
        "where it has none and 10.0% more TTFT (400.0 ms); level with the oracle (440.0 ms, "
        "hit 6.0%)",
    ]
    for line in headline(rows):
        assert "n/a" not in line and "-" not in line.replace("catsproto", "")


REPORT_ARGS = ["--trace", TRACE, "--limit", "60", "--policies", "nearest", "catsproto"]
REPORT_ARGS += ["--quiet"]


def test_a_report_folder_keeps_only_this_run_of_our_files(tmp_path, capsys):
    out = tmp_path / "rep"
    first = [*REPORT_ARGS, "--speedup", "1", "2", "--sweep-limit", "30", "--report", str(out)]
    assert cli.main(["eval", *first]) == 0
    ours = {"results.json", "summary.md", "ttft_cdf_x1.png", "ttft_cdf_x2.png"}
    ours |= {"sweep_update_interval_ms.png", "sweep_target_fpr.png"}
    assert {p.name for p in out.iterdir()} == ours
    # what is not ours stays, whatever its name looks like
    others = ["notes.md", "ttft_cdf_x1.png.bak", "sweep_other.png", "seeds.json", "old.png"]
    for name in others:
        (out / name).write_text("mine")
    (out / "ttft_cdf_x8.png").mkdir()  # a folder, not a file we wrote
    again = [*REPORT_ARGS, "--speedup", "2", "--sweep-limit", "0", "--report", str(out)]
    assert cli.main(["eval", *again]) == 0
    names = {p.name for p in out.iterdir()}
    assert names == {"results.json", "summary.md", "ttft_cdf_x2.png", "ttft_cdf_x8.png", *others}
    summary = (out / "summary.md").read_text()
    assert "ttft_cdf_x1" not in summary and "sweep_" not in summary
    for name in others:
        assert (out / name).read_text() == "mine"


def test_a_seed_report_removes_its_own_earlier_plots_only(tmp_path):
    from catsproto.adapters.report import write_seed_report

    rows = [
        {"policy": p, "speedup": x, "seed": s, "ttft_mean_ms": 400.0 + s + (p == "catsproto")}
        | {"hit_rate": 0.2}
        for x in (1.0, 4.0)
        for p in ("catsproto", "oracle")
        for s in (1, 2)
    ]
    meta = {"trace": "t", "requests": 1, "command": "c", "jobs": 1, "seeds_spec": "1-2"}
    write_seed_report(tmp_path, rows, seed_aggregate(rows), {"name": "S"}, meta)
    (tmp_path / "results.json").write_text("a main report's")
    assert {p.name for p in tmp_path.iterdir()} == {
        "seeds.json",
        "seeds.md",
        "seeds_x1.png",
        "seeds_x4.png",
        "results.json",
    }
    at_four = [r for r in rows if r["speedup"] == 4.0]
    write_seed_report(tmp_path, at_four, seed_aggregate(at_four), {"name": "S"}, meta)
    assert {p.name for p in tmp_path.iterdir()} == {
        "seeds.json",
        "seeds.md",
        "seeds_x4.png",
        "results.json",
    }


def test_summary_defines_fallbacks_and_the_rate_rule(tmp_path):
    out = tmp_path / "rep"
    argv = [*REPORT_ARGS, "--speedup", "4", "--sweep-limit", "0", "--report", str(out)]
    assert cli.main(["eval", *argv]) == 0
    text = (out / "summary.md").read_text()
    assert "fallbacks 10." in text
    assert "Fallbacks: catsproto decisions made before the deciding C-PS had heard any " in text
    assert "n/a under 10 s" in text
    docs = (Path(__file__).parents[1] / "docs" / "evaluation.md").read_text()
    assert '"fallbacks" (summary.md) = catsproto decisions made before' in docs
    assert "under 10 s of span it reads n/a" in docs


# --- plots: what a reader must be able to see -------------------------------------------

DOCS_EVAL = Path(__file__).parents[1] / "docs" / "eval"


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("study", ["seeds", "seeds-70b", "seeds-physical"])
@pytest.mark.parametrize("speedup", [1.0, 4.0])
def test_seed_plot_legends_cover_no_point_or_bar(study, speedup):
    """The twenty-seed study's plots (their own numbers): neither legend may lie over a
    bar of the differences or a per-seed point (seeds_x1.png's legend hid seed 20's)."""
    from catsproto.adapters.report import seed_figure

    doc = json.loads((DOCS_EVAL / study / "seeds.json").read_text())
    fig = seed_figure(doc["runs"], doc["aggregate"], speedup, "t")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    top, bottom = fig.axes[0], fig.axes[1]
    checked = 0
    for ax in (top, bottom):
        box = ax.get_legend().get_window_extent(renderer)
        for bar in ax.patches:
            checked += 1
            assert not _overlaps(box, bar.get_window_extent(renderer)), (ax, bar)
        for line in ax.get_lines():
            if line.get_linestyle() == "None" and line.get_marker() not in ("", "None", " "):
                for x, y in line.get_xydata():
                    checked += 1
                    px, py = ax.transData.transform((x, y))
                    assert not (box.x0 - 4 < px < box.x1 + 4 and box.y0 - 4 < py < box.y1 + 4)
    seeds = {r["seed"] for r in doc["runs"]}
    assert checked >= 2 * len(seeds) >= 20  # a bar and a point a seed at least


def _cdf_results(policies: Sequence[str], n: int = 150):
    from catsproto.adapters.trace import load_scenario
    from catsproto.keys import BlockKeyer
    from catsproto.sim import PreparedTrace, Scenario, apply_overrides, run_policy

    sc = Scenario.from_mapping(apply_overrides(load_scenario("s1"), ["speedup=4"]))
    keyer = BlockKeyer(sc.secret, sc.model_id, sc.block_tokens)
    trace = PreparedTrace.build(
        read_trace(TRACE, n), keyer, len(sc.sites), sc.speedup, sc.ingress_index
    )
    return [run_policy(p, trace, sc, seed=1) for p in policies]


def test_the_cdf_tells_seven_policies_apart_and_zooms_on_their_middle():
    from catsproto.adapters.report import cdf_figure
    from catsproto.sim import POLICIES

    results = _cdf_results(POLICIES)
    fig = cdf_figure(results, "S1: TTFT CDF, speedup 4")
    whole, zoom = fig.axes
    lines = whole.get_lines()
    assert [line.get_label() for line in lines] == list(POLICIES) == [r.policy for r in results]
    # the dash pattern as drawn (matplotlib has no public getter: get_linestyle() calls
    # every custom pattern "--")
    dashes = [str(line._unscaled_dash_pattern) for line in lines]
    assert len(set(dashes)) == 7, dashes  # told apart without colour too
    assert len({line.get_color() for line in lines}) == 7
    width = {line.get_label(): line.get_linewidth() for line in lines}
    assert width["catsproto"] > max(w for p, w in width.items() if p != "catsproto")
    assert zoom.get_ylim() == (0.5, 0.95) and zoom.get_xscale() == "log"
    assert [line.get_xydata().tolist() for line in zoom.get_lines()] == [
        line.get_xydata().tolist() for line in lines
    ]  # the same numbers, only zoomed
    lo, hi = zoom.get_xlim()
    ttft = [np.quantile(r.ttft_ms / 1000, q) for r in results for q in (0.5, 0.95)]
    assert min(ttft) >= lo and hi < max(ttft)  # the worst policies leave it to the right


def test_a_sweep_plot_states_its_requests_and_starts_its_axes_at_zero(tmp_path, monkeypatch):
    import matplotlib.figure

    from catsproto.adapters.report import sweep_figure, write_report

    pts = [
        {"target_fpr": f, "hit_rate": h, "ttft_mean_ms": 1.0, "adv_bytes_per_s": b}
        | {"adv_share_of_raw": 0.01}
        for f, h, b in ((0.001, 0.152, 1200.0), (0.01, 0.149, 900.0), (0.2, 0.144, None))
    ]
    fig = sweep_figure(pts, "target_fpr", "target false-positive rate", "S1: title")
    hit_axis, bytes_axis = fig.axes
    assert hit_axis.get_ylim()[0] == 0 and bytes_axis.get_ylim()[0] == 0
    assert hit_axis.get_ylim()[1] > 15.2 and bytes_axis.get_ylim()[1] > 1200
    (hits,) = hit_axis.get_lines()
    assert hits.get_ydata().tolist() == pytest.approx([15.2, 14.9, 14.4])
    (rates,) = bytes_axis.get_lines()
    assert rates.get_ydata().tolist() == [1200.0, 900.0]  # the n/a point left out
    # the report's sweep plot says on how many requests, at which speedup: the titles of
    # the figures it saves (each still saved)
    titles = []
    save = matplotlib.figure.Figure.savefig

    def save_and_note_title(self, *args, **kwargs):
        titles.append(self.axes[0].get_title())
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save_and_note_title)
    results = _cdf_results(["catsproto"], 30)
    rows = summary_rows(results, 512)
    meta = {"trace": "t", "requests": 30, "command": "c", "wall_s": 0.0, "sweep_requests": 2000}
    write_report(tmp_path, rows, results, {"name": "S1"}, {"target_fpr": pts}, meta)
    assert "S1: catsproto on the first 2,000 requests, speedup 1, one run per point" in titles
    assert (tmp_path / "sweep_target_fpr.png").stat().st_size > 1000


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_run_that_does_not_finish_leaves_no_report_folder_it_made(
    monkeypatch, tmp_path, capsys, stop
):
    """Interrupted (Ctrl-C) or failed mid-run: the folders --report made are gone again;
    a folder that was there before, with its files, stays as it was."""
    from catsproto.commands import eval as eval_cmd

    def halt(*args, **kwargs):
        raise stop("stopped in the middle of a run")

    monkeypatch.setattr(eval_cmd, "run_policy", halt)
    new = tmp_path / "new" / "deeper"
    argv = ["eval", "--quiet", "--trace", TRACE, "--limit", "5", "--policies", "nearest"]
    if stop is KeyboardInterrupt:
        assert cli.main([*argv, "--report", str(new)]) == 130
        assert "interrupted" in capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError):
            cli.main([*argv, "--report", str(new)])
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(stop):
        eval_cmd.run(cli.build_parser().parse_args([*argv, "--report", str(kept)]))
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]

"""The fault, churn and hostile-peer campaign (issue 11) against the real lab daemons.

Each scenario of `catsproto.lab.faults` is one test: it brings the chaos lab up in
namespaces (ExaBGP, FRR, BIRD), injects its fault, prints its figures and asserts its
checks. Durations are scaled down from the issue's minute-long runs (storm 10 s, hostile
traffic 8 s at 100 UPDATEs/s, load 8 s at 1,000 requests/s); `catsproto chaos --full` runs
the minute-long versions. The load's achieved rate is a figure of the machine: only the
minute-long run checks it; here every planned request must be answered without error.
Needs root: under CI=true these always run (and fail loudly without root); elsewhere,
without root, they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from catsproto.lab.faults import campaign

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="lab tests need root (network namespaces, FRR, BIRD)")


@pytest.mark.parametrize("name", list(campaign.SCENARIOS))
def test_scenario(name, tmp_path):
    result = campaign.run_one(name, tmp_path)
    print(json.dumps(result.to_json(), indent=1, default=str))
    print(campaign.table([result]))
    assert not result.error, result.error + "\n" + "\n".join(result.notes)
    assert result.checks, "a scenario must check something"
    assert result.passed, f"failed checks: {result.failed_checks()}; figures {result.figures}"


def test_table_format():
    ok = campaign.Result("crash", "instance crash", [("x", True)], "detection", 0.25, 0)
    bad = campaign.Result("hostile", "hostile peer", [("y", False)], rejected={"malformed": 3})
    text = campaign.table([ok, bad])
    assert "| 1 | instance crash | pass | detection 0.25 s | 0 | - |" in text
    assert "| 6 | hostile peer | FAIL (y) | - | - | malformed 3 |" in text


def test_a_plan_appears_whole_or_not_at_all(tmp_path):
    """The hostile speaker polls plans/*.json; a plan is written under a name that glob
    does not match and renamed into place (it once read a half-written plan and died)."""
    from catsproto.lab.faults.speaker import write_plan

    (tmp_path / "plans").mkdir()
    plan = {"rate": 100.0, "messages": [{"case": "x", "value": "00" * 5000}]}
    tmp = tmp_path / "plans" / ".000.json.tmp"
    tmp.write_text("{")  # a writer caught half way is invisible to the speaker's glob
    assert list((tmp_path / "plans").glob("*.json")) == []
    write_plan(tmp_path, "000.json", plan)
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["000.json"]
    assert json.loads((tmp_path / "plans" / "000.json").read_text()) == plan


def _chaos(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", "chaos", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _chaos_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("catsproto-chaos-*")}


def test_an_unwritable_json_file_is_refused_before_the_campaign():
    before = _chaos_dirs()
    out = _chaos("--only", "crash", "--json", "/nonexistent-dir/x.json", timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        "catsproto chaos: --json /nonexistent-dir/x.json: no folder /nonexistent-dir"
    )
    assert "chaos campaign" not in out.stdout  # nothing ran
    assert _chaos_dirs() <= before


def test_a_run_leaves_no_temporary_folder():
    before = _chaos_dirs()
    out = _chaos("--only", "crash")
    assert out.returncode in (0, 1), out.stderr
    assert "crash" in out.stdout
    assert _chaos_dirs() <= before, "the campaign's temporary folder was left behind"

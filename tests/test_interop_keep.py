"""`catsproto interop --keep` names each run folder it leaves behind, one `kept: PATH`
line on stderr per lab. No lab runs here (they need root): the reporter is called
directly, and the command line runs with the matrix itself replaced by stand-in runs."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from catsproto import cli
from lab.interop import matrix


def test_report_kept_writes_one_line_per_folder(tmp_path: Path) -> None:
    folders = [tmp_path / "catsproto-interop-x1fe-aaaa", tmp_path / "catsproto-interop-x1fn-b"]
    out = io.StringIO()
    matrix.report_kept(folders, out)
    assert out.getvalue() == "".join(f"kept: {f}\n" for f in folders)


def test_report_kept_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix.report_kept([tmp_path])
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"kept: {tmp_path}\n")


def _stand_in_runs(tmp_path: Path, calls: list[bool]):
    """A `run_matrix` that builds no lab: one run per transit, its folder made and kept
    when `keep` says so, as `run_lab` does."""

    def run_matrix(transits, extended, sizes, *, jobs, settle, keep):
        calls.append(keep)
        runs = []
        for transit in transits:
            folder = tmp_path / f"catsproto-interop-x1{transit[0]}e-abcd1234"
            folder.mkdir()
            runs.append(matrix.LabRun(transit, True, 0.1, {}, [], folder if keep else None))
        return runs

    return run_matrix


@pytest.mark.parametrize("keep", [True, False])
def test_interop_command_names_each_kept_folder(
    keep: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(matrix, "run_matrix", _stand_in_runs(tmp_path, calls))
    monkeypatch.setattr(matrix, "versions", lambda: {})
    monkeypatch.setattr(matrix.os, "geteuid", lambda: 0)
    argv = ["interop", "--transit", "frr", "--transit", "bird", "--extended", "on"]
    assert cli.main([*argv, "--keep"] if keep else argv) == 0
    out, err = capsys.readouterr()
    assert calls == [keep]
    assert "2 lab(s) in" in out and "kept:" not in out
    kept = [line for line in err.splitlines() if line.startswith("kept: ")]
    if keep:
        assert kept == [
            f"kept: {tmp_path / 'catsproto-interop-x1fe-abcd1234'}",
            f"kept: {tmp_path / 'catsproto-interop-x1be-abcd1234'}",
        ]
    else:
        assert kept == []

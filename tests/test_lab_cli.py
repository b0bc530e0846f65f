"""`catsproto lab capture`, `select` and Ctrl-C against real labs: a loopback lab (ExaBGP
speakers on 127.0.0.x, tcpdump on lo) and, for Ctrl-C, a namespace lab being built.

They need root (tcpdump, namespaces). Under CI=true they always run (and fail loudly
without root); elsewhere, without root, they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from catsproto import cli
from catsproto.adapters import netns
from catsproto.commands import lab as lab_command
from catsproto.lab import embedded, runner

LAB = Path(__file__).resolve().parent.parent / "lab"

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="lab tests need root (tcpdump, network namespaces)")


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """A fed loopback lab of cats4 (e2, e3, e4 speak to e1), under a root of its own."""
    root = tmp_path_factory.mktemp("loop")
    lab = embedded.up(LAB / "cats4.clab.yml", root, tag=f"l{os.getpid()}"[:8])
    try:
        runner.start_feeders(lab, 0.5)
        lab.wait_for(lambda: len({r["origin"] for r in lab.routes("e1")}) >= 6, 30, "6 origins")
        yield lab
    finally:
        runner.down(lab.run_dir)


def _lab_args(lab: runner.Lab) -> list[str]:
    return ["--root", str(lab.run_dir.parent), "--tag", lab.tag]


def test_capture_on_a_loopback_lab_takes_one_speakers_session(loop, tmp_path, capsys):
    """On loopback `lab capture` names a speaker (it ended in an IndexError): tcpdump on
    lo keeps that speaker's session with the receiver, and only it."""
    pcap = tmp_path / "e3.pcap"
    argv = ["lab", "capture", "e3", "-w", str(pcap), "--seconds", "2.5", *_lab_args(loop)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"wrote {pcap} ({pcap.stat().st_size} bytes, " in out
    assert cli.main(["inspect", str(pcap), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["advertisements"]
    e3 = loop.handle.state.info["addresses"]["e3"]
    assert found and all(f"{e3}:" in f["peer"] for f in found)  # e3's session, both ways
    origins = {f["advertisement"]["origin"]["address"][:8] for f in found}
    assert "10.103.0" in origins and not origins & {"10.102.0", "10.104.0"}
    assert cli.main(["lab", "capture", "c1-c3", "-w", str(pcap), *_lab_args(loop)]) == 2
    err = capsys.readouterr().err
    assert "a loopback lab has no links" in err and "e2, e3, e4" in err


def test_capture_reports_tcpdumps_failure_and_leaves_an_older_file_alone(loop, tmp_path, capsys):
    """A filter tcpdump refuses: its own message, one line, exit 2, and the file of that
    name keeps its old bytes (it used to say `wrote ... (N bytes)` of the old file, rc 0).
    A folder that does not exist is refused before tcpdump starts."""
    pcap = tmp_path / "old.pcap"
    pcap.write_bytes(b"old bytes")
    argv = ["lab", "capture", "e2", "-w", str(pcap), "--seconds", "5", *_lab_args(loop)]
    assert cli.main([*argv, "--filter", "bogus filter((("]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    assert err.startswith("catsproto lab: tcpdump failed (exit status 1): ")
    assert "syntax error" in err and "wrote" not in out
    assert pcap.read_bytes() == b"old bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.pcap"]  # no partial file
    missing = tmp_path / "nonexist" / "x.pcap"
    assert cli.main(["lab", "capture", "e2", "-w", str(missing), *_lab_args(loop)]) == 2
    err = capsys.readouterr().err
    assert err == f"catsproto lab: cannot write {missing}: {missing.parent} does not exist\n"


def test_select_finds_a_loopback_lab_where_lab_status_does_and_invents_no_transit(
    loop, tmp_path, monkeypatch, capsys
):
    """Without --root, select looks where lab status does (it looked only under the
    namespace labs' root); on loopback the path is the direct session, rtt 0."""
    monkeypatch.setattr(runner, "DEFAULT_ROOT", tmp_path / "no-namespace-labs")
    monkeypatch.setattr(lab_command, "LOOPBACK_ROOT", loop.run_dir.parent)
    assert cli.main(["select", "--lab", loop.tag, "--site", "3"]) == 0
    out = capsys.readouterr().out
    assert "path e1 > e3" in out and "rtt 0.0" in out
    for router in ("c1", "c2", "c3", "b4"):
        assert router not in out
    assert "warming up" in out and "reading rib.json" in out


def test_select_refuses_a_site_the_lab_has_not_and_install_on_loopback(loop, capsys):
    root = ["--root", str(loop.run_dir.parent)]
    assert cli.main(["select", "--lab", loop.tag, "--site", "9", *root]) == 2
    assert capsys.readouterr().err == (
        f"catsproto select: --site 9: lab {loop.tag} (cats4) has sites 1, 2, 3, 4\n"
    )
    assert cli.main(["select", "--lab", loop.tag, "--site", "2", "--install", *root]) == 2
    assert "runs on loopback" in capsys.readouterr().err


def test_select_times_the_decision_apart_from_start_up(loop, capsys):
    """The decision's own time is the selector's, warm; loading the kernels and reading
    rib.json are reported beside it (they made a decision look like 400-650 ms)."""
    root = ["--root", str(loop.run_dir.parent)]
    assert cli.main(["select", "--lab", loop.tag, "--site", "4", "--json", *root]) == 0
    doc = json.loads(capsys.readouterr().out)
    start_up = doc["start_up"]
    assert start_up["rib_routes"] >= 6 and start_up["rib_load_ms"] > 0
    assert start_up["warm_up_ms"] > 0
    assert 0 < doc["decision"]["decision_ms"] < 200


def _building(state: Path, stage: str) -> bool:
    """Whether `lab up` reached `stage`: its state file exists ("namespaces": the first
    is being made) or lists a daemon ("daemons": FRR's zebra started, the rest to come)."""
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):  # not there yet, or being replaced
        return False
    return stage == "namespaces" or bool(doc["processes"])


def test_an_interrupt_between_the_state_file_and_the_build_leaves_no_run_directory(
    tmp_path, monkeypatch
):
    """Ctrl-C after `up` wrote the run directory's state.json but before the build
    started (the test below sends it the moment state.json appears, and once landed
    there): the directory goes all the same. The interrupt is raised where it landed."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "Lab", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.up(LAB / "cats4.clab.yml", tmp_path, tag="iwindow")
    assert not (tmp_path / "iwindow").exists()
    assert netns.leftover_namespaces("iwindow") == []


@pytest.mark.parametrize("stage", ["namespaces", "daemons"])
def test_ctrl_c_while_lab_up_builds_is_one_line_exit_130_and_leaves_nothing(tmp_path, stage):
    """SIGINT while the lab is being built: `interrupted` on one line, exit 130, no
    traceback, and no run directory left to block the tag or show in lab status (it
    left state.json), no namespace, no process."""
    tag = f"i{os.getpid()}"[:7] + stage[0]
    argv = ["lab", "up", "cats4", "--root", str(tmp_path), "--tag", tag]
    proc = subprocess.Popen(
        [sys.executable, "-m", "catsproto", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    state = tmp_path / tag / netns.STATE_FILE
    deadline = time.monotonic() + 60
    try:
        while not _building(state, stage):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "lab up wrote no state.json"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err == "catsproto lab: interrupted\n"
    assert not (tmp_path / tag).exists()
    assert netns.leftover_namespaces(tag) == []
    daemons = subprocess.run(["pgrep", "-f", f"{tmp_path}/"], capture_output=True, text=True)
    assert daemons.stdout == "", daemons.stdout
    again = subprocess.run(
        [sys.executable, "-m", "catsproto", "lab", "status", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "no running lab" in again.stderr


def test_a_lab_that_fails_to_come_up_keeps_its_logs_but_not_the_tag(tmp_path, monkeypatch, capsys):
    """Not an interrupt but a failure (a daemon that does not start): the processes and
    namespaces go and state.json with them, so the tag is free and lab status lists
    nothing, but the logs that say why stay where the error line says."""
    tag = f"f{os.getpid()}"[:8]

    def failing_build(lab, *args):
        (lab.handle.run_dir / "s1.zebra.log").write_text("zebra: cannot bind\n")
        raise runner.LabError("timed out waiting for zebra on s1")

    monkeypatch.setattr(runner, "_build", failing_build)
    with pytest.raises(runner.LabError, match="zebra"):
        runner.up(lab_command.DEFAULT_TOPOLOGY, tmp_path, tag=tag)
    run_dir = tmp_path / tag
    assert (run_dir / "s1.zebra.log").read_text() == "zebra: cannot bind\n"
    assert not (run_dir / netns.STATE_FILE).exists()
    assert runner.running_labs(tmp_path) == []
    assert f"logs stay in {run_dir}" in capsys.readouterr().err
    assert netns.leftover_namespaces(tag) == []

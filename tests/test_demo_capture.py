"""Where the demo keeps its capture and trust file: never a folder another user could
have prepared (a guessable name in /tmp holding symlinks made a root demo write through
them), and a missing tcpdump is a usage error. No lab needed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from catsproto.commands import UsageError
from catsproto.commands import lab as lab_command


def test_the_default_folder_is_new_and_private_each_run(monkeypatch, tmp_path):
    monkeypatch.setattr(lab_command.tempfile, "tempdir", str(tmp_path))
    first = lab_command._capture_folder(None, "c42")
    second = lab_command._capture_folder(None, "c42")
    assert first != second and first.parent == second.parent == tmp_path
    assert first.name.startswith("catsproto-demo-c42-")
    assert stat.S_IMODE(first.stat().st_mode) == 0o700 and list(first.iterdir()) == []


def test_a_named_folder_must_be_a_real_one_of_ours(tmp_path):
    made = lab_command._capture_folder(str(tmp_path / "new" / "keep"), "c1")
    assert made.is_dir() and made == (tmp_path / "new" / "keep").resolve()
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(UsageError, match="symbolic link"):
        lab_command._capture_folder(str(link), "c1")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")  # root's, not ours
    with pytest.raises(UsageError, match="belongs to another user"):
        lab_command._capture_folder(str(theirs), "c1")


class _Stopped:
    """A finished capture: what `DemoCapture.finish` asks of its tcpdump."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def stop(self) -> int:
        return 3


def test_the_trust_file_replaces_a_link_left_in_the_folder_never_its_target(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("ORIGINAL")
    (keep / "trust.json").symlink_to(victim)
    source = tmp_path / "trust-src.json"
    source.write_text('{"operators": []}')
    capture = lab_command.DemoCapture(_Stopped(keep / "e1-bgp.pcap"), source, keep)  # type: ignore[arg-type]
    capture.finish()
    assert victim.read_text() == "ORIGINAL"
    kept = keep / "trust.json"
    assert not kept.is_symlink() and kept.read_text() == '{"operators": []}'
    assert "3 packets of the BGP sessions kept in" in capsys.readouterr().out
    assert sorted(p.name for p in keep.iterdir()) == ["trust.json"]


def test_a_missing_tcpdump_is_a_usage_error_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="cannot run tcpdump"):
        lab_command.Tcpdump(tmp_path / "x.pcap", "lo", "tcp port 179")


def test_a_sealed_demo_keeps_the_group_key_private_beside_the_capture(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    trust, key = tmp_path / "trust-src.json", tmp_path / "group-src.key"
    trust.write_text('{"operators": []}')
    key.write_text('{"format": "catsproto-group-key/1"}')
    victim = tmp_path / "victim"
    victim.write_text("ORIGINAL")
    (keep / "group.key").symlink_to(victim)
    capture = lab_command.DemoCapture(_Stopped(keep / "e1-bgp.pcap"), trust, keep, key)  # type: ignore[arg-type]
    capture.finish()
    kept = keep / "group.key"
    assert victim.read_text() == "ORIGINAL" and not kept.is_symlink()
    assert kept.read_text() == key.read_text() and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE((keep / "trust.json").stat().st_mode) == 0o644
    out = capsys.readouterr().out
    assert f"--group-key {kept}" in out and "sealed" in out
    assert sorted(p.name for p in keep.iterdir()) == ["group.key", "trust.json"]

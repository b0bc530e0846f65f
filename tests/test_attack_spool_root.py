"""Issue #41 rows 2 and 3, the part that needs root: a spool folder, or a route file in it,
that belongs to another user is refused (the owner of the folder decides what is
announced; a file of another user is never read). Root gives the folder or file away
with chown; the lab tests run as root, and so must these."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from catsproto.adapters import exabgp_announce as ann
from catsproto.adapters.file_modes import FileModeError
from tests.test_attack_spool import HOST, announced, spool_dir


def test_a_spool_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to give the folder away (the lab tests run as root)")
    d = spool_dir(tmp_path)
    os.chown(d, 65534, 65534)
    with pytest.raises(FileModeError) as caught:
        ann.Spool(d)
    assert f"spool folder {d} belongs to uid 65534" in str(caught.value)


def test_the_announcer_reads_no_file_of_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to give the file away (the lab tests run as root)")
    d = spool_dir(tmp_path)
    spool = ann.Spool(d)
    spool.publish(HOST, b"\x01")
    foreign = d / "10.1.0.12_32"
    foreign.write_bytes(b"\x02")
    os.chown(foreign, 65534, 65534)
    assert announced(spool) == [ann.announce_command(HOST, b"\x01")]
    assert "belongs to uid 65534" in spool.refused["10.1.0.12_32"]

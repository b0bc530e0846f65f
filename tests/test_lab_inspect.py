"""`catsproto inspect` on a capture of the 4-site lab: every advertisement verified; a
forged one (a byte changed in a capture) flagged with its reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from catsproto import cli
from catsproto.adapters import netns
from catsproto.lab import runner
from tests.lab_helpers import inspect_rows

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytest.skip("the lab needs root for namespaces (CI runs it as root)", allow_module_level=True)

LAB = Path(__file__).resolve().parent.parent / "lab"


def test_capture_of_the_4_site_lab_is_verified_and_a_forgery_is_flagged(tmp_path, capsys):
    tag = f"i{os.getpid()}"
    lab = runner.up(
        LAB / "cats4.clab.yml", tmp_path / "labs", tag=tag, feed=True, feed_interval=1.0
    )
    try:
        pcap = tmp_path / "c1-e1.pcap"
        lab.wait_for(lambda: len(lab.routes("e1")) >= 8, 30, "routes at e1")
        args = [
            "lab",
            "capture",
            "c1-e1",
            "-w",
            str(pcap),
            "--seconds",
            "4",
            "--root",
            str(tmp_path / "labs"),
            "--tag",
            tag,
        ]
        assert cli.main(args) == 0
        trust = str(lab.node_dir("e1") / "trust.json")
    finally:
        lab.down()
        assert netns.leftover_namespaces(tag) == []

    rows = inspect_rows(capsys, str(pcap), "--trust", trust)
    origins = {r["advertisement"]["origin"]["address"] for r in rows if "advertisement" in r}
    assert len(origins) >= 6, origins  # instances of every site cross c1-e1 in 4 s
    assert rows and all(r["status"] == "verified" for r in rows), {r["status"] for r in rows}

    # Forge: change one byte inside the first advertisement's timestamp in the file.
    victim = rows[0]["advertisement"]["timestamp"].to_bytes(8, "big")
    raw = bytearray(pcap.read_bytes())
    at = raw.index(victim)
    raw[at + 7] ^= 0x01
    forged = tmp_path / "forged.pcap"
    forged.write_bytes(bytes(raw))
    after = inspect_rows(capsys, str(forged), "--trust", trust)
    bad = [r for r in after if r["status"] != "verified"]
    assert len(bad) == 1 and bad[0]["status"] == "bad-signature", bad
    assert len(after) == len(rows)

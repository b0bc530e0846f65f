"""A sealed 4-site lab (`lab up --seal`): every instance seals its cache section under the
lab's group key, FRR and BIRD pass the ciphertext on, e1's receiver verifies and opens
it, and a capture on the way shows only ciphertext unless `inspect` is given the key.
The same capture checks `inspect` itself: every advertisement verified, and a forged
one (a byte changed in the file) flagged with its reason. (The unsealed lab's capture
is inspected by the demo's test, exactly as the demo prints the command.)"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from catsproto import cli
from catsproto.adapters import netns
from catsproto.lab import runner
from catsproto.lab.instances import lab_group_keys
from catsproto.lab.steering import rib_from_receiver
from catsproto.lab.topology import load
from tests.lab_helpers import inspect_rows

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytest.skip("the lab needs root for namespaces (CI runs it as root)", allow_module_level=True)

LAB = Path(__file__).resolve().parent.parent / "lab"


def _opened(lab: runner.Lab) -> list[dict]:
    return [r for r in lab.rib("e1").get("routes", []) if "opened_value" in r]


def test_a_sealed_lab_carries_ciphertext_that_only_the_receiver_opens(tmp_path, capsys):
    tag = f"s{os.getpid()}"
    lab = runner.up(
        LAB / "cats4.clab.yml", tmp_path / "labs", tag=tag, feed=True, feed_interval=1.0, seal=True
    )
    try:
        assert lab.sealed
        lab.wait_for(lambda: len(_opened(lab)) >= 8, 45, "opened routes at e1")
        key = lab.node_dir("e1") / "group.key"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        rib_file = lab.rib_file("e1")
        assert stat.S_IMODE(rib_file.stat().st_mode) == 0o600  # it holds cache state now
        snapshot = lab.rib("e1")
        assert snapshot["counters"]["sealed_opened"] > 0
        assert snapshot["counters"]["unheld_group_key"] == 0
        assert all(r["verified"] for r in snapshot["routes"])
        # the selector beside the receiver sees the cache: site 3's demo conversation
        rib = rib_from_receiver(snapshot, lab_now_ms(snapshot))
        holders = {str(i.address) for i in rib.services[100].live() if i.tiers}
        assert holders, "no instance with cache state in the opened RIB"
        pcap = tmp_path / "c1-e1.pcap"
        args = ["lab", "capture", "c1-e1", "-w", str(pcap), "--seconds", "4"]
        args += ["--root", str(tmp_path / "labs"), "--tag", tag]
        assert cli.main(args) == 0
        trust = str(lab.node_dir("e1") / "trust.json")
        group_key = tmp_path / "group.key"
        group_key.write_bytes(key.read_bytes())
        group_key.chmod(0o600)  # a group key file others may read is refused
    finally:
        lab.down()
        assert netns.leftover_namespaces(tag) == []

    every = inspect_rows(capsys, str(pcap), "--trust", trust)
    rows = [r for r in every if "advertisement" in r]
    assert rows and all(r["status"] == "verified" for r in rows), {r["status"] for r in rows}
    origins = {r["advertisement"]["origin"]["address"] for r in rows}
    assert len(origins) >= 6, origins  # instances of every site cross c1-e1 in 4 s
    on_wire = [r["advertisement"] for r in rows]
    assert all("cache-summaries" not in a and "cache-model" not in a for a in on_wire)
    assert sum("sealed-cache" in a for a in on_wire) >= len(on_wire) // 2
    opened = [
        r["advertisement"]
        for r in inspect_rows(capsys, str(pcap), "--trust", trust, "--group-key", str(group_key))
        if "advertisement" in r
    ]
    assert len(opened) == len(rows)
    assert any("cache-summaries" in a for a in opened)
    assert all("sealed-cache" not in a for a in opened)
    # Forge: change one byte inside the first advertisement's timestamp in the file.
    victim = rows[0]["advertisement"]["timestamp"].to_bytes(8, "big")
    raw = bytearray(pcap.read_bytes())
    raw[raw.index(victim) + 7] ^= 0x01
    forged = tmp_path / "forged.pcap"
    forged.write_bytes(bytes(raw))
    after = inspect_rows(capsys, str(forged), "--trust", trust)
    bad = [r for r in after if r["status"] != "verified"]
    assert len(bad) == 1 and bad[0]["status"] == "bad-signature", bad
    assert len(after) == len(every)
    # the key e1 was given is the one derived from the topology
    derived = lab_group_keys(load(LAB / "cats4.clab.yml")).active.to_json()
    assert json.loads(group_key.read_text()) == derived


def lab_now_ms(snapshot: dict) -> int:
    """The newest timestamp in the receiver's RIB (what 'now' was when it was written)."""
    return max(int(r["timestamp_ms"]) for r in snapshot["routes"])

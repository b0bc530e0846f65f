"""The receive daemon with a group key (`--group-key`): verified sealed cache sections
under a held key are opened and handed on as `opened_value` in rib.json; one under a key
it does not hold is accepted with its metrics, unopened and counted; its files are
written for the owner only."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.adapters.steering import Forwarder, SteeringService
from catsproto.lab import instances, view
from catsproto.lab.steering import rib_from_receiver
from catsproto.lab.topology import load
from catsproto.security import GroupKey, GroupKeyring
from catsproto.security.vectors import NLRI, NOW_MS, fixture, seed
from tests.lab_helpers import CATS4
from tests.test_robust_receiver import _announce, trust_for_now
from tests.test_steering import NEXT_HOPS, _config, _rib_json

F = fixture()  # group key 7
OTHER = GroupKeyring(GroupKey.of(8, seed("group-8")))


def _announced(value: bytes) -> rx.Announced:
    return rx.Announced(
        peer="192.0.2.1",
        prefix=NLRI,
        value=value,
        flags=wire.FLAG_OPTIONAL | wire.FLAG_TRANSITIVE,
    )


def _rib(tmp_path, group_keys) -> rx.CacheRib:
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    verifier = rx.TrustFileVerifier(trust, clock=lambda: NOW_MS / 1000, group_keys=group_keys)
    return rx.CacheRib(verifier=verifier)


def _sealed(seq: int, keyring: GroupKeyring = F.group) -> bytes:
    adv = security.seal(F.at(1, seq), keyring, bytes(12))
    return wire.encode(security.sign(adv, F.node, NLRI))


def test_a_section_under_a_held_key_is_opened_and_handed_on(tmp_path):
    rib = _rib(tmp_path, F.group)
    (change,) = rib.apply(_announced(_sealed(43)), now=1.0)
    assert change.kind == "accept" and change.entry.verified
    assert change.reason == "sealed cache section opened"
    opened = wire.decode(change.entry.opened_value)
    assert opened.cache_summaries == F.at(1, 43).cache_summaries
    assert opened.get(wire.SealedCache) is None
    assert opened.signature.key_id == F.node.key_id  # the signer it verified, kept
    assert opened.metrics_l0 == F.at(1, 43).metrics_l0
    assert change.entry.advertisement.get(wire.SealedCache) is not None  # as received
    route = rib.to_json()["routes"][0]
    assert route["opened_value"] == change.entry.opened_value.hex()
    assert route["value"] == _sealed(43).hex()
    assert rib.counters["sealed_opened"] == 1 and rib.counters["unheld_group_key"] == 0
    (again,) = rib.apply(_announced(_sealed(43)), now=2.0)  # BGP re-sends it
    assert again.unchanged and "opened_value" not in again.to_json()["entry"]


def test_a_section_under_a_key_not_held_is_accepted_unopened_and_counted(tmp_path):
    rib = _rib(tmp_path, F.group)
    (change,) = rib.apply(_announced(_sealed(43, OTHER)), now=1.0)
    assert change.kind == "accept" and change.entry.verified
    assert change.reason == "sealed cache section not opened: group key 8 is not held"
    assert change.entry.opened_value is None
    assert "opened_value" not in rib.to_json()["routes"][0]
    assert rib.counters["unheld_group_key"] == 1 and rib.counters["sealed_opened"] == 0
    assert rib.counters["not_verified"] == 0


def test_without_a_group_key_nothing_is_opened(tmp_path):
    rib = _rib(tmp_path, None)
    (change,) = rib.apply(_announced(_sealed(43)), now=1.0)
    assert change.kind == "accept" and change.reason == "" and change.entry.opened_value is None
    assert rib.counters["sealed_opened"] == rib.counters["unheld_group_key"] == 0


def test_a_clear_value_has_no_opened_value(tmp_path):
    rib = _rib(tmp_path, F.group)
    value = wire.encode(security.sign(F.at(1, 43), F.node, NLRI))
    (change,) = rib.apply(_announced(value), now=1.0)
    assert change.kind == "accept" and change.entry.opened_value is None
    assert rib.counters["sealed_opened"] == 0


@pytest.mark.parametrize("private", [True, False])
def test_the_files_are_the_owners_alone_when_private(tmp_path, private):
    old = os.umask(0)
    try:
        sink = rx.FileSink(tmp_path, rx.CacheRib(), private=private)
        sink(rx.Change("session", "192.0.2.1", reason="up"))
        sink.events.close()
    finally:
        os.umask(old)
    for name in ("rib.json", "events.jsonl"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == (0o600 if private else 0o666), name


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto.adapters.exabgp_receive", *argv],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_group_key_arguments_are_refused(tmp_path):
    key = tmp_path / "group.key"
    key.write_text(json.dumps(F.group.active.to_json()))
    key.chmod(0o600)  # a group key file others may read is refused
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    not_a_key = tmp_path / "not-a-key.json"  # private, so refused for what it holds
    not_a_key.write_text(json.dumps(F.trust.to_json()))
    not_a_key.chmod(0o600)
    out = str(tmp_path / "out")
    cases = [
        (["--group-key", str(key)], "needs --trust or --trust-when-present"),
        (["--trust", str(trust), "--group-key", str(tmp_path / "none")], "cannot read it"),
        (["--trust", str(trust), "--group-key", str(not_a_key)], "not a group key file"),
        (["--trust", str(trust)] + ["--group-key", str(key)] * 3, "one or two group keys"),
        (["--trust", str(trust)] + ["--group-key", str(key)] * 2, "share id 7"),
    ]
    for extra, message in cases:
        done = _run("--out", out, *extra)
        assert done.returncode == 2 and message in done.stderr, (extra, done.stderr)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_process_opens_a_sealed_value_and_writes_it_privately(tmp_path):
    """As ExaBGP runs it: a trust file, a group key file, one sealed UPDATE on stdin."""
    now = int(time.time() * 1000)  # the process reads its own clock: sign for now
    trust, key, out = tmp_path / "trust.json", tmp_path / "group.key", tmp_path / "out"
    trust.write_text(json.dumps(trust_for_now(now).to_json()))
    key.write_text(json.dumps(F.group.active.to_json()))
    key.chmod(0o600)  # a group key file others may read is refused
    adv = security.seal(F.base.replace(wire.Timestamp(now)), F.group, bytes(12))
    value = wire.encode(security.sign(adv, F.node, NLRI))
    argv = ["--out", str(out), "--trust", str(trust), "--group-key", str(key)]
    proc = subprocess.run(
        [sys.executable, "-m", "catsproto.adapters.exabgp_receive", *argv],
        input=_announce(value) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    snapshot = json.loads((out / "rib.json").read_text())
    (route,) = snapshot["routes"]
    assert route["verified"] is True
    opened = wire.decode(bytes.fromhex(route["opened_value"]))
    assert opened.cache_summaries == F.base.cache_summaries
    assert snapshot["counters"]["sealed_opened"] == 1
    for name in ("rib.json", "events.jsonl"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name


def _sealed_rib_json(now_ms: int, opened: bool) -> dict:
    """The steering tests' receiver RIB with every value's cache section sealed under
    group key 7, as the receiver writes it with (`opened`) or without the key."""
    doc = _rib_json(now_ms)
    for route in doc["routes"]:
        clear = bytes.fromhex(route["value"])
        adv = wire.decode(clear)
        if adv.cache_summaries is None and adv.get(wire.Capacity) is None:
            continue  # nothing to seal on this route
        sealed = security.seal(adv.without(wire.TLVType.SIGNATURE), F.group, bytes(12))
        route["value"] = wire.encode(sealed).hex()  # unsigned: the daemon does not verify
        if opened:
            route["opened_value"] = clear.hex()
    return doc


@pytest.mark.parametrize("opened", [True, False], ids=["opened", "sealed"])
def test_the_steering_daemon_reads_the_opened_value(tmp_path, opened):
    """With opened values the cached remote site wins as in the clear; with the values
    still sealed the daemon sees metrics only and credits no cache."""
    rib_file = tmp_path / "rib.json"
    rib_file.write_text(json.dumps(_sealed_rib_json(int(time.time() * 1000), opened)))
    service = SteeringService(_config(str(rib_file)), Forwarder(NEXT_HOPS, dry_run=True))
    answer = service.decide({"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)})
    if opened:
        assert answer["instance"] == "10.103.0.11" and answer["chosen"]["cached_blocks"] == 24
    else:
        assert answer["chosen"]["cached_blocks"] == 0


def test_the_lab_selector_reads_the_opened_value():
    now = int(time.time() * 1000)
    for opened, cached in ((True, 24), (False, 0)):
        rib = rib_from_receiver(_sealed_rib_json(now, opened), now)
        claims = {
            str(i.address): sum(len(t.shards) for t in i.tiers.values())
            for i in rib.services[100].live()
        }
        assert (claims["10.103.0.11"] > 0) == bool(cached), claims


def test_lab_status_counts_the_blocks_of_the_opened_value():
    topo = load(CATS4)
    clear = wire.encode(F.at(1, 43))
    value = wire.encode(security.seal(F.at(1, 43), F.group, bytes(12)))
    route = {"origin": "192.0.2.11", "site_id": 1, "sequence": 43, "bytes": len(value)}
    route |= {"peer": "10.0.11.2", "as_path": [65001], "verified": True, "value": value.hex()}
    blocks = sum(e.entry_count for e in F.at(1, 43).cache_summaries.entries)
    assert blocks > 0
    (sealed_row,) = view.origin_rows({"routes": [route]}, topo)
    (opened_row,) = view.origin_rows({"routes": [{**route, "opened_value": clear.hex()}]}, topo)
    assert sealed_row[5] == "0" and opened_row[5] == str(blocks)

"""Lab tests with real daemons: ExaBGP speakers, FRR and BIRD transits, in namespaces.

They need root (namespaces, FRR). Under CI=true they always run (and fail loudly
without root); elsewhere, without root, they are skipped with the reason.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from catsproto import examples, security, wire
from catsproto.adapters import netns
from catsproto.adapters.exabgp_announce import value_budget
from catsproto.lab import runner
from catsproto.lab.instances import instance_routes
from catsproto.summary import Summary
from tests.waits import wait_until

LAB = Path(__file__).resolve().parent.parent / "lab"

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="lab tests need root (network namespaces, FRR, BIRD)")


def _adv(address: str, seq: int, *, site: int = 1, score: int = 5) -> bytes:
    return wire.encode(
        wire.Advertisement.build(
            wire.Version(1),
            wire.Origin(100, site, ipaddress.ip_address(address)),
            wire.Sequence(epoch=1, sequence=seq),
            wire.Timestamp(examples.T0_MS + seq),
            wire.MetricsL2(score),
        )
    )


def _route(lab: runner.Lab, node: str, prefix: str) -> dict | None:
    return next((r for r in lab.routes(node) if r["prefix"] == prefix), None)


def _seen(lab: runner.Lab, node: str, prefix: str) -> str:
    """What `node`'s RIB holds for `prefix` now, and its sessions (for a timeout's message)."""
    route = _route(lab, node, prefix)
    held = "nothing" if route is None else f"value {route['value'][:48]}..."
    return f"{prefix} at {node}: {held}; sessions {lab.sessions()}"


def _wait_value(lab: runner.Lab, node: str, prefix: str, value: bytes, timeout: float = 20):
    return wait_until(
        f"{prefix} with the new value at {node}",
        lambda: (r := _route(lab, node, prefix)) and r["value"] == value.hex() and r,
        timeout,
        every=0.02,
        seen=lambda: _seen(lab, node, prefix),
    )


def _wait_gone(lab: runner.Lab, node: str, prefix: str, timeout: float = 20) -> None:
    wait_until(
        f"{prefix} gone at {node}",
        lambda: _route(lab, node, prefix) is None,
        timeout,
        every=0.02,
        seen=lambda: _seen(lab, node, prefix),
    )


@pytest.fixture(scope="module")
def lab3(tmp_path_factory):
    # not netns.lab_tag() (c<pid>): the CLI test below brings up a lab under that tag
    tag = f"t{os.getpid()}"
    lab = runner.up(LAB / "cats3.clab.yml", tmp_path_factory.mktemp("lab3"), tag=tag)
    try:
        yield lab
    finally:
        lab.down()
        assert netns.leftover_namespaces(lab.tag) == []


@pytest.fixture(scope="module")
def lab4(tmp_path_factory):
    tag = f"d{os.getpid()}"  # both labs may exist at once: a different tag
    lab = runner.up(LAB / "cats4.clab.yml", tmp_path_factory.mktemp("lab4"), tag=tag)
    try:
        yield lab
    finally:
        lab.down()
        assert netns.leftover_namespaces(lab.tag) == []


# ---- 3 nodes: spk (ExaBGP) -> t1 (FRR) -> rcv (ExaBGP), extended messages off ------------


def test_change_at_instance_reaches_receiver(lab3):
    spool = lab3.spool("spk")
    first, second = _adv("10.101.0.11", 1), _adv("10.101.0.11", 2, score=9)
    spool.publish("10.101.0.11/32", first)
    got = _wait_value(lab3, "rcv", "10.101.0.11/32", first)
    assert got["sequence"] == 1 and got["as_path"] == [65100, 65001]
    assert int(got["flags"], 16) & wire.FLAG_PARTIAL  # FRR set Partial on re-advertising
    spool.publish("10.101.0.11/32", second)
    got = _wait_value(lab3, "rcv", "10.101.0.11/32", second)
    assert got["sequence"] == 2
    assert wire.decode(bytes.fromhex(got["value"])).metrics_l2 == wire.MetricsL2(9)
    spool.withdraw("10.101.0.11/32")
    _wait_gone(lab3, "rcv", "10.101.0.11/32")


def test_stopped_instance_disappears(lab3):
    node = lab3.topology.nodes["spk"]
    proc = lab3.handle.start(
        "spk",
        "instances-test",
        [
            sys.executable,
            "-m",
            "catsproto.lab.instances",
            "--topology",
            lab3.path,
            "--node",
            "spk",
            "--spool",
            str(lab3.node_dir("spk") / "spool"),
            "--interval",
            "0.5",
            "--max-message",
            "4096",
        ],
    )
    origins = {str(i.address) for i in node.instances}
    try:
        lab3.wait_for(
            lambda: {r["origin"] for r in lab3.routes("rcv")} >= origins, 20, "both instances"
        )
        # a main route can land before its shard routes (separate UPDATEs): wait for them
        lab3.wait_for(
            lambda: any(r["prefix"].startswith("10.201.") for r in lab3.routes("rcv")),
            20,
            "each instance announces shard routes from its own range",
        )
    finally:
        lab3.handle.stop(proc)  # SIGTERM: the instance stops and withdraws its routes
    lab3.wait_for(
        lambda: not ({r["origin"] for r in lab3.routes("rcv")} & origins), 20, "instances gone"
    )


def test_malformed_attribute_withdraws_only_that_origin(lab3):
    spool = lab3.spool("spk")
    good_a, good_b = _adv("10.101.0.21", 1), _adv("10.101.0.22", 1)
    spool.publish("10.101.0.21/32", good_a)
    spool.publish("10.101.0.22/32", good_b)
    _wait_value(lab3, "rcv", "10.101.0.21/32", good_a)
    _wait_value(lab3, "rcv", "10.101.0.22/32", good_b)
    downs_before = [e for e in lab3.events("rcv") if e.get("reason") == "down"]
    broken = bytearray(good_a)
    broken[3] += 1  # version TLV length one too long: the value no longer decodes
    with pytest.raises(wire.CodecError):
        wire.decode(bytes(broken))
    spool.publish("10.101.0.21/32", bytes(broken))
    _wait_gone(lab3, "rcv", "10.101.0.21/32")
    refused = [e for e in lab3.events("rcv") if e["kind"] == "treat-as-withdraw"]
    assert refused and refused[-1]["prefix"] == "10.101.0.21/32"
    assert refused[-1]["entry"]["origin"] == "10.101.0.21"  # the state it withdrew
    assert _route(lab3, "rcv", "10.101.0.22/32")["value"] == good_b.hex()  # untouched
    # the origin recovers with its next good advertisement on the same session: the
    # UPDATE after the bad one came through, so a reset the bad one caused would show
    spool.publish("10.101.0.21/32", _adv("10.101.0.21", 2))
    _wait_value(lab3, "rcv", "10.101.0.21/32", _adv("10.101.0.21", 2))
    sessions = lab3.sessions()
    assert set(sessions["t1"].values()) == {"Established"}
    assert sessions["rcv"] == {"10.0.23.1": "up"}
    assert [e for e in lab3.events("rcv") if e.get("reason") == "down"] == downs_before
    spool.withdraw("10.101.0.21/32")
    spool.withdraw("10.101.0.22/32")


def test_oversized_value_is_refused_before_exabgp(lab3):
    spool = lab3.spool("spk")
    big = wire.encode(examples.large_advertisement(5000))
    prefix = ipaddress.ip_network("10.101.0.31/32")
    assert len(big) > value_budget(prefix, 4096)
    spool.publish(prefix, big)
    marker = _adv("10.101.0.32", 1)
    spool.publish("10.101.0.32/32", marker)  # announced in the same pass, after the big one
    # announced after the big one on the same session: the big one would be in already
    _wait_value(lab3, "rcv", "10.101.0.32/32", marker)
    assert _route(lab3, "rcv", "10.101.0.31/32") is None
    log = Path(lab3.run_dir / "spk.exabgp.log").read_text()
    assert "refused: 10.101.0.31/32" in log
    spool.withdraw(prefix)
    spool.withdraw("10.101.0.32/32")


def test_summary_larger_than_one_update_arrives_whole_by_sharding(lab3):
    spec = lab3.topology.nodes["spk"].instances[1]
    keys = np.unique(np.random.default_rng(7).integers(0, 2**64 - 1, 6000, dtype=np.uint64))
    whole = Summary.build(keys, 0.01)
    assert whole.size() > 4096  # one UPDATE could not carry it
    routes = instance_routes(spec, keys, sequence=1, now_ms=examples.T0_MS, max_message=4096)
    shards = {p: v for p, v in routes.items() if p != spec.csci}
    assert len(shards) >= 2
    for prefix, value in routes.items():
        assert len(value) <= value_budget(prefix, 4096)
        lab3.spool("spk").publish(prefix, value)
    for prefix, value in routes.items():
        _wait_value(lab3, "rcv", str(prefix), value, timeout=30)
    # reassemble: every key is in the summary of the shard whose range holds it
    found = np.zeros(keys.size, dtype=bool)
    for prefix in shards:
        adv = wire.decode(bytes.fromhex(_route(lab3, "rcv", str(prefix))["value"]))
        (entry,) = adv.cache_summaries.entries
        mine = (keys >= np.uint64(entry.key_lo)) & (keys <= np.uint64(entry.key_hi))
        summary = Summary.decode(entry.kind, entry.params, entry.body)
        assert summary.contains_many(keys[mine]).all()
        found |= mine
    assert found.all()
    for prefix in routes:
        lab3.spool("spk").withdraw(prefix)
    for prefix in routes:
        _wait_gone(lab3, "rcv", str(prefix))


# ---- 4 sites: FRR core, BIRD at site 4, selector at e1 ----------------------------------


def _trust(lab: runner.Lab, node: str, signer: security.SigningKey, routes: str) -> None:
    """An operator authorises `signer` for `routes`; the receiver at `node` trusts it."""
    operator = security.SigningKey.from_seed(bytes(range(32)))
    now = int(time.time() * 1000)
    delegation = security.authorise(
        operator,
        signer.public.raw,
        cs_ids=[100],
        routes=[routes],
        addresses=[routes],
        not_before_ms=now - 60_000,
        not_after_ms=now + 3_600_000,
    )
    store = (
        security.TrustStore().with_operator(operator.public.raw, "lab").with_delegation(delegation)
    )
    (lab.node_dir(node) / "trust.json").write_text(json.dumps(store.to_json()))


def test_advertisement_crosses_bird_and_frr_byte_identical_and_verified(lab4):
    signer = security.SigningKey.from_seed(bytes([7]) * 32)
    _trust(lab4, "e1", signer, "10.104.0.0/16")
    prefix = ipaddress.ip_network("10.104.0.11/32")
    adv = examples.examples()[3].advertisement.replace(  # extended length, three tiers
        wire.Origin(100, 4, prefix.network_address), wire.Timestamp(int(time.time() * 1000))
    )
    value = wire.encode(security.sign(adv, signer, prefix))
    lab4.spool("e4").publish(prefix, value)
    got = _wait_value(lab4, "e1", str(prefix), value, timeout=30)
    # e4 (65004) -> b4 BIRD (65204) -> c3 FRR (65103) -> c1 FRR (65101) -> e1
    assert got["as_path"] == [65101, 65103, 65204, 65004]
    assert got["value"] == value.hex() and got["verified"] is True
    assert "10.104.0.11/32" in lab4.birdc("b4", "show route")
    assert "10.104.0.11/32" in lab4.vtysh("c3", "show bgp ipv4 unicast")
    # the same signed bytes moved to another route do not verify: treat-as-withdraw
    lab4.spool("e4").publish("10.104.0.12/32", value)
    lab4.wait_for(
        lambda: any(
            e["kind"] == "treat-as-withdraw" and e["prefix"] == "10.104.0.12/32"
            for e in lab4.events("e1")
        ),
        30,
        "refusal of the moved advertisement",
    )
    assert _route(lab4, "e1", "10.104.0.12/32") is None
    assert _route(lab4, "e1", str(prefix))["verified"] is True
    for p in (prefix, "10.104.0.12/32"):
        lab4.spool("e4").withdraw(p)
    _wait_gone(lab4, "e1", str(prefix))
    (lab4.node_dir("e1") / "trust.json").unlink()


def test_every_instance_of_every_site_reaches_the_selector(lab4):
    expected = {}
    for name, node in lab4.topology.nodes.items():
        for seq, spec in enumerate(node.instances, 1):
            value = _adv(str(spec.address), seq, site=spec.site_id)
            lab4.spool(name).publish(spec.csci, value)
            expected[str(spec.csci)] = value.hex()
    assert len(expected) == 8
    lab4.wait_for(
        lambda: (
            {r["prefix"]: r["value"] for r in lab4.routes("e1") if r["prefix"] in expected}
            == expected
        ),
        30,
        "all eight instances at e1",
    )
    for name, node in lab4.topology.nodes.items():
        for spec in node.instances:
            lab4.spool(name).withdraw(spec.csci)


# ---- the CLI, end to end ---------------------------------------------------------------


def test_lab_cli_up_status_capture_down(tmp_path, capsys):
    from catsproto import cli

    root = ["--root", str(tmp_path)]
    assert cli.main(["lab", "up", "cats3", "--interval", "0.5", *root]) == 0
    tag = next(p.name for p in tmp_path.iterdir())
    try:
        lab = runner.attach(tmp_path / tag)
        lab.wait_for(lambda: len({r["origin"] for r in lab.routes("rcv")}) == 2, 30, "routes")
        capsys.readouterr()
        assert cli.main(["lab", "status", *root]) == 0
        status = capsys.readouterr().out
        assert "10.101.0.11" in status and "t1(frr)" in status and "yes" in status
        pcap = tmp_path / "spk-t1.pcap"
        assert (
            cli.main(["lab", "capture", "spk-t1", "-w", str(pcap), "--seconds", "1.5", *root]) == 0
        )
        assert pcap.stat().st_size > 200  # UPDATEs of the modelled instances
    finally:
        assert cli.main(["lab", "down", *root]) == 0
    assert netns.leftover_namespaces(tag) == []
    assert not any(netns.pid_alive(p.pid) for p in lab.handle.state.processes)

"""Route reflectors with real daemons: sites peer only with an FRR and a BIRD reflector.

`lab/catsrr.clab.yml`: four site egresses (ExaBGP, two instances each, every one also
a receiver) are iBGP route-reflector clients of rr1 (FRR) and rr2 (BIRD), with no
sessions among themselves. Every origin's signed attribute must reach every other
site through each reflector, byte for byte (flags apart from Partial), verified, with
ORIGINATOR_ID and CLUSTER_LIST showing the reflection; with either reflector killed,
the other still delivers. The lab tests need root; under CI=true they always run.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from catsproto import security, wire
from catsproto.adapters import netns
from catsproto.lab import configs, reflectors, runner, topology, view
from catsproto.lab.instances import instance_routes, lab_key, write_lab_trust

LAB = Path(__file__).resolve().parent.parent / "lab"
RR_FILE = LAB / "catsrr.clab.yml"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true",
    reason="lab tests need root (network namespaces, FRR, BIRD)",
)
FLAGS_WANTED = wire.FLAG_OPTIONAL | wire.FLAG_TRANSITIVE
FLAG_EXTENDED_LENGTH = 0x10  # whoever re-encodes may pick either length form


# ---- the topology and its configs (no root needed) --------------------------------------


def test_checked_in_file_is_what_the_generator_writes():
    doc = reflectors.reflector_topology(4, 2)
    assert RR_FILE.read_text() == reflectors.render(doc, file="catsrr.clab.yml")
    assert yaml.safe_load(RR_FILE.read_text()) == yaml.safe_load(reflectors.render(doc))


def test_sites_peer_only_with_the_reflectors_as_their_clients():
    t = topology.load(RR_FILE)
    sites = [n for n, node in t.nodes.items() if node.role == "exabgp"]
    assert len(sites) == 4
    for s in sites:
        peers = t.neighbors(s)
        assert sorted(nb.remote.node for nb in peers) == ["rr1", "rr2"]  # no full mesh
        assert all(nb.ibgp and not nb.rr_client for nb in peers)
    for rr, role in (("rr1", "frr"), ("rr2", "bird")):
        assert t.nodes[rr].role == role and t.nodes[rr].route_reflector
        assert sorted(nb.remote.node for nb in t.neighbors(rr)) == sorted(sites)
        assert all(nb.rr_client for nb in t.neighbors(rr))
    bgpd = configs.frr_bgpd_conf(t, "rr1")
    assert bgpd.count("route-reflector-client") == 4
    assert " bgp cluster-id 10.255.255.1" in bgpd
    assert "neighbor 10.1.0.5 remote-as 65000" in bgpd
    bird = configs.bird_conf(t, "rr2")
    assert bird.count("rr client;") == 4 and bird.count("direct;") == 4
    assert "rr cluster id 10.255.255.2;" in bird and "neighbor 10.2.0.5 as 65000;" in bird
    # eBGP topologies render as before: no reflector lines
    t4 = topology.load(LAB / "cats4.clab.yml")
    assert "route-reflector-client" not in configs.frr_bgpd_conf(t4, "c1")
    assert "rr client" not in configs.bird_conf(t4, "b4")


def test_reflectors_can_send_nothing_to_sites_that_only_announce():
    doc = reflectors.reflector_topology(3, 1, receivers=1, reflect_to="receivers")
    t = topology.from_dict(doc)
    assert [nb.export_none for nb in t.neighbors("rr1")] == [False, True, True]
    bgpd = configs.frr_bgpd_conf(t, "rr1")
    assert "neighbor 10.1.0.5 route-map CATS-SEND-NONE out" not in bgpd
    assert "neighbor 10.1.0.9 route-map CATS-SEND-NONE out" in bgpd
    assert "route-map CATS-SEND-NONE deny 10" in bgpd
    bird = configs.bird_conf(t, "rr2")
    assert bird.count("import all; export none;") == 2
    assert bird.count("import all; export all;") == 1
    assert "CATS-SEND-NONE" not in configs.frr_bgpd_conf(topology.load(RR_FILE), "rr1")
    doc["topology"]["nodes"]["rr1"]["labels"]["catsproto.reflect-to"] = "some"
    with pytest.raises(topology.TopologyError, match="reflect-to 'some'"):
        topology.from_dict(doc)


def test_same_as_sessions_need_a_reflector():
    doc = yaml.safe_load(RR_FILE.read_text())
    doc["topology"]["nodes"]["rr2"]["labels"]["catsproto.route-reflector"] = "false"
    with pytest.raises(topology.TopologyError, match="share AS 65000"):
        topology.from_dict(doc)
    doc = yaml.safe_load(RR_FILE.read_text())
    doc["topology"]["nodes"]["s1"]["labels"]["catsproto.route-reflector"] = "true"
    with pytest.raises(topology.TopologyError, match="only frr or bird"):
        topology.from_dict(doc)
    doc = yaml.safe_load(RR_FILE.read_text())
    doc["topology"]["nodes"]["rr1"]["labels"]["catsproto.cluster-id"] = "cluster-a"
    with pytest.raises(topology.TopologyError, match="cluster-id 'cluster-a'"):
        topology.from_dict(doc)
    with pytest.raises(ValueError, match="sites must be"):
        reflectors.reflector_topology(0)


def test_reflected_routes_parses_exabgp_json():
    line = (
        '{"type": "update", "neighbor": {"address": {"local": "10.1.0.5", "peer": "10.1.0.6"},'
        ' "message": {"update": {"attribute": {"originator-id": "10.254.0.2", "cluster-list":'
        ' ["10.255.255.1"], "attribute-0xFF-0xE0": "0x0102"}, "announce": {"ipv4 unicast":'
        ' {"10.1.0.9": [{"nlri": "10.64.0.3/32"}]}}}}}}'
    )
    down = '{"type": "state", "neighbor": {"address": {"peer": "10.1.0.6"}, "state": "down"}}'
    got = reflectors.reflected_routes([line, "not json"])
    r = got[("10.1.0.6", "10.64.0.3/32")]
    assert (r.originator_id, r.cluster_list, r.flags, r.value) == (
        "10.254.0.2",
        ("10.255.255.1",),
        0xE0,
        b"\x01\x02",
    )
    assert reflectors.reflected_routes([line, down]) == {}


def test_status_names_the_reflectors_a_route_came_through():
    t = topology.load(RR_FILE)
    adv = wire.Advertisement.build(
        wire.Version(1),
        wire.Origin(100, 2, ipaddress.ip_address("10.64.0.3")),
        wire.Sequence(epoch=1, sequence=4),
        wire.Timestamp(1),
    )
    value = wire.encode(adv).hex()
    route = {"origin": "10.64.0.3", "site_id": 2, "sequence": 4, "bytes": 40, "value": value}
    rib = {
        "routes": [
            {**route, "peer": "10.1.0.6", "as_path": [], "verified": True},
            {**route, "peer": "10.2.0.6", "as_path": [], "verified": True},
        ]
    }
    (row,) = view.origin_rows(rib, t)
    assert row[0] == "10.64.0.3" and row[3] == "2"
    assert row[6] == "rr1(frr) | rr2(bird)" and row[7] == "yes"
    rib["routes"].pop()
    assert view.origin_rows(rib, t)[0][6] == "rr1(frr)"


# ---- real daemons -------------------------------------------------------------------------


def _up(root: Path, tag: str) -> runner.Lab:
    lab = runner.up(RR_FILE, root, tag=tag)
    now = int(time.time() * 1000)
    for name, node in lab.topology.nodes.items():
        if node.receive:  # every receiver verifies against the instances' lab keys
            write_lab_trust(lab.topology, str(lab.node_dir(name) / "trust.json"), now)
    return lab


def _down(lab: runner.Lab) -> None:
    lab.down()
    assert netns.leftover_namespaces(lab.tag) == []
    assert not any(netns.pid_alive(p.pid) for p in lab.handle.state.processes)


@pytest.fixture(scope="module")
def rr_lab(tmp_path_factory):
    lab = _up(tmp_path_factory.mktemp("rr"), f"r{os.getpid()}")
    try:
        yield lab
    finally:
        _down(lab)


def _publish_all(lab: runner.Lab, sequence: int) -> dict[str, tuple[str, bytes]]:
    """Every instance announces its signed routes; {prefix: (origin site, value)}."""
    now = int(time.time() * 1000)
    expected = {}
    for name, node in lab.topology.nodes.items():
        for spec in node.instances:
            rng = np.random.default_rng(spec.site_id * 1000 + sequence)
            keys = rng.integers(0, 2**63, 300, dtype=np.uint64)
            routes = instance_routes(
                spec,
                keys,
                sequence=sequence,
                now_ms=now,
                max_message=65535,
                signer=lab_key(lab.topology, spec.name),
            )
            for prefix, value in routes.items():
                lab.spool(name).publish(prefix, value)
                expected[str(prefix)] = (name, value)
    return expected


def _reflector_of(lab: runner.Lab, site: str) -> dict[str, str]:
    """{peer address seen at `site`: reflector node}."""
    return {str(nb.remote.address.ip): nb.remote.node for nb in lab.topology.neighbors(site)}  # type: ignore[union-attr]


def _receivers(lab: runner.Lab) -> list[str]:
    return [n for n, node in lab.topology.nodes.items() if node.receive]


def _delivered(
    lab: runner.Lab,
    site: str,
    expected: dict[str, tuple[str, bytes]],
    via: set[str],
    verified: bool = True,
) -> bool:
    """Every other site's route sits in `site`'s RIB from each reflector in `via`,
    with the value sent (and verified, unless `verified=False`)."""
    peers = {a for a, rr in _reflector_of(lab, site).items() if rr in via}
    rib = {(r["peer"], r["prefix"]): r for r in lab.routes(site)}
    for prefix, (origin, value) in expected.items():
        if origin == site:
            continue
        for peer in peers:
            r = rib.get((peer, prefix))
            if r is None or r["value"] != value.hex() or (verified and not r["verified"]):
                return False
    return True


def _raw(lab: runner.Lab, site: str) -> dict[tuple[str, str], reflectors.Reflected]:
    path = lab.node_dir(site) / "rib" / "raw.jsonl"
    return reflectors.reflected_routes(path.read_text().splitlines() if path.exists() else [])


@needs_root
def test_every_origin_reaches_every_site_through_each_reflector(rr_lab):
    lab = rr_lab
    expected = _publish_all(lab, sequence=1)
    origins = {wire.decode(v).origin.address for _, v in expected.values()}
    assert len(origins) == 8 and len(expected) == 16  # a CSCI-ID route and a shard each
    for site in _receivers(lab):
        lab.wait_for(
            lambda s=site: _delivered(lab, s, expected, {"rr1", "rr2"}),
            20,
            f"every other site's routes at {site} through rr1 and rr2",
        )
    t = lab.topology
    for site in _receivers(lab):
        reflector_of = _reflector_of(lab, site)
        assert set(lab.rib(site)["sessions"]) == set(reflector_of)  # no other session
        seen = _raw(lab, site)
        for prefix, (origin, value) in expected.items():
            if origin == site:
                continue
            for peer, rr in reflector_of.items():
                r = seen[(peer, prefix)]
                assert r.value == value  # byte-identical
                assert r.flags is not None
                assert r.flags & ~(wire.FLAG_PARTIAL | FLAG_EXTENDED_LENGTH) == FLAGS_WANTED
                # RFC 4456: the originating site's router-id, one cluster: this reflector
                assert r.originator_id == t.router_id(origin)
                assert r.cluster_list == (t.nodes[rr].cluster_id,)
        others = {str(wire.decode(v).origin.address) for o, v in expected.values() if o != site}
        verified = {r["origin"] for r in lab.routes(site) if r["verified"]}
        assert verified >= others


@needs_root
def test_forged_advertisement_is_refused_through_both_reflectors(rr_lab):
    lab = rr_lab
    spec = lab.topology.nodes["s2"].instances[0]
    forger = security.SigningKey.from_seed(bytes([9]) * 32)  # authorised for nothing
    routes = instance_routes(
        spec,
        np.arange(1, 50, dtype=np.uint64),
        sequence=99,
        now_ms=int(time.time() * 1000),
        max_message=65535,
        signer=forger,
    )
    before = {site: len(lab.events(site)) for site in ("s1", "s3", "s4")}
    lab.spool("s2").publish(spec.csci, routes[spec.csci])
    for site in ("s1", "s3", "s4"):
        peers = set(_reflector_of(lab, site))

        def refused(s: str = site, peers: set[str] = peers) -> bool:
            from_peers = {
                e["peer"]
                for e in lab.events(s)[before[s] :]
                if e["kind"] == "treat-as-withdraw"
                and e["prefix"] == str(spec.csci)
                and "not verified" in e.get("reason", "")
            }
            # the snapshot is rewritten just after each event: wait for it as well
            held = [r for r in lab.routes(s) if r["prefix"] == str(spec.csci)]
            return from_peers >= peers and not held

        lab.wait_for(refused, 20, f"the forged route refused at {site} from both reflectors")
        # the other instances' state is untouched
        assert any(r["origin"] == str(spec.address) for r in lab.routes(site))


@needs_root
def test_an_instance_claiming_another_site_is_refused_through_both_reflectors(rr_lab):
    """#32 row 4: the lab binds each instance's key to its site, so an instance of s2
    signing with its own key but naming s1's site id (to be priced at s1's distance) is
    refused as not-authorised at every other site, through both reflectors."""
    lab = rr_lab
    spec = lab.topology.nodes["s2"].instances[0]
    other = lab.topology.nodes["s1"].instances[0].site_id
    assert other != spec.site_id
    claim = dataclasses.replace(spec, site_id=other)
    routes = instance_routes(
        claim,
        np.arange(1, 50, dtype=np.uint64),
        sequence=98,
        now_ms=int(time.time() * 1000),
        max_message=65535,
        signer=lab_key(lab.topology, spec.name),  # its own, authorised key
    )
    before = {site: len(lab.events(site)) for site in ("s1", "s3", "s4")}
    lab.spool("s2").publish(spec.csci, routes[spec.csci])
    for site in ("s1", "s3", "s4"):
        peers = set(_reflector_of(lab, site))

        def refused(s: str = site, peers: set[str] = peers) -> bool:
            from_peers = {
                e["peer"]
                for e in lab.events(s)[before[s] :]
                if e["kind"] == "treat-as-withdraw"
                and e["prefix"] == str(spec.csci)
                and "not-authorised" in e.get("reason", "")
                and f"site {other}" in e.get("reason", "")
            }
            held = [r for r in lab.routes(s) if r["prefix"] == str(spec.csci)]
            return from_peers >= peers and not held

        lab.wait_for(refused, 20, f"the other site's claim refused at {site} from both reflectors")


@needs_root
@pytest.mark.parametrize("killed", ["rr1", "rr2"], ids=["kill-frr", "kill-bird"])
def test_one_reflector_killed_the_other_still_delivers(tmp_path, killed):
    survivor = {"rr1": "rr2", "rr2": "rr1"}[killed]
    lab = _up(tmp_path, f"k{os.getpid() % 100000}{killed[-1]}")
    try:
        first = _publish_all(lab, sequence=1)
        for site in _receivers(lab):
            lab.wait_for(
                lambda s=site: _delivered(lab, s, first, {"rr1", "rr2"}), 20, f"routes at {site}"
            )
        for proc in [p for p in lab.handle.state.processes if p.node == killed]:
            os.killpg(proc.pid, signal.SIGKILL)  # no NOTIFICATION: the sockets just close
            lab.handle.stop(proc)
        # every site's session to the dead reflector goes down, its routes with it, and
        # what the survivor reflected stays
        for site in _receivers(lab):
            dead = next(a for a, rr in _reflector_of(lab, site).items() if rr == killed)
            lab.wait_for(
                lambda s=site, d=dead: (
                    lab.rib(s)["sessions"].get(d) == "down"
                    and not any(r["peer"] == d for r in lab.routes(s))
                ),
                15,
                f"{site}'s routes from {killed} withdrawn",
            )
            assert _delivered(lab, site, first, {survivor})
        second = _publish_all(lab, sequence=2)  # a change after the failure
        assert all(second[p][1] != first[p][1] for p in first)
        for site in _receivers(lab):
            lab.wait_for(
                lambda s=site: _delivered(lab, s, second, {survivor}),
                20,
                f"the new advertisements at {site} through {survivor}",
            )
    finally:
        _down(lab)


def test_cli_refuses_the_loopback_mode_for_reflectors_cleanly(tmp_path, capsys):
    from catsproto import cli

    code = cli.main(["lab", "up", "--topology", "catsrr", "--embedded", "--root", str(tmp_path)])
    assert code == cli.EXIT_BAD_INPUT
    assert "embedded mode needs one receiving" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing left
    assert cli.main(["lab", "up", "cats3", "--topology", "catsrr"]) == cli.EXIT_BAD_INPUT


@needs_root
def test_cli_lab_up_topology_status_down(tmp_path, capsys):
    from catsproto import cli

    root = ["--root", str(tmp_path)]
    assert cli.main(["lab", "up", "--topology", str(RR_FILE), "--no-feed", *root]) == 0
    tag = next(p.name for p in tmp_path.iterdir())
    try:
        lab = runner.attach(tmp_path / tag)
        expected = _publish_all(lab, sequence=1)  # no trust file here: accepted unverified
        lab.wait_for(
            lambda: _delivered(lab, "s4", expected, {"rr1", "rr2"}, verified=False),
            20,
            "every other site's routes at s4 through both reflectors",
        )
        capsys.readouterr()
        assert cli.main(["lab", "status", *root]) == 0
        status = capsys.readouterr().out
        assert "rr1(frr) | rr2(bird)" in status and "Established" in status
    finally:
        assert cli.main(["lab", "down", *root]) == 0
    assert netns.leftover_namespaces(tag) == []


# ---- the receiver at scale: one snapshot per burst, not per change -------------------------


def test_receiver_writes_its_snapshot_once_a_burst_is_taken_in(tmp_path):
    from catsproto.adapters import exabgp_receive as rx

    rib = rx.CacheRib()
    sink = rx.FileSink(tmp_path, rib, coalesce=True)
    values = {}
    for i in range(3):
        adv = wire.Advertisement.build(
            wire.Version(1),
            wire.Origin(100, 2, ipaddress.ip_address(f"10.64.0.{i + 1}")),
            wire.Sequence(epoch=1, sequence=1),
            wire.Timestamp(1),
        )
        values[f"10.64.0.{i + 1}/32"] = wire.encode(adv).hex()
    lines = [
        '{"type": "update", "neighbor": {"address": {"peer": "10.1.0.6"}, "message": {"update":'
        f' {{"attribute": {{"attribute-0xFF-0xE0": "0x{v}"}}, "announce": {{"ipv4 unicast":'
        f' {{"10.1.0.9": [{{"nlri": "{p}"}}]}}}}}}}}}}}}\n'
        for p, v in values.items()
    ]
    read, write = os.pipe()
    os.write(write, "".join(lines).encode())
    idle_after: list[int] = []
    seen: list[str] = []
    with os.fdopen(read) as stream:
        gen = rx.drained(stream, lambda: idle_after.append(len(seen)))
        seen.append(next(gen))
        assert idle_after == []  # more input was waiting: no write yet
        rx.run([seen[0]], rib, sink)
        assert json.loads((tmp_path / "rib.json").read_text())["routes"] == []  # deferred
        os.close(write)
        for line in gen:
            seen.append(line)
            rx.run([line], rib, sink)
        sink.flush()
    assert seen == lines and idle_after[-1] == 3  # once more at the end of input
    snapshot = json.loads((tmp_path / "rib.json").read_text())
    assert {r["prefix"]: r["value"] for r in snapshot["routes"]} == values
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 3  # every change

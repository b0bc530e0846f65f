"""The lab's topologies in real Docker containers, deployed as containerlab deploys them
(`catsproto.lab.deploy`), with the node image built by scripts/lab-image.

One cats4 deploy serves most tests (in file order: the last ones kill, stop and destroy
it); catsrr gets one deploy of its own at the end. A Docker daemon is started when none
answers and ended when the session ends; the image is built once per session (or found
current). They need root; under CI=true they always run (and fail loudly without root).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from catsproto import wire
from catsproto.adapters import netns
from catsproto.lab import deploy, runner, steering
from catsproto.lab.instances import (
    demo_prefix_keys,
    instance_routes,
    lab_group_keys,
    lab_key,
    write_lab_trust,
)
from catsproto.lab.runner import wait_for
from catsproto.lab.topology import Topology

pytestmark = pytest.mark.lab

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = [pytestmark, pytest.mark.skip(reason="container lab tests need root (Docker)")]

CHECKOUT = Path(__file__).resolve().parent.parent
LAB = CHECKOUT / "lab"
CATS4 = LAB / "cats4.clab.yml"
CATSRR = LAB / "catsrr.clab.yml"
# the links come this long after the containers start: the nodes are up before their
# links (the order that once left e4 unshaped), and must wait for them
WIRE_AFTER_S = 6.0
# e4 (65004) -> b4 BIRD (65204) -> c3 FRR (65103) -> c1 FRR (65101) -> e1
SITE4_PATH = [65101, 65103, 65204, 65004]


def _lab_name(topology: str) -> str:
    """The lab's name for containerlab (its containers' names): the topology's and this
    run's PID, so that two test runs on one machine do not take each other's containers.
    The nodes still read the topology file, name and keys as they are."""
    return f"{topology}x{os.getpid()}"


def _without_dead_runs(doc: dict, path: Path) -> deploy.ContainerLab:
    """The lab of `doc`, after destroying what earlier test runs whose process is gone
    left of the same topology (an interrupted run)."""
    topology = path.name.removesuffix(".clab.yml")
    out = deploy.docker(
        "ps", "-a", "--filter", "label=containerlab", "--format", '{{.Label "containerlab"}}'
    )
    for name in set(out.stdout.decode().split()):
        pid = name.removeprefix(f"{topology}x")
        if pid.isdigit() and not netns.pid_alive(int(pid)):
            deploy.ContainerLab(deploy.plan({**doc, "name": name}, path)).destroy()
    return deploy.ContainerLab(deploy.plan(doc, path))


def _images() -> set[str]:
    out = deploy.docker("images", "--all", "--quiet", "--no-trunc")
    return set(out.stdout.decode().split())


@pytest.fixture(scope="session")
def docker_ready():
    """A Docker daemon (the running one, or one started here) and the node image, built
    through scripts/lab-image; yields the script's output and the images there were."""
    if shutil.which("dockerd") is None:  # a fresh machine: the script installs Docker
        deploy.build_image(CHECKOUT)
    daemon = deploy.DockerDaemon().ensure()
    try:
        out = deploy.build_image(CHECKOUT)
        yield out, _images()
    finally:
        daemon.stop()


def _routes_of(topology: Topology, sequence: int, now_ms: int, *, seal: bool = False):
    """Every instance's signed routes, {node: {prefix: value}}: the first instance of each
    site holds its site's demo conversation, the second 200 keys of its own."""
    out: dict[str, dict] = {}
    group_keys = lab_group_keys(topology) if seal else None
    for name, node in topology.nodes.items():
        for i, spec in enumerate(node.instances):
            rng = np.random.default_rng(spec.site_id * 100 + i)
            keys = (
                demo_prefix_keys(spec.site_id)
                if i == 0
                else rng.integers(0, 2**63, 200, dtype=np.uint64)
            )
            out.setdefault(name, {}).update(
                instance_routes(
                    spec,
                    keys,
                    sequence=sequence,
                    now_ms=now_ms,
                    free_blocks=30000,
                    signer=lab_key(topology, spec.name),
                    group_keys=group_keys,
                )
            )
    return out


def _publish(lab, routes: dict[str, dict]) -> dict[str, bytes]:
    """Each node's routes into its spool (a netns lab's from here, a container's inside
    it); {prefix: value}."""
    flat = {}
    for node, by_prefix in routes.items():
        if isinstance(lab, deploy.ContainerLab):
            lab.publish(node, by_prefix)
        else:
            for prefix, value in by_prefix.items():
                lab.spool(node).publish(prefix, value)
        flat.update({str(p): v for p, v in by_prefix.items()})
    return flat


def _arrived(lab, node: str, expected: dict[str, bytes]) -> dict[str, dict] | None:
    got = {r["prefix"]: r for r in lab.routes(node) if r["prefix"] in expected}
    ok = len(got) == len(expected) and all(
        r["value"] == expected[p].hex() and r["verified"] for p, r in got.items()
    )
    return got if ok else None


@pytest.fixture(scope="module")
def cats4(docker_ready):
    """cats4 deployed once; every node gets CATSPROTO_SEAL=true (topology defaults, as a
    containerlab user would write it), so the receiver e1 holds the lab's group key."""
    doc = yaml.safe_load(CATS4.read_text())
    doc["name"] = _lab_name("cats4")
    doc["topology"]["defaults"] = {"env": {"CATSPROTO_SEAL": "true"}}
    lab = _without_dead_runs(doc, CATS4)
    lab.deploy(wire_after=WIRE_AFTER_S)
    try:
        wait_for(lambda: (lab.node_dir("e1") / "rib").is_dir(), 60, "e1's node to start")
        write_lab_trust(
            lab.topology, str(lab.node_dir("e1") / "trust.json"), int(time.time() * 1000)
        )
        yield lab
    finally:
        lab.destroy()


def test_the_image_is_built_once_and_then_found_current(docker_ready):
    out = subprocess.run(
        [str(CHECKOUT / "scripts" / "lab-image")], capture_output=True, text=True, check=True
    )
    assert "is current" in out.stderr and "nothing to build" in out.stderr, out.stderr
    check = subprocess.run([str(CHECKOUT / "scripts" / "lab-image"), "--check"], check=False)
    assert check.returncode == 0
    labels = json.loads(deploy.docker("image", "inspect", "catsproto-node:latest").stdout)[0]
    assert len(labels["Config"]["Labels"]["catsproto.inputs"]) == 64


def test_containers_are_what_containerlab_would_make(cats4):
    e1 = cats4.inspect("e1")
    assert e1["Name"] == f"/clab-{cats4.name}-e1" and e1["Config"]["Hostname"] == "e1"
    assert e1["Config"]["Labels"]["containerlab"] == cats4.name
    env = dict(v.split("=", 1) for v in e1["Config"]["Env"])
    assert env["CLAB_INTFS"] == "2" and env["CATSPROTO_NODE"] == "e1"
    assert env["CLAB_LABEL_CATSPROTO_ROLE"] == "exabgp"
    assert (
        e1["Mounts"][0]["Source"] == str(LAB) and e1["Mounts"][0]["Destination"] == "/catsproto/lab"
    )
    assert deploy.netns_names(cats4.name) == sorted(
        c.container for c in cats4.plan.containers.values()
    )
    for node in cats4.plan.containers:
        assert cats4.state(node)["Running"], node
        links = json.loads(cats4.exec(node, ["ip", "-j", "-4", "addr", "show"]))
        have = {i["ifname"]: i for i in links}
        for link in cats4.topology.links:
            for end in (link.a, link.b):
                if end.node != node:
                    continue
                iface = have[end.interface]  # the veth end, renamed to the endpoint's name
                assert iface["mtu"] == deploy.VETH_MTU and iface["operstate"] == "UP"
                addrs = {f"{a['local']}/{a['prefixlen']}" for a in iface["addr_info"]}
                assert str(end.address) in addrs  # set by the node, not by containerlab
                qdisc = cats4.exec(node, ["tc", "qdisc", "show", "dev", end.interface])
                assert "tbf" in qdisc or "netem" in qdisc, (node, end.interface, qdisc)
        assert "eth0" not in have  # no management network here (docs/howto-containerlab.md)
    # the nodes waited for their links (and shaped them, above)
    waited = [n for n in cats4.plan.containers if "node: waiting for eth1" in cats4.logs(n)]
    assert len(waited) >= 5, waited
    # the node's own lines reach `docker logs` as they happen (unbuffered)
    logs = cats4.logs("e4")
    assert "node: interfaces eth1 after" in logs and "node: eth1: address 10.0.14.1/30" in logs
    assert "node: default route via 10.100.1.1" in cats4.logs("client")


def test_every_bgp_session_is_established(cats4):
    def all_up():
        sessions = cats4.sessions()
        frr_bird = [s for n, s in sessions.items() if n != "e1"]
        return (
            sessions.get("e1") == {"10.0.11.2": "up"}
            and len(frr_bird) == 4
            and all(s and set(s.values()) == {"Established"} for s in frr_bird)
            and sessions
        )

    sessions = wait_for(all_up, 60, "every session Established")
    assert sum(len(s) for s in sessions.values()) == 1 + 3 + 3 + 4 + 2  # e1, c1, c2, c3, b4


def test_a_signed_advertisement_from_every_site_is_verified_at_e1(cats4):
    expected = _publish(cats4, _routes_of(cats4.topology, 1, int(time.time() * 1000)))
    got = wait_for(lambda: _arrived(cats4, "e1", expected), 60, "every instance's routes at e1")
    paths = {r["site_id"]: r["as_path"] for r in got.values()}
    assert sorted(paths) == [1, 2, 3, 4]
    assert paths[4] == SITE4_PATH
    assert paths[2] == [65101, 65102, 65002] and paths[3] == [65101, 65103, 65003]
    assert "10.104.0.11/32" in cats4.exec(
        "b4", ["birdc", "-s", "/var/lib/catsproto/bird.ctl", "show", "route"]
    )


def test_a_sealed_advertisement_is_opened_at_e1(cats4):
    now = int(time.time() * 1000)
    routes = _routes_of(cats4.topology, 2, now, seal=True)
    e3 = {
        p: v for p, v in routes["e3"].items() if p.overlaps(ipaddress.ip_network("10.203.11.0/28"))
    }
    assert e3
    for value in e3.values():  # sealed: the cache section is ciphertext on the wire
        assert wire.decode(value).cache_summaries is None
    expected = _publish(cats4, {"e3": e3})

    def opened():
        got = _arrived(cats4, "e1", expected)
        return got if got and all("opened_value" in r for r in got.values()) else None

    got = wait_for(opened, 60, "the sealed routes opened at e1")
    for route in got.values():
        adv = wire.decode(bytes.fromhex(route["opened_value"]))
        assert adv.cache_summaries is not None and adv.origin.site_id == 3
    assert cats4.rib("e1")["counters"]["sealed_opened"] >= len(e3)


def _decisions(topology: Topology, rib_json: dict, now_ms: int) -> list[tuple]:
    out = []
    for site, aware, blind in steering.decide_demo(topology, rib_json, "e1", now_ms):
        c, b = aware.chosen, blind.chosen
        out.append(
            (
                site,
                str(c.address),
                c.cached_blocks,
                round(c.total_ms, 6),
                tuple(c.path),
                str(b.address),
            )
        )
    return out


def test_the_selector_steers_on_what_bgp_delivered(cats4):
    rib = cats4.rib("e1")
    now = max(int(r["timestamp_ms"]) for r in rib["routes"])
    for site, chosen, cached, _, path, _ in _decisions(cats4.topology, rib, now):
        if site == 4:  # the farthest site's conversation goes where it is cached
            assert chosen == "10.104.0.11" and cached > 0
            assert path[0] == "e1" and path[-1] == "e4" and "b4" in path


def test_the_same_bytes_and_decisions_as_the_netns_lab(cats4, tmp_path):
    tag = f"k{os.getpid()}"
    netns_lab = runner.up(CATS4, tmp_path / "labs", tag=tag)
    try:
        write_lab_trust(
            netns_lab.topology,
            str(netns_lab.node_dir("e1") / "trust.json"),
            int(time.time() * 1000),
        )
        now = int(time.time() * 1000)
        routes = _routes_of(cats4.topology, 10, now)  # one set of bytes for both labs
        expected = _publish(netns_lab, routes)
        assert _publish(cats4, routes) == expected
        in_netns = wait_for(lambda: _arrived(netns_lab, "e1", expected), 60, "routes in netns")
        in_docker = wait_for(lambda: _arrived(cats4, "e1", expected), 60, "routes in containers")
        for prefix in expected:
            a, b = in_netns[prefix], in_docker[prefix]
            assert (a["value"], a["as_path"], a["verified"]) == (
                b["value"],
                b["as_path"],
                b["verified"],
            )
        only = {"routes": list(in_netns.values())}, {"routes": list(in_docker.values())}
        decided = [_decisions(netns_lab.topology, rib, now + 1000) for rib in only]
        assert decided[0] == decided[1] and len(decided[0]) == 4
    finally:
        netns_lab.down()
        assert netns.leftover_namespaces(tag) == []


def test_a_killed_container_is_withdrawn_and_steered_around(cats4):
    rib = cats4.rib("e1")
    assert any(r["site_id"] == 4 for r in rib["routes"])
    cats4.kill("e4")
    assert not cats4.state("e4")["Running"]
    wait_for(
        lambda: not any(r["site_id"] == 4 for r in cats4.routes("e1")), 30, "site 4 withdrawn at e1"
    )
    rib = cats4.rib("e1")
    now = max(int(r["timestamp_ms"]) for r in rib["routes"])
    for site, chosen, _, _, path, _ in _decisions(cats4.topology, rib, now):
        assert not chosen.startswith("10.104.") and "e4" not in path, (site, chosen, path)


def test_docker_stop_ends_a_node_cleanly_and_soon(cats4):
    for node in ("e2", "client", "c2"):
        started = time.monotonic()
        deploy.docker("stop", "--time", "20", cats4.container(node), timeout=60)
        took = time.monotonic() - started
        state = cats4.state(node)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], (node, state)
        assert took < 15, f"{node} took {took:.1f} s: SIGTERM ignored, SIGKILL at the end"
        assert "node: stopped" in cats4.logs(node) or "signal 15: exiting" in cats4.logs(node)


def test_destroy_leaves_no_container_veth_or_image_layer(cats4, docker_ready):
    _, images_before = docker_ready
    cats4.destroy()
    assert cats4.running() == []
    assert deploy.netns_names(cats4.name) == []
    assert deploy.host_veths() == []
    assert _images() == images_before
    dangling = deploy.docker("images", "--quiet", "--filter", "dangling=true").stdout.split()
    assert dangling == []
    assert deploy.docker("image", "inspect", "catsproto-node:latest", check=False).returncode == 0
    cats4.destroy()  # again: nothing to do, no error


def test_catsrr_reflectors_carry_every_sites_routes(docker_ready):
    doc = yaml.safe_load(CATSRR.read_text())
    doc["name"] = _lab_name("catsrr")
    lab = _without_dead_runs(doc, CATSRR)
    lab.deploy()
    try:
        t = lab.topology
        now = int(time.time() * 1000)
        sites = [n for n, node in t.nodes.items() if node.receive]
        for s in sites:
            wait_for(lambda s=s: (lab.node_dir(s) / "rib").is_dir(), 60, f"{s}'s node to start")
            write_lab_trust(t, str(lab.node_dir(s) / "trust.json"), now)
        routes = _routes_of(t, 1, now)
        _publish(lab, routes)
        reflector_peers = {"rr1", "rr2"}

        def everywhere():
            for s in sites:
                want = {
                    str(p): v for other, r in routes.items() if other != s for p, v in r.items()
                }
                got: dict[str, set[str]] = {}
                for r in lab.routes(s):
                    if (
                        r["prefix"] in want
                        and r["value"] == want[r["prefix"]].hex()
                        and r["verified"]
                    ):
                        got.setdefault(r["prefix"], set()).add(r["peer"])
                if set(got) != set(want) or any(len(peers) != 2 for peers in got.values()):
                    return False
            return True

        wait_for(everywhere, 90, "every site's routes at every other site through both reflectors")
        assert "10.64.0.1/32" in lab.exec("rr1", ["vtysh", "-c", "show bgp ipv4 unicast"])
        assert "10.64.0.1/32" in lab.exec(
            "rr2", ["birdc", "-s", "/var/lib/catsproto/bird.ctl", "show", "route"]
        )
        assert reflector_peers <= set(t.nodes)
    finally:
        lab.destroy()
    assert deploy.netns_names(lab.name) == [] and deploy.host_veths() == []

"""The path selector at the lab's receiver: a RIB fed with what BGP delivered, decisions.

The receiver's ExaBGP process keeps what arrived (verified values, per route) in its
rib.json; this module decodes those values into a `selector.RIB`, builds the selector's
network graph from the topology file's links (delay and rate: the same numbers the
runner shapes the links with), and asks `PathSelector.decide` where each site's demo
conversation should go from the receiver's site. The lab's own instances (`instances.py`)
pin one conversation per site, keyed with the lab's public demo secret.
"""

from __future__ import annotations

import re
from typing import Any

from catsproto import wire
from catsproto.lab.instances import BLOCK_TOKENS, demo_prefix_keys
from catsproto.lab.topology import Topology
from catsproto.selector import RIB, Decision, Link, Network, PathSelector, Request, SelectorConfig

_RATE = re.compile(r"^\s*([0-9.]+)\s*([kmg]?)bit\s*$", re.IGNORECASE)


def rate_mbps(text: str | None, default: float = 1000.0) -> float:
    """'1gbit' -> 1000.0; None -> default."""
    if not text:
        return default
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"rate {text!r} is not like 1gbit / 100mbit")
    scale = {"": 1e-6, "k": 1e-3, "m": 1.0, "g": 1e3}[m.group(2).lower()]
    return float(m.group(1)) * scale


def network_from_topology(topology: Topology) -> tuple[Network, dict[int, str]]:
    """The selector's graph (nodes are lab nodes) and the node of each site's egress."""
    net = Network(
        Link(link.a.node, link.b.node, link.delay_ms, rate_mbps(link.rate))
        for link in topology.links
    )
    sites = {spec.site_id: name for name, node in topology.nodes.items() for spec in node.instances}
    return net, sites


def loopback_links(topology: Topology, receiver: str) -> tuple[Link, ...]:
    """A loopback lab's real graph: each speaker peers with the receiver directly on `lo`,
    so one 0 ms link per speaker and none of the topology's transit routers (which the
    loopback mode does not run) or link delays (which it cannot apply)."""
    return tuple(
        Link(receiver, name, 0.0, rate_mbps(None))
        for name, node in topology.nodes.items()
        if node.role == "exabgp" and node.announce and not node.receive
    )


def lab_links(topology: Topology, receiver: str, *, loopback: bool) -> tuple[Link, ...]:
    """The links the selector should see: the topology's, or `loopback_links`."""
    if loopback:
        return loopback_links(topology, receiver)
    return tuple(
        Link(link.a.node, link.b.node, link.delay_ms, rate_mbps(link.rate))
        for link in topology.links
    )


def rib_from_receiver(rib_json: dict[str, Any], now_ms: int) -> RIB:
    """A selector RIB from the receiver's rib.json: verified values only (the routes the
    receiver refused never reach it), with their sealed cache section opened where the
    receiver holds the group key (`opened_value`)."""
    rib = RIB()
    for route in rib_json.get("routes", []):
        if route.get("verified") is False:
            continue
        adv = wire.decode(bytes.fromhex(route.get("opened_value", route["value"])))
        rib.accept(adv, now_ms)
    return rib


def decide_demo(
    topology: Topology,
    rib_json: dict[str, Any],
    ingress: str,
    now_ms: int,
    *,
    loopback: bool = False,
) -> list[tuple[int, Decision, Decision]]:
    """For each site's demo conversation, the selector's decision at `ingress`, and what
    network-only CATS (the same selector without the prompt's block keys) would pick.
    `loopback`: the lab runs on loopback (`loopback_links` is its graph)."""
    _, sites = network_from_topology(topology)
    network = Network(lab_links(topology, ingress, loopback=loopback))
    rib = rib_from_receiver(rib_json, now_ms)

    def fresh() -> PathSelector:  # one per question: no load counted from the others
        return PathSelector(rib, network, SelectorConfig(site_nodes=sites))

    cs_of_site = {  # the modelled instances' service (a real engine serves another)
        spec.site_id: spec.cs_id
        for node in topology.nodes.values()
        for spec in node.instances
        if spec.engine is None
    }
    out = []
    for site in sorted(sites):
        keys = demo_prefix_keys(site)
        tokens = len(keys) * BLOCK_TOKENS
        blind = fresh().decide(Request(cs_of_site[site], keys[:0], tokens, ingress), now_ms)
        aware = fresh().decide(Request(cs_of_site[site], keys, tokens, ingress), now_ms)
        out.append((site, aware, blind))
    return out

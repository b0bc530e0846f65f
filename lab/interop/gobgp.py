"""GoBGP (gobgpd 3.x) as a lab transit: its TOML configuration and how to start it.

Strategy: the lab's renderers (`catsproto.lab.configs`) cover ExaBGP, FRR and BIRD;
GoBGP is only needed by the interop matrix, so its renderer lives here. The transit
has one eBGP session per neighbor of the topology, IPv4 unicast, with the same short
timers as the other transits (hold 9 s, connect retry 1 s). GoBGP's default global
policy accepts and re-advertises everything, so no policy is configured. gobgpd runs in
the foreground with its gRPC API on the namespace's own loopback (`--api-hosts`), so
`gobgp -p PORT` inside the namespace talks to it and nothing listens outside the lab.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from catsproto.lab.runner import Lab
from catsproto.lab.topology import Topology

API_PORT = 50051


def _toml(value: object) -> str:
    """A TOML scalar or flat list (strings through JSON quoting, which TOML accepts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def gobgpd_conf(topo: Topology, node: str) -> str:
    """gobgpd TOML for `node`: one eBGP neighbor per link of the topology."""
    n = topo.nodes[node]
    out = [
        "[global.config]",
        f"  as = {_toml(n.asn)}",
        f"  router-id = {_toml(topo.router_id(node))}",
        "  port = 179",
        "",
    ]
    for nb in topo.neighbors(node):
        out += [
            "[[neighbors]]",
            "  [neighbors.config]",
            f"    neighbor-address = {_toml(str(nb.remote.address.ip))}",  # type: ignore[union-attr]
            f"    peer-as = {_toml(nb.remote_asn)}",
            "  [neighbors.transport.config]",
            f"    local-address = {_toml(str(nb.local.address.ip))}",  # type: ignore[union-attr]
            "  [neighbors.timers.config]",
            "    connect-retry = 1",
            "    hold-time = 9",
            "    keepalive-interval = 3",
            "  [[neighbors.afi-safis]]",
            "    [neighbors.afi-safis.config]",
            '      afi-safi-name = "ipv4-unicast"',
            "",
        ]
    return "\n".join(out)


def start_gobgp(lab: Lab, node: str) -> None:
    """Render the config into the node's directory and start gobgpd in its namespace."""
    d: Path = lab.node_dir(node)
    conf = d / "gobgpd.toml"
    conf.write_text(gobgpd_conf(lab.topology, node))
    lab.handle.start(
        node,
        "gobgpd",
        [
            "gobgpd",
            "-f",
            str(conf),
            "-p",
            "--api-hosts",
            f"127.0.0.1:{API_PORT}",
            "--pprof-disable",
        ],
    )


def neighbor_states(lab: Lab, node: str) -> dict[str, str]:
    """Session state per peer address, as `gobgp neighbor -j` reports it."""
    text = lab.handle.run(node, ["gobgp", "-p", str(API_PORT), "neighbor", "-j"])
    try:
        peers = json.loads(text)
    except ValueError:
        return {}
    out = {}
    for peer in peers or []:
        addr = peer.get("conf", {}).get("neighbor_address", "?")
        out[addr] = str(peer.get("state", {}).get("session_state", "?"))
    return out

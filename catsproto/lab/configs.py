"""Daemon configurations rendered from a topology: ExaBGP, FRR (zebra + bgpd), BIRD 2.

Pure text generation; the templates sit here, in one place, next to the rules they
follow (LAB-NOTES.md): FRR needs `no bgp ebgp-requires-policy` to pass anything over
eBGP, advertisement-interval 0 so that the measured convergence is ours rather than
FRR's MRAI; BIRD needs `enable extended messages on` to carry payloads over 4096 bytes;
ExaBGP turns extended messages off with `capability { extended-message disable; }`.

For the data plane (flows steered to instances, docs/steering.md): an ExaBGP node
announces the subnet of every link it has to a plain host (a node without a
catsproto.role, such as the ingress's client) so that replies find their way back, and
BIRD exports its BGP routes to the kernel as FRR's zebra does.

Route reflectors (RFC 4456; a node labelled `catsproto.route-reflector`): FRR gets
`neighbor X route-reflector-client` for each same-AS client and `bgp cluster-id` when
the topology names one; BIRD gets `rr client;` and `rr cluster id`. BIRD treats an
iBGP session as multihop and resolves its next hops recursively by default, which
needs an IGP we do not run, so its iBGP sessions are marked `direct` (every client is
on a link of the reflector; the next hop is resolved on that link). A reflector
labelled `catsproto.reflect-to: receivers` sends nothing to clients that only announce
(FRR: a deny-all `route-map ... out`; BIRD: `export none`). Both
reflect the next hop unchanged, so the attribute and the route reach the other clients
as the originating site sent them, plus ORIGINATOR_ID and CLUSTER_LIST.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from catsproto.lab.topology import Topology

EXABGP_ENV = {
    "exabgp_daemon_user": "root",
    "exabgp_api_cli": "false",
    "exabgp_log_destination": "stdout",
    "exabgp_daemon_daemonize": "false",
}


def host_networks(topo: Topology, node: str) -> list[str]:
    """Subnets of `node`'s links to plain hosts (nodes that run no BGP daemon of ours)."""
    out = []
    for link in topo.links:
        for local, remote in ((link.a, link.b), (link.b, link.a)):
            if local.node == node and remote.node not in topo.nodes and local.address:
                out.append(str(local.address.network))
    return out


def exabgp_conf(
    topo: Topology,
    node: str,
    *,
    python: str,
    spool: str,
    out: str,
    neighbors: Sequence[tuple[str, str, int, int]] | None = None,
    ports: tuple[int | None, int | None] = (None, None),
    group_key: str | None = None,
) -> str:
    """ExaBGP config for `node`. `neighbors` overrides the topology's sessions with
    (local address, peer address, local AS, peer AS) for the embedded mode, and `ports`
    (listen, connect) moves BGP off port 179 there. `group_key`: a group key file the
    receive process opens sealed cache sections with (a sealed lab)."""
    n = topo.nodes[node]
    embedded = neighbors is not None
    restart_peers: set[str] = set()  # peers that offer graceful restart too
    if neighbors is None:
        neighbors = [
            (str(nb.local.address.ip), str(nb.remote.address.ip), n.asn, nb.remote_asn)  # type: ignore[union-attr]
            for nb in topo.neighbors(node)
        ]
        restart_peers = {
            str(nb.remote.address.ip)  # type: ignore[union-attr]
            for nb in topo.neighbors(node)
            if topo.nodes[nb.remote.node].graceful_restart
        }
    max_message = 65535 if n.extended_message else 4096
    lines = []
    if n.announce:
        argv = [
            python,
            "-m",
            "catsproto.adapters.exabgp_announce",
            "--spool",
            spool,
            "--max-message",
            str(max_message),
            "--min-interval",
            str(n.min_interval),
            *(["--poll", str(n.spool_poll)] if n.spool_poll is not None else []),
        ]
        lines.append(f"process announce {{ run {shlex.join(argv)}; encoder text; }}")
    if n.receive:
        # verification starts once it exists; before that (and if it is removed) values
        # are accepted unverified, a lab convenience (docs/lab.md)
        trust = str(Path(out).parent / "trust.json")
        argv = [
            python,
            "-m",
            "catsproto.adapters.exabgp_receive",
            "--out",
            out,
            "--raw",
            "--trust-when-present",
            trust,
            *(["--group-key", group_key] if group_key else []),
        ]
        helper = n.restart_helper or n.graceful_restart
        if helper:  # keep a restarting peer's routes, stale, until its EoR
            argv += ["--graceful-restart", str(helper)]
        lines.append(f"process receive {{ run {shlex.join(argv)}; encoder json; }}")
    for i, (local, peer, local_as, peer_as) in enumerate(neighbors):
        body = [
            f"router-id {local if embedded else topo.router_id(node)};",
            f"local-address {local};",
            f"local-as {local_as};",
            f"peer-as {peer_as};",
            "hold-time 9;",
            "family { ipv4 unicast; }",
        ]
        listen, connect = ports
        if listen:
            body += ["passive;", f"listen {listen};"]
        if connect:
            body.append(f"connect {connect};")
        capabilities = []
        if not n.extended_message:
            capabilities.append("extended-message disable;")
        if n.graceful_restart and peer in restart_peers:  # only where both ends offer it
            capabilities.append(f"graceful-restart {n.graceful_restart};")
        if capabilities:
            body.append(f"capability {{ {' '.join(capabilities)} }}")
        stubs = [] if embedded else host_networks(topo, node)
        if stubs:
            routes = " ".join(f"route {net} next-hop self;" for net in stubs)
            body.append(f"static {{ {routes} }}")
        if n.announce:
            body.append(f"api speak{i} {{ processes [ announce ]; }}")
        if n.receive:
            body.append(
                f"api hear{i} {{ processes [ receive ]; receive {{ parsed; update; }} "
                "neighbor-changes; }"
            )
        lines.append(f"neighbor {peer} {{\n  " + "\n  ".join(body) + "\n}")
    return "\n".join(lines) + "\n"


def frr_zebra_conf(node: str) -> str:
    return f"hostname {node}\nlog stdout\n"


def frr_bgpd_conf(topo: Topology, node: str) -> str:
    n = topo.nodes[node]
    out = [
        "frr defaults traditional",
        f"hostname {node}",
        "log stdout",
        f"router bgp {n.asn}",
        f" bgp router-id {topo.router_id(node)}",
        " no bgp ebgp-requires-policy",
        " no bgp network import-check",
    ]
    if n.graceful_restart:
        out += [" bgp graceful-restart", f" bgp graceful-restart restart-time {n.graceful_restart}"]
    if n.route_reflector and n.cluster_id:
        out.append(f" bgp cluster-id {n.cluster_id}")
    nbs = topo.neighbors(node)
    for nb in nbs:
        peer = nb.remote.address.ip  # type: ignore[union-attr]
        out += [
            f" neighbor {peer} remote-as {nb.remote_asn}",
            f" neighbor {peer} timers 3 9",
            f" neighbor {peer} timers connect 1",
            f" neighbor {peer} advertisement-interval 0",
        ]
    out.append(" address-family ipv4 unicast")
    for nb in nbs:
        peer = nb.remote.address.ip  # type: ignore[union-attr]
        out.append(f"  neighbor {peer} activate")
        if nb.rr_client:
            out.append(f"  neighbor {peer} route-reflector-client")
        if nb.export_none:
            out.append(f"  neighbor {peer} route-map CATS-SEND-NONE out")
    out += [" exit-address-family"]
    if any(nb.export_none for nb in nbs):
        out.append("route-map CATS-SEND-NONE deny 10")
    out.append("")
    return "\n".join(out)


def bird_conf(topo: Topology, node: str) -> str:
    n = topo.nodes[node]
    out = [
        f"router id {topo.router_id(node)};",
        "log stderr all;",
        "protocol device { }",
        "protocol kernel { ipv4 { export all; }; }",  # forward along what BGP chose
        "",
    ]
    for i, nb in enumerate(topo.neighbors(node)):
        out += [
            f"protocol bgp peer{i} {{",
            f"  local {nb.local.address.ip} as {n.asn};",  # type: ignore[union-attr]
            f"  neighbor {nb.remote.address.ip} as {nb.remote_asn};",  # type: ignore[union-attr]
            "  hold time 9;",
            "  connect retry time 1;",
            "  enable extended messages on;",
            *(["  rr client;"] if nb.rr_client else []),
            *([f"  rr cluster id {n.cluster_id};"] if nb.rr_client and n.cluster_id else []),
            *(
                ["  graceful restart on;", f"  graceful restart time {n.graceful_restart};"]
                if n.graceful_restart
                else []
            ),
            *(["  direct;"] if nb.ibgp else []),  # a link peer: next hop on the link
            f"  ipv4 {{ import all; export {'none' if nb.export_none else 'all'}; }};",
            "}",
            "",
        ]
    return "\n".join(out)

"""What a receiver's RIB shows, per origin: blocks advertised, routes, path, verification.

Pure: takes the `rib.json` dict that `exabgp_receive` writes and the topology (to name
the transit routers on the AS path) and returns table rows.
"""

from __future__ import annotations

from typing import Any

from catsproto import wire
from catsproto.lab.topology import Topology


def as_names(topology: Topology) -> dict[int, str]:
    return {n.asn: f"{n.name}({n.role})" for n in topology.nodes.values()}


def peer_names(topology: Topology) -> dict[str, str]:
    """{link address: "node(role)"} for every BGP node's addressed link ends."""
    out = {}
    for link in topology.links:
        for end in (link.a, link.b):
            if end.address is not None and end.node in topology.nodes:
                out[str(end.address.ip)] = f"{end.node}({topology.nodes[end.node].role})"
    return out


def origin_rows(rib: dict[str, Any], topology: Topology) -> list[list[str]]:
    """One row per origin: address, site, sequence, routes, blocks, path, verified.
    The path is the transit ASes; over iBGP (an empty AS path: route reflection) it is
    the reflectors the routes came through, `rr1(frr) | rr2(bird)`."""
    names = as_names(topology)
    peers = peer_names(topology)
    by_origin: dict[str, list[dict[str, Any]]] = {}
    for route in rib.get("routes", []):
        by_origin.setdefault(route["origin"], []).append(route)
    rows = []
    for origin, routes in sorted(by_origin.items()):
        blocks = 0
        for r in routes:
            try:
                # the opened value where the receiver holds the group key (a sealed lab)
                adv = wire.decode(bytes.fromhex(r.get("opened_value", r["value"])))
            except (wire.CodecError, ValueError):
                continue
            if adv.cache_summaries:
                blocks += sum(e.entry_count for e in adv.cache_summaries.entries)
        longest = max((r.get("as_path", []) for r in routes), key=len)
        transits = [names.get(asn, str(asn)) for asn in longest[:-1]]
        if not longest:  # iBGP: name the peers (reflectors) it came through
            via = sorted({peers.get(r.get("peer", ""), r.get("peer", "?")) for r in routes})
            transits = [" | ".join(via)] if via else []
        rows.append(
            [
                origin,
                str(routes[0]["site_id"]),
                str(max(r["sequence"] for r in routes)),
                str(len(routes)),
                str(sum(r["bytes"] for r in routes)),
                str(blocks),
                " > ".join(transits) or "direct",
                "yes" if all(r["verified"] for r in routes) else "no",
            ]
        )
    return rows


ORIGIN_HEADER = ["origin", "site", "seq", "routes", "bytes", "blocks", "via", "verified"]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])

"""Route-reflector topologies: N sites that peer only with two reflectors (FRR and BIRD).

Strategy: `reflector_topology` (pure) returns a containerlab document — the same form
as the hand-written files in `lab/`, so it is still the single source of truth once
written — in which every site egress `s<k>` (ExaBGP, speaking for its instances) has
one link and one iBGP session to each of two route reflectors: `rr1` (FRR) and `rr2`
(BIRD), all in one AS. The sites are the reflectors' clients (RFC 4456) and have no
sessions among themselves, so N sites need 2N sessions, not N(N-1)/2. The reflectors
do not peer with each other: each client hears every route twice, once per reflector,
and either reflector alone delivers everything (what `tests/test_lab_rr.py` kills).

`lab/catsrr.clab.yml` is `render(reflector_topology(4, 2))`, what `python -m
catsproto.lab.reflectors` writes by default; its options are `--sites`, `--instances`,
`--receivers`, `--name` and `--file` (the file name the header mentions), nothing more.
The keyword arguments `min_interval`, `reflect_to` and `spool_poll` (node labels) are
for Python callers: `benchmarks/lab_scale.py` writes larger topologies and sets the last
two from its own command line. Address plan (room for 16,383 sites and a million
instances):

* site k's link to reflector r: 10.r.0.0/16 + 4k as a /30, site .1, reflector .2;
* site k's router-id 10.254.0.0 + k; reflector r's router-id and cluster-id 10.255.255.r;
* instance g (1-based over all sites): CSCI-ID 10.64.0.0 + g /32, shards 10.128.0.0 + 16g /28.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import sys
from collections.abc import Iterable
from typing import Any

import yaml

from catsproto.adapters.exabgp_receive import find_attribute
from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE

ASN = 65000
REFLECTORS = (("rr1", "frr"), ("rr2", "bird"))
MAX_SITES = 16_383
_SITE_ID_BASE = ipaddress.IPv4Address("10.254.0.0")
_CSCI_BASE = ipaddress.IPv4Address("10.64.0.0")
_SHARD_BASE = ipaddress.IPv4Address("10.128.0.0")


class _Flow(dict):
    """A mapping written on one line, like the hand-written files' endpoints and vars."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Flow, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)
)


def site_name(k: int) -> str:
    return f"s{k}"


def _link_ends(k: int, r: int) -> tuple[str, str]:
    base = ipaddress.IPv4Address(f"10.{r}.0.0") + 4 * k
    return f"{base + 1}/30", f"{base + 2}/30"


def reflector_topology(
    sites: int,
    instances: int = 2,
    *,
    name: str = "catsrr",
    receivers: int | None = None,
    min_interval: float = 0.0,
    reflect_to: str = "all",
    spool_poll: float | None = None,
) -> dict[str, Any]:
    """A containerlab document: `sites` ExaBGP egresses with `instances` each, clients of
    rr1 (FRR) and rr2 (BIRD). The first `receivers` sites (default: all) also receive;
    `reflect_to="receivers"`: the reflectors send nothing to the others; `spool_poll`:
    seconds between the announce processes' spool scans."""
    if not 1 <= sites <= MAX_SITES:
        raise ValueError(f"sites must be 1..{MAX_SITES}, not {sites}")
    if not 0 <= instances <= 1_000_000 // sites:
        raise ValueError(f"{instances} instances per site do not fit the address plan")
    receivers = sites if receivers is None else receivers
    nodes: dict[str, Any] = {}
    links: list[dict[str, Any]] = []
    for r, (rr, role) in enumerate(REFLECTORS, 1):
        rid = f"10.255.255.{r}"
        nodes[rr] = {
            "kind": "linux",
            "env": _Flow(CATSPROTO_NODE=rr),
            "labels": {
                "catsproto.role": role,
                "catsproto.asn": ASN,
                "catsproto.router-id": rid,
                "catsproto.route-reflector": "true",
                "catsproto.cluster-id": rid,
            },
        }
        if reflect_to != "all":
            nodes[rr]["labels"]["catsproto.reflect-to"] = reflect_to
    for k in range(1, sites + 1):
        labels: dict[str, Any] = {
            "catsproto.role": "exabgp",
            "catsproto.asn": ASN,
            "catsproto.router-id": str(_SITE_ID_BASE + k),
            "catsproto.announce": "true",
        }
        if k <= receivers:
            labels["catsproto.receive"] = "true"
        if min_interval:
            labels["catsproto.min-interval"] = min_interval
        if spool_poll is not None:
            labels["catsproto.spool-poll"] = spool_poll
        for j in range(1, instances + 1):
            g = (k - 1) * instances + j
            labels[f"catsproto.instance.s{k}i{j}"] = (
                f"csci={_CSCI_BASE + g}/32 shards={_SHARD_BASE + 16 * g}/28 cs-id=100 site={k}"
            )
        nodes[site_name(k)] = {
            "kind": "linux",
            "env": _Flow(CATSPROTO_NODE=site_name(k)),
            "labels": labels,
        }
        for r, (rr, _) in enumerate(REFLECTORS, 1):
            site_end, rr_end = _link_ends(k, r)
            links.append(
                {
                    "type": "veth",
                    "endpoints": [
                        _Flow(node=site_name(k), interface=f"eth{r}", ipv4=site_end),
                        _Flow(node=rr, interface=f"eth{k}", ipv4=rr_end),
                    ],
                    "vars": _Flow(delay="1ms", rate="1gbit"),
                }
            )
    return {
        "name": name,
        "topology": {
            "kinds": {
                "linux": {
                    "image": "catsproto-node:latest",
                    "cmd": f"catsproto lab node --topology /catsproto/lab/{name}.clab.yml",
                    "binds": [".:/catsproto/lab:ro"],
                }
            },
            "nodes": nodes,
            "links": links,
        },
    }


HEADER = """\
# {sites} sites behind two route reflectors (generated: python -m catsproto.lab.reflectors
# --sites {sites} --instances {instances}). Every site egress s<k> runs ExaBGP for its
# modelled instances and peers over iBGP (AS {asn}) ONLY with rr1 (FRR) and rr2 (BIRD),
# whose route-reflector clients the sites are; there is no full mesh among the sites,
# and the reflectors do not peer with each other, so each site hears every other site's
# advertisements twice, once through each reflector, with ORIGINATOR_ID and CLUSTER_LIST.
# {receive}
# Deploy with containerlab (docs/lab.md) or without Docker: `catsproto lab up lab/{file}`.
"""


def render(doc: dict[str, Any], *, file: str | None = None) -> str:
    """The document as YAML with a header saying what it is."""
    nodes = doc["topology"]["nodes"]
    sites = [n for n in nodes if n.startswith("s")]
    receiving = [n for n in sites if nodes[n]["labels"].get("catsproto.receive") == "true"]
    instances = sum(k.startswith("catsproto.instance.") for k in nodes[sites[0]]["labels"])
    receive = (
        "Every site also receives (its selector's RIB, verified)."
        if len(receiving) == len(sites)
        else f"Sites {', '.join(receiving) or 'none'} also receive (the selector's RIB)."
    )
    header = HEADER.format(
        sites=len(sites),
        instances=instances,
        asn=ASN,
        receive=receive,
        file=file or f"{doc['name']}.clab.yml",
    )
    return header + yaml.dump(
        doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100
    )


@dataclasses.dataclass(frozen=True)
class Reflected:
    """One route as a receiving ExaBGP saw it: the reflection attributes and the cache
    attribute's flags and value (None: the route carried none)."""

    peer: str
    prefix: str
    originator_id: str | None
    cluster_list: tuple[str, ...]
    flags: int | None
    value: bytes | None


def reflected_routes(
    lines: Iterable[str], type_code: int = DEFAULT_ATTRIBUTE_TYPE
) -> dict[tuple[str, str], Reflected]:
    """The routes each peer currently announces, from ExaBGP's JSON lines (`raw.jsonl`
    of a receiving node): ORIGINATOR_ID and CLUSTER_LIST (RFC 4456) as ExaBGP shows them.
    A session going down forgets that peer's routes. Lines that are not JSON are skipped."""
    out: dict[tuple[str, str], Reflected] = {}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        neighbor = obj.get("neighbor") or {}
        peer = str((neighbor.get("address") or {}).get("peer", "?"))
        if obj.get("type") == "state" and neighbor.get("state") == "down":
            out = {k: v for k, v in out.items() if k[0] != peer}
            continue
        update = ((neighbor.get("message") or {}).get("update")) or {}
        if obj.get("type") != "update" or not update:
            continue
        for routes in (update.get("withdraw") or {}).values():
            for r in routes:
                out.pop((peer, r["nlri"]), None)
        attributes = update.get("attribute") or {}
        found = find_attribute(attributes, type_code)
        for by_next_hop in (update.get("announce") or {}).values():
            for routes in by_next_hop.values():
                for r in routes:
                    out[(peer, r["nlri"])] = Reflected(
                        peer,
                        r["nlri"],
                        attributes.get("originator-id"),
                        tuple(attributes.get("cluster-list") or ()),
                        found[0] if found else None,
                        found[1] if found else None,
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a route-reflector lab topology (YAML)")
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--instances", type=int, default=2, help="modelled instances per site")
    p.add_argument("--receivers", type=int, help="how many sites also receive (default all)")
    p.add_argument("--name", default="catsrr")
    p.add_argument("--file", help="the file name the header mentions")
    args = p.parse_args(argv)
    try:
        doc = reflector_topology(
            args.sites, args.instances, name=args.name, receivers=args.receivers
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(doc, file=args.file))
    return 0


if __name__ == "__main__":
    sys.exit(main())

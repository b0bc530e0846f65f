"""A lab topology, read from its containerlab file (the single source of truth).

Strategy: everything the netns runner needs is in the `.clab.yml` in forms containerlab
itself accepts, so the same file deploys with `containerlab deploy`:

* nodes carry labels: `catsproto.role` (`exabgp`, `frr`, `bird`), `catsproto.asn`,
  optionally `catsproto.router-id`, and for ExaBGP nodes `catsproto.announce`,
  `catsproto.receive`, `catsproto.extended-message`, `catsproto.spool-poll` and one
  `catsproto.instance.<name>: "csci=10.1.0.11/32 shards=10.201.11.0/28 cs-id=100 site=1"`
  per modelled inference instance behind that egress (``engine=vllm`` in it: a real
  vLLM engine serves that instance, `catsproto.lab.engine`);
* links use containerlab's extended veth form: per-endpoint `ipv4` addresses, and
  `vars: {delay: 5ms, rate: 1gbit}` for the netem shaping of both directions.

Every link between two BGP nodes is one BGP session: eBGP where the ASNs differ; iBGP
where they are the same, which is allowed only if one end is a route reflector
(`catsproto.route-reflector: "true"`, optionally `catsproto.cluster-id`): its same-AS
peers that are not reflectors themselves are its route-reflector clients (RFC 4456), so
sites peer only with the reflectors and need no full mesh among themselves.
`catsproto.reflect-to: receivers` on a reflector sends nothing to clients that only
announce (no `catsproto.receive`): they have no selector to feed.
This module is pure: `from_dict` takes the parsed YAML; `load` reads the file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

ROLES = ("exabgp", "frr", "bird")
PREFIX = "catsproto."


class TopologyError(ValueError):
    """The topology file cannot be used; the message names the node or link."""


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """A modelled inference instance behind an egress: its own routes and identity."""

    name: str
    csci: ipaddress.IPv4Network  # its CSCI-ID host route
    shards: ipaddress.IPv4Network  # the range its shard routes come from
    cs_id: int
    site_id: int
    engine: str | None = None  # "vllm": a real engine serves it (catsproto.lab.engine)

    @property
    def address(self) -> ipaddress.IPv4Address:
        return self.csci.network_address


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    role: str
    asn: int
    router_id: str | None
    announce: bool = False
    receive: bool = False
    extended_message: bool = True
    min_interval: float = 0.0
    spool_poll: float | None = None  # announce: seconds between spool scans (None: its default)
    graceful_restart: int = 0  # RFC 4724 restart time (s) offered on its sessions; 0: off
    restart_helper: int = 0  # receiver: keep a downed peer's routes this long, stale
    instances: tuple[InstanceSpec, ...] = ()
    route_reflector: bool = False  # RFC 4456: reflects between its same-AS clients
    cluster_id: str | None = None  # RFC 4456 CLUSTER_ID (default: the router-id)
    reflect_to: str = "all"  # reflector: "receivers": clients that do not receive get none


@dataclasses.dataclass(frozen=True)
class Endpoint:
    node: str
    interface: str
    address: ipaddress.IPv4Interface | None


@dataclasses.dataclass(frozen=True)
class Link:
    a: Endpoint
    b: Endpoint
    delay_ms: float = 0.0
    rate: str | None = None

    @property
    def name(self) -> str:
        return f"{self.a.node}:{self.a.interface}--{self.b.node}:{self.b.interface}"


@dataclasses.dataclass(frozen=True)
class Neighbor:
    """One BGP session seen from `local`."""

    local: Endpoint
    remote: Endpoint
    remote_asn: int
    ibgp: bool = False  # same AS at both ends
    rr_client: bool = False  # `local` is a route reflector and `remote` its client
    export_none: bool = False  # `local` (a reflector) sends this client nothing


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    nodes: dict[str, Node]
    links: tuple[Link, ...]

    def neighbors(self, node: str) -> list[Neighbor]:
        out = []
        for link in self.links:
            for local, remote in ((link.a, link.b), (link.b, link.a)):
                if local.node == node and remote.node in self.nodes:
                    if local.address is None or remote.address is None:
                        raise TopologyError(f"link {link.name} between BGP nodes needs addresses")
                    here, there = self.nodes[node], self.nodes[remote.node]
                    out.append(
                        Neighbor(
                            local,
                            remote,
                            there.asn,
                            ibgp=there.asn == here.asn,
                            rr_client=there.asn == here.asn
                            and here.route_reflector
                            and not there.route_reflector,
                            export_none=here.route_reflector
                            and here.reflect_to == "receivers"
                            and there.role == "exabgp"
                            and not there.receive,
                        )
                    )
        return out

    def router_id(self, node: str) -> str:
        n = self.nodes[node]
        if n.router_id:
            return n.router_id
        for nb in self.neighbors(node):
            return str(nb.local.address.ip)  # type: ignore[union-attr]
        raise TopologyError(f"node {node} has no router-id and no addressed link")

    def find_link(self, text: str) -> Link:
        """A link by index, by `node:iface`, or by `nodeA-nodeB`."""
        if text.isdigit() and int(text) < len(self.links):
            return self.links[int(text)]
        for link in self.links:
            ends = {f"{link.a.node}:{link.a.interface}", f"{link.b.node}:{link.b.interface}"}
            if text in ends or text in (
                f"{link.a.node}-{link.b.node}",
                f"{link.b.node}-{link.a.node}",
            ):
                return link
        raise TopologyError(
            f"no link {text!r}; links: "
            + ", ".join(f"{i}={link.a.node}-{link.b.node}" for i, link in enumerate(self.links))
        )


_DURATION = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s)?\s*$")


def parse_delay_ms(text: object) -> float:
    m = _DURATION.match(str(text))
    if not m:
        raise TopologyError(f"delay {text!r} is not like 5ms")
    value, unit = float(m.group(1)), m.group(2) or "ms"
    return value * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def _bool(text: object) -> bool:
    return str(text).strip().lower() in ("1", "true", "yes", "on")


def _instance(node: str, name: str, text: str) -> InstanceSpec:
    fields = dict(part.split("=", 1) for part in str(text).split() if "=" in part)
    try:
        return InstanceSpec(
            name=name,
            csci=ipaddress.IPv4Network(fields["csci"]),
            shards=ipaddress.IPv4Network(fields["shards"]),
            cs_id=int(fields.get("cs-id", 100)),
            site_id=int(fields.get("site", 0)),
            engine=_engine(fields.get("engine")),
        )
    except (KeyError, ValueError) as exc:
        raise TopologyError(
            f"node {node}: instance {name}: {exc} "
            "(want csci=A/32 shards=N/L cs-id=C site=S [engine=vllm])"
        ) from None


ENGINES = ("vllm",)


def _engine(text: str | None) -> str | None:
    if text is None or text == "model":
        return None
    if text not in ENGINES:
        raise ValueError(f"engine={text}: the engines are {', '.join(ENGINES)} (or model)")
    return text


def _node(name: str, spec: dict[str, Any] | None) -> Node | None:
    labels = {
        k[len(PREFIX) :]: v
        for k, v in ((spec or {}).get("labels") or {}).items()
        if k.startswith(PREFIX)
    }
    role = labels.get("role")
    if role is None:
        return None  # not a BGP node of ours (e.g. a host)
    if role not in ROLES:
        raise TopologyError(f"node {name}: role {role!r} is not one of {', '.join(ROLES)}")
    try:
        asn = int(labels["asn"])
    except (KeyError, ValueError):
        raise TopologyError(f"node {name}: label catsproto.asn missing or not a number") from None
    reflector = _bool(labels.get("route-reflector", False))
    if reflector and role not in ("frr", "bird"):
        raise TopologyError(f"node {name}: only frr or bird nodes can be route reflectors")
    cluster_id = labels.get("cluster-id")
    if cluster_id is not None:
        try:
            cluster_id = str(ipaddress.IPv4Address(str(cluster_id)))
        except ValueError:
            raise TopologyError(
                f"node {name}: cluster-id {cluster_id!r} is not an IPv4 address"
            ) from None
    reflect_to = str(labels.get("reflect-to", "all"))
    if reflect_to not in ("all", "receivers"):
        raise TopologyError(f"node {name}: reflect-to {reflect_to!r} is not all or receivers")
    instances = tuple(
        _instance(name, key.split(".", 1)[1], value)
        for key, value in sorted(labels.items())
        if key.startswith("instance.")
    )
    return Node(
        name=name,
        role=role,
        asn=asn,
        router_id=labels.get("router-id"),
        announce=_bool(labels.get("announce", bool(instances))),
        receive=_bool(labels.get("receive", False)),
        extended_message=_bool(labels.get("extended-message", True)),
        min_interval=float(labels.get("min-interval", 0.0)),
        spool_poll=float(labels["spool-poll"]) if "spool-poll" in labels else None,
        graceful_restart=int(labels.get("graceful-restart", 0)),
        restart_helper=int(labels.get("restart-helper", 0)),
        instances=instances,
        route_reflector=reflector,
        cluster_id=cluster_id,
        reflect_to=reflect_to,
    )


def _endpoint(link_no: int, raw: Any) -> Endpoint:
    if isinstance(raw, str):
        node, _, iface = raw.partition(":")
        return Endpoint(node, iface, None)
    if not isinstance(raw, dict) or "node" not in raw or "interface" not in raw:
        raise TopologyError(f"link {link_no}: endpoint {raw!r} needs node and interface")
    addr = raw.get("ipv4")
    return Endpoint(raw["node"], raw["interface"], ipaddress.IPv4Interface(addr) if addr else None)


def from_dict(doc: dict[str, Any]) -> Topology:
    if not isinstance(doc, dict) or "topology" not in doc:
        raise TopologyError("not a containerlab topology (no 'topology' key)")
    topo = doc["topology"]
    all_nodes = topo.get("nodes") or {}
    nodes = {}
    for name, spec in all_nodes.items():
        node = _node(name, spec)
        if node is not None:
            nodes[name] = node
    links = []
    for i, raw in enumerate(topo.get("links") or []):
        ends = [_endpoint(i, e) for e in raw.get("endpoints", [])]
        if len(ends) != 2:
            raise TopologyError(f"link {i}: needs two endpoints")
        short_v4 = raw.get("ipv4") or []
        ends = [
            dataclasses.replace(e, address=ipaddress.IPv4Interface(short_v4[k]))
            if e.address is None and k < len(short_v4) and short_v4[k]
            else e
            for k, e in enumerate(ends)
        ]
        for e in ends:
            if e.node not in all_nodes:
                raise TopologyError(f"link {i}: unknown node {e.node!r}")
        vars_ = raw.get("vars") or {}
        links.append(
            Link(ends[0], ends[1], parse_delay_ms(vars_.get("delay", 0)), vars_.get("rate"))
        )
    result = Topology(str(doc.get("name", "lab")), nodes, tuple(links))
    for name, node in nodes.items():
        for nb in result.neighbors(name):
            if nb.ibgp and not (node.route_reflector or nodes[nb.remote.node].route_reflector):
                raise TopologyError(
                    f"{name} and {nb.remote.node} share AS {node.asn}: eBGP only, or iBGP "
                    "with a route reflector (label catsproto.route-reflector on one end)"
                )
    return result


def load(path: str | Path) -> Topology:
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TopologyError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path} is not YAML: {exc}") from None
    return from_dict(doc)


def with_engines(doc: dict[str, Any], engine: str, sites: list[int], cs_id: int) -> dict[str, Any]:
    """The containerlab document `doc` with the first instance (by name) of each of
    `sites` served by a real `engine` for service `cs_id` (`lab up --engine`): its
    label gains ``engine=ENGINE`` and its ``cs-id`` becomes `cs_id`. A site without an
    instance is a TopologyError; the other instances stay modelled."""
    import copy

    if engine not in ENGINES:
        raise TopologyError(f"engine {engine!r}: the engines are {', '.join(ENGINES)}")
    out = copy.deepcopy(doc)
    nodes = ((out.get("topology") or {}).get("nodes")) or {}
    firsts: dict[int, tuple[str, str, str]] = {}  # site -> (instance, node, label key)
    for node_name, spec in nodes.items():
        for key, value in sorted(((spec or {}).get("labels") or {}).items()):
            if not key.startswith(PREFIX + "instance."):
                continue
            inst = _instance(node_name, key.split(".", 2)[2], value)
            if inst.site_id in sites and (
                inst.site_id not in firsts or inst.name < firsts[inst.site_id][0]
            ):
                firsts[inst.site_id] = (inst.name, node_name, key)
    missing = sorted(set(sites) - set(firsts))
    if missing:
        raise TopologyError(f"--engine: no instance at site(s) {', '.join(map(str, missing))}")
    for _, node_name, key in firsts.values():
        labels = nodes[node_name]["labels"]
        parts = [p for p in str(labels[key]).split() if not p.startswith(("cs-id=", "engine="))]
        labels[key] = " ".join([*parts, f"cs-id={cs_id}", f"engine={engine}"])
    return out

"""Real flows in the lab: the steering API at the ingress, a client behind it, captures.

Strategy. The ingress is the node that receives (e1 in cats4): its ExaBGP receive
process keeps the verified RIB, and `start_steering` runs the steering API
(`catsproto.adapters.steering`) in its namespace on its client-facing address, with a
`SteeringConfig` derived from the topology (graph with the links' delay and rate, the
egress of each site, the ingress's neighbours as next hops, the lab's public keying
secret). The client is the plain host behind the ingress (`client` in cats4): `client`
below runs *in its namespace* (`run_client`) and measures what a user would — the
decision latency through the API and the time until an instance answers the prefill
(time to first token) — once steered, and once sent straight to the nearest site's
instance for comparison. `Capture` runs tcpdump on one link end, by PID.

The API runs with a bearer token (`--api-token-file`, a fresh random token per start,
in the ingress's run directory): the lab's clients read it from there and get whole
decisions; a caller without it gets 401 (docs/steering.md, "Who may ask"). The lab's instances
take a token of their own (`instances_token_file`, one per lab, written by the runner
before they start): the steering API sends it on what it proxies, and the client sends
it when it asks an instance directly.

There is no netem in the lab machines' kernel, so link delays are not applied: the TTFT
a client measures is prefill (and queue) time plus sub-millisecond forwarding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from catsproto.adapters import netns
from catsproto.adapters.file_modes import read_secret_file
from catsproto.adapters.steering import DEFAULT_PORT, SteeringConfig, post_json
from catsproto.lab.errors import LabError
from catsproto.lab.instances import (
    BLOCK_TOKENS,
    DEMO_SECRET,
    DEMO_SECRET_ID,
    INSTANCE_PORT,
    MODEL,
    demo_prompt,
)
from catsproto.lab.steering import lab_links, network_from_topology
from catsproto.lab.topology import Topology


class Lab(Protocol):
    """What this module uses of a running `catsproto.lab.runner.Lab` (the runner calls
    in here, so this side names the shape instead of importing the class)."""

    topology: Topology
    handle: Any
    run_dir: Path

    def rib_file(self, node: str) -> Path: ...
    def node_dir(self, node: str) -> Path: ...
    def wait_for(self, predicate: Any, timeout: float = ..., what: str = ...) -> Any: ...


STEERING_PORT = DEFAULT_PORT


def ingress_node(topology: Topology) -> str:
    for name, node in topology.nodes.items():
        if node.receive:
            return name
    raise LabError("no receiving node: nowhere to run the path selector")


def client_link(topology: Topology, ingress: str) -> tuple[str, str, str]:
    """(host, host address, ingress address) of the ingress's link to a plain host."""
    for link in topology.links:
        for local, remote in ((link.a, link.b), (link.b, link.a)):
            if (
                local.node == ingress
                and remote.node not in topology.nodes
                and local.address
                and remote.address
            ):
                return remote.node, str(remote.address.ip), str(local.address.ip)
    raise LabError(f"{ingress} has no link to a client host")


def is_loopback(lab: Lab) -> bool:
    """Whether the lab runs on loopback (`lab up --embedded`): no namespaces, no transit."""
    return lab.handle.state.info.get("mode") == "embedded"


def steering_config(
    lab: Lab, *, netns_name: str | None = None, ingress: str | None = None
) -> SteeringConfig:
    """The steering API's configuration for the lab's ingress (or another receiving
    node, `ingress`); on a loopback lab the graph is the direct sessions
    (`catsproto.lab.steering.loopback_links`)."""
    topology = lab.topology
    ingress = ingress or ingress_node(topology)
    _, sites = network_from_topology(topology)
    loopback = is_loopback(lab)
    links = lab_links(topology, ingress, loopback=loopback)
    if loopback:  # each speaker on its own 127.0.0.x, next to the receiver
        addresses = lab.handle.state.info.get("addresses", {})
        next_hops = {link.b: addresses.get(link.b, "127.0.0.1") for link in links}
    else:
        next_hops = {
            nb.remote.node: str(nb.remote.address.ip)  # type: ignore[union-attr]
            for nb in topology.neighbors(ingress)
        }
    try:
        _, _, source = client_link(topology, ingress)
    except LabError:
        source = None
    return SteeringConfig(
        ingress=ingress,
        rib_file=str(lab.rib_file(ingress)),
        links=links,
        sites=sites,
        next_hops=next_hops,
        secret=DEMO_SECRET,
        secret_id=DEMO_SECRET_ID,
        model_id=MODEL,
        block_size=BLOCK_TOKENS,
        source=source,
        instance_port=INSTANCE_PORT,
        netns=netns_name,
    )


def api_url(lab: Lab) -> str:
    _, _, address = client_link(lab.topology, ingress_node(lab.topology))
    return f"http://{address}:{STEERING_PORT}"


def api_token_file(lab: Lab) -> Path:
    """The file holding the steering API's bearer token (written by `start_steering`)."""
    return lab.node_dir(ingress_node(lab.topology)) / "steering.token"


def instances_token_file(lab: Lab) -> Path:
    """The file holding the bearer token of the lab's instances (`write_token_file`)."""
    return lab.run_dir / "instances.token"


def write_token_file(path: Path) -> Path:
    """A fresh random bearer token in `path`, readable by its owner only (0600); a file
    left there before is replaced, never reused."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def start_steering(lab: Lab, timeout: float = 15.0) -> netns.Process:
    """The steering API in the ingress's namespace, on its client-facing address, taking
    a fresh bearer token (`api_token_file`) and sending the instances' own
    (`instances_token_file`) on the requests it proxies."""
    ingress = ingress_node(lab.topology)
    _, _, address = client_link(lab.topology, ingress)
    d = lab.node_dir(ingress)
    conf = d / "steering.json"
    conf.write_text(json.dumps(steering_config(lab).to_json()))
    token = write_token_file(api_token_file(lab))
    ready = d / "steering.ready"
    ready.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "catsproto.adapters.steering",
        "--config",
        str(conf),
        "--listen",
        f"{address}:{STEERING_PORT}",
        "--ready",
        str(ready),
        "--api-token-file",
        str(token),
    ]
    if instances_token_file(lab).exists():
        argv += ["--instance-token-file", str(instances_token_file(lab))]
    url = f"http://{address}:{STEERING_PORT}"
    return _start_api(lab, "steering", argv, ready, url, token, timeout)


def _start_api(
    lab: Lab,
    name: str,
    argv: list[str],
    ready: Path,
    url: str,
    token: Path,
    timeout: float,
    node: str | None = None,
) -> netns.Process:
    """Run an API of the ingress node (or `node`; `argv` writes `ready` once it
    listens), note its URL and token file in the lab's state, and wait for it; a
    LabError with its log's tail if it dies first."""
    proc = lab.handle.start(node or ingress_node(lab.topology), name, argv)
    lab.handle.state.info[name] = {"url": url, "token_file": str(token)}
    lab.handle.save()
    lab.wait_for(lambda: ready.exists() or not lab.handle.alive(proc), timeout, name)
    if not ready.exists():
        raise LabError(f"{name} died: {Path(proc.log).read_text()[-2000:]}")
    return proc


INGRESS_PORT = 8000  # the OpenAI-compatible ingress, on the ingress's client-facing address


def ingress_token_file(lab: Lab, node: str | None = None) -> Path:
    """The file holding the ingress's (or `node`'s ingress's) bearer token (the OpenAI
    client's api_key)."""
    return lab.node_dir(node or ingress_node(lab.topology)) / "ingress.token"


def ingress_url(lab: Lab, node: str | None = None) -> str:
    _, _, address = client_link(lab.topology, node or ingress_node(lab.topology))
    return f"http://{address}:{INGRESS_PORT}"


def start_ingress(lab: Lab, timeout: float = 30.0, *, node: str | None = None) -> netns.Process:
    """The OpenAI-compatible ingress (`catsproto ingress serve`) in the ingress's
    namespace, beside the steering API: the engines' model keyed as their C-SMAs key it
    (the lab's secret, the engines' block size), proxied to the engine the selector
    picks, over the path it installs. `node`: another receiving node with a client host
    of its own (`with_second_ingress`), its selector fed by its own RIB."""
    from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, ENGINE_PORT, MODEL_DIR, SERVED_MODEL
    from catsproto.lab.engine_site import ENGINE_CS_ID

    ingress = node or ingress_node(lab.topology)
    _, _, address = client_link(lab.topology, ingress)
    d = lab.node_dir(ingress)
    config = dataclasses.replace(
        steering_config(lab, ingress=ingress),
        model_id=SERVED_MODEL,
        block_size=ENGINE_BLOCK_TOKENS,
        instance_port=ENGINE_PORT,
    )
    conf = d / "ingress.json"
    conf.write_text(json.dumps(config.to_json()))
    token = write_token_file(ingress_token_file(lab, ingress))
    ready = d / "ingress.ready"
    ready.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "catsproto.cli",
        "ingress",
        "serve",
        "--config",
        str(conf),
        "--model",
        f"{SERVED_MODEL}={ENGINE_CS_ID}:{MODEL_DIR}:{ENGINE_PORT}",
        "--listen",
        f"{address}:{INGRESS_PORT}",
        "--api-token-file",
        str(token),
        "--ready",
        str(ready),
    ]
    url = f"http://{address}:{INGRESS_PORT}"
    name = "ingress" if node is None else f"ingress-{ingress}"
    return _start_api(lab, name, argv, ready, url, token, timeout, ingress)


def with_second_ingress(
    doc: dict[str, Any], node: str, host: str, subnet: str = "10.100.4.0/30"
) -> dict[str, Any]:
    """A copy of the topology document `doc` in which `node` (an ExaBGP egress) also
    receives (its own RIB, from BGP like the first ingress's) and has a plain client
    host `host` behind it on `subnet` (the node takes its first address, the host the
    second; the node announces the subnet, as every egress announces its hosts'). Two
    sites then take requests, each at its own path selector."""
    import copy
    import ipaddress

    out = copy.deepcopy(doc)
    nodes = out["topology"]["nodes"]
    if node not in nodes:
        raise LabError(f"with_second_ingress: no node {node!r} in the topology")
    if host in nodes:
        raise LabError(f"with_second_ingress: {host!r} is already a node")
    labels = nodes[node].setdefault("labels", {})
    if labels.get("catsproto.role") != "exabgp":
        raise LabError(f"with_second_ingress: {node} is not an ExaBGP node")
    labels["catsproto.receive"] = "true"
    net = ipaddress.ip_network(subnet)
    first, second = list(net.hosts())[:2]
    nodes[host] = {"kind": "linux", "cmd": "sleep infinity"}
    used = {
        ep["interface"]
        for link in out["topology"]["links"]
        for ep in link["endpoints"]
        if ep["node"] == node
    }
    ifname = next(f"eth{i}" for i in range(1, 64) if f"eth{i}" not in used)
    out["topology"]["links"].append(
        {
            "type": "veth",
            "endpoints": [
                {"node": host, "interface": "eth1", "ipv4": f"{second}/{net.prefixlen}"},
                {"node": node, "interface": ifname, "ipv4": f"{first}/{net.prefixlen}"},
            ],
            "vars": {"delay": "1ms", "rate": "1gbit"},
        }
    )
    return out


def run_client(lab: Lab, argv: list[str], timeout: float = 120.0) -> dict[str, Any]:
    """`flows client ARGV` in the client host's namespace; its JSON result."""
    host, _, _ = client_link(lab.topology, ingress_node(lab.topology))
    out = subprocess.run(
        ["ip", "netns", "exec", lab.handle.ns(host), sys.executable, "-m", __name__, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise LabError(f"client failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


class Capture:
    """tcpdump on one end of a topology link (e.g. "c3-e3"), started and stopped by PID."""

    def __init__(self, lab: Lab, link: str, bpf: str, node: str | None = None) -> None:
        self.lab = lab
        found = lab.topology.find_link(link)
        ends = lab.handle.state.links[lab.topology.links.index(found)]
        self.end = next((e for e in ends if e.node == node), ends[0])
        self.pcap = lab.run_dir / f"{found.a.node}-{found.b.node}.{int(time.time())}.pcap"
        self.bpf = bpf
        self.proc: netns.Process | None = None

    def __enter__(self) -> Capture:
        argv = ["tcpdump", "-i", self.end.ifname, "-U", "-n", "-Z", "root", "-w"]
        self.proc = self.lab.handle.start(
            self.end.node, f"tcpdump-{self.end.ifname}", [*argv, str(self.pcap), self.bpf]
        )
        log = Path(self.proc.log)
        self.lab.wait_for(
            lambda: "listening on" in log.read_text(errors="replace"), 10, "tcpdump to listen"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            time.sleep(0.2)  # let the last segments land
            self.lab.handle.stop(self.proc)
            self.proc = None

    def packets(self) -> list[str]:
        """One text line per captured packet (tcpdump -nn -r)."""
        out = subprocess.run(
            ["tcpdump", "-nn", "-r", str(self.pcap)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return [line for line in out.stdout.splitlines() if line.strip()]


# ---- the client (runs in the client host's namespace) ---------------------------------


def _timed_generate(url: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    status, reply = post_json(url + "/generate", body, timeout=120, token=token)
    ttft = 1000 * (time.perf_counter() - started)
    if status != 200:
        raise SystemExit(f"{url} answered {status}: {reply}")
    return {"url": url, "ttft_ms": round(ttft, 3), "reply": reply}


def _read_token(path: str | None) -> str | None:
    """The bearer token in `path` (refused if group or others may read the file)."""
    return read_secret_file(path, "API token file").decode().strip() if path else None


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flows client", description="a client behind the ingress")
    p.add_argument("--api", required=True, help="the steering API, http://ADDRESS:PORT")
    p.add_argument("--site", type=int, required=True, help="send site N's demo conversation")
    p.add_argument("--cs-id", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3, help="steered requests")
    p.add_argument("--compare", action="append", default=[], help="instance URL to compare")
    p.add_argument("--proxy", action="store_true", help="also once through POST /generate")
    p.add_argument("--api-token-file", help="the API's bearer token (whole decisions)")
    p.add_argument(
        "--instance-token-file", help="the instances' bearer token (for the direct requests)"
    )
    args = p.parse_args(argv)
    token = _read_token(args.api_token_file)
    instance_token = _read_token(args.instance_token_file)
    tokens = demo_prompt(args.site)
    body = {"cs_id": args.cs_id, "prompt_token_ids": tokens}
    result: dict[str, Any] = {"prompt_tokens": len(tokens), "decisions": [], "steered": []}
    for _ in range(args.repeat):
        started = time.perf_counter()
        status, decision = post_json(args.api + "/decide", body, timeout=30, token=token)
        api_ms = 1000 * (time.perf_counter() - started)
        if status != 200:
            raise SystemExit(f"steering API answered {status}: {decision}")
        decision["client_api_ms"] = round(api_ms, 3)
        result["decisions"].append(decision)
        result["steered"].append(
            _timed_generate(decision["url"], {"prompt_token_ids": tokens}, instance_token)
        )
    if args.proxy:  # once more through the API's proxy: decide, install, forward
        result["proxied"] = _timed_generate(args.api, body, token)
    result["nearest"] = [
        _timed_generate(url, {"prompt_token_ids": tokens}, instance_token) for url in args.compare
    ]
    json.dump(result, sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "client":
        print("usage: python -m catsproto.lab.flows client --api URL --site N ...", file=sys.stderr)
        return 2
    return client_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

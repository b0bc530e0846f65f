"""What every fault scenario needs: the chaos lab up with trust, faults, a request driver.

Strategy: a scenario is a plain function that brings `lab/faults/chaos.clab.yml` up
through `catsproto.lab.runner` (namespaces, FRR, BIRD, ExaBGP), injects one kind of
fault with the tools here (kill -9 of a process group, restart of a daemon with its
rendered configuration, a link set down with pyroute2, a link squeezed with tbf) and
watches two things at the receiver `rcv`, where the selector sits: its RIB
(`rib.json`) and its event log (`events.jsonl`: accepts, withdrawals, treat-as-withdraw
with the reason, session changes). A `Steerer` thread asks the path selector for a
decision every `period` seconds from the RIB as it is at that moment, with the path
costs of the BGP paths the receiver actually holds (AS_PATH mapped back to lab nodes),
so a scenario can count requests steered to a dead instance or over a cut link.
Everything is torn down by PID in `ChaosLab.__exit__`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from pyroute2 import NetNS

from catsproto.adapters import netns
from catsproto.lab import configs, runner
from catsproto.lab.instances import BLOCK_TOKENS, write_lab_trust
from catsproto.lab.steering import rate_mbps, rib_from_receiver
from catsproto.lab.topology import InstanceSpec
from catsproto.selector import Link, Network, NoInstanceError, PathSelector, Request, SelectorConfig

CHAOS_TOPOLOGY = Path(__file__).resolve().parents[3] / "lab" / "faults" / "chaos.clab.yml"
RECEIVER = "rcv"
HOSTILE = "evil"
HOLD_TIME_S = 9.0  # configs.py: ExaBGP hold-time 9, FRR timers 3 9, BIRD hold time 9
_labs = itertools.count()


@dataclasses.dataclass
class Result:
    """One scenario's outcome: named checks, the headline figures and the details."""

    scenario: str
    title: str
    checks: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    time_label: str = ""
    time_s: float | None = None
    misrouted: int | None = None
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    def check(self, name: str, ok: bool) -> bool:
        self.checks.append((name, bool(ok)))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(ok for _, ok in self.checks)

    def failed_checks(self) -> list[str]:
        return [name for name, ok in self.checks if not ok]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["checks"] = [{"check": n, "ok": ok} for n, ok in self.checks]
        out["passed"] = self.passed
        return out


def reason_of(text: str) -> str:
    """The reason name of a receiver event: 'malformed', or the security reason."""
    if text.startswith("malformed"):
        return "malformed"
    if text.startswith("not verified: "):
        return text[len("not verified: ") :].split(":", 1)[0].strip()
    return text.split(":", 1)[0].strip() or "?"


def rejected_by_reason(events: Iterable[dict[str, Any]], peer: str | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        if e.get("kind") == "treat-as-withdraw" and (peer is None or e.get("peer") == peer):
            r = reason_of(e.get("reason", ""))
            out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One decision of the request driver."""

    time: float
    chosen: str | None  # instance address, None: no instance
    path: tuple[str, ...]
    origins: frozenset[str]  # instance addresses the RIB held then


class ChaosLab:
    """The chaos topology, up, with the receiver trusting the instances' lab keys."""

    def __init__(self, root: str | Path, topology: str | Path = CHAOS_TOPOLOGY) -> None:
        self.root = Path(root)
        self.topology_path = Path(topology)
        self._lab: runner.Lab | None = None
        self.tag = f"f{os.getpid() % 1_000_000}{next(_labs) % 10}"

    def __enter__(self) -> ChaosLab:
        self._lab = runner.up(self.topology_path, self.root, tag=self.tag)
        try:
            write_lab_trust(
                self._lab.topology,
                str(self._lab.node_dir(RECEIVER) / "trust.json"),
                int(time.time() * 1000),
            )
        except BaseException:
            self._lab.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lab is not None:
            self._lab.down()
            leftover = netns.leftover_namespaces(self.tag)
            if leftover:  # pragma: no cover - reported, never silently kept
                raise RuntimeError(f"namespaces left behind: {leftover}")

    # ---- the topology ------------------------------------------------------------------
    @property
    def lab(self) -> runner.Lab:
        """The running lab (runner.Lab)."""
        assert self._lab is not None, "use ChaosLab as a context manager"
        return self._lab

    def instance(self, name: str) -> tuple[str, InstanceSpec]:
        for node_name, node in self.lab.topology.nodes.items():
            for spec in node.instances:
                if spec.name == name:
                    return node_name, spec
        raise KeyError(name)

    def address_of(self, node: str, peer: str) -> str:
        """The address `node` has on its link to `peer`."""
        for link in self.lab.topology.links:
            ends = {link.a.node: link.a, link.b.node: link.b}
            if set(ends) == {node, peer}:
                return str(ends[node].address.ip)  # type: ignore[union-attr]
        raise KeyError(f"no link {node}-{peer}")

    def node_of_address(self) -> dict[str, str]:
        out = {}
        for link in self.lab.topology.links:
            for end in (link.a, link.b):
                if end.address is not None:
                    out[str(end.address.ip)] = end.node
        return out

    def link_delays(self) -> dict[frozenset[str], tuple[float, float]]:
        return {
            frozenset((link.a.node, link.b.node)): (link.delay_ms, rate_mbps(link.rate))
            for link in self.lab.topology.links
        }

    # ---- instances and the receiver ----------------------------------------------------
    def start_feeder(self, instance: str, interval: float = 0.5, **extra: Any) -> netns.Process:
        node, _ = self.instance(instance)
        argv = [
            sys.executable,
            "-m",
            "catsproto.lab.faults.feeder",
            "--topology",
            str(self.topology_path.resolve()),
            "--instance",
            instance,
            "--spool",
            str(self.lab.node_dir(node) / "spool"),
            "--interval",
            str(interval),
        ]
        for key, value in extra.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        return self.lab.handle.start(node, f"feeder-{instance}", argv)

    def publish(self, instance: str, sequence: int) -> dict[str, str]:
        """Publish the instance's signed routes at `sequence` once (static state)."""
        from catsproto.lab.faults.feeder import signed_routes

        node, spec = self.instance(instance)
        routes = signed_routes(self.lab.topology, spec, sequence, int(time.time() * 1000))
        spool = self.lab.spool(node)
        for prefix, value in routes.items():
            spool.publish(prefix, value)
        return {str(p): v.hex() for p, v in routes.items()}

    def routes(self) -> list[dict[str, Any]]:
        return self.lab.routes(RECEIVER)

    def rib_keys(self) -> frozenset[tuple[str, str, str]]:
        return frozenset((r["peer"], r["prefix"], r["value"]) for r in self.routes())

    def events(self) -> list[dict[str, Any]]:
        """The receiver's events.jsonl, without a line still being written (runner's
        `Lab.events` raises on that half line)."""
        try:
            text = (self.lab.node_dir(RECEIVER) / "rib" / "events.jsonl").read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break  # the line being appended: read it next time
        return out

    def origins(self, peer: str | None = None) -> set[str]:
        return {r["origin"] for r in self.routes() if peer is None or r["peer"] == peer}

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return self.lab.wait_for(predicate, timeout, what)

    def wait_stable(self, settle: float = 1.0, timeout: float = 30.0) -> frozenset:
        """The receiver's RIB once it has not changed for `settle` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.rib_keys(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.rib_keys()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= settle:
                return now
        raise runner.LabError(f"receiver RIB still changing after {timeout:g}s")

    def receiver_sessions(self) -> dict[str, str]:
        return dict(self.lab.rib(RECEIVER).get("sessions", {}))

    def transit_peers(self) -> list[str]:
        """Addresses of the receiver's transit peers (t1, t2), as its events name them."""
        return [self.address_of(t, RECEIVER) for t in ("t1", "t2")]

    def session_downs(
        self, since: float, peers: Iterable[str] | None = None
    ) -> list[dict[str, Any]]:
        """Session-down events at the receiver since `since` (default: transit peers)."""
        wanted = set(self.transit_peers() if peers is None else peers)
        return [
            e
            for e in self.events()
            if e.get("kind") == "session"
            and e.get("reason") == "down"
            and e.get("time", 0) >= since
            and e.get("peer") in wanted
        ]

    # ---- processes ---------------------------------------------------------------------
    def process(self, node: str, name: str) -> netns.Process:
        for p in self.lab.handle.state.processes:
            if p.node == node and p.name == name:
                return p
        raise KeyError(f"no process {name} on {node}")

    def kill9(self, node: str, name: str) -> float:
        """SIGKILL the process group (daemon and its helpers); returns when it was sent."""
        proc = self.process(node, name)
        at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.lab.handle.stop(proc, timeout=2)  # reap and forget
        return at

    def kill9_exabgp(self, node: str) -> float:
        """SIGKILL ExaBGP and its API processes: ExaBGP starts those in process groups of
        their own, so killing its group alone would leave them polling the spool."""
        helpers = self.pids_with("catsproto.adapters.exabgp_", str(self.lab.node_dir(node)))
        at = self.kill9(node, "exabgp")
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return at

    def restart_exabgp(self, node: str) -> float:
        d = self.lab.node_dir(node)
        at = time.time()
        self.lab.handle.start(
            node, "exabgp", [runner.exabgp_binary(), str(d / "exabgp.conf")], env=configs.EXABGP_ENV
        )
        return at

    def restart_frr(self, node: str) -> float:
        """zebra then bgpd again, with the configuration rendered at `up`."""
        conf = runner.FRR_RUN / self.lab.frr_pathspace(node)
        at = time.time()
        for daemon in ("zebra", "bgpd"):
            argv = [str(runner.FRR_BIN / daemon), "-N", self.lab.frr_pathspace(node)]
            argv += ["-f", str(conf / f"{daemon}.conf"), "-P", "0", "--log", "stdout"]
            self.lab.handle.start(node, daemon, argv)
            if daemon == "zebra":
                time.sleep(0.3)  # zserv.api is re-created; bgpd retries the connection anyway
        return at

    def restart_bird(self, node: str) -> float:
        d = self.lab.node_dir(node)
        at = time.time()
        self.lab.handle.start(
            node, "bird", ["bird", "-f", "-c", str(d / "bird.conf"), "-s", str(d / "bird.ctl")]
        )
        return at

    def pids_with(self, *needles: str) -> list[int]:
        """PIDs whose command line contains every needle."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.append(int(entry))
        return out

    def receive_process_pid(self) -> int | None:
        """The receiver's ExaBGP API process (its RIB, the selector's view)."""
        out = str(self.lab.node_dir(RECEIVER) / "rib")
        pids = self.pids_with("catsproto.adapters.exabgp_receive", out)
        return pids[0] if pids else None

    # ---- links -------------------------------------------------------------------------
    def link_ends(self, a: str, b: str) -> tuple[netns.LinkEnd, netns.LinkEnd]:
        for ends in self.lab.handle.state.links:
            if {ends[0].node, ends[1].node} == {a, b}:
                return ends
        raise KeyError(f"no link {a}-{b}")

    def set_link(self, a: str, b: str, up: bool) -> float:
        """Both veth ends up or down (pyroute2); returns when it was done."""
        at = time.time()
        for end in self.link_ends(a, b):
            with NetNS(self.lab.handle.ns(end.node)) as ns:
                idx = ns.link_lookup(ifname=end.ifname)[0]
                ns.link("set", index=idx, state="up" if up else "down")
        return at

    def squeeze(self, a: str, b: str, rate: str | None) -> str:
        """Replace the root qdisc of both ends with a tiny tbf (rate, one-packet queue):
        a congestion-loss burst where netem is missing. rate None restores 1gbit."""
        applied = []
        for end in self.link_ends(a, b):
            argv = ["tc", "qdisc", "replace", "dev", end.ifname, "root", "tbf"]
            if rate is None:
                argv += ["rate", "1gbit", "burst", "131072", "latency", "50ms"]
            else:
                argv += ["rate", rate, "burst", "1600", "limit", "1600"]
            out = subprocess.run(
                ["ip", "netns", "exec", self.lab.handle.ns(end.node), *argv],
                capture_output=True,
                text=True,
                check=False,
            )
            applied.append(out.stderr.strip() or "ok")
        return "; ".join(applied)


def _drops(text: str) -> int:
    words = text.replace(",", " ").replace("(", " ").split()
    return sum(int(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "dropped")


def qdisc_drops(lab: ChaosLab, a: str, b: str) -> int:
    """Packets the root qdiscs of link a-b dropped so far (both ends)."""
    total = 0
    for end in lab.link_ends(a, b):
        show = ["tc", "-s", "qdisc", "show", "dev", end.ifname]
        out = subprocess.run(
            ["ip", "netns", "exec", lab.lab.handle.ns(end.node), *show],
            capture_output=True,
            text=True,
            check=False,
        )
        total += _drops(out.stdout)
    return total


def netem_available(lab: ChaosLab) -> bool:
    """Whether this kernel has sch_netem (the runner records what shaping it applied)."""
    shaping = lab.lab.handle.state.info.get("shaping", {})
    return any(str(v).startswith("netem") for v in shaping.values())


# ---- the request driver -----------------------------------------------------------------


def network_from_bgp(lab: ChaosLab, rib_json: dict[str, Any]) -> Network:
    """The selector's graph: every link on a BGP path the receiver holds (AS_PATH mapped
    back to lab nodes), with the topology's delays and rates. A cut link whose routes
    are not yet withdrawn is still there: that is what the selector knows."""
    by_address = lab.node_of_address()
    by_asn = {n.asn: name for name, n in lab.lab.topology.nodes.items()}
    delays = lab.link_delays()
    links: dict[frozenset[str], Link] = {}
    for route in rib_json.get("routes", []):
        hops = [RECEIVER, by_address.get(route["peer"], "?")]
        hops += [by_asn.get(asn, "?") for asn in route.get("as_path", [])[1:]]
        pairs = [frozenset(p) for p in itertools.pairwise(hops)]
        if all(p in delays for p in pairs):
            for p in pairs:
                a, b = sorted(p)
                links[p] = Link(a, b, *delays[p])
    return Network(links.values())


class Steerer(threading.Thread):
    """Asks the selector where one request goes, every `period` seconds, from the RIB
    the receiver holds at that moment; keeps every answer."""

    def __init__(
        self, lab: ChaosLab, keys: np.ndarray, cs_id: int = 100, period: float = 0.05
    ) -> None:
        super().__init__(daemon=True)
        self.lab, self.keys, self.cs_id, self.period = lab, keys, cs_id, period
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()
        self.sites = {
            spec.site_id: name
            for name, node in lab.lab.topology.nodes.items()
            for spec in node.instances
        }

    def decide_once(self) -> Sample:
        now = time.time()
        rib_json = self.lab.lab.rib(RECEIVER)
        origins = frozenset(r["origin"] for r in rib_json.get("routes", []))
        rib = rib_from_receiver(rib_json, int(now * 1000))
        selector = PathSelector(
            rib, network_from_bgp(self.lab, rib_json), SelectorConfig(site_nodes=self.sites)
        )
        request = Request(self.cs_id, self.keys, max(len(self.keys), 24) * BLOCK_TOKENS, RECEIVER)
        try:
            d = selector.decide(request, int(now * 1000))
        except NoInstanceError:
            return Sample(now, None, (), origins)
        return Sample(now, str(d.chosen.address), tuple(d.chosen.path), origins)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.samples.append(self.decide_once())
            except Exception as exc:  # counted; the campaign goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop_event.wait(self.period)

    def stop(self) -> list[Sample]:
        self._stop_event.set()
        self.join(timeout=5)
        return list(self.samples)

    def wait_choice(self, address: str, timeout: float = 30.0) -> None:
        self.lab.wait_for(
            lambda: self.samples and self.samples[-1].chosen == address,
            timeout,
            f"the selector choosing {address}",
        )


def uses_link(path: tuple[str, ...], a: str, b: str) -> bool:
    return any({x, y} == {a, b} for x, y in itertools.pairwise(path))


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def prefix_of(address: str) -> str:
    return str(ipaddress.ip_network(address))

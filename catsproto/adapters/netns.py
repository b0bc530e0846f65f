"""Network namespaces, veth links, netem and daemon processes for the lab (pyroute2).

Strategy: one `NetnsLab` per running lab, named by a tag derived from the PID of the
process that built it (`c<pid>`), and that tag is in every name it creates — namespace
names (`c<pid>-<node>`), interface names (`c<pid>l<n>a`, at most 15 characters) and the
run directory — so two labs never clash and teardown can never touch anything else.
Everything the lab owns is written to `state.json` in its run directory as soon as it
exists, so a later process (`catsproto lab down`) tears the lab down from that file:
SIGTERM to each daemon's process group (every daemon is started with
`start_new_session=True`, so its PID is its group), a short wait, SIGKILL, then the
namespaces (which takes their veth ends with them) and FRR's `/var/run/frr/<tag>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pyroute2 import IPRoute, NetlinkError, NetNS, netns

IFNAME_MAX = 15
STATE_FILE = "state.json"


def lab_tag(pid: int | None = None) -> str:
    """The unique tag of a lab built by process `pid` (default: this process)."""
    return f"c{os.getpid() if pid is None else pid}"


@dataclasses.dataclass
class Process:
    """A daemon started in a namespace; `pid` is also its process-group id."""

    node: str
    name: str
    pid: int
    log: str


@dataclasses.dataclass
class LinkEnd:
    node: str
    ifname: str  # the name inside the namespace (tagged)
    label: str  # the containerlab name, e.g. eth1
    address: str | None  # CIDR, e.g. 10.0.12.1/30


@dataclasses.dataclass
class State:
    """What a lab owns: enough to tear it down from another process."""

    tag: str
    run_dir: str
    topology: str = ""
    owner_pid: int = 0
    namespaces: list[str] = dataclasses.field(default_factory=list)
    links: list[tuple[LinkEnd, LinkEnd]] = dataclasses.field(default_factory=list)
    processes: list[Process] = dataclasses.field(default_factory=list)
    extra_dirs: list[str] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> State:
        obj = dict(obj)
        obj["links"] = [(LinkEnd(**a), LinkEnd(**b)) for a, b in obj.get("links", [])]
        obj["processes"] = [Process(**p) for p in obj.get("processes", [])]
        return cls(**obj)


def load_state(run_dir: str | Path) -> State:
    return State.from_json(json.loads((Path(run_dir) / STATE_FILE).read_text()))


class NetnsLab:
    """Builds namespaces and links, starts processes in them, and tears all of it down."""

    def __init__(
        self,
        run_dir: str | Path,
        tag: str | None = None,
        topology: str = "",
        *,
        namespaced: bool = True,
    ) -> None:
        """namespaced=False runs processes in the current namespace (the no-root mode)."""
        self.namespaced = namespaced
        self.tag = tag or lab_tag()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state = State(self.tag, str(self.run_dir), topology, os.getpid())
        self._popen: dict[int, subprocess.Popen] = {}
        self.save()

    @classmethod
    def attach(cls, state: State) -> NetnsLab:
        """A handle on a lab built by another process, from its saved state."""
        lab = cls.__new__(cls)
        lab.tag, lab.run_dir, lab.state, lab._popen = state.tag, Path(state.run_dir), state, {}
        lab.namespaced = bool(state.namespaces)
        return lab

    # ---- names ---------------------------------------------------------------------
    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def _ifname(self, link_index: int, side: str) -> str:
        name = f"{self.tag}l{link_index}{side}"
        if len(name) > IFNAME_MAX:
            raise ValueError(f"interface name {name!r} longer than {IFNAME_MAX} characters")
        return name

    def save(self) -> None:
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state.to_json(), indent=1))
        tmp.replace(self.run_dir / STATE_FILE)

    # ---- topology ------------------------------------------------------------------
    def add_node(self, node: str) -> str:
        """Create the node's namespace and bring its loopback up."""
        name = self.ns(node)
        netns.create(name)
        self.state.namespaces.append(name)
        self.save()
        with NetNS(name) as ns:
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        return name

    def add_loopback_address(self, node: str, address: str) -> None:
        iface = ipaddress.ip_interface(address)
        with NetNS(self.ns(node)) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.addr("add", index=lo, address=str(iface.ip), prefixlen=iface.network.prefixlen)

    def add_link(
        self,
        a: tuple[str, str, str | None],
        b: tuple[str, str, str | None],
        *,
        delay_ms: float = 0.0,
        rate: str | None = None,
    ) -> tuple[LinkEnd, LinkEnd]:
        """A veth pair between nodes a and b: (node, containerlab interface, CIDR) each.

        netem (delay and rate) goes on both ends, so each direction sees it once.
        """
        index = len(self.state.links)
        ends = (
            LinkEnd(a[0], self._ifname(index, "a"), a[1], a[2]),
            LinkEnd(b[0], self._ifname(index, "b"), b[1], b[2]),
        )
        with IPRoute() as ip:
            ip.link("add", ifname=ends[0].ifname, kind="veth", peer=ends[1].ifname)
            self.state.links.append(ends)
            self.save()
            for end in ends:
                idx = ip.link_lookup(ifname=end.ifname)[0]
                ip.link("set", index=idx, net_ns_fd=self.ns(end.node))
        for end in ends:
            with NetNS(self.ns(end.node)) as ns:
                idx = ns.link_lookup(ifname=end.ifname)[0]
                if end.address:
                    iface = ipaddress.ip_interface(end.address)
                    ns.addr(
                        "add", index=idx, address=str(iface.ip), prefixlen=iface.network.prefixlen
                    )
                ns.link("set", index=idx, state="up")
                if delay_ms or rate:
                    shaped = shape(ns, idx, delay_ms, rate)
                    self.state.info.setdefault("shaping", {})[end.ifname] = shaped
        self.save()
        return ends

    # ---- processes -----------------------------------------------------------------
    def start(
        self,
        node: str,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> Process:
        """Run `argv` in the node's namespace in a new session, logging to the run dir."""
        log = self.run_dir / f"{node}.{name}.log"
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [*self._prefix(node), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        self._popen[popen.pid] = popen
        proc = Process(node, name, popen.pid, str(log))
        self.state.processes.append(proc)
        self.save()
        return proc

    def _prefix(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(node)] if self.namespaced else []

    def run(self, node: str, argv: Sequence[str], timeout: float = 10.0) -> str:
        """Run a short command in the node's namespace and return its stdout."""
        out = subprocess.run(
            [*self._prefix(node), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return out.stdout

    def stop(self, proc: Process, timeout: float = 5.0) -> None:
        """Stop one process group (SIGTERM, then SIGKILL) and forget it."""
        stop_groups([proc.pid], timeout, self._popen)
        self.state.processes = [p for p in self.state.processes if p.pid != proc.pid]
        self.save()

    def alive(self, proc: Process) -> bool:
        popen = self._popen.get(proc.pid)
        if popen is not None:
            return popen.poll() is None
        return pid_alive(proc.pid)

    def teardown(self) -> None:
        teardown(self.state, self._popen)
        self._popen.clear()


def shape(ns: NetNS, index: int, delay_ms: float, rate: str | None) -> str:
    """Put netem (delay, rate) on an interface; without sch_netem, tbf for the rate only.

    Returns what was applied, e.g. "netem delay 5ms rate 1gbit" or
    "tbf rate 1gbit (no netem in this kernel: delay not applied)".
    """
    params: dict = {"delay": int(delay_ms * 1000)}
    if rate:
        params["rate"] = rate
    try:
        ns.tc("add", "netem", index=index, handle="1:", **params)
        return f"netem delay {delay_ms:g}ms" + (f" rate {rate}" if rate else "")
    except NetlinkError:
        pass  # kernels built without sch_netem answer ENOENT or ERANGE
    if not rate:
        return "none (no netem in this kernel: delay not applied)"
    ns.tc("add", "tbf", index=index, handle="1:", rate=rate, burst=131072, latency=50_000)
    return f"tbf rate {rate} (no netem in this kernel: delay not applied)"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie we no longer own counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # only zombies left?
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_groups(
    pgids: Sequence[int],
    timeout: float = 5.0,
    popen: Mapping[int, subprocess.Popen] | None = None,
) -> None:
    """SIGTERM every process group, wait up to `timeout`, SIGKILL what is left."""
    popen = popen or {}
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    pending = list(pgids)
    while pending and time.monotonic() < deadline:
        for pgid in list(pending):
            if pgid in popen:
                popen[pgid].poll()
            if not group_alive(pgid):
                pending.remove(pgid)
        if pending:
            time.sleep(0.05)
    for pgid in pending:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for pgid in pgids:
        if pgid in popen:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen[pgid].wait(timeout=2)


def teardown(state: State, popen: Mapping[int, subprocess.Popen] | None = None) -> None:
    """Stop every process of the lab, remove its namespaces and extra directories."""
    try:
        stop_groups([p.pid for p in state.processes], popen=popen)
    finally:
        existing = set(netns.listnetns()) if state.namespaces else set()
        for name in state.namespaces:
            if name in existing and name.startswith(state.tag + "-"):
                with contextlib.suppress(OSError):
                    netns.remove(name)
        # veth ends left in the root namespace by a build that failed half way
        with IPRoute() if state.links else contextlib.nullcontext() as ip:
            for a, b in state.links:
                for end in (a, b):
                    for idx in ip.link_lookup(ifname=end.ifname):
                        with contextlib.suppress(Exception):
                            ip.link("del", index=idx)
        for d in state.extra_dirs:
            if state.tag in d:
                shutil.rmtree(d, ignore_errors=True)
        state.processes.clear()
        state.namespaces.clear()


def leftover_namespaces(tag: str) -> list[str]:
    return [n for n in netns.listnetns() if n.startswith(tag + "-")]

"""Inside a containerlab node: wait for the links, configure and shape them, run the daemons.

The node image's command is `catsproto lab node --topology /catsproto/lab/X.clab.yml`
with `CATSPROTO_NODE` set per node (see the topology files), so containerlab and the
netns runner read the same file. containerlab starts the container first and adds its
links afterwards, as veth ends renamed to the endpoints' names (eth1, ...), and says how
many there will be in `CLAB_INTFS`; it sets no address on a linux node's endpoints (its
documentation and issue srl-labs/containerlab#3189). So the node, in this order:

1. waits until every interface the topology gives it exists (and at least CLAB_INTFS
   of them), up to `--wait` seconds;
2. configures what the netns runner configures from outside: the endpoints' `ipv4:`
   addresses (those not already set), links and `lo` up, forwarding on, its instances'
   addresses on `lo`, and a default route for a plain host or an egress that only
   announces (`catsproto.lab.runner`, "The data plane follows BGP");
3. shapes its side of each link from the link's `vars` (netem, or tbf without netem);
4. renders its daemons' configs under /var/lib/catsproto and runs them in the foreground
   (FRR: zebra, then bgpd once zebra's socket exists), until one exits or a SIGTERM
   (`docker stop`, `containerlab destroy`) comes: then it stops them and exits 0.

A node without a role (a plain host such as cats4's `client`) stops after step 3 and
waits for SIGTERM. Every line goes out unbuffered, so `docker logs` shows it as it
happens. `CATSPROTO_SEAL=true` on a receiving node gives its receive process the lab's
group key (written 0600 to /var/lib/catsproto/group.key), as `lab up --seal` does.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pyroute2 import IPRoute

from catsproto.adapters.netns import shape
from catsproto.lab import configs
from catsproto.lab.errors import LabError
from catsproto.lab.runner import FRR_BIN, FRR_RUN, exabgp_binary, gateway, host_nodes
from catsproto.lab.topology import Topology, load

STATE = Path("/var/lib/catsproto")
SYS_NET = Path("/sys/class/net")
WAIT_S = 300.0  # for the links, as long as containerlab's own images wait for theirs


def say(text: str) -> None:
    print(f"node: {text}", flush=True)


def interfaces_of(topology: Topology, node: str) -> list[str]:
    """The node's link interfaces in the topology, in file order."""
    return [
        end.interface for link in topology.links for end in (link.a, link.b) if end.node == node
    ]


def wait_for_interfaces(
    names: Iterable[str],
    expected: int = 0,
    timeout: float = WAIT_S,
    sys_net: Path = SYS_NET,
    stop: threading.Event | None = None,
) -> float:
    """Wait until every interface in `names` exists and at least `expected` besides `lo`
    and `eth0` (containerlab's management interface); returns the seconds waited. A
    LabError names the missing ones after `timeout`."""
    wanted = list(names)
    started = time.monotonic()
    told = False
    while True:
        present = set(os.listdir(sys_net)) if sys_net.is_dir() else set()
        missing = [n for n in wanted if n not in present]
        data = len(present - {"lo", "eth0"})
        if not missing and data >= expected:
            return time.monotonic() - started
        if not told:
            what = ", ".join(missing) or f"{expected} interfaces"
            say(f"waiting for {what} (CLAB_INTFS={expected})")
            told = True
        if time.monotonic() - started > timeout:
            raise LabError(
                f"interfaces {', '.join(missing) or '?'} did not appear in {timeout:g} s "
                f"({data} of CLAB_INTFS={expected} present)"
            )
        if stop is not None and stop.wait(0.1):
            raise LabError("stopped while waiting for the interfaces")
        if stop is None:
            time.sleep(0.1)


def configure(topology: Topology, node: str) -> list[str]:
    """Addresses, links up, forwarding, instance addresses, default route (see above);
    returns one line per thing done."""
    done = []
    n = topology.nodes.get(node)
    with IPRoute() as ip:
        lo = ip.link_lookup(ifname="lo")[0]
        ip.link("set", index=lo, state="up")
        for link in topology.links:
            for end in (link.a, link.b):
                if end.node != node:
                    continue
                idx = ip.link_lookup(ifname=end.interface)[0]
                if end.address is not None:
                    have = {
                        (a.get_attr("IFA_ADDRESS"), a["prefixlen"])
                        for a in ip.get_addr(index=idx, family=2)
                    }
                    if (str(end.address.ip), end.address.network.prefixlen) not in have:
                        ip.addr(
                            "add",
                            index=idx,
                            address=str(end.address.ip),
                            prefixlen=end.address.network.prefixlen,
                        )
                        done.append(f"{end.interface}: address {end.address}")
                ip.link("set", index=idx, state="up")
        for spec in n.instances if n else ():
            net = ipaddress.ip_interface(str(spec.csci))
            ip.addr("replace", index=lo, address=str(net.ip), prefixlen=net.network.prefixlen)
            done.append(f"lo: instance {spec.name} at {spec.csci}")
        if n is None or (n.role == "exabgp" and not n.receive):
            via = gateway(topology, node)
            if via is not None:
                ip.route("replace", dst="0.0.0.0/0", gateway=via)
                done.append(f"default route via {via}")
    if n is not None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        done.append("forwarding on")
    return done


def shape_links(topology: Topology, node: str) -> list[str]:
    out = []
    with IPRoute() as ip:
        for link in topology.links:
            for end in (link.a, link.b):
                if end.node != node or not (link.delay_ms or link.rate):
                    continue
                for idx in ip.link_lookup(ifname=end.interface):
                    out.append(f"{end.interface}: {shape(ip, idx, link.delay_ms, link.rate)}")
    return out


def write_group_key(topology: Topology, path: Path) -> Path:
    """The lab's group key (`lab_group_keys`: lab only, derived from the topology), 0600."""
    from catsproto.lab.instances import lab_group_keys

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(lab_group_keys(topology).active.to_json(), out)
    return path


def commands(topology: Topology, node: str, state: Path, *, seal: bool = False) -> list[list[str]]:
    """The daemons of `node`, in start order, with their configs written under `state`."""
    n = topology.nodes[node]
    state.mkdir(parents=True, exist_ok=True)
    if n.role == "frr":
        (state / "zebra.conf").write_text(configs.frr_zebra_conf(node))
        (state / "bgpd.conf").write_text(configs.frr_bgpd_conf(topology, node))
        import pwd

        frr = pwd.getpwnam("frr")
        for p in (state, state / "zebra.conf", state / "bgpd.conf"):
            os.chown(p, frr.pw_uid, frr.pw_gid)
        return [
            [str(FRR_BIN / "zebra"), "-f", str(state / "zebra.conf"), "--log", "stdout"],
            [str(FRR_BIN / "bgpd"), "-f", str(state / "bgpd.conf"), "--log", "stdout"],
        ]
    if n.role == "bird":
        (state / "bird.conf").write_text(configs.bird_conf(topology, node))
        return [["bird", "-f", "-c", str(state / "bird.conf"), "-s", str(state / "bird.ctl")]]
    (state / "spool").mkdir(exist_ok=True)
    (state / "rib").mkdir(exist_ok=True)
    group_key = None
    if seal and n.receive:
        group_key = str(write_group_key(topology, state / "group.key"))
    conf = configs.exabgp_conf(
        topology,
        node,
        python=sys.executable,
        spool=str(state / "spool"),
        out=str(state / "rib"),
        group_key=group_key,
    )
    (state / "exabgp.conf").write_text(conf)
    return [[exabgp_binary(), str(state / "exabgp.conf")]]


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


class Stop:
    """SIGTERM or SIGINT noted (PID 1 in a container ignores both unless it handles them)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.signal = signum
        self.event.set()

    def install(self) -> Stop:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        return self


def _end(procs: list[subprocess.Popen], timeout: float = 8.0) -> None:
    """SIGTERM to each daemon (last started first), SIGKILL to those still there."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def run_node(topology_path: Path, node: str, *, wait: float = WAIT_S, state: Path = STATE) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stop = Stop().install()
    topology = load(topology_path)
    if node not in topology.nodes and node not in host_nodes(topology):
        print(f"node {node} is not in {topology_path}", file=sys.stderr)
        return 2
    role = topology.nodes[node].role if node in topology.nodes else "host"
    say(f"{node} ({role}) of {topology.name}")
    try:
        expected = int(os.environ.get("CLAB_INTFS", "0") or 0)
    except ValueError:
        print(f"CLAB_INTFS={os.environ['CLAB_INTFS']!r} is not a number", file=sys.stderr)
        return 2
    try:
        waited = wait_for_interfaces(interfaces_of(topology, node), expected, wait, stop=stop.event)
    except LabError as exc:
        print(f"node: {exc}", file=sys.stderr)
        return 0 if stop.signal else 1
    say(f"interfaces {' '.join(interfaces_of(topology, node)) or 'none'} after {waited:.1f} s")
    for line in [*configure(topology, node), *shape_links(topology, node)]:
        say(line)
    if role == "host":
        say("plain host: configured; waiting for SIGTERM")
        stop.event.wait()
        say(f"signal {stop.signal}: exiting")
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1", **configs.EXABGP_ENV)
    seal = _truthy(os.environ.get("CATSPROTO_SEAL"))
    procs: list[subprocess.Popen] = []
    try:
        for argv in commands(topology, node, state, seal=seal):
            say("starting " + " ".join(argv))
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
            if argv[0].endswith("/zebra"):  # bgpd needs zebra's socket
                socket = FRR_RUN / "zserv.api"
                deadline = time.monotonic() + 10
                while not socket.exists() and time.monotonic() < deadline:
                    if stop.event.wait(0.05) or procs[-1].poll() is not None:
                        break
        while not stop.event.wait(0.5):
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                say(f"{dead[0].args[0]} exited with {dead[0].returncode}; stopping the node")
                return dead[0].returncode or 1
        say(f"signal {stop.signal}: stopping the daemons")
        return 0
    finally:
        _end(procs)
        if stop.signal:
            say("stopped")

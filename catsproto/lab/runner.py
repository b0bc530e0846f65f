"""Bring a containerlab topology up without Docker: namespaces, links, daemons.

Strategy: `up` reads the `.clab.yml`, builds one namespace per node and one veth pair
per link (`catsproto.adapters.netns`), renders each daemon's configuration
(`catsproto.lab.configs`) into the lab's run directory and starts the daemons in their
namespaces: ExaBGP (with the announce and/or receive API processes), FRR (zebra, then
bgpd, in pathspace `<tag>-<node>`), BIRD. Whatever fails half way (or a Ctrl-C),
everything started so far is torn down, run directory included, before the error
propagates. The run directory keeps `state.json`, so `down` works from any later
process.

Per ExaBGP node the run directory holds `<node>/spool/` (write a route file there to
announce: `exabgp_announce.Spool`) and `<node>/rib/` (`rib.json` and `events.jsonl`
written by the receiver).

The data plane follows BGP: every BGP node forwards (ip_forward), FRR and BIRD install
what they learn, each instance's address sits on its egress's loopback, a plain host
(a node without catsproto.role, e.g. `client`) gets a default route to its router, and
an egress that only announces gets a default route to its transit (ExaBGP installs no
routes). The receiving node — the ingress, where the path selector sits — gets no
default: its steering forwarder installs one route per decision (docs/steering.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pyroute2 import NetNS
from pyroute2 import netns as pyroute2_netns

from catsproto.adapters import netns
from catsproto.adapters.exabgp_announce import Spool
from catsproto.lab import configs
from catsproto.lab.errors import LabError
from catsproto.lab.topology import Topology, load

DEFAULT_ROOT = Path(os.environ.get("CATSPROTO_LAB_ROOT", "/run/catsproto"))
FRR_RUN = Path("/var/run/frr")
FRR_BIN = Path("/usr/lib/frr")
DEFAULT_ENGINE_SITES = (2, 3)  # `lab up --engine`: where the real engines run


def exabgp_binary() -> str:
    local = Path(sys.executable).parent / "exabgp"
    return str(local) if local.exists() else "exabgp"


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 20.0,
    what: str = "condition",
    interval: float = 0.02,
) -> Any:
    """`predicate()` once it is true (polled every `interval` s); past `timeout` s a
    LabError naming `what` and the last result seen."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {timeout:g}s waiting for {what}; last: {result!r}")
        time.sleep(interval)


class Lab:
    """A running lab: its topology, its netns handle and where each node keeps its files."""

    def __init__(self, topology: Topology, handle: netns.NetnsLab, path: str = "") -> None:
        self.topology = topology
        self.handle = handle
        self.path = path

    @property
    def tag(self) -> str:
        return self.handle.tag

    @property
    def hosts(self) -> list[str]:
        """Plain hosts: link endpoints that run no BGP daemon of ours (e.g. `client`)."""
        return host_nodes(self.topology)

    @property
    def run_dir(self) -> Path:
        return self.handle.run_dir

    def node_dir(self, node: str) -> Path:
        return self.run_dir / node

    @property
    def sealed(self) -> bool:
        """Whether the instances seal their cache sections (`up(seal=True)`)."""
        return bool(self.handle.state.info.get("sealed", False))

    def spool(self, node: str) -> Spool:
        return Spool(self.node_dir(node) / "spool")

    def rib_file(self, node: str) -> Path:
        return self.node_dir(node) / "rib" / "rib.json"

    def rib(self, node: str) -> dict[str, Any]:
        try:
            return json.loads(self.rib_file(node).read_text())
        except (OSError, ValueError):
            return {"sessions": {}, "routes": []}

    def events(self, node: str) -> list[dict[str, Any]]:
        try:
            text = (self.node_dir(node) / "rib" / "events.jsonl").read_text()
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def frr_pathspace(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def vtysh(self, node: str, command: str) -> str:
        out = subprocess.run(
            ["vtysh", "-N", self.frr_pathspace(node), "-c", command],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout

    def birdc(self, node: str, command: str) -> str:
        out = subprocess.run(
            ["birdc", "-s", str(self.node_dir(node) / "bird.ctl"), *command.split()],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout

    def sessions(self) -> dict[str, dict[str, str]]:
        """BGP session state per node and peer, as each daemon reports it."""
        out: dict[str, dict[str, str]] = {}
        embedded = self.handle.state.info.get("mode") == "embedded"
        for name, node in self.topology.nodes.items():
            if embedded and node.role != "exabgp":
                continue
            if node.role == "frr":
                try:
                    summary = json.loads(self.vtysh(name, "show bgp ipv4 unicast summary json"))
                    peers = summary.get("peers", {})
                    out[name] = {p: str(v.get("state", "?")) for p, v in peers.items()}
                except ValueError:
                    out[name] = {}
            elif node.role == "bird":
                states = {}
                for line in self.birdc(name, "show protocols").splitlines():
                    parts = line.split()
                    if parts and parts[0].startswith("peer") and len(parts) >= 6:
                        states[parts[0]] = parts[5]
                out[name] = states
            elif node.receive:
                out[name] = self.rib(name).get("sessions", {})
        return out

    def routes(self, node: str) -> list[dict[str, Any]]:
        return self.rib(node).get("routes", [])

    def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition"
    ) -> Any:
        return wait_for(predicate, timeout, what)

    def down(self) -> None:
        self.handle.teardown()


def host_nodes(topology: Topology) -> list[str]:
    seen: dict[str, None] = {}
    for link in topology.links:
        for end in (link.a, link.b):
            if end.node not in topology.nodes:
                seen[end.node] = None
    return list(seen)


def gateway(topology: Topology, node: str) -> str | None:
    """The address of the other end of `node`'s first addressed link."""
    for link in topology.links:
        for local, remote in ((link.a, link.b), (link.b, link.a)):
            if local.node == node and remote.address is not None:
                return str(remote.address.ip)
    return None


def _dataplane(lab: Lab) -> None:
    """Forwarding on, instance addresses on their egress, default routes (see above)."""
    for name, node in lab.topology.nodes.items():
        lab.handle.run(name, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for spec in node.instances:
            lab.handle.add_loopback_address(name, str(spec.csci))
        if node.role == "exabgp" and not node.receive:
            _default_route(lab, name)
    for host in lab.hosts:
        _default_route(lab, host)


def _default_route(lab: Lab, node: str) -> None:
    via = gateway(lab.topology, node)
    if via is not None:
        with NetNS(lab.handle.ns(node)) as ns:
            ns.route("replace", dst="0.0.0.0/0", gateway=via)


def _start_frr(lab: Lab, node: str) -> None:
    pathspace = lab.frr_pathspace(node)
    conf_dir = FRR_RUN / pathspace
    conf_dir.mkdir(parents=True, exist_ok=True)
    lab.handle.state.extra_dirs.append(str(conf_dir))
    lab.handle.save()
    (conf_dir / "zebra.conf").write_text(configs.frr_zebra_conf(node))
    (conf_dir / "bgpd.conf").write_text(configs.frr_bgpd_conf(lab.topology, node))
    frr = pwd.getpwnam("frr")
    for p in (conf_dir, conf_dir / "zebra.conf", conf_dir / "bgpd.conf"):
        os.chown(p, frr.pw_uid, frr.pw_gid)
    lab.handle.start(
        node,
        "zebra",
        [
            str(FRR_BIN / "zebra"),
            "-N",
            pathspace,
            "-f",
            str(conf_dir / "zebra.conf"),
            "-P",
            "0",
            "--log",
            "stdout",
        ],
    )
    lab.wait_for(lambda: (conf_dir / "zserv.api").exists(), 10, f"zebra on {node}")
    lab.handle.start(
        node,
        "bgpd",
        [
            str(FRR_BIN / "bgpd"),
            "-N",
            pathspace,
            "-f",
            str(conf_dir / "bgpd.conf"),
            "-P",
            "0",
            "--log",
            "stdout",
        ],
    )


def _start_bird(lab: Lab, node: str) -> None:
    d = lab.node_dir(node)
    (d / "bird.conf").write_text(configs.bird_conf(lab.topology, node))
    lab.handle.start(
        node, "bird", ["bird", "-f", "-c", str(d / "bird.conf"), "-s", str(d / "bird.ctl")]
    )


def _start_exabgp(lab: Lab, node: str) -> None:
    d = lab.node_dir(node)
    spool = d / "spool"
    spool.mkdir(mode=0o755, exist_ok=True)
    spool.chmod(0o755)  # whatever the umask: the announcer refuses a folder others may write
    (d / "rib").mkdir(exist_ok=True)
    group_key = None
    if lab.sealed and lab.topology.nodes[node].receive:
        group_key = str(write_group_key(lab, node))
    conf = configs.exabgp_conf(
        lab.topology,
        node,
        python=sys.executable,
        spool=str(d / "spool"),
        out=str(d / "rib"),
        group_key=group_key,
    )
    (d / "exabgp.conf").write_text(conf)
    lab.handle.start(
        node, "exabgp", [exabgp_binary(), str(d / "exabgp.conf")], env=configs.EXABGP_ENV
    )


def write_group_key(lab: Lab, node: str) -> Path:
    """`node`'s copy of the lab's group key (`lab_group_keys`), mode 0600, for its
    receive process to open the sealed cache sections with."""
    from catsproto.lab.instances import lab_group_keys

    path = lab.node_dir(node) / "group.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(lab_group_keys(lab.topology).active.to_json(), out)
    return path


STARTERS: dict[str, Callable[[Lab, str], None]] = {
    "frr": _start_frr,
    "bird": _start_bird,
    "exabgp": _start_exabgp,
}


def up(
    topology_path: str | Path,
    root: str | Path = DEFAULT_ROOT,
    *,
    tag: str | None = None,
    feed: bool = False,
    feed_interval: float = 2.0,
    instance_args: tuple[str, ...] = (),
    seal: bool = False,
    engine: str | None = None,
    engine_sites: tuple[int, ...] = DEFAULT_ENGINE_SITES,
    engine_blocks: int | None = None,
) -> Lab:
    """Build the lab and start its daemons; on any failure tear down what exists.
    `seal`: the instances seal their cache sections under the lab's group key and the
    receivers open them (`Lab.sealed`). `engine` ("vllm"): the first instance of each of
    `engine_sites` is a real engine (`with_engines`; the lab then runs from that
    topology, written into its run directory)."""
    tag = tag or netns.lab_tag()
    run_dir = Path(root) / tag
    handle: netns.NetnsLab | None = None
    # Ctrl-C from the first thing written on: the run directory and its state.json
    # appear before the handle is named, and must go all the same
    with noting_interrupts() as interrupted:
        try:
            if engine is not None:
                topology_path = engine_topology(topology_path, run_dir, engine, engine_sites)
            topology = load(topology_path)
            handle = netns.NetnsLab(run_dir, tag, str(Path(topology_path).resolve()))
            handle.state.info["sealed"] = seal
            if engine_blocks is not None:
                handle.state.info["engine_blocks"] = engine_blocks
            lab = Lab(topology, handle, str(topology_path))
            _build(lab, feed, feed_interval, instance_args)
            interrupted.check()
        except BaseException as exc:  # an error or Ctrl-C: leave nothing that blocks the tag
            if handle is None:
                handle = _made_here(run_dir)
            if handle is not None:
                discard(handle, keep_logs=not isinstance(exc, KeyboardInterrupt))
            raise
    return lab


def _made_here(run_dir: Path) -> netns.NetnsLab | None:
    """The handle of the lab this process started in `run_dir` (its state says so), if
    one was made before the code that made it could keep it; else None."""
    try:
        state = netns.load_state(run_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return netns.NetnsLab.attach(state) if state.owner_pid == os.getpid() else None


def engine_topology(path: str | Path, run_dir: Path, engine: str, sites: tuple[int, ...]) -> Path:
    """The topology at `path` with real engines at `sites` (`with_engines`), written into
    `run_dir` (created), where `lab status` and `down` find it."""
    import yaml

    from catsproto.lab.engine_site import ENGINE_CS_ID
    from catsproto.lab.topology import TopologyError, with_engines

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TopologyError(f"cannot read {path}: {exc}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / Path(path).name
    out.write_text(yaml.safe_dump(with_engines(doc, engine, list(sites), ENGINE_CS_ID)))
    return out


def _build(lab: Lab, feed: bool, feed_interval: float, instance_args: tuple[str, ...]) -> None:
    """Namespaces, links, data plane, daemons (and feeders) of `up`, in that order."""
    topology, handle = lab.topology, lab.handle
    handle.state.info["name"] = topology.name
    for name in [*topology.nodes, *host_nodes(topology)]:
        handle.add_node(name)
        lab.node_dir(name).mkdir(mode=0o755, exist_ok=True)
        lab.node_dir(name).chmod(0o755)  # the spool's parent, as the announcer checks it
    for link in topology.links:
        handle.add_link(
            (link.a.node, link.a.interface, str(link.a.address) if link.a.address else None),
            (link.b.node, link.b.interface, str(link.b.address) if link.b.address else None),
            delay_ms=link.delay_ms,
            rate=link.rate,
        )
    _dataplane(lab)
    # transits first, so the speakers' first connection attempts find them listening
    order = sorted(topology.nodes.values(), key=lambda n: n.role == "exabgp")
    for node in order:
        STARTERS[node.role](lab, node.name)
    if feed:
        start_feeders(lab, feed_interval, instance_args)


def _remove_unrecorded_namespaces(tag: str, settle: float = 1.0) -> None:
    """Namespaces of `tag` the state does not list: pyroute2 creates one in a forked
    child, which finishes its work after a Ctrl-C interrupted the wait for it, so one
    may appear just after teardown. Looked for (and removed) for `settle` seconds."""
    deadline = time.monotonic() + settle
    while True:
        for name in netns.leftover_namespaces(tag):
            with contextlib.suppress(OSError):
                pyroute2_netns.remove(name)
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


class Interrupts:
    """Whether a SIGINT came while a lab was being built. Python raises KeyboardInterrupt
    where the signal lands, but one landing in the hooks around a fork (pyroute2 forks
    for each namespace it enters) is printed as "Exception ignored" and lost, and the
    lab came up after a Ctrl-C; `check` raises it again once the build is done."""

    def __init__(self) -> None:
        self.seen = False

    def handler(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


@contextlib.contextmanager
def noting_interrupts() -> Iterator[Interrupts]:
    """SIGINT noted in an `Interrupts` (and raised as usual) while the block runs, and a
    KeyboardInterrupt Python could not raise kept off stderr; only the main thread can
    set a signal handler, elsewhere nothing is noted."""
    noted = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    unraisable = sys.unraisablehook

    def quiet(info: Any) -> None:  # the lost one's "Exception ignored": `check` raises it
        if not isinstance(info.exc_value, KeyboardInterrupt):
            unraisable(info)

    previous = signal.signal(signal.SIGINT, noted.handler)
    sys.unraisablehook = quiet
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = unraisable


def discard(handle: netns.NetnsLab, *, keep_logs: bool = False) -> None:
    """Undo a lab that did not finish coming up, as `down` would: its processes, its
    namespaces and its run directory (whose state.json would otherwise keep the tag
    taken and show the dead lab in `lab status`). With `keep_logs` (a lab that failed,
    not one interrupted) only state.json goes: the daemons' logs that say why stay, and
    a line on stderr says where."""
    try:
        handle.teardown()
        if handle.namespaced:
            _remove_unrecorded_namespaces(handle.tag)
    finally:
        if keep_logs:
            (handle.run_dir / netns.STATE_FILE).unlink(missing_ok=True)
            print(f"lab: did not come up; its logs stay in {handle.run_dir}", file=sys.stderr)
        else:
            _remove_run_dir(handle.run_dir)


def start_feeders(lab: Lab, interval: float, instance_args: tuple[str, ...] = ()) -> None:
    """One modelled-instance process per egress with instances, writing its spool; the
    receivers trust the instances' (deterministic, lab-only) keys. In namespaces they
    are real modelled instances serving HTTP, each requiring the lab's fresh instance
    token (`flows.instances_token_file`), and the ingress runs the steering API.
    `instance_args` go to every served instance process (`catsproto.lab.instances`)."""
    from catsproto.lab.flows import instances_token_file, write_token_file
    from catsproto.lab.instances import write_lab_trust

    for name, node in lab.topology.nodes.items():
        if node.receive:
            write_lab_trust(
                lab.topology, str(lab.node_dir(name) / "trust.json"), int(time.time() * 1000)
            )
    token = write_token_file(instances_token_file(lab)) if lab.handle.namespaced else None
    engines = start_engines(lab)
    for name, node in lab.topology.nodes.items():
        if node.announce and node.instances:
            argv = [
                sys.executable,
                "-m",
                "catsproto.lab.instances",
                "--topology",
                str(Path(lab.path).resolve()),
                "--node",
                name,
                "--spool",
                str(lab.node_dir(name) / "spool"),
                "--interval",
                str(interval),
                "--max-message",
                "65535" if node.extended_message else "4096",
            ]
            if token is not None:  # real instances on their own addresses
                argv += ["--serve", "--api-token-file", str(token), *instance_args]
            if lab.sealed:  # the receivers hold the key (`write_group_key`)
                argv.append("--seal")
            if name in engines:
                argv += ["--engines", str(engines[name]), "--ready", str(_ready_file(lab, name))]
            lab.handle.start(name, "instances", argv)
    if engines:
        wait_for_engines(lab, list(engines))
    if lab.handle.namespaced and lab.hosts:
        from catsproto.lab.flows import start_ingress, start_steering

        start_steering(lab)
        if engines:
            start_ingress(lab)


def _ready_file(lab: Lab, node: str) -> Path:
    return lab.node_dir(node) / "instances.ready"


def start_engines(lab: Lab) -> dict[str, Path]:
    """Start a real engine for every instance the topology says is one, in its egress's
    namespace on the instance's own address (each bound to one core of its own, in
    turn); returns egress node -> the engines file its instances process reads."""
    from catsproto.lab.engine import ENGINE_KV_BLOCKS, EngineSpec, check_installed
    from catsproto.lab.engine_site import EngineSite

    wanted = [
        (name, spec)
        for name, node in lab.topology.nodes.items()
        for spec in node.instances
        if spec.engine is not None
    ]
    if not wanted:
        return {}
    if not lab.handle.namespaced:
        raise LabError("real engines need the namespaced lab (root, not --embedded)")
    python = check_installed()
    cores = os.cpu_count() or 1
    blocks = int(lab.handle.state.info.get("engine_blocks", ENGINE_KV_BLOCKS))
    files: dict[str, list[dict[str, Any]]] = {}
    for i, (node, inst) in enumerate(wanted):
        engine = EngineSpec(host=str(inst.address), cpu=str(i % cores), num_gpu_blocks=blocks)
        proc = lab.handle.start(node, f"engine-{inst.name}", engine.argv(python), env=engine.env())
        site = EngineSite(inst, engine).to_json()
        site["log"] = proc.log
        files.setdefault(node, []).append(site)
    lab.handle.state.info["engines"] = [e for sites in files.values() for e in sites]
    lab.handle.save()
    out = {}
    for node, sites in files.items():
        path = lab.node_dir(node) / "engines.json"
        path.write_text(json.dumps(sites, indent=1))
        _ready_file(lab, node).unlink(missing_ok=True)
        out[node] = path
    return out


def wait_for_engines(lab: Lab, nodes: list[str], timeout: float = 300.0) -> None:
    """Wait until every engine answers and its C-SMA runs (each egress's instances
    process writes its ready file then); an engine or instances process that dies
    first, or a timeout, is a LabError carrying the log's tail."""
    from catsproto.lab.engine import log_tail

    watched = [p for p in lab.handle.state.processes if p.name.startswith("engine-")]
    started = time.monotonic()
    while not all(_ready_file(lab, n).exists() for n in nodes):
        for p in watched:
            if not lab.handle.alive(p):
                raise LabError(f"engine {p.name} ({p.node}) exited:\n{log_tail(p.log)}")
        for n in nodes:
            inst = next(
                (p for p in lab.handle.state.processes if p.node == n and p.name == "instances"),
                None,
            )
            if inst is not None and not lab.handle.alive(inst):
                raise LabError(f"instances of {n} exited:\n{log_tail(inst.log)}")
        if time.monotonic() - started > timeout:
            raise LabError(f"engines not ready after {timeout:.0f} s (logs in {lab.run_dir})")
        time.sleep(0.5)


def attach(run_dir: str | Path) -> Lab:
    """The Lab object of a lab started by another process."""
    state = netns.load_state(run_dir)
    return Lab(load(state.topology), netns.NetnsLab.attach(state), state.topology)


def running_labs(root: str | Path = DEFAULT_ROOT) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / netns.STATE_FILE).exists())


def down(run_dir: str | Path) -> None:
    state = netns.load_state(run_dir)
    try:
        netns.teardown(state)
    finally:
        _remove_run_dir(Path(run_dir))


def _remove_run_dir(run_dir: Path, tries: int = 20) -> None:
    """Remove a lab's run directory. A daemon that was just killed may still write its
    last log line into it while the tree is removed ("directory not empty"), which once
    left a stale run directory that `running_labs` then listed: try again briefly."""
    for _ in range(tries):
        try:
            shutil.rmtree(run_dir)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(run_dir, ignore_errors=True)
    if run_dir.exists():
        print(f"lab: could not remove {run_dir}", file=sys.stderr)

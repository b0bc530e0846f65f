"""Deploy a containerlab topology into Docker containers where containerlab is not
installed: a test and demo tool, not a second containerlab (`containerlab deploy` stays
the user path, docs/howto-containerlab.md).

Strategy: `plan` (pure) reads the parsed `.clab.yml` the way containerlab reads it for
`kind: linux` nodes and says what each container gets; `ContainerLab.deploy` carries that
out with the docker CLI and pyroute2, in containerlab's order:

* one container per node, named `clab-<lab>-<node>` (the topology's `prefix` changes
  `clab`; `""` leaves the node name, `__lab-name` gives `<lab>-<node>`), with the node's
  name as hostname, its `image` and `cmd` (split like a shell; the image's entrypoint
  stays), `env`, `labels` and `binds` (host paths relative to the topology file's folder),
  each merged from `topology.defaults` < `topology.kinds.<kind>` < the node;
* containerlab's own labels (`containerlab`, `clab-node-name`, `clab-node-kind`,
  `clab-node-type`, `clab-node-group`, `clab-node-lab-dir`, `clab-topo-file`), and every
  label again as an environment variable `CLAB_LABEL_<KEY>` (upper case, other characters
  `_`), plus `CLAB_INTFS`, the number of data interfaces the node will get;
* IPv6 enabled in the container (`net.ipv6.conf.all.disable_ipv6=0`, as the linux kind);
* containers started first, links after: each link a veth pair made on the host under
  temporary names, its ends moved into the two containers' network namespaces, renamed
  to the endpoints' interface names, MTU 9500 (containerlab's default), up. The node's
  command waits for them (`CLAB_INTFS`); nothing assigns the endpoints' `ipv4:`, which
  containerlab does not do for linux nodes either (the node does it, `container.py`);
* each container's network namespace named after the container in /var/run/netns, so
  `ip netns exec clab-cats4-e1 ...` works as with containerlab.

Where it differs, on purpose: no management network (containerlab puts eth0 of every
node on a `clab` bridge, 172.20.20.0/24, with a NAT rule on the host; these topologies
carry everything on their data links, so the containers get no eth0 and the host no
bridge); `--privileged` replaced by every capability but CAP_SYS_RESOURCE, no seccomp
profile and a writable /proc/sys (machines whose bounding set lacks CAP_SYS_RESOURCE
refuse `--privileged`); no lab directory, /etc/hosts entries, SSH config or TLS
certificates; no `exec`, `startup-config`, `ports`, `mgmt-ipv4` and the like: a
topology asking for them is refused, not half deployed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from catsproto.lab.errors import LabError

NETNS_DIR = Path("/var/run/netns")
STATE = Path("/var/lib/catsproto")  # the node's files in its container (`container.py`)
IMAGE_LABEL = "catsproto.inputs"  # scripts/lab-image's label on the node image
_PUBLISH = (  # argv[1]: the spool; stdin: {prefix: value hex, or null to withdraw}
    "import json, sys\n"
    "from catsproto.adapters.exabgp_announce import Spool\n"
    "spool = Spool(sys.argv[1])\n"
    "for prefix, value in json.load(sys.stdin).items():\n"
    "    if value is None:\n"
    "        spool.withdraw(prefix)\n"
    "    else:\n"
    "        spool.publish(prefix, bytes.fromhex(value))\n"
)
VETH_MTU = 9500  # containerlab's default for veth links
RUN_OPTIONS = (  # what --privileged would give, minus CAP_SYS_RESOURCE (see above)
    "--cap-add",
    "ALL",
    "--cap-drop",
    "SYS_RESOURCE",
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "systempaths=unconfined",
)
NODE_KEYS = frozenset({"kind", "image", "cmd", "env", "labels", "binds", "group", "type"})
LINK_KEYS = frozenset({"type", "endpoints", "vars", "mtu", "labels"})


class DeployError(LabError):
    """The topology cannot be deployed this way, or Docker refused; names what and why."""


@dataclasses.dataclass(frozen=True)
class ContainerPlan:
    """What one node's container gets."""

    node: str
    container: str
    image: str
    cmd: tuple[str, ...]
    env: dict[str, str]
    labels: dict[str, str]
    binds: tuple[str, ...]

    def create_argv(self) -> list[str]:
        argv = ["docker", "create", "--name", self.container, "--hostname", self.node]
        argv += ["--network", "none", *RUN_OPTIONS]
        argv += ["--sysctl", "net.ipv6.conf.all.disable_ipv6=0"]
        for key, value in sorted(self.labels.items()):
            argv += ["--label", f"{key}={value}"]
        for key, value in sorted(self.env.items()):
            argv += ["--env", f"{key}={value}"]
        for bind in self.binds:
            argv += ["--volume", bind]
        return [*argv, self.image, *self.cmd]


@dataclasses.dataclass(frozen=True)
class LinkPlan:
    """One veth link: (node, interface) at each end."""

    a: tuple[str, str]
    b: tuple[str, str]
    mtu: int = VETH_MTU


@dataclasses.dataclass(frozen=True)
class Plan:
    lab: str
    topology_file: Path
    containers: dict[str, ContainerPlan]
    links: tuple[LinkPlan, ...]


def env_key(label: str) -> str:
    """A label's key as containerlab exports it: `CLAB_LABEL_` + upper case, other
    characters replaced by `_` (`catsproto.role` -> `CLAB_LABEL_CATSPROTO_ROLE`)."""
    return "CLAB_LABEL_" + re.sub(r"[^A-Z0-9_]", "_", label.upper())


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _endpoint(link: int, end: Any) -> tuple[str, str]:
    if isinstance(end, str) and end.count(":") == 1:
        node, iface = end.split(":")
        return node, iface
    if isinstance(end, dict) and "node" in end and "interface" in end:
        return str(end["node"]), str(end["interface"])
    raise DeployError(f"link {link}: endpoint {end!r} is neither node:interface nor an object")


def _resolve_bind(bind: str, folder: Path) -> str:
    host, sep, rest = bind.partition(":")
    if not sep:
        raise DeployError(f"bind {bind!r} is not host-path:container-path[:options]")
    path = Path(host).expanduser()
    if not path.is_absolute():
        path = (folder / path).resolve()
    if not path.exists():
        raise DeployError(f"bind {bind!r}: {path} does not exist")
    return f"{path}:{rest}"


def _merge_binds(layers: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Binds of every layer; a later layer's bind to the same container path wins."""
    by_target: dict[str, str] = {}
    for layer in layers:
        for bind in layer:
            target = bind.split(":")[1] if bind.count(":") >= 1 else bind
            by_target[target] = bind
    return tuple(by_target.values())


def plan(doc: dict[str, Any], topology_file: str | Path) -> Plan:
    """What deploying the parsed topology `doc` (read from `topology_file`) makes."""
    path = Path(topology_file).resolve()
    if not isinstance(doc, dict) or not isinstance(doc.get("topology"), dict):
        raise DeployError(f"{path}: no `topology` section")
    lab = doc.get("name")
    if not isinstance(lab, str) or not lab:
        raise DeployError(f"{path}: no lab `name`")
    prefix = doc.get("prefix", "clab")
    if "mgmt" in doc:
        raise DeployError(f"{path}: a `mgmt` network is not supported here (no mgmt network)")
    topo = doc["topology"]
    defaults = topo.get("defaults") or {}
    kinds = topo.get("kinds") or {}
    nodes = topo.get("nodes") or {}
    links = topo.get("links") or []
    interfaces: dict[str, list[str]] = {name: [] for name in nodes}
    link_plans = []
    for i, link in enumerate(links):
        if not isinstance(link, dict):
            raise DeployError(f"link {i}: not a mapping")
        unknown = set(link) - LINK_KEYS
        if unknown or link.get("type", "veth") != "veth":
            what = f"fields {sorted(unknown)}" if unknown else f"type {link.get('type')!r}"
            raise DeployError(f"link {i}: {what} not supported here (veth links only)")
        ends = link.get("endpoints") or []
        if len(ends) != 2:
            raise DeployError(f"link {i}: wants two endpoints, has {len(ends)}")
        a, b = (_endpoint(i, end) for end in ends)
        for node, iface in (a, b):
            if node not in nodes:
                raise DeployError(f"link {i}: endpoint {node}:{iface}: no node {node}")
            if iface in interfaces[node]:
                raise DeployError(f"link {i}: {node}:{iface} is already an endpoint")
            if not 0 < len(iface) <= 15 or "/" in iface:
                raise DeployError(f"link {i}: interface name {iface!r} is not a Linux name")
            interfaces[node].append(iface)
        link_plans.append(LinkPlan(a, b, int(link.get("mtu", VETH_MTU))))
    containers = {}
    for name in sorted(nodes):
        node = nodes[name] or {}
        unknown = set(node) - NODE_KEYS
        if unknown:
            raise DeployError(f"node {name}: {sorted(unknown)} not supported here")
        kind = str(node.get("kind", defaults.get("kind", "")))
        if kind != "linux":
            raise DeployError(f"node {name}: kind {kind!r} not supported here (linux only)")
        layers = [defaults, kinds.get(kind) or {}, node]

        def pick(key: str, layers: list[dict] = layers) -> Any:
            return next((layer[key] for layer in reversed(layers) if key in layer), None)

        image = pick("image")
        if not image:
            raise DeployError(f"node {name}: no image")
        cmd = pick("cmd")
        env = {k: _text(v) for layer in layers for k, v in (layer.get("env") or {}).items()}
        labels = {k: _text(v) for layer in layers for k, v in (layer.get("labels") or {}).items()}
        labels.update(
            {
                "containerlab": lab,
                "clab-node-name": name,
                "clab-node-kind": kind,
                "clab-node-type": _text(pick("type") or ""),
                "clab-node-group": _text(pick("group") or ""),
                "clab-node-lab-dir": str(path.parent / f"clab-{lab}" / name),
                "clab-topo-file": str(path),
            }
        )
        env.update({env_key(k): v for k, v in labels.items()})
        env["CLAB_INTFS"] = str(len(interfaces[name]))
        binds = _merge_binds([layer.get("binds") or [] for layer in layers])
        if prefix == "":
            container = name
        elif prefix == "__lab-name":
            container = f"{lab}-{name}"
        else:
            container = f"{prefix}-{lab}-{name}"
        containers[name] = ContainerPlan(
            node=name,
            container=container,
            image=str(image),
            cmd=tuple(shlex.split(str(cmd))) if cmd else (),
            env=env,
            labels=labels,
            binds=tuple(_resolve_bind(b, path.parent) for b in binds),
        )
    return Plan(lab, path, containers, tuple(link_plans))


def load_plan(topology_file: str | Path) -> Plan:
    import yaml

    try:
        doc = yaml.safe_load(Path(topology_file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeployError(f"cannot read {topology_file}: {exc}") from None
    return plan(doc, topology_file)


# ---- Docker: the CLI, and a daemon when none runs -----------------------------------------


def docker(*args: str, timeout: float = 120.0, check: bool = True, input: bytes | None = None):
    """Run `docker ARGS`; a failure is a DeployError carrying Docker's own message."""
    try:
        out = subprocess.run(
            ["docker", *args], capture_output=True, timeout=timeout, check=False, input=input
        )
    except FileNotFoundError:
        raise DeployError("no docker command (scripts/lab-image installs Docker)") from None
    except subprocess.TimeoutExpired:
        raise DeployError(f"docker {' '.join(args[:2])}: no answer in {timeout:g} s") from None
    if check and out.returncode != 0:
        message = out.stderr.decode(errors="replace").strip() or f"exit {out.returncode}"
        raise DeployError(f"docker {' '.join(args[:2])}: {message}")
    return out


def daemon_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ID}}", timeout=20, check=False).returncode == 0
    except DeployError:
        return False


class DockerDaemon:
    """A Docker daemon for the lab: the running one, or one started here (no bridge, no
    iptables rules, no ip_forward change) and ended by its PID in `stop`."""

    def __init__(self, log: str | Path = "/var/log/catsproto-dockerd.log") -> None:
        self.log = Path(log)
        self.proc: subprocess.Popen | None = None

    def ensure(self, timeout: float = 30.0) -> DockerDaemon:
        if daemon_answers():
            return self
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise DeployError("no dockerd: install Docker (scripts/lab-image does)")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [dockerd, "--bridge=none", "--iptables=false", "--ip-forward=false"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not daemon_answers():
            if self.proc.poll() is not None:
                raise DeployError(f"dockerd exited ({self.proc.returncode}); see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise DeployError(f"dockerd did not answer in {timeout:g} s; see {self.log}")
            time.sleep(0.2)
        return self

    @property
    def started(self) -> bool:
        return self.proc is not None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


def build_image(checkout: str | Path, *, timeout: float = 900.0) -> str:
    """`scripts/lab-image` of `checkout` (builds or finds the cached image); its output."""
    script = Path(checkout) / "scripts" / "lab-image"
    out = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if out.returncode != 0:
        raise DeployError(f"scripts/lab-image failed:\n{out.stdout}{out.stderr}")
    return out.stderr


# ---- a deployed lab ---------------------------------------------------------------------


class ContainerLab:
    """A topology deployed in containers (`deploy`), or found deployed (`attach`)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._pids: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self.plan.lab

    def container(self, node: str) -> str:
        return self.plan.containers[node].container

    def running(self) -> list[str]:
        """Names of the lab's containers Docker knows (any state)."""
        out = docker(
            "ps", "-a", "--filter", f"label=containerlab={self.name}", "--format", "{{.Names}}"
        )
        return sorted(out.stdout.decode().split())

    def pid(self, node: str) -> int:
        out = docker("inspect", "--format", "{{.State.Pid}}", self.container(node))
        pid = int(out.stdout.decode().strip() or 0)
        if pid <= 0:
            raise DeployError(f"container {self.container(node)} is not running")
        self._pids[node] = pid
        return pid

    def root(self, node: str) -> Path:
        """The container's file system as the host sees it (through its PID)."""
        return Path(f"/proc/{self._pids.get(node) or self.pid(node)}/root")

    def deploy(
        self, *, progress: Callable[[str], None] = lambda _: None, wire_after: float = 0.0
    ) -> ContainerLab:
        """Create and start every container, then wire the links; on any failure the
        half-made lab is destroyed before the error propagates. `wire_after`: seconds
        between starting the containers and wiring their links (containerlab: none; a
        test waits so that the nodes are up before their links, as on a busy host)."""
        plan = self.plan
        images = {c.image for c in plan.containers.values()}
        for image in sorted(images):
            if docker("image", "inspect", image, check=False).returncode != 0:
                raise DeployError(f"no image {image}: build it first (scripts/lab-image)")
        if self.running():
            raise DeployError(f"lab {self.name} is deployed already: destroy it first")
        started = time.monotonic()
        try:
            for c in plan.containers.values():
                docker(*c.create_argv()[1:])
            docker("start", *(c.container for c in plan.containers.values()))
            pids = docker(
                "inspect",
                "--format",
                "{{.State.Pid}}",
                *(c.container for c in plan.containers.values()),
            ).stdout.split()
            self._pids.update(zip(plan.containers, map(int, pids), strict=True))
            progress(f"{len(plan.containers)} containers started")
            for node in plan.containers:
                self._name_netns(node)
            time.sleep(wire_after)
            for link in plan.links:
                self._wire(link)
            progress(f"{len(plan.links)} links wired, {time.monotonic() - started:.1f} s in all")
        except BaseException:
            self.destroy()
            raise
        return self

    def _name_netns(self, node: str) -> None:
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        link = NETNS_DIR / self.container(node)
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(f"/proc/{self._pids.get(node) or self.pid(node)}/ns/net")

    def _wire(self, link: LinkPlan) -> None:
        from pyroute2 import IPRoute, NetNS

        temp = [f"cl{secrets.token_hex(4)}{side}" for side in "ab"]
        with IPRoute() as ip:
            ip.link("add", ifname=temp[0], kind="veth", peer=temp[1])
            try:
                for name, (node, _) in zip(temp, (link.a, link.b), strict=True):
                    idx = ip.link_lookup(ifname=name)[0]
                    ip.link("set", index=idx, mtu=link.mtu)
                    ip.link("set", index=idx, net_ns_pid=self._pids.get(node) or self.pid(node))
            except BaseException:
                for name in temp:
                    for idx in ip.link_lookup(ifname=name):
                        with contextlib.suppress(Exception):
                            ip.link("del", index=idx)
                raise
        for name, (node, iface) in zip(temp, (link.a, link.b), strict=True):
            with NetNS(self.container(node)) as ns:
                idx = ns.link_lookup(ifname=name)[0]
                ns.link("set", index=idx, ifname=iface)
                ns.link("set", index=idx, state="up")

    def destroy(self, stop_timeout: int = 10) -> None:
        """Stop the lab's containers (SIGTERM, SIGKILL after `stop_timeout` s), remove
        them (their veth ends go with their namespaces), the names of their namespaces,
        and node images left untagged by a rebuild. Nothing deployed: nothing to do."""
        names = self.running()
        if names:
            docker(
                "stop", "--time", str(stop_timeout), *names, timeout=stop_timeout + 60, check=False
            )
            docker("rm", "--force", *names, timeout=60, check=False)
        for c in self.plan.containers.values():
            link = NETNS_DIR / c.container
            if link.is_symlink():
                link.unlink()
        self._pids.clear()
        # an image scripts/lab-image replaced while these containers ran on it could not
        # be removed then; it is nobody's now
        docker("image", "prune", "--force", "--filter", f"label={IMAGE_LABEL}", check=False)
        left = self.running()
        if left:
            raise DeployError(f"containers left after destroy: {', '.join(left)}")

    # ---- looking inside -------------------------------------------------------------
    def exec(
        self, node: str, argv: Sequence[str], *, timeout: float = 30.0, input: bytes | None = None
    ) -> str:
        out = docker(
            "exec",
            *(["-i"] if input is not None else []),
            self.container(node),
            *argv,
            timeout=timeout,
            check=False,
            input=input,
        )
        return out.stdout.decode(errors="replace")

    def logs(self, node: str) -> str:
        out = docker("logs", self.container(node), check=False)
        return (out.stdout + out.stderr).decode(errors="replace")

    def inspect(self, node: str) -> dict[str, Any]:
        return json.loads(docker("inspect", self.container(node)).stdout)[0]

    def state(self, node: str) -> dict[str, Any]:
        return self.inspect(node)["State"]

    def kill(self, node: str) -> None:
        docker("kill", self.container(node))
        self._pids.pop(node, None)

    # ---- what the nodes hold (the files `catsproto lab node` keeps, STATE) ----------
    @property
    def topology(self) -> Any:
        from catsproto.lab.topology import load

        return load(self.plan.topology_file)

    def node_dir(self, node: str) -> Path:
        """The node's /var/lib/catsproto (configs, spool, rib, trust.json) from the host."""
        return self.root(node) / STATE.relative_to("/")

    def publish(self, node: str, routes: Mapping[Any, bytes | None]) -> None:
        """Write `routes` ({prefix: attribute value, or None to withdraw}) into the node's
        spool, with the spool's own code inside the container (its folder checks do not
        hold through /proc/PID/root from the host)."""
        body = json.dumps({str(p): (v.hex() if v is not None else None) for p, v in routes.items()})
        out = docker(
            "exec",
            "-i",
            self.container(node),
            "python",
            "-c",
            _PUBLISH,
            str(STATE / "spool"),
            input=body.encode(),
            check=False,
        )
        if out.returncode != 0:
            raise DeployError(f"publish at {node}: {out.stderr.decode(errors='replace').strip()}")

    def rib(self, node: str) -> dict[str, Any]:
        try:
            return json.loads((self.node_dir(node) / "rib" / "rib.json").read_text())
        except (OSError, ValueError, DeployError):
            return {"sessions": {}, "routes": []}

    def routes(self, node: str) -> list[dict[str, Any]]:
        return self.rib(node).get("routes", [])

    def events(self, node: str) -> list[dict[str, Any]]:
        try:
            text = (self.node_dir(node) / "rib" / "events.jsonl").read_text()
        except (OSError, DeployError):
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def sessions(self) -> dict[str, dict[str, str]]:
        """BGP session state per node and peer, as each daemon reports it (FRR: vtysh,
        BIRD: birdc, a receiving ExaBGP node: its receive process's rib.json)."""
        out: dict[str, dict[str, str]] = {}
        for name, node in self.topology.nodes.items():
            if node.role == "frr":
                text = self.exec(name, ["vtysh", "-c", "show bgp ipv4 unicast summary json"])
                try:
                    peers = json.loads(text).get("peers", {})
                except ValueError:
                    peers = {}
                out[name] = {p: str(v.get("state", "?")) for p, v in peers.items()}
            elif node.role == "bird":
                text = self.exec(
                    name, ["birdc", "-s", "/var/lib/catsproto/bird.ctl", "show", "protocols"]
                )
                out[name] = {
                    parts[0]: parts[5]
                    for parts in (line.split() for line in text.splitlines())
                    if len(parts) >= 6 and parts[0].startswith("peer")
                }
            elif node.receive:
                out[name] = self.rib(name).get("sessions", {})
        return out


def netns_names(lab: str, prefix: str = "clab") -> list[str]:
    """Names of network namespaces in /var/run/netns that belong to `lab`'s containers."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{prefix}-{lab}-"))


def host_veths(prefix: str = "cl") -> list[str]:
    """Interfaces on the host named as the deployer's temporary veth ends."""
    names = os.listdir("/sys/class/net")
    return sorted(n for n in names if re.fullmatch(rf"{prefix}[0-9a-f]{{8}}[ab]", n))

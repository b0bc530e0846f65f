"""`catsproto lab`: bring a topology up without Docker, look at it, capture, tear down.

catsproto lab up lab/cats4.clab.yml      # namespaces + ExaBGP/FRR/BIRD, instances fed
catsproto lab status                     # sessions and what the selector's RIB holds
catsproto lab capture e4-b4 -w x.pcap    # tcpdump on one link (BGP only)
catsproto lab down                       # stop everything, remove the namespaces
catsproto lab demo                       # up, watch advertisements flow, down
catsproto lab up catsrr                  # sites behind an FRR and a BIRD route reflector
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from catsproto.adapters.cli_args import seconds, whole_number
from catsproto.commands import UsageError

LAB_DIR = Path(__file__).resolve().parent.parent.parent / "lab"
DEFAULT_TOPOLOGY = LAB_DIR / "cats4.clab.yml"


def _topology_path(text: str) -> Path:
    p = Path(text)
    if not p.exists() and (LAB_DIR / text).exists():
        p = LAB_DIR / text
    if not p.exists() and (LAB_DIR / f"{text}.clab.yml").exists():
        p = LAB_DIR / f"{text}.clab.yml"
    if not p.exists():
        raise UsageError(f"no topology {text} (try cats3, cats4 or catsrr, or a .clab.yml file)")
    return p


def _root(args: argparse.Namespace) -> Path:
    from catsproto.lab.runner import DEFAULT_ROOT

    return Path(args.root) if args.root else DEFAULT_ROOT


LOOPBACK_ROOT = Path("/tmp/catsproto-lab")  # a loopback lab started without --root


def can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _running(args: argparse.Namespace) -> tuple[list[Path], str]:
    """Running labs under --root, or else under both default places (a namespace lab's
    and a loopback lab's), and where that was, for messages."""
    from catsproto.lab.runner import running_labs

    roots = [Path(args.root)] if args.root else list(dict.fromkeys([_root(args), LOOPBACK_ROOT]))
    labs = [lab for root in roots for lab in running_labs(root)]
    return labs, " or ".join(str(r) for r in roots)


def _one_lab(args: argparse.Namespace) -> Path:
    labs, where = _running(args)
    if args.tag:
        match = [p for p in labs if p.name == args.tag]
        if not match:
            raise UsageError(f"no running lab {args.tag} under {where}")
        return match[0]
    if not labs:
        raise UsageError(f"no running lab under {where} (start one with `lab up`)")
    if len(labs) > 1:
        raise UsageError("several labs are running: " + ", ".join(p.name for p in labs))
    return labs[0]


TAG_PATTERN = re.compile(r"[a-z][a-z0-9]{0,7}")  # veth names are <tag>l<link><side>: 15 at most


def _new_tag(args: argparse.Namespace, root: Path) -> str | None:
    """The tag asked for a new lab (None: the lab picks its own), checked before anything
    is built: a short lower-case name that no lab under `root` and no namespace uses."""
    tag = args.tag
    if tag is None:
        return None
    if not TAG_PATTERN.fullmatch(tag):
        raise UsageError(
            f"--tag {tag!r}: 1-8 characters, a lower-case letter first, then letters or "
            "digits (it prefixes namespace and interface names)"
        )
    if (root / tag).exists():
        raise UsageError(f"--tag {tag}: {root / tag} exists (a lab of that tag runs or was left)")
    if can_netns():
        from catsproto.adapters import netns

        if netns.leftover_namespaces(tag):
            raise UsageError(f"--tag {tag}: namespaces {tag}-* exist already")
    return tag


def _sites(text: str) -> tuple[int, ...]:
    try:
        sites = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: site numbers, e.g. 2,3") from None
    if not sites or len(set(sites)) != len(sites) or min(sites) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: distinct site numbers >= 1, e.g. 2,3")
    return sites


def cmd_up(args: argparse.Namespace) -> int:
    from catsproto.lab import embedded, runner
    from catsproto.lab.errors import LabError
    from catsproto.lab.topology import TopologyError

    if args.topology and args.topology_option and args.topology != args.topology_option:
        raise UsageError("give the topology once (positional or --topology)")
    text = args.topology or args.topology_option
    if not text:
        raise UsageError("which topology? e.g. `lab up cats4` or `lab up --topology X.clab.yml`")
    path = _topology_path(text)
    started = time.monotonic()
    embedded_mode = args.embedded or not can_netns()
    if args.seal and embedded_mode:
        raise UsageError("--seal needs the namespaced lab (root, not --embedded)")
    if args.engine and (embedded_mode or args.no_feed):
        raise UsageError("--engine needs the namespaced lab (root, not --embedded) and its feed")
    if (args.engine_sites or args.engine_blocks) and not args.engine:
        raise UsageError("--engine-sites and --engine-blocks go with --engine")
    try:
        if embedded_mode:
            root = _root(args) if args.root else LOOPBACK_ROOT
            lab = embedded.up(path, root, tag=_new_tag(args, root))
            if not args.no_feed:
                try:
                    runner.start_feeders(lab, args.interval)
                except BaseException:  # as `runner.up` does for its own feeders
                    runner.discard(lab.handle)
                    raise
        else:
            root = _root(args)
            lab = runner.up(
                path,
                root,
                feed=not args.no_feed,
                feed_interval=args.interval,
                tag=_new_tag(args, root),
                seal=args.seal,
                engine=args.engine,
                engine_sites=args.engine_sites or runner.DEFAULT_ENGINE_SITES,
                engine_blocks=args.engine_blocks,
            )
    except (TopologyError, LabError) as exc:  # e.g. a topology the loopback mode cannot run
        raise UsageError(f"{path.name}: {exc}") from None
    mode = lab.handle.state.info.get("mode", "netns")
    sealed = ", sealed" if lab.handle.state.info.get("sealed") else ""
    print(
        f"lab {lab.tag} ({lab.topology.name}, {mode}{sealed}) up in "
        f"{time.monotonic() - started:.2f}s"
    )
    print(f"run directory: {lab.run_dir}")
    running = running_nodes(lab)
    for name in running:
        node = lab.topology.nodes[name]
        extra = f", {len(node.instances)} instances" if node.instances else ""
        recv = ", receives" if node.receive else ""
        print(f"  {name:5} {node.role:7} AS{node.asn}{extra}{recv}")
    left = [f"{n} ({node.role})" for n, node in lab.topology.nodes.items() if n not in running]
    if left:
        print(f"  not run on loopback (no transit): {', '.join(left)}")
    print(f"next: catsproto lab status --tag {lab.tag}; catsproto lab down --tag {lab.tag}")
    return 0


def running_nodes(lab: Any) -> list[str]:
    """The topology's nodes the lab runs a daemon for: all of them in namespaces; on
    loopback only the receiving ExaBGP node and the announcing ones (`lab.embedded`)."""
    if lab.handle.state.info.get("mode") != "embedded":
        return list(lab.topology.nodes)
    return [
        name
        for name, node in lab.topology.nodes.items()
        if node.role == "exabgp" and (node.receive or node.announce)
    ]


def _print_status(run_dir: Path) -> None:
    from catsproto.lab import runner, view

    lab = runner.attach(run_dir)
    print(f"lab {lab.tag} ({lab.topology.name}) in {run_dir}")
    alive = sum(lab.handle.alive(p) for p in lab.handle.state.processes)
    print(f"processes: {alive}/{len(lab.handle.state.processes)} running")
    shaping = lab.handle.state.info.get("shaping", {})
    if shaping:
        print(f"link shaping: {sorted(set(shaping.values()))[0]}")
    print("BGP sessions:")
    for node, peers in lab.sessions().items():
        states = ", ".join(f"{p} {s}" for p, s in sorted(peers.items())) or "-"
        print(f"  {node:5} {states}")
    for name, node in lab.topology.nodes.items():
        if node.receive:
            rows = view.origin_rows(lab.rib(name), lab.topology)
            print(f"\ncache state at {name} (the selector's RIB): {len(rows)} origins")
            if rows:
                print(view.table(rows, view.ORIGIN_HEADER))


def cmd_status(args: argparse.Namespace) -> int:
    _print_status(_one_lab(args))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from catsproto.lab.runner import down

    labs, where = _running(args)
    if args.tag and not any(p.name == args.tag for p in labs):
        print(f"no running lab {args.tag} under {where}: nothing to stop")
        return 0
    if not labs:  # teardown is idempotent: nothing left is what was asked for
        print(f"no running lab under {where}: nothing to stop")
        return 0
    targets = labs if args.all else [_one_lab(args)]
    for run_dir in targets:
        started = time.monotonic()
        down(run_dir)
        print(f"lab {run_dir.name} down in {time.monotonic() - started:.2f}s")
    return 0


class Tcpdump:
    """tcpdump writing what one interface sees to a pcap file, started and stopped here.

    It writes to a fresh hidden file beside `out`, renamed to `out` only when tcpdump
    ended well, so a failed capture leaves an older `out` as it was and is never
    reported by that file's size. A tcpdump that exits by itself (a filter it refuses, a
    file it cannot write, an interface or namespace that is not there, no permission)
    raises `UsageError` with tcpdump's own message, on one line."""

    def __init__(self, out: Path, interface: str, bpf: str, netns: str | None = None) -> None:
        if not out.parent.is_dir():
            what = "is not a directory" if out.parent.exists() else "does not exist"
            raise UsageError(f"cannot write {out}: {out.parent} {what}")
        if out.is_dir():
            raise UsageError(f"cannot write {out}: it is a directory")
        self.out = out
        self.partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        argv = ["tcpdump", "-i", interface, "-U", "-n", "-Z", "root", "-w", str(self.partial)]
        argv.append(bpf)
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        try:
            self.proc = subprocess.Popen(
                argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=self.stderr
            )
        except OSError as exc:
            self.stderr.close()
            raise UsageError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None

    def messages(self) -> list[str]:
        """tcpdump's stderr so far, a line each."""
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace").splitlines()

    def wait_listening(self, timeout: float = 10.0) -> None:
        """Until tcpdump says it listens (or fails: then `UsageError`, see `stop`)."""
        deadline = time.monotonic() + timeout
        while not any("listening on" in line for line in self.messages()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise UsageError("tcpdump did not start listening in time")
            time.sleep(0.05)

    def wait(self, seconds: float) -> None:
        """Up to `seconds`, or until tcpdump exits by itself (Ctrl-C ends it too)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=seconds)

    def stop(self) -> int:
        """End tcpdump (SIGINT, as Ctrl-C would; it flushes and exits 0) and return the
        packets it captured; raise `UsageError` if it failed."""
        early = self.proc.poll()
        if early is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        lines = self.messages()
        self.stderr.close()
        if self.proc.returncode != 0 or (early is not None and not self.partial.exists()):
            self.partial.unlink(missing_ok=True)
            raise UsageError(tcpdump_failure(lines, self.proc.returncode, self.partial, self.out))
        self.partial.replace(self.out)
        counts = [line for line in lines if line.endswith("packets captured")]
        return int(counts[-1].split()[0]) if counts else 0


_TCPDUMP_CHATTER = ("listening on", "packets captured", "received by filter", "dropped by")


def tcpdump_failure(lines: list[str], status: int | None, partial: Path, out: Path) -> str:
    """One line from a failed tcpdump's stderr: its own words (each "tcpdump: " prefix
    dropped, the hidden file's name replaced by the one asked for), and its exit status."""
    said = [
        line.removeprefix("tcpdump: ").replace(str(partial), str(out)).strip()
        for line in lines
        if line.strip() and not any(c in line for c in _TCPDUMP_CHATTER)
    ]
    words = "; ".join(said) or "no message"
    return f"tcpdump failed (exit status {status}): {words}"


def _capture_point(lab: Any, text: str, bpf: str | None) -> tuple[str, str | None, str, str, str]:
    """(interface, namespace or None, filter, what, default file name) of `lab capture
    LINK` on `lab`."""
    from catsproto.lab.topology import TopologyError

    info = lab.handle.state.info
    if info.get("mode") == "embedded":  # sessions on lo, no links: LINK names a speaker
        receiver = next(n for n, node in lab.topology.nodes.items() if node.receive)
        addresses = info.get("addresses", {})
        speakers = [n for n in addresses if n != receiver]
        names = {s: s for s in speakers}
        names.update({f"{a}-{b}": s for s in speakers for a, b in ((receiver, s), (s, receiver))})
        if text not in names or "port" not in info:
            raise UsageError(
                f"a loopback lab has no links, only a BGP session from each speaker to "
                f"{receiver} on lo: give one of {', '.join(speakers)} (not {text!r})"
            )
        speaker = names[text]
        session = f"tcp port {info['port']} and host {addresses[speaker]}"
        what = f"the session {speaker}-{receiver} (lo)"
        bpf = f"({bpf}) and {session}" if bpf else session
        return "lo", None, bpf, what, f"{lab.tag}-{receiver}-{speaker}.pcap"
    try:
        link = lab.topology.find_link(text)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    end = lab.handle.state.links[lab.topology.links.index(link)][0]
    netns = lab.handle.ns(end.node) if lab.handle.namespaced else None
    name = f"{lab.tag}-{link.a.node}-{link.b.node}.pcap"
    return end.ifname, netns, bpf or "tcp port 179", f"{link.name} ({end.ifname})", name


def cmd_capture(args: argparse.Namespace) -> int:
    from catsproto.lab import runner

    lab = runner.attach(_one_lab(args))
    interface, netns, bpf, what, default = _capture_point(lab, args.link, args.filter)
    out = Path(args.write or default).resolve()
    tcpdump = Tcpdump(out, interface, bpf, netns)
    print(f"capturing {what} to {out} for {args.seconds:g}s", flush=True)
    try:
        tcpdump.wait(args.seconds)
    finally:  # Ctrl-C too: the packets so far are kept
        packets = tcpdump.stop()
    print(f"wrote {out} ({out.stat().st_size} bytes, {packets} packets)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Up (namespaces as root, loopback otherwise), watch the RIB, down."""
    from catsproto.lab import embedded, runner, view

    path = _topology_path(args.topology)
    root = _root(args) if (args.root or can_netns()) else LOOPBACK_ROOT
    netns_mode = can_netns() and not args.embedded
    if args.seal and not netns_mode:
        raise UsageError("--seal needs the namespaced lab (root, not --embedded)")
    if args.engine and not netns_mode:
        raise UsageError("--engine needs the namespaced lab (root, not --embedded)")
    started = time.monotonic()
    try:
        tag = _new_tag(args, root)
        lab = (
            runner.up(
                path,
                root,
                feed=True,
                feed_interval=args.interval,
                tag=tag,
                seal=args.seal,
                engine=args.engine,
            )
            if netns_mode
            else embedded.up(path, root, tag=tag)
        )
    except runner.LabError as exc:
        raise UsageError(f"{path.name}: {exc}") from None
    capture: DemoCapture | None = None
    rows: list[list[str]] = []
    try:
        if not netns_mode:
            runner.start_feeders(lab, args.interval)
        mode = "namespaces, FRR and BIRD transit" if netns_mode else "loopback, no transit"
        if lab.sealed:
            mode += ", cache sections sealed"
        print(f"lab {lab.topology.name} up ({mode}) in {time.monotonic() - started:.2f}s")
        receiver = next(n for n, node in lab.topology.nodes.items() if node.receive)
        print(_delay_note(lab, path))
        if not args.no_capture:
            capture = DemoCapture.start(lab, receiver, args.capture_dir)
        expected = sum(len(n.instances) for n in lab.topology.nodes.values())
        if not netns_mode:  # on loopback the receiver's own instances reach no one
            expected -= len(lab.topology.nodes[receiver].instances)
        try:
            lab.wait_for(
                lambda: len(view.origin_rows(lab.rib(receiver), lab.topology)) >= expected,
                args.seconds,
                f"{expected} origins at {receiver}",
            )
        except runner.LabError as exc:
            print(f"warning: {exc}")
        print(f"advertisements flowing to {receiver} after {time.monotonic() - started:.2f}s:")
        rows = view.origin_rows(lab.rib(receiver), lab.topology)
        print(view.table(rows, view.ORIGIN_HEADER))
        time.sleep(args.interval * 1.5)
        later = view.origin_rows(lab.rib(receiver), lab.topology)
        print(f"\n{args.interval * 1.5:g}s later (instances' caches changed):")
        print(view.table(later, view.ORIGIN_HEADER))
        accepted = sum(e["kind"] == "accept" for e in lab.events(receiver))
        print(f"\n{accepted} advertisements accepted at {receiver}")
        _print_steering(lab, receiver)
        if args.engine:
            _print_engines(lab)
    finally:
        try:
            if capture is not None:
                capture.finish()  # before the run directory (and the trust file in it) goes
        finally:
            t = time.monotonic()
            runner.down(lab.run_dir)  # processes, namespaces, and the run directory
            print(f"lab down in {time.monotonic() - t:.2f}s")
    return 0 if rows else 1


def _capture_folder(capture_dir: str | None, tag: str) -> Path:
    """Where the demo keeps its pcap and trust file: `capture_dir` (made 0700 if missing;
    an existing one must be a real folder owned by us), else a fresh `mkdtemp` folder.
    Raises OSError or UsageError."""
    if capture_dir is None:
        return Path(tempfile.mkdtemp(prefix=f"catsproto-demo-{tag}-"))
    folder = Path(capture_dir)
    if folder.is_symlink():
        raise UsageError(f"--capture-dir {folder} is a symbolic link: name the folder itself")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.geteuid():
        raise UsageError(f"--capture-dir {folder} belongs to another user")
    return folder.resolve()


def _delay_note(lab: Any, topology_path: Path) -> str:
    """Where the rtt in the demo's estimates comes from, said before any number."""
    if lab.handle.state.info.get("mode") == "embedded":
        return (
            "loopback: each speaker peers with the receiver directly, no transit routers and "
            "no link delay; the selector's graph is those direct 0 ms sessions"
        )
    shaping = lab.handle.state.info.get("shaping", {})
    if any("no netem" in applied for applied in shaping.values()):
        return (
            "link delays NOT applied: this kernel has no netem (link rates are applied); the "
            f"rtt in the estimates below is the sum of the link delays in {topology_path.name}, "
            "not a measurement"
        )
    return f"link delays applied with netem, as {topology_path.name} gives them"


class DemoCapture:
    """The demo's capture of the receiver's BGP sessions, kept (with the lab's trust file)
    in a folder that outlives the lab, so `catsproto inspect` can show them afterwards."""

    def __init__(
        self, tcpdump: Tcpdump, trust: Path, keep: Path, group_key: Path | None = None
    ) -> None:
        self.tcpdump, self.trust, self.keep = tcpdump, trust, keep
        self.group_key = group_key  # a sealed lab: the receiver's copy of the group key

    @classmethod
    def start(cls, lab: Any, receiver: str, capture_dir: str | None) -> DemoCapture | None:
        """tcpdump on the receiver's link to its transit (in namespaces) or on lo (the
        receiver's port); None, with a line saying why, when it cannot run. The files go
        to `capture_dir` (made if missing; refused if it is a symlink or not ours) or
        else to a fresh private folder in the temporary directory, never to a guessable
        name another user could have prepared with symlinks."""
        if os.geteuid() != 0 or shutil.which("tcpdump") is None:
            print("no capture of the BGP sessions: tcpdump (as root) is needed for one")
            return None
        info = lab.handle.state.info
        if info.get("mode") == "embedded":
            interface, netns, bpf = "lo", None, f"tcp port {info['port']}"
        else:
            ends = [
                end
                for pair in lab.handle.state.links
                for end, other in (pair, pair[::-1])
                if end.node == receiver and other.node in lab.topology.nodes
            ]
            if not ends:
                print(f"no capture: {receiver} has no link to another BGP node")
                return None
            interface, netns, bpf = ends[0].ifname, lab.handle.ns(receiver), "tcp port 179"
        try:
            keep = _capture_folder(capture_dir, lab.tag)
        except OSError as exc:
            print(f"no capture of the BGP sessions: --capture-dir {capture_dir}: {exc.strerror}")
            return None
        except UsageError as exc:
            print(f"no capture of the BGP sessions: {exc}")
            return None
        try:
            tcpdump = Tcpdump(keep / f"{receiver}-bgp.pcap", interface, bpf, netns)
        except UsageError as exc:
            print(f"no capture of the BGP sessions: {exc}")
            return None
        try:
            tcpdump.wait_listening()
        except UsageError as exc:
            print(f"no capture of the BGP sessions: {exc}")
            return None
        except BaseException:  # Ctrl-C while waiting: tcpdump is in its own session
            with contextlib.suppress(Exception):
                tcpdump.stop()
            raise
        print(f"capturing {receiver}'s BGP sessions ({interface}) to {tcpdump.out}")
        group_key = lab.node_dir(receiver) / "group.key" if lab.sealed else None
        return cls(tcpdump, lab.node_dir(receiver) / "trust.json", keep, group_key)

    def finish(self) -> None:
        """Stop tcpdump, keep the trust file beside the pcap, print how to look at them."""
        try:
            packets = self.tcpdump.stop()
        except UsageError as exc:
            print(f"\nthe capture failed: {exc}")
            return
        trust = self.keep / "trust.json"
        group_key = self.keep / "group.key"
        try:
            _keep_copy(self.trust, trust, 0o644)
            if self.group_key is not None:
                _keep_copy(self.group_key, group_key, 0o600)  # the secret stays private
        except OSError as exc:
            print(f"\n{packets} packets in {self.tcpdump.out}; no trust file kept: {exc}")
            return
        print(
            f"\n{packets} packets of the BGP sessions kept in {self.tcpdump.out}, with the "
            "lab's trust file; decode and verify every advertisement in it with:\n"
            f"  {catsproto_command()} inspect {self.tcpdump.out} --trust {trust}"
        )
        if self.group_key is not None:
            print(
                "the cache sections in it are sealed: that shows their ciphertext; with the "
                f"lab's group key (kept beside it, mode 0600) they are opened:\n"
                f"  {catsproto_command()} inspect {self.tcpdump.out} --trust {trust} "
                f"--group-key {group_key}"
            )


def _keep_copy(source: Path, target: Path, mode: int) -> None:
    """`source` copied to `target` as a new file renamed into place (never written
    through a link in the folder), with `mode`."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-")
    with os.fdopen(fd, "wb") as out:
        out.write(source.read_bytes())
    os.chmod(name, mode)
    os.replace(name, target)


def catsproto_command() -> str:
    """How to run this catsproto from a shell: `catsproto` when that is what PATH finds,
    else the full path of the one beside this Python (a venv not on PATH, as in
    scripts/demo)."""
    local = Path(sys.executable).parent / "catsproto"
    if local.exists() and shutil.which("catsproto") != str(local):
        return str(local)
    return "catsproto"


def _print_engines(lab: Any) -> None:
    """The real-engine step (`catsproto.lab.engine_demo`)."""
    from catsproto.lab import flows, view
    from catsproto.lab.engine_demo import HEADER, EngineDemo
    from catsproto.lab.errors import LabError

    engines = ", ".join(f"{e['host']} ({e['instance']})" for e in lab.handle.state.info["engines"])
    print(
        f"\nreal vLLM engines at {engines}, tiny model, dummy weights; the official openai "
        f"client behind the ingress ({flows.ingress_url(lab)}) asks a conversation:"
    )
    try:
        rows = EngineDemo(lab).run()
    except LabError as exc:
        print(f"engine step failed: {exc}")
        return
    print(view.table(rows, HEADER))
    print(
        "expected: what the selector's RIB (BGP, signed, verified) said the engine holds; "
        "vLLM cached: the engine's own usage report (it recomputes a prompt's last token)"
    )


def _print_steering(lab: Any, receiver: str) -> None:
    """The path selector at the receiver, fed by what BGP delivered: where each site's
    cached conversation goes from here, and why."""
    from catsproto.lab import steering

    now_ms = time.time_ns() // 1_000_000
    try:
        loopback = lab.handle.state.info.get("mode") == "embedded"
        decisions = steering.decide_demo(
            lab.topology, lab.rib(receiver), receiver, now_ms, loopback=loopback
        )
    except LookupError as exc:
        print(f"\nno steering decision possible: {exc}")
        return
    print(
        f"\npath selector at {receiver}, fed by BGP: where a conversation cached at site N "
        "goes (estimated TTFT)"
    )
    rows = [
        [
            "conversation",
            "cache-aware choice",
            "cached",
            "ttft ms",
            "path",
            "network-only choice",
            "ttft ms",
        ]
    ]
    for site, aware, blind in decisions:
        c, b = aware.chosen, blind.chosen
        rows.append(
            [
                f"site {site}",
                f"{c.address} (site {c.site_id})",
                str(c.cached_blocks),
                f"{c.total_ms:.0f}",
                " > ".join(c.path),
                f"{b.address} (site {b.site_id})",
                f"{b.total_ms:.0f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print("\nwhy, for the farthest site:\n" + decisions[-1][1].explain())


def cmd_node(args: argparse.Namespace) -> int:
    """Container entrypoint: wait for this node's links, configure and shape them, render
    its config, run its daemons until one exits or SIGTERM comes."""
    from catsproto.lab import container

    name = args.node or os.environ.get("CATSPROTO_NODE")
    if not name:
        raise UsageError("which node? give --node or set CATSPROTO_NODE")
    return container.run_node(_topology_path(args.topology), name, wait=args.wait)


def _container_lab(args: argparse.Namespace) -> Any:
    from catsproto.lab import deploy

    try:
        return deploy.ContainerLab(deploy.load_plan(_topology_path(args.topology)))
    except deploy.DeployError as exc:
        raise UsageError(str(exc)) from None


def cmd_deploy(args: argparse.Namespace) -> int:
    """Deploy a topology in Docker containers as containerlab would (`catsproto.lab.deploy`)."""
    from catsproto.lab import deploy

    lab = _container_lab(args)
    if not deploy.daemon_answers():
        raise UsageError(
            "no Docker daemon answers: start one (`dockerd --bridge=none --iptables=false "
            "--ip-forward=false &`, or `scripts/lab-image --keep-daemon`)"
        )
    try:
        lab.deploy(progress=lambda line: print(f"deploy: {line}"))
    except deploy.DeployError as exc:
        print(f"deploy: {exc}", file=sys.stderr)
        return 1
    for node, plan in lab.plan.containers.items():
        print(f"  {plan.container:<24} {node}")
    print(f"destroy with: {catsproto_command()} lab destroy {args.topology}")
    return 0


def cmd_destroy(args: argparse.Namespace) -> int:
    """Stop and remove a deployed topology's containers (SIGTERM first)."""
    from catsproto.lab import deploy

    lab = _container_lab(args)
    if not deploy.daemon_answers():
        print("destroy: no Docker daemon answers: nothing is deployed")
        return 0
    names = lab.running()
    try:
        lab.destroy()
    except deploy.DeployError as exc:
        print(f"destroy: {exc}", file=sys.stderr)
        return 1
    print(
        f"destroy: {len(names)} containers of {lab.name} removed"
        if names
        else f"destroy: nothing of {lab.name} was deployed"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser(
        "lab",
        help="the BGP lab: namespaces, ExaBGP, FRR, BIRD",
        description="Run a containerlab topology without Docker (network namespaces), "
        "or on loopback without root.",
    )
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="ACTION")

    find_root = (
        "where run directories live (default: both $CATSPROTO_LAB_ROOT, else "
        "/run/catsproto, and /tmp/catsproto-lab, where a loopback lab started without "
        "--root is)"
    )

    new_tag = (
        "the new lab's tag (1-8 characters: a lower-case letter, then letters or digits); "
        "default: c<pid> with namespaces, e<pid> on loopback"
    )

    def common(
        p: argparse.ArgumentParser,
        root_help: str = find_root,
        tag_help: str = "which lab (its run directory's name), when several run",
    ) -> None:
        p.add_argument("--root", help=root_help)
        p.add_argument("--tag", help=tag_help)

    p = sub.add_parser(
        "up",
        help="build the topology and start its daemons",
        description="Build a containerlab topology without Docker. As root: a network "
        "namespace per node, veth links with their shaping, and ExaBGP, FRR and BIRD in "
        "them. Without root (or with --embedded): ExaBGP speakers on loopback addresses "
        "peering directly, no transit. Either way modelled instances feed the speakers "
        "unless --no-feed. Prints the lab's tag and run directory.",
    )
    p.add_argument("topology", nargs="?", help="a .clab.yml file, or cats3 / cats4 / catsrr")
    p.add_argument("--topology", dest="topology_option", metavar="TOPOLOGY", help="the same")
    p.add_argument("--embedded", action="store_true", help="loopback mode, no root needed")
    p.add_argument("--no-feed", action="store_true", help="do not start modelled instances")
    p.add_argument(
        "--seal",
        action="store_true",
        help="the instances seal their cache sections (ChaCha20-Poly1305 under the lab's "
        "group key, written 0600 to each receiving node's group.key); the receivers open "
        "them, transits and captures see only ciphertext (namespaced lab only)",
    )
    p.add_argument(
        "--interval",
        type=seconds(),
        default=2.0,
        help="seconds between the modelled instances' cache updates",
    )
    p.add_argument(
        "--engine",
        choices=["vllm"],
        help="real engines: vLLM's OpenAI server (the tiny model of lab/engine, .venv-engine) "
        "serves the first instance of each --engine-sites site (service 200, model "
        "catsproto-tiny), fed to its C-SMA by its own KV events; the ingress at the "
        "selector serves OpenAI's API for it (docs/engine.md). Namespaced lab only; "
        "waits until every engine answers",
    )
    p.add_argument(
        "--engine-sites",
        type=_sites,
        default=None,
        metavar="N,N",
        help="sites whose first instance is a real engine (default 2,3: two engines fit "
        "two cores and a few GiB)",
    )
    p.add_argument(
        "--engine-blocks",
        type=whole_number(32),
        default=None,
        metavar="N",
        help="KV cache of each engine, in 32-token blocks (default 512: 16,384 tokens, "
        "small enough that evictions come soon)",
    )
    common(
        p,
        "where run directories live (default: $CATSPROTO_LAB_ROOT, else /run/catsproto; "
        "in loopback mode /tmp/catsproto-lab)",
        new_tag,
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "status",
        help="sessions and the receiver's cache state",
        description="Show a running lab: its processes, the link shaping, every node's BGP "
        "sessions, and the cache state in each receiver's RIB (what its path selector "
        "uses).",
    )
    common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "capture",
        help="tcpdump one link into a pcap",
        description="Run tcpdump on one end of a link of a running lab (inside its "
        "namespace) for --seconds and write what it sees to a pcap file; by default BGP "
        "only (tcp port 179). On a loopback lab it captures one speaker's session on lo. "
        "The file is written under a temporary name and renamed when tcpdump ends well; "
        "if tcpdump fails (a filter it refuses, a file it cannot write) its message is "
        "the error (exit 2) and an older file of that name is left as it was. "
        "`catsproto inspect FILE --trust RUN_DIR/e1/trust.json` decodes and verifies it.",
    )
    p.add_argument(
        "link",
        help="link index, node:iface, or nodeA-nodeB; on a loopback lab a speaker (e3) or "
        "its session with the receiver (e1-e3)",
    )
    p.add_argument("-w", "--write", help="pcap file (default <tag>-<a>-<b>.pcap)")
    p.add_argument(
        "--seconds",
        type=seconds(),
        default=10.0,
        help="how long to capture (Ctrl-C stops sooner)",
    )
    p.add_argument(
        "--filter",
        help="tcpdump filter expression, one argument (default: BGP, tcp port 179; on a "
        "loopback lab the chosen speaker's session, to which a filter given is added)",
    )
    common(p)
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser(
        "down",
        help="stop the daemons and remove the namespaces",
        description="Stop a running lab's processes by PID, remove its namespaces and its "
        "run directory; with --all, every lab under --root. With nothing running (or no "
        "lab of --tag) it says so and exits 0: the lab is down either way.",
    )
    p.add_argument("--all", action="store_true", help="every lab under --root")
    common(p)
    p.set_defaults(func=cmd_down)

    p = sub.add_parser(
        "demo",
        help="up, show advertisements flowing, down",
        description="Bring a topology up (namespaces with FRR and BIRD as root, loopback "
        "otherwise), wait until every instance's advertisement reached the receiver, show "
        "its RIB, and again after the caches changed, ask the path selector where each "
        "site's cached conversation goes, then tear the lab down. As root it captures the "
        "receiver's BGP sessions meanwhile and keeps the pcap and the lab's trust file "
        "(--capture-dir), printing the `catsproto inspect` command that verifies them. It "
        "says where the rtt in the estimates comes from: on a kernel without netem the "
        "link delays are not applied and the numbers are the topology file's.",
    )
    p.add_argument(
        "topology",
        nargs="?",
        default=str(DEFAULT_TOPOLOGY),
        help="a .clab.yml file, or cats3 / cats4 / catsrr (default: lab/cats4.clab.yml)",
    )
    p.add_argument("--embedded", action="store_true", help="loopback mode even as root")
    p.add_argument(
        "--interval",
        type=seconds(),
        default=1.0,
        help="seconds between the modelled instances' cache updates; the demo looks "
        "again 1.5 intervals after the first table",
    )
    p.add_argument("--seconds", type=seconds(), default=20.0, help="how long to wait for routes")
    p.add_argument(
        "--seal",
        action="store_true",
        help="the instances seal their cache sections under the lab's group key and the "
        "receiver opens them (as `lab up --seal`); the capture then shows ciphertext, and "
        "the group key is kept beside it (namespaced lab only)",
    )
    p.add_argument(
        "--capture-dir",
        metavar="DIR",
        help="where the capture of the receiver's BGP sessions and the lab's trust file are "
        "kept after the lab is down: a folder of yours, made if missing (default: a new "
        "private catsproto-demo-<tag>-XXXXXXXX folder in the temporary folder, /tmp)",
    )
    p.add_argument("--no-capture", action="store_true", help="do not capture the BGP sessions")
    p.add_argument(
        "--engine",
        choices=["vllm"],
        help="real engines at sites 2 and 3 (as `lab up --engine`), and a conversation "
        "through the OpenAI-compatible ingress with the official openai client: where it "
        "goes, vLLM's own cached tokens and the time to first token, beside network-only "
        "CATS (namespaced lab only)",
    )
    common(
        p,
        "where the run directory lives while the demo runs (default: $CATSPROTO_LAB_ROOT, "
        "else /run/catsproto; /tmp/catsproto-lab in loopback mode without root)",
        new_tag,
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "node",
        help="(in a container) run one node of a topology",
        description="The entrypoint of a containerlab container: shape this node's links, "
        "render its daemons' configuration from the topology and run them (ExaBGP, FRR or "
        "BIRD) until one exits.",
    )
    p.add_argument(
        "--topology",
        required=True,
        help="the topology the container belongs to: a .clab.yml file, or cats3 / cats4 / catsrr",
    )
    p.add_argument("--node", help="the node's name in it (default: $CATSPROTO_NODE)")
    p.add_argument(
        "--wait",
        type=seconds(),
        default=300.0,
        help="seconds to wait for the node's link interfaces, which containerlab adds after "
        "the container starts (default 300)",
    )
    p.set_defaults(func=cmd_node)

    for action, func, text in (
        (
            "deploy",
            cmd_deploy,
            "Start a topology in Docker containers wired as containerlab wires them "
            "(containers clab-<lab>-<node>, one veth pair per link, named as the endpoints), "
            "for machines without containerlab; `containerlab deploy` does the same where "
            "it is installed (docs/howto-containerlab.md says where the two differ). "
            "Needs root, a running Docker daemon and the node image (scripts/lab-image).",
        ),
        (
            "destroy",
            cmd_destroy,
            "Stop (SIGTERM, then SIGKILL after 10 s) and remove the containers of a topology "
            "deployed by `lab deploy` or containerlab, and their namespaces' names.",
        ),
    ):
        p = sub.add_parser(action, help=text.split(" (")[0].split(";")[0], description=text)
        p.add_argument("topology", help="a .clab.yml file, or cats3 / cats4 / catsrr")
        p.set_defaults(func=func)

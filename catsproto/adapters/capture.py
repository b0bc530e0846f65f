"""Record a real BGP capture: two ExaBGP speakers in two namespaces, tcpdump between them.

Strategy: the smallest lab that puts our attribute on a real wire. Namespace `a` runs
ExaBGP (AS 65001) with an API process that announces each route with
``attribute [ 0xTT 0xC0 0xHEX ]``; namespace `b` runs a passive ExaBGP (AS 65002) whose
JSON receiver writes what arrives to a file, and tcpdump on b's veth end writes the
pcap. We wait until every announced prefix has arrived, then stop tcpdump first (it
flushes every packet, `-U`), then everything else, by process group, in `finally`.
Extended messages (RFC 8654) are on by default in ExaBGP 5, so one announcement may
carry up to ~65 KB and spans many TCP segments on the wire.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from catsproto.adapters.netns import NetnsLab

A_ADDRESS, B_ADDRESS = "10.0.12.1", "10.0.12.2"
A_AS, B_AS = 65001, 65002

_ANNOUNCER = """\
import sys
for line in open(sys.argv[1]):
    sys.stdout.write(line)
    sys.stdout.flush()
for _ in sys.stdin:  # ExaBGP answers each command; keep reading until it stops us
    pass
"""

_RECEIVER = """\
import sys
with open(sys.argv[1], "a") as out:
    for line in sys.stdin:
        out.write(line)
        out.flush()
"""

_NO_OFFLOAD = """\
import sys
from pyroute2.ethtool import Ethtool
e = Ethtool()
f = e.get_features(sys.argv[1])
for name in ("tx-generic-segmentation", "tx-tcp-segmentation", "tx-tcp6-segmentation",
             "generic-receive-offload"):
    if name in f.features:
        f.features[name].enable = False
e.set_features(sys.argv[1], f)
"""


@dataclasses.dataclass(frozen=True)
class Announcement:
    """One route and the attribute value (our TLVs, or any bytes) it carries."""

    prefix: ipaddress.IPv4Network
    value: bytes
    type_code: int = 255
    flags: int = 0xC0

    def command(self, next_hop: str = A_ADDRESS) -> str:
        return (
            f"announce route {self.prefix} next-hop {next_hop} "
            f"attribute [ {self.type_code:#04x} {self.flags:#04x} 0x{self.value.hex()} ]"
        )


@dataclasses.dataclass
class CaptureResult:
    path: Path
    seconds: float
    received: int
    interface: str
    namespace: str


def _exabgp() -> str:
    local = Path(sys.executable).parent / "exabgp"
    return str(local) if local.exists() else (shutil.which("exabgp") or "exabgp")


def _config(
    peer: str, local: str, local_as: int, peer_as: int, process: str, run: str, extra: str
) -> str:
    encoder = "text" if process == "announce" else "json"
    receive = "" if process == "announce" else "receive { parsed; update; }"
    return f"""
process {process} {{
    run {run};
    encoder {encoder};
}}
neighbor {peer} {{
    router-id {local};
    local-address {local};
    local-as {local_as};
    peer-as {peer_as};
    {extra}
    api {{
        processes [ {process} ];
        {receive}
    }}
}}
"""


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def record_capture(
    path: str | Path,
    announcements: Sequence[Announcement],
    *,
    timeout: float = 30.0,
    tag: str | None = None,
    before_peering: Callable[[str, str], object] | None = None,
) -> CaptureResult:
    """Announce `announcements` from ExaBGP to ExaBGP over a veth pair; write the pcap
    seen on the receiver's interface to `path`. Needs root. `before_peering(namespace,
    interface)` runs once the capture runs and before the speakers start (to attach a
    live reader to the same interface)."""
    start = time.monotonic()
    path = Path(path).resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="catsproto-capture-"))
    lab = NetnsLab(run_dir, tag=tag or f"k{os.getpid()}", topology="capture")
    try:
        lab.add_node("a")
        lab.add_node("b")
        a_end, b_end = lab.add_link(
            ("a", "eth1", f"{A_ADDRESS}/30"), ("b", "eth1", f"{B_ADDRESS}/30")
        )
        for end in (a_end, b_end):  # wire-sized segments in the pcap, not 64 KB GSO ones
            lab.run(end.node, [sys.executable, "-c", _NO_OFFLOAD, end.ifname])
        (run_dir / "announce.txt").write_text("".join(a.command() + "\n" for a in announcements))
        (run_dir / "announce.py").write_text(_ANNOUNCER)
        (run_dir / "receive.py").write_text(_RECEIVER)
        received = run_dir / "received.jsonl"
        received.touch()
        py = sys.executable
        (run_dir / "a.conf").write_text(
            _config(
                B_ADDRESS, A_ADDRESS, A_AS, B_AS, "announce",
                f"{py} {run_dir}/announce.py {run_dir}/announce.txt", "",
            )
        )  # fmt: skip
        (run_dir / "b.conf").write_text(
            _config(
                A_ADDRESS, B_ADDRESS, B_AS, A_AS, "receive",
                f"{py} {run_dir}/receive.py {received}", "passive true;",
            )
        )  # fmt: skip
        env = {
            "exabgp_daemon_user": "root",
            "exabgp_api_cli": "false",
            "exabgp_log_destination": "stdout",
        }
        dump = lab.start(
            "b",
            "tcpdump",
            [
                "tcpdump",
                "-i",
                b_end.ifname,
                "--immediate-mode",
                "-U",
                "-Z",
                "root",
                "-w",
                str(path),
                "tcp port 179",
            ],
        )
        _wait(lambda: "listening on" in Path(dump.log).read_text(), 10, "tcpdump to start")
        if before_peering is not None:
            before_peering(lab.ns("b"), b_end.ifname)
        lab.start("b", "exabgp", [_exabgp(), str(run_dir / "b.conf")],
                  env={**env, "exabgp_tcp_bind": B_ADDRESS})  # fmt: skip
        _wait(lambda: ":179" in lab.run("b", ["ss", "-ltn"]), 10, "ExaBGP b to listen")
        lab.start("a", "exabgp", [_exabgp(), str(run_dir / "a.conf")], env=env)
        wanted = {str(a.prefix) for a in announcements}

        def arrived() -> set[str]:
            seen = set()
            for line in received.read_text().splitlines():
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                announce = msg.get("neighbor", {}).get("message", {}).get("update", {})
                for routes in announce.get("announce", {}).get("ipv4 unicast", {}).values():
                    seen |= {r["nlri"] if isinstance(r, dict) else r for r in routes}
            return seen

        _wait(lambda: wanted <= arrived(), timeout, f"{len(wanted)} routes to arrive")
        time.sleep(0.3)  # let the last ACKs reach the capture
        lab.stop(dump)
        return CaptureResult(
            path, time.monotonic() - start, len(arrived()), b_end.ifname, lab.ns("b")
        )
    finally:
        lab.teardown()
        if not os.environ.get("CATSPROTO_KEEP_RUN_DIR"):
            shutil.rmtree(run_dir, ignore_errors=True)

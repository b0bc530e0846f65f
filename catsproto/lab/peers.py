"""Peer routers: the cache-aware routers a vLLM user would install instead of catsproto.

Strategy. A peer is a real part of the evaluation, like an engine: a pinned PyPI package
installed into a venv of its own (its dependencies never meet catsproto's), cached per
name and version under the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``,
then ``catsproto/peers/<name>-<version>``) and reused when present, started in the
ingress node's namespace bound to the lab's addresses only (smg warns it runs without
authentication), health-polled through its ``GET /workers`` until every engine is
listed healthy, and ended by its PID group. `PEERS` says, per peer, the package, the
pinned version, the command and whether the engines need ``--enable-scale-out``.

The ingress node of the lab has no default route (the path selector installs one host
route per decision), so a peer there reaches the engines through `peer_routes`: a host
route per engine towards the ingress's first hop, with the client-facing address as the
source (the sites route it back: the ingress announces the client subnet), at a high
metric so the selector's own routes (metric 0) keep precedence while they exist.

    PEERS["smg"].argv(venv, "10.100.1.1", 8100, ["http://10.102.0.11:8000"], 8101)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catsproto.lab.errors import LabError

PEER_ROUTE_METRIC = 1000  # above the selector's routes (metric 0)
INSTALL_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 120.0


class PeerError(LabError):
    """A peer router that cannot be installed, started or made ready (the message says why)."""


def _launch_argv(
    entry: list[str],
) -> Callable[[Path, str, int, list[str], int, str], list[str]]:
    """The argv of a router that takes SGLang's router options (all three peers do)."""

    def argv(
        venv: Path, host: str, port: int, workers: list[str], metrics_port: int, policy: str
    ) -> list[str]:
        return [
            *[str(venv / "bin" / entry[0]), *entry[1:]],
            "--host",
            host,
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(metrics_port),
        ]

    return argv


@dataclass(frozen=True)
class PeerRouter:
    """One peer: its PyPI package at a pinned version, its command, what it needs."""

    name: str
    package: str
    version: str
    build_argv: Callable[[Path, str, int, list[str], int, str], list[str]]
    policy: str = "cache_aware"
    needs_scale_out: bool = False  # the engines must serve /v1/completions/render
    note: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def argv(
        self, venv: Path, host: str, port: int, workers: list[str], metrics_port: int
    ) -> list[str]:
        if not workers:
            raise PeerError(f"{self.name}: no engine to route to")
        return self.build_argv(venv, host, port, workers, metrics_port, self.policy)


PEERS: dict[str, PeerRouter] = {
    p.name: p
    for p in (
        PeerRouter(
            "smg",
            "smg",
            "1.13.0",
            _launch_argv(["smg", "launch"]),
            note="Shepherd Model Gateway (SGLang's router): an approximate prefix tree of "
            "what it routed itself, no engine state",
        ),
        PeerRouter(
            "sglang-router",
            "sglang-router",
            "0.3.2",
            _launch_argv(["python", "-m", "sglang_router.launch_router"]),
            note="SGLang's earlier router package: the same kind of tree",
        ),
        PeerRouter(
            "vllm-router",
            "vllm-router",
            "0.1.17",
            _launch_argv(["vllm-router"]),
            needs_scale_out=True,
            note="vllm-project/router; cache_aware renders prompts at the engines "
            "(/v1/completions/render, served with --enable-scale-out)",
        ),
    )
}


def cache_root() -> Path:
    """Where peer venvs are kept: $XDG_CACHE_HOME/catsproto/peers or ~/.cache/catsproto/peers."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "catsproto" / "peers"


INSTALLED_MARK = "catsproto-peer.json"  # written last: a venv without it is incomplete


def peer_venv(peer: PeerRouter, root: Path | None = None) -> Path:
    """The peer's venv, installed first if absent: ``python -m venv`` and ``pip install
    PACKAGE==VERSION`` in place (a venv's scripts name its path, so it cannot be moved),
    the mark file written only once both succeeded; a folder without the mark (an
    interrupted install) is removed and made again, a failed install removed."""
    root = root or cache_root()
    venv = root / f"{peer.name}-{peer.version}"
    if (venv / INSTALLED_MARK).exists():
        return venv
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(venv, ignore_errors=True)
    steps = [
        [_base_python(), "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", peer.requirement],
    ]
    try:
        for argv in steps:
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
            )
            if out.returncode != 0:
                raise PeerError(
                    f"{peer.name}: `{' '.join(argv[-3:])}` failed ({out.returncode}): "
                    f"{(out.stderr or out.stdout)[-1500:]}"
                )
        mark = {"package": peer.package, "version": peer.version, "installed_at": time.time()}
        (venv / INSTALLED_MARK).write_text(json.dumps(mark))
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    return venv


def _base_python() -> str:
    """The interpreter a peer venv is made from: this one's base (not its venv)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    return str(base) if base.exists() else sys.executable


def installed_version(venv: Path, package: str) -> str | None:
    """The version of `package` the venv holds, as its own pip metadata says."""
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))",
            package,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout.strip() or None


# ---- readiness ------------------------------------------------------------------------


def healthy_workers(doc: Any) -> set[str]:
    """The worker URLs a router's ``GET /workers`` answer lists as healthy. smg and
    sglang-router answer ``{"workers": [{"url", "is_healthy", ...}]}``; vllm-router a
    list of URLs or of such objects under ``workers`` or ``urls``; anything else lists
    none (and the caller keeps waiting)."""
    items = doc.get("workers", doc.get("urls", [])) if isinstance(doc, dict) else doc
    urls: set[str] = set()
    if not isinstance(items, list):
        return urls
    for item in items:
        if isinstance(item, str):
            urls.add(item.rstrip("/"))
        elif (
            isinstance(item, dict)
            and isinstance(item.get("url"), str)
            and item.get("is_healthy", True)
            and item.get("status", "ready") == "ready"
        ):
            urls.add(item["url"].rstrip("/"))
    return urls


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_for_workers(
    url: str,
    workers: list[str],
    alive: Callable[[], bool],
    log: Path | str,
    *,
    fetch: Callable[[str], Any] = get_json,
    timeout: float = READY_TIMEOUT_S,
) -> float:
    """Poll ``url/workers`` until every one of `workers` is listed healthy; returns the
    seconds it took. A router that exits first, or is not ready within `timeout`, raises
    PeerError with the tail of its log."""
    from catsproto.lab.engine import log_tail

    want = {w.rstrip("/") for w in workers}
    started = time.monotonic()
    seen: set[str] = set()
    while True:
        try:
            seen = healthy_workers(fetch(url.rstrip("/") + "/workers"))
        except (OSError, ValueError):
            seen = set()
        if want <= seen:
            return time.monotonic() - started
        if not alive():
            raise PeerError(f"the router at {url} exited while starting:\n{log_tail(log)}")
        if time.monotonic() - started > timeout:
            raise PeerError(
                f"the router at {url} listed {sorted(seen)} of {sorted(want)} after "
                f"{timeout:.0f} s:\n{log_tail(log)}"
            )
        time.sleep(0.5)


# ---- in the lab -----------------------------------------------------------------------


def route_argv(action: str, engine_host: str, gateway: str | None, source: str) -> list[str]:
    """`ip route` for a peer's host route to one engine (see the module's strategy)."""
    argv = ["ip", "route", action, f"{engine_host}/32"]
    if gateway is not None:
        argv += ["via", gateway]
    return [*argv, "src", source, "metric", str(PEER_ROUTE_METRIC)]


@dataclass
class RunningPeer:
    """A peer started in a lab node: its URL, its process, the routes it was given."""

    peer: PeerRouter
    node: str
    url: str
    proc: Any  # catsproto.adapters.netns.Process
    routes: list[list[str]]
    ready_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "peer": self.peer.name,
            "package": self.peer.requirement,
            "policy": self.peer.policy,
            "node": self.node,
            "url": self.url,
            "ready_s": round(self.ready_s, 1),
        }


def start_in_lab(
    lab: Any,
    peer: PeerRouter,
    node: str,
    host: str,
    gateway: str | None,
    workers: list[tuple[str, int]],
    *,
    port: int,
    metrics_port: int,
    venv: Path | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> RunningPeer:
    """Start `peer` in `node`'s namespace on `host`:`port`, in front of `workers`
    ((address, port) of each engine), with host routes to them via `gateway` from
    `host`; wait until its /workers lists them all. On failure it is stopped again."""
    venv = venv or peer_venv(peer)
    routes: list[list[str]] = []
    for address, _ in workers:
        lab.handle.run(node, route_argv("replace", address, gateway, host))
        routes.append(route_argv("del", address, gateway, host))
    urls = [f"http://{a}:{p}" for a, p in workers]
    argv = peer.argv(venv, host, port, urls, metrics_port)
    proc = lab.handle.start(node, f"peer-{peer.name}-{port}", argv, env={"NO_COLOR": "1"})
    url = f"http://{host}:{port}"
    running = RunningPeer(peer, node, url, proc, routes, 0.0)

    def fetch(u: str) -> Any:
        return json.loads(lab.handle.run(node, ["curl", "-sf", "--max-time", "5", u]) or "null")

    try:
        running.ready_s = wait_for_workers(
            url, urls, lambda: lab.handle.alive(proc), proc.log, fetch=fetch, timeout=timeout
        )
    except BaseException:
        stop_in_lab(lab, running)
        raise
    return running


def stop_in_lab(lab: Any, running: RunningPeer) -> None:
    """End the peer by its PID group and remove the routes it was given."""
    lab.handle.stop(running.proc)
    for argv in running.routes:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            lab.handle.run(running.node, argv)  # a route the kernel dropped: nothing to do
    running.routes = []


class LocalPeer:
    """A peer as a child process of this one, in its own process group, on a loopback
    address (tests, `benchmarks/ingress_overhead.py`); `close` ends it by its PID group."""

    def __init__(
        self,
        peer: PeerRouter,
        host: str,
        port: int,
        workers: list[str],
        metrics_port: int,
        log: Path,
        *,
        venv: Path | None = None,
    ) -> None:
        self.peer = peer
        self.url = f"http://{host}:{port}"
        self.workers = workers
        self.log = log
        argv = peer.argv(venv or peer_venv(peer), host, port, workers, metrics_port)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1"},
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        try:
            return wait_for_workers(self.url, self.workers, self.alive, self.log, timeout=timeout)
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM the peer's process group, then SIGKILL what is left."""
        from catsproto.lab.engine import end_group

        end_group(self.popen, timeout)

    def __enter__(self) -> LocalPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

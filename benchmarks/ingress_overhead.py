"""The OpenAI ingress's own cost, as JSON: the same short request straight to a vLLM
engine and through `catsproto ingress serve`, measured in one run.

Each request is a completion of `max_tokens=1` on one fixed prompt, served from the
engine's prefix cache after a warm-up (so the engine's part is as short as it gets and
the ingress's share as large). The ingress runs as its own process, started as the lab
starts it (`python -m catsproto.cli ingress serve`, a bearer token, routes not installed
since the engine is on this host), in front of the engine; its RIB is the receiver's
rib.json written from a real C-SMA (`NodeAgent`) on the engine's KV events, so every
request is tokenized, keyed, decided against a real summary, proxied and its usage
taken for ground truth. Requests alternate (direct, ingress, direct, ...) on one
keep-alive connection each, so a change of machine load hits both alike.

Beside it, in the same run, a peer router a vLLM user would put there instead
(`--peer`, default smg with ``--policy cache_aware``, from its own venv:
`catsproto.lab.peers`) in front of the same engine: requests rotate direct, ingress,
peer, so each path sees the same engine and the same machine load.

Headline: `added_p50_ms` = p50 through the ingress minus p50 direct (target: at most
2 ms), and `peer.added_p50_ms` the same for the peer; `ingress_minus_peer_p50_ms` is what
ours costs beyond the peer's (issue 40's target: within 1 ms). p99 beside each.

    .venv/bin/python benchmarks/ingress_overhead.py --start-engine [--requests 300]
    .venv/bin/python benchmarks/ingress_overhead.py [--engine-url URL] [--events ipc://...]
        [--replay ipc://...] [--model-dir DIR] [--model NAME] [--peer smg|none]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from catsproto import security, wire
from catsproto.adapters.instance import NodeAgent
from catsproto.adapters.steering import SteeringConfig
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.keys import BlockKeyer
from catsproto.node import BuilderConfig, ComputeState, DampeningPolicy, RouteAdvertisement
from catsproto.node.cache import TierSpec
from catsproto.summary import KIND_EXACT
from catsproto.wire import Tier

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"catsproto-ingress-bench-secret-1"
SECRET_ID = 9
CS_ID = 100
TOKEN = "a-token-for-the-ingress-benchmark"
PROMPT = "The ingress keys each prompt's blocks and steers it to the engine that holds them. "


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def write_rib(path: Path, origin: str, values: dict[str, str]) -> None:
    doc = {
        "sessions": {},
        "routes": [
            {
                "peer": "127.0.0.2",
                "prefix": prefix,
                "origin": origin,
                "cs_id": CS_ID,
                "value": value,
                "verified": True,
                "received_at": time.time(),
            }
            for prefix, value in sorted(values.items())
        ],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def c_sma(args: argparse.Namespace, host: str, rib: Path) -> NodeAgent:
    signer = security.SigningKey.from_seed(hashlib.sha256(b"catsproto-bench/ingress").digest())
    values: dict[str, str] = {}

    def publish(routes: list[RouteAdvertisement]) -> None:
        for r in routes:
            values[str(r.prefix)] = wire.encode(
                security.sign(r.advertisement, signer, r.prefix)
            ).hex()
        write_rib(rib, host, values)

    return NodeAgent(
        BuilderConfig(
            cs_id=CS_ID,
            address=host,
            model_id=args.model,
            block_size=args.block_size,
            secret_id=SECRET_ID,
            bytes_per_block=args.block_size * 4096,
            site_id=1,
            summary_kind=KIND_EXACT,
            snapshot_every=1,
            shard_range="10.255.9.0/24",
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=2_000, change_threshold=0),
        ),
        [TierSpec(Tier.HBM, 512, 0, 1_600_000)],
        BlockKeyer(SECRET, args.model, args.block_size),
        [RankEndpoint(0, args.events, args.replay)],
        lambda: ComputeState(prefill_rate_tps=8_000.0),
        on_routes=publish,
        poll_ms=10,
    ).start()


class Caller:
    """One keep-alive connection; `post` times one request to its last byte."""

    def __init__(self, url: str, token: str | None = None) -> None:
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def post(self, body: bytes) -> tuple[float, dict]:
        try:
            return self._post(body)
        except (http.client.HTTPException, OSError):  # an idle keep-alive closed: again
            self.conn.close()
            return self._post(body)

    def _post(self, body: bytes) -> tuple[float, dict]:
        started = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, self.headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        elapsed = time.perf_counter() - started
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {raw[:300]!r}")
        return elapsed, dict(resp.getheaders())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def figures(ms: list[float], direct: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(ms, 0.5), 3),
        "p90": round(percentile(ms, 0.9), 3),
        "p99": round(percentile(ms, 0.99), 3),
        "added_p50_ms": round(percentile(ms, 0.5) - percentile(direct, 0.5), 3),
        "added_p99_ms": round(percentile(ms, 0.99) - percentile(direct, 0.99), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300, help="requests each way")
    p.add_argument("--engine-url", default="http://127.0.0.1:18000")
    p.add_argument("--events", default="ipc:///tmp/deveng/kv.sock")
    p.add_argument("--replay", default="ipc:///tmp/deveng/replay.sock")
    p.add_argument("--model-dir", default=str(ROOT / "lab" / "engine" / "tiny-llama"))
    p.add_argument("--model", default="catsproto-tiny", help="the engine's served model name")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prompt-repeat", type=int, default=12, help="prompt = PROMPT x this")
    p.add_argument(
        "--start-engine",
        action="store_true",
        help="start a vLLM engine on 127.0.0.1 for this run (the lab's engine command, "
        "KV events on Unix sockets); otherwise one must run at --engine-url",
    )
    p.add_argument(
        "--peer",
        default="smg",
        help="the peer router measured beside the ingress (smg, sglang-router, "
        "vllm-router) or none",
    )
    args = p.parse_args(argv)
    from catsproto.lab import peers

    if args.peer != "none" and args.peer not in peers.PEERS:
        p.error(f"--peer {args.peer!r}: one of {', '.join(peers.PEERS)} or none")
    with tempfile.TemporaryDirectory(prefix="ingress-bench-engine-") as engine_dir:
        engine = None
        if args.start_engine:
            from catsproto.lab.engine import EngineSpec, LocalEngine

            spec = EngineSpec(host="127.0.0.1", port=free_port(), ipc_dir=Path(engine_dir))
            engine = LocalEngine(spec, Path(engine_dir) / "engine.log")
            engine.wait_ready()
            args.engine_url, args.events, args.replay = spec.url, spec.events, spec.replay
        try:
            return measure(args, peers)
        finally:
            if engine is not None:
                engine.close()


def measure(args: argparse.Namespace, peers: Any) -> int:
    """The run itself (see the module's docstring)."""
    engine = urlsplit(args.engine_url)
    host, port = engine.hostname or "127.0.0.1", engine.port or 80

    with tempfile.TemporaryDirectory(prefix="ingress-bench-") as tmp:
        d = Path(tmp)
        rib = d / "rib.json"
        write_rib(rib, host, {})
        agent = c_sma(args, host, rib)
        config = SteeringConfig(
            ingress="e1",
            rib_file=str(rib),
            links=(),
            sites={1: "e1"},
            next_hops={},
            secret=SECRET,
            secret_id=SECRET_ID,
            model_id=args.model,
            block_size=args.block_size,
            instance_port=port,
        )
        (d / "steering.json").write_text(json.dumps(config.to_json()))
        (d / "token").write_text(TOKEN + "\n")
        (d / "token").chmod(0o600)  # the ingress refuses a token file others may read
        ready = d / "ready"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "catsproto.cli",
                "ingress",
                "serve",
                "--config",
                str(d / "steering.json"),
                "--model",
                f"{args.model}={CS_ID}:{args.model_dir}:{port}",
                "--listen",
                "127.0.0.1:0",
                "--api-token-file",
                str(d / "token"),
                "--ready",
                str(ready),
                "--no-install-routes",
            ],
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
        peer = None
        try:
            if args.peer != "none":
                peer = peers.LocalPeer(
                    peers.PEERS[args.peer],
                    "127.0.0.1",
                    free_port(),
                    [args.engine_url],
                    free_port(),
                    d / "peer.log",
                )
                peer.wait_ready()
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the ingress did not start")
                time.sleep(0.05)
            (ingress_url,) = json.loads(ready.read_text())
            # a fresh first word: a prompt the engine has not cached yet, so its blocks'
            # BlockStored events reach the C-SMA (a cache hit publishes none)
            prompt = f"{os.urandom(6).hex()} " + PROMPT * args.prompt_repeat
            body = json.dumps({"model": args.model, "prompt": prompt, "max_tokens": 1}).encode()
            direct, through = Caller(args.engine_url), Caller(ingress_url, TOKEN)
            direct.post(body)  # the engine caches the prompt; the C-SMA advertises it
            expected = "0"
            deadline = time.monotonic() + 20
            while expected == "0" and time.monotonic() < deadline:
                time.sleep(0.1)
                _, headers = through.post(body)
                expected = headers.get("x-catsproto-expected-cached-blocks", "0")
            beside = Caller(peer.url) if peer is not None else None
            for _ in range(20):  # warm every path
                direct.post(body)
                through.post(body)
                if beside is not None:
                    beside.post(body)
            d_ms, i_ms, p_ms, decision_ms = [], [], [], []
            load_start = os.getloadavg()[0]
            for _ in range(args.requests):
                t, _ = direct.post(body)
                d_ms.append(1000 * t)
                t, headers = through.post(body)
                i_ms.append(1000 * t)
                decision_ms.append(float(headers["x-catsproto-decision-ms"]))
                if beside is not None:
                    t, _ = beside.post(body)
                    p_ms.append(1000 * t)
        finally:
            if peer is not None:
                peer.close()
            proc.terminate()
            proc.wait(timeout=10)
            agent.close()

    out = {
        "benchmark": "ingress_overhead",
        "requests_each": args.requests,
        "prompt_tokens_cached_blocks_expected": int(expected),
        "direct_ms": {
            "p50": round(percentile(d_ms, 0.5), 3),
            "p90": round(percentile(d_ms, 0.9), 3),
        },
        "ingress_ms": {
            "p50": round(percentile(i_ms, 0.5), 3),
            "p90": round(percentile(i_ms, 0.9), 3),
        },
        "added_p50_ms": round(percentile(i_ms, 0.5) - percentile(d_ms, 0.5), 3),
        "added_p90_ms": round(percentile(i_ms, 0.9) - percentile(d_ms, 0.9), 3),
        "ratio_p50": round(percentile(i_ms, 0.5) / percentile(d_ms, 0.5), 3),
        "decision_ms_p50": round(statistics.median(decision_ms), 3),
        "target_added_p50_ms": 2.0,
        "ingress": figures(i_ms, d_ms),
        "direct": figures(d_ms, d_ms),
        # the machine's 1-minute load at the start and end of the timed requests
        "load_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    if p_ms:
        out["peer"] = {
            "router": peers.PEERS[args.peer].requirement,
            "policy": peers.PEERS[args.peer].policy,
            **figures(p_ms, d_ms),
        }
        out["ingress_minus_peer_p50_ms"] = round(percentile(i_ms, 0.5) - percentile(p_ms, 0.5), 3)
        out["ingress_minus_peer_p99_ms"] = round(percentile(i_ms, 0.99) - percentile(p_ms, 0.99), 3)
        out["target_ingress_minus_peer_p50_ms"] = 1.0
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

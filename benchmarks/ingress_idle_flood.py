"""How long `/health` and a token holder wait while idle connections hold every handler
of the ingress, as JSON (issue 41, row 6: they used to get 503 for up to 10 s).

An `IngressServer` with the default 512 handlers (the lab's tiny model, no engine: the
two requests need none) on 127.0.0.1; an attacker opens `--idle` connections that send
nothing, from four loopback sources (127.0.0.2-5, each at its share of a quarter of the
handlers), and keeps them open. Then, `--rounds` times: GET /health, and GET /v1/models
with the token, each on a fresh connection, timed from connect to the last byte; the
idle connections the newcomers evicted are counted. The process needs about two file
descriptors per idle connection (the limit is raised to the hard limit).

    .venv/bin/python benchmarks/ingress_idle_flood.py [--idle 512] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

from ingress_refusal import service  # the same ingress, beside this script

from catsproto.adapters.ingress_http import IngressServer

TOKEN = "a-token-for-the-idle-flood-benchmark"


def ingress(rib: Path) -> IngressServer:
    """The ingress of `ingress_refusal.service` (the lab's tiny model, no engine), served."""
    return IngressServer(service(rib), api_token=TOKEN.encode(), install_routes=False).start()


def timed_get(address: tuple[str, int], path: str, token: str | None = None) -> tuple[int, float]:
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    started = time.perf_counter()
    with socket.create_connection(address, timeout=15) as sock:
        sock.sendall((head + "\r\n").encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    elapsed = time.perf_counter() - started
    return int(reply.split(b" ", 2)[1]), 1000 * elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as d:
        rib = Path(d) / "rib.json"
        rib.write_text(json.dumps({"sessions": {}, "routes": []}))
        server = ingress(rib)
        address = server.httpd.server_address[:2]
        idle = []
        try:
            for i in range(args.idle):
                sock = socket.socket()
                sock.bind((f"127.0.0.{2 + i % 4}", 0))
                sock.connect(address)
                idle.append(sock)
            deadline = time.monotonic() + 30
            while server.waiting < min(args.idle, 512) and time.monotonic() < deadline:
                time.sleep(0.05)
            held = server.waiting
            health, models, statuses = [], [], set()
            for _ in range(args.rounds):
                status, ms = timed_get(address, "/health")
                statuses.add(status)
                health.append(ms)
                status, ms = timed_get(address, "/v1/models", TOKEN)
                statuses.add(status)
                models.append(ms)
            stats = server.stats
            out = {
                "benchmark": "ingress_idle_flood",
                "machine": platform.machine(),
                "handlers": server.httpd.max_handlers,
                "idle_opened": args.idle,
                "idle_held_before": held,
                "statuses": sorted(statuses),
                "health_p50_ms": round(statistics.median(health), 2),
                "health_max_ms": round(max(health), 2),
                "token_holder_p50_ms": round(statistics.median(models), 2),
                "token_holder_max_ms": round(max(models), 2),
                "evicted": stats.evicted,
                "busy_refused": stats.busy_refused,
                "rounds": args.rounds,
            }
        finally:
            for sock in idle:
                sock.close()
            server.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Scenario 7, load: the selector's request API under a bounded load from a second process.

The steering service (`catsproto.adapters.steering`: RIB fed from the receiver's
rib.json, `PathSelector.decide`, the pyroute2 forwarder installing the chosen route) runs
as its own process in the receiver's namespace, listening on that namespace's loopback;
the instances keep publishing meanwhile, so the RIB under it changes twice a second.
`python -m catsproto.lab.faults.load` is the load generator, a second process in the same
namespace: `--threads` keep-alive HTTP/1.1 connections, each paced to its share of
`--rate` (open loop: a late request is sent at once, never skipped), every request a
`POST /decide` for site 1's cached conversation. It records every latency and every error
(non-200 answers, exceptions) and writes percentiles.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from catsproto.lab.faults.harness import RECEIVER, ChaosLab, Result
from catsproto.lab.instances import (
    BLOCK_TOKENS,
    DEMO_SECRET,
    DEMO_SECRET_ID,
    MODEL,
    demo_prefix_keys,
)

PORT = 8080
THREADS = 4


def loadgen(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bounded load on the steering API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--rate", type=float, default=1000)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    keys = demo_prefix_keys(1)
    body = json.dumps(
        {
            "cs_id": 100,
            "block_keys": [f"{int(k):016x}" for k in keys],
            "prompt_tokens": len(keys) * BLOCK_TOKENS,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[list[float]] = [[] for _ in range(args.threads)]
    errors: list[list[str]] = [[] for _ in range(args.threads)]
    chosen: list[dict[str, int]] = [{} for _ in range(args.threads)]
    start = time.monotonic() + 0.2
    per_thread = args.rate / args.threads

    def worker(i: int) -> None:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=10)
        n = 0
        while True:
            due = start + (n + i / args.threads) / per_thread
            if due - start >= args.seconds:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/decide", body, headers)
                resp = conn.getresponse()
                raw = resp.read()
                latencies[i].append(time.perf_counter() - t0)
                if resp.status != 200:
                    errors[i].append(f"{resp.status}: {raw[:100]!r}")
                else:
                    inst = json.loads(raw)["instance"]
                    chosen[i][inst] = chosen[i].get(inst, 0) + 1
            except (OSError, http.client.HTTPException, ValueError) as exc:
                errors[i].append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(args.host, args.port, timeout=10)
            n += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    lat = np.array([x for xs in latencies for x in xs]) * 1000
    all_errors = [e for es in errors for e in es]
    by_instance: dict[str, int] = {}
    for c in chosen:
        for k, v in c.items():
            by_instance[k] = by_instance.get(k, 0) + v
    pct = {f"p{q}": round(float(np.percentile(lat, q)), 3) for q in (50, 90, 99, 99.9)}
    report = {
        "requests": int(lat.size),
        "seconds": round(elapsed, 3),
        "rate_per_s": round(lat.size / elapsed, 1),
        "target_rate_per_s": args.rate,
        "threads": args.threads,
        "latency_ms": {**pct, "max": round(float(lat.max()), 3) if lat.size else None},
        "errors": len(all_errors),
        "first_errors": all_errors[:5],
        "chosen": by_instance,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def _planned(rate: float, seconds: float, threads: int) -> int:
    """How many requests the open-loop generator sends: the same schedule as `worker`."""
    per_thread = rate / threads
    total = 0
    for i in range(threads):
        n = 0
        while (n + i / threads) / per_thread < seconds:
            n += 1
        total += n
    return total


def serve(argv: list[str] | None = None) -> int:
    """`catsproto.adapters.steering`'s service and server, with Nagle off on the server
    side: its handler writes headers and body in two sends, and with Nagle on the body
    waits for the client's delayed ACK (~40 ms a request on a keep-alive connection)."""
    from catsproto.adapters import steering

    p = argparse.ArgumentParser(description="steering API for the load scenario")
    p.add_argument("--config", required=True)
    p.add_argument("--listen", required=True, help="ADDRESS:PORT")
    p.add_argument("--ready", required=True)
    p.add_argument("--nagle", action="store_true", help="leave Nagle on (as steering.py does)")
    args = p.parse_args(argv)
    config = steering.SteeringConfig.from_json(json.loads(Path(args.config).read_text()))
    forwarder = steering.Forwarder(config.next_hops, source=config.source, netns=config.netns)
    service = steering.SteeringService(config, forwarder)
    forwarder.kernel_routes()
    host, _, port = args.listen.rpartition(":")
    server = steering.SteeringServer(service, host, int(port))
    server.httpd.RequestHandlerClass.disable_nagle_algorithm = not args.nagle  # type: ignore[attr-defined]
    server.start()
    Path(args.ready).write_text(server.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.close()
        forwarder.remove_all()
    return 0


def _steering_config(lab: ChaosLab) -> dict:
    topo = lab.lab.topology
    links = [[k.a.node, k.b.node, k.delay_ms, 1000.0] for k in topo.links]
    return {
        "ingress": RECEIVER,
        "rib_file": str(lab.lab.rib_file(RECEIVER)),
        "links": links,
        "sites": {"1": "s1", "2": "s2"},
        "next_hops": {t: lab.address_of(t, RECEIVER) for t in ("t1", "t2")},
        "secret": DEMO_SECRET.hex(),
        "secret_id": DEMO_SECRET_ID,
        "model_id": MODEL,
        "block_size": BLOCK_TOKENS,
        "source": None,
        "instance_port": 8100,
        "netns": None,  # the service runs inside the receiver's namespace
    }


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("load", "load on the selector's request API (second process, loopback)")
    seconds = 60.0 if full else 8.0
    rate = 1000.0
    with ChaosLab(root) as lab:
        lab.start_feeder("i1", 0.5)
        lab.start_feeder("i2", 0.5)
        lab.wait_for(lambda: lab.origins() >= {"10.101.0.11", "10.102.0.11"}, 30, "instances")
        d = lab.lab.run_dir
        (d / "steering.json").write_text(json.dumps(_steering_config(lab)))
        ready = d / "steering.ready"
        argv = [sys.executable, "-m", "catsproto.lab.faults.load", "serve", "--config"]
        argv += [str(d / "steering.json"), "--listen", f"127.0.0.1:{PORT}", "--ready", str(ready)]
        lab.lab.handle.start(RECEIVER, "steering", argv)
        lab.wait_for(ready.exists, 15, "the steering API listening")
        out = d / "load.json"
        argv = [sys.executable, "-m", "catsproto.lab.faults.load", "--rate", str(rate)]
        argv += ["--seconds", str(seconds), "--out", str(out)]
        gen = lab.lab.handle.start(RECEIVER, "loadgen", argv)
        lab.wait_for(lambda: not lab.lab.handle.alive(gen), seconds * 3 + 30, "the load run")
        report = json.loads(out.read_text())
    result.time_label, result.time_s = "p99 latency (s)", report["latency_ms"]["p99"] / 1000
    result.misrouted = report["errors"]
    result.figures = report
    result.notes.append(
        "one selector counts its own decisions as load not yet advertised, so under "
        "1,000 requests/s it spreads the conversation over i1 and i2 (figures: chosen)"
    )
    planned = _planned(rate, seconds, THREADS)
    result.check("no errors", report["errors"] == 0)
    result.check(f"all {planned} planned requests answered", report["requests"] == planned)
    if full:
        # The rate is a figure of this machine: the minute-long run reports it as a check,
        # the short run (the test suite, on shared cores) only as a figure.
        result.check(f"sustained >= {rate:g} requests/s", report["rate_per_s"] >= rate * 0.98)
    else:
        result.notes.append(f"rate {report['rate_per_s']} requests/s (a figure, not a check)")
    result.check(
        "every request got an instance", sum(report["chosen"].values()) == report["requests"]
    )
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2:]))
    sys.exit(loadgen())

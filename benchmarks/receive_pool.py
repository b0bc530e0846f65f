"""Receive daemon throughput with its signature checks in 0, 1 and 2 worker processes, as
JSON.

The daemon's own loop (`exabgp_receive.run`: ExaBGP's JSON lines in, parse, decode,
verify against a trust file, RIB, the file sink writing `events.jsonl`, `rib.json` once
at the end as when the input runs dry) is fed the same burst of honest single-route
UPDATEs each time: signed advertisements of the `summary` kind of `benchmarks/verify.py`
(what an instance's node sends, about 2.5 KB), on `--routes` routes, every one accepted.
`--verify-workers 0` checks in the daemon's process; 1 and 2 check in a `VerifierPool`
ahead of the values' turn. Throughput is messages per second of wall time (the pool's
point is to use more than one core), best of `--rounds` interleaved rounds; the changes
each configuration hands out must be those of the one-process run, or the benchmark
fails.

With W workers and the daemon's process on C cores, the daemon can go no faster than
its own share of each message (parse, decode, the checks with state, RIB, files) allows,
nor than C cores allow in all: `share_of_daemon` is that share, measured as the
one-process cost less a bare verify (`bare_verify_us`), and `daemon_cpu_us_per_message`
is the CPU time the daemon's own process spent a message in each configuration (its
rate can never pass one message per that time).

    .venv/bin/python benchmarks/receive_pool.py [--messages 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from verify import typical_summary_advertisement  # noqa: E402

from catsproto import security, wire  # noqa: E402
from catsproto.adapters import exabgp_receive as rx  # noqa: E402
from catsproto.adapters.verifier_pool import VerifierPool  # noqa: E402
from catsproto.commands.eval import usable_cores  # noqa: E402
from catsproto.security.vectors import NOW_MS, fixture  # noqa: E402

F = fixture()
PEER = "10.0.0.1"


def update(value: bytes, prefix: ipaddress.IPv4Network) -> str:
    body = {
        "attribute": {"origin": "igp", "attribute-0xFF-0xC0": "0x" + value.hex()},
        "announce": {"ipv4 unicast": {PEER: [{"nlri": str(prefix)}]}},
    }
    message = {"update": body}
    return json.dumps(
        {"type": "update", "neighbor": {"address": {"peer": PEER}, "message": message}}
    )


def burst(n: int, routes: int) -> list[str]:
    """n honest UPDATEs over `routes` /32s, each route's sequence rising."""
    base = typical_summary_advertisement().replace(F.at(1, 1).origin, wire.Timestamp(NOW_MS - 1000))
    hosts = [ipaddress.ip_network(f"10.0.{8 + i // 250}.{i % 250 + 1}/32") for i in range(routes)]
    lines = []
    for i in range(n):
        adv = base.replace(wire.Sequence(1, i + 1))
        lines.append(
            update(wire.encode(security.sign(adv, F.node, hosts[i % routes])), hosts[i % routes])
        )
    return lines


def once(folder: Path, lines: list[str], workers: int) -> tuple[float, float, list[str]]:
    """Wall and daemon-process CPU seconds for the burst, and the kinds of the changes
    handed out."""
    folder.mkdir()
    trust = folder / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    trust.chmod(0o644)
    clock = lambda: NOW_MS / 1000  # noqa: E731
    verifier = rx.TrustFileVerifier(trust, clock=clock, log=lambda m: None)
    rib = rx.CacheRib(verifier=verifier)
    out = folder / f"out{workers}"
    sink = rx.FileSink(out, rib, coalesce=True)
    kinds: list[str] = []

    def on_change(change: rx.Change) -> None:
        kinds.append(change.kind)
        sink(change)

    pool = None
    if workers:
        pool = VerifierPool(workers, trust, optional=False, attribute_type=255)
        pool.submit([]).result()  # workers up before the clock starts
    try:
        t, cpu = time.perf_counter(), time.process_time()
        rx.run(lines, rib, on_change, clock=clock, log=lambda m: None, pool=pool)
        sink.flush()
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    finally:
        if pool is not None:
            pool.close()
    return wall, cpu, kinds


def value_of(line: str) -> bytes:
    attributes = json.loads(line)["neighbor"]["message"]["update"]["attribute"]
    return bytes.fromhex(attributes["attribute-0xFF-0xC0"][2:])


def value_bytes(line: str) -> int:
    return len(value_of(line))


def bare_verify_us(lines: list[str]) -> float:
    value = value_of(lines[0])
    prefix = ipaddress.ip_network("10.0.8.1/32")
    adv = wire.decode(value)
    message = security.signed_message(security.without_signature(value), prefix)
    sig, key = adv.signature.signature, F.node.public  # type: ignore[union-attr]
    n = 2000
    t = time.process_time()
    for _ in range(n):
        key.verify(sig, message)
    return (time.process_time() - t) / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=3000, help="UPDATEs per burst")
    p.add_argument("--routes", type=int, default=500, help="routes they are spread over")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, best kept")
    args = p.parse_args()
    if args.messages < 1 or args.routes < 1 or args.rounds < 1:
        p.error("--messages, --routes and --rounds must be at least 1")
    lines = burst(args.messages, args.routes)
    best: dict[int, float] = {}
    cpu_best: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="catsproto-pool-") as tmp:
        reference = None
        for r in range(args.rounds):
            for workers in (0, 1, 2):
                wall, cpu, kinds = once(Path(tmp) / f"r{r}w{workers}", lines, workers)
                reference = reference or kinds
                if kinds != reference:
                    raise SystemExit(f"{workers} worker(s): other changes than in one process")
                best[workers] = min(best.get(workers, wall), wall)
                cpu_best[workers] = min(cpu_best.get(workers, cpu), cpu)
                print(f"round {r + 1}: {workers} worker(s) {wall:.2f} s", file=sys.stderr)
    assert reference is not None and reference.count("accept") == args.messages
    rate = {w: args.messages / s for w, s in best.items()}
    bare = bare_verify_us(lines)
    one_process_us = 1e6 / rate[0]
    out = {
        "benchmark": "receive_pool",
        "messages": args.messages,
        "routes": args.routes,
        "value_bytes": value_bytes(lines[0]),
        "usable_cores": usable_cores(),
        "load_1min": round(os.getloadavg()[0], 2),
        "messages_per_s": {f"{w}_workers": round(v) for w, v in rate.items()},
        "one_worker_over_none": round(rate[1] / rate[0], 2),
        "two_workers_over_one": round(rate[2] / rate[1], 2),
        "two_workers_over_none": round(rate[2] / rate[0], 2),
        "one_process_us_per_message": round(one_process_us, 1),
        # the daemon's own process: what caps its rate whatever the cores
        "daemon_cpu_us_per_message": {
            f"{w}_workers": round(c / args.messages * 1e6, 1) for w, c in cpu_best.items()
        },
        "bare_verify_us": round(bare, 1),
        "share_of_daemon": round((one_process_us - bare) / one_process_us, 2),
        "changes_identical": True,
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

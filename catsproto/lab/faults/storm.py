"""Scenario 5, eviction storm and churn: 10,000 block events per second at one instance.

`python -m catsproto.lab.faults.storm` is the instance side: the node's own
`AdvertisementBuilder` (dampening: 500 ms minimum, 5 s maximum interval) over a
`TieredCache` of 4,000 HBM blocks, fed with fresh prompts so that every block stored
evicts one (two block events per block), at `--rate` events per second; every 20 ms it
polls the builder, signs what comes out with the instance's lab key and publishes it into
s2's spool. It writes its own counts (events, polls, advertisements, per-route gaps) on
exit. The scenario watches the receiver: the advertisement rate per route must stay
within the dampening bounds, the receiving process's memory (RSS, the selector's RIB)
must stay flat, and no BGP session may go down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from catsproto import security, wire
from catsproto.adapters.exabgp_announce import Spool
from catsproto.lab.faults.harness import RECEIVER, ChaosLab, Result
from catsproto.lab.instances import lab_key
from catsproto.lab.topology import load
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)

I2 = "10.102.0.11"
MIN_INTERVAL_MS, MAX_INTERVAL_MS = 500, 5_000
CAPACITY_BLOCKS = 4_000
TICK_S = 0.02


def storm(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="chaos lab: an instance under an eviction storm")
    p.add_argument("--topology", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--rate", type=float, default=10_000)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    topology = load(args.topology)
    spec = next(s for n in topology.nodes.values() for s in n.instances if s.name == args.instance)
    signer = lab_key(topology, spec.name)
    cache = TieredCache([TierSpec(wire.Tier.HBM, CAPACITY_BLOCKS, 5, 1_600_000)])
    builder = AdvertisementBuilder(
        BuilderConfig(
            cs_id=spec.cs_id,
            address=str(spec.address),
            site_id=spec.site_id,
            model_id="meta-llama/Llama-3.1-8B-Instruct",
            block_size=512,
            bytes_per_block=64 << 20,
            shard_range=str(spec.shards),
            as_path_hops=4,
            dampening=DampeningPolicy(MIN_INTERVAL_MS, MAX_INTERVAL_MS),
        ),
        cache,
        epoch=int(time.time()),
    )
    spool = Spool(args.spool)
    rng = np.random.default_rng(5)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    events = blocks = 0
    sent: dict[str, list[int]] = {}
    start = time.monotonic()
    next_tick = start
    while not stopping and time.monotonic() - start < args.seconds:
        due = args.rate * (time.monotonic() - start) - events
        while due > 0:  # fresh 32-block prompts: each block stored evicts one when full
            keys = (rng.integers(0, 2**63, size=32, dtype=np.uint64) * np.uint64(2)).tolist()
            _, changes = cache.admit(keys)
            n = sum(max(1, len(c.keys)) for c in changes)
            events += n
            blocks += len(keys)
            due -= n
        now_ms = int(time.time() * 1000)
        state = ComputeState(prefill_rate_tps=20_000, kv_utilisation=1.0, utilisation=0.5)
        for route in builder.poll(now_ms, state):
            value = wire.encode(security.sign(route.advertisement, signer, route.prefix))
            spool.publish(route.prefix, value)
            sent.setdefault(str(route.prefix), []).append(now_ms)
        next_tick += TICK_S
        time.sleep(max(0.0, next_tick - time.monotonic()))
    elapsed = time.monotonic() - start
    gaps = {p: int(np.diff(t).min()) if len(t) > 1 else None for p, t in sent.items()}
    Path(args.out).write_text(
        json.dumps(
            {
                "seconds": round(elapsed, 3),
                "block_events": events,
                "block_events_per_s": round(events / elapsed),
                "prompts_blocks": blocks,
                "polls": builder.stats.polls,
                "updates": builder.stats.updates,
                "advertisements": builder.stats.advertisements,
                "suppressed": builder.stats.suppressed,
                "per_route": {p: len(t) for p, t in sent.items()},
                "min_gap_ms": gaps,
            },
            indent=1,
        )
    )
    return 0


def _rss_kb(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run(root: Path, *, full: bool = False) -> Result:
    result = Result("storm", "eviction storm and churn (10,000 block events/s at i2)")
    seconds = 60.0 if full else 10.0
    with ChaosLab(root) as lab:
        lab.start_feeder("i1", 1.0)
        out = lab.lab.run_dir / "storm.json"
        argv = [sys.executable, "-m", "catsproto.lab.faults.storm", "--topology"]
        argv += [str(lab.topology_path.resolve()), "--instance", "i2", "--out", str(out)]
        argv += ["--spool", str(lab.lab.node_dir("s2") / "spool"), "--seconds", str(seconds)]
        lab.wait_for(lambda: "10.101.0.11" in lab.origins(), 30, "i1 at the receiver")
        started = time.time()
        mark = len(lab.events())
        proc = lab.lab.handle.start("s2", "storm", argv)
        lab.wait_for(lambda: I2 in lab.origins(), 30, "i2 at the receiver")
        receive_pid = lab.receive_process_pid()
        rss: list[tuple[float, int]] = []
        routes_seen: list[int] = []
        while lab.lab.handle.alive(proc):
            kb = _rss_kb(receive_pid)
            if kb is not None:
                rss.append((time.time() - started, kb))
            routes_seen.append(len(lab.routes()))
            time.sleep(0.25)
        stats = json.loads(out.read_text())
        time.sleep(1.0)
        events = lab.events()[mark:]
        downs = lab.session_downs(started)
        sessions = lab.lab.sessions()
        lab_transits = set(lab.transit_peers())
    accepted = [e for e in events if e.get("kind") == "accept" and e["entry"]["origin"] == I2]
    per_route: dict[tuple[str, str], list[int]] = {}
    for e in accepted:
        per_route.setdefault((e["peer"], e["prefix"]), []).append(e["entry"]["timestamp_ms"])
    min_gap = min(
        (int(np.diff(sorted(set(t))).min()) for t in per_route.values() if len(set(t)) > 1),
        default=None,
    )
    bound = int(stats["seconds"] * 1000 / MIN_INTERVAL_MS) + 1
    most = max(stats["per_route"].values(), default=0)
    half = len(rss) // 2
    early = max((kb for _, kb in rss[:half]), default=0)
    late = max((kb for _, kb in rss[half:]), default=0)
    refused = [e for e in events if e.get("kind") == "treat-as-withdraw"]
    transit_peers = lab_transits
    established = all(
        state in ("up", "Established")
        for node, peers in sessions.items()
        for peer, state in peers.items()
        if node != RECEIVER or peer in transit_peers
    )
    result.time_label, result.time_s, result.misrouted = "duration", stats["seconds"], None
    result.rejected = {}
    result.figures = {
        "block_events": stats["block_events"],
        "block_events_per_s": stats["block_events_per_s"],
        "builder": {k: stats[k] for k in ("polls", "updates", "advertisements", "suppressed")},
        "advertisements_per_route_max": most,
        "dampening_bound_per_route": bound,
        "min_gap_at_source_ms": min(
            (g for g in stats["min_gap_ms"].values() if g is not None), default=None
        ),
        "min_gap_at_receiver_ms": min_gap,
        "accepted_at_receiver": len(accepted),
        "refused_at_receiver": len(refused),
        "receive_process_rss_kb": {"first_half_max": early, "second_half_max": late},
        "receiver_routes_max": max(routes_seen, default=0),
        "sessions": sessions,
    }
    result.check("10,000 block events/s sustained", stats["block_events_per_s"] >= 9_500)
    result.check(f"at most one update per {MIN_INTERVAL_MS} ms per route", most <= bound)
    result.check(
        f"receiver saw no two updates of a route closer than {MIN_INTERVAL_MS} ms",
        min_gap is None or min_gap >= MIN_INTERVAL_MS - 5,
    )
    result.check("updates reached the receiver", len(accepted) > 0 and not refused)
    result.check("receiver memory flat (second half within 10% + 2 MB)", late <= early * 1.1 + 2048)
    result.check("no session went down", not downs and established)
    return result


if __name__ == "__main__":
    sys.exit(storm())

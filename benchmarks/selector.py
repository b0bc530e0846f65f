"""Selector decision rate and latency against a per-instance loop, and growth with fleet size.

Prints JSON. The fleet: N instances, each advertising a binary fuse summary of B block
keys (1% FPR) in HBM; a pool of 128-block prompts whose prefixes are each held, whole or
in part, by a few instances. Measured in one run:

- `selector`: PathSelector.decide with the key index warm (the pool's prompts recur, as
  prompt prefixes do in real traffic), cold (every prompt entirely new: its first key is
  asked of every instance, the rest of the few that hold it), and "new tail" (a held
  prefix followed by blocks never seen); with the summary lookups each decision made;
- `first_key_probe`: what asking one new key of every instance costs by itself (the
  compiled pass over all filters, memory reads in ~110 MB at the headline size), per key
  when the keys come one at a time and 16 at a time (a burst's new prompts asked
  together), the one-key pass without the prefetches that request each pair's cache
  lines ahead of its reads (`prefetch_speedup_ratio`, interleaved rounds), and the cold
  rate a decision could reach if it cost no more than a warm decision plus that one pass
  (`cold_bound_decisions_per_s`);
- `baseline`: the straightforward way — for every instance, probe its summary with all
  128 keys, take the leading run, compute the same TTFT estimate — one Python loop.

    python benchmarks/selector.py [--instances 1000] [--blocks 100000] [--curve]   # JSON lines
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import time

import numpy as np

from catsproto import wire
from catsproto.selector import RIB, Link, Network, PathSelector, Request, SelectorConfig
from catsproto.summary import build_shards, entry_budget

BLOCK = 512
PROMPT_BLOCKS = 128


def build_fleet(n: int, blocks: int, pool: np.ndarray, rng: np.random.Generator, pool_size: int):
    """A RIB of n instances over 10 sites; pool prompts' prefixes planted at a few each."""
    rib = RIB(hold_time_ms=10**12)
    sites = 10
    links = [Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, sites + 1)]
    distinct = min(n, 64)  # summaries are expensive to build: reuse a pool of them
    summaries = []
    for i in range(distinct):
        keys = rng.integers(0, 2**63, size=blocks, dtype=np.uint64)
        # plant some pool prefixes: instance i holds prompts i, i+distinct, ... (whole or half)
        planted = [
            pool[j][: PROMPT_BLOCKS if (i + j) % 2 else PROMPT_BLOCKS // 2]
            for j in range(i % pool_size, pool_size, distinct)
        ]
        if planted:
            keys[: sum(len(p) for p in planted)] = np.concatenate(planted)[:blocks]
        # shards by key range, each fitting one extended (65535-byte) UPDATE
        summaries.append(build_shards(keys, entry_budget(65535, 400), 0.01, kind=3))
    for i in range(n):
        for shard in summaries[i % distinct]:
            s = shard.summary
            entry = wire.SummaryEntry(
                tier=wire.Tier.HBM,
                kind=wire.SummaryKind(s.kind),
                version=1,
                base_version=0,
                key_lo=shard.key_lo,
                key_hi=shard.key_hi,
                entry_count=shard.entry_count,
                bytes_per_block=64 << 20,
                fetch_latency_us=5,
                fetch_bandwidth_mbps=800_000,
                params=s.params(),
                body=s.encode(),
            )
            adv = wire.Advertisement.build(
                wire.Version(1),
                wire.Origin(7, 1 + i % sites, ipaddress.IPv4Address(0x0A000000 + i + 1)),
                wire.Sequence(1, 1),
                wire.Timestamp(1),
                wire.CacheModel("bench", BLOCK, wire.KeyScheme.BLAKE2B64_CHAINED, 1),
                wire.CacheSummaries((entry,)),
            )
            rib.accept(adv, now_ms=1)
    return rib, Network(links)


def baseline_decide(rib: RIB, net: Network, req: Request) -> tuple[float, str]:
    """Per instance: probe all keys, leading run, same TTFT terms. No index, no vectors.
    Equal estimates go to the lowest slot, as in the selector."""
    best = (float("inf"), -1, "")
    for inst in rib.services[req.cs_id].live():
        path = net.path(req.ingress, f"site{inst.site_id}")
        held = inst.lookup(req.block_keys) > 0
        run = int(np.argmin(held)) if not held.all() else len(held)
        p = inst.fpr
        cached = max(0.0, run - p / (1 - p)) * BLOCK if run else 0.0
        ttft = (
            path.rtt_ms
            + req.prompt_tokens * 32 / (path.bandwidth_mbps * 1000)
            + inst.backlog_tokens / inst.prefill_tps * 1000
            + (req.prompt_tokens - cached) / inst.prefill_tps * 1000
        )
        best = min(best, (ttft, inst.slot, str(inst.address)))
    return best[0], best[2]


def lookups(sel: PathSelector) -> int:
    """Summary lookups made so far: (key, filter) pairs the fleet probe evaluated."""
    return sum(index.fleet.pairs for index in sel._index.values())


def time_calls(fn, reqs, seconds: float, once: bool = False) -> dict[str, float]:
    """Latency of fn over reqs, cycling through them for `seconds` (or each only once)."""
    lat = []
    start = time.perf_counter()
    cpu0 = time.process_time()
    i = 0
    while (time.perf_counter() - start < seconds or i < 20) and not (once and i >= len(reqs)):
        t0 = time.perf_counter()
        fn(reqs[i % len(reqs)])
        lat.append(time.perf_counter() - t0)
        i += 1
    cpu = time.process_time() - cpu0
    arr = np.array(lat) * 1000
    return {
        "calls": len(lat),
        "decisions_per_s": round(len(lat) / sum(lat), 1),
        # per second of this process's CPU time: one core's rate, whatever else runs
        "decisions_per_cpu_s": round(len(lat) / cpu, 1) if cpu > 0 else None,
        "p50_ms": round(float(np.percentile(arr, 50)), 4),
        "p99_ms": round(float(np.percentile(arr, 99)), 4),
    }


def first_key_probe(sel: PathSelector, rng: np.random.Generator, warm_p50_ms: float) -> dict:
    """Microseconds per new key asked of every instance (FleetProbe.held), one key per
    call and 16 per call, and the cold rate bounded by warm p50 + one single-key pass.
    The one-key pass is also timed without its prefetches, in rounds interleaved with it
    (best round of each), for the ratio they gain."""
    fleet = sel._index[7].fleet

    def per_key(burst: int, calls: int) -> float:
        keys = rng.integers(0, 2**63, size=(calls, burst), dtype=np.uint64)
        start = time.process_time()
        for row in keys:
            fleet.held(row)
        return (time.process_time() - start) / keys.size * 1e6

    out: dict[str, float] = {"us_per_key_16_per_call": round(per_key(16, 128), 1)}
    rounds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(8):
        for prefetch in (True, False):
            fleet.prefetch = prefetch
            rounds[prefetch].append(per_key(1, 512))
    fleet.prefetch = True
    with_, without = min(rounds[True]), min(rounds[False])
    out["us_per_key_1_per_call"] = round(with_, 1)
    out["us_per_key_1_per_call_without_prefetch"] = round(without, 1)
    out["prefetch_speedup_ratio"] = round(without / with_, 3)
    out["cold_bound_decisions_per_s"] = round(1e6 / (with_ + warm_p50_ms * 1000))
    return out


def run(n: int, blocks: int, seconds: float, baseline: bool) -> dict:
    rng = np.random.default_rng(7)
    pool_size = 256
    pool = rng.integers(0, 2**63, size=(pool_size, PROMPT_BLOCKS), dtype=np.uint64)
    t0 = time.perf_counter()
    rib, net = build_fleet(n, blocks, pool, rng, pool_size)
    setup_s = time.perf_counter() - t0
    reqs = [Request(7, pool[i], PROMPT_BLOCKS * BLOCK, "ingress") for i in range(pool_size)]
    sel = PathSelector(rib, net)
    for _ in range(2):  # warm the index: a prompt's keys are indexed when they recur
        for r in reqs:
            sel.decide(r, now_ms=2)
    out = {"instances": n, "blocks_per_instance": blocks, "setup_s": round(setup_s, 1)}

    def measure(case: str, prompts: list[np.ndarray], secs: float, once: bool) -> None:
        reqs_ = [Request(7, keys, PROMPT_BLOCKS * BLOCK, "ingress") for keys in prompts]
        before = lookups(sel)
        out[f"selector_{case}"] = res = time_calls(
            lambda r: sel.decide(r, now_ms=2), reqs_, secs, once=once
        )
        res["lookups_per_decision"] = round((lookups(sel) - before) / res.pop("calls"), 2)

    measure("warm", [r.block_keys for r in reqs], seconds, once=False)
    unique = 8000  # more new prompts than a timed run gets through: none recurs
    new_keys = rng.integers(0, 2**63, size=(unique, PROMPT_BLOCKS), dtype=np.uint64)
    measure("cold", list(new_keys), seconds / 2, once=True)
    # prompts that share a held prefix but were never seen: the first key is known, the
    # rest is asked of the prefix's holders only
    tails = rng.integers(0, 2**63, size=(unique, PROMPT_BLOCKS * 3 // 4), dtype=np.uint64)
    held = [pool[i % pool_size][: PROMPT_BLOCKS // 4] for i in range(unique)]
    tailed = [np.concatenate(p) for p in zip(held, tails, strict=True)]
    measure("new_tail", tailed, seconds / 2, once=True)
    out["first_key_probe"] = first_key_probe(sel, rng, out["selector_warm"]["p50_ms"])
    out["instance_lookups_per_decision_baseline"] = n * PROMPT_BLOCKS
    if baseline:
        out["baseline_loop"] = time_calls(lambda r: baseline_decide(rib, net, r), reqs, seconds)
        out["baseline_loop"].pop("calls")
        for case in ("warm", "cold", "new_tail"):
            out[f"{case}_over_baseline_ratio"] = round(
                out[f"selector_{case}"]["decisions_per_s"]
                / out["baseline_loop"]["decisions_per_s"],
                1,
            )
        # Same choice as the loop when the selector's extras (remote KV, own-load
        # accounting) are off: a fresh selector per request.
        agree = sum(
            str(
                PathSelector(rib, net, SelectorConfig(allow_remote_kv=False))
                .decide(r, now_ms=2)
                .chosen.address
            )
            == baseline_decide(rib, net, r)[1]
            for r in reqs[:25]
            + [Request(7, k, PROMPT_BLOCKS * BLOCK, "ingress") for k in new_keys[:25]]
        )
        out["same_choice_as_baseline_of_50"] = agree
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--curve", action="store_true", help="also 10 -> 10,000 instances")
    args = parser.parse_args()
    headline = run(args.instances, args.blocks, args.seconds, True)
    print(json.dumps({"benchmark": "selector", "headline": headline}), flush=True)
    if args.curve:  # one JSON line per fleet size, printed as it completes
        for n in (10, 100, 1000, 3000, 10_000):
            r = run(n, 10_000, args.seconds / 2, baseline=n <= 1000)
            print(json.dumps({"benchmark": "selector", "curve": r}), flush=True)


if __name__ == "__main__":
    main()

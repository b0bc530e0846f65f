"""Summary benchmark: size, false-positive rate, speed, delta cost, shard counts (JSON).

Run: .venv/bin/python benchmarks/summary.py [--quick]

Every comparison is a ratio between figures measured in this same run. Keys are seeded
random u64 (block keys are keyed hashes, so they are uniform); non-members are 1M other
random u64. The process is pinned to one CPU where the OS allows it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

from catsproto.summary import (
    KIND_BLOOM,
    KIND_EXACT,
    KIND_FUSE,
    DeltaSummary,
    Summary,
    build_shards,
    entry_budget,
)

TARGET = 0.01


def timed(fn, repeat: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, out = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def median_time(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_kinds(n: int, probes: np.ndarray, rng: np.random.Generator, quick: bool) -> dict:
    keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64))
    non_members = probes[~np.isin(probes, keys)]
    out: dict = {"keys": int(keys.size), "non_member_probes": int(non_members.size)}
    repeat = 1 if n >= 1_000_000 or quick else 5
    for name, kind in (("fuse", KIND_FUSE), ("bloom", KIND_BLOOM)):
        build_s = median_time(lambda k=kind: Summary.build(keys, TARGET, kind=k, seed=1), repeat)
        s = Summary.build(keys, TARGET, kind=kind, seed=1)
        assert s.contains_many(keys).all(), "false negative"
        query_s, hits = timed(lambda s=s: s.contains_many(non_members), 3)
        out[name] = {
            "bits_per_key": round(s.size() * 8 / keys.size, 3),
            "bytes": s.size(),
            "expected_fpr": round(s.fpr, 6),
            "measured_fpr": round(float(np.mean(hits)), 6),
            "build_ms": round(build_s * 1e3, 2),
            "query_keys_per_s": round(non_members.size / query_s),
        }
    exact = Summary.build(keys, TARGET, kind=KIND_EXACT)
    out["exact_bits_per_key"] = round(exact.size() * 8 / keys.size, 3)
    auto_s = median_time(lambda: Summary.build(keys, TARGET), repeat)
    out["auto_kind"] = Summary.build(keys, TARGET).kind
    out["auto_build_ms"] = round(auto_s * 1e3, 2)
    bound = math.log2(1 / TARGET)
    bloom_theory = bound / math.log(2)
    out["bits_per_key_side_by_side"] = {
        "bound": round(bound, 3),
        "bloom_theory": round(bloom_theory, 3),
        "bloom_measured": out["bloom"]["bits_per_key"],
        "ours_fuse": out["fuse"]["bits_per_key"],
    }
    out["ratios"] = {
        "fuse_over_bound": round(out["fuse"]["bits_per_key"] / bound, 4),
        "fuse_over_bloom": round(out["fuse"]["bits_per_key"] / out["bloom"]["bits_per_key"], 4),
        "fuse_query_over_bloom_query": round(
            out["fuse"]["query_keys_per_s"] / out["bloom"]["query_keys_per_s"], 3
        ),
    }
    out["targets_met"] = {
        "fpr_le_1pct": out["fuse"]["measured_fpr"] <= TARGET,
        "bits_le_8": out["fuse"]["bits_per_key"] <= 8.0,
        "query_ge_5M_per_s": out["fuse"]["query_keys_per_s"] >= 5_000_000,
    }
    if n == 100_000:
        out["targets_met"]["build_100k_lt_100ms"] = out["fuse"]["build_ms"] < 100
    return out


def bench_churn(n: int, rng: np.random.Generator) -> dict:
    """1 % of blocks evicted and as many new ones cached between two updates."""
    keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64))
    churn = n // 100
    evicted = rng.choice(keys, churn, replace=False)
    fresh = rng.integers(0, 2**64, churn, dtype=np.uint64)
    new = np.union1d(np.setdiff1d(keys, evicted), fresh)
    delta = DeltaSummary.between(keys, new)
    snapshot = Summary.build(new, TARGET, seed=1)
    changed = delta.changed
    return {
        "keys": int(keys.size),
        "changed_blocks": changed,
        "delta_bytes": delta.size(),
        "delta_bytes_per_changed_block": round(delta.size() / changed, 3),
        "snapshot_kind": snapshot.kind,
        "snapshot_bytes": snapshot.size(),
        "snapshot_bytes_per_changed_block": round(snapshot.size() / changed, 3),
        "delta_over_snapshot": round(delta.size() / snapshot.size(), 4),
    }


def bench_shards(n: int, rng: np.random.Generator) -> dict:
    keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64))
    out = {"keys": int(keys.size)}
    for label, message in (("msg_4096", 4096), ("msg_65535", 65535)):
        budget = entry_budget(message, 400)
        shards = build_shards(keys, budget, TARGET)
        out[label] = {
            "budget_bytes": budget,
            "shards": len(shards),
            "largest_tlv_bytes": max(s.tlv_bytes for s in shards),
            "fill": round(sum(s.tlv_bytes for s in shards) / (budget * len(shards)), 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="10k and 100k only")
    args = parser.parse_args()
    pinned = False
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            pinned = True
        except OSError:
            pass
    rng = np.random.default_rng(20240601)
    probes = rng.integers(0, 2**64, 1_000_000, dtype=np.uint64)
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    result = {
        "target_fpr": TARGET,
        "env": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "pinned_to_one_cpu": pinned,
        },
        "kinds": {str(n): bench_kinds(n, probes, rng, args.quick) for n in sizes},
        "churn_1pct": {str(n): bench_churn(n, rng) for n in sizes[1:]},
        "shards": {str(n): bench_shards(n, rng) for n in sizes[1:]},
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

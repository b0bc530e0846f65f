"""Advertisement-building speed: the sender's paths against the code they replaced (JSON).

Run: .venv/bin/python benchmarks/build.py [--requests 3000] [--rounds 3]

Everything is a ratio measured in this same run (the machine is shared; absolute times
move with its load, ratios much less). Two parts:

1. primitives, at the sizes of the S1 simulation (a shard of ~1,000 keys, deltas of
   ~60): the Rice coder, the fuse filter's construction and body codec, `unique_keys`
   on sorted keys and `TieredCache.admit`, each against its reference — the bit loops,
   numpy peeling rounds, `np.unique` and block-by-block admit that were the code before
   (kept below, or in `catsproto.summary.fuse.solve_reference`). Median µs per call.
2. churn: the first requests of the Mooncake conversation trace through one modelled
   instance (1,000 HBM blocks) and a sharded `AdvertisementBuilder` configured as in S1
   (4096-byte messages, 1 % target, 1 s / 60 s dampening) and polled on the trace's
   clock, every summary entry decoded and applied by a receiver — once with the
   reference primitives patched in, once as shipped, alternately `--rounds` times (best
   of each). The advertisements and the receivers' states must come out the same byte
   for byte; the script fails otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from catsproto import wire
from catsproto.adapters.trace_download import find_or_download_trace
from catsproto.keys import ENGINE_MOONCAKE, BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)
from catsproto.node.cache import BlockEvent, BlockEventKind, PrefixHit
from catsproto.summary import FuseSummary, Summary, SummaryReceiver, riceset, shard, versioning
from catsproto.summary import base as summary_base
from catsproto.summary import delta as summary_delta
from catsproto.summary import exact as summary_exact
from catsproto.summary import fuse as summary_fuse
from catsproto.wire import Tier

SECRET = b"benchmark-secret-0123456789abcdef"

# ---- the reference implementations (the code before the speed-up) -----------------------


def reference_low_bits(values: np.ndarray, width: int) -> np.ndarray:
    """`low_bits` as the Rice and fuse encoders did it: one shift and mask per bit."""
    bits = np.empty((values.size, width), dtype=np.uint8)
    for j in range(width):
        bits[:, j] = (values >> np.uint64(width - 1 - j)) & np.uint64(1)
    return bits


def reference_from_bits(bits: np.ndarray) -> np.ndarray:
    """`from_bits` as the decoders did it: one shift and or per bit."""
    out = np.zeros(bits.shape[0], dtype=np.uint64)
    for j in range(bits.shape[1]):
        out <<= np.uint64(1)
        out |= bits[:, j]
    return out


def reference_unique_keys(keys: object) -> np.ndarray:
    return np.unique(summary_base.as_key_array(keys))


def reference_sorted_difference(keys: np.ndarray, other: np.ndarray) -> np.ndarray:
    return np.setdiff1d(keys, other, assume_unique=True)


def reference_split_keys(keys: np.ndarray, shard_bits: int) -> list[np.ndarray]:
    lows = [shard.shard_range(i, shard_bits)[0] for i in range(1, 1 << shard_bits)]
    return np.split(keys, np.searchsorted(keys, lows))


def reference_size(self: Summary) -> int:
    return len(self.params()) + len(self.encode())


def reference_admit(self: TieredCache, keys: Sequence[int]) -> tuple[PrefixHit, list[BlockEvent]]:
    """`TieredCache.admit` block by block through the primitives, events merged after."""
    if self.specs[self.order[0]].capacity_blocks < 1:
        raise ValueError("the top tier needs room for at least one block to admit")
    hit = self.lookup(keys)
    for k in keys[: hit.depth]:
        self.hits[k] = self.hits.get(k, 0) + 1
    events: list[BlockEvent] = []
    top = self.order[0]
    parent_depth = 0
    for k in keys:
        self.depth.setdefault(k, parent_depth + 1)
        parent_depth = self.depth[k]
        where = self.tier_of(k)
        if where == top:
            self._touch(top, k)
            continue
        if where is not None:
            self._discard(where, k)
            events.append(BlockEvent(BlockEventKind.MOVED, where, (k,), top))
        else:
            events.append(BlockEvent(BlockEventKind.STORED, top, (k,)))
        _reference_make_room(self, top, events)
        self._insert(top, k)
    for k in reversed(keys):
        if k in self._lru[top]:
            self._touch(top, k)
    merged: list[BlockEvent] = []
    for ev in events:
        last = merged[-1] if merged else None
        if last and (last.kind, last.tier, last.to_tier) == (ev.kind, ev.tier, ev.to_tier):
            merged[-1] = BlockEvent(ev.kind, ev.tier, last.keys + ev.keys, ev.to_tier)
        else:
            merged.append(ev)
    return hit, merged


def _reference_make_room(cache: TieredCache, tier: Tier, events: list[BlockEvent]) -> None:
    capacity = cache.specs[tier].capacity_blocks
    lru = cache._lru[tier]
    while lru and len(lru) >= capacity:
        victim = next(iter(lru))
        cache._discard(tier, victim)
        i = cache.order.index(tier)
        below = cache.order[i + 1] if i + 1 < len(cache.order) else None
        if below is not None and cache.specs[below].capacity_blocks > 0:
            _reference_make_room(cache, below, events)
            cache._insert(below, victim)
            events.append(BlockEvent(BlockEventKind.MOVED, tier, (victim,), below))
        else:
            events.append(BlockEvent(BlockEventKind.REMOVED, tier, (victim,)))


def _reference_solve(
    keys: np.ndarray, seed: int, arity: int, seg_log2: int, segments: int, m: int
) -> np.ndarray | None:
    return summary_fuse.solve_reference(keys, seed, arity, seg_log2, segments, m)


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """The reference implementations patched in where the shipped code looks them up."""
    patches: list[tuple[object, str, object]] = [
        (riceset, "low_bits", reference_low_bits),
        (riceset, "from_bits", reference_from_bits),
        (summary_fuse, "low_bits", reference_low_bits),
        (summary_fuse, "from_bits", reference_from_bits),
        (FuseSummary, "_solve", staticmethod(_reference_solve)),
        (summary_base, "unique_keys", reference_unique_keys),
        (summary_delta, "unique_keys", reference_unique_keys),
        (summary_exact, "unique_keys", reference_unique_keys),
        (versioning, "unique_keys", reference_unique_keys),
        (shard, "unique_keys", reference_unique_keys),
        (summary_delta, "sorted_difference", reference_sorted_difference),
        (shard, "split_keys", reference_split_keys),
        (summary_delta.DeltaSummary, "size", reference_size),
        (summary_exact.ExactSummary, "size", reference_size),
        (FuseSummary, "size", reference_size),
        (TieredCache, "admit", reference_admit),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]  # type: ignore[attr-defined]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# ---- measuring -----------------------------------------------------------------------------


def median_us(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """Median µs per call over batches filling about `seconds`."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    batch = max(1, int(0.01 / once))
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times) * 1e6


def compare(name: str, fn: Callable[[], object], **extra: Any) -> dict[str, Any]:
    """`fn` timed as shipped and with the reference paths, alternately, best of 3 medians."""
    ref, new = [], []
    for _ in range(3):
        with reference_paths():
            ref.append(median_us(fn))
        new.append(median_us(fn))
    r, n = min(ref), min(new)
    return {
        "name": name,
        **extra,
        "reference_us": round(r, 2),
        "us": round(n, 2),
        "speedup": round(r / n, 2),
    }


def primitives() -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    shard_keys = np.unique(rng.integers(0, 2**64, 1000, dtype=np.uint64))
    delta_keys = np.unique(rng.integers(0, 2**64, 60, dtype=np.uint64))
    out = []
    for label, keys in (("60 keys", delta_keys), ("1,000 keys", shard_keys)):
        body = riceset.encode_rice_set(keys)
        with reference_paths():
            assert riceset.encode_rice_set(keys) == body
        out.append(compare("rice encode", lambda k=keys: riceset.encode_rice_set(k), size=label))
        out.append(compare("rice decode", lambda b=body: riceset.decode_rice_set(b), size=label))
    fuse = FuseSummary.from_keys(shard_keys, 0.01, seed=7)
    params, body = fuse.params(), fuse.encode()
    with reference_paths():
        again = FuseSummary.from_keys(shard_keys, 0.01, seed=7)
        assert again.params() == params and again.encode() == body
    out.append(
        compare(
            "fuse build (peel + assign)",
            lambda: FuseSummary.from_keys(shard_keys, 0.01, seed=7),
            size="1,000 keys",
        )
    )
    out.append(
        compare(
            "fuse body encode",
            lambda: FuseSummary(
                fuse.table_values(),
                arity=fuse.arity,
                seg_log2=fuse.seg_log2,
                segments=fuse.segments,
                m=fuse.m,
                g=fuse.g,
                b=fuse.b,
                seed=fuse.seed,
            ).encode(),
            size=f"{fuse.slots} slots",
        )
    )
    out.append(
        compare(
            "fuse body decode",
            lambda: FuseSummary.decode_body(params, body),
            size=f"{fuse.slots} slots",
        )
    )
    out.append(
        compare(
            "unique_keys, sorted input",
            lambda: summary_base.unique_keys(shard_keys),
            size="1,000 keys",
        )
    )
    prompts = [list(rng.integers(0, 3000, 40).tolist()) for _ in range(500)]

    def admit_all() -> None:
        cache = TieredCache([TierSpec(Tier.HBM, 1000, 5, 1)])
        for p in prompts:
            cache.admit(p)

    out.append(compare("TieredCache.admit", admit_all, size="500 prompts x 40 blocks, 1,000"))
    out[-1]["us_per_prompt"] = round(out[-1]["us"] / len(prompts), 2)
    return out


def churn_once(requests: list[list[int]], times: list[int]) -> tuple[float, list[bytes], bytes]:
    """Seconds to build (and receive) every advertisement of the trace prefix."""
    keyer = BlockKeyer(SECRET, "m", 512)
    cache = TieredCache([TierSpec(Tier.HBM, 1000, 5, 1_600_000)])
    builder = AdvertisementBuilder(
        BuilderConfig(
            cs_id=1,
            address="10.0.0.5",
            model_id="m",
            block_size=512,
            bytes_per_block=1 << 20,
            shard_range="10.255.1.0/24",
            hot_prefixes=0,
            main_on_summary_change=False,
            dampening=DampeningPolicy(  # S1's
                min_interval_ms=1_000,
                max_interval_ms=60_000,
                change_threshold=0.15,
                score_threshold=11,
                wait_threshold_ms=500,
            ),
        ),
        cache,
        epoch=1,
    )
    receivers: dict[tuple[str, int], SummaryReceiver] = {}
    sent: list[bytes] = []
    keyed = [[keyer.engine_key(ENGINE_MOONCAKE, h) for h in ids] for ids in requests]
    start = time.perf_counter()
    for now, keys in zip(times, keyed, strict=True):
        cache.admit(keys)
        for route in builder.poll(now, ComputeState(prefill_rate_tps=8_000.0)):
            sent.append(wire.encode(route.advertisement))
            for tlv in route.advertisement.tlvs:
                if isinstance(tlv, wire.CacheSummaries):
                    for entry in tlv.entries:
                        rx = receivers.setdefault(
                            (str(route.prefix), int(entry.tier)), SummaryReceiver()
                        )
                        rx.apply_entry(entry)
    seconds = time.perf_counter() - start
    probe = np.array(sorted({k for keys in keyed for k in keys}), dtype=np.uint64)
    state = b"".join(
        np.packbits(rx.contains_many(probe)).tobytes() for _, rx in sorted(receivers.items())
    )
    return seconds, sent, state


def churn(n: int, rounds: int) -> dict[str, Any]:
    requests, times = [], []
    with find_or_download_trace().open() as f:
        for line in f:
            if len(requests) >= n:
                break
            req = json.loads(line)
            requests.append(req["hash_ids"])
            times.append(int(req["timestamp"]))
    ref, new = [], []
    for _ in range(rounds):
        with reference_paths():
            r_s, r_sent, r_state = churn_once(requests, times)
        n_s, n_sent, n_state = churn_once(requests, times)
        if r_sent != n_sent or r_state != n_state:
            sys.exit("the shipped paths built different advertisements than the reference")
        ref.append(r_s)
        new.append(n_s)
    return {
        "requests": len(requests),
        "advertisements": len(n_sent),
        "advertisement_bytes": sum(map(len, n_sent)),
        "same_bytes_and_receiver_state": True,
        "reference_s": round(min(ref), 3),
        "s": round(min(new), 3),
        "speedup": round(min(ref) / min(new), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="trace prefix for churn")
    parser.add_argument("--rounds", type=int, default=3, help="alternate churn runs of each")
    args = parser.parse_args()
    FuseSummary.from_keys(np.arange(10, dtype=np.uint64), 0.01, seed=0)  # load the kernel
    out = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "primitives": primitives(),
        "churn": churn(args.requests, args.rounds),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

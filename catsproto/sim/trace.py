"""Trace requests and their block keys.

A `TraceRequest` is one line of a Mooncake-style trace (the adapter
`catsproto.adapters.trace` reads the file). `PreparedTrace` maps every `hash_id` onto a
block key with `BlockKeyer.engine_key` under the scenario's secret — once per distinct
id, shared by every policy's run — and fixes each request's ingress site. Pure.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from catsproto.keys import ENGINE_MOONCAKE, BlockKeyer

__all__ = [
    "MAX_ARRIVAL_MS",
    "RANDOM_SPREAD_SEED",
    "PreparedTrace",
    "TraceRequest",
    "spread_ticks",
]

RANDOM_SPREAD_SEED = 20251  # `arrival_spread = "random"`: the same draws in every run
MAX_ARRIVAL_MS = 2**62  # arrivals are int64 ms; the engine adds delays on top


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class PreparedTrace:
    """The trace as the simulator consumes it: arrival times after the speedup, block
    keys (uint64 array and int list per request), ingress site index per request."""

    requests: tuple[TraceRequest, ...]
    arrival_ms: np.ndarray  # int64, non-decreasing
    keys: tuple[np.ndarray, ...]
    key_lists: tuple[tuple[int, ...], ...]
    ingress: np.ndarray  # int64 site index

    @classmethod
    def build(
        cls,
        requests: Sequence[TraceRequest],
        keyer: BlockKeyer,
        n_sites: int,
        speedup: float,
        ingress_index: int = 1,
        key_memo: dict[int, int] | None = None,
        spread: bool | str = False,
    ) -> PreparedTrace:
        """`spread`: requests sharing a timestamp arrive over the time to the next
        distinct timestamp instead of all at once: evenly in trace order (True or
        "even") or uniformly at random ("random", a fixed seed), see `spread_ticks`."""
        memo = {} if key_memo is None else key_memo
        mode = {True: "even", False: "none"}.get(spread, spread)  # type: ignore[call-overload]
        if mode == "even":
            requests = spread_ticks(requests)
        elif mode == "random":
            requests = spread_ticks(requests, np.random.default_rng(RANDOM_SPREAD_SEED))
        elif mode != "none":
            raise ValueError(f"spread {spread!r} is not none, even or random")
        order = sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_ms, i))
        reqs = tuple(requests[i] for i in order)
        keys, lists, ingress = [], [], []
        for r in reqs:
            ks = []
            for h in r.hash_ids:
                k = memo.get(h)
                if k is None:
                    k = memo[h] = keyer.engine_key(ENGINE_MOONCAKE, h)
                ks.append(k)
            lists.append(tuple(ks))
            keys.append(np.array(ks, dtype=np.uint64))
            ids = r.hash_ids
            ingress.append(ids[min(ingress_index, len(ids) - 1)] % n_sites if ids else 0)
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"speedup {speedup} must be finite and > 0")
        ms = [r.timestamp_ms / speedup for r in reqs]
        for r, t in zip(reqs, ms, strict=True):
            if not (math.isfinite(t) and 0 <= t <= MAX_ARRIVAL_MS):
                raise ValueError(
                    f"timestamp {r.timestamp_ms!r} ms / speedup {speedup:g} is not an arrival "
                    f"time in 0..2^62 ms"
                )
        arrival = np.array([int(t) for t in ms], dtype=np.int64)
        return cls(reqs, arrival, tuple(keys), tuple(lists), np.array(ingress, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.requests)


def spread_ticks(
    requests: Sequence[TraceRequest], rng: np.random.Generator | None = None
) -> list[TraceRequest]:
    """The requests with each group that shares a timestamp spread evenly over the time
    to the next distinct timestamp, in trace order: the k-th of n at t + k (t' - t) / n;
    with `rng`, each at t + a uniform draw from [0, t' - t) instead (so the order inside
    a group is random too). A trace whose clock ticks coarsely (the Mooncake
    conversation trace: every 3 s) otherwise arrives in bursts no real arrival process
    has. The last group spreads over the median step between timestamps. Everything
    else is kept, and without `rng` the order too."""
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.timestamp_ms, []).append(i)
    ticks = sorted(groups)
    steps = sorted(b - a for a, b in itertools.pairwise(ticks))
    last = steps[len(steps) // 2] if steps else 0.0
    out = list(requests)
    for a, t in enumerate(ticks):
        width = (ticks[a + 1] - t) if a + 1 < len(ticks) else last
        members = groups[t]
        n = len(members)
        at = [k * width / n for k in range(n)] if rng is None else rng.random(n) * width
        for k, i in enumerate(members):
            out[i] = dataclasses.replace(requests[i], timestamp_ms=t + float(at[k]))
    return out

"""The serving side of the simulation: instances with tiered caches and FCFS queues.

Strategy. Each instance is a `catsproto.node.TieredCache` (LRU per tier, a request's
blocks touched in prefix order and all left cached) and one FCFS server: a request
routed at `t` starts at max(t, free_at), is busy for fetch + prefill, and its TTFT is

    round trip (ingress site, instance site) + queue wait + fetch + (input − cached) ÷ rate

where `cached` is 512 × the longest prefix of its blocks the instance holds when it is
routed (or pulls from another instance), and fetch is the cost of bringing that prefix
from its tiers (HBM is free) or across the network. In the *physical* arrival model
(scenario ``physical_arrival``) a request joins its queue, and is matched against the
cache, when it reaches the instance, one one-way delay after it was routed; until then
it is *in flight* (`expect`), and `waits_for` counts the work in flight ahead of it.
The same formulas, on exact state, are the oracle's estimate (`fetch_ms`, `pull_ms`,
`prefill_ms`), mirroring the selector's cost model (catsproto/selector/selector.py)
term by term. Pure and deterministic.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from catsproto.node import BlockEventKind, PrefixHit, TieredCache, TierSpec
from catsproto.sim.scenario import Scenario
from catsproto.wire import Tier

__all__ = ["Cluster", "Served"]

INF = float("inf")


@dataclass(frozen=True, slots=True)
class Served:
    """What happened to one request at its instance."""

    instance: int
    rtt_ms: float
    wait_ms: float
    fetch_ms: float
    prefill_ms: float
    hit_blocks: int  # blocks whose KV was reused (local prefix or pulled)
    local_blocks: int  # prefix held by the instance itself when routed
    pulled_blocks: int
    source: int | None

    @property
    def ttft_ms(self) -> float:
        return self.rtt_ms + self.wait_ms + self.fetch_ms + self.prefill_ms


class Cluster:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        n = sc.n_instances
        specs = [
            TierSpec(t.tier, t.capacity_blocks, t.fetch_latency_us, t.fetch_bandwidth_mbps)
            for t in sc.tiers
        ]
        self.caches = [TieredCache(specs) for _ in range(n)]
        self.site = np.array([sc.site_of(i) for i in range(n)], dtype=np.int64)
        self.rtt = np.array(sc.rtt_matrix(), dtype=np.float64)  # site × site
        self.inst_rtt = self.rtt[:, self.site]  # ingress site × instance
        self.free_at = np.zeros(n)
        self.served = np.zeros(n, dtype=np.int64)
        self.starts: list[deque[float]] = [deque() for _ in range(n)]
        self.physical = sc.physical_arrival
        # physical arrivals: work routed but not arrived, per instance, in arrival order
        self.inflight: list[list[tuple[float, int, float]]] = [[] for _ in range(n)]
        self.tier_cost = {
            t.tier: (t.fetch_latency_us / 1000, float(t.fetch_bandwidth_mbps)) for t in sc.tiers
        }
        self.bpb = sc.bytes_per_block
        self.single_hbm = len(sc.tiers) == 1 and sc.tiers[0].tier is Tier.HBM
        # engine events the caches produced (the raw vLLM stream equivalent)
        self.events = 0
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.moved_blocks = 0
        self.batches = 0

    # ---- state -------------------------------------------------------------------------

    def waits(self, t: float) -> np.ndarray:
        return np.maximum(0.0, self.free_at - t)

    def arrival_ms(self, ingress: int, i: int, t: float) -> float:
        """When a request routed at t from `ingress` joins instance i's queue: at once
        (routed model) or one one-way delay later (physical model)."""
        return t + float(self.inst_rtt[ingress, i]) / 2 if self.physical else t

    def waits_for(self, t: float, ingress: int) -> np.ndarray:
        """The queue wait each instance would give a request from `ingress` routed at t:
        `waits(t)` in the routed model; in the physical model, the wait on its arrival
        behind the queue now and the work in flight that arrives before it."""
        if not self.physical:
            return self.waits(t)
        out = np.zeros(len(self.caches))
        for i, flight in enumerate(self.inflight):
            at = t + float(self.inst_rtt[ingress, i]) / 2
            free = float(self.free_at[i])
            for when, _, work in flight:
                if when > at:
                    break
                free = max(free, when) + work
            out[i] = max(0.0, free - at)
        return out

    def expect(self, i: int, at: float, seq: int, work_ms: float) -> None:
        """Request `seq` is on its way to instance i, arriving at `at` with `work_ms` of
        work (estimated when routed); `serve` takes it off again."""
        bisect.insort(self.inflight[i], (at, seq, work_ms))

    def landed(self, i: int, at: float, seq: int) -> None:
        flight = self.inflight[i]
        k = bisect.bisect_left(flight, (at, seq, -INF))
        if k < len(flight) and flight[k][1] == seq:
            del flight[k]

    def restart(self, i: int, count: int, starts: Sequence[float]) -> None:
        """The last `count` requests served at instance i start at `starts` instead (a
        dispatch re-ordered them among themselves; the instance is busy as long)."""
        kept = self.starts[i]
        m = min(count, len(kept))  # the first of them may have been let go already
        for _ in range(m):
            kept.pop()
        kept.extend(sorted(starts)[count - m :])

    def queue_counts(self, i: int, t: float) -> tuple[int, int]:
        """(waiting, running) requests of instance i at time t."""
        starts = self.starts[i]
        while len(starts) > 1 and starts[1] <= t:
            starts.popleft()
        running = 1 if self.free_at[i] > t else 0
        waiting = sum(1 for s in starts if s > t)
        return waiting, running

    def lookup(self, i: int, keys: Sequence[int]) -> PrefixHit:
        return self.caches[i].lookup(keys)

    # ---- cost terms (the selector's formulas on exact state) ---------------------------

    def fetch_ms(self, tiers: Sequence[Tier]) -> float:
        """Bringing a local prefix from its tiers: latency once per tier, bytes ÷ bandwidth."""
        if self.single_hbm or not tiers:
            return 0.0
        total = 0.0
        for tier in sorted(set(tiers)):
            if tier is Tier.HBM:
                continue
            latency, bw = self.tier_cost[tier]
            blocks = sum(1 for x in tiers if x == tier)
            total += latency + _transfer_ms(blocks * self.bpb, bw)
        return total

    def pull_ms(self, src: int, dst: int, tiers: Sequence[Tier]) -> float:
        """Pulling a prefix (its tiers at the source) from instance src to dst."""
        nblocks = len(tiers)
        a, b = int(self.site[src]), int(self.site[dst])
        if a == b:
            delay, link = 0.0, INF
        else:
            delay, link = self.rtt[a, b] / 2, self.sc.link_bandwidth_mbps
        used = set(tiers)
        tier_bw = min((self.tier_cost[t][1] for t in used), default=INF)
        latency = max((self.tier_cost[t][0] for t in used), default=0.0)
        return delay + latency + _transfer_ms(nblocks * self.bpb, min(link, tier_bw))

    def prefill_ms(self, input_tokens: int, cached_blocks: int) -> float:
        work = max(0, input_tokens - self.sc.block_tokens * cached_blocks)
        return work / self.sc.prefill_tps * 1000

    # ---- serving -----------------------------------------------------------------------

    def _plan(
        self, i: int, keys: Sequence[int], source: int | None
    ) -> tuple[PrefixHit, int, float, int, int | None]:
        """What serving at i would reuse now: (local hit, blocks reused, fetch or pull
        ms, blocks pulled, the source actually pulled from)."""
        hit = self.caches[i].lookup(keys)
        cached, fetch, pulled = hit.depth, self.fetch_ms(hit.tiers), 0
        if source is not None and source != i:
            src_hit = self.caches[source].lookup(keys)
            if src_hit.depth > hit.depth:
                cached, pulled = src_hit.depth, src_hit.depth
                fetch = self.pull_ms(source, i, src_hit.tiers)
            else:
                source = None
        else:
            source = None
        return hit, cached, fetch, pulled, source

    def work_ms(
        self, i: int, input_tokens: int, keys: Sequence[int], source: int | None = None
    ) -> float:
        """The fetch (or pull) and prefill serving the request at i would take now."""
        _, cached, fetch, _, _ = self._plan(i, keys, source)
        return fetch + self.prefill_ms(input_tokens, cached)

    def serve(
        self,
        i: int,
        t: float,
        ingress: int,
        input_tokens: int,
        keys: Sequence[int],
        source: int | None = None,
    ) -> Served:
        """Route a request to instance i at time t (pulling its prefix from `source` if
        given and that holds more); update the queue and the cache."""
        hit, cached, fetch, pulled, source = self._plan(i, keys, source)
        prefill = self.prefill_ms(input_tokens, cached)
        start = max(t, float(self.free_at[i]))
        self.free_at[i] = start + fetch + prefill
        self.starts[i].append(start)
        self.served[i] += 1
        _, runs = self.caches[i].admit_runs(keys)  # counted only: no event objects
        self.batches += 1
        for kind, _, _, moved in runs:
            self.events += 1
            if kind is BlockEventKind.STORED:
                self.stored_blocks += len(moved)
            elif kind is BlockEventKind.REMOVED:
                self.removed_blocks += len(moved)
            elif kind is BlockEventKind.MOVED:
                self.moved_blocks += len(moved)
        return Served(
            i,
            float(self.inst_rtt[ingress, i]),
            start - t,
            fetch,
            prefill,
            cached,
            hit.depth,
            pulled,
            source,
        )


def _transfer_ms(nbytes: float, mbps: float) -> float:
    if nbytes == 0 or mbps == INF:
        return 0.0
    if mbps <= 0:
        return INF
    return nbytes * 8 / (mbps * 1000)


def ceil_ms(x: float) -> int:
    return math.ceil(x - 1e-9)

"""Site aggregation: a site's egress merges its instances' state into one site advertisement.

Strategy. BGP scales by aggregating prefixes at borders; cache state scales the same way.
Inside a site (or AS) every instance advertises itself; beyond it the site's egress (its
C-SMA aggregate) speaks for all of them with *one* origin — an `Origin` whose address is
the egress's and whose site_id is the site's — signed by the site's key. Remote selectors
then steer to the site, and the site's own selector, which keeps the full per-instance
state, picks the instance (`catsproto.sim.aggregate` runs that two-level decision).

What the site advertisement says:

* **cache summaries**: per tier, one filter built over the union of the keys the egress
  knows its instances hold (or, with ``min_holders`` > 1, over the keys held by at least
  that many instances — holder-weighted, smaller, for sites whose instances replicate
  popular prefixes; with ``max_depth``, over each prompt's first blocks only). A filter
  over the union is smaller than the instances' filters put together, since shared
  prefixes (system prompts) are counted once, and its false positive rate is the
  target's, not the sum of n filters' rates. The summaries go through the same
  `AdvertisementBuilder` as an instance's (dampening, snapshots and cumulative deltas,
  shards that fit one UPDATE) over a mirror `TieredCache` of the union.
* **CATS metrics** (CATS metric framework, L0/L1/L2): L0 values are the site's, each with
  ``Source.AGGREGATED``: request counts summed, utilisations averaged; the estimated
  TTFT is the pooled wait (Σ outstanding prefill tokens ÷ Σ prefill rate, statistic
  MEAN) next to the best instance's (statistic MIN). Prefill throughput and outstanding
  prefill tokens are *per instance* (statistic MEAN): a request's prefill runs on one
  instance at one instance's rate, so a remote selector that prices it as backlog ÷ rate
  + work ÷ rate must get that rate (the site's sum would make a 100-instance site look
  100× faster at prefill) and a backlog that gives the pooled wait at it. L1 and L2 are
  computed from the pooled state with the instance formulas (`catsproto.node.metrics`).
* **capacity**: Σ free blocks and Σ total blocks of the instances.

Pure: the clock, epoch and seeds come in; signing (`catsproto.security.sign` with the
site's key) and encoding are the caller's, as for an instance's routes.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from catsproto.node.builder import (
    AdvertisementBuilder,
    BuilderConfig,
    IPNetwork,
    RouteAdvertisement,
)
from catsproto.node.cache import TieredCache, TierSpec
from catsproto.node.metrics import (
    METRIC_GPU_UTILIZATION,
    METRIC_KV_CACHE_UTILIZATION,
    METRIC_OUTSTANDING_PREFILL_TOKENS,
    METRIC_PREFILL_THROUGHPUT,
    METRIC_RUNNING_REQUESTS,
    METRIC_TTFT,
    METRIC_WAITING_REQUESTS,
    CatsMetrics,
    ComputeState,
    ScoreScale,
    cats_metrics,
)
from catsproto.wire import Capacity, L0Metric, MetricsL0, Source, Statistic, Tier, Unit

__all__ = [
    "SiteAggregator",
    "SiteMember",
    "Visibility",
    "export_routes",
    "pooled_state",
    "site_capacity",
    "site_metrics",
    "union_keys",
]


@dataclass(frozen=True)
class SiteMember:
    """What the egress knows of one instance of its site right now.

    keys: block keys per tier (any order, duplicates allowed). state: its compute state.
    capacity_blocks / free_blocks: from its cache (free clamped to 0..capacity).
    depth: optional, each key's depth in its prompt (1 = first block), for ``max_depth``.
    """

    keys: Mapping[Tier, np.ndarray]
    state: ComputeState
    capacity_blocks: int
    free_blocks: int
    depth: Mapping[int, int] | None = None

    @classmethod
    def from_cache(cls, cache: TieredCache, state: ComputeState) -> SiteMember:
        total = cache.total_blocks()
        return cls(
            {t: cache.keys(t) for t in cache.order},
            state,
            total,
            max(0, min(cache.free_blocks(), total)),
            cache.depth,
        )


def union_keys(
    members: Sequence[SiteMember], tier: Tier, min_holders: int = 1, max_depth: int = 0
) -> np.ndarray:
    """Sorted keys of `tier` held by at least `min_holders` members (1: the union); with
    `max_depth` > 0 only keys no deeper than that in their prompt (a member without
    depths keeps all its keys). Since a cache frees a prompt's blocks tail first, what a
    member holds of a prompt is a prefix, and its first `max_depth` blocks stay one: a
    selector's longest run still starts at block 0, capped at `max_depth`."""
    if min_holders < 1:
        raise ValueError("min_holders must be >= 1")
    if max_depth < 0:
        raise ValueError("max_depth must be >= 0 (0: no limit)")
    arrays = []
    for m in members:
        if tier not in m.keys:
            continue
        keys = np.unique(np.asarray(m.keys[tier], dtype=np.uint64))
        if max_depth and m.depth is not None and len(keys):
            depth = m.depth
            deep = np.fromiter(
                (depth.get(k, 1) for k in keys.tolist()), dtype=np.int64, count=len(keys)
            )
            keys = keys[deep <= max_depth]
        arrays.append(keys)
    if not arrays:
        return np.zeros(0, dtype=np.uint64)
    allkeys = np.concatenate(arrays)
    if min_holders == 1:
        return np.unique(allkeys)
    uniq, counts = np.unique(allkeys, return_counts=True)
    return uniq[counts >= min_holders]


def pooled_state(states: Sequence[ComputeState]) -> ComputeState:
    """The site as one large instance: counts, backlog and prefill rate summed,
    utilisations averaged (so the pooled wait is Σ backlog ÷ Σ rate)."""
    if not states:
        raise ValueError("a site needs at least one member")
    n = len(states)
    return ComputeState(
        waiting=sum(s.waiting for s in states),
        running=sum(s.running for s in states),
        outstanding_prefill_tokens=sum(s.outstanding_prefill_tokens for s in states),
        prefill_rate_tps=sum(s.prefill_rate_tps for s in states),
        utilisation=sum(s.utilisation for s in states) / n,
        kv_utilisation=sum(s.kv_utilisation for s in states) / n,
    )


def site_metrics(states: Sequence[ComputeState], scale: ScoreScale | None = None) -> CatsMetrics:
    """L0 values of the site (Source.AGGREGATED; rate and backlog per instance) and L1/L2
    scores of its pooled state."""
    pooled = pooled_state(states)
    scores = cats_metrics(pooled, scale)
    cur, mean, agg = Statistic.CURRENT, Statistic.MEAN, Source.AGGREGATED
    best_wait = min(s.wait_ms for s in states)
    n = len(states)
    # per instance: backlog / rate is the pooled wait, work / rate one instance's prefill
    rate, backlog = pooled.prefill_rate_tps / n, pooled.outstanding_prefill_tokens / n
    l0 = MetricsL0(
        (
            L0Metric(
                METRIC_GPU_UTILIZATION, Unit.PERCENT, mean, agg, 100.0 * _c01(pooled.utilisation)
            ),
            L0Metric(METRIC_RUNNING_REQUESTS, Unit.COUNT, cur, agg, float(pooled.running)),
            L0Metric(METRIC_WAITING_REQUESTS, Unit.COUNT, cur, agg, float(pooled.waiting)),
            L0Metric(METRIC_PREFILL_THROUGHPUT, Unit.TOKENS_PER_SECOND, mean, agg, float(rate)),
            L0Metric(
                METRIC_KV_CACHE_UTILIZATION,
                Unit.PERCENT,
                mean,
                agg,
                100.0 * _c01(pooled.kv_utilisation),
            ),
            L0Metric(METRIC_TTFT, Unit.MILLISECONDS, mean, agg, float(pooled.wait_ms)),
            L0Metric(METRIC_TTFT, Unit.MILLISECONDS, Statistic.MIN, agg, float(best_wait)),
            L0Metric(METRIC_OUTSTANDING_PREFILL_TOKENS, Unit.COUNT, mean, agg, float(backlog)),
        )
    )
    return CatsMetrics(l0, scores.l1, scores.l2, scores.basis)


def site_capacity(members: Sequence[SiteMember]) -> Capacity:
    total = sum(m.capacity_blocks for m in members)
    free = sum(max(0, min(m.free_blocks, m.capacity_blocks)) for m in members)
    return Capacity(min(free, total), total)


def _c01(x: float) -> float:
    return max(0.0, min(1.0, x)) if math.isfinite(x) else 0.0


class SiteAggregator:
    """The site egress's C-SMA aggregate: members' state in, site routes out.

    ``config`` is an ordinary `BuilderConfig` whose address is the egress's, site_id the
    site's, and shard_range a range the site owns; ``tiers`` give each tier's retrieval
    cost (capacities are the members' sum and only size the mirror). Use:
    ``routes = agg.poll(now_ms, members)`` then sign each route's advertisement with the
    site key for its prefix, as an instance does.
    """

    def __init__(
        self,
        config: BuilderConfig,
        tiers: Sequence[TierSpec],
        epoch: int,
        *,
        min_holders: int = 1,
        max_depth: int = 0,
    ) -> None:
        if min_holders < 1:
            raise ValueError("min_holders must be >= 1")
        if max_depth < 0:
            raise ValueError("max_depth must be >= 0 (0: no limit)")
        self.max_depth = max_depth
        if config.site_id == 0:
            raise ValueError("a site advertisement needs a site_id")
        self.config = config
        self.min_holders = min_holders
        self.mirror = TieredCache(tiers)
        self.builder = AdvertisementBuilder(config, self.mirror, epoch)
        self._held: dict[Tier, np.ndarray] = {
            t: np.zeros(0, dtype=np.uint64) for t in self.mirror.order
        }

    def sync(self, members: Sequence[SiteMember]) -> int:
        """Bring the mirror to the members' (weighted) union; returns keys changed."""
        changed = 0
        for tier in self.mirror.order:
            new = union_keys(members, tier, self.min_holders, self.max_depth)
            old = self._held[tier]
            added = np.setdiff1d(new, old, assume_unique=True)
            removed = np.setdiff1d(old, new, assume_unique=True)
            for k in removed.tolist():
                self.mirror.remove(tier, k)
            for k in added.tolist():
                self.mirror.store(tier, k)
            self._held[tier] = new
            changed += len(added) + len(removed)
        return changed

    def suppressed(self, now_ms: int) -> bool:
        """True while the minimum interval since the last site advertisement runs: nothing
        can leave, so the union need not be recomputed (the mirror counts net changes,
        so syncing once when the interval ends gives the same state and the same count)."""
        d = self.builder.dampener
        last = d.last_sent_ms
        return last is not None and now_ms - last < d.policy.min_interval_ms

    def poll(
        self, now_ms: int, members: Sequence[SiteMember], *, force: bool = False
    ) -> list[RouteAdvertisement]:
        """Site routes due at `now_ms` (often none); the main route carries the site's
        aggregated metrics and capacity."""
        if not members:
            raise ValueError("a site needs at least one member")
        if not force and self.suppressed(now_ms):
            return []
        self.sync(members)
        states = [m.state for m in members]
        routes = self.builder.poll(now_ms, pooled_state(states), force=force)
        if not routes:
            return routes
        metrics = site_metrics(states, self.config.score_scale)
        capacity = site_capacity(members)
        out = []
        for r in routes:
            if r.tier is None:  # the main route: aggregated metrics and capacity
                adv = r.advertisement.replace(
                    metrics.l0, metrics.l1, metrics.l2, metrics.basis, capacity
                )
                r = RouteAdvertisement(r.prefix, adv, r.reason, r.tier, r.shard)
            out.append(r)
        return out

    def routes(self) -> list[IPNetwork]:
        """Every prefix the site announced in this epoch (main route first)."""
        return self.builder.routes()


class Visibility(enum.Enum):
    """Which advertisements a peer gets: inside the site (or AS) every instance's,
    beyond it only the site's aggregate."""

    INSIDE = "inside"
    BEYOND = "beyond"


def export_routes(
    visibility: Visibility,
    instance_routes: Sequence[RouteAdvertisement],
    site_routes: Sequence[RouteAdvertisement],
) -> list[RouteAdvertisement]:
    """The routes to announce to a peer of the given visibility (export policy)."""
    if visibility is Visibility.INSIDE:
        return list(instance_routes)
    return list(site_routes)

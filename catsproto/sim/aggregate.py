"""Aggregated remote state: per-instance advertisements inside a site, one site
advertisement beyond it, and a two-level decision.

Strategy. `AggregatedControlPlane` is the ordinary control plane (`sim.control`) with a
different export policy: each instance's routes reach only the C-PS of its own site,
while each site's egress runs a `catsproto.node.aggregate.SiteAggregator` over its
instances' caches and compute states, signs the site routes with the site's key, and
those reach every *other* site's C-PS (after the same propagation delay). So the C-PS at
ingress X holds per-instance state for X's instances and one origin per remote site.

`AggregatedPolicy` decides at the ingress's C-PS as `catsproto` does; if the winner is a
remote site's egress, the request is handed to that site's own selector, which holds its
instances' full state (a local RIB fed by the same instance routes) and picks the
instance. Handed-over decisions carry no claimed prefix (-1) into the engine's stale /
false-positive accounting, which compares against the ingress selector's views.

Policies, added to `sim.POLICIES` only by an explicit `register()`: ``catsproto-agg``
(the site advertises at the instances' update interval) and ``catsproto-agg10``
(at 10 s, closest to the traffic target in benchmarks/scale.py). Nothing registers
them by default, so `catsproto eval`'s policy list and its runs are unchanged.
"""

from __future__ import annotations

import heapq
import ipaddress
from dataclasses import dataclass

import numpy as np

from catsproto import wire
from catsproto.node import DampeningPolicy, TierSpec
from catsproto.node.aggregate import SiteAggregator, SiteMember
from catsproto.security import Policy as SecurityPolicy
from catsproto.security import Receiver, SigningKey, sign
from catsproto.selector import RIB, NoInstanceError, PathSelector, Request, SelectorConfig
from catsproto.sim.cluster import Cluster, ceil_ms
from catsproto.sim.control import CS_ID, ControlPlane, _seed, enrol
from catsproto.sim.policies import POLICIES, CatsprotoPolicy, Choice
from catsproto.sim.trace import PreparedTrace

__all__ = ["AggregateOptions", "AggregatedControlPlane", "AggregatedPolicy", "register"]


@dataclass(frozen=True)
class AggregateOptions:
    """The egress's aggregation: None takes the scenario's value."""

    interval_ms: int | None = None
    target_fpr: float | None = None
    min_holders: int = 1


def site_address(s: int) -> str:
    return f"10.{s + 1}.255.254"


def site_shards(s: int) -> str:
    return f"10.254.{s}.0/24"


class AggregatedControlPlane(ControlPlane):
    def __init__(
        self, sc, cluster: Cluster, *, exact: bool = False, options: AggregateOptions | None = None
    ) -> None:
        if sc.selector_site is not None:
            raise ValueError("aggregated remote state needs a C-PS at every ingress site")
        super().__init__(sc, cluster, exact=exact)
        opts = options or AggregateOptions()
        operator = SigningKey.from_seed(_seed(sc.seed, "operator"))
        self.site_keys: list[SigningKey] = []
        self.aggregators: list[SiteAggregator] = []
        trust = self.receivers[0].trust
        interval = sc.update_interval_ms if opts.interval_ms is None else opts.interval_ms
        dampening = DampeningPolicy(
            min_interval_ms=interval,
            max_interval_ms=max(interval, sc.refresh_interval_ms),
            change_threshold=sc.change_threshold,
            score_threshold=sc.score_threshold,
            wait_threshold_ms=sc.wait_threshold_ms,
        )
        for s in range(len(sc.sites)):
            key = SigningKey.from_seed(_seed(sc.seed, f"site-{s}"))
            address = site_address(s)
            trust, cfg = enrol(
                sc,
                trust,
                operator,
                key,
                address,
                s,
                site_shards(s),
                dampening,
                exact=self.exact,
                target_fpr=opts.target_fpr,
            )
            tiers = [
                TierSpec(
                    t.tier,
                    t.capacity_blocks * sc.instances_per_site,
                    t.fetch_latency_us,
                    t.fetch_bandwidth_mbps,
                )
                for t in sc.tiers
            ]
            self.site_keys.append(key)
            self.aggregators.append(
                SiteAggregator(cfg, tiers, epoch=1, min_holders=opts.min_holders)
            )
        self.receivers = [Receiver(trust, policy=SecurityPolicy()) for _ in self.receivers]
        self.site_index = {ipaddress.ip_address(site_address(s)): s for s in range(len(sc.sites))}
        # each site's own selector: its instances only, full per-instance state
        self.local_ribs = [RIB() for _ in sc.sites]
        network = self.selectors[0].network
        self.local_selectors = [
            PathSelector(
                self.local_ribs[s],
                network,
                SelectorConfig(
                    site_nodes={s + 1: name},
                    request_bytes_per_token=sc.request_bytes_per_token,
                    allow_remote_kv=False,  # the engine is given no source on a handover
                    default_block_size=sc.block_tokens,
                    spread_ms=sc.selector_spread_ms,
                    seed=sc.seed * 1000 + 500 + s,
                ),
            )
            for s, name in enumerate(sc.sites)
        ]
        self.site_stats = {"advertisements": 0, "bytes": 0}

    def poll(self, t: int, *, force: bool = False) -> None:
        """Instances as in `ControlPlane.poll`, but to their own site's C-PS only; then
        every site egress aggregates and announces to the other sites' C-PS."""
        sc, cl = self.sc, self.cluster
        for i, builder in enumerate(self.builders):
            state = self.compute_state(i, t)
            self._polled[i] = state
            self.stats.polls += 1
            routes = builder.poll(t, state, force=force)
            if not routes:
                continue
            self.stats.builds += 1
            cache = cl.caches[i]
            snapshot = frozenset().union(*(cache.keys(tier).tolist() for tier in cache.order))
            s = sc.site_of(i)
            for route in routes:
                value = wire.encode(sign(route.advertisement, self.keys[i], route.prefix))
                self.stats.advertisements += 1
                self.stats.bytes += len(value)
                self._push(t + self._delay[s][s], s, i, route.prefix, value, snapshot)
        for s, agg in enumerate(self.aggregators):
            members = [
                SiteMember.from_cache(cl.caches[i], self._polled[i] or self.compute_state(i, t))
                for i in range(s * sc.instances_per_site, (s + 1) * sc.instances_per_site)
            ]
            routes = agg.poll(t, members, force=force)
            for route in routes:
                value = wire.encode(sign(route.advertisement, self.site_keys[s], route.prefix))
                self.stats.advertisements += 1
                self.stats.bytes += len(value)
                self.site_stats["advertisements"] += 1
                self.site_stats["bytes"] += len(value)
                for x in range(len(sc.sites)):
                    if x != s:
                        self._push(t + self._delay[s][x], x, -1 - s, route.prefix, value, None)

    def _push(self, at: float, x: int, i: int, prefix: object, value: bytes, snap) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (ceil_ms(at), self._counter, x, i, prefix, value, snap))

    def deliver(self, t: int) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t:
            at, _, x, i, prefix, value, snapshot = heapq.heappop(heap)
            self.stats.deliveries += 1
            verdict = self.receivers[x].check(value, prefix, at)
            self.stats.full_checks += 1
            self.receivers[x] = self.receivers[x].commit(verdict)
            if not verdict.ok or verdict.advertisement is None:
                reason = verdict.reason.value
                self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
                continue
            self.stats.accepted += 1
            self.ribs[x].accept(verdict.advertisement, at)
            if i >= 0:  # an instance route of site x: also its site's own selector
                self.local_ribs[x].accept(verdict.advertisement, at)
                if snapshot is not None:
                    self.views[x][i] = snapshot


class AggregatedPolicy(CatsprotoPolicy):
    """catsproto with per-instance state at home and site aggregates from elsewhere."""

    name = "catsproto-agg"
    options = AggregateOptions()

    def __init__(self, cluster: Cluster, trace: PreparedTrace, seed: int) -> None:
        super().__init__(cluster, trace, seed)
        self.control = AggregatedControlPlane(cluster.sc, cluster, options=self.options)
        if len(trace):
            self.control.start(int(trace.arrival_ms[0]))
        self._index = {ipaddress.ip_address(a): i for a, i in self.control.address_index.items()}
        self.handovers = 0

    def choose(self, r: int, t: int) -> Choice:
        control = self.control
        assert isinstance(control, AggregatedControlPlane)
        x = int(self.trace.ingress[r])
        req = self.trace.requests[r]
        request = Request(CS_ID, self.trace.keys[r], req.input_length, self._nodes[x])
        try:
            decision = control.selectors[x].decide(request, t)
        except NoInstanceError:
            self.fallbacks += 1
            cl = self.cluster
            here = np.nonzero(cl.site == x)[0]
            return Choice(self._least(t, here, cl.waits(t)[here]), fallback=True)
        self.last_decision = decision
        address = decision.chosen.address
        site = control.site_index.get(address)
        if site is not None:  # a remote site: its own selector picks the instance
            return self._site_choice(site, r, t)
        return Choice(self._index[address], None, decision.chosen.cached_blocks)

    def _site_choice(self, s: int, r: int, t: int) -> Choice:
        control = self.control
        assert isinstance(control, AggregatedControlPlane)
        req = self.trace.requests[r]
        request = Request(CS_ID, self.trace.keys[r], req.input_length, self._nodes[s])
        self.handovers += 1
        try:
            d = control.local_selectors[s].decide(request, t)
        except NoInstanceError:
            cl = self.cluster
            here = np.nonzero(cl.site == s)[0]
            return Choice(self._least(t, here, cl.waits(t)[here]), fallback=True)
        return Choice(self._index[d.chosen.address], None, -1)


class AggregatedPolicy10(AggregatedPolicy):
    name = "catsproto-agg10"
    options = AggregateOptions(interval_ms=10_000)


def register() -> None:
    """Add the aggregated policies to `sim.POLICIES` (idempotent)."""
    POLICIES.setdefault(AggregatedPolicy.name, AggregatedPolicy)
    POLICIES.setdefault(AggregatedPolicy10.name, AggregatedPolicy10)


def unregister() -> None:
    """Take them out again (tests that must leave the default policy list as it was)."""
    for name in (AggregatedPolicy.name, AggregatedPolicy10.name):
        POLICIES.pop(name, None)

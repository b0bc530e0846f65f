"""Aggregated remote state: per-instance advertisements inside a site, one site
advertisement beyond it, on the two-level decision of `sim.hierarchy`.

Strategy. S1's `catsproto` already decides in two levels: the ingress's C-PS picks the
*site* and that site's own C-PS the instance. So beyond a site an ingress needs only
"which site holds this prefix, how busy is it", which one site advertisement can say.
`AggregatedControlPlane` is `HierarchicalControlPlane` with another export policy:

- each instance's routes reach only the C-PSs of its own site (the ingress C-PS there
  and the site C-PS, as before); they never cross the site border;
- each site's egress runs a `catsproto.node.aggregate.SiteAggregator` over its
  instances' caches and compute states (the union of their keys, or the keys held by
  ``min_holders`` of them; rate and backlog per instance), signs the site routes with
  the site's key, and those reach every *other* site's ingress C-PS after the same
  propagation delay, with the site's own dampening (``interval_ms``, ``target_fpr``).

So the C-PS at ingress X holds per-instance state for X's instances and one origin per
remote site. `AggregatedPolicy` is `HierarchicalPolicy` unchanged: its ingress decision
names either a home instance or a remote site's egress, and either way only the site is
kept; the site's C-PS (full per-instance state) places the request, with the same
bounce and sticky rules. A site egress's address resolves to its site through
``_index`` (mapped to the site's first instance, which `HierarchicalPolicy.choose`
only uses to read the site).

Bytes: ``stats.bytes`` counts every signed route announced (instance routes kept inside
plus site routes), ``beyond_site_bytes`` only the site routes, which are what crosses a
site border; `sim.engine` reports it as ``adv_beyond_site_bytes`` (for per-instance
catsproto every route crosses, so it equals ``adv_bytes``).

Policies, added to `sim.POLICIES` only by an explicit `register()` (the default
`catsproto eval` list and runs are unchanged): ``catsproto-agg`` (the site advertises
at the instances' interval and FPR), ``catsproto-agg10`` and ``catsproto-agg20`` (10 s
and 20 s site interval), ``catsproto-agg10f5`` (10 s, 5 % FPR), ``catsproto-agg10h2``
(10 s, only keys at least two instances hold), ``catsproto-agg10d4``, ``-d8``, ``-d16``
(10 s, each held prefix's first 4 / 8 / 16 blocks); ``catsproto-agg-nokeys`` is a control
(empty site summaries: metrics and capacity only). `benchmarks/scale.py --quality` runs
them against catsproto on the whole trace.
"""

from __future__ import annotations

import heapq
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from catsproto import wire
from catsproto.node import DampeningPolicy, TierSpec
from catsproto.node.aggregate import SiteAggregator, SiteMember
from catsproto.security import Policy as SecurityPolicy
from catsproto.security import Receiver, SigningKey, sign
from catsproto.selector.rib import ServiceTable
from catsproto.sim.cluster import Cluster, ceil_ms
from catsproto.sim.control import _seed, enrol
from catsproto.sim.hierarchy import HierarchicalControlPlane, HierarchicalPolicy
from catsproto.sim.policies import POLICIES
from catsproto.sim.trace import PreparedTrace

__all__ = [
    "AGGREGATED_POLICIES",
    "AggregateOptions",
    "AggregatedControlPlane",
    "AggregatedPolicy",
    "register",
    "unregister",
]


@dataclass(frozen=True)
class AggregateOptions:
    """The egress's aggregation beyond the site: None takes the scenario's value."""

    interval_ms: int | None = None
    target_fpr: float | None = None
    min_holders: int = 1
    max_depth: int = 0


NO_KEYS = 1 << 30  # a holder threshold no key reaches: empty site summaries


def site_address(s: int) -> str:
    return f"10.{s + 1}.255.254"


def site_shards(s: int) -> str:
    return f"10.254.{s}.0/24"


class AggregatedControlPlane(HierarchicalControlPlane):
    """Instance routes stay in their site; site aggregates go to the other sites."""

    def __init__(
        self, sc, cluster: Cluster, *, exact: bool = False, options: AggregateOptions | None = None
    ) -> None:
        super().__init__(sc, cluster, exact=exact)
        opts = options or AggregateOptions()
        self.options = opts
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
            trust, cfg = enrol(
                sc,
                trust,
                operator,
                key,
                site_address(s),
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
                SiteAggregator(
                    cfg, tiers, epoch=1, min_holders=opts.min_holders, max_depth=opts.max_depth
                )
            )
        self.receivers = [Receiver(trust, policy=SecurityPolicy()) for _ in self.receivers]
        self.site_index = {ipaddress.ip_address(site_address(s)): s for s in range(len(sc.sites))}
        self.beyond_site_advertisements = 0
        self.beyond_site_bytes = 0

    def poll(self, t: int, *, force: bool = False) -> None:
        """Instances as in `ControlPlane.poll`, their routes kept to their own site's
        C-PS; then every site egress aggregates and announces to the other sites."""
        before = self._counter
        super().poll(t, force=force)
        if self._counter != before:  # export policy: instance routes do not leave the site
            site_of = self.sc.site_of
            kept = [e for e in self._heap if e[3] < 0 or site_of(e[3]) == e[2]]
            if len(kept) != len(self._heap):
                heapq.heapify(kept)
                self._heap = kept
        self._poll_sites(t, force)

    def _poll_sites(self, t: int, force: bool) -> None:
        sc, cl = self.sc, self.cluster
        per = sc.instances_per_site
        for s, agg in enumerate(self.aggregators):
            if not force and agg.suppressed(t):
                continue
            members = [
                SiteMember.from_cache(cl.caches[i], self.compute_state(i, t))
                for i in range(s * per, (s + 1) * per)
            ]
            for route in agg.poll(t, members, force=force):
                value = wire.encode(sign(route.advertisement, self.site_keys[s], route.prefix))
                self.stats.advertisements += 1
                self.stats.bytes += len(value)
                self.beyond_site_advertisements += 1
                self.beyond_site_bytes += len(value)
                for x in range(len(self.selectors)):
                    if x != s:
                        self._counter += 1
                        at = ceil_ms(t + self._delay[s][x])
                        entry = (at, self._counter, x, -1 - s, route.prefix, value, None)
                        heapq.heappush(self._heap, entry)

    def _accepted(self, x: int, i: int, adv: wire.Advertisement, at: int) -> None:
        if i >= 0:  # a site aggregate (i < 0) feeds only the ingress C-PS
            super()._accepted(x, i, adv, at)


class AggregatedPolicy(HierarchicalPolicy):
    """S1's two-level catsproto with site aggregates as the only remote state."""

    name = "catsproto-agg"
    options = AggregateOptions()
    carry_source = False  # a remote site is one aggregate origin: no holder to pull from

    def __init__(
        self, cluster: Cluster, trace: PreparedTrace, seed: int, *, exact: bool = False
    ) -> None:
        super().__init__(cluster, trace, seed, exact=exact)
        sc = cluster.sc
        self.control = AggregatedControlPlane(sc, cluster, exact=exact, options=self.options)
        if len(trace):
            self.control.start(int(trace.arrival_ms[0]))
        # a site egress's address names its site (through its first instance)
        for address, s in self.control.site_index.items():
            self._index[address] = s * sc.instances_per_site

    def _routes_of_site(self, x: int, home: ServiceTable) -> Iterable[object]:
        """Beyond site x its aggregate is the one route (its queue is the pooled wait of
        x's instances), so the overflow signal floors that."""
        return (ipaddress.ip_address(site_address(x)),)


def _variant(name: str, options: AggregateOptions) -> type[AggregatedPolicy]:
    return type(
        f"AggregatedPolicy_{name.rsplit('-', 1)[-1]}",
        (AggregatedPolicy,),
        {"name": name, "options": options, "__doc__": f"{AggregatedPolicy.__doc__} {options}"},
    )


AGGREGATED_POLICIES: dict[str, type[AggregatedPolicy]] = {
    AggregatedPolicy.name: AggregatedPolicy,
    "catsproto-agg10": _variant("catsproto-agg10", AggregateOptions(interval_ms=10_000)),
    "catsproto-agg20": _variant("catsproto-agg20", AggregateOptions(interval_ms=20_000)),
    "catsproto-agg10f5": _variant(
        "catsproto-agg10f5", AggregateOptions(interval_ms=10_000, target_fpr=0.05)
    ),
    "catsproto-agg10h2": _variant(
        "catsproto-agg10h2", AggregateOptions(interval_ms=10_000, min_holders=2)
    ),
    "catsproto-agg10d4": _variant(
        "catsproto-agg10d4", AggregateOptions(interval_ms=10_000, max_depth=4)
    ),
    "catsproto-agg10d8": _variant(
        "catsproto-agg10d8", AggregateOptions(interval_ms=10_000, max_depth=8)
    ),
    "catsproto-agg10d16": _variant(
        "catsproto-agg10d16", AggregateOptions(interval_ms=10_000, max_depth=16)
    ),
    # a control, not a proposal: sites advertise no keys beyond themselves (metrics and
    # capacity only), to show how much a scenario's quality depends on remote summaries
    "catsproto-agg-nokeys": _variant("catsproto-agg-nokeys", AggregateOptions(min_holders=NO_KEYS)),
}


def register() -> None:
    """Add the aggregated policies to `sim.POLICIES` (idempotent)."""
    for name, cls in AGGREGATED_POLICIES.items():
        POLICIES.setdefault(name, cls)


def unregister() -> None:
    """Take them out again (tests that must leave the default policy list as it was)."""
    for name in AGGREGATED_POLICIES:
        POLICIES.pop(name, None)

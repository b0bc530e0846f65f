"""Site aggregation (catsproto.node.aggregate): one signed site advertisement over the
union of the instances' keys, aggregated CATS metrics, and its path through the real
codec, signature check and selector RIB."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from catsproto import wire
from catsproto.node import BuilderConfig, ComputeState, TieredCache, TierSpec
from catsproto.node.aggregate import (
    SiteAggregator,
    SiteMember,
    Visibility,
    export_routes,
    pooled_state,
    site_metrics,
    union_keys,
)
from catsproto.node.metrics import (
    METRIC_OUTSTANDING_PREFILL_TOKENS,
    METRIC_PREFILL_THROUGHPUT,
    METRIC_RUNNING_REQUESTS,
)
from catsproto.security import Policy, Receiver, SigningKey, TrustStore, authorise, sign
from catsproto.selector import RIB, Link, Network, PathSelector, Request, SelectorConfig
from catsproto.wire import Source, Statistic, Tier

HBM = TierSpec(Tier.HBM, 1000, 0, 8_000_000)


def _member(keys: list[int], backlog: int = 0, tps: float = 20_000.0) -> SiteMember:
    cache = TieredCache([HBM])
    for k in keys:
        cache.store(Tier.HBM, k)
    return SiteMember.from_cache(
        cache,
        ComputeState(outstanding_prefill_tokens=backlog, prefill_rate_tps=tps, utilisation=0.5),
    )


def _config(**kw: object) -> BuilderConfig:
    base: dict[str, object] = dict(
        cs_id=7,
        address="10.9.255.254",
        model_id="m",
        block_size=512,
        bytes_per_block=0,
        site_id=9,
        shard_range="10.254.9.0/24",
    )
    base.update(kw)
    return BuilderConfig(**base)  # type: ignore[arg-type]


def test_union_and_holder_weighting() -> None:
    a, b, c = _member([1, 2, 3]), _member([2, 3, 4]), _member([3, 5])
    assert union_keys([a, b, c], Tier.HBM).tolist() == [1, 2, 3, 4, 5]
    assert union_keys([a, b, c], Tier.HBM, 2).tolist() == [2, 3]
    assert union_keys([a, b, c], Tier.HBM, 3).tolist() == [3]
    assert union_keys([a], Tier.DRAM).tolist() == []
    with pytest.raises(ValueError):
        union_keys([a], Tier.HBM, 0)


def test_depth_limit_keeps_each_prompts_first_blocks() -> None:
    """Prompts through real caches, which free a prompt's tail first: with max_depth 2
    the site keeps each held prefix's first two blocks (so a longest run from block 0
    still finds them) and drops the deeper ones."""
    cache_a, cache_b = TieredCache([TierSpec(Tier.HBM, 6, 0, 8_000_000)]), TieredCache([HBM])
    cache_a.admit([11, 12, 13, 14, 15])
    cache_a.admit([31, 32, 33])  # evicts 15 and 14, the first prompt's tail
    cache_b.admit([21, 22, 23])
    state = ComputeState(prefill_rate_tps=20_000.0)
    members = [SiteMember.from_cache(c, state) for c in (cache_a, cache_b)]
    assert sorted(cache_a.keys(Tier.HBM).tolist()) == [11, 12, 13, 31, 32, 33]
    assert union_keys(members, Tier.HBM, max_depth=2).tolist() == [11, 12, 21, 22, 31, 32]
    assert union_keys(members, Tier.HBM).tolist() == [11, 12, 13, 21, 22, 23, 31, 32, 33]
    q = [21, 22, 23]
    bare = SiteMember({Tier.HBM: np.array(q, dtype=np.uint64)}, state, 1000, 997)
    assert union_keys([bare], Tier.HBM, max_depth=1).tolist() == q  # no depths: all kept
    with pytest.raises(ValueError):
        union_keys(members, Tier.HBM, max_depth=-1)
    agg = SiteAggregator(_config(), [TierSpec(Tier.HBM, 2000, 0, 8_000_000)], 1, max_depth=2)
    agg.poll(0, members)
    assert (
        sorted(agg.mirror.keys(Tier.HBM).tolist())
        == union_keys(members, Tier.HBM, max_depth=2).tolist()
    )


def test_metrics_are_aggregated_per_cats_framework() -> None:
    states = [
        ComputeState(
            waiting=1, running=1, outstanding_prefill_tokens=20_000, prefill_rate_tps=20_000
        ),
        ComputeState(waiting=0, running=0, outstanding_prefill_tokens=0, prefill_rate_tps=20_000),
    ]
    pooled = pooled_state(states)
    assert pooled.prefill_rate_tps == 40_000 and pooled.outstanding_prefill_tokens == 20_000
    assert pooled.wait_ms == 500.0
    m = site_metrics(states)
    assert all(x.source is Source.AGGREGATED for x in m.l0.metrics)
    ttft = {x.statistic: x.value for x in m.l0.metrics if x.metric_type == 7}
    assert ttft == {Statistic.MEAN: 500.0, Statistic.MIN: 0.0}
    # a request's prefill runs on one instance: rate and backlog per instance (MEAN),
    # whose quotient is still the pooled wait
    by_type = {x.metric_type: x for x in m.l0.metrics if x.metric_type != 7}
    rate, backlog = by_type[METRIC_PREFILL_THROUGHPUT], by_type[METRIC_OUTSTANDING_PREFILL_TOKENS]
    assert (rate.value, rate.statistic) == (20_000.0, Statistic.MEAN)
    assert (backlog.value, backlog.statistic) == (10_000.0, Statistic.MEAN)
    assert backlog.value / rate.value * 1000 == pooled.wait_ms
    running = by_type[METRIC_RUNNING_REQUESTS]
    assert (running.value, running.statistic) == (1.0, Statistic.CURRENT)  # counts summed
    # L1/L2 per site, from the pooled state: service = round(10 * 1000 / 1500) = 7
    assert {s.category.name: s.score for s in m.l1.scores}["SERVICE"] == 7
    assert m.l2.score == min(s.score for s in m.l1.scores)
    wire.decode(wire.encode(wire.Advertisement.build(*_mandatory(), m.l0, m.l1, m.l2)))


def _mandatory() -> list[wire.TLV]:
    return [
        wire.Version(wire.FORMAT_VERSION),
        wire.Origin(7, 9, ipaddress.ip_address("10.9.255.254")),
        wire.Sequence(1, 1),
        wire.Timestamp(0),
    ]


def test_site_advertisement_through_codec_signature_and_rib() -> None:
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 2**63, 50, dtype=np.uint64).tolist()
    members = [
        _member(shared + rng.integers(1, 2**63, 500, dtype=np.uint64).tolist(), backlog=1000 * i)
        for i in range(4)
    ]
    agg = SiteAggregator(_config(), [TierSpec(Tier.HBM, 4000, 0, 8_000_000)], epoch=1)
    routes = agg.poll(1_000, members)
    assert routes and routes[0].tier is None
    main = routes[0].advertisement
    assert main.origin.site_id == 9 and str(main.origin.address) == "10.9.255.254"
    assert main.capacity == wire.Capacity(4 * (1000 - 550), 4000)
    assert main.metrics_l0 is not None
    assert all(x.source is Source.AGGREGATED for x in main.metrics_l0.metrics)
    # signed by the site key, verified, accepted into a RIB as one origin
    operator = SigningKey.from_seed(b"o" * 32)
    site_key = SigningKey.from_seed(b"s" * 32)
    trust = (
        TrustStore()
        .with_operator(operator.public.raw, "op")
        .with_delegation(
            authorise(
                operator,
                site_key.public.raw,
                cs_ids=[7],
                routes=["10.9.255.254/32", "10.254.9.0/24"],
                addresses=["10.9.255.254/32"],
                not_before_ms=0,
                not_after_ms=1 << 62,
            )
        )
    )
    receiver = Receiver(trust, policy=Policy())
    rib = RIB()
    total_bytes = 0
    for r in routes:
        value = wire.encode(sign(r.advertisement, site_key, r.prefix))
        total_bytes += len(value)
        verdict = receiver.check(value, r.prefix, 1_000)
        assert verdict.ok, verdict.reason
        receiver = receiver.commit(verdict)
        assert verdict.advertisement is not None
        rib.accept(verdict.advertisement, 1_000)
    table = rib.services[7]
    assert len(table.live()) == 1
    site = table.live()[0]
    union = union_keys(members, Tier.HBM)
    assert site.lookup(union).all()  # no false negatives over the union
    # priced as one instance: its rate, and the backlog that gives the pooled wait at it
    assert site.prefill_tps == 20_000 and site.backlog_tokens == 1_500
    # one site summary is smaller than the four instances' summaries together
    per_instance = 0
    for i, m in enumerate(members):
        cache = TieredCache([HBM])
        for k in m.keys[Tier.HBM].tolist():
            cache.store(Tier.HBM, k)
        from catsproto.node import AdvertisementBuilder

        b = AdvertisementBuilder(
            _config(address=f"10.9.0.{i + 1}", shard_range=f"10.255.{i}.0/24"), cache, 1
        )
        per_instance += sum(len(wire.encode(r.advertisement)) for r in b.poll(1_000, m.state))
    unsigned = sum(len(wire.encode(r.advertisement)) for r in routes)
    assert unsigned < per_instance
    # a remote selector steers a request with a shared prefix to the site
    net = Network([Link("in", "site9", 5.0, 1000.0)])
    sel = PathSelector(rib, net, SelectorConfig(site_nodes={9: "site9"}))
    d = sel.decide(Request(7, np.array(shared[:4], dtype=np.uint64), 2048, "in"), 1_000)
    assert d.chosen.site_id == 9 and d.chosen.cached_blocks >= 4


def test_deltas_and_dampening_follow_the_union() -> None:
    members = [_member(list(range(1, 101))), _member(list(range(50, 151)))]
    agg = SiteAggregator(_config(), [TierSpec(Tier.HBM, 2000, 0, 8_000_000)], epoch=1)
    first = agg.poll(0, members)
    assert len(first) == 2  # main route + one shard
    assert agg.poll(500, members) == []  # nothing changed, min interval not reached
    members[1] = _member(list(range(50, 171)))  # 20 new keys: > 5 % of 150
    routes = agg.poll(1_000, members)
    shard = [r for r in routes if r.tier is Tier.HBM]
    assert shard and shard[0].advertisement.cache_summaries is not None
    entry = shard[0].advertisement.cache_summaries.entries[0]
    assert entry.base_version == 1 and entry.entry_count == 170  # a delta on the snapshot


def test_skipping_the_union_inside_the_min_interval_changes_nothing() -> None:
    """A key added and removed again inside the interval counts nowhere (the mirror keeps
    net changes), so not syncing while suppressed sends the same bytes at the same times."""
    rng = np.random.default_rng(5)
    base = [rng.integers(1, 2**63, 300, dtype=np.uint64).tolist() for _ in range(3)]
    spec = [TierSpec(Tier.HBM, 3000, 0, 8_000_000)]
    skipping = SiteAggregator(_config(), spec, epoch=1)
    every_tick = SiteAggregator(_config(), spec, epoch=1)
    every_tick.suppressed = lambda now_ms: False  # type: ignore[method-assign]
    sent, skipped = [], 0
    for t in range(0, 6_000, 250):
        keys = [b[: 200 + (t // 250 * 37) % 100] for b in base]
        if t % 500 == 0:  # a passing key, gone by the next poll
            keys[0] = keys[0] + [int(rng.integers(1, 2**63))]
        members = [_member(k, backlog=t) for k in keys]
        skipped += skipping.suppressed(t)
        a, b = skipping.poll(t, members), every_tick.poll(t, members)
        assert [wire.encode(r.advertisement) for r in a] == [
            wire.encode(r.advertisement) for r in b
        ]
        sent += a
    assert len(sent) > 2 and skipped > 6


def test_export_policy() -> None:
    members = [_member([1, 2])]
    agg = SiteAggregator(_config(), [HBM], epoch=1)
    site_routes = agg.poll(0, members)
    inst_routes = site_routes[:0]
    assert export_routes(Visibility.BEYOND, inst_routes, site_routes) == site_routes
    assert export_routes(Visibility.INSIDE, inst_routes, site_routes) == []
    with pytest.raises(ValueError):
        SiteAggregator(_config(site_id=0), [HBM], epoch=1)

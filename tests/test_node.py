"""The pure C-SMA core: cache model, metrics, dampening, advertisement builder."""

from __future__ import annotations

import ipaddress
import itertools

import numpy as np
import pytest

from catsproto import wire
from catsproto.keys import BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    AdvertisementTooLarge,
    BlockEvent,
    BlockEventKind,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    KeyMode,
    ModelShape,
    Reason,
    TieredCache,
    TierSpec,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    VllmIngest,
    cats_metrics,
)
from catsproto.summary import ShardedSender, SummaryReceiver, attribute_value_budget
from catsproto.wire import Tier

H, D, S, R = Tier.HBM, Tier.DRAM, Tier.SSD, Tier.REMOTE
STORED, REMOVED, MOVED = BlockEventKind.STORED, BlockEventKind.REMOVED, BlockEventKind.MOVED


def small_cache(hbm: int = 2, dram: int = 2, ssd: int = 1) -> TieredCache:
    return TieredCache(
        [
            TierSpec(H, hbm, 5, 1_600_000),
            TierSpec(D, dram, 20, 400_000),
            TierSpec(S, ssd, 200, 50_000),
        ]
    )


def tiers(cache: TieredCache) -> dict[Tier, list[int]]:
    return {t: cache.lru_keys(t) for t in cache.order}


# ---- cache model ----------------------------------------------------------------------


def test_model_shape_bytes_per_block() -> None:
    # Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, fp16, 16-token blocks.
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16)
    assert shape.bytes_per_token == 131_072
    assert shape.bytes_per_block == 2_097_152
    with pytest.raises(ValueError, match="layers"):
        ModelShape(0, 8, 128, 2, 16)


def test_lru_and_demotion_exact_on_a_scripted_sequence() -> None:
    cache = small_cache()
    mirror = small_cache()

    hit, ev = cache.admit([1, 2])
    assert hit.depth == 0
    assert ev == [BlockEvent(STORED, H, (1, 2))]
    assert tiers(cache) == {H: [2, 1], D: [], S: []}  # first block touched last
    mirror.apply(ev)

    hit, ev = cache.admit([3])
    assert ev == [BlockEvent(STORED, H, (3,)), BlockEvent(MOVED, H, (2,), D)]
    assert tiers(cache) == {H: [1, 3], D: [2], S: []}
    mirror.apply(ev)

    hit, ev = cache.admit([4, 5])
    assert ev == [
        BlockEvent(STORED, H, (4,)),
        BlockEvent(MOVED, H, (1,), D),
        BlockEvent(STORED, H, (5,)),
        BlockEvent(MOVED, D, (2,), S),
        BlockEvent(MOVED, H, (3,), D),
    ]
    assert tiers(cache) == {H: [5, 4], D: [1, 3], S: [2]}
    mirror.apply(ev)

    hit, ev = cache.admit([2, 6])
    assert hit.depth == 1 and hit.tiers == (S,) and hit.blocks_in(S) == 1
    assert ev == [
        BlockEvent(MOVED, S, (2,), H),
        BlockEvent(MOVED, D, (1,), S),
        BlockEvent(MOVED, H, (5,), D),
        BlockEvent(STORED, H, (6,)),
        BlockEvent(REMOVED, S, (1,)),
        BlockEvent(MOVED, D, (3,), S),
        BlockEvent(MOVED, H, (4,), D),
    ]
    assert tiers(cache) == {H: [6, 2], D: [5, 4], S: [3]}
    mirror.apply(ev)

    hit, ev = cache.admit([4, 7])  # a DRAM hit, then a miss
    assert hit.depth == 1 and hit.tiers == (D,)
    assert tiers(cache) == {H: [7, 4], D: [6, 2], S: [5]}  # 3 fell off the last tier
    mirror.apply(ev)

    # the events replayed on an empty model give the same membership per tier
    for t in cache.order:
        assert sorted(mirror.lru_keys(t)) == sorted(cache.lru_keys(t))
    assert cache.hits == {2: 1, 4: 1}
    assert cache.depth[6] == 3 and cache.depth[1] == 1  # 6 follows 2, the second block
    assert cache.used_blocks() == 5 and cache.free_blocks() == 0 and cache.total_blocks() == 5


def test_prefix_lookup_stops_at_first_miss() -> None:
    cache = small_cache(hbm=4)
    cache.admit([10, 11, 12])
    assert cache.lookup([10, 11, 99, 12]).depth == 2
    assert cache.lookup([99, 10]).depth == 0
    assert 12 in cache and 99 not in cache


def test_change_tracking_cancels_and_resets() -> None:
    cache = small_cache(hbm=4)
    assert cache.store(H, 1) and not cache.store(H, 1)
    cache.store(H, 2)
    cache.remove(H, 2)
    assert cache.changes(H) == (frozenset({1}), frozenset())
    cache.mark_advertised()
    assert cache.pending_changes() == 0
    cache.remove(H, 1)
    cache.store(H, 1)
    assert cache.pending_changes() == 0
    assert cache.clear(H) == 1 and cache.changes(H) == (frozenset(), frozenset({1}))


def test_hot_prefixes_rank_hits_then_depth() -> None:
    cache = small_cache(hbm=8)
    cache.admit([1, 2, 3])
    cache.admit([1, 2])
    cache.admit([1])
    assert cache.hot_prefixes(2) == [(1, 1), (2, 2)]
    assert cache.hot_prefixes(0) == []


# ---- metrics ----------------------------------------------------------------------------


def test_cats_metrics_scores() -> None:
    m = cats_metrics(
        ComputeState(
            waiting=3,
            running=1,
            outstanding_prefill_tokens=8000,
            prefill_rate_tps=8000.0,
            utilisation=0.25,
            kv_utilisation=0.5,
        )
    )
    values = {x.metric_type: x.value for x in m.l0.metrics}
    assert values[7] == 1000.0 and values[1] == 25.0 and values[3] == 3.0 and values[11] == 8000
    scores = {s.category: s.score for s in m.l1.scores}
    assert scores == {wire.MetricCategory.COMPUTE: 8, wire.MetricCategory.SERVICE: 5}
    assert m.l2.score == 5
    idle = cats_metrics(ComputeState())
    assert idle.l2.score == 10
    with pytest.raises(ValueError):
        ComputeState(prefill_rate_tps=0)


# ---- builder ----------------------------------------------------------------------------

KEYER = BlockKeyer(b"k" * 32, "test/model", 4)


def config(**kw: object) -> BuilderConfig:
    base: dict[str, object] = dict(
        cs_id=7,
        address="10.0.0.5",
        model_id="test/model",
        block_size=4,
        bytes_per_block=65_536,
        site_id=3,
        secret_id=9,
        dampening=DampeningPolicy(
            min_interval_ms=500, max_interval_ms=10_000, change_threshold=0.1
        ),
    )
    base.update(kw)
    return BuilderConfig(**base)  # type: ignore[arg-type]


def roundtrip(route) -> wire.Advertisement:  # type: ignore[no-untyped-def]
    value = wire.encode(route.advertisement)
    back = wire.decode(value)
    assert back == route.advertisement and wire.encode(back) == value
    return back


def test_builder_single_route_carries_everything() -> None:
    cache = small_cache(hbm=64, dram=64, ssd=64)
    keys = KEYER.block_keys(list(range(40)))
    cache.admit(keys)
    builder = AdvertisementBuilder(config(), cache, epoch=42)
    routes = builder.poll(1_000, ComputeState(waiting=1, prefill_rate_tps=5000.0))
    assert len(routes) == 1 and routes[0].reason is Reason.INITIAL
    assert routes[0].prefix == ipaddress.ip_network("10.0.0.5/32")
    adv = roundtrip(routes[0])
    assert adv.sequence == wire.Sequence(42, 1) and adv.timestamp_ms == 1_000
    assert adv.origin == wire.Origin(7, 3, ipaddress.ip_address("10.0.0.5"))
    assert adv.cache_model == wire.CacheModel("test/model", 4, wire.KeyScheme(1), 9)
    assert adv.capacity == wire.Capacity(192 - 10, 192)
    entries = adv.cache_summaries.entries  # type: ignore[union-attr]
    assert [e.tier for e in entries] == [H, D, S]
    hbm = entries[0]
    assert (hbm.entry_count, hbm.bytes_per_block, hbm.fetch_latency_us) == (10, 65_536, 5)
    receiver = SummaryReceiver()
    receiver.apply_entry(hbm)
    assert receiver.contains_many(np.array(keys, dtype=np.uint64)).all()
    hot = adv.hot_prefixes.prefixes  # type: ignore[union-attr]
    assert len(hot) == 8 and all(p.block_key in keys for p in hot)

    # nothing changed: nothing to say until the refresh
    assert builder.poll(2_000, ComputeState(waiting=1, prefill_rate_tps=5000.0)) == []
    assert (
        builder.decide(2_000, ComputeState(waiting=1, prefill_rate_tps=5000.0)).reason
        is Reason.IDLE
    )
    # a one-key change is below 10% of 10 advertised keys? 1 >= 1.0: it is at the threshold
    cache.admit([12345])
    again = builder.poll(2_100, ComputeState(waiting=1, prefill_rate_tps=5000.0))
    assert [r.reason for r in again] == [Reason.CHANGE]
    adv2 = roundtrip(again[0])
    assert adv2.sequence == wire.Sequence(42, 2)
    e2 = adv2.cache_summaries.entries[0]  # type: ignore[union-attr]
    receiver.apply_entry(e2)
    assert 12345 in receiver.state  # type: ignore[operator]
    # refresh after max interval even without change
    refresh = builder.poll(12_100, ComputeState(waiting=1, prefill_rate_tps=5000.0))
    assert [r.reason for r in refresh] == [Reason.REFRESH]
    assert builder.stats.advertisements == 3 and builder.stats.bytes > 0


def test_builder_single_route_refuses_what_does_not_fit() -> None:
    cache = TieredCache([TierSpec(H, 100_000, 5, 1)])
    for k in range(1, 20_000):
        cache.store(H, k * 0x9E3779B97F4A7C15 % (1 << 64))
    builder = AdvertisementBuilder(config(), cache, epoch=1)
    with pytest.raises(AdvertisementTooLarge, match="shard range"):
        builder.poll(0, ComputeState())


def test_builder_sharded_routes_fit_and_reconstruct() -> None:
    rng = np.random.default_rng(5)
    cache = TieredCache([TierSpec(H, 2_000, 5, 1_600_000), TierSpec(D, 20_000, 30, 200_000)])
    hbm_keys = [int(k) for k in rng.integers(1, 2**63, 1_500)]
    dram_keys = [int(k) for k in rng.integers(1, 2**63, 12_000)]
    for k in hbm_keys:
        cache.store(H, k)
    for k in dram_keys:
        cache.store(D, k)
    policy = DampeningPolicy(min_interval_ms=500, change_threshold=0.01)
    cfg = config(shard_range="10.255.1.0/24", reserve_bytes=300, dampening=policy)
    builder = AdvertisementBuilder(cfg, cache, epoch=2)
    routes = builder.poll(0, ComputeState())
    limit = attribute_value_budget(4096, as_path_hops=2) - 300
    # receivers keyed by what the wire says each shard covers (tier, key_lo, key_hi)
    receivers: dict[tuple[Tier, int, int], SummaryReceiver] = {}
    assert routes[0].tier is None and routes[0].advertisement.cache_summaries is None
    for r in routes:
        adv = roundtrip(r)
        assert len(wire.encode(adv)) <= limit
        if r.tier is not None:
            (entry,) = adv.cache_summaries.entries  # type: ignore[union-attr]
            assert entry.tier == r.tier
            span = (r.tier, entry.key_lo, entry.key_hi)
            receivers.setdefault(span, SummaryReceiver()).apply_entry(entry)  # type: ignore[arg-type]
    seqs = [r.sequence for r in routes]
    assert seqs == list(range(1, len(routes) + 1))
    dram_routes = [r for r in routes if r.tier == D]
    assert len(dram_routes) > 1
    assert str(dram_routes[0].prefix) == "10.255.1.64/32"  # DRAM's quarter of the /24

    spans = sorted(receivers)
    for tier in (H, D):  # each tier's shards tile the key space, no gap, no overlap
        mine = [(lo, hi) for t, lo, hi in spans if t == tier]
        assert mine[0][0] == 0 and mine[-1][1] == 2**64 - 1
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(mine))

    def held(tier: Tier, keys: list[int]) -> bool:
        """Every key is in the summary of the one shard whose advertised range holds it."""
        for k in keys:
            (span,) = [sp for sp in spans if sp[0] == tier and sp[1] <= k <= sp[2]]
            if not receivers[span].contains_many(np.array([k], dtype=np.uint64))[0]:
                return False
        return True

    assert held(H, hbm_keys) and held(D, dram_keys)
    # one DRAM key added: main route plus that key's DRAM shard only
    new_key = 0xABCDEF0123456789
    cache.store(D, new_key)
    cache.store(H, 77)  # and enough HBM churn to pass the threshold
    for k in hbm_keys[:200]:
        cache.remove(H, k)
    changed = builder.poll(1_000, ComputeState())
    assert changed[0].tier is None  # the main route
    changed_spans = []
    for r in changed:
        if r.tier is not None:
            (entry,) = roundtrip(r).cache_summaries.entries  # type: ignore[union-attr]
            span = (r.tier, entry.key_lo, entry.key_hi)
            receivers[span].apply_entry(entry)  # type: ignore[index]
            changed_spans.append(span)
    dram_changed = [sp for sp in changed_spans if sp[0] == D]
    assert len(dram_changed) == 1 and dram_changed[0][1] <= new_key <= dram_changed[0][2]
    assert held(D, [new_key, *dram_keys]) and held(H, [77, *hbm_keys[200:]])
    assert isinstance(builder._senders[D], ShardedSender)
    assert builder.routes()[0] == ipaddress.ip_network("10.0.0.5/32")


# ---- dampening under a storm ---------------------------------------------------------------


def test_dampening_bounds_updates_under_a_10k_events_per_second_storm() -> None:
    """10,000 block events/s for 10 simulated seconds; at most one update per 500 ms."""
    cache = TieredCache([TierSpec(H, 4_096, 5, 1)])
    ingest = VllmIngest(cache, KEYER, key_mode=KeyMode.ENGINE_IDS)
    policy = DampeningPolicy(min_interval_ms=500, max_interval_ms=5_000, change_threshold=0.01)
    builder = AdvertisementBuilder(config(dampening=policy), cache, epoch=1)
    sent: list[int] = []
    block = 0
    for ms in range(10_000):
        # ten events this millisecond: store 10 fresh blocks, evict 10 old ones
        stored = list(range(block, block + 10))
        events: list[object] = [VllmBlockStored(stored, None, [0] * 40, 4)]
        if block >= 2_000:
            events.append(VllmBlockRemoved(list(range(block - 2_000, block - 1_990))))
        block += 10
        ingest.apply_batch(VllmEventBatch(ms / 1000, tuple(events)))  # type: ignore[arg-type]
        if builder.poll(ms, ComputeState(waiting=ms % 7)):
            sent.append(ms)
    assert ingest.stats.block_events >= 100_000 - 2_000
    gaps = np.diff(sent)
    assert gaps.min() >= 500
    assert len(sent) <= 10_000 // 500 + 1
    assert len(sent) >= 10_000 // 500 - 1  # the storm keeps the updates at the bound
    assert builder.stats.suppressed > 9_000

"""Routes that go quiet at the origin: refreshed within the max interval, snapshots for
late receivers.

A busy instance changes some shard at every update, so the dampener's own refresh (after
max_interval_ms with no update at all) never fires; the builder must still re-send every
route it has not sent for the max interval, or the signed timestamps of its quiet routes
age until a receiver that checks them later (restart, session flap, new peer) refuses
them. And a route re-sent with nothing changed must let a receiver that missed its last
snapshot catch up, so it announces a snapshot when its last update was a delta.
"""

from __future__ import annotations

import ipaddress

import numpy as np

from catsproto import security, wire
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    Reason,
    RouteAdvertisement,
    TieredCache,
    TierSpec,
)
from catsproto.selector import RIB
from catsproto.summary import KIND_EXACT, ShardedSender
from catsproto.wire import Tier
from tests.rib_helpers import keys as random_keys

H, D = Tier.HBM, Tier.DRAM
CS_ID = 7
ADDRESS = "10.0.0.5"
REFRESH_MS = 30_000
OPERATOR = security.SigningKey.from_seed(bytes(range(32)))
NODE = security.SigningKey.from_seed(bytes(range(1, 33)))
TRUST = (
    security.TrustStore()
    .with_operator(OPERATOR.public.raw)
    .with_delegation(
        security.authorise(
            OPERATOR,
            NODE.public.raw,
            cs_ids=[CS_ID],
            routes=["10.0.0.0/8"],
            addresses=["10.0.0.0/8"],
            not_before_ms=0,
            not_after_ms=10**13,
        )
    )
)


def make_builder(
    *,
    shard_range: str | None = "10.255.1.0/24",
    tiers: tuple[Tier, ...] = (H,),
    **kw: object,
) -> tuple[AdvertisementBuilder, TieredCache]:
    cache = TieredCache([TierSpec(t, 100_000, 10 * int(t), 1_600_000) for t in tiers])
    opts: dict[str, object] = dict(
        summary_kind=KIND_EXACT,
        dampening=DampeningPolicy(
            min_interval_ms=1_000, max_interval_ms=REFRESH_MS, change_threshold=0
        ),
    )
    opts.update(kw)
    config = BuilderConfig(
        cs_id=CS_ID,
        address=ADDRESS,
        model_id="test/model",
        block_size=4,
        bytes_per_block=65_536,
        site_id=3,
        shard_range=shard_range,
        **opts,  # type: ignore[arg-type]
    )
    return AdvertisementBuilder(config, cache, epoch=1), cache


def key_ranges(routes: list[RouteAdvertisement]) -> dict[int, tuple[int, int]]:
    """Shard index -> (key_lo, key_hi) of the shard routes among `routes`."""
    out = {}
    for r in routes:
        if r.shard is not None:
            summaries = r.advertisement.cache_summaries
            assert summaries is not None
            (entry,) = summaries.entries
            out[r.shard] = (entry.key_lo, entry.key_hi)
    return out


def keys_within(lo: int, hi: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(k) for k in rng.integers(lo, hi, n, dtype=np.uint64, endpoint=True)]


def over_the_wire(routes: list[RouteAdvertisement]) -> list[tuple[object, wire.Advertisement]]:
    return [(r.prefix, wire.decode(wire.encode(r.advertisement))) for r in routes]


def claimed(rib: RIB, keys: list[int]) -> int:
    """How many of `keys` the RIB says the instance holds (any tier)."""
    inst = rib.services[CS_ID].by_address[ipaddress.ip_address(ADDRESS)]
    return int(np.count_nonzero(inst.lookup(np.array(keys, dtype=np.uint64))))


def busy_history(
    builder: AdvertisementBuilder, cache: TieredCache, until_ms: int, step_ms: int = 10_000
) -> tuple[dict[object, list[tuple[int, bytes]]], list[list[RouteAdvertisement]]]:
    """Store 2,000 keys, then change the LAST shard only, every `step_ms`, polling after
    each change. Returns every route's signed values by send time, and the polls."""
    for k in random_keys(2_000, 1):
        cache.store(H, k)
    first = builder.poll(0, ComputeState())
    ranges = key_ranges(first)
    assert len(ranges) >= 4, "the test needs several shards"
    busy = max(ranges)
    sent: dict[object, list[tuple[int, bytes]]] = {}
    polls = [first]
    for r in first:
        sent.setdefault(r.prefix, []).append((0, _signed(r)))
    for n, t in enumerate(range(step_ms, until_ms + 1, step_ms)):
        cache.store(H, keys_within(*ranges[busy], 1, 100 + n)[0])
        routes = builder.poll(t, ComputeState())
        polls.append(routes)
        for r in routes:
            sent.setdefault(r.prefix, []).append((t, _signed(r)))
    return sent, polls


def _signed(route: RouteAdvertisement) -> bytes:
    return wire.encode(security.sign(route.advertisement, NODE, route.prefix))


# ---- a busy instance keeps refreshing its quiet routes --------------------------------


def test_a_busy_instance_re_sends_its_quiet_shard_routes_within_the_max_interval() -> None:
    builder, cache = make_builder()
    sent, _polls = busy_history(builder, cache, 400_000)
    # the dampener's own refresh never fired: every update was a change
    assert builder.stats.by_reason == {"initial": 1, "change": 40}
    assert len(sent) >= 5
    for prefix, copies in sent.items():
        times = [t for t, _ in copies]
        gaps = [b - a for a, b in zip([0, *times], [*times, 400_000], strict=True)]
        # a route goes out with the first update at or after its max interval, and
        # updates are never further apart than that: the bound is twice the interval
        assert max(gaps) <= 2 * REFRESH_MS, (prefix, times)
    # a receiver that sees the last copy of every route only now (it restarted, its
    # session flapped, it is a new peer) finds them all fresh
    receiver = security.Receiver(TRUST)
    for prefix, copies in sorted(sent.items(), key=lambda kv: str(kv[0])):
        verdict, receiver = receiver.receive(copies[-1][1], prefix, 400_000)  # type: ignore[arg-type]
        assert verdict.ok, (prefix, copies[-1][0], verdict.reason)


def test_a_quiet_route_piggybacked_on_a_change_is_labelled_a_refresh() -> None:
    builder, cache = make_builder()
    _, polls = busy_history(builder, cache, 60_000)
    # at 30 s the quiet shards reach the max interval; the update is a change of the
    # busy shard, which keeps its reason; the others ride along as refreshes
    at_30s = polls[3]
    reasons = {r.shard: r.reason for r in at_30s}
    busy = max(i for i in reasons if i is not None)
    assert reasons[busy] is Reason.CHANGE
    assert reasons[None] is Reason.CHANGE  # main_on_summary_change: the main route too
    quiet = {i: why for i, why in reasons.items() if i not in (None, busy)}
    assert quiet and set(quiet.values()) == {Reason.REFRESH}
    # at 40 s, 50 s nothing quiet is due again: only the change goes out
    for routes in polls[4:6]:
        assert {r.shard for r in routes} == {None, busy}


def test_the_main_route_is_refreshed_when_only_shards_change() -> None:
    # the main route follows summary changes only when its metrics are due; with steady
    # metrics it must still go out within the max interval
    builder, cache = make_builder(main_on_summary_change=False)
    sent, polls = busy_history(builder, cache, 200_000)
    main = ipaddress.ip_network(ADDRESS)
    times = [t for t, _ in sent[main]]
    assert times == [0, 30_000, 60_000, 90_000, 120_000, 150_000, 180_000]
    main_routes = [r for routes in polls[1:] for r in routes if r.tier is None]
    assert {r.reason for r in main_routes} == {Reason.REFRESH}


def test_an_idle_instance_sends_nothing_between_refreshes() -> None:
    # the per-route refresh adds nothing to an instance whose dampener refreshes anyway
    builder, cache = make_builder()
    for k in random_keys(500, 2):
        cache.store(H, k)
    first = builder.poll(0, ComputeState())
    for t in range(1_000, REFRESH_MS, 1_000):
        assert builder.poll(t, ComputeState()) == []
    again = builder.poll(REFRESH_MS, ComputeState())
    assert {r.prefix for r in again} == {r.prefix for r in first}
    assert {r.reason for r in again} == {Reason.REFRESH}


# ---- a late receiver catches up on a quiet shard --------------------------------------


def test_a_late_receiver_catches_up_on_a_quiet_shard_at_the_refresh() -> None:
    builder, cache = make_builder(snapshot_every=8)
    held = random_keys(200, 1)
    for k in held:
        cache.store(H, k)
    first = builder.poll(0, ComputeState())  # snapshots; the late receiver misses them
    (extra,) = random_keys(1, 7)
    cache.store(H, extra)
    change = builder.poll(1_000, ComputeState())  # a delta on the snapshot
    (delta,) = [r for r in change if r.shard is not None]
    entry = delta.advertisement.cache_summaries.entries[0]  # type: ignore[union-attr]
    assert entry.base_version != 0
    on_time, late = RIB(), RIB()
    for _, adv in over_the_wire(first + change):
        on_time.accept(adv, 1_000)
    for _, adv in over_the_wire(change):
        late.accept(adv, 1_000)
    assert claimed(late, held) == 0  # the delta alone is no use to it
    refresh = builder.poll(1_000 + REFRESH_MS, ComputeState())
    again = [r for r in refresh if r.shard == delta.shard]
    (snap,) = [r.advertisement.cache_summaries.entries[0] for r in again]  # type: ignore[union-attr]
    assert snap.base_version == 0 and snap.version > entry.version  # versions keep rising
    for _, adv in over_the_wire(refresh):
        on_time.accept(adv, 1_000 + REFRESH_MS)
        late.accept(adv, 1_000 + REFRESH_MS)
    assert claimed(late, [*held, extra]) == len(held) + 1
    assert claimed(on_time, [*held, extra]) == len(held) + 1  # the snapshot agrees
    # the next refresh re-sends that snapshot: no new version, no new snapshot
    later = builder.poll(1_000 + 2 * REFRESH_MS, ComputeState())
    (same,) = [
        r.advertisement.cache_summaries.entries[0]  # type: ignore[union-attr]
        for r in later
        if r.shard == delta.shard
    ]
    assert (same.version, same.base_version) == (snap.version, 0)


def test_a_late_receiver_catches_up_on_a_quiet_shard_of_a_busy_instance() -> None:
    builder, cache = make_builder(snapshot_every=8)
    for k in random_keys(2_000, 1):
        cache.store(H, k)
    first = builder.poll(0, ComputeState())
    ranges = key_ranges(first)
    quiet, busy = min(ranges), max(ranges)
    quiet_keys = [k for k in cache.keys(H).tolist() if ranges[quiet][0] <= k <= ranges[quiet][1]]
    (extra,) = keys_within(*ranges[quiet], 1, 3)
    cache.store(H, extra)  # one change of the quiet shard: a delta
    late = RIB()
    routes = builder.poll(1_000, ComputeState())
    assert any(r.shard == quiet for r in routes)
    for n, t in enumerate(range(10_000, 100_001, 10_000)):
        cache.store(H, keys_within(*ranges[busy], 1, 200 + n)[0])
        for _, adv in over_the_wire(builder.poll(t, ComputeState())):
            late.accept(adv, t)
    assert claimed(late, [*quiet_keys, extra]) == len(quiet_keys) + 1


def test_the_single_route_layout_snapshots_a_quiet_tier() -> None:
    # without shard routes the main route carries every tier and goes out with every
    # update; a tier whose summary stays the same delta must still become a snapshot
    builder, cache = make_builder(shard_range=None, tiers=(H, D), snapshot_every=8)
    dram = random_keys(50, 4)
    for k in random_keys(50, 3):
        cache.store(H, k)
    for k in dram:
        cache.store(D, k)
    builder.poll(0, ComputeState())
    (extra,) = random_keys(1, 5)
    cache.store(D, extra)  # dram's stream: a delta, then quiet
    builder.poll(1_000, ComputeState())
    late = RIB()
    for n, t in enumerate(range(10_000, 60_001, 10_000)):
        cache.store(H, random_keys(1, 300 + n)[0])  # hbm keeps changing
        for _, adv in over_the_wire(builder.poll(t, ComputeState())):
            late.accept(adv, t)
    assert claimed(late, [*dram, extra]) == len(dram) + 1


# ---- the summary side ------------------------------------------------------------------


def test_sharded_sender_snapshots_unchanged_shards_on_request() -> None:
    sender = ShardedSender(600, 0.01, kind=KIND_EXACT, snapshot_every=8)
    keys = np.array(sorted(random_keys(300, 9)), dtype=np.uint64)
    first = sender.update(keys)
    assert len(first) > 1 and all(not su.update.is_delta for su in first)
    assert sender.update(keys) == []  # nothing changed, nothing asked
    again = sender.update(keys, snapshot={1})
    assert [su.index for su in again] == [1]
    (su,) = again
    assert not su.update.is_delta and su.update.version > first[1].update.version
    assert su.update.entry_count == first[1].update.entry_count
    assert sender.update(keys) == []  # and the stream is settled again


def test_the_piggybacked_refresh_follows_the_policy_max_interval() -> None:
    policy = DampeningPolicy(min_interval_ms=1_000, max_interval_ms=50_000, change_threshold=0)
    builder, cache = make_builder(dampening=policy)
    _, polls = busy_history(builder, cache, 60_000)
    assert all({r.reason for r in routes} == {Reason.CHANGE} for routes in polls[1:5])
    assert Reason.REFRESH in {r.reason for r in polls[5]}  # at 50 s

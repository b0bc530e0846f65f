"""A shard-count change at the origin replaces, at the receiver, what the older layout said.

When a summary outgrows its shards the sender doubles their number and every shard
starts again with a snapshot (summary/shard.py); shard 0 of the new layout rides the
route that shard 0 of the old one rode, so no route is withdrawn. The RIB keys a stream
by (tier, key range), so a stream of the old layout has no successor of the same range:
it has to give way to the new streams over its range, or it keeps claiming what the
origin held before the change for as long as the origin lives.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from catsproto import wire
from catsproto.adapters.steering import RibFeed
from catsproto.node import AdvertisementBuilder
from catsproto.selector import RIB
from catsproto.selector.rib import TierState
from catsproto.summary import SummaryReceiver
from catsproto.summary.versioning import Outcome
from tests.rib_helpers import CS_ID, H, claimed, instance, keys, poll


def deliver(builder: AdvertisementBuilder, rib: RIB, now: int) -> list[wire.Advertisement]:
    sent = [adv for _, adv in poll(builder, now)]
    for adv in sent:
        rib.accept(adv, now)
    return sent


def ranges(rib: RIB) -> list[tuple[int, int]]:
    (inst,) = rib.services[CS_ID].live()
    return sorted(inst.tiers[H].shards)


def test_a_doubled_shard_count_retires_the_old_layouts_streams() -> None:
    builder, cache = instance()
    rib = RIB()
    old = keys(50, 1)
    for k in old:
        cache.store(H, k)
    deliver(builder, rib, 0)
    assert ranges(rib) == [(0, 2**64 - 1)]  # one shard
    assert claimed(rib, old) == 50
    for k in old:  # evicted; then enough new keys that one shard no longer fits
        cache.remove(H, k)
    new = keys(3_000, 2)
    for k in new:
        cache.store(H, k)
    deliver(builder, rib, 1_000)
    layout = ranges(rib)
    assert len(layout) > 1  # the shard count grew ...
    assert layout[0][0] == 0 and layout[-1][1] == 2**64 - 1  # ... and the new shards
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(layout))  # tile it
    assert claimed(rib, new) == 3_000
    assert claimed(rib, old) == 0  # the old single shard no longer answers


def test_an_old_layouts_entry_arriving_late_is_ignored() -> None:
    builder, cache = instance()
    first, late = RIB(), RIB()
    old = keys(50, 3)
    for k in old:
        cache.store(H, k)
    before = deliver(builder, first, 0)
    for k in old:
        cache.remove(H, k)
    new = keys(3_000, 4)
    for k in new:
        cache.store(H, k)
    after = deliver(builder, first, 1_000)
    # a receiver that hears the new layout first and the old single shard afterwards
    # (another path, reordered): the old entry must not displace the new streams
    for adv in after:
        late.accept(adv, 1_000)
    shard_advs = [a for a in before if a.cache_summaries is not None]
    assert shard_advs
    for adv in shard_advs:
        outcomes = late.accept(adv, 1_001).outcomes
        assert [o for _, _, o in outcomes] == [Outcome.OLD.value]
    assert ranges(late) == ranges(first)
    assert claimed(late, new) == 3_000 and claimed(late, old) == 0


def rib_doc(routes: list[tuple[str, wire.Advertisement, bool]]) -> dict[str, object]:
    """A receiver's rib.json with these (prefix, advertisement, verified) routes."""
    return {
        "routes": [
            {
                "peer": "10.0.0.1",
                "prefix": prefix,
                "value": wire.encode(adv).hex(),
                "origin": str(adv.origin.address),
                "cs_id": adv.origin.cs_id,
                "verified": ok,
            }
            for prefix, adv, ok in routes
        ]
    }


def test_a_shard_route_withdrawn_or_refused_takes_its_summary_along(tmp_path) -> None:
    builder, cache = instance()
    mine = keys(3_000, 5)  # several shards from the start
    for k in mine:
        cache.store(H, k)
    routes = poll(builder, 0)
    shards = [(p, a) for p, a in routes if a.cache_summaries is not None]
    assert len(shards) > 1
    feed = RibFeed(tmp_path / "rib.json")
    assert feed.apply(rib_doc([(p, a, True) for p, a in routes]), 0)
    assert claimed(feed.rib, mine) == 3_000
    (entry,) = shards[0][1].cache_summaries.entries  # type: ignore[union-attr]
    in_first = [k for k in mine if entry.key_lo <= k <= entry.key_hi]
    assert 0 < len(in_first) < 3_000
    # the first shard's route refused by the receiver (treat-as-withdraw), the rest kept
    doc = rib_doc([(p, a, p != shards[0][0]) for p, a in routes])
    assert feed.apply(doc, 1)
    assert claimed(feed.rib, in_first) == 0
    assert claimed(feed.rib, mine) == 3_000 - len(in_first)
    # and withdrawn outright: the second shard's route is no longer in the file at all
    doc = rib_doc([(p, a, p != shards[0][0]) for p, a in routes if p != shards[1][0]])
    assert feed.apply(doc, 2)
    (entry2,) = shards[1][1].cache_summaries.entries  # type: ignore[union-attr]
    in_second = [k for k in mine if entry2.key_lo <= k <= entry2.key_hi]
    assert claimed(feed.rib, in_second) == 0 and in_second
    assert [str(i.address) for i in feed.rib.services[CS_ID].live()] == ["10.0.0.5"]


def test_without_its_own_host_route_an_origin_is_not_used_and_comes_back_whole(tmp_path) -> None:
    builder, cache = instance()
    mine = keys(3_000, 6)
    for k in mine:
        cache.store(H, k)
    routes = poll(builder, 0)
    main = "10.0.0.5/32"
    assert routes[0][0] == main and len(routes) > 2
    feed = RibFeed(tmp_path / "rib.json")
    # its shard routes first: nothing to steer to yet
    assert feed.apply(rib_doc([(p, a, True) for p, a in routes if p != main]), 0)
    assert CS_ID not in feed.rib.services or not feed.rib.services[CS_ID].live()
    assert feed.apply(rib_doc([(p, a, True) for p, a in routes]), 1)
    assert claimed(feed.rib, mine) == 3_000
    # its own route refused (treat-as-withdraw): the instance is gone ...
    assert feed.apply(rib_doc([(p, a, p != main) for p, a in routes]), 2)
    assert not feed.rib.services[CS_ID].live()
    # ... and back with every summary once that route is good again
    assert feed.apply(rib_doc([(p, a, True) for p, a in routes]), 3)
    assert claimed(feed.rib, mine) == 3_000


@given(
    cuts=st.lists(st.integers(1, 999), unique=True, max_size=12),
    keep=st.lists(st.booleans(), min_size=13, max_size=13),
    lo=st.integers(0, 1_000),
    width=st.integers(0, 400),
)
def test_overlapping_finds_exactly_the_ranges_that_share_a_key(cuts, keep, lo, width) -> None:
    tier = TierState(H, 1, 0, 1)
    edges = [0, *sorted(cuts), 1_000]
    stored = [(a, b - 1) for (a, b), k in zip(itertools.pairwise(edges), keep, strict=False) if k]
    for shard in reversed(stored):  # any insertion order
        tier.add(shard, SummaryReceiver())
    shard = (lo, lo + width)
    brute = {s for s in stored if s != shard and s[0] <= shard[1] and shard[0] <= s[1]}
    assert set(tier.overlapping(shard)) == brute
    if stored:
        tier.drop(stored[0])
        assert tier.ranges == sorted(stored[1:]) and stored[0] not in tier.shards


def test_overlapping_at_a_shared_boundary_key() -> None:
    tier = TierState(H, 1, 0, 1)
    for shard in [(0, 4), (5, 10), (11, 20)]:
        tier.add(shard, SummaryReceiver())
    assert tier.overlapping((5, 5)) == [(5, 10)]
    assert sorted(tier.overlapping((0, 5))) == [(0, 4), (5, 10)]
    assert sorted(tier.overlapping((10, 11))) == [(5, 10), (11, 20)]
    assert tier.overlapping((21, 30)) == [] and tier.overlapping((5, 10)) == []

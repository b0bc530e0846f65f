"""What a receiver believes across an origin's restart, a second path and its own restart.

- A copy of the old epoch that arrives after the new epoch (a late path, a route the
  crashed process left announced) is ignored: the receiver refuses it as replayed (its
  window keeps each origin's highest epoch), and the RIB, fed directly here, ignores it
  too, as it knows the origin's epoch.
- A route that stands via a second peer keeps its summary when the first peer's copy goes.
- A steering daemon that starts late dates each route by when its receiver took it, so
  an origin silent for an hour is not fresh to it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto import wire
from catsproto.adapters.steering import RibFeed
from catsproto.selector import RIB
from catsproto.selector.rib import ServiceTable
from catsproto.summary.versioning import Outcome
from tests.rib_helpers import CS_ID, MAIN, H, claimed, instance, keys, poll


def test_a_late_copy_of_the_old_epoch_is_ignored_after_a_restart() -> None:
    rib = RIB()
    old_builder, old_cache = instance(epoch=1, snapshot_every=1)
    old = keys(40, 1)
    for k in old:
        old_cache.store(H, k)
    for t in range(1, 12):  # the old process runs a while: its shard versions climb
        old_cache.store(H, keys(1, 100 + t)[0])
        for _, adv in poll(old_builder, t * 1_000):
            rib.accept(adv, t * 1_000)
    old_cache.store(H, keys(1, 999)[0])
    late = [a for p, a in poll(old_builder, 12_000) if p != MAIN]  # delayed on its path
    new_builder, new_cache = instance(epoch=2, snapshot_every=1)  # restarted, with an empty cache
    new = keys(30, 2)
    for k in new:
        new_cache.store(H, k)
    fresh = poll(new_builder, 20_000)
    rib.accept(dict(fresh)[MAIN], 20_000)
    for adv in late:
        outcomes = rib.accept(adv, 20_001).outcomes
        assert [o for _, _, o in outcomes] == [Outcome.OLD.value]
    for prefix, adv in fresh:
        if prefix != MAIN:
            rib.accept(adv, 20_002)
    assert claimed(rib, old) == 0 and claimed(rib, new) == 30
    (inst,) = rib.services[CS_ID].live()
    assert inst.epoch_seq[0] == 2 and inst.heard_ms == 20_002


def test_forgetting_an_old_epochs_route_leaves_the_new_epoch_alone() -> None:
    rib = RIB()
    old_builder, old_cache = instance(epoch=1, snapshot_every=1)
    for k in keys(20, 3):
        old_cache.store(H, k)
    before = poll(old_builder, 0)
    new_builder, new_cache = instance(epoch=2, snapshot_every=1)
    held = keys(25, 4)
    for k in held:
        new_cache.store(H, k)
    for _, adv in poll(new_builder, 1_000):
        rib.accept(adv, 1_000)
    for prefix, adv in before:  # a second path's old copy is refused, treated as withdrawn
        if prefix != MAIN:
            assert rib.forget_summaries(adv) == 0
    assert claimed(rib, held) == 25


def rib_doc(routes: list[tuple[str, str, wire.Advertisement, float]]) -> dict[str, object]:
    """rib.json with these (peer, prefix, advertisement, received_at s) routes."""
    return {
        "routes": [
            {
                "peer": peer,
                "prefix": prefix,
                "value": wire.encode(adv).hex(),
                "origin": str(adv.origin.address),
                "cs_id": adv.origin.cs_id,
                "verified": True,
                "received_at": at,
            }
            for peer, prefix, adv, at in routes
        ]
    }


def test_a_route_still_carried_by_another_peer_keeps_its_summary(tmp_path) -> None:
    builder, cache = instance(epoch=1, snapshot_every=1)
    mine = keys(40, 5)
    for k in mine:
        cache.store(H, k)
    routes = poll(builder, 0)
    both = [(peer, p, a, 0.0) for peer in ("192.0.2.1", "192.0.2.2") for p, a in routes]
    feed = RibFeed(tmp_path / "rib.json")
    assert feed.apply(rib_doc(both), 0)
    assert claimed(feed.rib, mine) == 40
    one = [r for r in both if r[0] == "192.0.2.2"]  # the first reflector is down
    assert feed.apply(rib_doc(one), 1)
    assert claimed(feed.rib, mine) == 40
    assert feed.apply(rib_doc([]), 2)  # and the second: the origin is gone
    assert claimed(feed.rib, mine) == 0


def test_a_late_starting_feed_dates_routes_by_when_they_were_received(tmp_path) -> None:
    hour_ms = 3_600_000
    quiet, quiet_cache = instance(epoch=1, snapshot_every=1)
    for k in keys(10, 6):
        quiet_cache.store(H, k)
    routes = [("192.0.2.1", p, a, 0.0) for p, a in poll(quiet, 0)]  # heard an hour ago
    feed = RibFeed(tmp_path / "rib.json")
    assert feed.apply(rib_doc(routes), hour_ms)
    (inst,) = feed.rib.services[CS_ID].instances
    assert inst is not None and inst.heard_ms == 0  # past the hold time: not a candidate
    assert [i.address for i in feed.rib.expire(hour_ms)] == [inst.address]
    # a route received "in the future" of the reader's clock is dated at the read
    quiet_cache.store(H, keys(1, 7)[0])
    ahead = [("192.0.2.1", p, a, (hour_ms + 5_000) / 1000) for p, a in poll(quiet, 1)]
    feed2 = RibFeed(tmp_path / "rib2.json")
    assert feed2.apply(rib_doc(ahead), hour_ms)
    (inst2,) = feed2.rib.services[CS_ID].instances
    assert inst2 is not None and inst2.heard_ms == hour_ms


def test_a_restart_is_seen_after_a_first_advertisement_at_epoch_zero_sequence_zero() -> None:
    """(0, 0) is a real first (epoch, sequence), not "nothing heard yet": a later epoch
    still replaces what was said in it."""
    from tests.selector_fixtures import advert, entry

    rib = RIB()
    first = advert("10.0.1.1", 1, [entry([1, 2, 3], version=7)], seq=0, epoch=0)
    rib.accept(wire.decode(wire.encode(first)), 1_000)
    restarted = advert("10.0.1.1", 1, [entry([42], version=1)], seq=0, epoch=1, ts=2_000)
    outcomes = rib.accept(wire.decode(wire.encode(restarted)), 2_000).outcomes
    assert [o for _, _, o in outcomes] != [Outcome.OLD.value]
    (inst,) = rib.services[7].live()
    assert inst.epoch_seq == (1, 0)
    held = inst.lookup(np.asarray([1, 42], dtype=np.uint64))
    assert held[0] == 0 and held[1] != 0  # the old epoch's key is gone, the new one held


@settings(max_examples=300, deadline=None)
@given(
    start=st.lists(st.integers(0, 50), min_size=12, max_size=12),
    writes=st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 50), st.integers(1, 12)), max_size=60
    ),
)
def test_heard_floor_is_the_minimum_after_any_writes(start, writes) -> None:
    """The remembered oldest heard time of the first n slots equals the minimum taken
    afresh after every write, whatever the order of writes (times that go back too)."""
    table = ServiceTable(7, capacity=12)
    table.heard_ms[:12] = start
    for slot, ms, n in writes:
        table.heard(slot, ms)
        assert table.heard_floor(n) == int(table.heard_ms[:n].min())

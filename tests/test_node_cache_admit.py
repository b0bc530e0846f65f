"""`TieredCache.admit` (primitives inlined, events merged as they happen) against the
plain block-by-block version it replaced: same hits, events, LRU orders, pending
changes, depths and hit counts on random workloads over one to four tiers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.node.cache import BlockEvent, BlockEventKind, PrefixHit, TieredCache, TierSpec
from catsproto.wire import Tier


class PlainCache(TieredCache):
    """The straightforward admit: one event per block through the public primitives,
    merged afterwards."""

    def admit(self, keys: Sequence[int]) -> tuple[PrefixHit, list[BlockEvent]]:
        if self.specs[self.order[0]].capacity_blocks < 1:
            raise ValueError("the top tier needs room for at least one block to admit")
        hit = self.lookup(keys)
        for k in keys[: hit.depth]:
            self.hits[k] = self.hits.get(k, 0) + 1
        events: list[BlockEvent] = []
        top = self.order[0]
        parent_depth = 0
        for k in keys:
            self.depth.setdefault(k, parent_depth + 1)
            parent_depth = self.depth[k]
            where = self.tier_of(k)
            if where == top:
                self._touch(top, k)
                continue
            if where is not None:
                self._discard(where, k)
                events.append(BlockEvent(BlockEventKind.MOVED, where, (k,), top))
            else:
                events.append(BlockEvent(BlockEventKind.STORED, top, (k,)))
            self._plain_make_room(top, events)
            self._insert(top, k)
        for k in reversed(keys):
            if k in self._lru[top]:
                self._touch(top, k)
        return hit, merged(events)

    def _plain_make_room(self, tier: Tier, events: list[BlockEvent]) -> None:
        capacity = self.specs[tier].capacity_blocks
        lru = self._lru[tier]
        while lru and len(lru) >= capacity:
            victim = next(iter(lru))
            self._discard(tier, victim)
            i = self.order.index(tier)
            below = self.order[i + 1] if i + 1 < len(self.order) else None
            if below is not None and self.specs[below].capacity_blocks > 0:
                self._plain_make_room(below, events)
                self._insert(below, victim)
                events.append(BlockEvent(BlockEventKind.MOVED, tier, (victim,), below))
            else:
                events.append(BlockEvent(BlockEventKind.REMOVED, tier, (victim,)))


def merged(events: list[BlockEvent]) -> list[BlockEvent]:
    out: list[BlockEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if last and (last.kind, last.tier, last.to_tier) == (ev.kind, ev.tier, ev.to_tier):
            out[-1] = BlockEvent(ev.kind, ev.tier, last.keys + ev.keys, ev.to_tier)
        else:
            out.append(ev)
    return out


def state(cache: TieredCache) -> tuple:
    return (
        {t: cache.lru_keys(t) for t in cache.order},
        {t: cache.changes(t) for t in cache.order},
        dict(cache.depth),
        dict(cache.hits),
    )


TIERS = [Tier.HBM, Tier.DRAM, Tier.SSD, Tier.REMOTE]
prompts = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(
    capacities=st.lists(st.integers(0, 9), min_size=1, max_size=4).map(
        lambda c: [max(1, c[0]), *c[1:]]
    ),
    workload=prompts,
    mark_every=st.integers(1, 5),
)
def test_admit_equals_the_plain_version(
    capacities: list[int], workload: list[list[int]], mark_every: int
) -> None:
    specs = [TierSpec(TIERS[i], c, 10 * i, 1000) for i, c in enumerate(capacities)]
    fast, plain = TieredCache(specs), PlainCache(specs)
    for n, prompt in enumerate(workload):
        # chained keys rarely repeat inside a prompt, but the model must not care
        assert fast.admit(prompt) == plain.admit(prompt)
        assert state(fast) == state(plain)
        if n % mark_every == 0:
            fast.mark_advertised()
            plain.mark_advertised()
        assert [fast.lookup(p) for p in workload[:3]] == [plain.lookup(p) for p in workload[:3]]


def test_demotion_chain_events_are_merged_in_order() -> None:
    specs = [TierSpec(Tier.HBM, 2, 0, 1), TierSpec(Tier.DRAM, 2, 5, 1)]
    fast, plain = TieredCache(specs), PlainCache(specs)
    for prompt in ([1, 2], [3, 4], [5, 6, 7], [1, 2, 3]):
        hit, events = fast.admit(prompt)
        assert (hit, events) == plain.admit(prompt)
    kinds = [e.kind for e in events]
    assert BlockEventKind.MOVED in kinds and BlockEventKind.REMOVED in kinds


def test_a_top_tier_without_room_is_refused() -> None:
    cache = TieredCache([TierSpec(Tier.HBM, 0, 0, 1), TierSpec(Tier.DRAM, 4, 5, 1)])
    with pytest.raises(ValueError, match="room for at least one block"):
        cache.admit([1])
    assert cache.count(Tier.HBM) == cache.count(Tier.DRAM) == 0

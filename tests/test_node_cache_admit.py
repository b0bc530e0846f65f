"""`TieredCache.admit` (primitives inlined, events merged as they happen) against the
plain block-by-block version it replaced: same hits, events, LRU orders, pending
changes, depths and hit counts on random workloads over one to four tiers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.build import reference_admit
from catsproto.node.cache import BlockEventKind, TieredCache, TierSpec
from catsproto.wire import Tier


class PlainCache(TieredCache):
    """The straightforward admit the benchmark also times: one event per block through
    the public primitives, merged afterwards (`benchmarks/build.py`)."""

    admit = reference_admit


def state(cache: TieredCache) -> tuple:
    return (
        {t: cache.lru_keys(t) for t in cache.order},
        {t: cache.changes(t) for t in cache.order},
        dict(cache.depth),
        dict(cache.hits),
    )


TIERS = [Tier.HBM, Tier.DRAM, Tier.SSD, Tier.REMOTE]
prompts = st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=40)


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

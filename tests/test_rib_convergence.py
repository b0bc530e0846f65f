"""Whatever BGP does to the order of an origin's routes, the RIB ends up believing the truth.

A property over random histories: an instance's cache grows and shrinks (so its sender
doubles the shard count on the way), each poll's routes reach the receiver in any order
across routes, and each route's own announcements in order but with any of them lost
(a transit passes on only the latest per prefix). After the last announcement of every
route has arrived, the RIB must claim exactly the keys the instance holds: with exact
summaries there are no false positives to excuse a wrong claim.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto import wire
from catsproto.node import AdvertisementBuilder, ComputeState, TieredCache
from catsproto.selector import RIB
from tests.rib_helpers import CS_ID, H, instance

# one step of the history: add this many new keys, then remove this share of all
steps = st.lists(
    st.tuples(st.integers(0, 1_200), st.sampled_from([0.0, 0.1, 0.5, 0.9])),
    min_size=2,
    max_size=6,
)


def setup(snapshot_every: int) -> tuple[AdvertisementBuilder, TieredCache]:
    # room for 1,024 shard routes per tier and no eviction: the history decides what goes
    return instance(snapshot_every=snapshot_every, shard_range="10.255.0.0/20", capacity=10**6)


def history(
    builder: AdvertisementBuilder, cache: TieredCache, plan: list[tuple[int, float]], seed: int
) -> tuple[dict[str, list[wire.Advertisement]], list[int]]:
    """Run the plan: per route (prefix), its announcements in the order sent; and every
    key the instance ever held."""
    rng = np.random.default_rng(seed)
    held: list[int] = []
    ever: list[int] = []
    per_route: dict[str, list[wire.Advertisement]] = {}
    for step, (add, share) in enumerate(plan):
        for k in rng.integers(1, 2**64 - 1, add, dtype=np.uint64).tolist():
            cache.store(H, int(k))
            held.append(int(k))
            ever.append(int(k))
        gone = set(rng.permutation(len(held))[: int(share * len(held))].tolist())
        for j in sorted(gone):
            cache.remove(H, held[j])
        held = [k for j, k in enumerate(held) if j not in gone]
        for r in builder.poll(1_000 * (step + 1), ComputeState()):
            adv = wire.decode(wire.encode(r.advertisement))
            per_route.setdefault(str(r.prefix), []).append(adv)
    return per_route, ever


def deliver(
    rib: RIB, per_route: dict[str, list[wire.Advertisement]], seed: int, lossy: bool
) -> None:
    """Interleave the routes at random; per route keep the order, and (lossy) drop any
    announcement but the last."""
    rng = np.random.default_rng(seed)
    queues = {}
    for prefix, advs in per_route.items():
        keep = [a for a in advs[:-1] if not lossy or rng.random() < 0.5] + [advs[-1]]
        queues[prefix] = keep
    now = 0
    while queues:
        prefix = sorted(queues)[int(rng.integers(len(queues)))]
        rib.accept(queues[prefix].pop(0), now)
        now += 1
        if not queues[prefix]:
            del queues[prefix]


def believed(rib: RIB, candidates: list[int]) -> set[int]:
    (inst,) = rib.services[CS_ID].live()
    ks = np.array(candidates, dtype=np.uint64)
    return {k for k, hit in zip(candidates, inst.lookup(ks) > 0, strict=True) if hit}


def truth(cache: TieredCache) -> set[int]:
    return set(cache.lru_keys(H))


@settings(max_examples=25, deadline=None)
@given(plan=steps, seed=st.integers(0, 2**32 - 1))
def test_snapshots_with_losses_and_reordering_converge_to_the_truth(plan, seed) -> None:
    builder, cache = setup(snapshot_every=1)  # every value stands alone, as in the lab
    per_route, ever = history(builder, cache, plan, seed)
    rib = RIB()
    deliver(rib, per_route, seed + 1, lossy=True)
    assert believed(rib, ever) == truth(cache)


@settings(max_examples=25, deadline=None)
@given(plan=steps, seed=st.integers(0, 2**32 - 1))
def test_deltas_reordered_across_routes_converge_to_the_truth(plan, seed) -> None:
    builder, cache = setup(snapshot_every=8)  # deltas: each route's order must hold
    per_route, ever = history(builder, cache, plan, seed)
    rib = RIB()
    deliver(rib, per_route, seed + 1, lossy=False)
    assert believed(rib, ever) == truth(cache)

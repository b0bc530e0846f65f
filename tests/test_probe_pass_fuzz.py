"""The compiled probe pass fuzzed against each filter's own answers.

The pass (`selector/probe_pass.py`) reads slot values at positions it computes from a
row's parameters, without bounds checks: the parameters come from peers' advertisements
(decoded and checked by the codec, then copied into the fleet's rows). Here a peer's
filters are anything the codec accepts: random geometry (arity 3 or 4, segment sizes
from 1 slot up, as few segments as the arity allows), alphabets from 2 to above a byte
(those rows are handed back to Python), any packing, any seed, random slot values (not a
filter built from keys: its answers are noise, and must still be the same noise), and
shard ranges anywhere in the key space. Every instance's routes go through the wire
encoding and the RIB as a receiver takes them; the pass must then answer every key,
duplicates and range edges included, exactly as each instance's `lookup` does, with and
without its prefetches, through `held` and `hits`.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catsproto.selector import RIB
from catsproto.selector.fleet import FleetProbe
from catsproto.summary.fuse import MAX_GROUP, FuseSummary
from tests.test_selector_fleet import announce, reference, shard_entry

U64 = (1 << 64) - 1


@st.composite
def fuse_filters(draw: st.DrawFn) -> FuseSummary:
    arity = draw(st.sampled_from([3, 4]))
    seg_log2 = draw(st.integers(0, 6))
    segments = draw(st.integers(arity, arity + 10))
    m = draw(st.sampled_from([2, 3, 7, 107, 255, 256, 257, 65_537, (1 << 32) - 1]))
    g = draw(st.integers(1, MAX_GROUP))
    bits = (m**g - 1).bit_length()  # the fewest that hold g digits
    if bits > 64:
        g, bits = 1, (m - 1).bit_length()
    b = draw(st.integers(max(1, bits), 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    slots = segments << seg_log2
    fill = draw(st.sampled_from(["random", "zero", "top"]))
    if fill == "random":
        table = rng.integers(0, m, size=slots, dtype=np.uint64)
    else:
        table = np.full(slots, 0 if fill == "zero" else m - 1, dtype=np.uint64)
    seed = draw(st.integers(0, U64))
    return FuseSummary(
        table.astype(np.uint32), arity=arity, seg_log2=seg_log2, segments=segments, m=m,
        g=g, b=b, seed=seed,
    )  # fmt: skip


@st.composite
def shard_ranges(draw: st.DrawFn) -> list[tuple[int, int]]:
    """One to three disjoint ranges, in order: the whole key space, or cut anywhere."""
    cuts = sorted(draw(st.lists(st.integers(1, U64), min_size=0, max_size=2, unique=True)))
    edges = [0, *cuts, U64 + 1]
    return [(edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1)]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
@given(
    fleet=st.lists(
        shard_ranges().flatmap(
            lambda ranges: st.tuples(
                st.just(ranges),
                st.lists(fuse_filters(), min_size=len(ranges), max_size=len(ranges)),
            )
        ),
        min_size=1,
        max_size=4,
    ),
    asked=st.lists(st.integers(0, U64), min_size=1, max_size=40),
    key_seed=st.integers(0, 2**32 - 1),
)
def test_the_pass_answers_as_every_filter_does(
    fleet: list[tuple[list[tuple[int, int]], list[FuseSummary]]],
    asked: list[int],
    key_seed: int,
) -> None:
    rib = RIB(hold_time_ms=10**9)
    edges = []
    for i, (ranges, filters) in enumerate(fleet):
        entries = [
            shard_entry(f, lo, hi, count=1) for (lo, hi), f in zip(ranges, filters, strict=True)
        ]
        announce(rib, i, entries)
        for lo, hi in ranges:  # the range edges and their neighbours: the bisection's cases
            edges += [x for x in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1) if 0 <= x <= U64]
    rng = np.random.default_rng(key_seed)
    keys = np.array(
        [*asked, *asked[:5], *edges, *rng.integers(0, U64, size=200, dtype=np.uint64).tolist()],
        dtype=np.uint64,
    )
    assert len(rib.services[7].live()) == len(fleet)  # the RIB took every instance
    expect = reference(rib, keys)
    probe = FleetProbe(rib.services[7])
    for prefetch in (True, False):
        probe.prefetch = prefetch
        assert probe.held(keys) == expect
        assert [probe.held(keys[i : i + 1])[0] for i in range(0, len(keys), 37)] == expect[::37]
        slots = np.array([*reversed(range(len(fleet))), len(fleet) + 3])  # one unknown
        hit = probe.hits(keys, slots)
        for c, s in enumerate(slots.tolist()):
            assert hit[:, c].tolist() == [bool(m >> s & 1) for m in expect]
    # the compiled loop answered the byte-sized alphabets (the others were handed back)
    if any(f.m <= 256 for _, filters in fleet for f in filters):
        assert probe.pairs > 0

"""The compiled fuse construction (`fuse_peel`) against the numpy rounds it replaces.

Equal tables, not just valid ones: the slot values go on the wire, and the draft's
vectors and every simulation result depend on them byte for byte.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.summary import FuseSummary
from catsproto.summary.fuse import (
    _fingerprints,
    _hashes,
    _slots,
    choose_packing,
    fuse_geometry,
    solve_reference,
)
from catsproto.summary.fuse_peel import peel_and_assign

U64 = 2**64 - 1


def both(
    keys: np.ndarray, seed: int, arity: int, m: int, shrink: int = 0
) -> tuple[np.ndarray | None, np.ndarray | None]:
    seg_log2, segments = fuse_geometry(int(keys.size), arity)
    segments = max(arity, segments - shrink)
    args = (keys, seed, arity, seg_log2, segments, m)
    return FuseSummary._solve(*args), solve_reference(*args)


def assert_same(got: np.ndarray | None, want: np.ndarray | None) -> None:
    assert (got is None) == (want is None)
    if want is not None:
        assert got is not None and got.dtype == want.dtype
        assert np.array_equal(got, want)


@pytest.mark.parametrize("arity", [3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 9, 50, 300, 1000, 4000, 60_000])
def test_tables_equal_the_reference(arity: int, n: int) -> None:
    rng = np.random.default_rng(n * 10 + arity)
    for trial in range(6 if n < 10_000 else 1):
        keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64))
        seed = int(rng.integers(0, 2**63))
        got, want = both(keys, seed, arity, 107)
        assert_same(got, want)
        if n and trial == 0:
            assert want is not None  # the first geometry usually peels: a real comparison


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.integers(0, U64), min_size=1, max_size=200, unique=True),
    seed=st.integers(0, U64),
    arity=st.sampled_from([3, 4]),
    m=st.sampled_from([2, 107, 1 << 20, (1 << 32) - 1]),
    shrink=st.integers(0, 3),
)
def test_random_sets_seeds_and_tight_tables(
    keys: list[int], seed: int, arity: int, m: int, shrink: int
) -> None:
    """Tables made too small stall the peeling: both must then give up alike."""
    arr = np.unique(np.array(keys, dtype=np.uint64))
    got, want = both(arr, seed, arity, m, shrink)
    assert_same(got, want)


def test_stalls_are_reported_alike() -> None:
    rng = np.random.default_rng(5)
    outcomes = set()
    for trial in range(40):
        keys = np.unique(rng.integers(0, 2**64, 400, dtype=np.uint64))
        got, want = both(keys, trial, 4, 107, shrink=int(trial % 4) + 1)
        assert_same(got, want)
        outcomes.add(want is None)
    assert outcomes == {True, False}  # both stalls and successes were compared


def test_built_filters_hold_every_key_and_match_the_reference_build() -> None:
    rng = np.random.default_rng(11)
    keys = np.unique(rng.integers(0, 2**64, 2500, dtype=np.uint64))
    fuse = FuseSummary.from_keys(keys, 0.01, seed=3)
    assert fuse.contains_many(keys).all()
    m = choose_packing(0.01)
    assert m is not None
    table = solve_reference(keys, fuse.seed, fuse.arity, fuse.seg_log2, fuse.segments, m[0])
    assert table is not None and np.array_equal(table, fuse.table_values())


def test_kernel_signature_is_fixed() -> None:
    keys = np.arange(10, dtype=np.uint64)
    h, h2 = _hashes(keys, 0)
    slots = _slots(h, h2, 4, 2, 8).astype(np.int64)
    fp = _fingerprints(h, 107).astype(np.int64)
    with pytest.raises(TypeError):
        peel_and_assign(slots.astype(np.int32), fp, 107, np.zeros(32, dtype=np.int64))
    table = np.zeros(32, dtype=np.int64)
    ok = peel_and_assign(slots, fp, 107, table)
    want = solve_reference(keys, 0, 4, 2, 8, 107)
    assert ok == (want is not None)
    if ok:
        assert np.array_equal(table.astype(np.uint32), want)

"""Shortcuts on the sender's path give what the general operations give.

`unique_keys` skips the sort for sorted input, `sorted_difference` replaces
`np.setdiff1d`, and deltas and filters count their size without encoding: each is
checked against the operation it stands for, on edge cases and random sets.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.summary import (
    KIND_DELTA,
    KIND_EXACT,
    KIND_FUSE,
    DeltaSummary,
    ExactSummary,
    Summary,
    SummaryDecodeError,
)
from catsproto.summary.base import sorted_difference, unique_keys
from catsproto.summary.delta import apply_delta
from catsproto.summary.shard import shard_range, split_keys

U64 = 2**64 - 1
key_lists = st.lists(st.integers(0, U64), max_size=300)


@pytest.mark.parametrize(
    "keys", [[], [7], [0, U64], [U64, 0], [3, 3], [1, 2, 2, 3], [5, 4, 3], list(range(40))]
)
def test_unique_keys_edges(keys: list[int]) -> None:
    got = unique_keys(np.array(keys, dtype=np.uint64))
    assert got.dtype == np.uint64
    assert [int(k) for k in got] == sorted(set(keys))


@settings(max_examples=120, deadline=None)
@given(keys=key_lists, presort=st.booleans())
def test_unique_keys_equals_np_unique_and_never_aliases(keys: list[int], presort: bool) -> None:
    arr = np.array(sorted(set(keys)) if presort else keys, dtype=np.uint64)
    got = unique_keys(arr)
    assert np.array_equal(got, np.unique(arr)) and got.dtype == np.uint64
    assert not np.shares_memory(got, arr)  # summaries freeze what they are given
    assert np.array_equal(unique_keys(keys), np.unique(arr))


@settings(max_examples=120, deadline=None)
@given(a=key_lists, b=key_lists)
def test_sorted_difference_equals_setdiff1d(a: list[int], b: list[int]) -> None:
    x, y = unique_keys(a), unique_keys(b + a[: len(a) // 2])
    for p, q in ((x, y), (y, x), (x, x), (x, y[:0])):
        got = sorted_difference(p, q)
        assert np.array_equal(got, np.setdiff1d(p, q, assume_unique=True))
        assert got.dtype == np.uint64


@settings(max_examples=100, deadline=None)
@given(old=key_lists, new=key_lists)
def test_delta_size_counts_its_bytes_without_encoding(old: list[int], new: list[int]) -> None:
    delta = DeltaSummary.between(old, new)
    size = delta.size()  # before any encode
    assert size == len(delta.encode()) == len(delta.params()) + len(delta.encode())
    assert size == DeltaSummary.size_between(unique_keys(old), unique_keys(new))
    assert delta.same_bytes(DeltaSummary(delta.added, delta.removed))
    decoded = Summary.decode(KIND_DELTA, b"", delta.encode())
    assert isinstance(decoded, DeltaSummary) and decoded.size() == size
    assert np.array_equal(decoded.added, delta.added)
    assert np.array_equal(decoded.removed, delta.removed)
    base = ExactSummary(old)
    after = apply_delta(base, delta)
    assert isinstance(after, ExactSummary) and np.array_equal(after.keys, unique_keys(new))


def test_a_decoded_delta_still_refuses_a_key_added_and_removed() -> None:
    body = DeltaSummary([1, 2], []).encode()[:-4] + DeltaSummary([2], []).encode()[:-4]
    with pytest.raises(SummaryDecodeError, match="same key"):
        Summary.decode(KIND_DELTA, b"", body)
    with pytest.raises(ValueError, match="both added and removed"):
        DeltaSummary([1, 2], [2])


@settings(max_examples=40, deadline=None)
@given(keys=key_lists, target=st.sampled_from([0.01, 0.2, 1e-4]))
def test_snapshot_sizes_equal_their_encoded_bytes(keys: list[int], target: float) -> None:
    for kind in (KIND_EXACT, KIND_FUSE):
        s = Summary.build(keys, target, kind=kind, seed=1)
        size = s.size()  # before any encode
        assert size == len(s.params()) + len(s.encode())
        again = Summary.decode(kind, s.params(), s.encode())
        assert again.size() == size


@pytest.mark.parametrize("shard_bits", [0, 1, 3, 8, 16])
def test_split_keys_cuts_where_np_split_cuts(shard_bits: int) -> None:
    rng = np.random.default_rng(shard_bits)
    for n in (0, 1, 7, 3000):
        keys = np.unique(rng.integers(0, 2**64, n, dtype=np.uint64))
        if n > 2:
            keys[0], keys[-1] = 0, U64
        lows = [shard_range(i, shard_bits)[0] for i in range(1, 1 << shard_bits)]
        want = np.split(keys, np.searchsorted(keys, lows))
        got = split_keys(keys, shard_bits)
        assert len(got) == len(want) == 1 << shard_bits
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b) and a.dtype == b.dtype
    with pytest.raises(ValueError, match="shard_bits"):
        split_keys(np.zeros(0, dtype=np.uint64), 17)

"""Deltas and versions: in-order deltas equal a snapshot; wrong bases are refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import catsproto.wire as wire
from catsproto.summary import (
    KIND_BLOOM,
    KIND_DELTA,
    KIND_EXACT,
    KIND_FUSE,
    DeltaSummary,
    ExactSummary,
    LayeredView,
    Outcome,
    Summary,
    SummaryDecodeError,
    SummaryReceiver,
    SummarySender,
    apply_delta,
)

U64 = 2**64 - 1
key_sets = st.lists(st.sets(st.integers(0, U64), max_size=60), min_size=1, max_size=8)


def arr(keys: set[int] | list[int]) -> np.ndarray:
    return np.array(sorted(keys), dtype=np.uint64)


@settings(max_examples=60, deadline=None)
@given(sets=key_sets)
def test_deltas_in_order_equal_a_fresh_snapshot(sets: list[set[int]]) -> None:
    state: Summary = ExactSummary(sets[0])
    for old, new in itertools.pairwise(sets):
        delta = DeltaSummary.between(arr(old), arr(new))
        wire_delta = Summary.decode(KIND_DELTA, delta.params(), delta.encode())
        assert isinstance(wire_delta, DeltaSummary)
        state = apply_delta(state, wire_delta)  # type: ignore[assignment]
        assert isinstance(state, ExactSummary)
        assert state.same_bytes(ExactSummary(new))


@pytest.mark.parametrize("kind", [KIND_BLOOM, KIND_FUSE])
@settings(max_examples=25, deadline=None)
@given(sets=key_sets, seed=st.integers(0, U64))
def test_deltas_on_a_filter_never_lose_a_member(kind: int, sets: list[set[int]], seed: int) -> None:
    base = Summary.build(arr(sets[0]), 0.01, kind=kind, seed=seed)
    state: Summary | LayeredView = base
    removed_ever: set[int] = set()
    for old, new in itertools.pairwise(sets):
        state = apply_delta(state, DeltaSummary.between(arr(old), arr(new)))
        removed_ever |= old - new
        gone = arr(removed_ever - new)
        assert state.contains_many(arr(new)).all()
        assert not state.contains_many(gone).any()


def test_delta_body_is_canonical() -> None:
    d = DeltaSummary([1, 5, 9], [2, 3])
    body = d.encode()
    back = Summary.decode(KIND_DELTA, b"", body)
    assert back.same_bytes(d)
    assert 5 in back and 2 not in back
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_DELTA, b"", body + b"\x00")
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_DELTA, b"\x01", body)
    for cut in range(len(body)):
        with pytest.raises(SummaryDecodeError):
            Summary.decode(KIND_DELTA, b"", body[:cut])
    overlapping = ExactSummary([1, 2]).encode() + ExactSummary([2]).encode()
    with pytest.raises(SummaryDecodeError, match="same key"):
        Summary.decode(KIND_DELTA, b"", overlapping)
    with pytest.raises(ValueError):
        DeltaSummary([1], [1])
    with pytest.raises(ValueError):
        apply_delta(d, d)


def run(sender_sets: list[set[int]], **kw: object) -> list:
    sender = SummarySender(0.01, **kw)  # type: ignore[arg-type]
    return [sender.update(arr(s)) for s in sender_sets]


@settings(max_examples=40, deadline=None)
@given(sets=key_sets, every=st.integers(1, 4), chain=st.booleans(), kind=st.sampled_from([None, 1]))
def test_sender_receiver_in_order(
    sets: list[set[int]], every: int, chain: bool, kind: int | None
) -> None:
    sender = SummarySender(0.01, kind=kind, snapshot_every=every, chain=chain)
    receiver = SummaryReceiver()
    since_snapshot = 0
    last_version = 0
    for keys in sets:
        update = sender.update(arr(keys))
        if update is None:
            continue
        assert update.version > last_version
        last_version = update.version
        since_snapshot = since_snapshot + 1 if update.is_delta else 0
        assert since_snapshot < every
        entry = wire.SummaryEntry(
            tier=wire.Tier.DRAM,
            kind=wire.SummaryKind(update.kind),
            version=update.version,
            base_version=update.base_version,
            key_lo=0,
            key_hi=U64,
            entry_count=update.entry_count,
            bytes_per_block=1,
            fetch_latency_us=1,
            fetch_bandwidth_mbps=1,
            params=update.params(),
            body=update.encode(),
        )
        outcome = receiver.apply_entry(entry)
        assert outcome in (Outcome.SNAPSHOT, Outcome.DELTA)
        assert not receiver.stale and receiver.version == update.version
        assert receiver.contains_many(arr(keys)).all()
        if kind == KIND_EXACT:
            state = receiver.state
            assert isinstance(state, ExactSummary) and state.same_bytes(ExactSummary(keys))


def test_unchanged_keys_make_no_update_and_sender_picks_smaller() -> None:
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64, 20_000, dtype=np.uint64)
    sender = SummarySender(0.01, snapshot_every=4)
    first = sender.update(keys)
    assert first is not None and not first.is_delta and first.kind == KIND_FUSE
    assert sender.update(keys) is None
    small = sender.update(keys[10:])
    assert small is not None and small.is_delta and small.base_version == first.version
    # replacing most keys: the delta would be larger than a snapshot
    big = sender.update(rng.integers(0, 2**64, 20_000, dtype=np.uint64))
    assert big is not None and not big.is_delta


def test_snapshot_at_least_every_n() -> None:
    sets = [set(range(i, i + 50)) for i in range(10)]
    updates = run(sets, snapshot_every=3, kind=KIND_EXACT)
    assert [u.is_delta for u in updates] == [False, True, True] * 3 + [False]
    # cumulative deltas name the snapshot as base; chained ones the previous version
    assert [u.base_version for u in updates[:3]] == [0, 1, 1]
    chained = run(sets, snapshot_every=3, kind=KIND_EXACT, chain=True)
    assert [u.base_version for u in chained[:3]] == [0, 1, 2]


def test_delta_on_wrong_base_is_refused_and_state_kept_stale() -> None:
    sets = [set(range(i, i + 50)) for i in range(6)]
    u = run(sets, snapshot_every=10, kind=KIND_EXACT, chain=True)
    r = SummaryReceiver()
    assert r.apply(u[0].version, 0, u[0].summary) is Outcome.SNAPSHOT
    assert r.apply(u[1].version, u[1].base_version, u[1].summary) is Outcome.DELTA
    # u[2] lost: u[3] is on base 3, which this receiver never held
    assert r.apply(u[3].version, u[3].base_version, u[3].summary) is Outcome.STALE
    assert r.stale and r.version == u[1].version
    assert r.contains_many(arr(sets[1])).all()  # last good state still answers
    assert r.apply(u[1].version, u[1].base_version, u[1].summary) is Outcome.OLD
    assert r.apply(u[4].version, u[4].base_version, u[4].summary) is Outcome.STALE
    snap = ExactSummary(sets[5])
    assert r.apply(u[5].version + 1, 0, snap) is Outcome.SNAPSHOT
    assert not r.stale


def test_cumulative_deltas_survive_lost_updates() -> None:
    sets = [set(range(i, i + 50)) for i in range(6)]
    u = run(sets, snapshot_every=10, kind=KIND_EXACT)
    r = SummaryReceiver()
    r.apply(u[0].version, 0, u[0].summary)
    for i in (2, 5):  # only some updates arrive
        assert r.apply(u[i].version, u[i].base_version, u[i].summary) is Outcome.DELTA
        assert r.state is not None and r.state.same_bytes(ExactSummary(sets[i]))  # type: ignore[union-attr]


def test_receiver_refuses_kind_and_base_mismatch() -> None:
    r = SummaryReceiver()
    assert not r.contains_many(np.array([1], dtype=np.uint64)).any()
    with pytest.raises(SummaryDecodeError):
        r.apply(2, 1, ExactSummary([1]))
    with pytest.raises(SummaryDecodeError):
        r.apply(2, 0, DeltaSummary([1], []))
    with pytest.raises(SummaryDecodeError):
        r.apply(2, 2, DeltaSummary([1], []))
    assert r.apply(2, 1, DeltaSummary([1], [])) is Outcome.STALE  # nothing held yet


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, U64), max_size=40), st.lists(st.integers(0, U64), max_size=40))
def test_in_sorted_answers_as_a_set_test(members: set[int], asked: list[int]) -> None:
    """The binary-search membership the deltas and the selector's corrected rows use
    agrees with a plain set test, for empty sets, absent keys and keys past the end."""
    from catsproto.summary.base import in_sorted

    sorted_keys = np.array(sorted(members), dtype=np.uint64)
    keys = np.array([*asked, U64, 0], dtype=np.uint64)
    got = in_sorted(sorted_keys, keys)
    assert got.tolist() == [int(k) in members for k in keys.tolist()]

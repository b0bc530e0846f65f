"""Sharding: budgets from message sizes, shards that fit, one route per shard."""

from __future__ import annotations

import ipaddress
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import catsproto.wire as wire
from catsproto.summary import (
    ENTRY_OVERHEAD,
    KIND_EXACT,
    Outcome,
    ShardedSender,
    Summary,
    SummaryReceiver,
    attribute_value_budget,
    build_shards,
    entry_budget,
    shard_of,
    shard_prefix,
    shard_range,
)


def keys_of(n: int, seed: int) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**64, n, dtype=np.uint64))


def test_budget_matches_lab_measurements() -> None:
    assert attribute_value_budget(4096) == 4044  # one IPv4 /32 over eBGP (LAB-NOTES)
    assert attribute_value_budget(65535) == 65483
    assert attribute_value_budget(65535, as_path_hops=2) == 65479  # lab: ~65478 via FRR
    assert attribute_value_budget(4096, ipv6=True) == 4096 - 23 - 4 - 9 - 41 - 4
    assert attribute_value_budget(4096, extra_attribute_bytes=7) == 4037
    assert entry_budget(4096, 300) == 3744
    with pytest.raises(ValueError):
        entry_budget(4096, 4000)


def test_entry_overhead_matches_the_wire_encoding() -> None:
    s = Summary.build(keys_of(500, 1), 0.01)
    entry = wire.SummaryEntry(
        tier=wire.Tier.HBM,
        kind=wire.SummaryKind(s.kind),
        version=1,
        base_version=0,
        key_lo=0,
        key_hi=2**64 - 1,
        entry_count=500,
        bytes_per_block=1 << 20,
        fetch_latency_us=5,
        fetch_bandwidth_mbps=100_000,
        params=s.params(),
        body=s.encode(),
    )
    w = wire.Writer()
    wire.CacheSummaries(entries=(entry,)).encode_tlv(w)
    assert len(w.getvalue()) == ENTRY_OVERHEAD + s.size()


def test_shard_ranges_tile_the_key_space() -> None:
    for bits in range(0, 5):
        ranges = [shard_range(i, bits) for i in range(1 << bits)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 2**64 - 1
        for (_, hi), (lo, _) in itertools.pairwise(ranges):
            assert lo == hi + 1
    keys = keys_of(1000, 2)
    idx = shard_of(keys, 3)
    for k, i in zip(keys, idx, strict=True):
        lo, hi = shard_range(int(i), 3)
        assert lo <= int(k) <= hi
    with pytest.raises(ValueError):
        shard_range(4, 2)


@pytest.mark.parametrize(("message", "other"), [(4096, 400), (65535, 400)])
def test_shards_fit_the_budget_and_cover_every_key(message: int, other: int) -> None:
    keys = keys_of(120_000, 3)
    budget = entry_budget(message, other)
    shards = build_shards(keys, budget, 0.01)
    assert all(s.tlv_bytes <= budget for s in shards)
    assert sum(s.entry_count for s in shards) == keys.size
    bits = shards[0].shard_bits
    assert len(shards) == 1 << bits
    if bits:  # one fewer bit would not have fit (the count is minimal, up to estimates)
        assert (
            sum(s.tlv_bytes - ENTRY_OVERHEAD for s in shards)
            > (budget - ENTRY_OVERHEAD) * (len(shards) // 2) * 0.9
        )
    for s in shards:
        mine = keys[shard_of(keys, bits) == s.index]
        assert s.summary.contains_many(mine).all()
        decoded = Summary.decode(s.summary.kind, s.summary.params(), s.summary.encode())
        assert decoded.same_bytes(s.summary)


def test_small_sets_need_one_shard() -> None:
    shards = build_shards(keys_of(100, 4), entry_budget(4096, 200), 0.01)
    assert len(shards) == 1 and (shards[0].key_lo, shards[0].key_hi) == (0, 2**64 - 1)
    with pytest.raises(ValueError):
        build_shards(keys_of(100, 4), ENTRY_OVERHEAD, 0.01)


def test_shard_prefixes_are_host_routes_inside_the_instance_range() -> None:
    assert shard_prefix("10.255.7.0/24", 0) == ipaddress.ip_network("10.255.7.0/32")
    assert shard_prefix("10.255.7.0/24", 255) == ipaddress.ip_network("10.255.7.255/32")
    assert shard_prefix("2001:db8:0:7::/64", 3) == ipaddress.ip_network("2001:db8:0:7::3/128")
    with pytest.raises(ValueError):
        shard_prefix("10.255.7.0/24", 256)
    prefixes = {shard_prefix("10.255.7.0/24", i) for i in range(16)}
    assert len(prefixes) == 16


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32), churn=st.integers(1, 40))
def test_sharded_sender_touches_only_changed_shards(seed: int, churn: int) -> None:
    keys = keys_of(20_000, seed)
    budget = entry_budget(4096, 300)
    sender = ShardedSender(budget, 0.01, snapshot_every=4)
    first = sender.update(keys)
    bits = sender.shard_bits
    assert bits >= 1 and len(first) == 1 << bits
    receivers = {u.index: SummaryReceiver() for u in first}
    for u in first:
        assert u.tlv_bytes <= budget and not u.update.is_delta
        receivers[u.index].apply(u.update.version, 0, u.update.summary)
    rng = np.random.default_rng(seed + 1)
    removed = rng.choice(keys, churn, replace=False)
    added = rng.integers(0, 2**64, churn, dtype=np.uint64)
    new = np.union1d(np.setdiff1d(keys, removed), added)
    updates = sender.update(new)
    changed = set(shard_of(np.setxor1d(keys, new), bits).tolist())
    assert changed
    assert {u.index for u in updates} == changed
    for u in updates:
        assert u.tlv_bytes <= budget and u.shard_bits == bits
        update = u.update
        outcome = receivers[u.index].apply(update.version, update.base_version, update.summary)
        assert outcome in (Outcome.DELTA, Outcome.SNAPSHOT)
    for i, r in receivers.items():
        assert r.contains_many(new[shard_of(new, bits) == i]).all()


def test_sharded_sender_grows_shards_when_a_snapshot_no_longer_fits() -> None:
    budget = entry_budget(4096, 300)
    sender = ShardedSender(budget, 0.01, kind=KIND_EXACT)
    first = sender.update(keys_of(100, 5))
    assert sender.shard_bits == 0 and len(first) == 1
    grown = sender.update(keys_of(5000, 6))
    assert sender.shard_bits > 0
    assert len(grown) == 1 << sender.shard_bits
    assert all(u.tlv_bytes <= budget and not u.update.is_delta for u in grown)
    assert min(u.update.version for u in grown) > first[0].update.version


@pytest.mark.parametrize("budget", [0, 10, ENTRY_OVERHEAD])
def test_a_budget_with_no_room_for_a_summary_is_refused_at_once(budget: int) -> None:
    """A sender given a budget its entry's own fields fill is refused when made, with
    the numbers (it used to fail later, dividing by zero or taking log2 of a negative)."""
    with pytest.raises(ValueError, match=f"budget of {budget} bytes leaves no room"):
        ShardedSender(budget, 0.01)
    with pytest.raises(ValueError, match=f"budget of {budget} bytes leaves no room"):
        build_shards(np.arange(1, 100, dtype=np.uint64), budget, 0.01)

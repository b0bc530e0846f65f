"""An entry the RIB ignores (unknown kind, a body that does not decode, an older version)
changes nothing: no tier is made for it, and no cost or stream of a tier it names moves."""

from __future__ import annotations

import dataclasses

import numpy as np

from catsproto import wire
from catsproto.selector import RIB
from tests.selector_fixtures import advert, entry

KEYS = np.arange(1, 200, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def _tiers(rib: RIB) -> dict:
    inst = next(iter(rib.services[7].live()))
    return {
        t.name: (s.bytes_per_block, s.fetch_latency_us, s.fetch_bandwidth_mbps, sorted(s.shards))
        for t, s in inst.tiers.items()
    }


def test_unknown_kind_on_a_new_tier_makes_no_tier():
    rib = RIB()
    hbm = entry(KEYS, kind=wire.SummaryKind.FUSE)
    dram = dataclasses.replace(
        entry(KEYS, tier=wire.Tier.DRAM, latency_us=40, mbps=200_000), kind=200
    )
    result = rib.accept(advert("10.0.0.1", 1, [hbm, dram]), now_ms=1000)
    assert [o[2].split(":")[0] for o in result.outcomes] == ["snapshot applied", "rejected"]
    assert list(_tiers(rib)) == ["HBM"]
    table = rib.services[7]
    assert bool(table.hbm_only[result.instance.slot])


def test_refused_or_older_entry_leaves_the_tier_as_it_was():
    rib = RIB()
    first = entry(KEYS, tier=wire.Tier.DRAM, version=5, latency_us=40, mbps=200_000)
    rib.accept(advert("10.0.0.1", 1, [first], seq=1), now_ms=1000)
    before = _tiers(rib)
    garbled = dataclasses.replace(
        entry(KEYS, tier=wire.Tier.DRAM, version=6, latency_us=900, mbps=1),
        body=first.body[:-3],
    )
    older = entry(KEYS[:50], tier=wire.Tier.DRAM, version=4, latency_us=900, mbps=1)
    for n, e in enumerate((garbled, older)):
        rib.accept(advert("10.0.0.1", 1, [e], seq=2 + n), now_ms=1001 + n)
        assert _tiers(rib) == before
    assert rib.rejected_total == 1
    # and a newer one that applies moves the costs
    newer = entry(KEYS, tier=wire.Tier.DRAM, version=7, latency_us=60, mbps=100_000)
    rib.accept(advert("10.0.0.1", 1, [newer], seq=9), now_ms=1010)
    assert _tiers(rib)["DRAM"][1:3] == (60, 100_000)

"""The eviction term: what a placement costs the fleet's caches, on hand-worked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from catsproto.selector import RIB, Link, Network, PathSelector, Request
from catsproto.selector.occupancy import CacheLedger
from catsproto.selector.selector import SelectorConfig
from tests.selector_fixtures import BLOCK, advert, entry

NEAR, FAR = "10.0.1.1", "10.0.2.1"
TPS = 10_000.0
BLOCK_MS = BLOCK / TPS * 1000  # 51.2 ms to prefill one block
# Work sent drains between requests a second apart (the queue term stays out of the way),
# and no instance pulls another's prefix (real engines do not): the eviction term decides.
CFG = SelectorConfig(pending="drain", allow_remote_kv=False)


def net() -> Network:
    return Network(
        [
            Link("ingress", "site1", delay_ms=1, bandwidth_mbps=100_000),
            Link("ingress", "site2", delay_ms=3, bandwidth_mbps=100_000),
        ]
    )


def prompt(i: int, blocks: int = 8) -> Request:
    keys = np.arange(10_000 * (i + 1), 10_000 * (i + 1) + blocks, dtype=np.uint64)
    return Request(7, keys, blocks * BLOCK, "ingress")


def fleet(near_cap: tuple[int, int] | None, far_cap: tuple[int, int] | None, **kw) -> RIB:
    rib = RIB()
    rib.accept(advert(NEAR, 1, capacity=near_cap, **kw.get("near", {})), now_ms=1000)
    rib.accept(advert(FAR, 2, capacity=far_cap, **kw.get("far", {})), now_ms=1000)
    return rib


def test_the_rib_keeps_the_newest_capacity_of_each_instance():
    rib = RIB()
    rib.accept(advert(NEAR, 1, capacity=(40, 100), ts=2000, seq=2), now_ms=2000)
    table = rib.services[7]
    slot = table.by_address[next(iter(table.by_address))].slot
    assert (table.kv_free[slot], table.kv_total[slot], table.kv_at_ms[slot]) == (40, 100, 2000)
    # an older advertisement (a late copy on another route) does not take it back
    rib.accept(advert(NEAR, 1, capacity=(90, 100), ts=1500, seq=1), now_ms=2100)
    assert table.kv_free[slot] == 40
    rib.accept(advert(NEAR, 1, capacity=(10, 100), ts=2500, seq=3), now_ms=2500)
    assert table.kv_free[slot] == 10
    # one without a Capacity TLV says nothing of it: the last stands
    rib.accept(advert(NEAR, 1, ts=3000, seq=4), now_ms=3000)
    assert table.kv_free[slot] == 10


def test_free_blocks_cost_nothing_and_the_nearest_wins():
    sel = PathSelector(fleet((100, 100), (100, 100)), net(), CFG)
    d = sel.decide(prompt(0), now_ms=1000)
    assert str(d.chosen.address) == NEAR
    assert d.chosen.evict_ms == 0 and d.chosen.evicted_blocks == 0
    assert d.runner_up.evict_ms == 0


def test_placements_use_up_the_advertised_free_blocks_until_an_advertisement_counts_them():
    rib = fleet((10, 100), (100, 100))
    sel = PathSelector(rib, net(), CFG)
    d = sel.decide(prompt(0), now_ms=1000)  # 8 blocks at the near one: 2 left free there
    assert str(d.chosen.address) == NEAR and d.chosen.evicted_blocks == 0
    ledger = sel._ledgers[7]
    slot = rib.services[7].by_address[d.chosen.address].slot
    assert ledger.placed[slot] == 8
    # its next advertisement, built after the placement, counts those blocks itself
    rib.accept(advert(NEAR, 1, capacity=(2, 100), ts=1001, seq=2), now_ms=1001)
    ledger.refresh(rib.services[7])
    assert ledger.placed[slot] == 0


def test_a_full_cache_that_turns_over_sends_new_prefixes_to_free_blocks():
    # the near instance is full; the far one has room. While the near one has taken few
    # blocks lately its victims are cold, and it keeps the new prompts (it is nearer);
    # once it has taken about its capacity, evicting there costs more than the far trip.
    sel = PathSelector(fleet((0, 64), (1000, 1000)), net(), CFG)
    went = []
    for i in range(12):
        d = sel.decide(prompt(i), now_ms=1000 + 1000 * i)
        went.append(str(d.chosen.address))
    assert went[0] == NEAR
    assert FAR in went
    first_far = went.index(FAR)
    d = sel.decide(prompt(99), now_ms=1000 + 1000 * 12)
    assert str(d.chosen.address) == FAR and d.chosen.evict_ms == 0
    near = d.runner_up
    assert str(near.address) == NEAR
    assert near.evicted_blocks == 8  # no free block: every new block evicts one
    # the price is the evicted blocks' prefill times the victims' value
    assert 0 < near.evict_ms < 8 * BLOCK_MS
    assert near.total_ms == pytest.approx(
        near.rtt_ms + near.upload_ms + near.queue_ms + near.prefill_ms + near.evict_ms
    )
    assert "evict" in d.explain()
    # placements at the near one before the far one took over: what made it warm
    assert 1 <= first_far <= 11


def test_a_conversation_stays_on_its_full_holder():
    keys = prompt(5).block_keys
    holder = {"entries": [entry(keys[:7])]}  # the first 7 of the 8 blocks
    sel = PathSelector(fleet((0, 64), (1000, 1000), near=holder), net(), CFG)
    # make the holder's cache hot: it took a capacity's worth of other prompts lately
    ledger = sel._ledger_for(sel.rib.services[7])
    ledger.refresh(sel.rib.services[7])
    ledger.since_ms = 0
    ledger.add(sel.rib.services[7], 0, 900, 64.0)
    d = sel.decide(prompt(5), now_ms=1000)
    assert str(d.chosen.address) == NEAR
    assert d.chosen.cached_blocks == 7 and d.chosen.evicted_blocks == 1
    assert d.chosen.evict_ms > 0
    # moving it would prefill all 8 blocks at the far one
    assert d.runner_up.prefill_ms == pytest.approx(8 * BLOCK_MS)


def test_a_holder_whose_queue_costs_more_than_a_prefill_elsewhere_loses_it():
    keys = prompt(5).block_keys
    holder = {"entries": [entry(keys[:7])], "backlog": 20_000}  # 2 s of queue
    sel = PathSelector(fleet((0, 64), (1000, 1000), near=holder), net(), CFG)
    d = sel.decide(prompt(5), now_ms=1000)
    assert str(d.chosen.address) == FAR and d.chosen.evict_ms == 0
    assert str(d.runner_up.address) == NEAR and d.runner_up.queue_ms == pytest.approx(2000)


def test_without_a_capacity_tlv_nothing_is_priced():
    sel = PathSelector(fleet(None, None), net(), CFG)
    for i in range(20):
        d = sel.decide(prompt(i), now_ms=1000 + 1000 * i)
        assert str(d.chosen.address) == NEAR and d.chosen.evict_ms == 0


def test_pricing_can_be_turned_off():
    sel = PathSelector(
        fleet((0, 64), (1000, 1000)),
        net(),
        SelectorConfig(pending="drain", allow_remote_kv=False, price_evictions=False),
    )
    for i in range(20):
        d = sel.decide(prompt(i), now_ms=1000 + 1000 * i)
        assert str(d.chosen.address) == NEAR and d.chosen.evict_ms == 0


def test_a_request_sent_elsewhere_is_taken_back_from_the_ledger():
    rib = fleet((10, 100), (100, 100))
    sel = PathSelector(rib, net(), CFG)
    d = sel.decide(prompt(0), now_ms=1000)
    slot = rib.services[7].by_address[d.chosen.address].slot
    assert sel._ledgers[7].placed[slot] == 8
    assert sel.forget_last(7, d.chosen.address)
    assert sel._ledgers[7].placed[slot] == 0 and sel._ledgers[7].recent[slot] == 0


def test_victim_value_follows_the_lru_age():
    # 64 blocks of capacity, 64 placed just now, watched for the whole horizon: the
    # victims were last used about one horizon ago, exp(-1) of them wanted again
    rib = fleet((0, 64), (0, 64))
    table = rib.services[7]
    ledger = CacheLedger(horizon_ms=1000.0)
    ledger.refresh(table)
    ledger.since_ms = -1_000_000
    ledger.add(table, 0, 0, 64.0)
    ev = ledger.terms(table, slice(0, 2), 0, np.full(2, 512.0), np.full(2, 0.1))
    assert ev.block_ms[0] == pytest.approx(51.2 * math.exp(-1))
    assert ev.block_ms[1] == 0  # nothing placed there: cold victims
    evicted, ms = ev.price(np.array([8.0, 8.0]))
    assert list(evicted) == [8, 8] and ms[1] == 0
    with pytest.raises(ValueError, match="reuse horizon"):
        CacheLedger(horizon_ms=0)
    with pytest.raises(ValueError, match="reuse_horizon_ms"):
        SelectorConfig(reuse_horizon_ms=float("inf"))

"""The selector's per-slot state across slot reuse, and its paths across link updates.

A RIB slot freed by a withdrawal (or expiry) is reused by the next new address; the work
the selector logged for the departed instance must not be charged to the newcomer. A
`Network.add` (a new delay measurement) must reach the selector's cached paths."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from catsproto import wire
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)
from catsproto.selector import RIB, Link, Network, PathSelector, Request
from catsproto.selector.selector import SelectorConfig
from catsproto.summary import KIND_EXACT
from tests.selector_fixtures import BLOCK, BYTES_PER_BLOCK, advert, entry

KEYS = np.arange(1000, 1016, dtype=np.uint64)  # a 16-block prompt
TOKENS = 16 * BLOCK  # 8192: 819.2 ms of prefill at 10,000 tokens/s
OTHER = np.arange(5000, 5004, dtype=np.uint64)  # a prompt nobody holds
MODES = ["count", "drain"]


def ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address)


def no_metrics(address: str, site: int, keys: np.ndarray, ts: int, seq: int = 1):
    """A route that carries a summary and no metrics (a shard route, say)."""
    return wire.Advertisement.build(
        wire.Version(1),
        wire.Origin(7, site, ip(address)),
        wire.Sequence(1, seq),
        wire.Timestamp(ts),
        wire.CacheModel("test-model", BLOCK, wire.KeyScheme.BLAKE2B64_CHAINED, 1),
        wire.CacheSummaries((entry(keys),)),
    )


def one_site(pending: str, *addresses: str) -> tuple[RIB, PathSelector]:
    rib = RIB()
    for a in addresses:
        rib.accept(advert(a, 1), now_ms=1000)
    net = Network([Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000)])
    return rib, PathSelector(rib, net, SelectorConfig(pending=pending))


# ---- the occupant counter ----------------------------------------------------------------


def test_occupant_moves_when_a_slot_gets_a_new_instance_or_loses_one():
    rib = RIB()
    table = rib.table(7)
    assert table.occupant[0] == 0
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    assert table.occupant[0] == 1
    rib.accept(advert("10.0.1.1", 2, seq=2, ts=1100), now_ms=1100)  # same one, moved site
    assert table.occupant[0] == 1
    assert rib.withdraw(ip("10.0.1.1"), 7) == 1
    assert table.occupant[0] == 2
    rib.accept(advert("10.0.1.9", 1), now_ms=1200)  # a newcomer takes the freed slot
    assert table.by_address[ip("10.0.1.9")].slot == 0 and table.occupant[0] == 3
    for k in range(2, 40):  # past the first allocation: the counters stay with their slots
        rib.accept(advert(f"10.0.2.{k}", 2), now_ms=1200)
    assert len(table.occupant) >= 40 and table.occupant[0] == 3 and table.occupant[1] == 1


# ---- pending work after slot reuse ----------------------------------------------------------


@pytest.mark.parametrize("pending", MODES)
def test_a_newcomer_in_a_freed_slot_does_not_inherit_the_departed_ones_work(pending):
    """The newcomer's first metrics were built before the work was sent (propagation
    delay): before the fix it was charged the departed instance's 819.2 ms."""
    rib, sel = one_site(pending, "10.0.1.1")
    d = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000)
    assert str(d.chosen.address) == "10.0.1.1"
    assert sel.queued_ms(7, ip("10.0.1.1"), 1000) == pytest.approx(819.2)
    assert rib.withdraw(ip("10.0.1.1"), 7) == 1
    rib.accept(advert("10.0.1.9", 1, ts=900), now_ms=1100)  # built at 900, before the work
    assert rib.services[7].by_address[ip("10.0.1.9")].slot == 0
    assert sel.queued_ms(7, ip("10.0.1.9"), 1100) == 0
    d = sel.decide(Request(7, OTHER, 4 * BLOCK, "ingress"), 1100)
    assert str(d.chosen.address) == "10.0.1.9" and d.chosen.queue_ms == 0
    # and what this decision sent there is counted, as for any instance
    assert sel.queued_ms(7, ip("10.0.1.9"), 1100) == pytest.approx(204.8)


@pytest.mark.parametrize("pending", MODES)
def test_a_newcomer_whose_first_route_has_no_metrics_starts_with_no_pending_work(pending):
    rib, sel = one_site(pending, "10.0.1.1", "10.0.1.2")
    sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000)  # to 10.0.1.1 (lowest slot)
    assert sel.queued_ms(7, ip("10.0.1.1"), 1000) == pytest.approx(819.2)
    assert sel.note(7, ip("10.0.1.2"), 1000, 3000.0)  # 300 ms at the other one
    rib.withdraw(ip("10.0.1.1"), 7)
    rib.accept(no_metrics("10.0.1.9", 1, KEYS, ts=1200), now_ms=1200)
    assert sel.queued_ms(7, ip("10.0.1.9"), 1200) == 0
    d = sel.decide(Request(7, OTHER, 4 * BLOCK, "ingress"), 1200)
    # the newcomer is idle; the other one still has its noted work
    assert str(d.chosen.address) == "10.0.1.9" and d.chosen.queue_ms == 0
    assert d.runner_up.queue_ms == pytest.approx(300.0 if pending == "count" else 100.0)


@pytest.mark.parametrize("pending", MODES)
def test_undoing_work_at_a_newcomer_never_undoes_the_departed_ones(pending):
    rib, sel = one_site(pending, "10.0.1.1")
    assert sel.note(7, ip("10.0.1.1"), 1000, 5000.0)
    rib.withdraw(ip("10.0.1.1"), 7)
    rib.accept(no_metrics("10.0.1.9", 1, KEYS, ts=1000), now_ms=1000)
    assert not sel.forget_last(7, ip("10.0.1.9"))
    assert not sel.forget(7, ip("10.0.1.9"), 1000, 5000.0)
    assert sel.note(7, ip("10.0.1.9"), 1000, 1000.0)
    assert sel.queued_ms(7, ip("10.0.1.9"), 1000) == pytest.approx(100.0)
    assert sel.forget(7, ip("10.0.1.9"), 1000, 1000.0)
    assert sel.queued_ms(7, ip("10.0.1.9"), 1000) == 0


@pytest.mark.parametrize("pending", MODES)
def test_an_expired_instance_takes_its_pending_work_along(pending):
    rib, sel = one_site(pending, "10.0.1.1")
    rib.hold_time_ms = 500
    sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000)
    assert [str(i.address) for i in rib.expire(1600)] == ["10.0.1.1"]
    rib.accept(advert("10.0.1.9", 1, ts=900), now_ms=1600)  # built before the work
    assert sel.queued_ms(7, ip("10.0.1.9"), 1600) == 0
    assert sel.least_queued(7, 1600) == (ip("10.0.1.9"), 0.0)


@pytest.mark.parametrize("pending", MODES)
def test_work_at_an_instance_that_stays_is_still_counted(pending):
    """The counter moves only with the slot's occupant: a re-advertisement that does not
    count the work yet (built before it) keeps it pending."""
    rib, sel = one_site(pending, "10.0.1.1", "10.0.1.2")
    sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000)
    rib.accept(advert("10.0.1.1", 1, seq=2, ts=999), now_ms=1000)
    rib.withdraw(ip("10.0.1.2"), 7)  # another slot moves
    d = sel.decide(Request(7, OTHER, 4 * BLOCK, "ingress"), 1000)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.queue_ms == pytest.approx(819.2)


def _builder(address: str) -> tuple[AdvertisementBuilder, TieredCache]:
    cache = TieredCache([TierSpec(wire.Tier.HBM, 100_000, 0, 1_600_000)])
    cfg = BuilderConfig(
        cs_id=7,
        address=address,
        model_id="test/model",
        block_size=4,
        bytes_per_block=65_536,
        site_id=3,
        shard_range="10.255.1.0/24",
        summary_kind=KIND_EXACT,
        dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=10_000, change_threshold=0),
    )
    return AdvertisementBuilder(cfg, cache, epoch=1), cache


@pytest.mark.parametrize("pending", MODES)
def test_node_routes_through_the_codec_a_newcomer_starts_clean(pending):
    """Real builder routes, encoded and decoded: the newcomer's shard route arrives
    before its main route (which carries the metrics)."""
    net = Network([Link("in", "site3", 5.0, 10_000)])
    rib = RIB()
    sel = PathSelector(rib, net, SelectorConfig(site_nodes={3: "site3"}, pending=pending))

    def announce(address: str, built_ms: int, accepted_ms: int, shards_only: bool) -> None:
        builder, cache = _builder(address)
        for k in range(8):
            cache.store(wire.Tier.HBM, 10_000 * (1 + int(ip(address)) % 7) + k)
        for route in builder.poll(built_ms, ComputeState(prefill_rate_tps=10_000.0)):
            if shards_only and route.tier is None:
                continue
            rib.accept(wire.decode(wire.encode(route.advertisement)), accepted_ms)

    announce("10.0.0.5", 0, 0, shards_only=False)
    d = sel.decide(Request(7, OTHER, 100_000, "in"), 1000)  # 10 s of prefill
    assert str(d.chosen.address) == "10.0.0.5"
    rib.withdraw(ip("10.0.0.5"), 7)
    announce("10.0.0.9", 900, 1500, shards_only=True)
    assert sel.queued_ms(7, ip("10.0.0.9"), 1500) == 0
    d = sel.decide(Request(7, OTHER, 100, "in"), 1500)
    assert str(d.chosen.address) == "10.0.0.9" and d.chosen.queue_ms == 0


# ---- link-metric updates ------------------------------------------------------------------


def test_network_version_moves_with_every_add():
    net = Network([Link("a", "b", 1, 10)])
    assert net.version == 1
    net.add(Link("a", "b", 2, 10))
    net.add(Link("b", "c", 2, 10))
    assert net.version == 3 and net.path("a", "c").delay_ms == 4


def _two_sites() -> tuple[RIB, Network, PathSelector]:
    net = Network([Link("ingress", "site1", 5, 10_000), Link("ingress", "site2", 20, 10_000)])
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    return rib, net, PathSelector(rib, net)


def test_a_link_that_became_slow_stops_attracting_traffic():
    _, net, sel = _two_sites()
    req = Request(7, OTHER, 4 * BLOCK, "ingress")
    d = sel.decide(req, 1000)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.rtt_ms == 10
    net.add(Link("ingress", "site1", 500, 10_000))  # a new measurement
    d = sel.decide(req, 1001)
    assert str(d.chosen.address) == "10.0.2.1" and d.chosen.rtt_ms == 40
    assert str(d.runner_up.address) == "10.0.1.1" and d.runner_up.rtt_ms == 1000


def test_a_new_shortcut_changes_the_priced_path_and_the_explained_one():
    _, net, sel = _two_sites()
    req = Request(7, OTHER, 4 * BLOCK, "ingress")
    assert sel.decide(req, 1000).runner_up.path == ("ingress", "site2")
    net.add(Link("ingress", "r1", 0.5, 10_000))
    net.add(Link("r1", "site2", 0.5, 10_000))  # site2 now 1 ms away, through r1
    d = sel.decide(req, 1001)
    assert str(d.chosen.address) == "10.0.2.1"
    assert d.chosen.path == ("ingress", "r1", "site2") and d.chosen.rtt_ms == 2


def test_a_pull_is_priced_at_the_inter_site_link_as_it_is_now():
    """The remote-KV option: an idle instance pulls an overloaded holder's prefix over
    the site1-site2 link; when that link slows down, the pull's price follows (and past
    a point it no longer wins)."""
    net = Network(
        [
            Link("ingress", "site1", 5, 10_000),
            Link("ingress", "site2", 5, 10_000),
            Link("site1", "site2", 1, 400_000),
        ]
    )
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], backlog=100_000), now_ms=1000)  # 10 s
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    sel = PathSelector(rib, net)
    req = Request(7, KEYS, TOKENS, "ingress")
    transfer = 16 * BYTES_PER_BLOCK * 8 / (400_000 * 1000)
    c = sel.decide(req, 1000).chosen
    assert str(c.kv_source) == "10.0.1.1" and c.fetch_ms == pytest.approx(1 + 0.005 + transfer)
    net.add(Link("site1", "site2", 3, 400_000))  # slower, still the shortest way
    c = sel.decide(req, 1001).chosen
    assert str(c.kv_source) == "10.0.1.1" and c.fetch_ms == pytest.approx(3 + 0.005 + transfer)
    net.add(Link("ingress", "site1", 2_000, 10_000))
    net.add(Link("site1", "site2", 2_000, 400_000))
    c = sel.decide(req, 1002).chosen
    assert str(c.address) == "10.0.2.1" and c.kv_source is None  # computing beats a 2 s pull


def test_a_link_that_widened_lets_a_pull_win_that_was_out_of_reach():
    """A pull out of reach (1 GiB over 500 Mbit/s: 17 s, the holder's queue is 10 s),
    with the vectors from the holder's site prepared, wins once the link widens."""
    net = Network(
        [
            Link("ingress", "site1", 5, 10_000),
            Link("ingress", "site2", 5, 10_000),
            Link("site1", "site2", 1, 500),
        ]
    )
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], backlog=100_000), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    sel = PathSelector(rib, net)
    assert sel.prepare(7) == 2  # the widest path from the holder's site is known
    req = Request(7, KEYS, TOKENS, "ingress")
    d = sel.decide(req, 1000)
    assert str(d.chosen.address) == "10.0.2.1" and d.chosen.kv_source is None
    assert sel.forget_last(7, d.chosen.address)
    net.add(Link("site1", "site2", 1, 400_000))
    c = sel.decide(req, 1001).chosen
    assert str(c.address) == "10.0.2.1" and str(c.kv_source) == "10.0.1.1"
    assert c.fetch_ms == pytest.approx(1 + 0.005 + 16 * BYTES_PER_BLOCK * 8 / (400_000 * 1000))


def test_after_each_update_the_decision_is_a_fresh_selectors():
    """Vectors prepared from every site and cached pull terms are worked out again: each
    decision after an update equals that of a selector built on the updated network."""
    net = Network(
        [
            Link("ingress", "site1", 5, 10_000),
            Link("ingress", "site2", 5, 10_000),
            Link("site1", "site2", 1, 400_000),
        ]
    )
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], backlog=100_000), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    sel = PathSelector(rib, net)
    assert sel.prepare(7) == 2
    req = Request(7, KEYS, TOKENS, "ingress")
    updates = [
        Link("site1", "site2", 4, 400_000),
        Link("ingress", "site2", 30, 10_000),
        Link("site1", "site2", 1_500, 400_000),
        Link("ingress", "site1", 0.5, 10_000),
    ]
    sources = []
    for now, link in enumerate(updates, start=1001):
        net.add(link)
        got = sel.decide(req, now)
        assert sel.forget_last(7, got.chosen.address)  # leave the queues as they were
        want = PathSelector(rib, net).decide(req, now)
        assert (got.chosen, got.runner_up) == (want.chosen, want.runner_up)
        sources.append(str(got.chosen.kv_source))
    assert sources == ["10.0.1.1", "10.0.1.1", "None", "None"]  # the pull stops paying

"""The path selector's cost model on hand-worked cases, each term checked."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from catsproto import wire
from catsproto.selector import RIB, Link, Network, NoInstanceError, PathSelector, Request
from catsproto.selector.selector import Decision, SelectorConfig
from tests.selector_fixtures import BLOCK, BYTES_PER_BLOCK, advert, entry

KEYS = np.arange(1000, 1016, dtype=np.uint64)  # a 16-block prompt
TOKENS = 16 * BLOCK  # 8192
UPLOAD_10G = TOKENS * 4 * 8 / (10_000 * 1000)  # ms at 10 Gbit/s


def two_sites() -> Network:
    return Network(
        [
            Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000),
            Link("ingress", "site2", delay_ms=20, bandwidth_mbps=10_000),
        ]
    )


def test_farther_site_with_the_whole_prefix_beats_the_nearest_without_cache():
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)]), now_ms=1000)
    sel = PathSelector(rib, two_sites())
    d = sel.decide(Request(7, KEYS, TOKENS, "ingress"), now_ms=1000)

    far, near = d.chosen, d.runner_up
    assert str(far.address) == "10.0.2.1" and far.path == ("ingress", "site2")
    assert far.rtt_ms == 40 and far.upload_ms == pytest.approx(UPLOAD_10G)
    assert far.queue_ms == 0 and far.fetch_ms == 0  # HBM
    assert far.cached_blocks == 16 and far.expected_cached_blocks == 16 and far.prefill_ms == 0
    assert far.total_ms == pytest.approx(40 + UPLOAD_10G)

    # The near one would compute everything (819.2 ms) or pull 1 GiB over 25 ms of path.
    assert str(near.address) == "10.0.1.1" and near.rtt_ms == 10
    pull = 25 + 0.005 + 16 * BYTES_PER_BLOCK * 8 / (10_000 * 1000)
    assert near.prefill_ms == pytest.approx(TOKENS / 10_000 * 1000)
    assert near.kv_source is None and near.total_ms == pytest.approx(10 + UPLOAD_10G + 819.2)
    assert pull > 819.2  # which is why it does not pull
    assert "chosen: 10.0.2.1" in d.explain()


def test_overloaded_holder_loses_to_an_idle_instance_pulling_its_prefix():
    net = Network(
        [
            Link("ingress", "site1", 5, 10_000),
            Link("ingress", "site2", 5, 10_000),
            Link("site1", "site2", 1, 400_000),  # a fat inter-site link
        ]
    )
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], backlog=100_000), now_ms=1000)  # 10 s queue
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    d = PathSelector(rib, net).decide(Request(7, KEYS, TOKENS, "ingress"), now_ms=1000)
    c = d.chosen
    assert str(c.address) == "10.0.2.1" and str(c.kv_source) == "10.0.1.1"
    pull = 1 + 0.005 + 16 * BYTES_PER_BLOCK * 8 / (400_000 * 1000)
    assert c.fetch_ms == pytest.approx(pull) and c.prefill_ms == 0
    assert c.total_ms == pytest.approx(10 + UPLOAD_10G + pull)
    assert d.runner_up.queue_ms == pytest.approx(10_000)  # the holder, 100k tokens behind


def test_stale_summary_counts_half():
    rib = RIB()
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS, version=1)]), now_ms=1000)
    # a delta on version 5, which this receiver never saw: state kept, marked stale
    delta = entry(
        KEYS[:1],
        kind=wire.SummaryKind.DELTA,
        version=6,
        base_version=5,
        summary=__import__("catsproto.summary", fromlist=["DeltaSummary"]).DeltaSummary.between(
            KEYS, KEYS[:15]
        ),
    )
    res = rib.accept(advert("10.0.2.1", 2, [delta], seq=2, ts=1001), now_ms=1001)
    assert res.outcomes[0][2].startswith("delta on a base not held")
    d = PathSelector(rib, two_sites()).decide(Request(7, KEYS, TOKENS, "ingress"), now_ms=1001)
    assert d.chosen.stale and d.chosen.cached_blocks == 16
    assert d.chosen.expected_cached_blocks == 8
    assert d.chosen.prefill_ms == pytest.approx(8 * BLOCK / 10_000 * 1000)


def test_false_positive_rate_is_priced_into_the_prefix():
    rib = RIB()
    e = entry(KEYS, kind=wire.SummaryKind.BLOOM, fpr=0.05)
    rib.accept(advert("10.0.2.1", 2, [e]), now_ms=1000)
    d = PathSelector(rib, two_sites()).decide(Request(7, KEYS, TOKENS, "ingress"), now_ms=1000)
    p = d.chosen.fpr
    assert 0 < p < 0.2  # the filter's own estimate from its fill, near the 5% target
    assert d.chosen.cached_blocks == 16
    assert d.chosen.expected_cached_blocks == pytest.approx(16 - p / (1 - p))
    uncached = TOKENS - d.chosen.expected_cached_blocks * BLOCK
    assert d.chosen.prefill_ms == pytest.approx(uncached / 10_000 * 1000)


def test_false_positive_beyond_the_real_prefix_only_extends_it():
    """Keys past the held prefix are misses; the run stops at the first miss."""
    rib = RIB()
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS[:10])]), now_ms=1000)
    d = PathSelector(rib, two_sites()).decide(Request(7, KEYS, TOKENS, "ingress"), now_ms=1000)
    assert d.chosen.cached_blocks == 10


def test_slower_tiers_cost_their_latency_and_bandwidth():
    rib = RIB()
    hbm = entry(KEYS[:4])
    ssd = entry(KEYS, tier=wire.Tier.SSD, latency_us=400, mbps=25_000)
    rib.accept(advert("10.0.2.1", 2, [hbm, ssd]), now_ms=1000)
    d = PathSelector(rib, two_sites(), SelectorConfig(allow_remote_kv=False)).decide(
        Request(7, KEYS, TOKENS, "ingress"), now_ms=1000
    )
    # 4 blocks in HBM (free), 12 from SSD: 0.4 ms + 12 x 64 MiB at 25 Gbit/s
    assert d.chosen.fetch_ms == pytest.approx(0.4 + 12 * BYTES_PER_BLOCK * 8 / (25_000 * 1000))


def test_hot_prefix_spreads_instead_of_herding():
    """Many requests for one prefix before the holder's next advertisement: our own
    decisions count as backlog, so later requests go elsewhere (pulling the prefix)."""
    net = Network(
        [Link("ingress", f"site{i}", 5, 10_000) for i in (1, 2, 3)]
        + [Link("site1", "site2", 1, 400_000), Link("site1", "site3", 1, 400_000)]
    )
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)]), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2), now_ms=1000)
    rib.accept(advert("10.0.3.1", 3), now_ms=1000)
    sel = PathSelector(rib, net)
    long_prompt = TOKENS + 40 * BLOCK  # 16 cached blocks + 40 new ones each time
    chosen = [
        str(sel.decide(Request(7, KEYS, long_prompt, "ingress"), now_ms=1000).chosen.address)
        for _ in range(30)
    ]
    counts = {a: chosen.count(a) for a in set(chosen)}
    assert len(counts) == 3 and max(counts.values()) <= 12, counts
    # A new advertisement from the holder that includes that work resets our count.
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], seq=2, ts=2000, backlog=0), now_ms=2000)
    d = sel.decide(Request(7, KEYS, long_prompt, "ingress"), now_ms=2000)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.queue_ms == 0


def test_expired_and_withdrawn_instances_are_not_chosen():
    rib = RIB(hold_time_ms=5000)
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)]), now_ms=1000)
    rib.accept(advert("10.0.1.1", 1), now_ms=5000)
    sel = PathSelector(rib, two_sites())
    assert str(sel.decide(Request(7, KEYS, TOKENS, "ingress"), 5000).chosen.address) == "10.0.2.1"
    assert str(sel.decide(Request(7, KEYS, TOKENS, "ingress"), 6500).chosen.address) == "10.0.1.1"
    assert rib.withdraw(ipaddress.ip_address("10.0.1.1")) == 1
    with pytest.raises(NoInstanceError):
        sel.decide(Request(7, KEYS, TOKENS, "ingress"), 6500)
    with pytest.raises(NoInstanceError):
        sel.decide(Request(99, KEYS, TOKENS, "ingress"), 6500)


def test_index_follows_summary_changes():
    rib = RIB()
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)]), now_ms=1000)
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    sel = PathSelector(rib, two_sites())
    req = Request(7, KEYS, TOKENS, "ingress")
    assert sel.decide(req, 1000).chosen.cached_blocks == 16
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS[:3], version=2)], seq=2, ts=1001), now_ms=1001)
    d = sel.decide(req, 1001)
    assert str(d.chosen.address) == "10.0.2.1" and d.chosen.cached_blocks == 3
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS, version=1)], seq=2, ts=1002), now_ms=1002)
    d = sel.decide(req, 1002)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.cached_blocks == 16


def test_advertised_backlog_drains_at_the_prefill_rate():
    """10,000 tokens advertised at t=1000 at 10,000 tok/s: 1 s of work, half left at 1500."""
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, backlog=10_000, ts=1000), now_ms=1000)
    sel = PathSelector(rib, two_sites())
    req = Request(7, KEYS, TOKENS, "ingress")
    assert sel.decide(req, 1000).chosen.queue_ms == pytest.approx(1000)
    sel = PathSelector(rib, two_sites())
    assert sel.decide(req, 1500).chosen.queue_ms == pytest.approx(500)
    sel = PathSelector(rib, two_sites())
    assert sel.decide(req, 2500).chosen.queue_ms == 0


def test_same_millisecond_advertisements_are_ordered_by_sequence():
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, backlog=0, ts=1000, seq=1), now_ms=1000)
    res = rib.accept(advert("10.0.1.1", 1, backlog=5000, ts=1000, seq=2), now_ms=1000)
    assert res.metrics_updated and res.instance.backlog_tokens == 5000
    old = rib.accept(advert("10.0.1.1", 1, backlog=1, ts=1000, seq=1), now_ms=1000)
    assert not old.metrics_updated and old.instance.backlog_tokens == 5000


def test_spread_picks_among_near_equal_candidates_only():
    """Eight idle, identical instances at one site: exact argmin always takes the first
    slot; with a margin, choices spread; a clearly better candidate still always wins."""
    net = Network([Link("ingress", "site1", 5, 10_000), Link("ingress", "site2", 50, 10_000)])
    rib = RIB()
    for i in range(8):
        rib.accept(advert(f"10.0.1.{i + 1}", 1), now_ms=1000)
    small = Request(7, KEYS[:1], 16, "ingress")  # 1.6 ms of prefill
    # Fresh selectors (say, one per ingress) with the same stale view: exact argmin
    # makes every one of them send its first request to the same instance ...
    firsts = {str(PathSelector(rib, net).decide(small, 1000).chosen.address) for _ in range(8)}
    assert firsts == {"10.0.1.1"}
    # ... the power of two choices among near-equal ones spreads them.
    firsts = {
        str(
            PathSelector(rib, net, SelectorConfig(spread_ms=5.0, seed=s))
            .decide(small, 1000)
            .chosen.address
        )
        for s in range(8)
    }
    assert len(firsts) >= 4
    far = SelectorConfig(spread_ms=5.0, seed=3)
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)]), now_ms=1000)  # holds the whole prompt
    sel = PathSelector(rib, net, far)
    assert all(
        str(sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen.address) == "10.0.2.1"
        for _ in range(3)
    )


def test_a_long_lived_selector_prices_a_recurring_prompt_as_a_fresh_one_would():
    """The holders of a prompt and what their runs are worth are remembered between
    decisions; each change of what that pricing reads (a summary, staleness, the block
    size) must show in the next decision exactly as a fresh selector sees it."""
    from catsproto.summary import DeltaSummary

    rib = RIB()
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)]), now_ms=1000)
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS[:12])]), now_ms=1000)
    cfg = SelectorConfig(peer_selectors=0)  # its own decisions add no load: fresh == old
    sel = PathSelector(rib, two_sites(), cfg)
    req = Request(7, KEYS, TOKENS, "ingress")

    def same_as_fresh(now: int):
        d = sel.decide(req, now)
        fresh = PathSelector(rib, two_sites(), cfg).decide(req, now)
        assert d.chosen == fresh.chosen and d.runner_up == fresh.runner_up
        return {str(e.address): e for e in (d.chosen, d.runner_up)}

    first = same_as_fresh(1000)
    assert first["10.0.2.1"].cached_blocks == 16 and first["10.0.1.1"].cached_blocks == 12
    assert same_as_fresh(1000) == first  # remembered, unchanged
    # the far holder evicts most of the prompt
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS[:3], version=2)], seq=2, ts=1001), now_ms=1001)
    got = same_as_fresh(1001)
    assert got["10.0.2.1"].cached_blocks == 3 and got["10.0.1.1"].cached_blocks == 12
    # the near one's model moves to 256-token blocks: its 12 blocks cover half the tokens
    rib.accept(advert("10.0.1.1", 1, seq=2, ts=1002, block=256), now_ms=1002)
    got = same_as_fresh(1002)
    assert got["10.0.1.1"].prefill_ms == pytest.approx((TOKENS - 12 * 256) / 10)
    # a delta it cannot apply: its run counts half
    delta = entry(
        KEYS[:1],
        kind=wire.SummaryKind.DELTA,
        version=6,
        base_version=5,
        summary=DeltaSummary.between(KEYS, KEYS[:15]),
    )
    rib.accept(advert("10.0.1.1", 1, [delta], seq=3, ts=1003, block=256), now_ms=1003)
    got = same_as_fresh(1003)
    assert got["10.0.1.1"].stale and got["10.0.1.1"].expected_cached_blocks == 6


def test_path_vectors_follow_an_instance_that_moves_site():
    """The per-site vectors (prepared ahead, or built on first use) are patched where a
    slot's site changed; decisions stay those of a fresh selector."""
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS[:8])]), now_ms=1000)
    cfg = SelectorConfig(peer_selectors=0)
    sel = PathSelector(rib, two_sites(), cfg)
    assert sel.prepare(7) == 2 and sel.prepare(99) == 0
    req = Request(7, KEYS, TOKENS, "ingress")

    def same_as_fresh():
        d = sel.decide(req, 1000)
        fresh = PathSelector(rib, two_sites(), cfg).decide(req, 1000)
        assert d.chosen == fresh.chosen and d.runner_up == fresh.runner_up
        return {str(e.address): e for e in (d.chosen, d.runner_up)}

    assert same_as_fresh()["10.0.1.1"].rtt_ms == 10
    rib.accept(advert("10.0.1.1", 2, seq=2, ts=1001), now_ms=1000)  # now at site 2
    moved = same_as_fresh()["10.0.1.1"]
    assert moved.rtt_ms == 40 and moved.site_id == 2


def test_work_weight_ranks_by_the_work_a_choice_makes():
    """One site, no upload, no pulls. By ttft: idle I1 829.2 ms, I2 (100 ms queued) 929.2,
    the holder H of 8 blocks (600 ms queued) 10 + 600 + 409.6 = 1019.6, third. Weighing
    prefill by 0.5: I1 829.2 + 409.6 = 1238.8, I2 1338.8, H 1019.6 + 204.8 = 1224.4: the
    holder wins, I1 is the runner-up, and each estimate keeps its real terms."""
    net = Network([Link("ingress", "site1", 5, 10_000)])
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.1.2", 1, backlog=1_000), now_ms=1000)
    rib.accept(advert("10.0.1.3", 1, [entry(KEYS[:8])], backlog=6_000), now_ms=1000)
    req = Request(7, KEYS, TOKENS, "ingress")
    plain = SelectorConfig(request_bytes_per_token=0, allow_remote_kv=False)
    by_ttft = PathSelector(rib, net, plain).decide(req, now_ms=1000)
    assert str(by_ttft.chosen.address) == "10.0.1.1"
    assert str(by_ttft.runner_up.address) == "10.0.1.2"
    weighed = SelectorConfig(request_bytes_per_token=0, allow_remote_kv=False, work_weight=0.5)
    d = PathSelector(rib, net, weighed).decide(req, now_ms=1000)
    h, i1 = d.chosen, d.runner_up
    assert str(h.address) == "10.0.1.3" and str(i1.address) == "10.0.1.1"
    assert h.cached_blocks == 8 and h.queue_ms == pytest.approx(600)
    assert h.prefill_ms == pytest.approx(409.6) and h.total_ms == pytest.approx(1019.6)
    assert i1.prefill_ms == pytest.approx(819.2) and i1.total_ms == pytest.approx(829.2)
    # the near-equal set is taken by rank too: within 20 ms of H's 1224.4 is I1 (1238.8),
    # and the better of two draws from those is H unless both draws are I1; by ttft the
    # set would be I1 alone
    picks = set()
    for seed in range(8):
        spread = SelectorConfig(
            request_bytes_per_token=0,
            allow_remote_kv=False,
            work_weight=0.5,
            spread_ms=20,
            seed=seed,
        )
        picks.add(str(PathSelector(rib, net, spread).decide(req, 1000).chosen.address))
    assert "10.0.1.3" in picks and picks <= {"10.0.1.1", "10.0.1.3"}, picks
    # just below the break-even weight (190.4 / 409.6 = 0.465) the idle instance wins again
    below = SelectorConfig(request_bytes_per_token=0, allow_remote_kv=False, work_weight=0.46)
    assert str(PathSelector(rib, net, below).decide(req, now_ms=1000).chosen.address) == (
        "10.0.1.1"
    )
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="work_weight"):
            SelectorConfig(work_weight=bad)


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_work_weight_ranks_every_candidate_as_one_by_one_estimates_say(monkeypatch, weight):
    """A randomized table: 24 instances at 4 sites holding random prefixes of 6 prompts
    under 5 % filters, random backlogs. The decision (staged search forced on, so holders
    start at bounds of their runs) must be the one a brute force gives: each instance's
    estimate from a selector that knows only that instance, ranked by ttft + weight x
    prefill (ties: lowest slot). With weight 0 that is the ranking by ttft alone, the
    selector's behaviour before the weight existed: the same decision, repr for repr."""
    from catsproto.selector import index as index_module

    rng = np.random.default_rng(77)
    prompts = rng.integers(0, 2**63, size=(6, 64), dtype=np.uint64)
    net = Network([Link("ingress", f"site{s}", 1 + 4 * s, 10_000) for s in range(1, 5)])
    adverts = []
    for i in range(24):
        depth = int(rng.integers(2, 65))
        held = [p[: max(2, depth - 8 * j)] for j, p in enumerate(prompts)]
        other = rng.integers(0, 2**63, size=100, dtype=np.uint64)
        keys = np.concatenate([*held, other])
        e = entry(keys, kind=wire.SummaryKind.FUSE, fpr=0.05)
        backlog = float(rng.integers(0, 40_000))
        adverts.append(advert(f"10.0.{1 + i % 4}.{1 + i}", 1 + i % 4, [e], backlog=backlog))
    rib = RIB()
    for a in adverts:
        rib.accept(a, now_ms=1000)
    cfg = SelectorConfig(work_weight=weight, request_bytes_per_token=0, allow_remote_kv=False)
    monkeypatch.setattr(index_module, "STAGE_MIN_LOOKUPS", 0)  # bound runs whenever it may
    asks = [p for p in prompts]
    asks += [np.concatenate([p[:20], rng.integers(0, 2**63, 30, dtype=np.uint64)]) for p in prompts]
    changed = 0
    for keys in asks:
        req = Request(7, keys, len(keys) * BLOCK, "ingress")
        got = PathSelector(rib, net, cfg).decide(req, now_ms=1000)
        alone = []
        for a in adverts:
            one = RIB()
            one.accept(a, now_ms=1000)
            alone.append(PathSelector(one, net, cfg).decide(req, now_ms=1000).chosen)
        table = rib.services[7]
        order = sorted(
            range(len(alone)),
            key=lambda k: (
                alone[k].total_ms + weight * alone[k].prefill_ms,
                table.by_address[alone[k].address].slot,
            ),
        )
        want = Decision(alone[order[0]], alone[order[1]], len(alone))
        assert repr(got) == repr(want)
        by_ttft = min(alone, key=lambda e: (e.total_ms, table.by_address[e.address].slot))
        changed += got.chosen != by_ttft
    # the weight must matter on this table (else the test would not tell the two apart)
    assert (changed > 0) == (weight > 0), changed


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_work_weight_keeps_a_slow_pull_that_wins_by_rank(monkeypatch, weight):
    """The holder H (site 2) of a 32-block prompt's first 16 blocks has 10 s queued; idle A
    and B (site 1) would prefill all 32 blocks (1638.4 ms) or pull the 1 GiB prefix from its
    15 Gbit/s tier (1 + 572.7 ms) and prefill 16 (819.2): 1392.9 < 1638.4, so both pull. With
    w = 0.5 the cheapest pull's rank floor (10 + 573.7 + 1.5 x 819.2 = 1812.5) is above the
    leaders' ttft (1648.4) but within their rank (2467.6): the pruning of pulls that
    cannot reach the leaders (forced on for these three candidates) must use the rank."""
    from catsproto.selector import selector as selector_module

    net = Network(
        [
            Link("ingress", "site1", 5, 10_000),
            Link("ingress", "site2", 5, 10_000),
            Link("site1", "site2", 1, 400_000),
        ]
    )
    prompt = np.arange(5000, 5032, dtype=np.uint64)
    rib = RIB()
    slow = entry(prompt[:16], mbps=15_000)  # the tier, not the path, bounds the pull
    rib.accept(advert("10.0.2.1", 2, [slow], backlog=100_000), now_ms=1000)
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.1.2", 1), now_ms=1000)
    cfg = SelectorConfig(work_weight=weight, request_bytes_per_token=0)
    req = Request(7, prompt, 32 * BLOCK, "ingress")
    sel = PathSelector(rib, net, cfg)
    assert sel.prepare(7) == 2  # paths from each site known: the cheapest pull is 573.7 ms
    monkeypatch.setattr(selector_module, "_FEW_PULLS", 0)  # the pruning path
    d = sel.decide(req, now_ms=1000)
    monkeypatch.undo()
    pull = 1 + 0.005 + 16 * BYTES_PER_BLOCK * 8 / (15_000 * 1000)
    for est in (d.chosen, d.runner_up):
        assert str(est.kv_source) == "10.0.2.1" and est.prefill_ms == pytest.approx(819.2)
        assert est.total_ms == pytest.approx(10 + pull + 819.2)
    assert {str(d.chosen.address), str(d.runner_up.address)} == {"10.0.1.1", "10.0.1.2"}


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_work_weight_prunes_remote_pulls_only_where_they_cannot_matter(monkeypatch, weight):
    """80 instances (more than the few whose pulls are all priced), pulls allowed, one
    deep holder of each prompt with a long queue: the decision, every term, equals the
    one that prices every candidate's pull, with and without a work weight."""
    from catsproto.selector import selector as selector_module

    rng = np.random.default_rng(5)
    prompts = rng.integers(0, 2**63, size=(4, 32), dtype=np.uint64)
    links = [Link("ingress", f"site{s}", 2 + 3 * s, 10_000) for s in range(1, 5)]
    links += [
        Link(f"site{a}", f"site{b}", 1, 400_000) for a in range(1, 5) for b in range(a + 1, 5)
    ]
    net = Network(links)
    rib = RIB()
    for i in range(80):
        depth = 32 if i < 4 else int(rng.integers(0, 12))
        held = np.concatenate([p[:depth] for p in prompts]) if depth else prompts[0][:0]
        keys = np.concatenate([held, rng.integers(0, 2**63, size=50, dtype=np.uint64)])
        backlog = 60_000.0 if i < 4 else float(rng.integers(0, 30_000))
        adv = advert(f"10.1.{i // 250}.{1 + i % 250}", 1 + i % 4, [entry(keys)], backlog=backlog)
        rib.accept(adv, now_ms=1000)
    cfg = SelectorConfig(work_weight=weight, spread_ms=3.0, seed=1)
    pruned, every = PathSelector(rib, net, cfg), PathSelector(rib, net, cfg)
    pulls = 0
    for n, p in enumerate(prompts):
        req = Request(7, p, 40 * BLOCK, "ingress")
        got = pruned.decide(req, now_ms=1000 + n)
        monkeypatch.setattr(selector_module, "_FEW_PULLS", 10**9)
        want = every.decide(req, now_ms=1000 + n)
        monkeypatch.undo()
        assert repr(got) == repr(want), n
        pulls += got.chosen.kv_source is not None
    assert pulls > 0  # the pulls were in play


def _one_site(pending: str) -> tuple[RIB, PathSelector]:
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1), now_ms=1000)
    rib.accept(advert("10.0.1.2", 1), now_ms=1000)
    net = Network([Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000)])
    return rib, PathSelector(rib, net, SelectorConfig(pending=pending))


def test_pending_count_keeps_sent_work_until_an_advertisement_counts_it():
    """`count`: a decision's prefill (8192 tokens at 10,000/s: 819.2 ms) stays in the
    queue term in full until an advertisement built at or after it arrives."""
    rib, sel = _one_site("count")
    first = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen
    a = first.address
    assert first.queue_ms == 0 and first.prefill_ms == pytest.approx(819.2)
    assert sel.queued_ms(7, a, 1500) == pytest.approx(819.2)  # not drained
    second = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1500).chosen
    assert second.address != a and second.queue_ms == 0  # the other one is idle
    assert sel.note(7, a, 1600, 1000.0)  # another C-PS sent 100 ms more
    assert sel.queued_ms(7, a, 1600) == pytest.approx(919.2)
    assert sel.forget_last(7, a) and sel.queued_ms(7, a, 1600) == pytest.approx(819.2)
    assert not sel.note(7, ipaddress.ip_address("10.9.9.9"), 1600, 1.0)
    # an advertisement of the decision's own millisecond counts it (backlog 0: done)
    rib.accept(advert(str(a), 1, seq=2, ts=1000), now_ms=1700)
    assert sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1700).chosen.queue_ms == 0


def test_pending_drain_replays_sent_work_at_the_advertised_rate():
    """`drain`: the same work drains at 10 tokens/ms from the decision on; an entry of
    the advertisement's own millisecond still counts (it may be newer than the build)."""
    rib, sel = _one_site("drain")
    a = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen.address
    assert sel.queued_ms(7, a, 1500) == pytest.approx(319.2)
    assert sel.note(7, a, 1500, 1000.0)  # queued behind what is left: +100 ms
    assert sel.queued_ms(7, a, 1500) == pytest.approx(419.2)
    assert sel.queued_ms(7, a, 2000) == 0
    b = next(x for x in rib.services[7].by_address if x != a)
    assert sel.least_queued(7, 1500) == (b, 0.0)
    # the queues before the last work counted at a: 319.2 ms there
    assert sel.note(7, b, 1500, 5000.0)
    assert sel.least_queued(7, 1500, before_last=b) == (b, 0.0)
    assert sel.least_queued(7, 1500)[0] == a
    assert sel.forget_last(7, b) and sel.queued_ms(7, b, 1500) == 0
    rib.accept(advert(str(a), 1, seq=2, ts=1000), now_ms=1500)
    got = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1500)
    assert got.chosen.address == b  # a still has 419.2 ms: kept, as the replay says
    assert got.runner_up.queue_ms == pytest.approx(419.2)


def test_pending_mode_is_checked():
    with pytest.raises(ValueError, match="pending must be one of count, drain"):
        SelectorConfig(pending="fifo")
    with pytest.raises(ValueError, match="peer_selectors"):
        SelectorConfig(pending="drain", peer_selectors=4)


@pytest.mark.parametrize("pending", ["count", "drain"])
def test_pending_work_counts_the_fetch_as_well_as_the_prefill(pending):
    """A holder of the prompt's first 8 blocks in DRAM (at 8 Gbit/s): the decision's
    estimate fetches them, then prefills the other 8; the instance is busy for both, so
    the next decision sees both in its queue."""
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS[:8], tier=wire.Tier.DRAM, mbps=8_000)]), 1000)
    net = Network([Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000)])
    sel = PathSelector(rib, net, SelectorConfig(pending=pending))
    first = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen
    assert first.cached_blocks == 8 and first.prefill_ms == pytest.approx(409.6)
    assert first.fetch_ms == pytest.approx(0.005 + 8 * BYTES_PER_BLOCK * 8 / (8_000 * 1000))
    busy = first.fetch_ms + first.prefill_ms
    second = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen
    assert second.queue_ms == pytest.approx(busy)


def test_queued_ms_leaves_out_work_a_newer_advertisement_counts_before_any_decision():
    rib, sel = _one_site("count")
    a = sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1000).chosen.address
    assert sel.note(7, a, 1200, 1000.0)
    assert sel.queued_ms(7, a, 1300) == pytest.approx(919.2)
    # built at 1100: counts the decision (its backlog, 500 tokens, drains by 1150), not
    # the note
    rib.accept(advert(str(a), 1, seq=2, ts=1100, backlog=500.0), now_ms=1250)
    assert sel.queued_ms(7, a, 1300) == pytest.approx(100.0)
    assert sel.decide(Request(7, KEYS, TOKENS, "ingress"), 1300).runner_up.queue_ms == (
        pytest.approx(100.0)
    )


def _site_cps(pending: str) -> PathSelector:
    """A site's C-PS over its three instances (10,000 tokens/s each, 1 ms from its box):
    A holds the prompt's first 4 blocks behind 300 ms of queue, B and C hold nothing
    behind 100 and 50 ms."""
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS[:4])], backlog=3000.0), now_ms=1000)
    rib.accept(advert("10.0.1.2", 1, backlog=1000.0), now_ms=1000)
    rib.accept(advert("10.0.1.3", 1, backlog=500.0), now_ms=1000)
    net = Network([Link("ingress", "site1", delay_ms=1, bandwidth_mbps=10_000)])
    return PathSelector(rib, net, SelectorConfig(pending=pending, allow_remote_kv=False))


FAR = ipaddress.ip_address("10.0.2.9")  # another site's holder, not in the site's RIB


@pytest.mark.parametrize("pending", ["count", "drain"])
def test_a_carried_pull_that_wins_is_the_decision_and_its_work_is_logged(pending):
    """Own options: A 2 + up + 300 + 12 blocks x 51.2 = 916.4 + up; B 2 + up + 100 +
    819.2 = 921.2 + up; C 2 + up + 50 + 819.2 = 871.2 + up, the best. The ingress's pull
    from FAR (30 ms, 1024 tokens left: 102.4 ms) onto each: least at C, the least queued,
    2 + up + 50 + 30 + 102.4 = 184.4 + up, which wins. C is then busy 50 + 132.4 ms."""
    from catsproto.selector import CarriedPull

    sel = _site_cps(pending)
    c = ipaddress.ip_address("10.0.1.3")
    d = sel.decide(Request(7, KEYS, TOKENS, "ingress", CarriedPull(FAR, 30.0, 102.4)), 1000)
    got = d.chosen
    assert got is d.carried
    assert got.address == c and got.kv_source == FAR and got.site_id == 1
    assert (got.rtt_ms, got.queue_ms, got.fetch_ms, got.prefill_ms) == (2, 50, 30, 102.4)
    assert got.upload_ms == pytest.approx(TOKENS * 4 * 8 / (10_000 * 1000))
    assert got.cached_blocks == 0 and got.expected_cached_blocks == 0
    assert got.total_ms == pytest.approx(184.4 + got.upload_ms)
    own = d.runner_up  # the site's own best is the runner-up
    assert own.address == c and own.kv_source is None
    assert own.total_ms == pytest.approx(871.2 + got.upload_ms)
    assert sel.queued_ms(7, c, 1000) == pytest.approx(50 + 30 + 102.4)
    assert "KV from 10.0.2.9" in d.explain()


def test_a_carried_pull_that_loses_leaves_the_decision_as_without_it():
    """The same pull at 900 ms: onto C 2 + up + 50 + 900 + 102.4 = 1054.4 + up, worse
    than C computing everything (871.2 + up): the decision is the one made without the
    offer, runner-up A; the offer's estimate is still reported. A pull from an
    instance the RIB holds is not taken as carried (the selector prices its own)."""
    from catsproto.selector import CarriedPull

    req = Request(7, KEYS, TOKENS, "ingress")
    bare = _site_cps("drain").decide(req, 1000)
    sel = _site_cps("drain")
    lose = Request(7, KEYS, TOKENS, "ingress", CarriedPull(FAR, 900.0, 102.4))
    d = sel.decide(lose, 1000)
    assert repr(d) == repr(bare) and d.chosen.kv_source is None
    assert str(d.runner_up.address) == "10.0.1.1"
    assert d.carried is not None and str(d.carried.address) == "10.0.1.3"
    assert d.carried.total_ms == pytest.approx(1054.4 + d.chosen.upload_ms)
    assert sel.queued_ms(7, d.chosen.address, 1000) == pytest.approx(50 + 819.2)
    held = CarriedPull(ipaddress.ip_address("10.0.1.1"), 0.0, 0.0)
    mine = _site_cps("drain").decide(Request(7, KEYS, TOKENS, "ingress", held), 1000)
    assert repr(mine) == repr(bare) and mine.carried is None


@pytest.mark.parametrize("fetch, prefill", [(-1.0, 0.0), (0.0, float("nan")), (float("inf"), 1)])
def test_a_carried_pull_must_be_priced(fetch, prefill):
    from catsproto.selector import CarriedPull

    with pytest.raises(ValueError, match="carried pull"):
        CarriedPull(FAR, fetch, prefill)


def test_at_one_site_the_carried_pull_goes_to_the_least_queued_instance():
    """At one site every instance has the same round trip and upload, so the offer's
    best candidate is `least_queued`'s instance at its queue (random backlogs and sent
    work, drained), and it wins exactly when it beats the selector's own choice."""
    from catsproto.selector import CarriedPull

    rng = np.random.default_rng(11)
    rib = RIB()
    for i in range(12):
        held = KEYS[: int(rng.integers(0, 12))]
        backlog = float(rng.integers(0, 20_000))
        rib.accept(
            advert(f"10.0.1.{i + 1}", 1, [entry(held)] if len(held) else [], backlog=backlog),
            now_ms=1000,
        )
    net = Network([Link("ingress", "site1", delay_ms=1, bandwidth_mbps=10_000)])
    sel = PathSelector(rib, net, SelectorConfig(pending="drain"))
    twin = PathSelector(rib, net, SelectorConfig(pending="drain"))
    won = lost = 0
    for n in range(40):
        now = 1000 + 25 * n
        offer = CarriedPull(FAR, float(rng.uniform(0, 400)), float(rng.uniform(0, 800)))
        least, q = sel.least_queued(7, now)
        own = twin.decide(Request(7, KEYS, TOKENS, "ingress"), now)
        d = sel.decide(Request(7, KEYS, TOKENS, "ingress", offer), now)
        assert d.carried is not None
        assert d.carried.address == least and d.carried.queue_ms == pytest.approx(q)
        if d.chosen is d.carried:
            won += 1
            assert d.carried.total_ms < own.chosen.total_ms
            assert repr(d.runner_up) == repr(own.chosen)
            twin.forget_last(7, own.chosen.address)  # keep the twin's log the same
            work = (offer.fetch_ms + offer.prefill_ms) / 1000 * 10_000
            twin.note(7, least, now, work)
        else:
            lost += 1
            assert d.carried.total_ms >= own.chosen.total_ms
            assert repr(d) == repr(own)
    assert won and lost  # both sides were in play

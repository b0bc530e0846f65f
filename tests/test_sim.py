"""The simulator on a hand-made trace: hits and TTFTs worked out by hand per policy.

Scenario: sites A and B (RTT 10 ms, 1 ms within a site), two instances each (A1 A2 B1
B2 = 0 1 2 3), blocks of 4 tokens, prefill 1,000 tokens/s (1 token = 1 ms), ingress
site = sites[hash_ids[1] mod 2]. Requests (t ms, input tokens, hash_ids):

    r0  t=0   8  (0, 2)      ingress A
    r1  t=5   8  (0, 2)      ingress A   same prefix as r0
    r2  t=10  12 (5, 7, 9)   ingress B
    r3  t=20  10 (0, 2, 4)   ingress A   r0's two blocks + one (partial) block

TTFT = RTT + wait + (input − 4 × cached blocks) ms. Worked out in each test.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
from collections import deque

import numpy as np
import pytest

from catsproto.adapters.trace import find_trace, load_scenario, read_trace
from catsproto.keys import BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)
from catsproto.selector.pending import replay
from catsproto.sim import (
    Cluster,
    PreparedTrace,
    Scenario,
    ScenarioError,
    TraceRequest,
    apply_overrides,
    run_policy,
)
from catsproto.sim.control import ControlPlane
from catsproto.sim.hierarchy import HierarchicalPolicy
from catsproto.wire import Tier

TRACE_FILE = str(find_trace())

HAND = [
    TraceRequest(0, 8, 1, (0, 2)),
    TraceRequest(5, 8, 1, (0, 2)),
    TraceRequest(10, 12, 1, (5, 7, 9)),
    TraceRequest(20, 10, 1, (0, 2, 4)),
]


def mini(**over: object) -> Scenario:
    raw: dict[str, object] = {
        "name": "hand",
        "sites": ["A", "B"],
        "rtt_ms": {"A-B": 10.0},
        "intra_site_rtt_ms": 1.0,
        "instances_per_site": 2,
        "tiers": {"hbm": {"capacity_blocks": 100, "fetch_bandwidth_mbps": 8_000_000}},
        "block_tokens": 4,
        "prefill_tps": 1000.0,
        "update_interval_ms": 1000,
        "per_hop_ms": 1.0,
        "max_message_bytes": 4096,
    }
    raw.update(over)
    return Scenario.from_mapping(raw)


def prepared(sc: Scenario, requests=HAND) -> PreparedTrace:
    keyer = BlockKeyer(sc.secret, sc.model_id, sc.block_tokens)
    return PreparedTrace.build(requests, keyer, len(sc.sites), sc.speedup, sc.ingress_index)


def outcome(policy: str, sc: Scenario | None = None, requests=HAND, **kw: object):
    sc = sc or mini()
    r = run_policy(policy, prepared(sc, requests), sc, seed=3, **kw)
    return r.instance.tolist(), r.hit_blocks.tolist(), r.ttft_ms.tolist(), r


def test_ingress_and_keys():
    tr = prepared(mini())
    assert tr.ingress.tolist() == [0, 0, 1, 0]
    assert tr.key_lists[0] == tr.key_lists[1] == tr.key_lists[3][:2]
    assert len(set(tr.key_lists[2]) & set(tr.key_lists[0])) == 0


def test_round_robin():
    # r0 A1: 1+0+8=9 | r1 A2: 1+0+8=9 | r2 B1 (ingress B): 1+0+12=13
    # r3 B2 from ingress A: 10+0+10=20, B2 holds nothing
    inst, hits, ttft, r = outcome("round-robin")
    assert inst == [0, 1, 2, 3]
    assert hits == [0, 0, 0, 0]
    assert ttft == pytest.approx([9, 9, 13, 20])
    assert r.hit_rate == 0.0


def test_least_loaded():
    # waits at r1 (t=5): A1 busy until 8 -> A2; at r2 (t=10): A2 busy, A1 B1 B2 idle,
    # fewest served first -> B1; at r3 (t=20): B1 busy until 22 -> B2 (served 0)
    inst, _hits, ttft, _ = outcome("least-loaded")
    assert inst == [0, 1, 2, 3]
    assert ttft == pytest.approx([9, 9, 13, 20])


def test_nearest():
    # r1: A1 busy (wait 3) -> A2, a miss: 9 | r3: A1 and A2 idle, served 1 each -> A1,
    # which holds (0, 2): 2 blocks cached, work 10-8=2: TTFT 1+0+2=3
    inst, hits, ttft, r = outcome("nearest")
    assert inst == [0, 1, 2, 0]
    assert hits == [0, 0, 0, 2]
    assert ttft == pytest.approx([9, 9, 13, 3])
    assert r.hit_rate == pytest.approx(2 / 10)


def test_compute_aware():
    # r1: A1 1+3+8=12 vs A2 1+0+8=9 -> A2 | r2: B1 13 | r3: A1 and A2 both 11 -> A1 (hit)
    inst, _hits, ttft, _ = outcome("compute-aware")
    assert inst == [0, 1, 2, 0]
    assert ttft == pytest.approx([9, 9, 13, 3])


def test_oracle():
    # r1: A1 holds (0, 2): 1 + wait 3 + 0 = 4 beats A2's 9 | r3: A1 1+0+2=3
    inst, hits, ttft, r = outcome("oracle")
    assert inst == [0, 0, 2, 0]
    assert hits == [0, 2, 0, 2]
    assert ttft == pytest.approx([9, 4, 13, 3])
    assert r.hit_rate == pytest.approx(4 / 10)
    assert r.rtt_ms.tolist() == [1, 1, 1, 1]
    assert r.wait_ms.tolist() == [0, 3, 0, 0]


def test_random_is_seeded_and_accounted():
    a = outcome("random")
    b = outcome("random")
    assert a[0] == b[0]
    draws = np.random.default_rng(3).integers(4, size=4)
    # the same draw sequence the policy makes, one draw per request
    rng = np.random.default_rng(3)
    assert a[0] == [int(rng.integers(4)) for _ in range(4)]
    assert len(draws) == 4
    r = a[3]
    np.testing.assert_allclose(r.ttft_ms, r.rtt_ms + r.wait_ms + r.fetch_ms + r.prefill_ms)


def test_catsproto_with_delays_by_hand():
    # r0 t=0: advertisements of t=0 are still in flight -> fallback (nearest): A1, 9
    # r1 t=5: the ingress-A selector heard A1 A2 (at 0 + 0.5 + 1 hop -> 2 ms), empty and
    #   idle; A1 and A2 tie at 9, A1 has the lower slot -> A1: real wait 3, real hit 2 -> 4
    # r2 t=10: ingress-B selector: B1 and B2 idle -> B1: 13
    # r3 t=20: no new advertisement until the 1 s tick, so the selector knows no cached
    #   block and counts its own r1 (8 tokens = 8 ms) as A1's queue: A1 1+8+10=19,
    #   A2 1+0+10=11 -> A2, which holds nothing: 1+0+10 = 11
    inst, hits, ttft, r = outcome("catsproto")
    assert inst == [0, 0, 2, 1]
    assert hits == [0, 2, 0, 0]
    assert ttft == pytest.approx([9, 4, 13, 11])
    assert r.fallbacks == 1
    assert r.control["refused"] == {}
    assert r.control["accepted"] == r.control["deliveries"] > 0
    assert r.unadvertised_blocks == 2  # r1's two cached blocks were not yet advertised


def test_catsproto_exact_zero_delay_matches_oracle_by_hand():
    sc = mini(update_interval_ms=0, propagation=False)
    inst, _hits, ttft, r = outcome("catsproto", sc, exact=True)
    assert inst == [0, 0, 2, 0]
    assert ttft == pytest.approx([9, 4, 13, 3])
    assert r.fallbacks == 0


@pytest.mark.parametrize("speedup", [1.0, 8.0])
def test_catsproto_exact_zero_delay_equals_oracle_on_trace(speedup):
    """With zero delay and exact summaries the selector's cost model is the oracle's:
    the same instance for every request of a slice of the real trace. One C-PS serves
    every ingress (no query round trip), so it has seen every decision: the trace
    arrives in bursts within one millisecond, and a per-ingress selector learns of
    another's decision only from the next advertisement's load, which the RIB accepts
    only with a newer millisecond timestamp."""
    raw = apply_overrides(
        load_scenario("s1"),
        [
            "update_interval_ms=0",
            "propagation=false",
            f"speedup={speedup}",
            "selector_site=B",
            "decision_rtt=false",
            "selector_spread_ms=0",
        ],
    )
    sc = Scenario.from_mapping(raw)
    tr = prepared(sc, read_trace(TRACE_FILE, limit=160))
    oracle = run_policy("oracle", tr, sc)
    cats = run_policy("catsproto", tr, sc, exact=True)
    assert cats.fallbacks == 0
    assert cats.instance.tolist() == oracle.instance.tolist()
    np.testing.assert_allclose(cats.ttft_ms, oracle.ttft_ms)
    assert oracle.hit_blocks.sum() > 0 and oracle.wait_ms.max() > 0  # not a trivial slice


def test_tiers_and_pulls_priced_like_the_selector():
    # one DRAM tier below a 2-block HBM: r3's prefix was demoted, so fetching costs
    sc = mini(
        tiers={
            "hbm": {"capacity_blocks": 2, "fetch_bandwidth_mbps": 8_000_000},
            "dram": {"capacity_blocks": 10, "fetch_latency_us": 1000, "fetch_bandwidth_mbps": 8},
        },
        bytes_per_block=1000,
        remote_kv=True,
    )
    inst, _hits, ttft, r = outcome("oracle", sc)
    # r1: A1 is busy (wait 3); A2 computes while pulling (0, 2) from A1's HBM in the same
    # site: 2 × 1000 B × 8 / 8,000,000 Mbit/s = 2e-6 ms, TTFT 1 + 0 + 2e-6 + 0
    assert inst[1] == 1 and r.pulled_blocks.tolist() == [0, 2, 0, 0]
    assert ttft[1] == pytest.approx(1 + 2e-6)
    # r3 at t=20: A1 and A2 both hold (0, 2) in HBM: 1+0+2 = 3 each, A1 by index
    assert inst[3] == 0 and ttft[3] == pytest.approx(3)
    cl_cost = run_policy("oracle", prepared(sc), sc)  # deterministic
    assert cl_cost.ttft_ms.tolist() == r.ttft_ms.tolist()
    cl = Cluster(sc)
    assert cl.fetch_ms((Tier.DRAM, Tier.DRAM)) == pytest.approx(3.0)
    assert cl.fetch_ms((Tier.HBM, Tier.DRAM)) == pytest.approx(2.0)
    # a pull A1 -> B1: one-way 5 ms + latency 1 ms + 2 blocks at min(link, 8 Mbit/s) 2 ms
    assert cl.pull_ms(0, 2, (Tier.DRAM, Tier.DRAM)) == pytest.approx(8.0)


def test_scenario_overrides_and_errors():
    raw = load_scenario("s1")
    sc = Scenario.from_mapping(apply_overrides(raw, ["prefill_tps=40000", "rtt_ms.A-D=30"]))
    assert sc.prefill_tps == 40000 and sc.rtt("D", "A") == 30
    assert sc.n_instances == 16 and sc.tiers[0].capacity_blocks == 1000
    with pytest.raises(ScenarioError, match="no such key"):
        apply_overrides(raw, ["prefil_tps=1"])
    with pytest.raises(ScenarioError, match="key=value"):
        apply_overrides(raw, ["prefill_tps"])
    with pytest.raises(ScenarioError, match="rtt_ms lacks"):
        Scenario.from_mapping({**raw, "rtt_ms": {"A-B": 1}})
    with pytest.raises(ScenarioError, match="selector_site"):
        Scenario.from_mapping({**raw, "selector_site": "Z"})
    with pytest.raises(ScenarioError, match="selector_peers applies to the flat selector"):
        Scenario.from_mapping({**raw, "selector_peers": True})  # S1 is two-level
    flat = Scenario.from_mapping({**raw, "selector_peers": True, "site_dispatch": False})
    assert flat.selector_peers and not flat.site_dispatch
    for name, code in (("exact", 1), ("Bloom", 2), ("fuse", 3), ("3", 3), ("auto", None)):
        got = Scenario.from_mapping(apply_overrides(raw, [f"summary_kind={name}"]))
        assert got.summary_kind == code, name
    for bad in ("cuckoo", "4"):
        with pytest.raises(ScenarioError, match="summary_kind"):
            Scenario.from_mapping(apply_overrides(raw, [f"summary_kind={bad}"]))
    big = Scenario.from_mapping(load_scenario("llama70b"))
    assert big.bytes_per_block == 80 * 8 * 128 * 2 * 2 * 512
    assert [t.tier.name for t in big.tiers] == ["HBM", "DRAM"]


def test_replay_drains_the_sent_work_fcfs():
    # 100 tokens advertised at t=0, 1 token/ms: at 50 ms 50 are left, +30 sent -> 80;
    # at 200 ms those are done (80 - 150 < 0), +20 sent -> 20; at 210 ms 10 are left
    sent = deque([(50, 30.0), (200, 20.0)])
    assert replay(100.0, 0.0, sent, 1000.0, 210.0) == pytest.approx(10.0)
    assert replay(100.0, 0.0, deque(), 1000.0, 30.0) == pytest.approx(70.0)
    assert replay(0.0, 0.0, sent, 1000.0, 500.0) == 0.0


def test_replay_forgets_only_what_cannot_matter():
    # the queue was empty when (200, 20) arrived: (50, 30) no longer matters and goes;
    # what is left gives the same answer. An entry older than the advertisement (its
    # backlog counts it) goes too.
    sent = deque([(50, 30.0), (200, 20.0), (205, 5.0)])
    assert replay(100.0, 0.0, sent, 1000.0, 210.0) == pytest.approx(15.0)
    assert list(sent) == [(200, 20.0), (205, 5.0)]
    assert replay(100.0, 0.0, sent, 1000.0, 210.0) == pytest.approx(15.0)
    busy = deque([(50, 30.0), (60, 10.0)])  # never empty: both stay
    assert replay(100.0, 0.0, busy, 1000.0, 70.0) == pytest.approx(70.0)
    assert len(busy) == 2
    old = deque([(5, 7.0), (20, 3.0)])
    assert replay(10.0, 10.0, old, 1000.0, 20.0) == pytest.approx(3.0)
    assert list(old) == [(20, 3.0)]


def test_catsproto_site_dispatch_by_hand():
    # The ingress C-PS picks the site, the site's own C-PS the instance, and work sent
    # since an advertisement drains at the advertised rate (dead reckoning).
    # r0 t=0: nothing heard yet -> fallback (nearest): A1, 9
    # r1 t=5: ingress A heard A1 A2 (at 2 ms; B's arrive at 5 + 2 hops = 7 ms): tie at
    #   9 -> A1, site A; A's C-PS: A1 and A2 tie -> A1: real wait 3, real hit 2 -> 4
    # r2 t=10: ingress B: B1 13 beats A's 10 + 12 -> site B; B's C-PS: B1 -> 13
    # r3 t=20: A's C-PS sent A1 8 tokens at t=5 on an empty queue: done by t=13, so A1's
    #   queue is 0 (the flat selector still counts 8 ms there and picks A2): A1 1+0+10
    #   = 11 ties A2 -> A1, which really holds (0, 2): 1 + 0 + 2 = 3. The oracle's run.
    sc = mini(site_dispatch=True)
    inst, hits, ttft, r = outcome("catsproto", sc)
    assert inst == [0, 0, 2, 0]
    assert hits == [0, 2, 0, 2]
    assert ttft == pytest.approx([9, 4, 13, 3])
    assert r.fallbacks == 1
    assert r.control["refused"] == {}
    assert r.unadvertised_blocks == 4  # r1's and r3's cached blocks were not advertised yet


def test_site_dispatch_every_decision_at_the_instances_site():
    sc = Scenario.from_mapping(apply_overrides(load_scenario("s1"), ["site_dispatch=true"]))
    tr = prepared(sc, read_trace(TRACE_FILE, limit=300))
    cluster = Cluster(sc)
    policy = HierarchicalPolicy(cluster, tr, 0)
    served = [0] * len(sc.sites)
    for r in range(len(tr)):
        t = int(tr.arrival_ms[r])
        policy.advance(t)
        choice = policy.choose(r, t)
        req = tr.requests[r]
        cluster.serve(choice.instance, t, int(tr.ingress[r]), req.input_length, tr.key_lists[r])
        if not choice.fallback:
            served[sc.site_of(choice.instance)] += 1
    control = policy.control
    for s, local in enumerate(control.local_selectors):
        table = control.local_ribs[s].services[1]
        assert {i.site_id for i in table.live()} == {s + 1}  # its own instances only
        assert local._draws == 0  # no power-of-two draws at the site: it sees all its work
    # every request served at a site was placed by that site's own C-PS
    assert policy.site_decisions == served
    assert policy.handovers > 0 and sum(served) > 250


# ingress = sites[hash_ids[3] mod 2], so two prompts can share three blocks and still
# enter at different sites
BURST = [
    TraceRequest(0, 16, 1, (1, 2, 4, 5)),  # q0 ingress B
    TraceRequest(2000, 100, 1, (11, 13, 15, 17)),  # q1 ingress B
    TraceRequest(2000, 100, 1, (21, 23, 25, 27)),  # q2 ingress B
    TraceRequest(2000, 16, 1, (1, 2, 4, 6)),  # q3 ingress A, q0's first three blocks
]


@pytest.mark.parametrize(
    "over, inst, hits, ttft",
    [
        ({}, [2, 2, 3, 2], [0, 0, 0, 3], [17, 101, 101, 114]),
        ({"site_bounce": True}, [2, 2, 3, 0], [0, 0, 0, 0], [17, 101, 101, 27]),
        ({"remote_margin_ms": 5.0}, [2, 2, 3, 0], [0, 0, 0, 0], [17, 101, 101, 17]),
    ],
)
def test_site_bounce_and_remote_margin_by_hand(over, inst, hits, ttft):
    # q0 t=0: nothing heard -> fallback at B: B1, 1+0+16 = 17; B1's summary of
    #   (1, 2, 4, 5) leaves at the 1 s tick and reaches ingress A at 1007
    # q1 t=2000: B1 B2 tie at 1+0+100 -> B1: 101 | q2: B's C-PS counts q1 on B1 -> B2: 101
    # q3 t=2000 at ingress A, which cannot know of q1 q2: B1 holds 3 of its blocks,
    #   10 + 0 + 4 = 14 beats A1's 1 + 0 + 16 = 17 -> site B. B's C-PS: B1 1+100+4 = 105,
    #   so 10 + 100 + 4 = 114 as A sees it: B1 (no bounce).
    # bounce: 114 is worse than A expected (14 + the 10 ms detour) and than A1 after the
    #   detour (17 + 10) -> handed back: A1, 1 + 10 + 0 + 16 = 27.
    # a 5 ms remote margin: A1's 17 is within 14 + 5, so ingress A keeps it: A1, 17.
    sc = mini(site_dispatch=True, ingress_index=3, **over)
    got_inst, got_hits, got_ttft, r = outcome("catsproto", sc, requests=BURST)
    assert prepared(sc, BURST).ingress.tolist() == [1, 1, 1, 0]
    assert got_inst == inst
    assert got_hits == hits
    assert got_ttft == pytest.approx(ttft)
    if over.get("site_bounce"):
        assert r.rtt_ms.tolist() == [1, 1, 1, 11]  # the detour is in the round trip


STICK = [
    TraceRequest(0, 16, 1, (1, 2, 4, 6)),  # ingress A
    TraceRequest(2000, 20, 1, (31, 33, 35, 36)),  # ingress A
    TraceRequest(2000, 16, 1, (1, 2, 4, 8)),  # ingress A, shares three blocks with the first
]


@pytest.mark.parametrize("margin", [0.0, 10.0])
def test_site_sticky_by_hand(margin):
    # r0 t=0: fallback A1 (17), advertised at the 1 s tick | r1 t=2000: A1 A2 tie at 21 ->
    # A1, busy until 2020 | r2: A1 1 + 20 + (16 - 12) = 25, A2 1 + 0 + 16 = 17 -> A2;
    # with a 10 ms margin A's C-PS keeps the prefix on its holder (25 <= 17 + 10): A1 25
    sc = mini(site_dispatch=True, site_sticky_ms=margin, ingress_index=3)
    inst, hits, ttft, _r = outcome("catsproto", sc, requests=STICK)
    if margin:
        assert inst == [0, 0, 0]
        assert hits == [0, 0, 3]
        assert ttft == pytest.approx([17, 21, 25])
    else:
        assert inst == [0, 0, 1]
        assert hits == [0, 0, 0]
        assert ttft == pytest.approx([17, 21, 17])


def test_builder_summary_change_alone_sends_only_its_shards():
    """`BuilderConfig.main_on_summary_change=False` (the eval's setting): a summary change
    re-sends the changed shard, not the main route; a wait off the receivers' prediction
    by the threshold brings the main route back."""
    cache = TieredCache([TierSpec(Tier.HBM, 100, 0, 8_000_000)])
    cache.admit(list(range(1, 41)))
    damp = DampeningPolicy(1000, 30_000, 0.05, score_threshold=11, wait_threshold_ms=100)
    cfg = BuilderConfig(
        cs_id=1,
        address="10.1.0.1",
        model_id="m",
        block_size=4,
        bytes_per_block=0,
        shard_range="10.255.0.0/24",
        dampening=damp,
        main_on_summary_change=False,
    )
    builder = AdvertisementBuilder(cfg, cache, epoch=1)
    main = ipaddress.ip_network("10.1.0.1/32")
    idle = ComputeState(prefill_rate_tps=1000.0)
    first = builder.poll(0, idle)
    assert first[0].prefix == main and len(first) == 2  # initial: main and the HBM shard
    cache.admit(list(range(100, 110)))  # 10 of 40 keys changed: over 5 %
    changed = builder.poll(1000, idle)
    assert [r.prefix for r in changed] == [first[1].prefix]  # the shard alone
    assert changed[0].advertisement.cache_summaries is not None
    # 200 tokens at 1,000 tokens/s: 200 ms of wait where receivers predict 0
    busy = ComputeState(outstanding_prefill_tokens=200, prefill_rate_tps=1000.0)
    loaded = builder.poll(2000, busy)
    assert [r.prefix for r in loaded] == [main]
    # drained as predicted, scores not asked for (threshold 11 of 10): nothing to send
    assert (
        builder.poll(3000, ComputeState(outstanding_prefill_tokens=0, prefill_rate_tps=1000.0))
        == []
    )
    # the default sends the main route with every change
    cfg2 = dataclasses.replace(cfg, main_on_summary_change=True)
    b2 = AdvertisementBuilder(cfg2, TieredCache([TierSpec(Tier.HBM, 100, 0, 8_000_000)]), 1)
    b2.poll(0, idle)
    b2.cache.admit(list(range(1, 11)))
    assert next(r.prefix for r in b2.poll(1000, idle)) == main


@pytest.mark.parametrize("speedup", [1.0, 4.0])
def test_skipping_quiet_polls_changes_nothing(monkeypatch, speedup):
    """The control plane does not poll a builder whose dampener could only say no; the
    advertisements, their bytes and every decision are those of polling them all."""
    raw = apply_overrides(load_scenario("s1"), [f"speedup={speedup}"])
    sc = Scenario.from_mapping(raw)
    tr = prepared(sc, read_trace(TRACE_FILE, limit=400))
    fast = run_policy("catsproto", tr, sc)
    monkeypatch.setattr(ControlPlane, "skip_quiet_polls", False)
    full = run_policy("catsproto", tr, sc)
    assert fast.instance.tolist() == full.instance.tolist()
    np.testing.assert_allclose(fast.ttft_ms, full.ttft_ms)
    for k in ("advertisements", "bytes", "accepted", "builds"):
        assert fast.control[k] == full.control[k], k
    assert fast.control["polls"] < full.control["polls"]  # and it did skip some


# ingress = sites[hash_ids[3] mod 2]: B for q1-q3, A for q0, q4, q5
OVERFLOW = [
    TraceRequest(0, 4, 1, (100, 101, 102, 104)),  # q0 ingress A
    TraceRequest(2000, 100, 1, (11, 13, 15, 17)),  # q1 ingress B
    TraceRequest(2000, 100, 1, (21, 23, 25, 27)),  # q2 ingress B
    TraceRequest(2000, 100, 1, (31, 33, 35, 37)),  # q3 ingress B
    TraceRequest(2000, 100, 1, (40, 42, 44, 46)),  # q4 ingress A
    TraceRequest(2000, 100, 1, (50, 52, 54, 56)),  # q5 ingress A
]


@pytest.mark.parametrize(
    "signal, inst, ttft",
    [
        (False, [0, 2, 3, 0, 1, 2], [5, 101, 101, 110, 101, 210]),
        (True, [0, 2, 3, 0, 1, 0], [5, 101, 101, 110, 101, 201]),
    ],
)
def test_overflow_signal_by_hand(signal, inst, ttft):
    # q0 t=0: nothing heard -> fallback A1, 1+0+4 = 5; by t=2000 every instance is idle
    #   and advertised so. Burst at t=2000, 100 tokens each, no shared blocks:
    # q1 q2 (ingress B): B1 then B2, 1+0+100 = 101 each
    # q3 (ingress B): B1 B2 wait 100 -> home 201; A1 as B sees it 10+0+100 = 110 -> site
    #   A, A's C-PS: A1, 110 (as B expected: no bounce)
    # q4 (ingress A): A1 waits 100 -> A2, 101
    # q5 (ingress A): A1 A2 wait 100 -> home 201; ingress A cannot know of q1 q2, so B
    #   looks idle: 10+0+100 = 110 -> site B: B1, 10+100+100 = 210 (home after the
    #   detour, 211, is no better: no bounce).
    # With the signal, q3 told A's box that B's least queue was 100 ms: B is 210 as A
    #   sees it, worse than home's 201 -> A1 (ties A2), 1+100+100 = 201.
    sc = mini(site_dispatch=True, site_bounce=True, ingress_index=3, overflow_signal=signal)
    got_inst, _hits, got_ttft, _ = outcome("catsproto", sc, requests=OVERFLOW)
    assert prepared(sc, OVERFLOW).ingress.tolist() == [0, 1, 1, 1, 0, 0]
    assert got_inst == inst
    assert got_ttft == pytest.approx(ttft)


@pytest.mark.parametrize(
    "signal, inst, ttft",
    [
        (False, [0, 2, 3, 0, 1, 2], [5, 101, 101, 110, 101, 210]),
        (True, [0, 2, 3, 0, 1, 0], [5, 101, 101, 110, 101, 201]),
    ],
)
def test_overflow_signal_reaches_a_site_known_only_by_its_aggregate(signal, inst, ttft):
    """The same burst as above where each ingress knows the other site only by its site
    aggregate (catsproto-agg): the signal floors that one route, with the same outcome.
    The aggregate's queue is one instance's backlog at one instance's rate, so at t=2000
    an idle B reads 10+0+100 = 110 as before, and the signal's 100 ms lifts it to 210."""
    from catsproto.sim.aggregate import register, unregister

    register()
    try:
        sc = mini(site_dispatch=True, site_bounce=True, ingress_index=3, overflow_signal=signal)
        got_inst, _hits, got_ttft, _ = outcome("catsproto-agg", sc, requests=OVERFLOW)
    finally:
        unregister()
    assert got_inst == inst
    assert got_ttft == pytest.approx(ttft)


@pytest.mark.parametrize("pulls", [True, False])
def test_site_cps_pulls_from_a_busy_sibling_by_hand(pulls):
    # STICK with pulls priced (1,000-byte blocks, HBM at 8,000,000 Mbit/s). r0 t=0:
    # fallback A1 (17), advertised at the 1 s tick | r1 t=2000: A1 A2 tie at 21 -> A1,
    # busy until 2020 | r2 (shares three blocks with r0): A1 1 + 20 + (16 - 12) = 25; A2
    # 1 + 0 + 16 = 17, or A2 pulling the three blocks from A1 inside the site: no delay,
    # 3 x 1000 B x 8 / 8,000,000 Mbit/s = 3e-6 ms, 1 + 0 + 3e-6 + 4. A's C-PS holds A1's
    # summary, so it plans that pull: A2, 5 + 3e-6. Without pulls: A2 from scratch, 17.
    sc = mini(site_dispatch=True, ingress_index=3, bytes_per_block=1000, remote_kv=pulls)
    inst, hits, ttft, r = outcome("catsproto", sc, requests=STICK)
    assert inst == [0, 0, 1]
    if pulls:
        assert hits == [0, 0, 3]
        assert r.pulled_blocks.tolist() == [0, 0, 3]
        assert ttft == pytest.approx([17, 21, 5 + 3e-6], abs=1e-9)
        assert r.fetch_ms.tolist()[2] == pytest.approx(3e-6, abs=1e-12)
    else:
        assert hits == [0, 0, 0]
        assert r.pulled_blocks.tolist() == [0, 0, 0]
        assert ttft == pytest.approx([17, 21, 17])


CARRY = [
    TraceRequest(0, 16, 1, (1, 2, 4, 7)),  # ingress B
    TraceRequest(2000, 16, 1, (1, 2, 4, 8)),  # ingress A, the first three blocks held at B1
]


@pytest.mark.parametrize("carry", [True, False])
def test_site_cps_takes_the_ingress_pull_from_another_site_by_hand(carry, monkeypatch):
    # r0 t=0: fallback at B: B1, 1 + 0 + 16 = 17; advertised at the 1 s tick, heard at A
    #   at 1000 + 5 + 2 hops = 1007.
    # r1 t=2000 at ingress A: B1 10 + 0 + 4 = 14; A1 1 + 0 + 16 = 17; A1 pulling B1's
    #   three blocks: one-way 5 ms + 3 x 1000 B x 8 / 100,000 Mbit/s (the link; HBM is
    #   wider) = 5.00024, 1 + 0 + 5.00024 + 4 = 10.00024 -> site A, source B1. A's C-PS
    #   knows only A1 A2 (17 each): the source travelling with the request makes A1 pull
    #   it: 10.00024, as the engine prices the pull (same link). Without it: A1, 17.
    monkeypatch.setattr(HierarchicalPolicy, "carry_source", carry)
    sc = mini(site_dispatch=True, ingress_index=3, bytes_per_block=1000, remote_kv=True)
    assert prepared(sc, CARRY).ingress.tolist() == [1, 0]
    inst, hits, ttft, r = outcome("catsproto", sc, requests=CARRY)
    assert inst == [2, 0]
    if carry:
        assert hits == [0, 3]
        assert r.pulled_blocks.tolist() == [0, 3]
        assert ttft == pytest.approx([17, 10.00024])
    else:
        assert hits == [0, 0]
        assert ttft == pytest.approx([17, 17])


CARRY_STICK = [
    TraceRequest(0, 16, 1, (1, 2, 4, 7)),  # ingress B
    TraceRequest(0, 16, 1, (1, 2, 5, 6)),  # ingress A: A1 will hold r3's first two blocks
    TraceRequest(2000, 20, 1, (31, 33, 35, 36)),  # ingress A: keeps A1 busy until 2020
    TraceRequest(2000, 16, 1, (1, 2, 4, 8)),  # ingress A, the first three blocks at B1
]


@pytest.mark.parametrize("margin", [0.0, 30.0])
def test_a_carried_pull_after_the_sticky_margin_by_hand(margin):
    # r0 t=0 at B: fallback B1 (17); r1 t=0 at A: fallback A1 (17). Advertised at 1 s.
    # r2 t=2000 at A: A1 A2 tie at 21 -> A1, busy until 2020.
    # r3 t=2000 at ingress A: A1 1 + 20 + 8 = 29; B1 10 + 0 + 4 = 14; A2 pulling B1's
    #   three blocks 1 + 0 + 5.00024 + 4 = 10.00024 -> site A, source B1. A's C-PS: A2
    #   pulling A1's two blocks inside the site 1 + 0 + 2e-6 + 8 = 9.000002, its best;
    #   runner-up A1, 29. The carried pull onto its least queued (A2) 10.00024 loses.
    #   With a 30 ms sticky margin the prefix stays on its holder A1 (29 <= 9.000002 +
    #   30), and then the carried pull beats that (10.00024 < 29): A2 pulls from B1.
    sc = mini(
        site_dispatch=True,
        ingress_index=3,
        bytes_per_block=1000,
        remote_kv=True,
        site_sticky_ms=margin,
    )
    assert prepared(sc, CARRY_STICK).ingress.tolist() == [1, 0, 0, 0]
    inst, hits, ttft, r = outcome("catsproto", sc, requests=CARRY_STICK)
    assert inst == [2, 0, 0, 1]
    if margin:
        assert hits[3] == 3 and r.pulled_blocks.tolist()[3] == 3
        assert ttft == pytest.approx([17, 17, 21, 10.00024])
    else:
        assert hits[3] == 2 and r.pulled_blocks.tolist()[3] == 2
        assert ttft == pytest.approx([17, 17, 21, 9.000002], abs=1e-9)


def test_spread_ticks_spreads_a_shared_timestamp_evenly_until_the_next():
    from catsproto.sim.trace import spread_ticks

    ts = [0.0, 0.0, 0.0, 3000.0, 3000.0, 6000.0]
    reqs = [TraceRequest(t, 100 + i, 1, (i, i + 1)) for i, t in enumerate(ts)]
    out = spread_ticks(reqs)
    assert [r.timestamp_ms for r in out] == [0.0, 1000.0, 2000.0, 3000.0, 4500.0, 6000.0]
    assert [(r.input_length, r.hash_ids) for r in out] == [
        (r.input_length, r.hash_ids) for r in reqs
    ]  # order and everything else kept
    assert [r.timestamp_ms for r in reqs] == ts  # the input is left as it was
    # the last group spreads over the median step between timestamps (3000 ms here)
    tail = spread_ticks([*reqs, TraceRequest(6000.0, 1, 1, (9,))])
    assert [r.timestamp_ms for r in tail[-2:]] == [6000.0, 7500.0]
    keyer = BlockKeyer(b"s" * 16, "m", 512)
    prepared = PreparedTrace.build(reqs, keyer, 4, 2.0, spread=True)
    assert prepared.arrival_ms.tolist() == [0, 500, 1000, 1500, 2250, 3000]
    at_once = PreparedTrace.build(reqs, keyer, 4, 2.0).arrival_ms.tolist()
    assert at_once == [0, 0, 0, 1500, 1500, 3000]


def test_random_spread_draws_within_each_slot_the_same_every_run():
    from catsproto.sim.trace import RANDOM_SPREAD_SEED, spread_ticks

    ts = [0.0] * 6 + [3000.0] * 5 + [6000.0]
    reqs = [TraceRequest(t, 100 + i, 1, (i, i + 1)) for i, t in enumerate(ts)]
    out = spread_ticks(reqs, np.random.default_rng(RANDOM_SPREAD_SEED))
    again = spread_ticks(reqs, np.random.default_rng(RANDOM_SPREAD_SEED))
    assert out == again
    for before, after in zip(reqs, out, strict=True):
        assert before.timestamp_ms <= after.timestamp_ms < before.timestamp_ms + 3000
        assert (after.input_length, after.hash_ids) == (before.input_length, before.hash_ids)
    firsts = [r.timestamp_ms for r in out[:6]]
    assert firsts != sorted(firsts)  # the order inside a slot is drawn too (this seed)
    keyer = BlockKeyer(b"s" * 16, "m", 512)
    built = PreparedTrace.build(reqs, keyer, 4, 1.0, spread="random")
    assert built.arrival_ms.tolist() == sorted(int(r.timestamp_ms) for r in out)
    assert [r.input_length for r in built.requests[:6]] == [
        r.input_length for r in sorted(out[:6], key=lambda r: r.timestamp_ms)
    ]
    with pytest.raises(ValueError, match="spread"):
        PreparedTrace.build(reqs, keyer, 4, 1.0, spread="poisson")


@pytest.mark.parametrize(
    "value, mode",
    [(False, "none"), (True, "even"), ("even", "even"), ("random", "random"), ("none", "none")],
)
def test_arrival_spread_values(value, mode):
    assert mini(arrival_spread=value).arrival_spread == mode


def test_arrival_spread_refuses_what_it_does_not_know():
    with pytest.raises(ScenarioError, match="arrival_spread 'poisson'"):
        mini(arrival_spread="poisson")
    for number in (0, 1):  # 0 == False in Python, but not a value of the key
        with pytest.raises(ScenarioError, match=f"arrival_spread {number} is not"):
            mini(arrival_spread=number)
    # from the command line a string: --set arrival_spread=false / true / random
    raw = load_scenario("s1")
    for text, mode in (("false", "none"), ("true", "even"), ("even", "even"), ("random", "random")):
        got = Scenario.from_mapping(apply_overrides(raw, [f"arrival_spread={text}"]))
        assert got.arrival_spread == mode, text


BOOLEAN_KEYS = sorted(f.name for f in dataclasses.fields(Scenario) if f.type in ("bool", bool))


def test_every_boolean_key_is_checked():
    assert len(BOOLEAN_KEYS) == 11
    assert "sharded" in BOOLEAN_KEYS and "price_evictions" in BOOLEAN_KEYS


@pytest.mark.parametrize("key", BOOLEAN_KEYS)
def test_a_boolean_key_takes_true_or_false_and_nothing_else(key):
    """`--set sharded=False` reaches the scenario as the string 'False' (not JSON), which
    bool() read as true: every boolean key refuses anything but a real boolean."""
    raw = load_scenario("s1")
    if key == "selector_peers":
        raw = {**raw, "site_dispatch": False}  # selector_peers needs the flat selector
    for value in (True, False):
        text = "true" if value else "false"
        got = Scenario.from_mapping(apply_overrides(raw, [f"{key}={text}"]))
        assert getattr(got, key) is value
        assert getattr(Scenario.from_mapping({**raw, key: value}), key) is value
    for text, shown in (("False", "'False'"), ("no", "'no'"), ("off", "'off'"), ("0", "0")):
        with pytest.raises(ScenarioError) as caught:
            Scenario.from_mapping(apply_overrides(raw, [f"{key}={text}"]))
        assert str(caught.value) == f"{key} must be true or false, not {shown}"
    for value in (1, "true", None, [True]):
        with pytest.raises(ScenarioError, match=f"^{key} must be true or false, not "):
            Scenario.from_mapping({**raw, key: value})


def test_the_conversation_trace_ticks_every_three_seconds():
    """Why `arrival_spread` exists: the shared trace's timestamps step by 3 s (±3 ms)."""
    reqs = read_trace(TRACE_FILE, None)
    ticks = sorted({r.timestamp_ms for r in reqs})
    steps = {b - a for a, b in itertools.pairwise(ticks)}
    assert len(reqs) == 12_031 and len(ticks) == 1_180
    assert steps <= set(range(2997, 3004))
    assert Scenario.from_mapping(load_scenario("s1")).arrival_spread == "none"


# physical arrivals: a request joins its queue half its round trip after it is routed
OVERTAKE = [
    TraceRequest(0, 16, 1, (1, 2, 4, 5)),  # p0 ingress B
    TraceRequest(2000, 16, 1, (1, 2, 4, 6)),  # p1 ingress A, p0's first three blocks
    TraceRequest(2000, 100, 1, (11, 13, 15, 17)),  # p2 ingress B
]


@pytest.mark.parametrize(
    "physical, inst, hits, ttft",
    [(False, [2, 2, 3], [0, 3, 0], [17, 14, 101]), (True, [2, 3, 2], [0, 0, 0], [17, 26, 101])],
)
def test_oracle_routed_and_physical_arrival_by_hand(physical, inst, hits, ttft):
    # p0 t=0: all idle and empty: B1 1+0+16 = 17 (ties B2, lowest index)
    # p1 t=2000 from A: B1 holds 3 of its blocks, 10+0+4 = 14 beats A1's 1+0+16 = 17 -> B1
    # p2 t=2000 from B: routed, p1 already joined B1 (busy until 2004): B2, 101.
    #   Physical: p1 is still on its way (it reaches site B at 2005), p2 reaches B1 at
    #   2000.5, ahead of it: no wait for p2 at B1 -> B1 (ties B2), 101. The oracle placed
    #   p1 at site B; on arrival B1 waits 95.5 ms (10+95.5+4 = 109.5), B2 none: B2,
    #   10+0+16 = 26 (binding B1 at the ingress would have given 109.5).
    sc = mini(ingress_index=3, physical_arrival=physical)
    assert prepared(sc, OVERTAKE).ingress.tolist() == [1, 0, 1]
    got_inst, got_hits, got_ttft, r = outcome("oracle", sc, requests=OVERTAKE)
    assert got_inst == inst
    assert got_hits == hits
    assert got_ttft == pytest.approx(ttft)
    assert r.wait_ms.tolist() == [0, 0, 0]
    assert r.rtt_ms.tolist() == [1, 10, 1]


SWAMP = [*OVERTAKE, TraceRequest(2000, 100, 1, (21, 23, 25, 27))]  # p3 ingress B


def test_physical_oracle_hands_back_a_request_whose_site_filled_up_by_hand():
    # As above, and p3 (ingress B, 100 tokens) takes B2: both of B's instances busy
    # until 2100.5 when p1 (from A) reaches site B at 2005: B1 10+95.5+4 = 109.5 there,
    # against going back to A, arriving 2010.5: A1 1+10+0+16 = 27 -> handed back: A1, 27.
    sc = mini(ingress_index=3, physical_arrival=True)
    assert prepared(sc, SWAMP).ingress.tolist() == [1, 0, 1, 1]
    inst, hits, ttft, r = outcome("oracle", sc, requests=SWAMP)
    assert inst == [2, 0, 2, 3]
    assert hits == [0, 0, 0, 0]
    assert ttft == pytest.approx([17, 27, 101, 101])
    assert r.rtt_ms.tolist() == [1, 11, 1, 1]  # the detour is in the round trip
    assert r.wait_ms.tolist() == [0, 0, 0, 0]


def test_physical_waits_count_work_in_flight_that_arrives_first():
    cl = Cluster(mini(physical_arrival=True))
    cl.free_at[2] = 2003.0  # B1 busy until 2003
    cl.expect(2, 2004.0, 1, 10.0)  # 10 ms of work reaching B1 at 2004
    cl.expect(2, 2009.0, 2, 7.0)  # and 7 more at 2009
    # from A (B1 is 5 ms away), routed at 2000: arrives 2005, behind the first: 2014
    assert cl.waits_for(2000, 0)[2] == pytest.approx(9.0)
    # from B (0.5 ms away), routed at 2000: arrives 2000.5, ahead of both: 2003
    assert cl.waits_for(2000, 1)[2] == pytest.approx(2.5)
    # routed at 2004.5 from A: arrives 2009.5, behind both (2014, then 2021)
    assert cl.waits_for(2004.5, 0)[2] == pytest.approx(11.5)
    cl.landed(2, 2004.0, 1)
    assert cl.inflight[2] == [(2009.0, 2, 7.0)]
    routed = Cluster(mini())
    routed.expect(0, 1.0, 1, 50.0)  # the routed model has nothing in flight to count
    assert routed.waits_for(0, 0).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("physical", [False, True])
def test_site_cps_places_on_arrival_in_the_physical_model(physical):
    # The same requests with the two-level decision. p0: fallback B1, 17; advertised at
    # the 1 s tick. p1 t=2000 at ingress A: B1 14 as A sees it -> site B.
    # Routed: B's C-PS places p1 at once: B1, 14; p2 then finds B1 busy: B2, 101.
    # Physical: p1 reaches B's C-PS at 2005, after p2 (ingress B, placed at 2000: B1,
    #   101). B's C-PS counted p2's 100 ms on B1: B1 1+95+4 = 100, B2 1+0+16 = 17 -> B2:
    #   10 + 0 + 16 = 26 (no bounce: 26 is not worse than 14 + the 10 ms detour).
    sc = mini(site_dispatch=True, site_bounce=True, ingress_index=3, physical_arrival=physical)
    inst, hits, ttft, r = outcome("catsproto", sc, requests=OVERTAKE)
    if physical:
        assert inst == [2, 3, 2]
        assert hits == [0, 0, 0]
        assert ttft == pytest.approx([17, 26, 101])
    else:
        assert inst == [2, 2, 3]
        assert hits == [0, 3, 0]
        assert ttft == pytest.approx([17, 14, 101])
    assert r.fallbacks == 1


@pytest.mark.parametrize(
    "over, inst, ttft, rtt",
    [
        ({}, [2, 2, 3, 2], [17, 101, 101, 109.5], [1, 1, 1, 10]),
        ({"site_bounce": True}, [2, 2, 3, 0], [17, 101, 101, 27], [1, 1, 1, 11]),
        ({"remote_margin_ms": 5.0}, [2, 2, 3, 0], [17, 101, 101, 17], [1, 1, 1, 1]),
    ],
)
def test_bounce_in_the_physical_model_by_hand(over, inst, ttft, rtt, monkeypatch):
    # BURST with physical arrivals. q1 q2 (ingress B) join B1, B2 at 2000.5 (busy until
    # 2100.5). q3 (ingress A at 2000) reaches B's C-PS at 2005: B1 1+95+4 = 100 beats B2's
    # 1+95+16 -> B1; no bounce: it joins at 2005, 10 + 95.5 + 4 = 109.5.
    # Bounce: B1 as A sees it, 10 + 95 + 4 = 109, is worse than A expected (14 + the
    #   10 ms detour) and than A1 when sent (17, carried along) + 10 -> back at A's C-PS
    #   at 2010: A1, joined at 2010.5: 1 + 10 + 0 + 16 = 27. Ingress A's count of the
    #   work it sent B1 at 2000 (4 tokens) is undone then, by its time and size.
    #   A margin keeps it home at once: A1, 17.
    from catsproto.selector import PathSelector

    forgotten: list[tuple[int, float, bool]] = []
    forget = PathSelector.forget

    def spy(self, cs_id, address, sent_ms, tokens):
        done = forget(self, cs_id, address, sent_ms, tokens)
        forgotten.append((sent_ms, float(tokens), done))
        return done

    monkeypatch.setattr(PathSelector, "forget", spy)
    sc = mini(site_dispatch=True, ingress_index=3, physical_arrival=True, **over)
    got_inst, _hits, got_ttft, r = outcome("catsproto", sc, requests=BURST)
    assert got_inst == inst
    assert got_ttft == pytest.approx(ttft)
    assert r.rtt_ms.tolist() == rtt
    if over.get("site_bounce"):  # 4 tokens, and a little for the filter's false positives
        assert forgotten == [(2000, pytest.approx(4.0, abs=0.02), True)]
    else:
        assert forgotten == []


def test_forget_undoes_one_entry_by_time_and_size():
    from catsproto.selector.pending import PendingWork

    class Table:  # what a count-mode `remove` reads of the service table
        ms_per_token = np.ones(1)
        occupant = np.ones(1, dtype=np.int64)

    pend = PendingWork(drain=False)
    pend.grow(1)
    for at, tokens in [(5, 8.0), (5, 3.0), (7, 8.0), (9, 1.0)]:
        pend.add(Table(), 0, at, tokens)  # type: ignore[arg-type]
    assert pend.remove(Table(), 0, 5, 8.0)  # type: ignore[arg-type]
    assert list(pend.log[0]) == [(5, 3.0), (7, 8.0), (9, 1.0)]
    assert pend.tokens[0] == pytest.approx(12.0) and pend.ms[0] == pytest.approx(12.0)
    assert not pend.remove(Table(), 0, 5, 8.0)  # type: ignore[arg-type]  # gone
    assert not pend.remove(Table(), 0, 4, 3.0)  # type: ignore[arg-type]  # never logged
    assert not pend.remove(Table(), 0, 7, 1.0)  # type: ignore[arg-type]  # other size
    assert list(pend.log[0]) == [(5, 3.0), (7, 8.0), (9, 1.0)]


def test_the_trace_is_the_published_one():
    """The evaluation's numbers are for one exact file: the digest data/traces names."""
    import hashlib
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "data" / "traces" / "README.md"
    digest = hashlib.sha256(find_trace().read_bytes()).hexdigest()
    assert digest == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    assert digest in readme.read_text()

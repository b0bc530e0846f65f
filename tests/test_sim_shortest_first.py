"""A dispatch that sends a millisecond's requests for one instance least work first.

`Scenario.shortest_first`: "none" keeps FCFS in trace order; "catsproto" lets the site
C-PS of the two-level decision rank by its own estimate; "all" lets every policy rank by
what it knows (the oracle the exact work). Hand-worked cases, then the whole-trace
property that only the order changes, never a decision.
"""

from __future__ import annotations

import numpy as np
import pytest

from catsproto.adapters.trace import find_trace, load_scenario, read_trace
from catsproto.sim import Scenario, ScenarioError, TraceRequest, apply_overrides, run_policy
from tests.test_sim import mini, outcome, prepared

# Three requests at one instant from ingress A (hash_ids[1] even); site B is 100 ms
# away, so every policy keeps them on A's one instance. Works 12, 4 and 8 ms.
BURST = [
    TraceRequest(0, 12, 1, (0, 2, 4)),
    TraceRequest(0, 4, 1, (6,)),
    TraceRequest(0, 8, 1, (8, 10)),
]


def one_each(**over: object) -> Scenario:
    return mini(instances_per_site=1, rtt_ms={"A-B": 100.0}, **over)


@pytest.mark.parametrize(
    "who, ttft",
    [
        ("none", [13, 17, 25]),  # FCFS: waits 0, 12, 16
        ("catsproto", [13, 17, 25]),  # the oracle is not catsproto: FCFS still
        ("all", [25, 5, 13]),  # 4 ms first, then 8, then 12: waits 12, 0, 4
    ],
)
def test_the_oracle_by_hand(who, ttft):
    inst, _hits, got, r = outcome("oracle", one_each(shortest_first=who), BURST)
    assert inst == [0, 0, 0]
    assert got == pytest.approx(ttft)
    # the instance is busy as long either way: the last one starts at 16
    assert max(r.wait_ms) == pytest.approx(16 if who != "all" else 12)


def test_cache_blind_policies_rank_by_the_whole_prefill():
    # nearest knows the input length, not the caches: the same order as the oracle here
    _inst, _hits, got, _r = outcome("nearest", one_each(shortest_first="all"), BURST)
    assert got == pytest.approx([25, 5, 13])
    _inst, _hits, got, _r = outcome("nearest", one_each(shortest_first="catsproto"), BURST)
    assert got == pytest.approx([13, 17, 25])


# r0 warms A's instance with (0, 2, 4) at t=0 (a fallback: nothing heard yet); the
# advertisement of the 1 s tick tells A's C-PS. At t=2000, rB (8 tokens, nothing cached)
# comes first in the trace and rA (16 tokens, 3 of its 4 blocks cached: 4 ms) second.
WARM = [
    TraceRequest(0, 12, 1, (0, 2, 4)),
    TraceRequest(2000, 8, 1, (20, 22)),
    TraceRequest(2000, 16, 1, (0, 2, 4, 14)),
]


@pytest.mark.parametrize(
    "who, ttft",
    [
        ("none", [13, 9, 13]),  # rB 1+0+8; rA waits 8: 1+8+4
        ("catsproto", [13, 13, 5]),  # the site C-PS expects 4 ms of rA: rA first
    ],
)
def test_the_site_cps_ranks_by_its_own_estimate(who, ttft):
    sc = one_each(site_dispatch=True, shortest_first=who)
    inst, hits, got, r = outcome("catsproto", sc, WARM)
    assert inst == [0, 0, 0]
    assert hits == [0, 0, 3]
    assert r.claimed_blocks.tolist()[2] == 3  # it knew of the prefix: that is the rank
    assert got == pytest.approx(ttft)
    # by the whole prefill rB (8) would go before rA (16): the estimate decided
    assert r.fallbacks == 1


def test_values_of_the_key():
    for value, mode in [
        (False, "none"),
        ("none", "none"),
        ("CATSPROTO", "catsproto"),
        ("all", "all"),
    ]:
        assert mini(shortest_first=value).shortest_first == mode
    for bad in ("sjf", 1, True):
        with pytest.raises(ScenarioError, match=r"shortest_first .* is not none, catsproto or all"):
            mini(shortest_first=bad)
    assert Scenario.from_mapping(load_scenario("s1")).shortest_first == "catsproto"


@pytest.mark.parametrize("policy, who", [("catsproto", "catsproto"), ("oracle", "all")])
def test_on_the_trace_only_the_order_changes(policy, who):
    raw = load_scenario("s1")
    reqs = read_trace(str(find_trace()), limit=400)
    runs = {}
    for mode in ("none", who):
        sc = Scenario.from_mapping(apply_overrides(raw, [f"shortest_first={mode}", "speedup=4"]))
        runs[mode] = run_policy(policy, prepared(sc, reqs), sc, seed=1)
    fcfs, ranked = runs["none"], runs[who]
    assert np.array_equal(fcfs.instance, ranked.instance)  # the same decisions ...
    assert np.array_equal(fcfs.hit_blocks, ranked.hit_blocks)  # ... and the same caches
    assert np.allclose(fcfs.prefill_ms, ranked.prefill_ms)
    moved = ~np.isclose(fcfs.wait_ms, ranked.wait_ms)
    assert moved.sum() > 0  # the trace's shared instants do put several on one instance
    if policy == "oracle":  # ranked by the exact work: the least sum of waits
        assert ranked.wait_ms.sum() < fcfs.wait_ms.sum()

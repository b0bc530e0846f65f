"""The eval variant with aggregated remote state (catsproto.sim.aggregate): instance
routes stay in their site, site aggregates travel, remote decisions hand over."""

from __future__ import annotations

import pytest

from catsproto.adapters.trace import find_trace, load_scenario, read_trace
from catsproto.keys import BlockKeyer
from catsproto.sim import POLICIES, PreparedTrace, Scenario, run_policy
from catsproto.sim.aggregate import (
    AGGREGATED_POLICIES,
    AggregatedControlPlane,
    AggregatedPolicy,
    register,
    unregister,
)

TRACE_FILE = find_trace()


def _trace(sc: Scenario, limit: int) -> PreparedTrace:
    keyer = BlockKeyer(sc.secret, sc.model_id, sc.block_tokens)
    requests = read_trace(TRACE_FILE, limit=limit)
    return PreparedTrace.build(requests, keyer, len(sc.sites), sc.speedup, sc.ingress_index)


@pytest.fixture(autouse=True)
def _registered():
    register()
    yield
    unregister()


def test_registered_without_touching_defaults() -> None:
    assert POLICIES["catsproto-agg"] is AggregatedPolicy
    assert all(POLICIES[name] is cls for name, cls in AGGREGATED_POLICIES.items())
    assert list(POLICIES)[:7] == [
        "random",
        "round-robin",
        "least-loaded",
        "nearest",
        "compute-aware",
        "catsproto",
        "oracle",
    ]
    unregister()
    assert not set(AGGREGATED_POLICIES) & set(POLICIES)
    register()


def test_aggregated_run_keeps_instances_home_and_steers_through_sites() -> None:
    sc = Scenario.from_mapping(load_scenario("s1"))
    tr = _trace(sc, 300)
    from catsproto.sim.cluster import Cluster

    cluster = Cluster(sc)
    policy = AggregatedPolicy(cluster, tr, 0)
    control = policy.control
    assert isinstance(control, AggregatedControlPlane)
    remote_site_picks = 0
    for r in range(len(tr)):
        t = int(tr.arrival_ms[r])
        policy.advance(t)
        choice = policy.choose(r, t)
        x = int(tr.ingress[r])
        top = policy.last_decision
        if not choice.fallback and top is not None:
            s = control.site_index.get(top.chosen.address)
            if s is not None:  # the ingress named a remote site: an instance there (or home)
                remote_site_picks += 1
                assert s != x
                assert sc.site_of(choice.instance) in (s, x)
            else:  # it named a home instance
                assert sc.site_of(policy._index[top.chosen.address]) == x
        req = tr.requests[r]
        cluster.serve(choice.instance, t, x, req.input_length, tr.key_lists[r])
    for x, rib in enumerate(control.ribs):
        live = rib.services[1].live()
        own = [i for i in live if i.site_id == x + 1]
        remote = [i for i in live if i.site_id != x + 1]
        assert len(own) == 4 and {i.site_id for i in live} == {1, 2, 3, 4}
        # one origin per remote site, its egress, priced at one instance's prefill rate
        assert sorted(str(i.address) for i in remote) == sorted(
            f"10.{s + 1}.255.254" for s in range(4) if s != x
        )
        assert all(i.prefill_tps == sc.prefill_tps for i in remote)
        assert len(control.local_ribs[x].services[1].live()) == 4
    assert remote_site_picks > 0 and policy.handovers > 0
    assert 0 < control.beyond_site_bytes < control.stats.bytes
    assert control.stats.refused == {}


def test_beyond_site_bytes_reported_apart() -> None:
    sc = Scenario.from_mapping(load_scenario("s1"))
    tr = _trace(sc, 200)
    agg = run_policy("catsproto-agg", tr, sc).summary()
    flat = run_policy("catsproto", tr, sc).summary()
    assert agg["refused"] == {} and 0.0 < agg["hit_rate"] <= 1.0
    # per-instance: every route crosses the site border; aggregated: only the site routes
    assert flat["adv_beyond_site_bytes"] == flat["adv_bytes"] > 0
    assert 0 < agg["adv_beyond_site_bytes"] < agg["adv_bytes"]


def test_longer_site_interval_sends_fewer_site_bytes() -> None:
    sc = Scenario.from_mapping(load_scenario("s1"))
    tr = _trace(sc, 400)
    one = run_policy("catsproto-agg", tr, sc).summary()
    ten = run_policy("catsproto-agg10", tr, sc).summary()
    assert ten["adv_beyond_site_bytes"] < one["adv_beyond_site_bytes"]

"""The eval variant with aggregated remote state (catsproto.sim.aggregate): instance
routes stay in their site, site aggregates travel, remote decisions hand over."""

from __future__ import annotations

import pytest

from catsproto.adapters.trace import find_trace, load_scenario, read_trace
from catsproto.keys import BlockKeyer
from catsproto.sim import POLICIES, PreparedTrace, Scenario, run_policy
from catsproto.sim.aggregate import AggregatedControlPlane, AggregatedPolicy, register, unregister

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
    assert "catsproto-agg" not in POLICIES
    register()


def test_aggregated_run_keeps_instances_home_and_steers_through_sites() -> None:
    sc = Scenario.from_mapping(load_scenario("s1"))
    tr = _trace(sc, 200)
    result = run_policy("catsproto-agg", tr, sc)
    s = result.summary()
    assert s["requests"] == 200 and s["refused"] == {}
    assert 0.0 < s["hit_rate"] <= 1.0
    # the control plane: each ingress RIB has its own 4 instances and 3 remote sites
    from catsproto.sim.cluster import Cluster

    cluster = Cluster(sc)
    policy = AggregatedPolicy(cluster, tr, 0)
    control = policy.control
    assert isinstance(control, AggregatedControlPlane)
    for r in range(len(tr)):
        t = int(tr.arrival_ms[r])
        policy.advance(t)
        choice = policy.choose(r, t)
        req = tr.requests[r]
        cluster.serve(choice.instance, t, int(tr.ingress[r]), req.input_length, tr.key_lists[r])
    for x, rib in enumerate(control.ribs):
        live = rib.services[1].live()
        sites = {i.site_id for i in live}
        own = [i for i in live if i.site_id == x + 1]
        assert len(own) == 4 and sites == {1, 2, 3, 4}
        assert len(live) == 4 + 3  # per-instance at home, one origin per remote site
        assert len(control.local_ribs[x].services[1].live()) == 4
    assert policy.handovers > 0
    assert control.site_stats["advertisements"] > 0

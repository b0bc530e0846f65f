"""Trace-driven evaluation of steering policies (pure, deterministic, seeded).

    scenario = Scenario.from_mapping(parsed_file)            # catsproto.sim.scenario
    trace = PreparedTrace.build(requests, keyer, 4, scenario.speedup)
    result = run_policy("catsproto", trace, scenario, seed=1)
    result.summary()   # hit rate, TTFT mean/p50/p99 and its split, advertisement bytes

See docs/evaluation.md.
"""

from catsproto.sim.cluster import Cluster, Served
from catsproto.sim.control import ControlPlane, ControlStats
from catsproto.sim.engine import RunResult, run_policy
from catsproto.sim.policies import POLICIES, Choice, Policy, make_policy
from catsproto.sim.scenario import Scenario, ScenarioError, TierConfig, apply_overrides
from catsproto.sim.trace import PreparedTrace, TraceRequest

__all__ = [name for name in dir() if not name.startswith("_")]

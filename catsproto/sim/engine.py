"""The discrete-event loop: requests in arrival order, the control plane in between.

Strategy. Requests are the only events that change the serving state, and an FCFS
queue's wait is known at arrival (`Cluster.serve`), so the loop walks requests in time
order; before each one the policy's `advance(t)` runs whatever happened up to `t` —
for catsproto, every update-interval tick (builders polled, advertisements signed and
scheduled) and every delivery (verified, merged into a RIB) in time order. After each
catsproto decision, what the selector believed is compared with the instance's real
cache: a claimed prefix longer than the real one is a *stale* hit if the first missing
block was in the summary's key set when it was built (evicted since), else a
*false-positive* hit. With `Scenario.shortest_first`, the requests routed in one
millisecond are served at each instance least expected work first instead of in trace
order (`_shortest_first`; the routed model only): the decisions stay, the waits move.
Pure and deterministic: seeds come in, no clocks, no files.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from catsproto.sim.cluster import Cluster, Served
from catsproto.sim.hierarchy import HierarchicalPolicy
from catsproto.sim.policies import CatsprotoPolicy, Choice, Handoff, Policy, make_policy
from catsproto.sim.scenario import Scenario
from catsproto.sim.trace import PreparedTrace

__all__ = ["RATE_MIN_SPAN_S", "RunResult", "run_policy"]

Progress = Callable[[int], None]

# A per-second rate needs this much trace time (first to last arrival, after the
# speedup): over a few seconds it is mostly every instance's first, full advertisement
# divided by almost nothing (one request: its bytes over 0 s). Below it, rates are None.
RATE_MIN_SPAN_S = 10.0


@dataclass
class RunResult:
    """Per-request outcomes of one policy on one trace and scenario, and the control
    plane's costs (catsproto only)."""

    policy: str
    scenario: str
    speedup: float
    ttft_ms: np.ndarray
    rtt_ms: np.ndarray
    wait_ms: np.ndarray
    fetch_ms: np.ndarray
    prefill_ms: np.ndarray
    hit_blocks: np.ndarray
    blocks: np.ndarray
    instance: np.ndarray
    pulled_blocks: np.ndarray
    duration_s: float  # the trace's span: first to last arrival, after the speedup
    claimed_blocks: np.ndarray | None = None  # catsproto: the chosen estimate's prefix
    stale_hits: int = 0  # requests whose claimed prefix was evicted since advertised
    stale_blocks: int = 0
    false_positive_hits: int = 0  # requests whose claimed prefix was a filter's mistake
    false_positive_blocks: int = 0
    unadvertised_blocks: int = 0  # cached blocks the selector did not know about yet
    fallbacks: int = 0
    control: dict[str, object] = field(default_factory=dict)
    engine_events: dict[str, int] = field(default_factory=dict)

    def per_second(self, amount: float) -> float | None:
        """`amount` over the run's span; None when the span is under RATE_MIN_SPAN_S."""
        return amount / self.duration_s if self.duration_s >= RATE_MIN_SPAN_S else None

    @property
    def hit_rate(self) -> float:
        total = int(self.blocks.sum())
        return float(self.hit_blocks.sum()) / total if total else 0.0

    def summary(self) -> dict[str, object]:
        t = self.ttft_ms
        out: dict[str, object] = {
            "policy": self.policy,
            "scenario": self.scenario,
            "speedup": self.speedup,
            "requests": len(t),
            "hit_rate": self.hit_rate,
            "ttft_mean_ms": float(t.mean()) if len(t) else 0.0,
            "ttft_p50_ms": float(np.percentile(t, 50)) if len(t) else 0.0,
            "ttft_p99_ms": float(np.percentile(t, 99)) if len(t) else 0.0,
            "rtt_mean_ms": float(self.rtt_ms.mean()) if len(t) else 0.0,
            "wait_mean_ms": float(self.wait_ms.mean()) if len(t) else 0.0,
            "fetch_mean_ms": float(self.fetch_ms.mean()) if len(t) else 0.0,
            "prefill_mean_ms": float(self.prefill_ms.mean()) if len(t) else 0.0,
            "pulled_blocks": int(self.pulled_blocks.sum()),
            "duration_s": self.duration_s,
        }
        if self.control:
            adv_bytes = int(self.control.get("bytes", 0))  # type: ignore[call-overload]
            out.update(
                adv_bytes=adv_bytes,
                adv_bytes_per_s=self.per_second(adv_bytes),
                advertisements=self.control.get("advertisements", 0),
                # what crosses a site border (aggregated policies: the site routes only)
                adv_beyond_site_bytes=self.control.get("beyond_site_bytes", adv_bytes),
                stale_hits=self.stale_hits,
                stale_blocks=self.stale_blocks,
                false_positive_hits=self.false_positive_hits,
                false_positive_blocks=self.false_positive_blocks,
                unadvertised_blocks=self.unadvertised_blocks,
                fallbacks=self.fallbacks,
                refused=self.control.get("refused", {}),
            )
        out["engine_events"] = dict(self.engine_events)
        return out


def run_policy(
    name: str,
    trace: PreparedTrace,
    scenario: Scenario,
    *,
    seed: int = 0,
    exact: bool = False,
    progress: Progress | None = None,
) -> RunResult:
    """Simulate one policy over the whole prepared trace (arrival times already scaled
    by `scenario.speedup`). `exact`: catsproto's builders send exact summaries."""
    cluster = Cluster(scenario)
    if name == "catsproto" and scenario.site_dispatch and scenario.selector_site is None:
        policy = HierarchicalPolicy(cluster, trace, seed, exact=exact)
    elif name == "catsproto":
        policy = CatsprotoPolicy(cluster, trace, seed, exact=exact)
    else:
        policy = make_policy(name, cluster, trace, seed)
    n = len(trace)
    cols = {k: np.zeros(n) for k in ("ttft", "rtt", "wait", "fetch", "prefill")}
    hit = np.zeros(n, dtype=np.int64)
    blocks = np.zeros(n, dtype=np.int64)
    inst = np.zeros(n, dtype=np.int64)
    pulled = np.zeros(n, dtype=np.int64)
    claimed = np.full(n, -1, dtype=np.int64)
    result_extra = {"stale": [0, 0], "fp": [0, 0], "unadvertised": 0}
    is_cats = isinstance(policy, CatsprotoPolicy)
    done = 0

    def record(r: int, choice: Choice, served: Served) -> None:
        nonlocal done
        keys = trace.key_lists[r]
        cols["ttft"][r] = served.ttft_ms + choice.extra_rtt_ms
        cols["rtt"][r] = served.rtt_ms + choice.extra_rtt_ms
        cols["wait"][r] = served.wait_ms
        cols["fetch"][r] = served.fetch_ms
        cols["prefill"][r] = served.prefill_ms
        hit[r], blocks[r] = served.hit_blocks, len(keys)
        inst[r], pulled[r] = served.instance, served.pulled_blocks
        claimed[r] = choice.claimed_blocks
        if is_cats and not choice.fallback and choice.source is None:
            _classify(
                policy,  # type: ignore[arg-type]
                choice.instance,
                int(trace.ingress[r]),
                keys,
                served.local_blocks,
                choice.claimed_blocks,
                result_extra,
            )
        done += 1
        if progress is not None:
            progress(done)

    if scenario.physical_arrival:
        _run_physical(policy, cluster, trace, record)
    else:
        order = _dispatch_order(policy, scenario, cluster, trace)
        r = 0
        while r < n:
            t = int(trace.arrival_ms[r])
            end = r + 1
            if order is not None:
                while end < n and int(trace.arrival_ms[end]) == t:
                    end += 1
            batch: list[tuple[int, Choice, Served]] = []
            for q in range(r, end):
                policy.advance(t)
                choice = policy.choose(q, t)
                served = cluster.serve(
                    choice.instance,
                    t,
                    int(trace.ingress[q]),
                    trace.requests[q].input_length,
                    trace.key_lists[q],
                    choice.source,
                )
                batch.append((q, choice, served))
            if order is not None and len(batch) > 1:
                batch = _shortest_first(cluster, t, batch, order)
            for q, choice, served in batch:
                record(q, choice, served)
            r = end
    span = (int(trace.arrival_ms[-1]) - int(trace.arrival_ms[0])) / 1000 if n else 0.0
    out = RunResult(
        policy=name,
        scenario=scenario.name,
        speedup=scenario.speedup,
        ttft_ms=cols["ttft"],
        rtt_ms=cols["rtt"],
        wait_ms=cols["wait"],
        fetch_ms=cols["fetch"],
        prefill_ms=cols["prefill"],
        hit_blocks=hit,
        blocks=blocks,
        instance=inst,
        pulled_blocks=pulled,
        duration_s=span,
        engine_events={
            "batches": cluster.batches,
            "events": cluster.events,
            "stored_blocks": cluster.stored_blocks,
            "removed_blocks": cluster.removed_blocks,
            "moved_blocks": cluster.moved_blocks,
        },
    )
    if is_cats:
        assert isinstance(policy, CatsprotoPolicy)
        st = policy.control.stats
        out.claimed_blocks = claimed
        out.stale_hits, out.stale_blocks = result_extra["stale"]  # type: ignore[misc]
        out.false_positive_hits, out.false_positive_blocks = result_extra["fp"]  # type: ignore[misc]
        out.unadvertised_blocks = int(result_extra["unadvertised"])  # type: ignore[arg-type]
        out.fallbacks = policy.fallbacks
        out.control = {
            "advertisements": st.advertisements,
            "bytes": st.bytes,
            "beyond_site_bytes": getattr(policy.control, "beyond_site_bytes", st.bytes),
            "deliveries": st.deliveries,
            "accepted": st.accepted,
            "refused": dict(st.refused),
            "polls": st.polls,
            "builds": st.builds,
        }
    return out


def _run_physical(
    policy: Policy,
    cluster: Cluster,
    trace: PreparedTrace,
    record: Callable[[int, Choice, Served], None],
) -> None:
    """The physical arrival model: a request routed at t joins its instance's queue (and
    is matched against its cache) on arrival, t + the extra round trip of its decision
    (a shared C-PS's query, a bounce's detour) + half the round trip to the instance; a
    request handed to another site's C-PS is placed when it reaches that site. Events
    (ingress decisions, arrivals at a site's C-PS, arrivals at an instance) run in time
    order; at equal times, what is already in flight first."""
    heap: list[tuple[float, int, int, Choice | Handoff]] = []
    seq = 0

    def schedule(r: int, out: Choice | Handoff) -> None:
        nonlocal seq
        seq += 1
        if isinstance(out, Handoff):
            heapq.heappush(heap, (out.at_ms, seq, r, out))
            return
        x, i = int(trace.ingress[r]), out.instance
        at = float(trace.arrival_ms[r]) + out.extra_rtt_ms + float(cluster.inst_rtt[x, i]) / 2
        work = cluster.work_ms(i, trace.requests[r].input_length, trace.key_lists[r], out.source)
        cluster.expect(i, at, seq, work)
        heapq.heappush(heap, (at, seq, r, out))

    n, r = len(trace), 0
    while r < n or heap:
        t = int(trace.arrival_ms[r]) if r < n else None
        if heap and (t is None or heap[0][0] <= t):
            at, k, q, item = heapq.heappop(heap)
            if isinstance(item, Handoff):
                policy.advance(math.floor(at))
                schedule(q, policy.arrive(q, item))
                continue
            cluster.landed(item.instance, at, k)
            req = trace.requests[q]
            served = cluster.serve(
                item.instance,
                at,
                int(trace.ingress[q]),
                req.input_length,
                trace.key_lists[q],
                item.source,
            )
            record(q, item, served)
            continue
        assert t is not None
        policy.advance(t)
        schedule(r, policy.route(r, t))
        r += 1


WorkOf = Callable[[int, Choice, Served], float]


def _dispatch_order(
    policy: Policy, sc: Scenario, cluster: Cluster, trace: PreparedTrace
) -> WorkOf | None:
    """How the policy's dispatch ranks a millisecond's requests for one instance
    (`Scenario.shortest_first`), or None: FCFS in trace order. Each ranks by what it
    knows: catsproto by its C-PS's estimate, the oracle by the exact work, every other
    policy (and catsproto's fallback) by the request's whole prefill, as it knows
    nothing of caches."""
    who = sc.shortest_first
    if who == "none" or (who == "catsproto" and not isinstance(policy, HierarchicalPolicy)):
        return None

    def whole(q: int, choice: Choice, served: Served) -> float:
        return cluster.prefill_ms(trace.requests[q].input_length, 0)

    if isinstance(policy, CatsprotoPolicy):  # its fallback knew nothing of caches
        return lambda q, choice, served: (
            whole(q, choice, served) if choice.fallback else choice.work_ms
        )
    if policy.name == "oracle":
        return lambda q, choice, served: served.fetch_ms + served.prefill_ms
    return whole


def _shortest_first(
    cluster: Cluster,
    t: int,
    batch: list[tuple[int, Choice, Served]],
    work_of: WorkOf,
) -> list[tuple[int, Choice, Served]]:
    """Requests routed at the same millisecond `t` and served one after another at each
    instance (in trace order), re-ordered there least expected work first: the instance
    is busy as long (its `free_at` stays), each request's wait moves. The routing
    decisions were made before and stay; so do the caches (admitted in trace order)."""
    by_instance: dict[int, list[int]] = {}
    for k, (_, choice, _) in enumerate(batch):
        by_instance.setdefault(choice.instance, []).append(k)
    out = list(batch)
    for i, ks in by_instance.items():
        if len(ks) < 2:
            continue
        first = t + batch[ks[0]][2].wait_ms
        ranked = sorted(ks, key=lambda k: (work_of(*batch[k]), batch[k][0]))
        start, starts = first, []
        for k in ranked:
            q, choice, served = batch[k]
            out[k] = (q, choice, replace(served, wait_ms=start - t))
            starts.append(start)
            start += served.fetch_ms + served.prefill_ms
        cluster.restart(i, len(ks), starts)
    return out


def _classify(
    policy: CatsprotoPolicy,
    i: int,
    ingress: int,
    keys: tuple[int, ...],
    actual: int,
    claimed: int,
    acc: dict[str, object],
) -> None:
    if claimed > actual:
        view = policy.view(ingress, i)
        bucket = "stale" if keys[actual] in view else "fp"
        counts = acc[bucket]
        assert isinstance(counts, list)
        counts[0] += 1
        counts[1] += claimed - actual
    elif actual > claimed >= 0:
        acc["unadvertised"] = int(acc["unadvertised"]) + actual - claimed  # type: ignore[call-overload]

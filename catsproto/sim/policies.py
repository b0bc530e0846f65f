"""Steering policies: each picks an instance (and maybe a KV source) for one request.

All see the same state: the cluster (exact queues and caches, which only the oracle
and the load-aware baselines read) and the request. Baselines are given *exact,
instant* load — generous to them, so the comparison with catsproto (which sees load and
cache state only through delayed advertisements) is conservative. Ties go to the
instance that has served fewest requests, then the lowest index, so idle instances
share the work instead of one taking everything.

- random: uniform, seeded.
- round-robin: instances in turn.
- least-loaded: the smallest queue wait anywhere.
- nearest: network-only CATS — the ingress site, least-loaded instance there.
- compute-aware: CATS without cache knowledge — smallest RTT + wait + full prefill.
- catsproto: `PathSelector.decide` of the ingress site's selector, on advertised state.
- oracle: exact, instant cache contents and queues; the lowest estimated TTFT (greedy),
  with the same cost model as the selector (including pulls when the scenario has them).

In the physical arrival model (scenario ``physical_arrival``) the load the baselines and
the oracle read is the wait a request would meet on *arrival*, one one-way delay after
it is routed, behind the work already in flight there (`Cluster.waits_for`): still
exact, and still generous to them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from catsproto.selector import NoInstanceError, Request
from catsproto.selector.selector import Estimate
from catsproto.sim.cluster import Cluster
from catsproto.sim.control import CS_ID, ControlPlane, ingress_node
from catsproto.sim.trace import PreparedTrace

__all__ = ["POLICIES", "Choice", "Handoff", "Policy", "make_policy"]


@dataclass(frozen=True, slots=True)
class Choice:
    instance: int
    source: int | None = None  # instance to pull the cached prefix from
    claimed_blocks: int = -1  # what the policy believed was cached there (-1: no belief)
    fallback: bool = False
    extra_rtt_ms: float = 0.0  # asking a shared C-PS elsewhere costs a round trip
    work_ms: float = 0.0  # the work the deciding C-PS expects it to put on the instance


@dataclass(frozen=True, slots=True)
class Handoff:
    """A request on its way to site `site`, whose own C-PS places it when it gets there
    at `at_ms` (the two-level decision in the physical arrival model). What the ingress
    knew travels with it."""

    site: int
    at_ms: float
    sent_ms: int  # when the ingress routed it
    top: Estimate | None  # the ingress's winning estimate (its pull, if any, comes along)
    floor_ms: float = 0.0  # overflow signal: its ingress site's least queue when sent
    home_ms: float | None = None  # the ingress site's best TTFT when sent (for a bounce)
    extra_rtt_ms: float = 0.0  # a bounce: the detour already travelled
    bounced: bool = False


class Policy:
    name = ""

    def __init__(self, cluster: Cluster, trace: PreparedTrace, seed: int) -> None:
        self.cluster = cluster
        self.trace = trace
        self.seed = seed

    def advance(self, t: int) -> None:
        """Called before the request at time t (the control plane runs here)."""

    def choose(self, r: int, t: int) -> Choice:
        raise NotImplementedError

    def route(self, r: int, t: int) -> Choice | Handoff:
        """The decision at the ingress at t (physical arrival model): an instance, or a
        site whose C-PS decides when the request arrives (`arrive`)."""
        return self.choose(r, t)

    def arrive(self, r: int, handoff: Handoff) -> Choice | Handoff:
        raise NotImplementedError(f"{self.name} does not hand requests over")

    def _least(self, t: int, candidates: np.ndarray, cost: np.ndarray) -> int:
        served = self.cluster.served[candidates]
        order = np.lexsort((candidates, served, cost))
        return int(candidates[order[0]])


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, cluster: Cluster, trace: PreparedTrace, seed: int) -> None:
        super().__init__(cluster, trace, seed)
        self.rng = np.random.default_rng(seed)

    def choose(self, r: int, t: int) -> Choice:
        return Choice(int(self.rng.integers(len(self.cluster.caches))))


class RoundRobinPolicy(Policy):
    name = "round-robin"
    _next = 0

    def choose(self, r: int, t: int) -> Choice:
        i = self._next
        self._next = (i + 1) % len(self.cluster.caches)
        return Choice(i)


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def choose(self, r: int, t: int) -> Choice:
        cl = self.cluster
        waits = cl.waits_for(t, int(self.trace.ingress[r]))
        return Choice(self._least(t, np.arange(len(cl.caches)), waits))


class NearestPolicy(Policy):
    name = "nearest"

    def choose(self, r: int, t: int) -> Choice:
        cl = self.cluster
        x = int(self.trace.ingress[r])
        here = np.nonzero(cl.site == x)[0]
        return Choice(self._least(t, here, cl.waits_for(t, x)[here]))


class ComputeAwarePolicy(Policy):
    name = "compute-aware"

    def choose(self, r: int, t: int) -> Choice:
        cl = self.cluster
        req = self.trace.requests[r]
        x = int(self.trace.ingress[r])
        cost = cl.inst_rtt[x] + cl.waits_for(t, x) + cl.prefill_ms(req.input_length, 0)
        return Choice(self._least(t, np.arange(len(cl.caches)), cost))


class OraclePolicy(Policy):
    """Exact, instant knowledge; the selector's cost model on it; ties to the lowest index
    (as the selector's stable sort over its slots).

    In the physical arrival model the oracle binds late and may hand back, as the
    two-level decision does: the site is fixed when the request leaves its ingress, and a
    request bound for another site is placed on one of that site's instances when it
    gets there, on the exact state of that moment, unless going back to its ingress's
    site (the detour added) is faster, in which case it is placed there on its return.
    (Binding the instance at the ingress instead loses to requests routed later that
    arrive first.) In the routed model none of this arises: the state does not change
    between routing and arrival."""

    name = "oracle"

    def choose(self, r: int, t: int) -> Choice:
        total, source, hits = self._costs(r, t)
        best = int(np.argmin(total))
        return Choice(best, None if source[best] < 0 else int(source[best]), hits[best])

    def route(self, r: int, t: int) -> Choice | Handoff:
        choice = self.choose(r, t)
        cl = self.cluster
        x, s = int(self.trace.ingress[r]), int(cl.site[choice.instance])
        if not cl.physical or s == x:
            return choice
        return Handoff(s, cl.arrival_ms(x, choice.instance, t), t, None)

    def arrive(self, r: int, handoff: Handoff) -> Choice | Handoff:
        cl = self.cluster
        total, source, hits = self._costs(r, handoff.sent_ms + handoff.extra_rtt_ms)
        here = np.nonzero(cl.site == handoff.site)[0]
        best = int(here[np.argmin(total[here])])
        if handoff.bounced:
            return Choice(
                best,
                None if source[best] < 0 else int(source[best]),
                hits[best],
                extra_rtt_ms=handoff.extra_rtt_ms,
            )
        x = int(self.trace.ingress[r])
        if handoff.site != x:
            detour = float(cl.rtt[x, handoff.site])
            back, _, _ = self._costs(r, handoff.sent_ms + detour)
            home = np.nonzero(cl.site == x)[0]
            if float(back[home].min()) + detour < float(total[best]):
                at = handoff.at_ms + detour / 2
                return Handoff(x, at, handoff.sent_ms, None, extra_rtt_ms=detour, bounced=True)
        return Choice(best, None if source[best] < 0 else int(source[best]), hits[best])

    def _costs(self, r: int, t: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Each instance's estimated TTFT for request r routed at t, the instance it
        would pull from (-1: none), and the prefix it holds."""
        cl = self.cluster
        req = self.trace.requests[r]
        keys = self.trace.key_lists[r]
        n = len(cl.caches)
        hits = [cl.lookup(i, keys) for i in range(n)]
        x = int(self.trace.ingress[r])
        base = cl.inst_rtt[x] + cl.waits_for(t, x)
        total = np.array(
            [
                base[i] + cl.fetch_ms(h.tiers) + cl.prefill_ms(req.input_length, h.depth)
                for i, h in enumerate(hits)
            ]
        )
        source = np.full(n, -1)
        if cl.sc.remote_kv:
            src = max(range(n), key=lambda i: (hits[i].depth, -i))
            blocks = min(hits[src].depth, -(-req.input_length // cl.sc.block_tokens))
            if blocks > 0:
                tiers = hits[src].tiers[:blocks]
                remote_prefill = cl.prefill_ms(req.input_length, hits[src].depth)
                for i in range(n):
                    if i == src:
                        continue
                    cand = base[i] + cl.pull_ms(src, i, tiers) + remote_prefill
                    if cand < total[i]:
                        total[i], source[i] = cand, src
        return total, source, [h.depth for h in hits]


class CatsprotoPolicy(Policy):
    """The ingress site's path selector on what verified advertisements told it."""

    name = "catsproto"

    def __init__(
        self, cluster: Cluster, trace: PreparedTrace, seed: int, *, exact: bool = False
    ) -> None:
        super().__init__(cluster, trace, seed)
        self.control = ControlPlane(cluster.sc, cluster, exact=exact)
        if len(trace):
            self.control.start(int(trace.arrival_ms[0]))
        self._nodes = [ingress_node(s) for s in cluster.sc.sites]
        self._index = {ipaddress.ip_address(a): i for a, i in self.control.address_index.items()}
        self.fallbacks = 0
        sc = cluster.sc
        shared = sc.selector_site
        self._query_rtt = [
            sc.rtt(site, shared) if shared is not None and sc.decision_rtt else 0.0
            for site in sc.sites
        ]
        self.last_decision = None

    def advance(self, t: int) -> None:
        self.control.advance(t)

    def view(self, ingress: int, instance: int) -> frozenset[int]:
        """The keys the deciding C-PS's summaries of `instance` were built from."""
        return self.control.views[self.control.selector_of[ingress]][instance]

    def choose(self, r: int, t: int) -> Choice:
        x = int(self.trace.ingress[r])
        req = self.trace.requests[r]
        request = Request(CS_ID, self.trace.keys[r], req.input_length, self._nodes[x])
        try:
            decision = self.control.selectors[self.control.selector_of[x]].decide(request, t)
        except NoInstanceError:  # nothing heard yet (the very first requests)
            self.fallbacks += 1
            cl = self.cluster
            here = np.nonzero(cl.site == x)[0]
            return Choice(self._least(t, here, cl.waits(t)[here]), fallback=True)
        self.last_decision = decision
        chosen = decision.chosen
        source = chosen.kv_source
        return Choice(
            self._index[chosen.address],
            None if source is None else self._index[source],
            chosen.cached_blocks,
            extra_rtt_ms=self._query_rtt[x],
            work_ms=chosen.prefill_ms + chosen.fetch_ms,
        )


POLICIES: dict[str, Callable[[Cluster, PreparedTrace, int], Policy]] = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "nearest": NearestPolicy,
    "compute-aware": ComputeAwarePolicy,
    "catsproto": CatsprotoPolicy,
    "oracle": OraclePolicy,
}


def make_policy(name: str, cluster: Cluster, trace: PreparedTrace, seed: int) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(cluster, trace, seed)

"""The control plane of the simulation: what a C-PS at each ingress site knows, and when.

Strategy. Nothing reaches a selector except through the real path. Every update
interval each instance's `catsproto.node.AdvertisementBuilder` is polled with the
instance's compute state; its dampener decides whether anything leaves. Each route it
returns is signed (`catsproto.security.sign`) for its own prefix, encoded
(`catsproto.wire.encode`), and scheduled for delivery to the selector of every ingress
site after the one-way delay between the sites plus `per_hop_ms` per BGP hop. On
delivery the selector's `catsproto.security.Receiver` verifies the bytes and only an
accepted advertisement is merged into that selector's `catsproto.selector.RIB`. So the
summaries' false positives, the dampening, the delay and the signature checks all shape
what `PathSelector.decide` sees.

Each ingress site runs its own selector (RIB, key index, pending-work bookkeeping) over
a star network: its ingress node reaches every site's node with a link of half the
scenario's round trip, so the selector's RTT term is exactly the scenario's. With
remote KV pulls, sites are linked to each other too (the scenario then checks that its
RTT table is a metric, so shortest paths keep those round trips).

Keys and seeds are derived from the scenario's seed: the run is deterministic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import ipaddress
from dataclasses import dataclass, field

from catsproto import wire
from catsproto.node import (
    AdvertisementBuilder,
    AdvertisementTooLarge,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
)
from catsproto.security import (
    Policy,
    Receiver,
    SigningKey,
    TrustStore,
    Verdict,
    authorise,
    sign,
)
from catsproto.selector import RIB, Link, Network, Path, PathSelector, SelectorConfig
from catsproto.sim.cluster import Cluster, ceil_ms
from catsproto.sim.scenario import Scenario, ScenarioError
from catsproto.summary import KIND_EXACT, NoRoomError, Summary

__all__ = ["CS_ID", "ControlPlane", "ControlStats", "ingress_node"]

CS_ID = 1
_SCORE_SPAN = 10  # L1/L2 scores are 0..10 (node.metrics), so no move reaches 11
_NOT_AFTER_MS = 1 << 62


def enrol(
    sc: Scenario,
    trust: TrustStore,
    operator: SigningKey,
    key: SigningKey,
    address: str,
    site: int,
    shards: str | None,
    dampening: DampeningPolicy,
    *,
    exact: bool,
    target_fpr: float | None = None,
) -> tuple[TrustStore, BuilderConfig]:
    """An origin (an instance, or a site's aggregate) joins the control plane: the
    operator authorises its key for its /32, shard range and site, and its builder's
    config."""
    routes = [f"{address}/32"] + ([shards] if shards else [])
    delegation = authorise(
        operator,
        key.public.raw,
        cs_ids=[CS_ID],
        routes=routes,
        addresses=[f"{address}/32"],
        sites=[site + 1],
        not_before_ms=0,
        not_after_ms=_NOT_AFTER_MS,
    )
    cfg = BuilderConfig(
        cs_id=CS_ID,
        address=address,
        model_id=sc.model_id,
        block_size=sc.block_tokens,
        bytes_per_block=sc.bytes_per_block,
        site_id=site + 1,
        secret_id=1,
        target_fpr=0.0 if exact else (target_fpr or sc.target_fpr),
        summary_kind=KIND_EXACT if exact else sc.summary_kind,
        snapshot_every=sc.snapshot_every,
        seed=sc.seed,
        max_message_bytes=sc.max_message_bytes,
        shard_range=shards,
        dampening=dampening,
        main_on_summary_change=sc.main_on_summary_change,
    )
    return trust.with_delegation(delegation), cfg


class MeasuredNetwork(Network):
    """The selector's network with end-to-end paths as a network metric agent measures
    them (the scenario's RTT table), not re-derived by shortest-path routing: a round
    trip table need not be a metric (S1's A-D is 40 ms though A-B-D is 30), and what
    the traffic sees is what the table says."""

    def __init__(self, measured: dict[tuple[str, str], Path], links: list[Link]) -> None:
        super().__init__(links)
        self.measured = measured

    def path(self, src: str, dst: str) -> Path | None:
        found = self.measured.get((src, dst))
        return found if found is not None else super().path(src, dst)


def ingress_node(site: str) -> str:
    return f"in-{site}"


def _seed(seed: int, label: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{label}".encode(), digest_size=32).digest()


@dataclass
class ControlStats:
    advertisements: int = 0  # routes announced (each signed once by its origin)
    bytes: int = 0  # signed attribute-value bytes announced by all origins
    deliveries: int = 0  # advertisements verified by some selector
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    full_checks: int = 0  # complete receive-path checks (decode, signature, scope, replay)
    reused_verdicts: int = 0  # identical checks at another selector, verdict reused
    builds: int = 0  # polls that produced advertisements
    skipped_polls: int = 0  # builders not asked: their dampener could only say no
    decoded: int = 0  # summary bodies decoded (`SharedDecode`)
    reused_decodes: int = 0  # the same body at another RIB: its decoded summary reused


class SharedDecode:
    """`Summary.decode` for every RIB of one run. The same signed route reaches every
    C-PS, so each body would be decoded once per RIB; this decodes it once and hands the
    same summary to the others (summaries are never changed in place: a delta makes a
    new view). A body that does not decode raises at every RIB, as before. Bounded."""

    LIMIT = 4096

    def __init__(self, stats: ControlStats) -> None:
        self._memo: dict[tuple[int, bytes, bytes], Summary] = {}
        self._stats = stats

    def __call__(self, kind: int, params: bytes, body: bytes) -> Summary:
        name = (kind, params, body)
        summary = self._memo.get(name)
        if summary is not None:
            self._stats.reused_decodes += 1
            return summary
        summary = Summary.decode(kind, params, body)
        self._stats.decoded += 1
        if len(self._memo) >= self.LIMIT:
            self._memo.clear()
        self._memo[name] = summary
        return summary


class ControlPlane:
    skip_quiet_polls = True  # do not ask builders whose dampener could only say no

    def __init__(self, sc: Scenario, cluster: Cluster, *, exact: bool = False) -> None:
        self.sc = sc
        self.cluster = cluster
        self.exact = exact or sc.update_interval_ms == 0
        self.stats = ControlStats()
        n = sc.n_instances
        operator = SigningKey.from_seed(_seed(sc.seed, "operator"))
        trust = TrustStore().with_operator(operator.public.raw, "eval-operator")
        self.keys: list[SigningKey] = []
        self.builders: list[AdvertisementBuilder] = []
        self.address_index: dict[object, int] = {}
        dampening = DampeningPolicy(
            min_interval_ms=sc.update_interval_ms,
            max_interval_ms=sc.refresh_interval_ms,
            change_threshold=sc.change_threshold,
            score_threshold=sc.score_threshold,
            wait_threshold_ms=sc.wait_threshold_ms,
        )
        for i in range(n):
            s, j = sc.site_of(i), i % sc.instances_per_site
            address = f"10.{s + 1}.0.{j + 1}"
            shards = f"10.255.{i}.0/24" if sc.sharded else None
            key = SigningKey.from_seed(_seed(sc.seed, f"instance-{i}"))
            trust, cfg = enrol(sc, trust, operator, key, address, s, shards, dampening, exact=exact)
            cfg = dataclasses.replace(cfg, hot_prefixes=sc.hot_prefixes)
            self.keys.append(key)
            self.builders.append(AdvertisementBuilder(cfg, cluster.caches[i], epoch=1))
            self.address_index[ipaddress.ip_address(address)] = i
        # one C-PS per ingress site, or one shared C-PS at a site for all ingresses
        if sc.selector_site is None:
            self.selector_sites = list(range(len(sc.sites)))
            self.selector_of = list(range(len(sc.sites)))
        else:
            self.selector_sites = [sc.sites.index(sc.selector_site)]
            self.selector_of = [0] * len(sc.sites)
        k = len(self.selector_sites)
        self.receivers = [Receiver(trust, policy=Policy()) for _ in range(k)]
        self.decode = SharedDecode(self.stats)
        self.ribs = [RIB(decode=self.decode) for _ in range(k)]
        site_nodes = {s + 1: name for s, name in enumerate(sc.sites)}
        network = self._network()
        self.selectors = [
            PathSelector(
                self.ribs[x],
                network,
                SelectorConfig(
                    site_nodes=site_nodes,
                    request_bytes_per_token=sc.request_bytes_per_token,
                    allow_remote_kv=sc.remote_kv,
                    default_block_size=sc.block_tokens,
                    spread_ms=sc.selector_spread_ms,
                    peer_selectors=k if sc.selector_peers else 1,
                    seed=sc.seed * 1000 + x,
                    price_evictions=sc.price_evictions,
                    reuse_horizon_ms=sc.reuse_horizon_ms,
                ),
            )
            for x in range(k)
        ]
        # what each selector's summaries say, by instance: the key set at build time
        self.views: list[list[frozenset[int]]] = [[frozenset() for _ in range(n)] for _ in range(k)]
        self._heap: list[tuple[int, int, int, int, object, bytes, frozenset[int] | None]] = []
        self._counter = 0
        self._polled: list[ComputeState | None] = [None] * n
        # per builder, its last update: (when, keys then advertised) and (when, the
        # queue wait its main route then told receivers); for `_quiet`
        self._sent: list[tuple[int, int] | None] = [None] * n
        self._sent_wait: list[tuple[int, float] | None] = [None] * n
        # verdicts by (bytes, route): (replay position the checker saw before, verdict)
        self._verdicts: dict[tuple[bytes, object], tuple[object, object]] = {}
        self._next_tick = 0
        self._delay = [
            [self._propagation_ms(a, b) for b in self.selector_sites] for a in range(len(sc.sites))
        ]

    def _network(self) -> MeasuredNetwork:
        sc = self.sc
        bw = sc.link_bandwidth_mbps
        table: dict[tuple[str, str], Path] = {}
        for a in sc.sites:
            for b in sc.sites:
                delay = sc.rtt(a, b) / 2
                table[(ingress_node(a), b)] = Path((ingress_node(a), b), delay, bw)
                if a != b:
                    table[(a, b)] = Path((a, b), delay, bw)
        links = [Link(ingress_node(a), a, sc.rtt(a, a) / 2, bw) for a in sc.sites]
        return MeasuredNetwork(table, links)

    def _propagation_ms(self, origin_site: int, ingress_site: int) -> float:
        sc = self.sc
        if not sc.propagation:
            return 0.0
        a, b = sc.sites[origin_site], sc.sites[ingress_site]
        hops = 1 if a == b else 2  # instance -> its egress speaker (-> the ingress's)
        return sc.rtt(a, b) / 2 + sc.per_hop_ms * hops

    # ---- advertising -------------------------------------------------------------------

    def compute_state(self, i: int, t: float) -> ComputeState:
        sc, cl = self.sc, self.cluster
        wait_ms = max(0.0, float(cl.free_at[i]) - t)
        waiting, running = cl.queue_counts(i, t)
        cache = cl.caches[i]
        top = cache.order[0]
        interval = max(sc.update_interval_ms, 1000)
        return ComputeState(
            waiting=waiting,
            running=running,
            outstanding_prefill_tokens=round(wait_ms * sc.prefill_tps / 1000),
            prefill_rate_tps=sc.prefill_tps,
            utilisation=min(1.0, wait_ms / interval),
            kv_utilisation=cache.count(top) / max(1, cache.specs[top].capacity_blocks),
        )

    def poll(self, t: int, *, force: bool = False) -> None:
        """Poll every builder at time t; sign, encode and schedule what leaves.

        A builder whose cache has no pending change and whose compute state equals the
        one it was last polled with can only answer "idle" unless its refresh is due,
        so it is not asked (the same decisions, without rebuilding its metrics)."""
        refresh = self.sc.refresh_interval_ms
        for i, builder in enumerate(self.builders):
            state = self.compute_state(i, t)
            last = builder.dampener.last_sent_ms
            if (
                not force
                and last is not None
                and t - last < refresh
                and state == self._polled[i]
                and not builder.cache.pending_changes()
            ):
                continue
            if not force and self.skip_quiet_polls and self._quiet(i, t, state):
                self.stats.skipped_polls += 1
                continue
            self._polled[i] = state
            self.stats.polls += 1
            try:
                routes = builder.poll(t, state, force=force)
            except (AdvertisementTooLarge, NoRoomError) as exc:  # the scenario's, not a bug
                raise ScenarioError(
                    f"max_message_bytes {self.sc.max_message_bytes}: instance "
                    f"{self.sc.instance_names()[i]}'s advertisement at {t} ms does not fit: "
                    f"{exc}"
                ) from None
            if builder.dampener.last_sent_ms == t:  # what receivers were told at t
                self._sent[i] = (t, builder.cache.used_blocks())
                if any(r.prefix == builder.main_prefix for r in routes):
                    self._sent_wait[i] = (t, state.wait_ms)
            if not routes:
                continue
            self.stats.builds += 1
            cache = self.cluster.caches[i]
            snapshot: frozenset[int] | None = None
            if any(r.tier is not None or r.advertisement.cache_summaries for r in routes):
                snapshot = frozenset().union(*(cache.keys(tier).tolist() for tier in cache.order))
            origin_site = self.sc.site_of(i)
            for route in routes:
                signed = sign(route.advertisement, self.keys[i], route.prefix)
                value = wire.encode(signed)
                self.stats.advertisements += 1
                self.stats.bytes += len(value)
                for x in range(len(self.selectors)):
                    at = ceil_ms(t + self._delay[origin_site][x])
                    self._counter += 1
                    heapq.heappush(
                        self._heap, (at, self._counter, x, i, route.prefix, value, snapshot)
                    )

    def _quiet(self, i: int, t: int, state: ComputeState) -> bool:
        """Can builder i's dampener only say "idle" or "below threshold" at t? Its
        rules (`node.dampening`) on what this plane recorded of its last update: no
        refresh due, no score trigger possible (scores span 0..10), too few keys
        changed, the queue wait within the threshold of the receivers' prediction.
        False whenever the record is not of the builder's last update."""
        builder = self.builders[i]
        p = builder.dampener.policy
        last, sent = builder.dampener.last_sent_ms, self._sent[i]
        if last is None or sent is None or sent[0] != last or t - last >= p.max_interval_ms:
            return False
        if p.score_threshold <= _SCORE_SPAN:
            return False
        changed = builder.cache.pending_changes()
        if changed >= p.min_changed_keys and changed >= p.change_threshold * max(1, sent[1]):
            return False
        told = self._sent_wait[i]
        if told is not None:
            error = state.wait_ms - max(0.0, told[1] - (t - told[0]))
            if abs(error) >= p.wait_threshold_ms:
                return False
        return True

    def deliver(self, t: int) -> None:
        """Verify and merge every advertisement that has arrived by time t."""
        heap = self._heap
        while heap and heap[0][0] <= t:
            at, _, x, i, prefix, value, snapshot = heapq.heappop(heap)
            self.stats.deliveries += 1
            verdict = self._check(x, value, prefix, at)
            self.receivers[x] = self.receivers[x].commit(verdict)
            if not verdict.ok or verdict.advertisement is None:
                reason = verdict.reason.value
                self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
                continue
            self.stats.accepted += 1
            self.ribs[x].accept(verdict.advertisement, at)
            if snapshot is not None:
                self.views[x][i] = snapshot
            self._accepted(x, i, verdict.advertisement, at)

    def _accepted(self, x: int, i: int, adv: wire.Advertisement, at: int) -> None:
        """Hook: selector x accepted instance i's advertisement at `at` (a site's own
        C-PS in `sim.hierarchy` merges its instances' routes here as well)."""

    def _check(self, x: int, value: bytes, prefix: object, at: int) -> Verdict:
        """`Receiver.check` of selector x. Every selector receives an origin's routes in
        the same order, so when this route's replay state at x is the one the first
        checker saw and the timestamp is still fresh, x's check would return the same
        verdict: it is reused (saving a decode and an Ed25519 verify per extra
        selector); otherwise x checks in full."""
        receiver = self.receivers[x]
        memo = self._verdicts.get((value, prefix))
        if memo is not None:
            before, verdict = memo
            assert isinstance(verdict, Verdict)
            route = verdict.route
            adv = verdict.advertisement
            if (
                route is not None
                and adv is not None
                and receiver.window.get(route) == before
                and adv.timestamp_ms >= at - receiver.policy.max_age_ms
                and adv.timestamp_ms <= at + receiver.policy.max_future_ms
            ):
                self.stats.reused_verdicts += 1
                return verdict
        verdict = receiver.check(value, prefix, at)  # type: ignore[arg-type]
        self.stats.full_checks += 1
        if verdict.route is not None:
            self._verdicts[(value, prefix)] = (receiver.window.get(verdict.route), verdict)
        if len(self._verdicts) > 4096:
            self._verdicts.clear()
        return verdict

    def advance(self, t: int) -> None:
        """Run the control plane up to (and including) time t, before a request at t."""
        if self.exact:
            self.poll(t, force=True)
            self.deliver(t)
            return
        step = self.sc.update_interval_ms
        while self._next_tick <= t:
            tick = self._next_tick
            self.deliver(tick)
            self.poll(tick)
            self._next_tick += step
        self.deliver(t)

    def start(self, t0: int) -> None:
        """First tick at the first arrival (aligned to the update interval)."""
        step = max(1, self.sc.update_interval_ms)
        self._next_tick = (t0 // step) * step

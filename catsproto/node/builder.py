"""The advertisement builder of a C-SMA: cache model + compute state -> routes to announce.

Strategy. The caller owns the clock and calls `AdvertisementBuilder.poll(now_ms, state)`
as often as it likes (every event batch, every 100 ms ...). The dampener decides whether
anything leaves; if so the builder returns a list of `RouteAdvertisement`s, each an
*unsigned* `Advertisement` and the host prefix to announce it on. Signing and encoding
belong to the caller (`catsproto.security`, then `wire.encode`), so the builder leaves
`reserve_bytes` of every attribute free for the signature and delegation TLVs.

Two layouts:

* **single route** (no ``shard_range``): one advertisement on the instance's own address
  carries everything — metrics, cache model, capacity, hot prefixes and one
  cache-summary entry per tier. Each tier gets an equal share of the attribute budget;
  a tier that outgrows its share raises `AdvertisementTooLarge` (configure a shard
  range, or extended messages, for larger caches).
* **sharded** (``shard_range`` given, e.g. ``10.255.1.0/24``): the instance address
  carries metrics, model, capacity and hot prefixes; each tier's summary is cut by
  `catsproto.summary.ShardedSender` into key-range shards that fit one UPDATE, and shard
  s of tier t rides host route ``shard_range[(t - 1) × stride + s]`` where stride is a
  quarter of the range (so a /24 allows 64 shards per tier).

Versions, snapshots and deltas come from `catsproto.summary`: per tier (and shard) a
sender announces a snapshot or a cumulative delta, whichever is smaller. Every
advertisement gets the next sequence number of the origin's (epoch, sequence) — the
epoch is given by the caller and must grow on every restart. Unchanged shards are not
re-sent on a change, but every update also carries any route (shard or main) not sent for
the dampening policy's max interval, and the dampener's refresh re-sends everything (new
sequence and timestamp), so receivers' freshness checks keep passing however busy the
other routes are. A route re-sent with nothing changed whose last update is a delta that
has stood for the max interval announces a snapshot instead (a new version), so a
receiver that missed the snapshot catches up on a quiet shard.
Pure: the clock, the epoch and the filter seed are parameters.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass, field

from catsproto import wire
from catsproto.node.cache import TieredCache
from catsproto.node.dampening import Dampener, DampeningPolicy, Decision, Reason
from catsproto.node.metrics import CatsMetrics, ComputeState, ScoreScale, cats_metrics
from catsproto.summary import ENTRY_OVERHEAD, ShardedSender, ShardUpdate, attribute_value_budget
from catsproto.wire import (
    Advertisement,
    CacheModel,
    CacheSummaries,
    Capacity,
    HotPrefix,
    HotPrefixes,
    KeyScheme,
    Origin,
    Sequence,
    SummaryEntry,
    SummaryKind,
    Tier,
    Timestamp,
    Version,
)

__all__ = [
    "AdvertisementBuilder",
    "AdvertisementTooLarge",
    "BuilderConfig",
    "BuilderStats",
    "RouteAdvertisement",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
HOT_PREFIX_BYTES = 12


class AdvertisementTooLarge(ValueError):
    """The cache state does not fit the configured message size and layout."""


@dataclass(frozen=True)
class BuilderConfig:
    """What the builder needs besides the cache model.

    cs_id, address, site_id: the Origin TLV. model_id, block_size, secret_id, key_scheme:
    the cache-model TLV (which keying secret and scheme made the block keys).
    bytes_per_block: KV bytes of one block (`ModelShape.bytes_per_block`).
    target_fpr, summary_kind (None: smallest), snapshot_every, seed: summary senders.
    hot_prefixes: how many prefixes to name exactly. max_message_bytes: 4096, or 65535
    with RFC 8654 extended messages. as_path_hops: longest AS path the UPDATE will
    carry. reserve_bytes: left free in every attribute for signature and delegation.
    shard_range: the instance's own range for shard routes (None: single route).
    main_on_summary_change: with shard routes, False sends a change of the summaries
    alone on the changed shard routes only; the main route (metrics) then goes out
    first, on refresh and when the metrics themselves moved enough to be wanted.
    """

    cs_id: int
    address: str
    model_id: str
    block_size: int
    bytes_per_block: int
    site_id: int = 0
    secret_id: int = 0
    key_scheme: KeyScheme = KeyScheme.BLAKE2B64_CHAINED
    target_fpr: float = 0.01
    summary_kind: int | None = None
    snapshot_every: int = 8
    seed: int = 0
    hot_prefixes: int = 8
    max_message_bytes: int = 4096
    as_path_hops: int = 2
    reserve_bytes: int = 384
    shard_range: str | None = None
    dampening: DampeningPolicy = field(default_factory=DampeningPolicy)
    score_scale: ScoreScale = field(default_factory=ScoreScale)
    main_on_summary_change: bool = True


@dataclass(frozen=True, slots=True)
class RouteAdvertisement:
    """One unsigned advertisement and the host prefix that carries it.

    tier and shard are None for the instance's main route.
    """

    prefix: IPNetwork
    advertisement: Advertisement
    reason: Reason
    tier: Tier | None = None
    shard: int | None = None

    @property
    def epoch(self) -> int:
        return self.advertisement.sequence.epoch

    @property
    def sequence(self) -> int:
        return self.advertisement.sequence.sequence


@dataclass(slots=True)
class BuilderStats:
    polls: int = 0
    updates: int = 0
    """Polls that produced advertisements."""
    advertisements: int = 0
    suppressed: int = 0
    """Polls where a change big enough for an update was held back by the min interval."""
    bytes: int = 0
    """Unsigned attribute-value bytes of every advertisement built."""
    by_reason: dict[str, int] = field(default_factory=dict)


class AdvertisementBuilder:
    """Turns a `TieredCache` and compute state into dampened, versioned advertisements.

    Use: ``routes = builder.poll(now_ms, state)``; for each route sign
    ``route.advertisement``, `wire.encode` it and announce it on ``route.prefix``.
    """

    def __init__(self, config: BuilderConfig, cache: TieredCache, epoch: int) -> None:
        if not 0 <= epoch < 1 << 32:
            raise ValueError(f"epoch {epoch} is not a u32")
        self.config = config
        self.cache = cache
        self.epoch = epoch
        self.sequence = 0
        self.stats = BuilderStats()
        self.dampener = Dampener(config.dampening)
        self.address = ipaddress.ip_address(config.address)
        self.main_prefix: IPNetwork = ipaddress.ip_network(self.address)
        self.shard_range: IPNetwork | None = (
            ipaddress.ip_network(config.shard_range) if config.shard_range else None
        )
        if self.shard_range is not None and self.shard_range.version != self.address.version:
            raise ValueError("shard_range and address must be the same IP version")
        self._origin = Origin(config.cs_id, config.site_id, self.address)
        self._model = CacheModel(
            config.model_id, config.block_size, config.key_scheme, config.secret_id
        )
        self._value_budget = (
            attribute_value_budget(
                config.max_message_bytes,
                ipv6=self.address.version == 6,
                as_path_hops=config.as_path_hops,
            )
            - config.reserve_bytes
        )
        self._senders: dict[Tier, ShardedSender] = {}
        self._last_shards: dict[tuple[Tier, int], ShardUpdate] = {}
        self._made_ms: dict[tuple[Tier, int], int] = {}  # when a stream's last update was new
        self._sent_ms: dict[tuple[Tier, int] | None, int] = {}  # route (None: main) -> last sent
        self._advertised_keys = 0
        self._last_metrics: CatsMetrics | None = None
        self._advertised_wait: tuple[int, float] | None = None  # (when, queue wait ms)

    # ---- the API ---------------------------------------------------------------------

    def poll(
        self, now_ms: int, state: ComputeState, *, force: bool = False
    ) -> list[RouteAdvertisement]:
        """Advertisements due at `now_ms` (often none). `force` skips the dampening."""
        self.stats.polls += 1
        metrics = self._metrics(state)
        score_delta = self._score_delta(metrics)
        wait_error = self._wait_error(now_ms, state)
        decision = self.dampener.decide(
            now_ms,
            self.cache.pending_changes(),
            self._advertised_keys,
            score_delta,
            wait_error_ms=wait_error,
            force=force,
        )
        if not decision.send:
            if decision.reason is Reason.SUPPRESSED:
                self.stats.suppressed += 1
            return []
        metrics_due = self.dampener.wanted(0, 0, score_delta, wait_error)
        return self._build(now_ms, metrics, decision, state.wait_ms, metrics_due=metrics_due)

    def decide(self, now_ms: int, state: ComputeState) -> Decision:
        """What `poll` would decide now, without building anything."""
        metrics = self._metrics(state)
        return self.dampener.decide(
            now_ms,
            self.cache.pending_changes(),
            self._advertised_keys,
            self._score_delta(metrics),
            wait_error_ms=self._wait_error(now_ms, state),
        )

    def routes(self) -> list[IPNetwork]:
        """Every prefix announced so far in this epoch (main route first)."""
        return [self.main_prefix] + [self._shard_prefix(t, i) for t, i in self._last_shards]

    # ---- building --------------------------------------------------------------------

    def _metrics(self, state: ComputeState) -> CatsMetrics:
        return cats_metrics(state, self.config.score_scale)

    def _score_delta(self, metrics: CatsMetrics) -> int:
        last = self._last_metrics
        if last is None:
            return 0
        deltas = [abs(metrics.l2.score - last.l2.score)]
        pairs = zip(metrics.l1.scores, last.l1.scores, strict=True)
        deltas += [abs(a.score - b.score) for a, b in pairs]
        return max(deltas)

    def _wait_error(self, now_ms: int, state: ComputeState) -> float:
        """Queue wait now minus what receivers predict from the last advertisement: its
        wait, drained at the prefill rate since (see catsproto.selector)."""
        if self._advertised_wait is None:
            return 0.0
        at, wait = self._advertised_wait
        return state.wait_ms - max(0.0, wait - (now_ms - at))

    def _next_sequence(self) -> Sequence:
        self.sequence += 1
        return Sequence(self.epoch, self.sequence)

    def _hot(self) -> HotPrefixes | None:
        hot = self.cache.hot_prefixes(self.config.hot_prefixes)
        if not hot:
            return None
        return HotPrefixes(tuple(HotPrefix(k, d) for k, d in sorted(hot)))

    def _main_tlvs(self, metrics: CatsMetrics) -> list[wire.TLV]:
        tlvs: list[wire.TLV] = [Version(wire.FORMAT_VERSION), self._origin]
        tlvs += [metrics.l0, metrics.l1, metrics.l2, metrics.basis, self._model]
        total = self.cache.total_blocks()
        tlvs.append(Capacity(min(self.cache.free_blocks(), total), total))
        hot = self._hot()
        if hot is not None:
            tlvs.append(hot)
        return tlvs

    def _entry(self, tier: Tier, su: ShardUpdate) -> SummaryEntry:
        spec = self.cache.specs[tier]
        u = su.update
        return SummaryEntry(
            tier,
            SummaryKind(u.kind),
            u.version,
            u.base_version,
            su.key_lo,
            su.key_hi,
            u.entry_count,
            self.config.bytes_per_block,
            spec.fetch_latency_us,
            spec.fetch_bandwidth_mbps,
            u.params(),
            u.encode(),
        )

    def _sender(self, tier: Tier, budget: int) -> ShardedSender:
        sender = self._senders.get(tier)
        if sender is None:
            sender = self._senders[tier] = ShardedSender(
                budget,
                self.config.target_fpr,
                kind=self.config.summary_kind,
                seed=self.config.seed,
                snapshot_every=self.config.snapshot_every,
            )
        return sender

    def _shard_prefix(self, tier: Tier, index: int) -> IPNetwork:
        assert self.shard_range is not None
        stride = self.shard_range.num_addresses // 4
        if index >= stride:
            raise AdvertisementTooLarge(
                f"{tier.name.lower()} needs shard {index} but {self.shard_range} allows "
                f"{stride} per tier"
            )
        at = int(self.shard_range.network_address) + (int(tier) - 1) * stride + index
        return ipaddress.ip_network((at, self.shard_range.max_prefixlen))

    def _stamp(self, now_ms: int, tlvs: list[wire.TLV]) -> Advertisement:
        return Advertisement.build(*tlvs, self._next_sequence(), Timestamp(now_ms))

    def _due(self, now_ms: int, route: tuple[Tier, int] | None) -> bool:
        """Has this route (a shard's, None for the main route) gone out, but not for the
        policy's max interval?"""
        sent = self._sent_ms.get(route)
        return sent is not None and now_ms - sent >= self.config.dampening.max_interval_ms

    def _stale_deltas(self, now_ms: int, tier: Tier, indices: set[int]) -> set[int]:
        """Of these unchanged streams, those announcing the same delta for the max interval:
        a receiver that missed its base never catches up on them without a snapshot."""
        wait = self.config.dampening.max_interval_ms
        return {
            i
            for i in indices
            if self._last_shards[(tier, i)].update.is_delta
            and now_ms - self._made_ms[(tier, i)] >= wait
        }

    def _update_streams(
        self,
        now_ms: int,
        tier: Tier,
        sender: ShardedSender,
        keys: object,
        snapshot: Collection[int] = (),
    ) -> set[int]:
        """Run the tier's sender; remember its announcements; the shards announced."""
        announced = set()
        for su in sender.update(keys, snapshot=snapshot):
            self._last_shards[(tier, su.index)] = su
            self._made_ms[(tier, su.index)] = now_ms
            announced.add(su.index)
        return announced

    def _build(
        self,
        now_ms: int,
        metrics: CatsMetrics,
        decision: Decision,
        wait_ms: float,
        *,
        metrics_due: bool = True,
    ) -> list[RouteAdvertisement]:
        full = decision.reason in (Reason.INITIAL, Reason.REFRESH, Reason.FORCED)
        main_tlvs = self._main_tlvs(metrics)
        out: list[RouteAdvertisement] = []
        send_main = True
        if self.shard_range is None:
            budget = self._value_budget - _tlvs_size(main_tlvs) - 32  # seq + timestamp
            share = (budget - 4) // len(self.cache.order) + 4  # one TLV header for all
            if share <= ENTRY_OVERHEAD:
                raise AdvertisementTooLarge(f"no room for summaries: {budget} bytes left")
            entries = []
            for tier in self.cache.order:
                sender = self._sender(tier, share)
                keys = self.cache.keys(tier)
                changed = self._update_streams(now_ms, tier, sender, keys)
                if not changed and (tier, 0) in self._last_shards:
                    stale = self._stale_deltas(now_ms, tier, {0})
                    if stale:
                        self._update_streams(now_ms, tier, sender, keys, snapshot=stale)
                if sender.shard_bits:
                    raise AdvertisementTooLarge(
                        f"{tier.name.lower()} summary of {self.cache.count(tier)} keys "
                        f"does not fit {share} bytes: configure a shard range"
                    )
                entries.append(self._entry(tier, self._last_shards[(tier, 0)]))
            main_tlvs.append(CacheSummaries(tuple(entries)))
            main = self._stamp(now_ms, main_tlvs)
            out.append(RouteAdvertisement(self.main_prefix, main, decision.reason))
        else:
            send_main = full or metrics_due or self.config.main_on_summary_change
            main_reason = decision.reason
            if not send_main and self._due(now_ms, None):
                send_main, main_reason = True, Reason.REFRESH
            if send_main:
                main = self._stamp(now_ms, main_tlvs)
                out.append(RouteAdvertisement(self.main_prefix, main, main_reason))
            shard_tlvs: list[wire.TLV] = [Version(wire.FORMAT_VERSION), self._origin, self._model]
            budget = self._value_budget - _tlvs_size(shard_tlvs) - 32
            refresh_ms = self.config.dampening.max_interval_ms
            for tier in self.cache.order:
                sender = self._sender(tier, budget)
                keys = self.cache.keys(tier)
                changed = self._update_streams(now_ms, tier, sender, keys)
                # a route not sent for the max interval goes out with this update, so its
                # signed timestamp stays fresh however busy the other routes are
                again = {
                    r[1]
                    for r, at in self._sent_ms.items()
                    if r is not None and r[0] == tier and (full or now_ms - at >= refresh_ms)
                }
                stale = self._stale_deltas(now_ms, tier, again - changed)
                snapped = (
                    self._update_streams(now_ms, tier, sender, keys, stale) if stale else set()
                )
                for index in sorted(changed | again | snapped):
                    entry = self._entry(tier, self._last_shards[(tier, index)])
                    adv = self._stamp(now_ms, [*shard_tlvs, CacheSummaries((entry,))])
                    prefix = self._shard_prefix(tier, index)
                    reason = decision.reason if full or index in changed else Reason.REFRESH
                    out.append(RouteAdvertisement(prefix, adv, reason, tier, index))
        for r in out:
            self._sent_ms[None if r.tier is None else (r.tier, r.shard or 0)] = now_ms
        self.dampener.sent(now_ms)
        self.cache.mark_advertised()
        self._advertised_keys = self.cache.used_blocks()
        if send_main:  # what receivers now believe about the load
            self._last_metrics = metrics
            self._advertised_wait = (now_ms, wait_ms)
        self.stats.updates += 1
        self.stats.advertisements += len(out)
        self.stats.by_reason[decision.reason.value] = (
            self.stats.by_reason.get(decision.reason.value, 0) + 1
        )
        for r in out:
            self.stats.bytes += len(wire.encode(r.advertisement))
        return out


def _tlvs_size(tlvs: list[wire.TLV]) -> int:
    w = wire.Writer()
    for t in tlvs:
        t.encode_tlv(w)
    return len(w)

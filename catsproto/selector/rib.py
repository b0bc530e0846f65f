"""The selector's RIB: what verified advertisements say about each instance of a service.

Strategy: one `ServiceTable` per CS-ID keeps its instances in numbered slots, with the
numbers the cost model needs every decision (prefill rate, advertised backlog, site,
liveness) in numpy arrays indexed by slot, so a decision scores every instance in a few
vector operations. Each instance keeps one `SummaryReceiver` per (tier, shard) — the
summaries layer decides snapshot/delta/stale — and a generation number that moves
whenever any of them changes, which is what the key index (`index.py`) invalidates on.
A tier's shards never overlap: when the origin doubles its shard count, an entry of the
new layout retires the old layout's streams over its range, and an old-layout entry
arriving later is ignored (versions rise across the change).

Only advertisements that the security layer accepted reach `accept`; the RIB still
refuses what it cannot use (no summaries for an unknown kind, a broken delta) by
recording it, never by raising past its caller. Time is `now_ms`, passed in.
"""

from __future__ import annotations

import bisect
import ipaddress
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from catsproto.summary import Summary, SummaryReceiver
from catsproto.summary.versioning import Outcome
from catsproto.wire import (
    Advertisement,
    CacheModel,
    Capacity,
    CodecError,
    KeyScheme,
    L0MetricType,
    SealedCache,
    Source,
    Statistic,
    Tier,
    Unit,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_HOLD_TIME_MS = 90_000  # like BGP's default hold time: 3 missed 30 s refreshes
DEFAULT_PREFILL_TPS = 10_000.0  # tokens/s assumed until an instance advertises its rate
NOT_HEARD = (-1, -1)  # an Instance's (epoch, sequence) before anything was accepted
REJECTED_KEPT = 256  # messages of unusable summary entries kept (a long-lived daemon)

# The L0 metrics the RIB reads, each in the one unit it is priced in, as the current
# value or a mean (a site's route carries the mean over its instances); a percentile, a
# minimum or a maximum of a queue is not the queue a new request joins, and an entry of
# another unit or statistic is skipped, as an unknown metric type is. Of several entries
# of one metric the RIB takes the current value before a mean, then a measured value
# before an aggregated, an estimated and a nominal one (`_RANK`, lowest first).
_L0_READ = {
    int(L0MetricType.PREFILL_THROUGHPUT): Unit.TOKENS_PER_SECOND,
    int(L0MetricType.OUTSTANDING_PREFILL_TOKENS): Unit.COUNT,
    int(L0MetricType.WAITING_REQUESTS): Unit.COUNT,
}
_STATISTIC_RANK = {Statistic.CURRENT: 0, Statistic.MEAN: 1}
_SOURCE_RANK = {Source.MEASURED: 0, Source.AGGREGATED: 1, Source.ESTIMATED: 2, Source.NOMINAL: 3}
_SOURCES = len(_SOURCE_RANK)  # the rank of a source this code does not name


@dataclass
class TierState:
    """One tier of one instance: retrieval cost and the summaries of its shards."""

    tier: Tier
    bytes_per_block: int
    fetch_latency_us: int
    fetch_bandwidth_mbps: int
    shards: dict[tuple[int, int], SummaryReceiver] = field(default_factory=dict)
    # the shards' key ranges, sorted; they never overlap (`add`, `drop`, `overlapping`)
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def add(self, shard: tuple[int, int], receiver: SummaryReceiver) -> None:
        self.shards[shard] = receiver
        bisect.insort(self.ranges, shard)

    def drop(self, shard: tuple[int, int]) -> None:
        del self.shards[shard]
        del self.ranges[bisect.bisect_left(self.ranges, shard)]

    def overlapping(self, shard: tuple[int, int]) -> list[tuple[int, int]]:
        """The other shards whose key ranges overlap `shard` (another layout's). The
        ranges are disjoint, so sorted by their low keys they are sorted by their high
        keys too: the overlapping ones sit just below where `shard` would go."""
        lo, hi = shard
        out = []
        j = bisect.bisect_right(self.ranges, (hi, 1 << 64)) - 1  # every range starting <= hi
        while j >= 0 and self.ranges[j][1] >= lo:
            if self.ranges[j] != shard:
                out.append(self.ranges[j])
            j -= 1
        return out

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        held = np.zeros(keys.shape, dtype=bool)
        for (lo, hi), receiver in self.shards.items():
            if lo == 0 and hi == (1 << 64) - 1:
                held |= receiver.contains_many(keys)
                continue
            inside = (keys >= np.uint64(lo)) & (keys <= np.uint64(hi))
            if inside.any():
                held[inside] |= receiver.contains_many(keys[inside])
        return held

    @property
    def fpr(self) -> float:
        return max((r.state.fpr for r in self.shards.values() if r.state is not None), default=0.0)

    @property
    def stale(self) -> bool:
        return any(r.stale for r in self.shards.values())


@dataclass
class Instance:
    """Everything the RIB knows about one instance of one service."""

    slot: int
    cs_id: int
    address: IPAddress
    site_id: int
    epoch_seq: tuple[int, int] = NOT_HEARD  # (epoch, sequence) of the newest accepted
    metrics_ms: int = -1  # timestamp of the advertisement the metrics came from
    metrics_seq: tuple[int, int] = (0, 0)  # and its (epoch, sequence)
    heard_ms: int = 0  # when the RIB last accepted anything from it
    block_size: int = 0
    model_id: str = ""
    key_scheme: int = 0
    secret_id: int = 0
    prefill_tps: float = DEFAULT_PREFILL_TPS
    backlog_tokens: float = 0.0
    waiting: float = 0.0
    # its KV capacity (Capacity TLV): (timestamp, epoch, sequence) of the advertisement
    # it came from; (-1, 0, 0) before any
    capacity_stamp: tuple[int, int, int] = (-1, 0, 0)
    tiers: dict[Tier, TierState] = field(default_factory=dict)
    generation: int = 0
    fpr: float = 0.0  # worst expected false-positive rate of its summaries
    stale: bool = False  # some summary missed a delta and awaits a snapshot

    def summaries_changed(self) -> None:
        self.fpr = max((t.fpr for t in self.tiers.values()), default=0.0)
        self.stale = any(t.stale for t in self.tiers.values())

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Per key, the code of the fastest tier holding it, 0 where none does."""
        if len(self.tiers) == 1:
            (tier,) = self.tiers
            return np.where(self.tiers[tier].contains_many(keys), np.int8(tier), np.int8(0))
        where = np.zeros(keys.shape, dtype=np.int8)
        for tier in sorted(self.tiers, reverse=True):  # slowest first, fastest overwrites
            where[self.tiers[tier].contains_many(keys)] = int(tier)
        return where

    def prefix_tiers(self, keys: np.ndarray) -> np.ndarray:
        """Tier codes of a run of keys already known to be held (as `lookup`); an
        instance with one tier needs no second probe."""
        if len(self.tiers) == 1:
            return np.full(keys.shape, int(next(iter(self.tiers))), dtype=np.int8)
        return self.lookup(keys)


@dataclass
class AcceptResult:
    instance: Instance
    outcomes: list[tuple[Tier, tuple[int, int], str]]
    metrics_updated: bool


_METRICS_STAMPS = itertools.count()


class ServiceTable:
    """The instances of one CS-ID, in slots, with per-slot arrays for scoring."""

    def __init__(self, cs_id: int, capacity: int = 16):
        self.cs_id = cs_id
        self.instances: list[Instance | None] = []
        self.by_address: dict[IPAddress, Instance] = {}
        self.generation = 0  # bumps on any summary change of any slot
        self.site_version = 0  # bumps when a slot's site changes
        self.occupancy_version = 0  # bumps with any slot's `occupant`
        self.live_mask = 0  # bit per occupied slot
        self.key_space_version = 0  # bumps when a slot's (model, key scheme, secret) moves
        self._key_masks: dict[tuple[str, int, int], tuple[tuple[int, int], int]] = {}
        self._heard_floor: tuple[int, int] | None = None  # (n, min of heard_ms[:n])
        # moves with any slot's metrics_version, unique across tables: a reader that saw
        # this stamp (and this many slots) has nothing new to read there
        self.metrics_stamp = next(_METRICS_STAMPS)
        # moves with any slot's kv_version, the same way
        self.capacity_stamp = next(_METRICS_STAMPS)
        self._alloc(capacity)

    def heard_floor(self, n: int) -> int:
        """The oldest `heard_ms` of the first n slots: what every decision asks (is
        every slot live?), remembered until a write can move it (`heard`)."""
        floor = self._heard_floor
        if floor is None or floor[0] != n:
            floor = self._heard_floor = (n, int(self.heard_ms[:n].min()))
        return floor[1]

    def heard(self, slot: int, ms: int) -> None:
        """Set a slot's `heard_ms`, keeping the remembered floor exact."""
        old = int(self.heard_ms[slot])
        self.heard_ms[slot] = ms
        floor = self._heard_floor
        if floor is None or slot >= floor[0]:
            return
        if ms <= floor[1]:
            self._heard_floor = (floor[0], ms)
        elif old <= floor[1]:  # it was the oldest (or one of them): look again
            self._heard_floor = None

    def _alloc(self, capacity: int) -> None:
        old = len(getattr(self, "alive", ()))

        def grow(arr: np.ndarray | None, dtype: type, fill: float) -> np.ndarray:
            out = np.full(capacity, fill, dtype=dtype)
            if arr is not None:
                out[:old] = arr[:old]
            return out

        self.alive = grow(getattr(self, "alive", None), bool, False)
        self.site = grow(getattr(self, "site", None), np.int64, -1)
        self.prefill_tps = grow(getattr(self, "prefill_tps", None), np.float64, 1.0)
        self.backlog_tokens = grow(getattr(self, "backlog_tokens", None), np.float64, 0.0)
        self.slot_generation = grow(getattr(self, "slot_generation", None), np.int64, 0)
        self.heard_ms = grow(getattr(self, "heard_ms", None), np.int64, 0)
        self._heard_floor = None
        self.metrics_ms = grow(getattr(self, "metrics_ms", None), np.int64, -1)
        self.metrics_version = grow(getattr(self, "metrics_version", None), np.int64, 0)
        # bumps when a slot gets a new instance or loses its own: per-slot state kept
        # outside the table (a selector's log of work sent) is the departed one's
        self.occupant = grow(getattr(self, "occupant", None), np.int64, 0)
        # derived by `set_load`: ms per prefill token, the backlog in ms, and when it drains
        self.ms_per_token = grow(getattr(self, "ms_per_token", None), np.float64, 1000.0)
        self.backlog_ms = grow(getattr(self, "backlog_ms", None), np.float64, 0.0)
        self.drain_end_ms = grow(getattr(self, "drain_end_ms", None), np.float64, -1.0)
        # what the cost model reads of a holder, mirrored from its Instance (`describe`)
        self.fpr = grow(getattr(self, "fpr", None), np.float64, 0.0)
        # blocks a run of hits loses to its expected false positives: p/(1-p), inf at p=1
        self.fp_discount = grow(getattr(self, "fp_discount", None), np.float64, 0.0)
        self.stale = grow(getattr(self, "stale", None), bool, False)
        self.block_size = grow(getattr(self, "block_size", None), np.int64, 0)
        self.hbm_only = grow(getattr(self, "hbm_only", None), bool, True)
        # its fastest tier's bandwidth (Mbit/s) and latency (ms), and the largest block
        self.tier0_mbps = grow(getattr(self, "tier0_mbps", None), np.float64, 0.0)
        self.tier0_latency_ms = grow(getattr(self, "tier0_latency_ms", None), np.float64, 0.0)
        self.max_block_bytes = grow(getattr(self, "max_block_bytes", None), np.int64, 0)
        # its KV capacity and free blocks over all tiers as last advertised (Capacity TLV;
        # 0 and 0: not known), as of `kv_at_ms`; `kv_version` moves with each
        self.kv_total = grow(getattr(self, "kv_total", None), np.float64, 0.0)
        self.kv_free = grow(getattr(self, "kv_free", None), np.float64, 0.0)
        self.kv_at_ms = grow(getattr(self, "kv_at_ms", None), np.int64, -1)
        self.kv_version = grow(getattr(self, "kv_version", None), np.int64, 0)

    def slot_for(self, address: IPAddress, site_id: int) -> Instance:
        inst = self.by_address.get(address)
        if inst is not None:
            if inst.site_id != site_id:
                inst.site_id = site_id
                self.site[inst.slot] = site_id
                self.site_version += 1
            return inst
        slot = next((i for i, x in enumerate(self.instances) if x is None), len(self.instances))
        if slot == len(self.instances):
            self.instances.append(None)
        if slot >= len(self.alive):
            self._alloc(2 * len(self.alive))
        inst = Instance(slot, self.cs_id, address, site_id)
        self.instances[slot] = inst
        self.by_address[address] = inst
        self.alive[slot] = True
        self.occupant[slot] += 1
        self.occupancy_version += 1
        self.live_mask |= 1 << slot
        self.site[slot] = site_id
        self.site_version += 1
        self.set_load(slot, inst.prefill_tps, 0.0, -1)
        self.set_capacity(slot, 0, 0, -1)
        self.touch(inst)
        return inst

    def set_load(self, slot: int, prefill_tps: float, backlog_tokens: float, at_ms: int) -> None:
        """An instance's advertised prefill rate and backlog as of `at_ms`: the backlog
        drains at that rate from then on (the dead reckoning the node shares)."""
        self.prefill_tps[slot] = prefill_tps
        self.backlog_tokens[slot] = backlog_tokens
        self.metrics_ms[slot] = at_ms
        self.ms_per_token[slot] = 1000.0 / prefill_tps
        self.backlog_ms[slot] = backlog = backlog_tokens / prefill_tps * 1000
        self.drain_end_ms[slot] = at_ms + backlog

    def set_capacity(self, slot: int, free_blocks: int, total_blocks: int, at_ms: int) -> None:
        """An instance's advertised KV capacity as of `at_ms` (None of it known: 0, 0)."""
        self.kv_free[slot] = free_blocks
        self.kv_total[slot] = total_blocks
        self.kv_at_ms[slot] = at_ms
        self.kv_version[slot] += 1
        self.capacity_stamp = next(_METRICS_STAMPS)

    def describe(self, inst: Instance) -> None:
        """Copy the instance's summary-derived figures into the per-slot arrays."""
        slot = inst.slot
        self.fpr[slot] = p = inst.fpr
        self.fp_discount[slot] = p / (1 - p) if p < 1 else float("inf")
        self.stale[slot] = inst.stale
        self.block_size[slot] = inst.block_size
        self.hbm_only[slot] = len(inst.tiers) == 1 and Tier.HBM in inst.tiers
        if inst.tiers:
            fastest = inst.tiers[min(inst.tiers)]
            self.tier0_mbps[slot] = fastest.fetch_bandwidth_mbps
            self.tier0_latency_ms[slot] = fastest.fetch_latency_us / 1000
            self.max_block_bytes[slot] = max(t.bytes_per_block for t in inst.tiers.values())

    def touch(self, inst: Instance) -> None:
        """Record that `inst`'s summaries changed (the key index re-probes it)."""
        self.describe(inst)
        self.generation += 1
        inst.generation = self.generation
        self.slot_generation[inst.slot] = self.generation

    def remove(self, address: IPAddress) -> Instance | None:
        inst = self.by_address.pop(address, None)
        if inst is None:
            return None
        self.instances[inst.slot] = None
        self.alive[inst.slot] = False
        self.occupant[inst.slot] += 1
        self.occupancy_version += 1
        self.live_mask &= ~(1 << inst.slot)
        self.touch(inst)
        return inst

    def live(self) -> list[Instance]:
        return [i for i in self.instances if i is not None]

    def key_space_mask(self, space: tuple[str, int, int]) -> int:
        """Bitmask of the slots whose block keys are of `space` (model id, key scheme,
        secret id, as their Cache Model TLV says): only their summaries can hold a key
        computed in that space. Remembered until a slot or its key space changes."""
        now = (self.occupancy_version, self.key_space_version)
        known = self._key_masks.get(space)
        if known is not None and known[0] == now:
            return known[1]
        mask = 0
        for inst in self.live():
            if (inst.model_id, inst.key_scheme, inst.secret_id) == space:
                mask |= 1 << inst.slot
        if len(self._key_masks) >= 64:
            self._key_masks.clear()
        self._key_masks[space] = (now, mask)
        return mask


def _record_model(table: ServiceTable, inst: Instance, model: CacheModel) -> None:
    """Take the origin's Cache Model: what its block keys mean from now on."""
    resized = model.block_size != inst.block_size
    space = (model.model_id, int(model.key_scheme), model.secret_id)
    if space != (inst.model_id, inst.key_scheme, inst.secret_id):
        table.key_space_version += 1
    inst.block_size, inst.model_id = model.block_size, model.model_id
    inst.key_scheme, inst.secret_id = int(model.key_scheme), model.secret_id
    table.block_size[inst.slot] = model.block_size
    if resized:  # what the selector remembers of a holder's prefix is in blocks
        table.touch(inst)


def _record_capacity(table: ServiceTable, inst: Instance, adv: Advertisement) -> None:
    """Take the origin's Capacity TLV when it is newer than the one held (by timestamp,
    then epoch and sequence, as metrics are): what an eviction-aware placement reads."""
    cap = adv.get(Capacity)
    if cap is None:
        return
    stamp = (adv.timestamp_ms, adv.sequence.epoch, adv.sequence.sequence)
    if stamp <= inst.capacity_stamp:
        return
    inst.capacity_stamp = stamp
    table.set_capacity(inst.slot, cap.free_blocks, cap.total_blocks, adv.timestamp_ms)


def _forget_claims(table: ServiceTable, inst: Instance) -> None:
    """Drop every summary the origin advertised (a restart, a section left sealed, a key
    scheme this receiver cannot derive): nothing it said of its cache stands."""
    if inst.tiers:
        inst.tiers.clear()
        inst.summaries_changed()
        table.touch(inst)


class RIB:
    """Verified cache state per CS-ID, with freshness by hold time."""

    def __init__(
        self,
        hold_time_ms: int = DEFAULT_HOLD_TIME_MS,
        decode: Callable[[int, bytes, bytes], Summary] = Summary.decode,
    ):
        """`decode` turns an entry's (kind, params, body) into a summary; a caller that
        feeds the same verified routes to several RIBs may share one that remembers
        what it decoded (decoded summaries are never changed in place)."""
        self.hold_time_ms = hold_time_ms
        self.decode = decode
        self.services: dict[int, ServiceTable] = {}
        # what could not be used, for logs and tests: the latest REJECTED_KEPT, and a count
        self.rejected: deque[str] = deque(maxlen=REJECTED_KEPT)
        self.rejected_total = 0

    def table(self, cs_id: int) -> ServiceTable:
        table = self.services.get(cs_id)
        if table is None:
            table = self.services[cs_id] = ServiceTable(cs_id)
        return table

    def accept(self, adv: Advertisement, now_ms: int) -> AcceptResult:
        """Merge one verified advertisement (one route: metrics and/or summary shards)."""
        origin = adv.origin
        table = self.table(origin.cs_id)
        inst = table.slot_for(origin.address, origin.site_id)
        seq = (adv.sequence.epoch, adv.sequence.sequence)
        heard = inst.epoch_seq != NOT_HEARD  # (0, 0) is a real first (epoch, sequence)
        if heard and seq[0] < inst.epoch_seq[0]:
            # from before the origin's restart, on a route that has not carried the new
            # epoch yet (a late copy, a stale route of the crashed process): what it
            # says is gone with that process, and it must not hold back the new epoch
            summaries = adv.cache_summaries
            old = [
                (e.tier, (e.key_lo, e.key_hi), Outcome.OLD.value)
                for e in (summaries.entries if summaries else ())
            ]
            return AcceptResult(inst, old, False)
        inst.heard_ms = max(inst.heard_ms, now_ms)
        table.heard(inst.slot, inst.heard_ms)
        if heard and seq[0] > inst.epoch_seq[0]:
            # The origin restarted: what it said in its old epoch went with it. Its new
            # summaries start again at version 1, and replace the old ones, never merge.
            _forget_claims(table, inst)
        inst.epoch_seq = max(inst.epoch_seq, seq)
        sealed = adv.get(SealedCache)
        if sealed is not None:
            # a cache section left sealed (no group key for it, or an AEAD this code
            # lacks): the origin's cache state now sits where this receiver cannot read
            # it, so what it said before goes; its metrics and clear TLVs are used below
            if sealed.has_known_algorithm:
                why = f"group key {sealed.key_id} not held"
            else:
                why = f"unknown sealing algorithm {int(sealed.algorithm)}"
            self.rejected.append(f"{origin.address}: sealed cache section not opened: {why}")
            self.rejected_total += 1
            _forget_claims(table, inst)
            if adv.get(Capacity) is None:  # sealed with the rest: unknown from now on
                table.set_capacity(inst.slot, 0, 0, adv.timestamp_ms)
        model = adv.cache_model
        if model is not None:
            # recorded even when its scheme is unknown, so that summaries sent later
            # without a Cache Model are read under it, not under the scheme used before
            _record_model(table, inst, model)
        if inst.key_scheme and inst.key_scheme not in KeyScheme._value2member_map_:
            return self._unknown_scheme(table, inst, adv)
        metrics_updated = self._metrics(table, inst, adv)
        _record_capacity(table, inst, adv)
        outcomes = []
        changed = False
        summaries = adv.cache_summaries
        for entry in summaries.entries if summaries else ():
            tier = inst.tiers.get(entry.tier)
            shard = (entry.key_lo, entry.key_hi)
            overlapping: list[tuple[int, int]] = []
            receiver = None
            if tier is not None:
                overlapping = tier.overlapping(shard)
                if any(tier.shards[o].version > entry.version for o in overlapping):
                    # a shard of an older layout, overtaken on another route by the
                    # layout that replaced it (versions rise across a shard-count change)
                    outcomes.append((entry.tier, shard, Outcome.OLD.value))
                    continue
                receiver = tier.shards.get(shard)
            fresh = receiver is None
            if receiver is None:
                receiver = SummaryReceiver()
            try:
                summary = self.decode(int(entry.kind), entry.params, entry.body)
                outcome = receiver.apply(entry.version, entry.base_version, summary)
            except CodecError as exc:
                # ignored: no tier made, no cost or stream changed
                self.rejected.append(f"{origin.address} {entry.tier.name.lower()} {shard}: {exc}")
                self.rejected_total += 1
                outcomes.append((entry.tier, shard, f"rejected: {exc.reason}"))
                continue
            outcomes.append((entry.tier, shard, outcome.value))
            if outcome is Outcome.OLD:
                continue  # what an older version said: costs and streams stay
            if tier is None:
                tier = inst.tiers[entry.tier] = TierState(
                    entry.tier,
                    entry.bytes_per_block,
                    entry.fetch_latency_us,
                    entry.fetch_bandwidth_mbps,
                )
            tier.bytes_per_block = entry.bytes_per_block
            tier.fetch_latency_us = entry.fetch_latency_us
            tier.fetch_bandwidth_mbps = entry.fetch_bandwidth_mbps
            if overlapping:
                # the shard count changed: the older layout's streams over this range
                # say what the origin held before, so they go (also when this entry is a
                # delta whose base has not come yet: its stream is then marked stale)
                for o in overlapping:
                    tier.drop(o)
                changed = True
            if fresh:
                tier.add(shard, receiver)
            changed |= outcome in (Outcome.SNAPSHOT, Outcome.DELTA, Outcome.STALE)
        if changed:
            inst.summaries_changed()
            table.touch(inst)
        return AcceptResult(inst, outcomes, metrics_updated)

    def forget_summaries(self, adv: Advertisement) -> int:
        """The route that carried `adv` is gone (withdrawn, or refused: RFC 7606
        treat-as-withdraw) while its origin still has others: forget the summary streams
        it carried, unless a newer version of a stream came since. How many went."""
        table = self.services.get(adv.origin.cs_id)
        summaries = adv.cache_summaries
        if table is None or summaries is None:
            return 0
        inst = table.by_address.get(adv.origin.address)
        if inst is None or adv.sequence.epoch < inst.epoch_seq[0]:
            return 0  # an older epoch's streams went with its restart already
        gone = 0
        for entry in summaries.entries:
            tier = inst.tiers.get(entry.tier)
            if tier is None:
                continue
            shard = (entry.key_lo, entry.key_hi)
            held = tier.shards.get(shard)
            if held is not None and held.version <= entry.version:
                tier.drop(shard)
                gone += 1
        if gone:
            inst.summaries_changed()
            table.touch(inst)
        return gone

    def _unknown_scheme(
        self, table: ServiceTable, inst: Instance, adv: Advertisement
    ) -> AcceptResult:
        """The origin's keys are derived in a way this receiver cannot (the scheme of its
        Cache Model, in this advertisement or the last one that carried one): nothing it
        says of its cache can match a key computed here. Metrics count; every summary
        entry is refused and what it said of its cache before goes (its keys changed
        meaning)."""
        metrics_updated = self._metrics(table, inst, adv)
        entries = adv.cache_summaries.entries if adv.cache_summaries else ()
        reason = f"unknown key scheme {inst.key_scheme}"
        for e in entries:
            shard = (e.key_lo, e.key_hi)
            self.rejected.append(f"{adv.origin.address} {e.tier.name.lower()} {shard}: {reason}")
            self.rejected_total += 1
        _forget_claims(table, inst)
        outcomes = [(e.tier, (e.key_lo, e.key_hi), f"rejected: {reason}") for e in entries]
        return AcceptResult(inst, outcomes, metrics_updated)

    def _metrics(self, table: ServiceTable, inst: Instance, adv: Advertisement) -> bool:
        l0 = adv.metrics_l0
        seq = (adv.sequence.epoch, adv.sequence.sequence)
        # Newer by timestamp; two in the same millisecond are ordered by sequence.
        if l0 is None or (adv.timestamp_ms, seq) <= (inst.metrics_ms, inst.metrics_seq):
            return False
        inst.metrics_ms, inst.metrics_seq = adv.timestamp_ms, seq
        best: dict[int, tuple[int, int, float]] = {}  # metric type -> (ranks, value)
        for m in l0.metrics:
            unit = _L0_READ.get(m.metric_type)
            statistic = _STATISTIC_RANK.get(m.statistic)
            if unit is None or m.unit != unit or statistic is None:
                continue
            rank = (statistic, _SOURCE_RANK.get(m.source, _SOURCES), m.value)
            if m.metric_type not in best or rank[:2] < best[m.metric_type][:2]:
                best[m.metric_type] = rank
        for metric_type, (_, _, value) in best.items():
            if metric_type == L0MetricType.PREFILL_THROUGHPUT:
                if value > 0:
                    inst.prefill_tps = value
            elif metric_type == L0MetricType.OUTSTANDING_PREFILL_TOKENS:
                inst.backlog_tokens = max(0.0, value)
            else:
                inst.waiting = max(0.0, value)
        table.set_load(inst.slot, inst.prefill_tps, inst.backlog_tokens, inst.metrics_ms)
        table.metrics_version[inst.slot] += 1
        table.metrics_stamp = next(_METRICS_STAMPS)
        return True

    def withdraw(self, address: IPAddress, cs_id: int | None = None) -> int:
        """Forget an origin (route withdrawn, RFC 7606 treat-as-withdraw, or expiry)."""
        tables = (
            [self.services[cs_id]]
            if cs_id in self.services
            else (list(self.services.values()) if cs_id is None else [])
        )
        return sum(t.remove(address) is not None for t in tables)

    def expire(self, now_ms: int) -> list[Instance]:
        """Drop instances not heard from within the hold time."""
        gone = []
        for table in self.services.values():
            for inst in table.live():
                if now_ms - inst.heard_ms > self.hold_time_ms:
                    table.remove(inst.address)
                    gone.append(inst)
        return gone

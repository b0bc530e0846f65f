"""The tiered KV-cache model of one instance: which block keys sit in which tier.

Strategy. Each tier (`hbm`, `dram`, `ssd`, `remote`) is an insertion-ordered dict used
as an LRU list (oldest first), so every operation is O(1) per block. The model serves
two masters with the same state:

* **simulation** (the modelled instance, the simulator): `admit(keys)` runs a request's
  prompt through an *exclusive* hierarchy — hits anywhere are promoted to the top tier,
  new blocks go there too, and a full tier demotes its least recently used block to the
  next tier, the last tier drops it. Every change comes back as a `BlockEvent`, in the
  order it happened, so an adapter can publish it as engine events.
* **mirroring** (the C-SMA fed by a real engine): `store`, `remove`, `clear` apply what
  the engine says happened; the engine has already decided, so no capacity is enforced
  and tiers need not be exclusive (an offloaded block may sit in HBM and DRAM at once).

Since the last `mark_advertised()` the model keeps, per tier, the keys added and removed
(a key stored then removed again cancels out), so the advertisement builder knows how
much changed in O(1) and its dampening can ask "is this worth an update?".
Pure: no clocks, no IO.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from catsproto.wire import Tier

__all__ = [
    "BlockEvent",
    "BlockEventKind",
    "ModelShape",
    "PrefixHit",
    "TierSpec",
    "TieredCache",
]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Model dimensions that fix the size of one KV block.

    bytes_per_block = layers × kv_heads × head_dim × 2 (K and V) × dtype_bytes × block_size.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: how many blocks fit and what fetching one costs.

    fetch_latency_us: time to first byte of a fetch from this tier. fetch_bandwidth_mbps:
    Mbit/s once it flows. Both go into the tier's cache-summary entry.
    """

    tier: Tier
    capacity_blocks: int
    fetch_latency_us: int
    fetch_bandwidth_mbps: int

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"{self.tier.name} capacity_blocks must be >= 0")
        if not 0 <= self.fetch_latency_us < 1 << 32:
            raise ValueError(f"{self.tier.name} fetch_latency_us outside u32")
        if not 0 <= self.fetch_bandwidth_mbps < 1 << 32:
            raise ValueError(f"{self.tier.name} fetch_bandwidth_mbps outside u32")


class BlockEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    MOVED = "moved"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change of the model. MOVED goes from `tier` to `to_tier`; CLEARED has no keys."""

    kind: BlockEventKind
    tier: Tier
    keys: tuple[int, ...] = ()
    to_tier: Tier | None = None


EventRun = tuple[BlockEventKind, Tier, "Tier | None", list[int]]
"""Consecutive changes of one kind between the same tiers: (kind, tier, to_tier, keys)."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prompt's block-key prefix the cache holds, and where."""

    depth: int
    """Blocks matched from the start of the prompt (stops at the first miss)."""
    tiers: tuple[Tier, ...]
    """The tier each matched block came from (the fastest that holds it)."""

    def blocks_in(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t == tier)


@dataclass(slots=True)
class _Changes:
    added: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    def add(self, key: int) -> None:
        if key in self.removed:
            self.removed.discard(key)
        else:
            self.added.add(key)

    def remove(self, key: int) -> None:
        if key in self.added:
            self.added.discard(key)
        else:
            self.removed.add(key)

    def __len__(self) -> int:
        return len(self.added) + len(self.removed)


class TieredCache:
    """Block keys per tier with LRU order, block depth and hit counts.

    tiers: the tiers this instance has, fastest first (demotion follows this order).
    """

    def __init__(self, tiers: Sequence[TierSpec]) -> None:
        if not tiers:
            raise ValueError("a cache needs at least one tier")
        order = [s.tier for s in tiers]
        if order != sorted(set(order)):
            raise ValueError(f"tiers must be distinct and fastest first, got {order}")
        self.specs: dict[Tier, TierSpec] = {s.tier: s for s in tiers}
        self.order: tuple[Tier, ...] = tuple(order)
        # OrderedDict, not dict: taking the oldest key of a plain dict scans past every
        # key deleted from its front since the last resize (about 1.4 µs a victim here)
        self._lru: dict[Tier, OrderedDict[int, None]] = {t: OrderedDict() for t in order}
        self._changes: dict[Tier, _Changes] = {t: _Changes() for t in order}
        # for the per-block loops: (tier, its LRU dict) fastest first, and each tier's next
        self._tiers: tuple[tuple[Tier, OrderedDict[int, None]], ...] = tuple(
            (t, self._lru[t]) for t in order
        )
        self._below: dict[Tier, Tier | None] = {
            t: order[i + 1] if i + 1 < len(order) else None for i, t in enumerate(order)
        }
        self.depth: dict[int, int] = {}
        """Depth in blocks of every key ever seen (1 = first block of a prompt)."""
        self.hits: dict[int, int] = {}
        """Times a key was found in the cache (admit) or stored again (mirror)."""

    # ---- queries -------------------------------------------------------------------

    def __contains__(self, key: int) -> bool:
        return any(key in lru for lru in self._lru.values())

    def tier_of(self, key: int) -> Tier | None:
        """The fastest tier holding `key`."""
        for t, lru in self._tiers:
            if key in lru:
                return t
        return None

    def count(self, tier: Tier) -> int:
        return len(self._lru[tier])

    def lru_keys(self, tier: Tier) -> list[int]:
        """Keys of `tier`, least recently used first."""
        return list(self._lru[tier])

    def keys(self, tier: Tier) -> np.ndarray:
        """Keys of `tier` as a uint64 array (unsorted)."""
        lru = self._lru[tier]
        # the plain dict's walk of the same keys: twice as fast as the LRU list's, and
        # the order is not promised
        return np.fromiter(dict.keys(lru), dtype=np.uint64, count=len(lru))

    def total_blocks(self) -> int:
        return sum(s.capacity_blocks for s in self.specs.values())

    def used_blocks(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def free_blocks(self) -> int:
        return sum(max(0, s.capacity_blocks - len(self._lru[t])) for t, s in self.specs.items())

    def lookup(self, keys: Sequence[int]) -> PrefixHit:
        """The prefix of `keys` the cache holds, without touching anything."""
        tiers: list[Tier] = []
        for k in keys:
            for t, lru in self._tiers:  # `tier_of`, inlined: this runs per prompt block
                if k in lru:
                    tiers.append(t)
                    break
            else:
                break
        return PrefixHit(len(tiers), tuple(tiers))

    # ---- change tracking -------------------------------------------------------------

    def pending_changes(self, tier: Tier | None = None) -> int:
        """Keys added or removed (net) since the last `mark_advertised`."""
        if tier is not None:
            return len(self._changes[tier])
        return sum(len(c) for c in self._changes.values())

    def changes(self, tier: Tier) -> tuple[frozenset[int], frozenset[int]]:
        """(added, removed) keys of `tier` since the last `mark_advertised`."""
        c = self._changes[tier]
        return frozenset(c.added), frozenset(c.removed)

    def mark_advertised(self) -> None:
        for c in self._changes.values():
            c.added.clear()
            c.removed.clear()

    # ---- simulation: exclusive LRU hierarchy with demotion ------------------------------

    def admit(self, keys: Sequence[int]) -> tuple[PrefixHit, list[BlockEvent]]:
        """Serve a prompt whose block keys are `keys` (in prompt order): `admit_runs`,
        its runs as `BlockEvent`s."""
        hit, runs = self.admit_runs(keys)
        return hit, [BlockEvent(kind, tier, tuple(ks), to) for kind, tier, to, ks in runs]

    def admit_runs(self, keys: Sequence[int]) -> tuple[PrefixHit, list[EventRun]]:
        """Serve a prompt whose block keys are `keys` (in prompt order).

        The cached prefix is looked up first (that is the hit). Then every block ends in
        the top tier: hits elsewhere are promoted, misses stored, each full tier demoting
        its LRU block one tier down. Finally the prompt's blocks are touched last block
        first, so its first block is the most recently used (an engine frees a request's
        blocks tail first, which keeps shared prefixes longest).

        The changes come back as runs `(kind, tier, to_tier, keys)`, each what one
        `BlockEvent` of `admit` holds, in order: a caller that only counts them (the
        simulator) builds no event objects.
        """
        top = self.order[0]
        capacity = self.specs[top].capacity_blocks
        if capacity < 1:
            raise ValueError("the top tier needs room for at least one block to admit")
        hit = self.lookup(keys)
        hits = self.hits
        for k in keys[: hit.depth]:
            hits[k] = hits.get(k, 0) + 1
        # Runs of events as they happen: (kind, tier, to_tier, keys); consecutive events
        # of one kind and the same tiers share a run. The primitives (`tier_of`, `_touch`,
        # `_insert`, `_Changes.add/remove`) are inlined for the top tier: this loop runs
        # for every block of every prompt, and a call costs more than the dict operation.
        runs: list[EventRun] = []
        top_lru = self._lru[top]
        top_added, top_removed = self._changes[top].added, self._changes[top].removed
        lower = self._tiers[1:]
        below = self._below[top]
        demotes = below is not None and self.specs[below].capacity_blocks > 0
        depth = self.depth
        parent_depth = 0
        last: EventRun | None = None
        for k in keys:
            parent_depth = depth.setdefault(k, parent_depth + 1)
            if k in top_lru:
                top_lru.move_to_end(k)
                continue
            for where, lru in lower:
                if k in lru:  # leave the lower tier first: room below may be needed
                    self._discard(where, k)
                    if last is not None and last[0] is _MOVED and last[1] == where:
                        last[3].append(k)
                    else:
                        runs.append(last := (_MOVED, where, top, [k]))
                    break
            else:
                if last is not None and last[0] is _STORED:
                    last[3].append(k)
                else:
                    runs.append(last := (_STORED, top, None, [k]))
            if len(top_lru) >= capacity:
                if demotes:
                    events = _Runs(runs)
                    self._make_room(top, events)
                    last = runs[-1]
                else:  # `_make_room` of a tier with nothing below: drop its LRU blocks
                    while len(top_lru) >= capacity:
                        victim = top_lru.popitem(last=False)[0]
                        if victim in top_added:
                            top_added.discard(victim)
                        else:
                            top_removed.add(victim)
                        if last[0] is _REMOVED:
                            last[3].append(victim)
                        else:
                            runs.append(last := (_REMOVED, top, None, [victim]))
            top_lru[k] = None
            if k in top_removed:
                top_removed.discard(k)
            else:
                top_added.add(k)
        for k in reversed(keys):
            if k in top_lru:
                top_lru.move_to_end(k)
        return hit, runs

    def _make_room(self, tier: Tier, events: _Runs) -> None:
        """Demote (or drop, from the last tier) LRU blocks until `tier` has a free slot."""
        capacity = self.specs[tier].capacity_blocks
        lru = self._lru[tier]
        below = self._below[tier]
        while lru and len(lru) >= capacity:
            victim = next(iter(lru))
            self._discard(tier, victim)
            if below is not None and self.specs[below].capacity_blocks > 0:
                self._make_room(below, events)
                self._insert(below, victim)
                events.add(BlockEventKind.MOVED, tier, victim, below)
            else:
                events.add(BlockEventKind.REMOVED, tier, victim, None)

    # ---- mirroring: apply what an engine reports ---------------------------------------

    def store(self, tier: Tier, key: int, depth: int | None = None) -> bool:
        """Record `key` in `tier` (most recently used). False if it was there already."""
        if depth is not None:
            self.depth.setdefault(key, depth)
        lru = self._lru[tier]
        if key in lru:
            self.hits[key] = self.hits.get(key, 0) + 1
            self._touch(tier, key)
            return False
        self._insert(tier, key)
        return True

    def remove(self, tier: Tier, key: int) -> bool:
        """Forget `key` in `tier`. False if it was not there."""
        if key not in self._lru[tier]:
            return False
        self._discard(tier, key)
        return True

    def clear(self, tier: Tier) -> int:
        """Forget every key of `tier`; returns how many there were."""
        lru = self._lru[tier]
        n = len(lru)
        for k in list(lru):
            self._discard(tier, k)
        return n

    def apply(self, events: Iterable[BlockEvent]) -> None:
        """Apply block events (as produced by `admit`) to this model."""
        for ev in events:
            if ev.kind is BlockEventKind.STORED:
                for k in ev.keys:
                    self.store(ev.tier, k)
            elif ev.kind is BlockEventKind.REMOVED:
                for k in ev.keys:
                    self.remove(ev.tier, k)
            elif ev.kind is BlockEventKind.MOVED:
                assert ev.to_tier is not None
                for k in ev.keys:
                    self.remove(ev.tier, k)
                    self.store(ev.to_tier, k)
            else:
                self.clear(ev.tier)

    # ---- hot prefixes ----------------------------------------------------------------

    def hot_prefixes(self, limit: int, tier: Tier | None = None) -> list[tuple[int, int]]:
        """Up to `limit` (key, depth) pairs worth naming exactly.

        Ranked by hits, then depth (a deeper prefix saves more), then key; only keys in
        `tier` (default: the fastest tier) count. Deterministic.
        """
        if limit <= 0:
            return []
        tier = tier or self.order[0]
        lru = self._lru[tier]
        hits, depth = self.hits, self.depth
        ranked = sorted(lru, key=lambda k: (-hits.get(k, 0), -depth.get(k, 1), k))
        return [(k, depth.get(k, 1)) for k in ranked[:limit]]

    # ---- primitives ------------------------------------------------------------------

    def _insert(self, tier: Tier, key: int) -> None:
        self._lru[tier][key] = None
        self._changes[tier].add(key)

    def _discard(self, tier: Tier, key: int) -> None:
        del self._lru[tier][key]
        self._changes[tier].remove(key)

    def _touch(self, tier: Tier, key: int) -> None:
        self._lru[tier].move_to_end(key)


_STORED, _REMOVED, _MOVED = (
    BlockEventKind.STORED,
    BlockEventKind.REMOVED,
    BlockEventKind.MOVED,
)


class _Runs:
    """Block events as they happen, merged on the fly: consecutive events of one kind
    and the same tiers become one event with all their keys, in order, without an
    event object per block on the way."""

    __slots__ = ("_runs",)

    def __init__(self, runs: list[EventRun] | None = None) -> None:
        self._runs = [] if runs is None else runs

    def add(self, kind: BlockEventKind, tier: Tier, key: int, to_tier: Tier | None) -> None:
        runs = self._runs
        if runs:
            last = runs[-1]
            if last[0] is kind and last[1] == tier and last[2] == to_tier:
                last[3].append(key)
                return
        runs.append((kind, tier, to_tier, [key]))

    def events(self) -> list[BlockEvent]:
        return [BlockEvent(kind, tier, tuple(keys), to) for kind, tier, to, keys in self._runs]

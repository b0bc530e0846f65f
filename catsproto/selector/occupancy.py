"""What a placement costs the fleet's caches: the eviction term of an estimate.

Strategy. A prompt placed at an instance stores the blocks it did not find there. An
instance with free KV blocks stores them for nothing; one whose cache is full evicts as
many blocks as it stores, and an evicted block that someone's next turn wanted costs
that turn its prefill. So every candidate's estimate carries

    evict = max(0, new blocks − free blocks) × block prefill ms × victim value

- free blocks: the instance's Capacity TLV (free of total, over all tiers, at the
  advertisement's timestamp), less the blocks this selector placed there since (times
  `peer_selectors`, as the queue term counts work): the advertisement cannot know them;
- new blocks: the whole blocks of the prompt beyond the run the candidate holds;
- victim value: the chance that the block an eviction takes is wanted again. An LRU
  cache of C blocks filled at r blocks per millisecond evicts blocks last used about
  age = C / r ago; such a block is taken to be wanted again with probability
  exp(−age / H), H the reuse horizon (`SelectorConfig.reuse_horizon_ms`). r is this
  selector's own placements there (times `peer_selectors`): an exponentially weighted
  sum S of the blocks placed, decayed over H, over the weight of the time it has been
  watching, H·(1 − exp(−t / H)), t counted from its first decision and never less than
  H / 4 (a burst in the first seconds is not a rate). A cache that took a capacity's
  worth of new blocks within the horizon evicts blocks that are still warm, one that
  took few evicts cold ones.

Its effects: new prefixes go where blocks are free, then where the cache turns over
slowest, so the fleet's caches fill and churn evenly instead of the nearest one
overflowing while another stays empty; a conversation stays on its holder (it stores few
new blocks there, and its whole prompt elsewhere) unless the holder's queue costs more
than a prefill elsewhere. An instance that advertises no capacity is priced at 0.

Pure: the time comes in as `now_ms`; S decays with it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from catsproto.selector.rib import ServiceTable

__all__ = ["CacheLedger", "Evictions"]


@dataclass
class Evictions:
    """One decision's eviction terms per candidate: what `CacheLedger.terms` read, and
    `price` for a vector of new blocks."""

    free: np.ndarray  # blocks the candidate has free now (inf: capacity not known)
    block_ms: np.ndarray  # ms one evicted block is worth there (prefill × victim value)

    def price(self, new_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(blocks evicted, their ms) per candidate for `new_blocks` stored there."""
        evicted = np.maximum(new_blocks - self.free, 0.0)  # free = inf: none
        return evicted, evicted * self.block_ms


@dataclass
class CacheLedger:
    """Per slot of one service table: the blocks this selector placed since the slot's
    last Capacity advertisement, and its recent placements decayed over the horizon."""

    peers: int = 1
    horizon_ms: float = 120_000.0
    placed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    log: list[deque[tuple[int, float]]] = field(default_factory=list)
    seen_kv: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seen_occupant: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    recent: np.ndarray = field(default_factory=lambda: np.zeros(0))  # S, as of recent_ms
    recent_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seen_stamp: tuple[int, int] = (-1, -1)  # table's (capacity_stamp, size) last read
    since_ms: float | None = None  # the first decision priced: when watching began

    def __post_init__(self) -> None:
        if not (self.horizon_ms > 0 and math.isfinite(self.horizon_ms)):
            raise ValueError(f"reuse horizon must be a finite number > 0 ms, not {self.horizon_ms}")

    def grow(self, n: int) -> None:
        m = len(self.placed)
        if m >= n:
            return
        extra = n - m
        self.placed = np.concatenate([self.placed, np.zeros(extra)])
        self.log.extend(deque() for _ in range(extra))
        self.seen_kv = np.concatenate([self.seen_kv, np.full(extra, -1, dtype=np.int64)])
        self.seen_occupant = np.concatenate([self.seen_occupant, np.zeros(extra, np.int64)])
        self.recent = np.concatenate([self.recent, np.zeros(extra)])
        self.recent_ms = np.concatenate([self.recent_ms, np.zeros(extra)])

    def _claim(self, table: ServiceTable, slot: int) -> None:
        """Forget what was kept for a slot's previous occupant."""
        self.grow(slot + 1)
        if self.seen_occupant[slot] != table.occupant[slot]:
            self.log[slot].clear()
            self.placed[slot] = self.recent[slot] = 0.0
            self.seen_occupant[slot] = table.occupant[slot]
            self.seen_kv[slot] = -1

    def refresh(self, table: ServiceTable) -> None:
        """Drop the placements that newer Capacity advertisements count."""
        n = len(table.alive)
        self.grow(n)
        if self.seen_stamp == (table.capacity_stamp, n):
            return
        self.seen_stamp = (table.capacity_stamp, n)
        moved = table.kv_version[:n] != self.seen_kv[:n]
        moved |= table.occupant[:n] != self.seen_occupant[:n]
        for slot in np.flatnonzero(moved).tolist():
            self._claim(table, slot)
            log, at = self.log[slot], int(table.kv_at_ms[slot])
            while log and log[0][0] <= at:
                log.popleft()
            self.placed[slot] = sum(blocks for _, blocks in log)
            self.seen_kv[slot] = table.kv_version[slot]

    def add(self, table: ServiceTable, slot: int, now_ms: int, blocks: float) -> None:
        """Log `blocks` stored at `slot` by a request placed at `now_ms`."""
        self._claim(table, slot)
        self.log[slot].append((now_ms, blocks))
        self.placed[slot] += blocks
        self.recent[slot] = self._decayed(slot, now_ms) + blocks
        self.recent_ms[slot] = now_ms

    def remove(self, table: ServiceTable, slot: int, at_ms: int | None = None) -> bool:
        """Undo the newest placement at `slot` (made at `at_ms`, if given): the request
        went elsewhere. False: none such is logged."""
        self._claim(table, slot)
        log = self.log[slot]
        for k in range(len(log) - 1, -1, -1):
            when, blocks = log[k]
            if at_ms is None or when == at_ms:
                del log[k]
                self.placed[slot] = max(0.0, self.placed[slot] - blocks) if log else 0.0
                decay = math.exp(-(self.recent_ms[slot] - when) / self.horizon_ms)
                self.recent[slot] = max(0.0, self.recent[slot] - blocks * decay)
                return True
            if when < at_ms:
                return False
        return False

    def _decayed(self, slot: int, now_ms: float) -> float:
        age = max(0.0, now_ms - float(self.recent_ms[slot]))
        return float(self.recent[slot]) * math.exp(-age / self.horizon_ms)

    def terms(
        self,
        table: ServiceTable,
        pick: slice | np.ndarray,
        now_ms: int,
        block_tokens: np.ndarray,
        ms_per_token: np.ndarray,
    ) -> Evictions:
        """The free blocks and the worth of an evicted block of the candidates `pick`."""
        if self.since_ms is None:
            self.since_ms = now_ms
        h = self.horizon_ms
        total = table.kv_total[pick]
        free = table.kv_free[pick] - self.peers * self.placed[pick]
        np.maximum(free, 0.0, out=free)
        free[total <= 0] = np.inf
        age = np.maximum(now_ms - self.recent_ms[pick], 0.0)
        recent = self.peers * self.recent[pick] * np.exp(-age / h)  # S
        watched = max(now_ms - self.since_ms, h / 4)
        # age of a victim over H: C / (r H), with r H = S / (1 - exp(-t / H))
        scaled = total * -math.expm1(-watched / h)
        # S = 0 (nothing placed there lately): cold victims, worth nothing
        value = np.where(recent > 0, np.exp(-scaled / np.maximum(recent, 1e-300)), 0.0)
        return Evictions(free, block_tokens * ms_per_token * value)

"""Versions, snapshots and deltas: what a sender announces and what a receiver believes.

Strategy. Every announcement of one summary stream (one tier, one shard) carries a
version (u32, from 1, strictly increasing) and a base version: 0 for a snapshot, else the
exact version the delta applies to. BGP keeps only the latest attribute per route and a
transit may coalesce updates, so by default a sender makes every delta *cumulative*
against its last snapshot: missing intermediate updates costs a receiver nothing as long
as it saw that snapshot. (``chain=True`` makes deltas against the previous version
instead: smaller, but one lost update leaves the receiver stale until the next snapshot.)
The sender sends whichever of delta and snapshot is smaller, and a snapshot at least
every ``snapshot_every`` updates, so cumulative deltas cannot grow without bound and a
receiver that joined late catches up within that many updates (and, on a stream whose
keys stopped changing, at its next refresh, which the builder sends as a snapshot).

A receiver applies a delta only on top of exactly its base version — its current
state, or the last snapshot it holds. Anything else (a delta on a version it never saw)
leaves the last good state in place, marked stale, until a snapshot or a delta on a
base it holds arrives. Versions not above the current one are ignored (re-advertisements
and reordering). Pure: no clocks; versions start where the caller says.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from catsproto.summary.base import Summary, SummaryDecodeError, unique_keys
from catsproto.summary.delta import DeltaSummary, SummaryState, apply_delta

U32_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class SummaryUpdate:
    """One announcement of a summary stream: a snapshot (base 0) or a delta."""

    version: int
    base_version: int
    summary: Summary
    entry_count: int

    @property
    def is_delta(self) -> bool:
        return self.base_version != 0

    @property
    def kind(self) -> int:
        return self.summary.kind

    def params(self) -> bytes:
        return self.summary.params()

    def encode(self) -> bytes:
        return self.summary.encode()


class SummarySender:
    """Turns successive key sets of one stream into snapshots and deltas."""

    def __init__(
        self,
        target_fpr: float,
        *,
        kind: int | None = None,
        seed: int = 0,
        snapshot_every: int = 8,
        chain: bool = False,
        first_version: int = 1,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        if not 1 <= first_version <= U32_MAX:
            raise ValueError(f"first_version {first_version} outside 1..2^32-1")
        self.target_fpr = target_fpr
        self.kind = kind
        self.seed = seed
        self.snapshot_every = snapshot_every
        self.chain = chain
        self._next_version = first_version
        self.version = 0
        self.snapshot_version = 0
        self._keys: np.ndarray | None = None
        self._snapshot_keys: np.ndarray | None = None
        self._since_snapshot = 0

    def update(self, keys: object, *, force_snapshot: bool = False) -> SummaryUpdate | None:
        """The announcement for the new key set, or None if nothing changed."""
        new = unique_keys(keys)
        if not force_snapshot and self._keys is not None and np.array_equal(new, self._keys):
            return None
        if self._next_version > U32_MAX:
            raise OverflowError("summary version space exhausted; start a new epoch")
        version = self._next_version
        update: SummaryUpdate | None = None
        kind = self.kind
        due = self._since_snapshot + 1 >= self.snapshot_every
        if self._keys is not None and not force_snapshot and not due:
            assert self._snapshot_keys is not None
            base_keys = self._keys if self.chain else self._snapshot_keys
            base = self.version if self.chain else self.snapshot_version
            delta = DeltaSummary.between(base_keys, new)
            sizes = Summary.estimates(new, self.target_fpr)
            if kind is None:  # the kind a snapshot would take (`Summary.smallest_kind`)
                kind = min(sizes, key=lambda code: (sizes[code], code))
            if delta.size() < sizes[kind]:
                update = SummaryUpdate(version, base, delta, int(new.size))
                self._since_snapshot += 1
        if update is None:
            snapshot = Summary.build(new, self.target_fpr, kind=kind, seed=self.seed)
            update = SummaryUpdate(version, 0, snapshot, int(new.size))
            self._snapshot_keys = new
            self.snapshot_version = version
            self._since_snapshot = 0
        self._keys = new
        self.version = version
        self._next_version = version + 1
        return update


class Outcome(enum.Enum):
    """What a receiver did with an announcement."""

    SNAPSHOT = "snapshot applied"
    DELTA = "delta applied"
    STALE = "delta on a base not held; kept last good state, marked stale"
    OLD = "version not newer than the current one; ignored"


class EntryLike(Protocol):
    """The fields of `catsproto.wire.SummaryEntry` a receiver reads."""

    version: int
    base_version: int
    kind: int
    params: bytes
    body: bytes


class SummaryReceiver:
    """What one receiver believes about one summary stream."""

    def __init__(self) -> None:
        self.version = 0
        self.stale = False
        self.state: SummaryState | None = None
        self.snapshot_version = 0
        self._snapshot: Summary | None = None

    def apply_entry(self, entry: EntryLike) -> Outcome:
        """Decode a cache-summary entry's body and apply it."""
        summary = Summary.decode(int(entry.kind), entry.params, entry.body)
        return self.apply(entry.version, entry.base_version, summary)

    def apply(self, version: int, base_version: int, summary: Summary) -> Outcome:
        is_delta = isinstance(summary, DeltaSummary)
        if is_delta != (base_version != 0):
            raise SummaryDecodeError(
                f"kind {summary.kind} does not match base_version {base_version}"
            )
        if base_version >= version:
            raise SummaryDecodeError(f"base_version {base_version} not below version {version}")
        if version <= self.version:
            return Outcome.OLD
        if not is_delta:
            self.state = summary
            self._snapshot = summary
            self.snapshot_version = version
            self.version = version
            self.stale = False
            return Outcome.SNAPSHOT
        assert isinstance(summary, DeltaSummary)
        if self.state is not None and base_version == self.version:
            base: SummaryState = self.state
        elif self._snapshot is not None and base_version == self.snapshot_version:
            base = self._snapshot
        else:
            self.stale = True
            return Outcome.STALE
        self.state = apply_delta(base, summary)
        self.version = version
        self.stale = False
        return Outcome.DELTA

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        if self.state is None:
            return np.zeros(keys.shape, dtype=bool)
        return self.state.contains_many(keys)

"""Work a selector sent to instances since their last advertisement: its queue term.

Strategy. An advertisement says how many prefill tokens an instance had outstanding
when it was built (`backlog_tokens` at `metrics_ms`) and how fast it prefills; the
selector drains that backlog at the advertised rate. What the advertisement cannot say
is the work sent there since. Each selector keeps, per slot, a log of (time, tokens)
for the work it (or another decision-maker that told it, `PathSelector.note`) sent,
and counts it in one of two ways (`SelectorConfig.pending`):

- ``count``: every entry in full until an advertisement built at or after its time
  arrives, times `peer_selectors` (selectors assumed to steer as much there). Cheap
  and cautious: a selector that is one of several sharing instances over-counts rather
  than herds;
- ``drain``: the backlog and the entries replayed as one FCFS queue draining at the
  advertised rate (`replay`), so work sent a while ago is counted as done. Right when
  the log is complete — the one C-PS sending work to a site's instances, told by no one
  else — and what the two-level decision of the simulation uses. An entry made in the
  advertisement's own millisecond still counts (the advertisement may have been built
  before it); `peer_selectors` does not apply.

A slot's log belongs to the instance it was kept for: when the table puts another
instance in the slot, or frees it (`ServiceTable.occupant` moves), the log, its tokens
and its queue time are forgotten before the slot is read or written again.

Pure: times come in as arguments.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from catsproto.selector.rib import ServiceTable

__all__ = ["PENDING_MODES", "PendingWork", "replay"]

PENDING_MODES = ("count", "drain")


def replay(
    backlog: float, at_ms: float, sent: deque[tuple[int, float]], tps: float, now_ms: float
) -> float:
    """Tokens still queued at `now_ms` at an instance that advertised `backlog` tokens at
    `at_ms` and has since been sent `sent` = (time, tokens), FCFS, draining at `tps`
    tokens per second. Entries before `at_ms` are skipped (the advertisement counts
    them). Leading entries that cannot matter any more — the queue was empty when a
    later one arrived, so the same replay without them gives the same answer — are
    removed from `sent`, which keeps the replay short however long an advertisement
    lives."""
    q, cursor, drop = backlog, at_ms, 0
    for k, (when, tokens) in enumerate(sent):
        if when < at_ms:
            drop = k + 1
            continue
        q = max(0.0, q - (when - cursor) * tps / 1000)
        if q == 0.0:
            drop = k
        q += tokens
        cursor = when
    for _ in range(drop):
        sent.popleft()
    return max(0.0, q - (now_ms - cursor) * tps / 1000)


@dataclass
class PendingWork:
    """Per slot of one service table: the log of work sent and its queue time now."""

    drain: bool
    peers: int = 1
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seen_version: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the table's occupant counter per slot when its log was last checked (`_claim`)
    seen_occupant: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    log: list[deque[tuple[int, float]]] = field(default_factory=list)
    # the queue time decide() adds to the drained advertised backlog, per slot
    ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # drain: slots whose log is not empty (the others add nothing)
    busy: set[int] = field(default_factory=set)
    # the table's `occupancy_version` at the last `refresh` (no slot to check while equal)
    seen_occupancy: int = -1
    # the table's `metrics_stamp` and size when every slot's version was last read
    seen_metrics: tuple[int, int] = (-1, -1)

    def grow(self, n: int) -> None:
        m = len(self.tokens)
        if m >= n:
            return
        self.tokens = np.concatenate([self.tokens, np.zeros(n - m)])
        self.seen_version = np.concatenate([self.seen_version, np.full(n - m, -1, dtype=np.int64)])
        self.seen_occupant = np.concatenate([self.seen_occupant, np.zeros(n - m, dtype=np.int64)])
        self.log.extend(deque() for _ in range(n - m))
        self.ms = np.concatenate([self.ms, np.zeros(n - m)])

    def _forget(self, slot: int) -> None:
        self.log[slot].clear()
        self.tokens[slot] = 0.0
        self.ms[slot] = 0.0
        self.busy.discard(slot)

    def _claim(self, table: ServiceTable, slot: int) -> None:
        """Make `slot`'s log its current occupant's: forget it if the table has put
        another instance there (or freed it) since it was last checked."""
        self.grow(slot + 1)
        occupant = table.occupant[slot]
        if self.seen_occupant[slot] != occupant:
            self._forget(slot)
            self.seen_occupant[slot] = occupant

    def _is_current(self, table: ServiceTable, slot: int) -> bool:
        """Whether `slot`'s log was kept for the instance now in it."""
        return slot < len(self.log) and self.seen_occupant[slot] == table.occupant[slot]

    def refresh(self, table: ServiceTable, now_ms: int) -> None:
        """Drop what newer advertisements count, and work out `ms` for `now_ms`."""
        n = len(table.alive)
        self.grow(n)
        if self.seen_occupancy != table.occupancy_version:
            for slot in np.nonzero(table.occupant[:n] != self.seen_occupant[:n])[0].tolist():
                self._forget(slot)
                self.seen_occupant[slot] = table.occupant[slot]
            self.seen_occupancy = table.occupancy_version
        if self.seen_metrics == (table.metrics_stamp, n):
            changed: list[int] = []  # no slot's metrics moved since every one was read
        else:
            changed = np.nonzero(table.metrics_version[:n] != self.seen_version[:n])[0].tolist()
            self.seen_metrics = (table.metrics_stamp, n)
        for slot in changed:
            log = self.log[slot]
            at = table.metrics_ms[slot]
            if self.drain:
                while log and log[0][0] < at:
                    log.popleft()
            else:
                while log and log[0][0] <= at:
                    self.tokens[slot] -= log.popleft()[1]
            if not log or not table.alive[slot]:
                log.clear()  # no float residue: an empty log means nothing pending
                self.tokens[slot] = 0.0
            self.seen_version[slot] = table.metrics_version[slot]
            if self.drain:
                if not log:
                    self.busy.discard(slot)
                    self.ms[slot] = 0.0
            else:
                self._count_ms(table, slot)
        if self.drain:  # the replayed queue depends on now: every busy slot, every time
            for slot in list(self.busy):
                self.drain_ms(table, slot, now_ms)

    def add(self, table: ServiceTable, slot: int, now_ms: int, tokens: float) -> None:
        """Log `tokens` of work sent to `slot` at `now_ms` (in time order). With
        ``drain`` the queue time is worked out again at the next `refresh`."""
        self._claim(table, slot)
        self.tokens[slot] += tokens
        self.log[slot].append((now_ms, tokens))
        if self.drain:
            self.busy.add(slot)
        else:
            self._count_ms(table, slot)

    def pop_last(self, table: ServiceTable, slot: int) -> float | None:
        """Undo the last entry of `slot`; its tokens, or None if the log was empty."""
        self._claim(table, slot)
        if not self.log[slot]:
            return None
        _, tokens = self.log[slot].pop()
        self.tokens[slot] -= tokens
        if not self.log[slot]:
            self.tokens[slot] = 0.0
        if not self.drain:
            self._count_ms(table, slot)
        return tokens

    def remove(self, table: ServiceTable, slot: int, at_ms: int, tokens: float) -> bool:
        """Undo the newest entry of `slot` logged at `at_ms` with exactly `tokens`; False
        when there is none (a newer advertisement counted it, or it never was)."""
        self._claim(table, slot)
        log = self.log[slot]
        for k in range(len(log) - 1, -1, -1):
            when, logged = log[k]
            if when < at_ms:
                return False
            if when == at_ms and logged == tokens:
                del log[k]
                self.tokens[slot] -= tokens
                if not log:
                    self.tokens[slot] = 0.0
                if not self.drain:
                    self._count_ms(table, slot)
                return True
        return False

    def queued_tokens(self, table: ServiceTable, slot: int, now_ms: float) -> float:
        """The advertised backlog drained to `now_ms` plus the pending work, in tokens,
        as the next decision would count it (no state changes, whatever has arrived)."""
        tps = float(table.prefill_tps[slot])
        backlog, at = float(table.backlog_tokens[slot]), float(table.metrics_ms[slot])
        log = self.log[slot] if self._is_current(table, slot) else deque()
        if self.drain:
            return replay(backlog, at, log, tps, now_ms)
        drained = max(0.0, backlog - max(0.0, now_ms - at) * tps / 1000)
        if slot < len(self.seen_version) and table.metrics_version[slot] == self.seen_version[slot]:
            return drained + self.peers * float(self.tokens[slot] if log else 0.0)
        # an advertisement not refreshed yet counts the entries built at or before it
        return drained + self.peers * sum(tokens for when, tokens in log if when > at)

    def _count_ms(self, table: ServiceTable, slot: int) -> None:
        self.ms[slot] = self.peers * self.tokens[slot] * table.ms_per_token[slot]

    def drain_ms(self, table: ServiceTable, slot: int, now_ms: float) -> None:
        """``drain``: `ms` of `slot` at `now_ms`, the replayed queue less the drained
        backlog, in ms of the advertised rate."""
        log = self.log[slot]
        if not log:
            self.ms[slot] = 0.0
            self.busy.discard(slot)
            return
        tps = float(table.prefill_tps[slot])
        backlog, at = float(table.backlog_tokens[slot]), float(table.metrics_ms[slot])
        drained = max(0.0, backlog - max(0.0, now_ms - at) * tps / 1000)
        self.ms[slot] = (replay(backlog, at, log, tps, now_ms) - drained) * 1000 / tps

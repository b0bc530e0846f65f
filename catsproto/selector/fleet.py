"""One probe answers a block key for every instance at once: the fleet's filters side by side.

Strategy. The key index (`index.py`) needs, for a few keys, the set of instances whose
summaries hold each of them. Asking every instance's summary in turn costs one numpy
call per (instance, shard): tens of microseconds each, so a key never seen before cost
over 100 ms against a thousand instances. Here every binary fuse filter of a service
table is one *row* — its hash salts, geometry and alphabet in a row of `_par`, its slot
values copied into one shared buffer — so a probe of k keys against the rows of the
asked slots is one call of a compiled loop (`probe_pass.py`) over the (key, row) pairs
whose shard range holds the key, with the hashing of `FuseSummary.contains_many`.
A fuse row with a delta layered on it (`LayeredView`) keeps its exact corrections, the
delta's sorted added and removed keys, in one shared key buffer, and the pass asks them
by bisection before the filter. Summaries of other kinds (exact sets, Bloom filters) and
fuse filters with alphabets above 256 are handed back by the pass and asked one by one:
the node prefers fuse filters for every set larger than a few dozen keys, so those rows
are few and small. Where the compiled pass cannot be loaded (`PASS`: no numba for the
platform, or its compiler refusing the machine) every row is asked that way:
the same answers, one numpy call per (row, batch of keys).

Rows are rebuilt lazily: a slot whose generation moved (`ServiceTable.touch`) gets new
rows at the next probe, its old rows are marked dead, and the buffer is compacted when
more than half of it is dead; the correction buffer likewise. Pure: no clocks, no IO.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from catsproto.kernels import Kernel
from catsproto.selector.fuse_rows import (
    P_FOUR,
    P_M,
    P_OFFSET,
    P_SALT0,
    P_SALT1,
    P_SEG,
    P_SEG_LOG2,
    P_SEG_MASK,
    P_STARTS,
    P_WIDTH,
)
from catsproto.summary.delta import LayeredView
from catsproto.summary.fuse import FuseSummary
from catsproto.summary.hashing import GOLDEN, mix64_int

if TYPE_CHECKING:
    from catsproto.selector.rib import ServiceTable

_MASK64 = (1 << 64) - 1
_ROW_FIELDS = (
    ("slot", np.int64),
    ("tier", np.int64),
    ("key_lo", np.uint64),
    ("key_hi", np.uint64),
    ("salt0", np.uint64),
    ("salt1", np.uint64),
    ("starts", np.uint64),  # segments - arity + 1
    ("seg_log2", np.uint64),
    ("seg_mask", np.uint64),
    ("four", np.bool_),  # arity 4 (else 3)
    ("m", np.uint64),
    ("offset", np.int64),  # of the row's slot values in the buffer
    ("fuse", np.bool_),  # asked in the compiled pass; else through `other`
    ("corrected", np.bool_),  # a fuse row with exact corrections (a delta on top)
)


def _load_pass() -> ModuleType:
    from catsproto.selector import probe_pass

    return probe_pass


PASS = Kernel(_load_pass)
"""The compiled pass, or None where it cannot be loaded: a probe then asks every filter
through its own summary, as it asks other kinds (the same answers, at numpy's speed)."""


def _salt(seed: int, stream: int) -> int:
    return mix64_int((seed + (stream + 1) * GOLDEN) & _MASK64)


class FleetProbe:
    """Membership of block keys across all instances of one `ServiceTable`."""

    def __init__(self, table: ServiceTable, *, compiled: bool = True) -> None:
        # the compiled pass, loaded with the first probe (importing the selector alone
        # does not pay for the compiler); without it (or `compiled=False`) every row is
        # asked through its own summary
        self._kernels = PASS.get() if compiled else None
        self.table = table
        self._cols: dict[str, np.ndarray] = {name: np.zeros(0, t) for name, t in _ROW_FIELDS}
        self._par = np.zeros((0, P_WIDTH), dtype=np.uint64)
        self._rows = 0
        self._buf = np.zeros(1, dtype=np.uint8)  # index 0 stays 0: arity-3 rows' 4th gather
        self._used = 1
        self._dead = 0
        self._slot_rows: dict[int, range] = {}
        self._live: np.ndarray | None = None  # the slots with rows (sorted), while kept
        self._live_mask: tuple[np.ndarray, int] | None = None  # (that array, its bitmask)
        self._special: np.ndarray | None = None  # room for the rows a pass leaves to Python
        self._built_gen = np.full(0, -1, dtype=np.int64)
        self._slot_start = np.zeros(0, dtype=np.int64)  # rows of slot s: start..stop
        self._slot_stop = np.zeros(0, dtype=np.int64)
        self._other: dict[int, object] = {}  # row -> state with contains_many
        self._row_corrections: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # the corrections as the pass reads them: row -> (added start, stop, removed
        # start, stop) in one buffer of keys
        self._corr_at = np.zeros((0, 4), dtype=np.int64)
        self._corr = np.zeros(0, dtype=np.uint64)
        self._corr_used = self._corr_dead = 0
        self._synced = -1  # the table generation the rows were last brought up to
        self.rebuilds = 0  # slots whose rows were rebuilt, for tests and benchmarks
        self.compactions = 0
        self.correction_compactions = 0
        self.pairs = 0  # (key, filter) pairs evaluated: the summary lookups done
        # the pass requests each pair's cache lines ahead of its reads (the same answers
        # either way; off only to measure what that gains: benchmarks/selector.py)
        self.prefetch = True

    # ---- keeping rows in step with the table --------------------------------------------

    def sync(self) -> None:
        """Rebuild the rows of every slot whose summaries changed since last built."""
        table = self.table
        n = len(table.instances)
        if table.generation == self._synced:  # no slot touched since (`ServiceTable.touch`)
            return
        self._synced = table.generation
        if len(self._built_gen) < n:
            grown = np.full(max(n, 2 * len(self._built_gen)), -1, dtype=np.int64)
            grown[: len(self._built_gen)] = self._built_gen
            self._built_gen = grown
            for name in ("_slot_start", "_slot_stop"):
                col = np.zeros(len(grown), dtype=np.int64)
                col[: len(getattr(self, name))] = getattr(self, name)
                setattr(self, name, col)
        dirty = np.flatnonzero(table.slot_generation[:n] != self._built_gen[:n])
        for slot in dirty.tolist():
            if not self._refill_slot(slot):
                self._drop_slot(slot)
                self._add_slot(slot)
            self._built_gen[slot] = table.slot_generation[slot]
            self.rebuilds += 1
        if self._dead > 4096 and self._dead * 2 > self._used:
            self._compact()
        elif self._corr_dead > 4096 and self._corr_dead * 2 > self._corr_used:
            self._compact_corrections()

    def _drop_slot(self, slot: int) -> None:
        self._live = self._special = None
        rows = self._slot_rows.pop(slot, None)
        if rows is None:
            return
        self._slot_start[slot] = self._slot_stop[slot] = 0
        cols = self._cols
        for r in rows:
            if cols["fuse"][r]:
                self._dead += int((cols["starts"][r] + cols["four"][r] + 2) << cols["seg_log2"][r])
            self._forget_row(r)
        # dead rows never match: an empty key range
        cols["key_lo"][rows.start : rows.stop] = 1
        cols["key_hi"][rows.start : rows.stop] = 0

    def _add_slot(self, slot: int) -> None:
        self._live = self._special = None
        inst = self.table.instances[slot]
        if inst is None:
            return
        first = self._rows
        for tier, state in inst.tiers.items():
            for (lo, hi), receiver in state.shards.items():
                summary = receiver.state
                if summary is None:
                    continue
                self._add_row(slot, int(tier), lo, hi, summary)
        self._slot_rows[slot] = range(first, self._rows)
        self._slot_start[slot], self._slot_stop[slot] = first, self._rows

    def _grow(self) -> None:
        r = self._rows
        size = max(64, 2 * r)
        for name, col in self._cols.items():
            grown = np.zeros(size, dtype=col.dtype)
            grown[:r] = col[:r]
            self._cols[name] = grown
        par = np.zeros((size, P_WIDTH), dtype=np.uint64)
        par[:r] = self._par[:r]
        self._par = par
        corr_at = np.zeros((size, 4), dtype=np.int64)
        corr_at[:r] = self._corr_at[:r]
        self._corr_at = corr_at

    def _forget_row(self, r: int) -> None:
        """Drop row r's per-row object and exact corrections from the books."""
        self._other.pop(r, None)
        gone = self._row_corrections.pop(r, None)
        if gone is not None:
            self._cols["corrected"][r] = False
            self._corr_dead += len(gone[0]) + len(gone[1])

    def _refill_slot(self, slot: int) -> bool:
        """Rewrite a changed slot's rows where they stand, if its new summaries have the
        old rows' shards, kinds and slot-value lengths (a site re-advertising filters of
        the same geometry, the usual update): no buffer growth, the rows keep their
        indices, so the remembered row sets stay valid; the columns are written a slot at
        a time. False (nothing changed) if not."""
        rows = self._slot_rows.get(slot)
        inst = self.table.instances[slot]
        if rows is None or inst is None or len(rows) == 0:
            return False
        tiers: list[int] = []
        ranges: list[int] = []
        states: list[object] = []
        for tier, state in inst.tiers.items():
            for (lo, hi), receiver in state.shards.items():
                if receiver.state is not None:
                    tiers.append(int(tier))
                    ranges += (lo, hi)
                    states.append(receiver.state)
        part = slice(rows.start, rows.stop)
        cols = self._cols
        if len(states) != len(rows) or cols["tier"][part].tolist() != tiers:
            return False
        old = np.stack([cols["key_lo"][part], cols["key_hi"][part]], axis=1).ravel()
        if old.tolist() != ranges:
            return False
        fuse_old = cols["fuse"][part].tolist()
        length_old = (
            (cols["starts"][part] + cols["four"][part] + 2) << cols["seg_log2"][part]
        ).tolist()
        bases = [st.base if isinstance(st, LayeredView) else st for st in states]
        for base, fuse, length in zip(bases, fuse_old, length_old, strict=True):
            if self._in_pass(base) != fuse:
                return False
            if fuse and len(base.table_values()) != length:
                return False
        params: list[list[int]] = []
        offsets = cols["offset"][part].tolist()
        buf = self._buf
        for j, r in enumerate(rows):
            self._forget_row(r)
            summary, base = states[j], bases[j]
            if not fuse_old[j]:
                self._other[r] = summary
                params.append([0] * P_WIDTH)
                continue
            values = base.table_values()
            at = offsets[j]
            buf[at : at + len(values)] = values
            seg_log2 = base.seg_log2
            params.append(
                [
                    _salt(base.seed, 0),
                    _salt(base.seed, 1),
                    base.segments - base.arity + 1,
                    seg_log2,
                    (1 << seg_log2) - 1,
                    base.m,
                    at,
                    1 << seg_log2,
                    _MASK64 if base.arity == 4 else 0,
                ]
            )
            if isinstance(summary, LayeredView):
                self._correct_row(r, summary)
        par = np.array(params, dtype=np.uint64)
        fuse_rows = np.array(fuse_old, dtype=bool)
        par[~fuse_rows] = self._par[part][~fuse_rows]
        self._par[part] = par
        par = par.T
        for name, at in (
            ("salt0", P_SALT0),
            ("salt1", P_SALT1),
            ("starts", P_STARTS),
            ("seg_log2", P_SEG_LOG2),
            ("seg_mask", P_SEG_MASK),
            ("m", P_M),
        ):
            cols[name][part][fuse_rows] = par[at][fuse_rows]
        cols["four"][part][fuse_rows] = par[P_FOUR][fuse_rows] != 0
        return True

    def _correct_row(self, r: int, summary: LayeredView) -> None:
        """Book the exact additions and removals of the delta layered on row r (sorted,
        as `apply_delta` leaves them), where the compiled pass reads them."""
        self._book_corrections(r, (summary.added, summary.removed))
        self._cols["corrected"][r] = True

    def _book_corrections(self, r: int, corrections: tuple[np.ndarray, np.ndarray]) -> None:
        added, removed = corrections
        self._row_corrections[r] = corrections
        start = self._corr_used
        need = start + len(added) + len(removed)
        if need > len(self._corr):
            grown = np.zeros(max(need, 2 * len(self._corr), 256), dtype=np.uint64)
            grown[:start] = self._corr[:start]
            self._corr = grown
        middle = start + len(added)
        self._corr[start:middle] = added
        self._corr[middle:need] = removed
        self._corr_at[r] = (start, middle, middle, need)
        self._corr_used = need

    def _compact_corrections(self) -> None:
        """Rewrite the live rows' corrections into a fresh buffer."""
        self.correction_compactions += 1
        live = sorted(self._row_corrections.items())
        self._corr = np.zeros(max(256, sum(len(a) + len(b) for _, (a, b) in live)), np.uint64)
        self._corr_used = self._corr_dead = 0
        for r, corrections in live:
            self._book_corrections(r, corrections)

    def _add_row(self, slot: int, tier: int, lo: int, hi: int, summary: object) -> None:
        r = self._rows
        if r == len(self._cols["slot"]):
            self._grow()
        self._fill_row(r, slot, tier, lo, hi, summary, None)
        self._rows = r + 1

    def _fill_row(
        self, r: int, slot: int, tier: int, lo: int, hi: int, summary: object, at: int | None
    ) -> None:
        """Write row r; its slot values appended to the buffer, or over those at `at`."""
        cols = self._cols
        cols["slot"][r], cols["tier"][r] = slot, tier
        cols["key_lo"][r], cols["key_hi"][r] = lo, hi
        base = summary.base if isinstance(summary, LayeredView) else summary
        if self._in_pass(base):
            values = base.table_values()
            if at is None:
                offset = self._append(values)
            else:
                offset = at
                self._buf[at : at + len(values)] = values
            cols["salt0"][r], cols["salt1"][r] = _salt(base.seed, 0), _salt(base.seed, 1)
            cols["starts"][r] = base.segments - base.arity + 1
            cols["seg_log2"][r] = base.seg_log2
            cols["seg_mask"][r] = (1 << base.seg_log2) - 1
            cols["four"][r] = base.arity == 4
            cols["m"][r] = base.m
            cols["offset"][r] = offset
            cols["fuse"][r] = True
            self._par[r] = self._params(r)
            if isinstance(summary, LayeredView):
                self._correct_row(r, summary)
        else:
            cols["fuse"][r] = False
            self._other[r] = summary
            self._special = None

    def _in_pass(self, base: object) -> bool:
        """Whether a row of this summary is asked in the compiled pass: a fuse filter of
        byte-sized slot values, when the pass is loaded."""
        return self._kernels is not None and isinstance(base, FuseSummary) and base.m <= 256

    def _params(self, r: int) -> list[int]:
        """Row r's hashing parameters, a row of `_par`."""
        cols = self._cols
        out = [0] * P_WIDTH
        out[P_SALT0], out[P_SALT1] = int(cols["salt0"][r]), int(cols["salt1"][r])
        out[P_STARTS], out[P_SEG_LOG2] = int(cols["starts"][r]), int(cols["seg_log2"][r])
        out[P_SEG_MASK], out[P_M] = int(cols["seg_mask"][r]), int(cols["m"][r])
        out[P_OFFSET], out[P_SEG] = int(cols["offset"][r]), 1 << int(cols["seg_log2"][r])
        out[P_FOUR] = (1 << 64) - 1 if cols["four"][r] else 0  # arity 3: 4th gather at 0
        return out

    def _append(self, values: np.ndarray) -> int:
        need = self._used + len(values)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.uint8)
            grown[: self._used] = self._buf[: self._used]
            self._buf = grown
        offset = self._used
        self._buf[offset:need] = values
        self._used = need
        return offset

    def _compact(self) -> None:
        """Copy the live rows' slot values to a fresh buffer and forget the dead rows."""
        self.compactions += 1
        self._live = self._special = None
        old_rows = sorted(self._slot_rows.items())
        old_cols, old_buf = self._cols, self._buf
        old_other, old_corr = self._other, self._row_corrections
        self._cols = {name: np.zeros(0, t) for name, t in _ROW_FIELDS}
        self._par = np.zeros((0, P_WIDTH), dtype=np.uint64)
        self._corr_at = np.zeros((0, 4), dtype=np.int64)
        self._corr_used = self._corr_dead = 0
        self._rows, self._used, self._dead = 0, 1, 0
        self._buf = np.zeros(max(1, len(old_buf) // 2), dtype=np.uint8)
        self._slot_rows, self._other, self._row_corrections = {}, {}, {}
        for slot, rows in old_rows:
            first = self._rows
            for r in rows:
                self._copy_row(old_cols, old_buf, r, old_other.get(r), old_corr.get(r))
            self._slot_rows[slot] = range(first, self._rows)
            self._slot_start[slot], self._slot_stop[slot] = first, self._rows

    def _copy_row(self, cols, buf, r, other, corrections) -> None:
        new = self._rows
        if new == len(self._cols["slot"]):
            self._grow()
        for name in self._cols:
            self._cols[name][new] = cols[name][r]
        if cols["fuse"][r]:
            length = int((cols["starts"][r] + cols["four"][r] + 2) << cols["seg_log2"][r])
            start = int(cols["offset"][r])
            self._cols["offset"][new] = self._append(buf[start : start + length])
            self._par[new] = self._params(new)
        if other is not None:
            self._other[new] = other
        if corrections is not None:
            self._book_corrections(new, corrections)
        self._rows = new + 1

    # ---- probing ---------------------------------------------------------------------

    def rows_of(self, slots: np.ndarray | None) -> np.ndarray:
        """Row indices of `slots` (all live rows if None)."""
        return self._rows_of(self._asked(slots))

    def live_mask(self) -> int:
        """The slots with rows, as a bitmask (after bringing the rows up to the table)."""
        self.sync()
        live = self._asked(None)
        if self._live_mask is None or self._live_mask[0] is not live:
            bits = np.zeros(int(live[-1]) + 1 if len(live) else 0, dtype=bool)
            bits[live] = True
            mask = int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")
            self._live_mask = (live, mask)
        return self._live_mask[1]

    def _asked(self, slots: np.ndarray | None) -> np.ndarray:
        """`slots` (every slot with rows if None) that the table has room for."""
        if slots is None:
            if self._live is None:
                live = np.fromiter(self._slot_rows, dtype=np.int64, count=len(self._slot_rows))
                live.sort()
                self._live = live
            return self._live
        slots = np.asarray(slots, dtype=np.int64)
        return slots[(slots >= 0) & (slots < len(self._slot_start))]

    def _rows_of(self, slots: np.ndarray) -> np.ndarray:
        starts, stops = self._slot_start[slots], self._slot_stop[slots]
        lengths = stops - starts
        total = int(lengths.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        # concatenated ranges: each row index is its range's start plus its rank inside it
        shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        return shift + np.arange(total)

    def held(self, keys: np.ndarray, slots: np.ndarray | None = None) -> list[int]:
        """Per key, the bitmask of slots (of `slots`, or all) whose summaries hold it."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        self.sync()
        asked = self._asked(slots)
        if len(keys) == 0 or len(asked) == 0:
            return [0] * len(keys)
        # one bit per slot from the first asked (rounded down to a byte) to the last
        if slots is None:  # every slot with rows: sorted already
            lo, hi = int(asked[0]), int(asked[-1])
        else:
            lo, hi = int(asked.min()), int(asked.max())
        base = lo & ~7
        width = (hi - base + 8) & ~7
        dense = np.zeros((len(keys), width), dtype=np.bool_)
        self._pass(keys, asked, False, base, dense)
        raw = np.packbits(dense, axis=1, bitorder="little").tobytes()
        width >>= 3
        return [
            int.from_bytes(raw[at : at + width], "little") << base
            for at in range(0, len(raw), width)
        ]

    def hits(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether each of `slots` (distinct) holds each key: a (key, slot) boolean
        array, the same answers as `held` without building a bitmask per key (what a
        caller that reads a few slots' columns wants)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        out = np.zeros((len(keys), len(slots)), dtype=np.bool_)
        self.sync()
        if len(keys) and len(slots):
            self._pass(keys, slots, True, 0, out)
        return out

    def _pass(
        self, keys: np.ndarray, slots: np.ndarray, by_position: bool, base: int, out: np.ndarray
    ) -> None:
        """Set out[key, column] where a row of the slot holds the key: the column is the
        slot's position in `slots` if `by_position`, else the slot less `base`. Fuse rows
        (with their exact corrections) are asked in the compiled pass; the rows it hands
        back (other kinds) here, one by one."""
        if self._kernels is None:  # no compiled pass: every row asks itself
            stop = len(self._slot_start)
            for j, s in enumerate(slots.tolist()):
                if 0 <= s < stop:
                    column = j if by_position else s - base
                    for r in range(int(self._slot_start[s]), int(self._slot_stop[s])):
                        self._special_row(keys, r, column, out)
            return
        cols = self._cols
        if self._special is None:
            count = int(np.count_nonzero(~cols["fuse"][: self._rows]))
            self._special = np.zeros((count, 2), dtype=np.int64)
        pairs, handed = self._kernels.probe_pass(
            _frozen(keys),
            _frozen(slots),
            by_position,
            base,
            self._slot_start,
            self._slot_stop,
            cols["key_lo"],
            cols["key_hi"],
            cols["fuse"],
            cols["corrected"],
            self._corr_at,
            self._corr,
            self._par,
            self._buf,
            out,
            self._special,
            self.prefetch,
        )
        self.pairs += pairs
        if handed:
            for r, column in self._special[:handed].tolist():
                self._special_row(keys, r, column, out)

    def _special_row(self, keys: np.ndarray, r: int, column: int, out: np.ndarray) -> None:
        """Row r's answers for the keys in its range, into `out[:, column]`: a summary of
        another kind asks itself."""
        cols = self._cols
        state = self._other.get(r)
        if state is None:
            return
        inside = np.flatnonzero((keys >= cols["key_lo"][r]) & (keys <= cols["key_hi"][r]))
        x = keys[inside]
        hit = state.contains_many(x)
        self.pairs += len(x)
        out[inside[hit], column] = True


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view of `a` (itself if it is one): the compiled pass's input type."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a

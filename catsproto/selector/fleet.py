"""One probe answers a block key for every instance at once: the fleet's filters side by side.

Strategy. The key index (`index.py`) needs, for a few keys, the set of instances whose
summaries hold each of them. Asking every instance's summary in turn costs one numpy
call per (instance, shard): tens of microseconds each, so a key never seen before cost
over 100 ms against a thousand instances. Here every binary fuse filter of a service
table is one *row* — its hash salts, geometry and alphabet in per-row arrays, its slot
values copied into one shared buffer — so a probe of k keys against r rows is a single
run of vector operations over the k × r (key, row) pairs whose shard range contains the
key: the same hashing and gathers as `FuseSummary.contains_many`, with each row's
parameters broadcast. Deltas on top of a fuse snapshot (`LayeredView`) add exact
corrections, kept per key in two small dictionaries. Summaries of other kinds (exact
sets, Bloom filters) and fuse filters with alphabets above 256 stay per-row objects and
are asked one by one: the node prefers fuse filters for every set larger than a few
dozen keys, so those rows are few and small.

Rows are rebuilt lazily: a slot whose generation moved (`ServiceTable.touch`) gets new
rows at the next probe, its old rows are marked dead, and the buffer is compacted when
more than half of it is dead. Pure: no clocks, no IO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from catsproto.summary.delta import LayeredView
from catsproto.summary.fuse import FuseSummary
from catsproto.summary.hashing import GOLDEN, mix64_int

if TYPE_CHECKING:
    from catsproto.selector.rib import ServiceTable

_MASK64 = (1 << 64) - 1
_U32 = np.uint64(0xFFFFFFFF)
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_S48 = np.uint64(48)
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
    ("fuse", np.bool_),  # vectorised row; else asked through `other`
)


# Per-row hashing parameters side by side, so a probe gathers them in one take: the
# rows of `FleetProbe._par` (parameter x row).
_P_SALT0, _P_SALT1, _P_STARTS, _P_SEG_LOG2, _P_SEG_MASK, _P_M, _P_OFFSET, _P_SEG, _P_FOUR = range(9)
_P_WIDTH = 9
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # the SplitMix64 finaliser of `hashing.mix64`, inlined
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
_SHIFTS = np.array([[0], [16], [32], [48]], dtype=np.uint64)  # of h2, one per hash function
_STEPS = np.arange(4, dtype=np.uint64)[:, None]  # segments after the first


def _salt(seed: int, stream: int) -> int:
    return mix64_int((seed + (stream + 1) * GOLDEN) & _MASK64)


class FleetProbe:
    """Membership of block keys across all instances of one `ServiceTable`."""

    def __init__(self, table: ServiceTable) -> None:
        self.table = table
        self._cols: dict[str, np.ndarray] = {name: np.zeros(0, t) for name, t in _ROW_FIELDS}
        self._par = np.zeros((_P_WIDTH, 0), dtype=np.uint64)
        self._rows = 0
        self._buf = np.zeros(1, dtype=np.uint8)  # index 0 stays 0: arity-3 rows' 4th gather
        self._used = 1
        self._dead = 0
        self._slot_rows: dict[int, range] = {}
        self._all: _RowSet | None = None  # every live slot's rows, while rows do not move
        self._all_slots = np.zeros(0, dtype=np.int64)  # those slots, sorted
        self._sets: dict[bytes, _RowSet] = {}  # the rows of slot sets asked recently
        self._built_gen = np.full(0, -1, dtype=np.int64)
        self._slot_start = np.zeros(0, dtype=np.int64)  # rows of slot s: start..stop
        self._slot_stop = np.zeros(0, dtype=np.int64)
        self._other: dict[int, object] = {}  # row -> state with contains_many
        self._added: dict[int, list[int]] = {}  # key -> rows whose delta added it
        self._removed: dict[int, list[int]] = {}  # key -> rows whose delta removed it
        self._row_corrections: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._synced = -1  # the table generation the rows were last brought up to
        self.rebuilds = 0  # slots whose rows were rebuilt, for tests and benchmarks
        self.compactions = 0
        self.pairs = 0  # (key, filter) pairs evaluated: the summary lookups done

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

    def _drop_slot(self, slot: int) -> None:
        self._all = None
        bit = 1 << slot  # remembered row sets holding the slot: stale once it moves
        for name in [name for name, rs in self._sets.items() if rs.mask & bit]:
            del self._sets[name]
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
        self._all = None
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
        par = np.zeros((_P_WIDTH, size), dtype=np.uint64)
        par[:, :r] = self._par[:, :r]
        self._par = par

    def _forget_row(self, r: int) -> None:
        """Drop row r's per-row object and exact corrections from the books."""
        self._other.pop(r, None)
        added, removed = self._row_corrections.pop(r, (None, None))
        for keys, book in ((added, self._added), (removed, self._removed)):
            for k in keys.tolist() if keys is not None else ():
                owners = book[k]
                owners.remove(r)
                if not owners:
                    del book[k]

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
            if (isinstance(base, FuseSummary) and base.m <= 256) != fuse:
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
                params.append([0] * _P_WIDTH)
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
        par = np.array(params, dtype=np.uint64).T
        fuse_rows = np.array(fuse_old, dtype=bool)
        par[:, ~fuse_rows] = self._par[:, part][:, ~fuse_rows]
        self._par[:, part] = par
        for name, at in (
            ("salt0", _P_SALT0),
            ("salt1", _P_SALT1),
            ("starts", _P_STARTS),
            ("seg_log2", _P_SEG_LOG2),
            ("seg_mask", _P_SEG_MASK),
            ("m", _P_M),
        ):
            cols[name][part][fuse_rows] = par[at][fuse_rows]
        cols["four"][part][fuse_rows] = par[_P_FOUR][fuse_rows] != 0
        return True

    def _correct_row(self, r: int, summary: LayeredView) -> None:
        """Book the exact additions and removals of the delta layered on row r."""
        self._row_corrections[r] = (summary.added, summary.removed)
        for keys, book in ((summary.added, self._added), (summary.removed, self._removed)):
            for k in keys.tolist():
                book.setdefault(k, []).append(r)

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
        if isinstance(base, FuseSummary) and base.m <= 256:
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
            self._par[:, r] = self._params(r)
            if isinstance(summary, LayeredView):
                self._correct_row(r, summary)
        else:
            cols["fuse"][r] = False
            self._other[r] = summary

    def _params(self, r: int) -> list[int]:
        """Row r's hashing parameters, a column of `_par`."""
        cols = self._cols
        out = [0] * _P_WIDTH
        out[_P_SALT0], out[_P_SALT1] = int(cols["salt0"][r]), int(cols["salt1"][r])
        out[_P_STARTS], out[_P_SEG_LOG2] = int(cols["starts"][r]), int(cols["seg_log2"][r])
        out[_P_SEG_MASK], out[_P_M] = int(cols["seg_mask"][r]), int(cols["m"][r])
        out[_P_OFFSET], out[_P_SEG] = int(cols["offset"][r]), 1 << int(cols["seg_log2"][r])
        out[_P_FOUR] = (1 << 64) - 1 if cols["four"][r] else 0  # arity 3: 4th gather at 0
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
        self._all = None
        self._sets = {}
        old_rows = sorted(self._slot_rows.items())
        old_cols, old_buf = self._cols, self._buf
        old_other, old_corr = self._other, self._row_corrections
        self._cols = {name: np.zeros(0, t) for name, t in _ROW_FIELDS}
        self._par = np.zeros((_P_WIDTH, 0), dtype=np.uint64)
        self._rows, self._used, self._dead = 0, 1, 0
        self._buf = np.zeros(max(1, len(old_buf) // 2), dtype=np.uint8)
        self._slot_rows, self._other, self._row_corrections = {}, {}, {}
        self._added, self._removed = {}, {}
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
            self._par[:, new] = self._params(new)
        if other is not None:
            self._other[new] = other
        if corrections is not None:
            self._row_corrections[new] = corrections
            for keys, book in zip(corrections, (self._added, self._removed), strict=True):
                for k in keys.tolist():
                    book.setdefault(k, []).append(new)
        self._rows = new + 1

    # ---- probing ---------------------------------------------------------------------

    def rows_of(self, slots: np.ndarray | None) -> np.ndarray:
        """Row indices of `slots` (all live rows if None)."""
        rs = self._row_set(slots)
        return rs.rows if rs is not None else np.zeros(0, dtype=np.int64)

    def _row_set(self, slots: np.ndarray | None) -> _RowSet | None:
        """The rows of `slots` (every live slot if None) with what a probe reads of them,
        remembered while none of those slots changes (a decision asks the holders of a
        prefix several times, and the same holders recur with the same prompts)."""
        if self._all is None:
            live = np.fromiter(self._slot_rows, dtype=np.int64, count=len(self._slot_rows))
            live.sort()
            self._all_slots, self._all = live, self._new_row_set(live)
        if slots is None:
            return self._all
        if len(slots) == len(self._all_slots) and np.array_equal(slots, self._all_slots):
            return self._all
        name = slots.tobytes()
        rs = self._sets.get(name)
        if rs is None:
            rs = self._new_row_set(slots)
            if len(self._sets) >= 256:
                self._sets.clear()
            self._sets[name] = rs
        return rs

    def _new_row_set(self, slots: np.ndarray) -> _RowSet | None:
        slots = np.asarray(slots, dtype=np.int64)
        mask = _mask_of(slots)  # every asked slot, rows or not: one added later drops the set
        slots = slots[slots < len(self._slot_start)]
        rows = self._rows_of(slots)
        if len(rows) == 0:
            return _RowSet(rows, 0, 0, mask, self._cols)
        return _RowSet(rows, int(slots.min()), int(slots.max()), mask, self._cols)

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
        keys = np.asarray(keys, dtype=np.uint64)
        n_keys = len(keys)
        found = self._probe(keys, slots)
        if found is None:
            return [0] * n_keys
        rs, ki, rj, hit = found
        # one bit per slot from the set's first (rounded down to a byte) to its last
        dense = np.zeros((n_keys, rs.width), dtype=bool)
        dense[ki[hit], rs.slot[rj[hit]]] = True
        raw = np.packbits(dense, axis=1, bitorder="little").tobytes()
        width, base = rs.width >> 3, rs.base
        return [
            int.from_bytes(raw[at : at + width], "little") << base
            for at in range(0, len(raw), width)
        ]

    def hits(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether each of `slots` (distinct) holds each key: a (key, slot) boolean
        array, the same answers as `held` without building a bitmask per key (what a
        caller that reads a few slots' columns wants)."""
        keys = np.asarray(keys, dtype=np.uint64)
        out = np.zeros((len(keys), len(slots)), dtype=bool)
        found = self._probe(keys, slots)
        if found is None:
            return out
        rs, ki, rj, hit = found
        if rs.column is None:  # each row's position in the asked slots
            order = np.argsort(slots)
            rs.column = order[np.searchsorted(slots[order], rs.slot + rs.base)]
        out[ki[hit], rs.column[rj[hit]]] = True
        return out

    def _probe(
        self, keys: np.ndarray, slots: np.ndarray | None
    ) -> tuple[_RowSet, np.ndarray, np.ndarray, np.ndarray] | None:
        """The row set of `slots`, the (key, row) pairs whose shard range holds the key
        and whether each row's filter holds its key; None if nothing to ask."""
        self.sync()
        rs = self._row_set(slots)
        if len(keys) == 0 or rs is None or len(rs.rows) == 0:
            return None
        rows = rs.rows
        pairs: _Pairs | _DensePairs
        if len(keys) * len(rows) <= _DENSE_PAIRS:
            pairs = _DensePairs(keys, rs.lo, rs.hi)
        else:
            pairs = _Pairs(keys, rs.lo, rs.hi)
        ki, rj = pairs.key, pairs.row
        if rs.fuse is None:  # every row a fuse filter: the usual case
            self.pairs += len(ki)
            hit = self._fuse_hits(keys[ki], rows[rj]) if len(ki) else np.zeros(0, dtype=bool)
        else:
            hit = np.zeros(len(ki), dtype=bool)
            fuse = rs.fuse[rj]
            self.pairs += int(np.count_nonzero(fuse))
            if fuse.any():
                hit[fuse] = self._fuse_hits(keys[ki[fuse]], rows[rj[fuse]])
            for j in np.flatnonzero(~rs.fuse).tolist():
                state = self._other.get(int(rows[j]))
                at = pairs.of_row(j)
                if state is not None and len(at):
                    hit[at] = state.contains_many(keys[ki[at]])
                    self.pairs += len(at)
        if self._added or self._removed:
            self._correct(keys, rows, pairs, hit)
        return rs, ki, rj, hit

    def _fuse_hits(self, x: np.ndarray, rr: np.ndarray) -> np.ndarray:
        """`FuseSummary.contains_many` of key x[i] in row rr[i], for every i at once: the
        rows' parameters in one gather, both hash streams mixed together, the 3 or 4 slot
        values in one gather (an arity-3 row's 4th reads the buffer's zero at 0)."""
        par = self._par.take(rr, axis=1)  # (parameter, pair): each row contiguous
        z = par[_P_SALT0 : _P_SALT1 + 1] ^ x  # mix64 of both streams, in place
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
        h, h2 = z[0], z[1]
        base = (((h >> _S32) * par[_P_STARTS]) >> _S32) << par[_P_SEG_LOG2]
        base += par[_P_OFFSET]
        at = (h2 >> _SHIFTS) & par[_P_SEG_MASK]  # (hash function, pair)
        at += base
        at += par[_P_SEG] * _STEPS
        at[3] &= par[_P_FOUR]
        acc = self._buf[at.view(np.int64)].sum(axis=0, dtype=np.uint64)
        m = par[_P_M]
        return acc % m == ((h & _U32) * m) >> _S32

    def _correct(
        self, keys: np.ndarray, rows: np.ndarray, pairs: _Pairs | _DensePairs, hit: np.ndarray
    ) -> None:
        """Apply the exact additions and removals of deltas layered on fuse rows."""
        where: dict[int, int] | None = None
        for i, k in enumerate(keys.tolist()):
            for book, value in ((self._removed, False), (self._added, True)):
                owners = book.get(k)
                if not owners:
                    continue
                if where is None:
                    where = {int(r): j for j, r in enumerate(rows.tolist())}
                for r in owners:
                    j = where.get(r)
                    at = pairs.find(i, j) if j is not None else None
                    if at is not None:
                        hit[at] = value


_DENSE_PAIRS = 16384  # (key, row) tests up to which testing each against each is quicker


class _DensePairs:
    """The (key, row) pairs of a small probe, by testing every key against every row."""

    __slots__ = ("_index", "inside", "key", "row")

    def __init__(self, keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        key_col = keys[:, None]
        self.inside = (key_col >= lo) & (key_col <= hi)
        self.key, self.row = np.nonzero(self.inside)
        self._index: np.ndarray | None = None

    def of_row(self, j: int) -> np.ndarray:
        return np.flatnonzero(self.row == j)

    def find(self, i: int, j: int) -> int | None:
        """The pair of key `i` and row `j`, if the row's range holds the key."""
        if not self.inside[i, j]:
            return None
        if self._index is None:
            self._index = np.full(self.inside.shape, -1, dtype=np.int64)
            self._index[self.key, self.row] = np.arange(len(self.key))
        return int(self._index[i, j])


class _Pairs:
    """The (key, row) pairs of a probe whose row's key range holds the key, found by
    sorting the keys once and bisecting each row's range into them: O(rows x log keys +
    pairs), where testing every key against every row was O(keys x rows) — 400,000
    comparisons for a 200-block prompt asked of the 62 sites (33 shard routes each) that
    hold its prefix. Pairs come grouped by row, keys in sorted order within a row."""

    __slots__ = ("count", "first", "key", "order", "rank", "row", "start")

    def __init__(self, keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        if len(keys) == 1:  # a new prompt's first key, often asked of every row
            k = keys[0]
            self.row = np.flatnonzero((lo <= k) & (hi >= k))
            self.key = np.zeros(len(self.row), dtype=np.int64)
            self.order = None  # one key: rows found by bisecting `row` (sorted)
            return
        self.order = order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        self.start = np.searchsorted(ordered, lo, "left")
        count = np.searchsorted(ordered, hi, "right") - self.start
        np.maximum(count, 0, out=count)  # dead rows have an empty range (lo > hi)
        self.count = count
        self.first = np.cumsum(count) - count  # each row's first pair
        total = int(count.sum())
        self.row = np.repeat(np.arange(len(lo)), count)
        position = np.arange(total) - np.repeat(self.first - self.start, count)
        self.key = order[position]
        self.rank: np.ndarray | None = None  # sorted position of each key, when asked

    def of_row(self, j: int) -> np.ndarray:
        if self.order is None:
            return np.flatnonzero(self.row == j)
        first = int(self.first[j])
        return np.arange(first, first + int(self.count[j]))

    def find(self, i: int, j: int) -> int | None:
        """The pair of key `i` and row `j`, if the row's range holds the key."""
        if self.order is None:
            at = int(np.searchsorted(self.row, j))
            return at if at < len(self.row) and int(self.row[at]) == j else None
        if self.rank is None:
            self.rank = np.empty(len(self.order), dtype=np.int64)
            self.rank[self.order] = np.arange(len(self.order))
        offset = int(self.rank[i]) - int(self.start[j])
        return int(self.first[j]) + offset if 0 <= offset < int(self.count[j]) else None


class _RowSet:
    """The rows of a set of slots and what a probe reads of them: key ranges, the slot of
    each row counted from `base` (the set's first slot rounded down to a byte), and which
    rows are not fuse filters (None when all are)."""

    __slots__ = ("base", "column", "fuse", "hi", "lo", "mask", "rows", "slot", "width")

    def __init__(
        self, rows: np.ndarray, first: int, last: int, mask: int, cols: dict[str, np.ndarray]
    ) -> None:
        self.rows, self.mask = rows, mask
        self.lo, self.hi = cols["key_lo"][rows], cols["key_hi"][rows]
        self.base = first & ~7
        self.width = (last - self.base + 8) & ~7
        self.slot = cols["slot"][rows] - self.base
        fuse = cols["fuse"][rows]
        self.fuse: np.ndarray | None = None if fuse.all() else fuse
        self.column: np.ndarray | None = None  # each row's slot's position (`hits`)


def _mask_of(slots: np.ndarray) -> int:
    if len(slots) == 0:
        return 0
    flags = np.zeros(int(slots.max()) + 1, dtype=bool)
    flags[slots] = True
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

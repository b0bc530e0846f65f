"""The fleet probe's compiled pass (`fleet.FleetProbe`): binary fuse lookups of many
(key, row) pairs in one call.

Strategy. A decision at a thousand sites asks a few keys of thousands of shard rows; as
vector operations that was some 30 numpy calls and their temporaries per pass, and on
cold caches the buffer reads waited one after another. Here one compiled loop walks the
asked slots' rows, bisects each row's shard range into the sorted keys, and tests the
pairs in batches: first the slot positions and fingerprints of 64 pairs, each pair's four
cache lines requested (a prefetch) as soon as its positions are known, then all their
buffer reads, which by then are under way together. The hashing is that of
`FuseSummary.contains_many` (`_slots_of`, `_member`), the only copy of it in the selector.
Types are fixed by the signatures (compiled once, cached beside the module): a caller
passing anything else gets a TypeError, never a silent second version. Pure: no clocks,
no IO of its own (the compiler's cache aside).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

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
)

_U64 = numba.uint64
# what the pass only reads of its caller: read-only views (index answers are kept frozen)
_KEYS = numba.types.Array(_U64, 1, "C", readonly=True)
_SLOTS = numba.types.Array(numba.int64, 1, "C", readonly=True)
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # the SplitMix64 finaliser of `hashing.mix64`
_M2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)


@numba.njit(_U64(_U64), cache=True, inline="always")
def _mix(z: int) -> int:
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    return z ^ (z >> np.uint64(31))


@numba.njit(_U64(_U64, _U64[::1], _U64[:, ::1], numba.int64), cache=True, inline="always")
def _slots_of(x: int, p: np.ndarray, at: np.ndarray, i: int) -> int:
    """Where key x's 3 or 4 slot values lie in the buffer, for the row with parameters `p`
    (a row of `_par`), into at[i] (an arity-3 row's fourth is 0, the buffer's zero);
    returns the fingerprint. The hashing of `FuseSummary.contains_many`: start segment
    and fingerprint from h, the slots within the segments from h2."""
    h = _mix(x ^ p[P_SALT0])
    h2 = _mix(x ^ p[P_SALT1])
    first = (((h >> np.uint64(32)) * p[P_STARTS]) >> np.uint64(32)) << p[P_SEG_LOG2]
    first += p[P_OFFSET]
    mask, seg = p[P_SEG_MASK], p[P_SEG]
    at[i, 0] = first + (h2 & mask)
    at[i, 1] = first + seg + ((h2 >> np.uint64(16)) & mask)
    at[i, 2] = first + np.uint64(2) * seg + ((h2 >> np.uint64(32)) & mask)
    at[i, 3] = (first + np.uint64(3) * seg + ((h2 >> np.uint64(48)) & mask)) & p[P_FOUR]
    return ((h & _LOW32) * p[P_M]) >> np.uint64(32)


@numba.njit(
    numba.bool_(numba.uint8[::1], _U64[:, ::1], numba.int64, _U64, _U64),
    cache=True,
    inline="always",
)
def _member(buf: np.ndarray, at: np.ndarray, i: int, fingerprint: int, m: int) -> bool:
    """Whether the slot values at at[i] sum to the fingerprint modulo m."""
    acc = np.uint64(buf[at[i, 0]]) + np.uint64(buf[at[i, 1]])
    acc += np.uint64(buf[at[i, 2]]) + np.uint64(buf[at[i, 3]])
    return acc % m == fingerprint


@numba.njit(numba.bool_(_U64[::1], numba.int64, numba.int64, _U64), cache=True, inline="always")
def _listed(corr: np.ndarray, lo: int, hi: int, x: int) -> bool:
    """Whether x is among the sorted keys corr[lo:hi] (one list of a row's exact
    corrections)."""
    a, top = lo, hi
    while a < top:
        mid = (a + top) >> 1
        if corr[mid] < x:
            a = mid + 1
        else:
            top = mid
    return a < hi and corr[a] == x


if numba.config.DISABLE_JIT:  # numba's debugging mode runs this module as Python

    def _prefetch(buf: np.ndarray, at: int) -> None:
        """Nothing to ask of the memory system from Python."""

else:

    @intrinsic
    def _prefetch(typingctx, buf, at):
        """Ask the memory system for the cache line of buf[at] now, without waiting for it
        (a hint: no fault, no effect on any value)."""

        def codegen(context, builder, signature, args):
            buf_type, _ = signature.args
            array = context.make_array(buf_type)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, buf_type, array, [args[1]])
            i32 = ir.IntType(32)
            # llvm.prefetch(address, read, keep in all levels, data cache)
            name = "llvm.prefetch.p0"
            if not getattr(ptr.type, "is_opaque", True):  # an LLVM with typed pointers
                ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
                name = "llvm.prefetch.p0i8"
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]), name
            )
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return numba.types.void(buf, at), codegen


_BATCH = 64  # pairs whose buffer reads are issued together (memory-level parallelism)


@numba.njit(
    numba.types.UniTuple(numba.int64, 2)(
        _KEYS,
        _SLOTS,
        numba.bool_,  # columns by position in slots (else slot - base)
        numba.int64,  # base
        numba.int64[::1],  # slot_start
        numba.int64[::1],  # slot_stop
        _U64[::1],  # key_lo
        _U64[::1],  # key_hi
        numba.bool_[::1],  # fuse
        numba.bool_[::1],  # corrected
        numba.int64[:, ::1],  # corr_at (row x: added start, stop, removed start, stop)
        _U64[::1],  # corr: every corrected row's sorted added and removed keys
        _U64[:, ::1],  # par (row x parameter)
        numba.uint8[::1],  # buf
        numba.bool_[:, ::1],  # out (key x column)
        numba.int64[:, ::1],  # handed back: (row, column)
        numba.bool_,  # prefetch: request a pair's cache lines once its positions are known
    ),
    cache=True,
)
def probe_pass(
    keys, slots, by_position, base, slot_start, slot_stop, key_lo, key_hi, fuse, corrected,
    corr_at, corr, par, buf, out, special, prefetch,
):  # fmt: skip
    """Every (key, row) pair of the asked slots' rows whose shard range holds the key,
    tested in one loop: keys sorted once, each row's range found by bisection. A fuse row
    with a delta on top answers from its exact corrections first (added: held, removed:
    not), from the filter otherwise. Rows of other kinds are handed back in `special`
    (row, column) instead. Plain fuse rows' pairs
    go in batches: their slot positions first, then all their buffer reads (independent
    loads the processor overlaps: the buffer is far larger than the caches). Returns
    (pairs tested, rows handed back)."""
    n = len(keys)
    order = np.argsort(keys)
    ks = keys[order]
    n_slots = len(slot_start)
    pairs = 0
    handed = 0
    at = np.empty((_BATCH, 4), dtype=np.uint64)
    one = np.empty((1, 4), dtype=np.uint64)
    fingerprint = np.empty(_BATCH, dtype=np.uint64)
    alphabet = np.empty(_BATCH, dtype=np.uint64)
    key_of = np.empty(_BATCH, dtype=np.int64)
    column_of = np.empty(_BATCH, dtype=np.int64)
    queued = 0
    for j in range(len(slots)):
        s = slots[j]
        if s < 0 or s >= n_slots:
            continue
        column = j if by_position else s - base
        for r in range(slot_start[s], slot_stop[s]):
            lo, hi = key_lo[r], key_hi[r]
            if n == 1:
                if ks[0] < lo or ks[0] > hi:
                    continue
                a, b = 0, 1
            else:
                a, top = 0, n  # first key >= lo
                while a < top:
                    mid = (a + top) >> 1
                    if ks[mid] < lo:
                        a = mid + 1
                    else:
                        top = mid
                b, top = a, n  # first key > hi
                while b < top:
                    mid = (b + top) >> 1
                    if ks[mid] <= hi:
                        b = mid + 1
                    else:
                        top = mid
                if a >= b:
                    continue
            if not fuse[r]:
                if handed == len(special):  # only if a slot was asked twice
                    raise ValueError("fleet probe: a slot asked twice in one pass")
                special[handed, 0] = r
                special[handed, 1] = column
                handed += 1
                continue
            pairs += b - a
            p = par[r]
            if corrected[r]:
                for q in range(a, b):
                    x = ks[q]
                    if _listed(corr, corr_at[r, 0], corr_at[r, 1], x):
                        hit = True
                    elif _listed(corr, corr_at[r, 2], corr_at[r, 3], x):
                        hit = False
                    else:
                        hit = _member(buf, one, 0, _slots_of(x, p, one, 0), p[P_M])
                    if hit:
                        out[order[q], column] = True
                continue
            for q in range(a, b):
                fingerprint[queued] = _slots_of(ks[q], p, at, queued)
                if prefetch:
                    for w in range(4):
                        _prefetch(buf, at[queued, w])
                alphabet[queued] = p[P_M]
                key_of[queued] = order[q]
                column_of[queued] = column
                queued += 1
                if queued == _BATCH:
                    for i in range(queued):
                        if _member(buf, at, i, fingerprint[i], alphabet[i]):
                            out[key_of[i], column_of[i]] = True
                    queued = 0
    for i in range(queued):
        if _member(buf, at, i, fingerprint[i], alphabet[i]):
            out[key_of[i], column_of[i]] = True
    return pairs, handed

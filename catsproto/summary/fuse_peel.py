"""The fuse filter's compiled construction step (`fuse.FuseSummary._solve`): peel the
key hypergraph and assign the slot values in one call.

Strategy. The reference (`fuse.peel_rounds` and the assignment loop of
`fuse.solve_reference`) peels in rounds of numpy calls; for the few thousand keys of
one shard a round costs far more in call overhead than in work, and a build makes some
twenty rounds. This kernel runs the *same* rounds one key at a time, so that every key
is freed through the same slot as in the reference, and therefore gets the same value:

* a round's queue is, as there, the slots of degree one in slot order (first round) or
  in the order the previous round's keys touched them (slot j of every key, then slot
  j + 1, keys in round order), repeats included;
* a key named by several queued slots is kept once, at its *last* position in the
  queue (what the reference's `stamp[found] = order` leaves, numpy writing repeated
  indices in order), and is freed through that slot;
* degrees and owners are lowered for the whole round before the next queue is read.

The values are then assigned in reverse peeling order. Inside a round the order does not
matter: a key's free slot holds it alone when the round starts, so no other key of the
round touches it. `tests/test_summary_fuse_peel.py` checks the tables equal the
reference's on random sets of every size class. Types are fixed by the signature
(compiled once, cached beside the module, like the selector's probe pass); the module
is imported on the first fuse build, so importing `catsproto.summary` does not load the
compiler. Pure: no clocks, no IO of its own (the compiler's cache aside).
"""

from __future__ import annotations

import numba
import numpy as np

_I64 = numba.int64


@numba.njit(numba.bool_(_I64[:, ::1], _I64[::1], _I64, _I64[::1]), cache=True)
def peel_and_assign(slots: np.ndarray, fingerprints: np.ndarray, m: int, table: np.ndarray) -> bool:
    """Fill `table` (zeros, one entry per slot) so that every key's slot values sum to
    its fingerprint modulo m; False, with `table` unspecified, if peeling stalls.

    slots: (arity, n) slot of every key in each segment; fingerprints: n values < m.
    """
    arity, n = slots.shape
    size = table.size
    deg = np.zeros(size, dtype=np.int64)
    owner = np.zeros(size, dtype=np.int64)  # sum of the keys in the slot: the key at degree 1
    for j in range(arity):
        for i in range(n):
            s = slots[j, i]
            deg[s] += 1
            owner[s] += i
    stamp = np.full(n, -1, dtype=np.int64)
    peeled_keys = np.empty(n, dtype=np.int64)  # in peeling order
    peeled_free = np.empty(n, dtype=np.int64)  # the slot each was freed through
    room = max(size, arity * n)
    queue = np.empty(room, dtype=np.int64)
    follow = np.empty(room, dtype=np.int64)
    length = 0
    for s in range(size):
        if deg[s] == 1:
            queue[length] = s
            length += 1
    peeled = 0
    while length:
        for i in range(length):
            stamp[owner[queue[i]]] = i
        first = peeled
        for i in range(length):
            key = owner[queue[i]]
            if stamp[key] == i:
                peeled_keys[peeled] = key
                peeled_free[peeled] = queue[i]
                peeled += 1
        for j in range(arity):
            for p in range(first, peeled):
                key = peeled_keys[p]
                s = slots[j, key]
                deg[s] -= 1
                owner[s] -= key
        length = 0
        for j in range(arity):
            for p in range(first, peeled):
                s = slots[j, peeled_keys[p]]
                if deg[s] == 1:
                    follow[length] = s
                    length += 1
        queue, follow = follow, queue
    if peeled != n:
        return False
    for p in range(n - 1, -1, -1):
        key = peeled_keys[p]
        total = 0
        for j in range(arity):
            total += table[slots[j, key]]
        value = (fingerprints[key] - total) % m
        if value < 0:  # whichever sign convention the remainder has: 0 <= value < m
            value += m
        table[peeled_free[p]] = value
    return True

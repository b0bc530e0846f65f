"""Kind 3, binary fuse filter over Z_m with packed fingerprints — the near-optimal static filter.

Strategy. A binary fuse filter (Graf & Lemire, "Binary Fuse Filters: Fast and Smaller
Than Xor Filters", JEA 2022) stores one small value per slot in a table of
``segments * L`` slots; key x maps to ``arity`` slots, one in each of ``arity``
consecutive segments of length L, and is a member iff its slot values combine to its
fingerprint. Classic filters combine with XOR over b-bit fingerprints, so the false
positive rate is 2^-b and only whole bits are possible (7 bits: 0.78 %, 8 bits: 0.39 %).
We combine by **addition modulo m** instead, for any alphabet size m: construction and
queries are the same peeling and the same gathers, and the rate is exactly 1/m. Slot
values are then packed g to a group as the base-m number sum(d_j * m^j) in b bits
(m^g <= 2^b), so a slot costs b/g bits: at a 1 % target we use m = 107, g = 4, b = 27,
i.e. 6.75 bits per slot at 0.935 % — instead of 7 bits at 0.78 % or 8 at 0.39 %. With
4-wise fuse (about 1.075 slots per key for large n) that is ~7.3 bits/key against the
6.64-bit bound; a Bloom filter needs 9.6.

The alphabet is sized for 95 % of the target rate (``DESIGN_MARGIN``) so that a
measurement over a million non-members (sigma ~0.01 % at 1 %) does not straddle the target.

Construction peels the 4-uniform hypergraph in *rounds*: every slot of degree one frees
its single key (found as the sum of the indices of the keys left in that slot); all keys freed in a
round are independent, so a round is a handful of numpy calls, and values are assigned
round by round in reverse. If peeling stalls, the next seed is tried, and after three
(eight for small sets) failures at one size the table grows by a segment (or 0.5 %);
the seed and geometry that worked go into the params.

params (20 bytes, big-endian)::

    arity u8 (3|4) | seg_log2 u8 (L = 2^seg_log2 <= 2^16) | segments u32 (>= arity)
    | m u32 (>= 2) | g u8 (1..8) | b u8 (1..64, m^g <= 2^b) | seed u64

body: ceil(segments*L / g) groups of b bits, most significant bit first, then zero bits
to the byte boundary. Group i holds slots g*i .. g*i+g-1 as sum(d_j * m^j); a group value
>= m^g, a nonzero digit past the last slot, or a nonzero padding bit is refused.

Hashes: h = mix(x, seed, 0), h' = mix(x, seed, 1). Start segment s = ((h >> 32) *
(segments - arity + 1)) >> 32; slot j = (s + j) * L + ((h' >> 16 j) mod L); fingerprint
f = ((h mod 2^32) * m) >> 32. Member iff (sum_j T[slot j]) mod m == f.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from catsproto.kernels import Kernel
from catsproto.summary.base import (
    KIND_FUSE,
    U64_MAX,
    Summary,
    SummaryDecodeError,
    from_bits,
    low_bits,
    register_kind,
)
from catsproto.summary.hashing import GOLDEN, mix64_int, seeded

DESIGN_MARGIN = 0.95
MAX_GROUP = 8
MAX_ALPHABET = (1 << 32) - 1  # m is a u32 on the wire
MAX_SEG_LOG2 = 16
PARAMS_LEN = 20
_ATTEMPTS_PER_SIZE = 3  # seeds tried at one table size before growing it ...
_ATTEMPTS_PER_SIZE_SMALL = 8  # ... or this many below _SMALL keys, where a try is cheap
_SMALL = 50_000
_MAX_ATTEMPTS = 200


def int_root_floor(value: int, g: int) -> int:
    """Largest m with m^g <= value."""
    m = round(value ** (1.0 / g))
    while m**g > value:
        m -= 1
    while (m + 1) ** g <= value:
        m += 1
    return m


def choose_packing(target_fpr: float) -> tuple[int, int, int] | None:
    """(m, g, b) with fewest bits per slot b/g such that 1/m <= DESIGN_MARGIN * target.

    Ties go to the smaller group. None if the target needs an alphabet above 2^32-1 (m is a u32).
    """
    need = math.ceil(1.0 / (DESIGN_MARGIN * target_fpr))
    need = max(2, need)
    if need > MAX_ALPHABET:
        return None
    best: tuple[float, int, int, int] | None = None
    for g in range(1, MAX_GROUP + 1):
        b = max(1, math.ceil(g * math.log2(need)) - 1)
        while need**g > 1 << b:
            b += 1
        if b > 64:
            continue
        m = min(int_root_floor(1 << b, g), MAX_ALPHABET)
        cost = b / g
        if best is None or cost < best[0] - 1e-12:
            best = (cost, m, g, b)
    assert best is not None
    return best[1], best[2], best[3]


def fuse_geometry(n: int, arity: int) -> tuple[int, int]:
    """(seg_log2, first segment count to try) for n keys.

    Segment length L = 2^floor(ln n / ln 2.91) for arity 4 (half a doubling above Graf &
    Lemire's choice, which peeled more reliably in our measurements) and their
    2^floor(ln n / ln 3.33 + 2.25) for arity 3. The first table size is fitted to where
    peeling succeeds about half the time or more — 1 + 13.5 / ln(n)^2 slots per key for
    arity 4 (1.16 at 10k keys, 1.10 at 100k, 1.07 at 1M), below the paper's conservative
    sizing; `FuseSummary.from_keys` retries seeds and grows the table on failure.
    """
    n = max(n, 2)
    if arity == 4:
        seg_log2 = math.floor(math.log(n) / math.log(2.91))
        factor = max(1.06, 1.0 + 13.5 / math.log(n) ** 2)
    elif arity == 3:
        seg_log2 = math.floor(math.log(n) / math.log(3.33) + 2.25)
        factor = max(1.125, 0.875 + 0.25 * math.log(1_000_000) / math.log(n))
    else:
        raise ValueError(f"arity must be 3 or 4, got {arity}")
    seg_log2 = max(0, min(MAX_SEG_LOG2, seg_log2))
    segments = max(arity, math.ceil(n * factor / (1 << seg_log2)))
    return seg_log2, segments


def _hashes(keys: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return seeded(keys, seed, 0), seeded(keys, seed, 1)


def _slots(h: np.ndarray, h2: np.ndarray, arity: int, seg_log2: int, segments: int) -> np.ndarray:
    starts = np.uint64(segments - arity + 1)
    base = (((h >> np.uint64(32)) * starts) >> np.uint64(32)) << np.uint64(seg_log2)
    mask = np.uint64((1 << seg_log2) - 1)
    out = np.empty((arity, h.size), dtype=np.intp)
    for j in range(arity):
        out[j] = base + np.uint64(j << seg_log2) + ((h2 >> np.uint64(16 * j)) & mask)
    return out


def _fingerprints(h: np.ndarray, m: int) -> np.ndarray:
    return ((h & np.uint64(0xFFFFFFFF)) * np.uint64(m)) >> np.uint64(32)


def peel_rounds(
    slots: np.ndarray, size: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """Peel in rounds; return [(keys, their free slots, their slot matrix)] per round.

    None if peeling stalls (a 2-core remains). A slot of degree one names its only key
    as the sum of the indices of the keys in it; keys found twice in a round are kept once.
    """
    arity, n = slots.shape
    flat = slots.reshape(-1)
    deg = np.bincount(flat, minlength=size)
    index = np.tile(np.arange(n, dtype=np.float64), arity)
    owner = np.bincount(flat, weights=index, minlength=size).astype(np.intp)
    stamp = np.full(n, -1, dtype=np.intp)
    queue = np.flatnonzero(deg == 1)
    rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    peeled = 0
    while queue.size:
        found = owner[queue]
        order = np.arange(found.size)
        stamp[found] = order
        first = stamp[found] == order
        keys, free = found[first], queue[first]
        matrix = slots[:, keys]
        rounds.append((keys, free, matrix))
        peeled += keys.size
        touched = matrix.reshape(-1)
        np.subtract.at(deg, touched, 1)
        np.subtract.at(owner, touched, np.tile(keys, arity))
        queue = touched[deg[touched] == 1]
    return rounds if peeled == n else None


def _load_peel() -> ModuleType:
    from catsproto.summary import fuse_peel

    return fuse_peel


PEEL = Kernel(_load_peel)
"""The compiled peeling kernel, or None where it cannot be loaded: construction then
runs `solve_reference`, which gives the same table value for value."""


def solve_reference(
    keys: np.ndarray, seed: int, arity: int, seg_log2: int, segments: int, m: int
) -> np.ndarray | None:
    """`FuseSummary._solve` in numpy rounds (`peel_rounds`): the definition the compiled
    kernel must match value for value (tests and benchmarks/build.py compare them)."""
    size = segments << seg_log2
    if keys.size == 0:
        return np.zeros(size, dtype=np.uint32)
    h, h2 = _hashes(keys, seed)
    slots = _slots(h, h2, arity, seg_log2, segments)
    rounds = peel_rounds(slots, size)
    if rounds is None:
        return None
    fp = _fingerprints(h, m).astype(np.int64)
    table = np.zeros(size, dtype=np.int64)
    for peeled, free, matrix in reversed(rounds):
        total = table[matrix].sum(axis=0)
        table[free] = (fp[peeled] - total) % m
    return table.astype(np.uint32)


@register_kind
class FuseSummary(Summary):
    """A binary fuse filter with modular fingerprints (see module docstring)."""

    kind = KIND_FUSE

    def __init__(
        self,
        table: np.ndarray,
        *,
        arity: int,
        seg_log2: int,
        segments: int,
        m: int,
        g: int,
        b: int,
        seed: int,
    ) -> None:
        if arity not in (3, 4):
            raise ValueError(f"arity must be 3 or 4, got {arity}")
        if not 0 <= seg_log2 <= MAX_SEG_LOG2:
            raise ValueError(f"seg_log2 {seg_log2} outside 0..{MAX_SEG_LOG2}")
        if not arity <= segments < 1 << 32:
            raise ValueError(f"segments {segments} outside {arity}..2^32-1")
        if not 2 <= m <= MAX_ALPHABET or not 1 <= g <= MAX_GROUP or not 1 <= b <= 64:
            raise ValueError(f"bad packing m={m} g={g} b={b}")
        if m**g > 1 << b:
            raise ValueError(f"{g} digits base {m} do not fit {b} bits")
        if not 0 <= seed <= U64_MAX:
            raise ValueError(f"seed {seed} is not a u64")
        if table.shape != (segments << seg_log2,):
            raise ValueError("table size does not match the geometry")
        # Slot values are < m: the narrowest type that holds them (a byte at 1 % FPR).
        dtype = np.uint8 if m <= 1 << 8 else np.uint16 if m <= 1 << 16 else np.uint32
        self._table = np.ascontiguousarray(table, dtype=dtype)
        self._table.flags.writeable = False
        self.arity, self.seg_log2, self.segments = arity, seg_log2, segments
        self.m, self.g, self.b, self.seed = m, g, b, seed
        self._body: bytes | None = None

    @property
    def slots(self) -> int:
        return self.segments << self.seg_log2

    def table_values(self) -> np.ndarray:
        """The slot values (read-only), one per slot, in the narrowest unsigned type."""
        return self._table

    # -- build -----------------------------------------------------------------------
    @classmethod
    def from_keys(
        cls, keys: np.ndarray, target_fpr: float, seed: int, arity: int = 4
    ) -> FuseSummary:
        packing = choose_packing(target_fpr) if target_fpr > 0 else None
        if packing is None:
            raise ValueError(f"a fuse filter cannot meet a false-positive rate of {target_fpr}")
        m, g, b = packing
        seg_log2, segments = fuse_geometry(int(keys.size), arity)
        per_size = _ATTEMPTS_PER_SIZE_SMALL if keys.size < _SMALL else _ATTEMPTS_PER_SIZE
        try_seed = seed
        for attempt in range(_MAX_ATTEMPTS):
            if attempt and attempt % per_size == 0:
                segments += max(1, segments // 200)
            table = cls._solve(keys, try_seed, arity, seg_log2, segments, m)
            if table is not None:
                return cls(
                    table,
                    arity=arity,
                    seg_log2=seg_log2,
                    segments=segments,
                    m=m,
                    g=g,
                    b=b,
                    seed=try_seed,
                )
            try_seed = mix64_int(seed + (attempt + 1) * GOLDEN)
        raise RuntimeError(f"fuse construction failed {_MAX_ATTEMPTS} times")  # pragma: no cover

    @staticmethod
    def _solve(
        keys: np.ndarray, seed: int, arity: int, seg_log2: int, segments: int, m: int
    ) -> np.ndarray | None:
        """The slot values for these keys, or None if this seed's hypergraph does not peel:
        `solve_reference`'s table, computed by the compiled `fuse_peel` kernel (by
        `solve_reference` itself where that cannot be loaded, and for no keys)."""
        fuse_peel = PEEL.get()  # the compiler loads with the first build
        if fuse_peel is None or keys.size == 0:
            return solve_reference(keys, seed, arity, seg_log2, segments, m)
        h, h2 = _hashes(keys, seed)
        slots = _slots(h, h2, arity, seg_log2, segments).astype(np.int64, copy=False)
        fp = _fingerprints(h, m).astype(np.int64)
        table = np.zeros(segments << seg_log2, dtype=np.int64)
        if not fuse_peel.peel_and_assign(slots, fp, m, table):
            return None
        return table.astype(np.uint32)

    @classmethod
    def estimate_size(cls, keys: np.ndarray, target_fpr: float) -> int | None:
        packing = choose_packing(target_fpr) if target_fpr > 0 else None
        if packing is None:
            return None
        _, g, b = packing
        seg_log2, segments = fuse_geometry(int(keys.size), 4)
        groups = -(-(segments << seg_log2) // g)
        return PARAMS_LEN + (groups * b + 7) // 8

    # -- wire ------------------------------------------------------------------------
    def size(self) -> int:
        """params + body bytes, from the geometry (no encoding needed)."""
        return PARAMS_LEN + (-(-self.slots // self.g) * self.b + 7) // 8

    def params(self) -> bytes:
        return (
            bytes([self.arity, self.seg_log2])
            + self.segments.to_bytes(4, "big")
            + self.m.to_bytes(4, "big")
            + bytes([self.g, self.b])
            + self.seed.to_bytes(8, "big")
        )

    def encode(self) -> bytes:
        if self._body is None:
            g, b, m = self.g, self.b, self.m
            groups = -(-self.slots // g)
            digits = np.zeros(groups * g, dtype=np.uint64)
            digits[: self.slots] = self._table
            digits = digits.reshape(groups, g)
            value = np.zeros(groups, dtype=np.uint64)
            for j in reversed(range(g)):
                value = value * np.uint64(m) + digits[:, j]
            self._body = np.packbits(low_bits(value, b).reshape(-1)).tobytes()
        return self._body

    @classmethod
    def decode_body(cls, params: bytes, body: bytes) -> FuseSummary:
        if len(params) != PARAMS_LEN:
            raise SummaryDecodeError(f"fuse params need {PARAMS_LEN} bytes, got {len(params)}", 0)
        arity, seg_log2 = params[0], params[1]
        segments = int.from_bytes(params[2:6], "big")
        m = int.from_bytes(params[6:10], "big")
        g, b = params[10], params[11]
        seed = int.from_bytes(params[12:20], "big")
        if arity not in (3, 4):
            raise SummaryDecodeError(f"fuse arity {arity} is not 3 or 4", 0)
        if seg_log2 > MAX_SEG_LOG2:
            raise SummaryDecodeError(f"fuse seg_log2 {seg_log2} above {MAX_SEG_LOG2}", 1)
        if segments < arity:
            raise SummaryDecodeError(f"fuse segments {segments} below arity {arity}", 2)
        if not 2 <= m <= MAX_ALPHABET:
            raise SummaryDecodeError(f"fuse alphabet {m} outside 2..2^32-1", 6)
        if not 1 <= g <= MAX_GROUP:
            raise SummaryDecodeError(f"fuse group {g} outside 1..{MAX_GROUP}", 10)
        if not 1 <= b <= 64:
            raise SummaryDecodeError(f"fuse group bits {b} outside 1..64", 11)
        if m**g > 1 << b:
            raise SummaryDecodeError(f"{g} digits base {m} do not fit {b} bits", 11)
        slots = segments << seg_log2
        groups = -(-slots // g)
        need = (groups * b + 7) // 8
        if len(body) != need:
            raise SummaryDecodeError(
                f"fuse body of {slots} slots needs {need} bytes, got {len(body)}", 0
            )
        bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8))
        if bits[groups * b :].any():
            raise SummaryDecodeError("nonzero padding bits in fuse body", len(body) - 1)
        value = from_bits(bits[: groups * b].reshape(groups, b))
        digits = np.empty((groups, g), dtype=np.uint64)
        mm = np.uint64(m)
        for j in range(g):
            value, digits[:, j] = np.divmod(value, mm)
        bad = np.flatnonzero(value)
        if bad.size:
            raise SummaryDecodeError(
                f"fuse group {int(bad[0])} holds a value of {g} digits >= {m}^{g}",
                int(bad[0]) * b // 8,
            )
        flat = digits.reshape(-1)
        if flat[slots:].any():
            raise SummaryDecodeError("nonzero digit past the last fuse slot", len(body) - 1)
        out = cls(
            flat[:slots].astype(np.uint32),
            arity=arity,
            seg_log2=seg_log2,
            segments=segments,
            m=m,
            g=g,
            b=b,
            seed=seed,
        )
        out._body = body
        return out

    # -- membership ------------------------------------------------------------------
    @property
    def fpr(self) -> float:
        return 1.0 / self.m

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        h, h2 = _hashes(keys, self.seed)
        slots = _slots(h, h2, self.arity, self.seg_log2, self.segments)
        table = self._table
        acc = table[slots[0]].astype(np.uint64)
        for j in range(1, self.arity):
            acc += table[slots[j]]
        acc %= np.uint64(self.m)
        return acc == _fingerprints(h, self.m)

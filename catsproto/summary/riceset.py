"""Golomb–Rice coding of a sorted set of distinct u64 keys (used by exact sets and deltas).

Layout (all big-endian, bits MSB first)::

    count   u32        number of keys n
    low     n*k bits   remainders r_i = d_i mod 2^k, fixed width
    high    unary      quotients q_i = d_i >> k, each as q_i zero bits then a one bit
    pad     0..7 bits  zero, up to the byte boundary

with gaps d_0 = x_0 and d_i = x_i - x_{i-1} - 1 (keys are distinct, so no gap is
negative and a set has exactly one encoding: sortedness and uniqueness are built into
the code, not checked after the fact). The Rice parameter is not transmitted; it is

    k = bit_length(floor(2^64 * 709 / (1024 * n))) - 1     (k = 0 when n = 0)

i.e. floor(log2(ln 2 * 2^64 / n)), optimal for uniformly spread keys; each key costs about
k + 1.5 bits ~ log2(2^64 / n) + 1. Splitting the fixed-width remainders from the unary
quotients (as Elias–Fano does) lets numpy decode without a bit-serial loop: the one-bits
of the high stream are found with one `flatnonzero`. The code is self-delimiting, so a
delta body can hold two sets back to back.
"""

from __future__ import annotations

import numpy as np

from catsproto.summary.base import SummaryDecodeError, from_bits, low_bits


def rice_parameter(n: int) -> int:
    if n <= 0:
        return 0
    return max(0, ((1 << 64) * 709 // (1024 * n)).bit_length() - 1)


def rice_set_bits(keys: np.ndarray) -> int:
    """Bits of the low+high streams for sorted distinct keys (header and padding excluded)."""
    n = int(keys.size)
    if n == 0:
        return 0
    k = rice_parameter(n)
    d = _gaps(keys)
    return n * (k + 1) + int((d >> np.uint64(k)).sum(dtype=np.uint64))


def rice_set_size(keys: np.ndarray) -> int:
    """Encoded bytes of a set, header included."""
    return 4 + (rice_set_bits(keys) + 7) // 8


def _gaps(keys: np.ndarray) -> np.ndarray:
    d = np.empty_like(keys)
    d[:1] = keys[:1]
    np.subtract(keys[1:], keys[:-1], out=d[1:])
    d[1:] -= np.uint64(1)
    return d


def encode_rice_set(keys: np.ndarray) -> bytes:
    """Encode sorted, distinct uint64 keys."""
    n = int(keys.size)
    if n >= 1 << 32:
        raise ValueError(f"{n} keys exceed the u32 count")
    if n > 1 and not (keys[1:] > keys[:-1]).all():
        raise ValueError("keys must be sorted and distinct")
    header = n.to_bytes(4, "big")
    if n == 0:
        return header
    k = rice_parameter(n)
    d = _gaps(keys)
    q = (d >> np.uint64(k)).astype(np.int64)
    high_len = int(q.sum()) + n
    bits = np.zeros(n * k + high_len, dtype=np.uint8)
    if k:
        bits[: n * k] = low_bits(d, k).reshape(-1)
    ones = (q + 1).cumsum()
    ones += n * k - 1
    bits[ones] = 1
    return header + np.packbits(bits).tobytes()


def decode_rice_set(data: bytes, offset: int = 0) -> tuple[np.ndarray, int]:
    """Decode one set starting at ``offset``; return (keys, offset just past it).

    Raises SummaryDecodeError (offsets relative to ``data``) on truncation, overflow
    past 2^64-1 or nonzero padding.
    """
    if len(data) - offset < 4:
        raise SummaryDecodeError(
            f"key set count needs 4 bytes, {len(data) - offset} remain", offset
        )
    n = int.from_bytes(data[offset : offset + 4], "big")
    start = offset + 4
    if n == 0:
        return np.zeros(0, dtype=np.uint64), start
    k = rice_parameter(n)
    remaining_bits = (len(data) - start) * 8
    if n * (k + 1) > remaining_bits:
        raise SummaryDecodeError(
            f"key set of {n} keys needs at least {n * (k + 1)} bits, {remaining_bits} remain",
            offset,
        )
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=start))
    high = bits[n * k :]
    ones = np.flatnonzero(high)
    if ones.size < n:
        raise SummaryDecodeError(
            f"key set announces {n} keys, its unary stream ends after {ones.size}", offset
        )
    end_bit = n * k + int(ones[n - 1]) + 1
    end = start + (end_bit + 7) // 8
    pad_end = (end - start) * 8
    if ones.size > n and n * k + int(ones[n]) < pad_end:
        raise SummaryDecodeError("nonzero padding bits after key set", end - 1)
    # quotients: the zero bits between one-bits (array methods, not np.diff/np.all:
    # their dispatch dominates for sets of a few dozen keys)
    q = np.empty(n, dtype=np.int64)
    q[0] = ones[0]
    np.subtract(ones[1:n], ones[: n - 1], out=q[1:])
    q[1:] -= 1
    if k and int(q.max()) >= 1 << (64 - k):
        raise SummaryDecodeError("key set gap exceeds 64 bits", offset)
    d = q.astype(np.uint64) << np.uint64(k)
    if k:
        d |= from_bits(bits[: n * k].reshape(n, k))
    d[1:] += np.uint64(1)
    keys = d.cumsum(dtype=np.uint64)
    if n > 1 and not (keys[1:] > keys[:-1]).all():
        raise SummaryDecodeError("key set runs past 2^64-1", offset)
    return keys, end

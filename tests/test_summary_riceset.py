"""The vectorised Rice coder and bit-field packing against a bit-by-bit reference.

The reference below is written from the layout in `catsproto.summary.riceset` alone
(a string of '0'/'1' characters, one Python int per key), so it shares no code with the
numpy coder: same bytes for every set, and on any input the same keys and end offset,
or a `SummaryDecodeError` with the same offset and message.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.summary import SummaryDecodeError
from catsproto.summary.base import from_bits, low_bits
from catsproto.summary.fuse import FuseSummary
from catsproto.summary.riceset import (
    decode_rice_set,
    encode_rice_set,
    rice_parameter,
    rice_set_size,
)

U64 = 2**64 - 1


def reference_encode(keys: list[int]) -> bytes:
    n = len(keys)
    out = n.to_bytes(4, "big")
    if n == 0:
        return out
    k = rice_parameter(n)
    gaps = [keys[0]] + [b - a - 1 for a, b in itertools.pairwise(keys)]
    low = "".join(format(d & ((1 << k) - 1), f"0{k}b") if k else "" for d in gaps)
    high = "".join("0" * (d >> k) + "1" for d in gaps)
    bits = low + high
    bits += "0" * (-len(bits) % 8)
    return out + int(bits, 2).to_bytes(len(bits) // 8, "big")


def reference_decode(data: bytes, offset: int = 0) -> tuple[list[int], int]:
    if len(data) - offset < 4:
        raise SummaryDecodeError(
            f"key set count needs 4 bytes, {len(data) - offset} remain", offset
        )
    n = int.from_bytes(data[offset : offset + 4], "big")
    start = offset + 4
    if n == 0:
        return [], start
    k = rice_parameter(n)
    bits = "".join(format(b, "08b") for b in data[start:])
    if n * (k + 1) > len(bits):
        raise SummaryDecodeError(
            f"key set of {n} keys needs at least {n * (k + 1)} bits, {len(bits)} remain",
            offset,
        )
    quotients, pos = [], n * k
    for found in range(n):
        one = bits.find("1", pos)
        if one < 0:
            raise SummaryDecodeError(
                f"key set announces {n} keys, its unary stream ends after {found}", offset
            )
        quotients.append(one - pos)
        pos = one + 1
    end = start + (pos + 7) // 8
    if "1" in bits[pos : (end - start) * 8]:
        raise SummaryDecodeError("nonzero padding bits after key set", end - 1)
    if k and max(quotients) >= 1 << (64 - k):
        raise SummaryDecodeError("key set gap exceeds 64 bits", offset)
    keys, x = [], -1
    for i, q in enumerate(quotients):
        r = int(bits[i * k : (i + 1) * k], 2) if k else 0
        x += 1 + ((q << k) | r)
        if x > U64:
            raise SummaryDecodeError("key set runs past 2^64-1", offset)
        keys.append(x)
    return keys, end


def outcome(decode, data: bytes, offset: int = 0) -> tuple:  # type: ignore[no-untyped-def]
    """What a decoder makes of the bytes: its keys and end, or its error's offset and text."""
    try:
        keys, end = decode(data, offset)
    except SummaryDecodeError as exc:
        return ("error", exc.offset, str(exc))
    return ("ok", [int(k) for k in keys], end)


def as_array(keys: list[int]) -> np.ndarray:
    return np.array(sorted(set(keys)), dtype=np.uint64)


EDGE_SETS = [
    [],
    [0],
    [U64],
    [0, U64],
    [U64 - 1, U64],
    [0, 1, 2, 3],
    list(range(0, 2**64, 2**60)),
    [2**63],
    [5, 2**63, U64],
]
key_lists = st.lists(st.integers(0, U64), max_size=400).map(lambda ks: sorted(set(ks)))


@pytest.mark.parametrize("keys", EDGE_SETS, ids=str)
def test_edge_sets_encode_like_the_reference_and_round_trip(keys: list[int]) -> None:
    arr = as_array(keys)
    data = encode_rice_set(arr)
    assert data == reference_encode(keys)
    assert len(data) == rice_set_size(arr)
    assert outcome(decode_rice_set, data) == ("ok", keys, len(data))


@settings(max_examples=150, deadline=None)
@given(keys=key_lists)
def test_random_sets_encode_like_the_reference(keys: list[int]) -> None:
    data = encode_rice_set(as_array(keys))
    assert data == reference_encode(keys)
    assert len(data) == rice_set_size(as_array(keys))
    assert outcome(decode_rice_set, data) == outcome(reference_decode, data)


def test_dense_and_clustered_sets() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 31, 32, 33, 1000, 5000):
        for keys in (
            np.unique(rng.integers(0, 2**64, n, dtype=np.uint64)),
            np.arange(n, dtype=np.uint64) * np.uint64(3) + np.uint64(2**40),
            np.unique(rng.integers(0, 2**20, n, dtype=np.uint64)),
        ):
            data = encode_rice_set(keys)
            assert data == reference_encode([int(k) for k in keys])
            got, end = decode_rice_set(data)
            assert np.array_equal(got, keys) and end == len(data)


@settings(max_examples=150, deadline=None)
@given(keys=key_lists, data=st.data())
def test_truncated_and_garbled_input_fail_alike(keys: list[int], data: st.DataObject) -> None:
    good = encode_rice_set(as_array(keys)) + bytes([0xFF]) * data.draw(st.integers(0, 2))
    cut = data.draw(st.integers(0, len(good)))
    assert outcome(decode_rice_set, good[:cut]) == outcome(reference_decode, good[:cut])
    flips = data.draw(st.lists(st.integers(0, len(good) * 8 - 1), min_size=1, max_size=4))
    garbled = bytearray(good)
    for bit in flips:
        garbled[bit // 8] ^= 0x80 >> (bit % 8)
    assert outcome(decode_rice_set, bytes(garbled)) == outcome(reference_decode, bytes(garbled))
    offset = data.draw(st.integers(0, 3))
    framed = bytes(offset) + bytes(garbled)
    assert outcome(decode_rice_set, framed, offset) == outcome(reference_decode, framed, offset)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_random_bytes_decode_like_the_reference(raw: bytes) -> None:
    assert outcome(decode_rice_set, raw) == outcome(reference_decode, raw)
    # small counts make the key and padding checks reachable from random bytes
    small = bytes(3) + bytes([raw[0] % 8 if raw else 1]) + raw[1:]
    assert outcome(decode_rice_set, small) == outcome(reference_decode, small)


def test_overflow_and_gap_errors_keep_their_offset() -> None:
    # two keys with k = 62: a first key of 2^64-1 then any gap runs past 2^64-1
    k = rice_parameter(2)
    low = format((1 << k) - 1, f"0{k}b") + "0" * k
    bits = low + "0001" + "1"  # quotients 3 and 0
    bits += "0" * (-len(bits) % 8)
    body = (2).to_bytes(4, "big") + int(bits, 2).to_bytes(len(bits) // 8, "big")
    for at in (0, 5):
        data = bytes(at) + body
        got = outcome(decode_rice_set, data, at)
        assert got == outcome(reference_decode, data, at)
        assert got[0] == "error" and got[1] == at and "2^64-1" in got[2]
    wide = (1).to_bytes(4, "big") + bytes([0]) * 9 + b"\x01"  # k = 63, quotient >= 2
    assert outcome(decode_rice_set, wide) == outcome(reference_decode, wide)
    assert outcome(decode_rice_set, wide)[0] == "error"


def test_encoder_refuses_unsorted_or_repeated_keys() -> None:
    for bad in ([2, 1], [1, 1]):
        with pytest.raises(ValueError, match="sorted and distinct"):
            encode_rice_set(np.array(bad, dtype=np.uint64))


@pytest.mark.parametrize("width", [1, 2, 7, 8, 27, 31, 32, 33, 63, 64])
def test_bit_fields_match_python_ints(width: int) -> None:
    rng = np.random.default_rng(width)
    values = rng.integers(0, 2**64, 200, dtype=np.uint64)
    values[:3] = [0, U64, 1 << 63]
    bits = low_bits(values, width)
    assert bits.shape == (200, width)
    want = ["".join(map(str, row)) for row in bits]
    assert want == [format(int(v) & ((1 << width) - 1), f"0{width}b") for v in values]
    back = from_bits(bits)
    assert back.dtype == np.uint64
    assert [int(v) for v in back] == [int(v) & ((1 << width) - 1) for v in values]


def reference_fuse_body(fuse: FuseSummary) -> bytes:
    values = [int(v) for v in fuse.table_values()]
    values += [0] * (-len(values) % fuse.g)
    bits = ""
    for i in range(0, len(values), fuse.g):
        group = sum(d * fuse.m**j for j, d in enumerate(values[i : i + fuse.g]))
        bits += format(group, f"0{fuse.b}b")
    bits += "0" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


@pytest.mark.parametrize("target", [0.01, 0.001, 0.3, 1e-6])
@pytest.mark.parametrize("n", [0, 1, 17, 900])
def test_fuse_body_packs_like_the_reference(target: float, n: int) -> None:
    keys = np.unique(np.random.default_rng(n).integers(0, 2**64, n, dtype=np.uint64))
    fuse = FuseSummary.from_keys(keys, target, seed=n)
    body = fuse.encode()
    assert body == reference_fuse_body(fuse)
    assert fuse.size() == len(fuse.params()) + len(body)
    again = FuseSummary.decode_body(fuse.params(), body)
    assert np.array_equal(again.table_values(), fuse.table_values())
    assert again.encode() == body

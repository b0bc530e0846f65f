"""Summary kinds: round trips, no false negatives, canonical bodies, error family."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import catsproto.wire as wire
from catsproto.summary import (
    KIND_BLOOM,
    KIND_DELTA,
    KIND_EXACT,
    KIND_FUSE,
    BloomSummary,
    DeltaSummary,
    ExactSummary,
    FuseSummary,
    Summary,
    SummaryDecodeError,
    register_kind,
    registered_kinds,
)
from catsproto.summary.fuse import choose_packing
from catsproto.summary.riceset import decode_rice_set, encode_rice_set

U64 = 2**64 - 1
keys_st = st.lists(st.integers(0, U64), max_size=300)
SNAPSHOT_KINDS = [KIND_EXACT, KIND_BLOOM, KIND_FUSE]


def rng_keys(n: int, seed: int) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**64, n, dtype=np.uint64))


def roundtrip(s: Summary) -> Summary:
    return Summary.decode(s.kind, s.params(), s.encode())


def test_error_is_in_the_codec_family() -> None:
    assert issubclass(SummaryDecodeError, wire.BadValueError)
    assert issubclass(SummaryDecodeError, wire.CodecError)
    err = SummaryDecodeError("x", 3)
    assert err.offset == 3


def test_registry_is_explicit_and_refuses_doubles() -> None:
    kinds = registered_kinds()
    assert kinds == {
        KIND_EXACT: ExactSummary,
        KIND_BLOOM: BloomSummary,
        KIND_FUSE: FuseSummary,
        KIND_DELTA: DeltaSummary,
    }
    assert kinds[KIND_FUSE].kind == wire.SummaryKind.FUSE
    with pytest.raises(ValueError, match="already registered"):
        register_kind(ExactSummary)


def test_unknown_kind_and_long_params_are_decode_errors() -> None:
    with pytest.raises(SummaryDecodeError):
        Summary.decode(9, b"", b"")
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_EXACT, bytes(256), b"\x00\x00\x00\x00")


@pytest.mark.parametrize("kind", SNAPSHOT_KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=keys_st, seed=st.integers(0, U64), probes=keys_st)
def test_no_false_negatives_and_roundtrip_answers_alike(
    kind: int, keys: list[int], seed: int, probes: list[int]
) -> None:
    s = Summary.build(keys, 0.01, kind=kind, seed=seed)
    arr = np.array(keys, dtype=np.uint64)
    assert s.contains_many(arr).all()
    assert all(k in s for k in keys[:5])
    d = roundtrip(s)
    assert d.kind == s.kind and d.params() == s.params() and d.encode() == s.encode()
    q = np.concatenate([arr, np.array(probes, dtype=np.uint64)])
    assert np.array_equal(d.contains_many(q), s.contains_many(q))


@settings(max_examples=60, deadline=None)
@given(keys=keys_st)
def test_exact_set_is_exact(keys: list[int]) -> None:
    s = ExactSummary(keys)
    assert [int(k) for k in s.keys] == sorted(set(keys))
    d = roundtrip(s)
    assert isinstance(d, ExactSummary)
    assert np.array_equal(d.keys, s.keys)
    others = np.array([k ^ 1 for k in keys if k ^ 1 not in set(keys)], dtype=np.uint64)
    assert not s.contains_many(others).any()


def test_exact_edges() -> None:
    for keys in ([], [0], [U64], [0, U64], [U64 - 1, U64], list(range(50))):
        s = ExactSummary(keys)
        assert np.array_equal(roundtrip(s).keys, np.array(sorted(keys), dtype=np.uint64))
    assert ExactSummary([]).encode() == b"\x00\x00\x00\x00"
    assert -1 not in ExactSummary([1]) and "1" not in ExactSummary([1])


def test_rice_sets_are_self_delimiting() -> None:
    a, b = rng_keys(40, 1), rng_keys(7, 2)
    data = encode_rice_set(a) + encode_rice_set(b)
    got_a, mid = decode_rice_set(data)
    got_b, end = decode_rice_set(data, mid)
    assert np.array_equal(got_a, a) and np.array_equal(got_b, b) and end == len(data)


def test_exact_rejects_trailing_truncated_padding_and_overflow() -> None:
    body = ExactSummary(rng_keys(20, 3)).encode()
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_EXACT, b"", body + b"\x00")
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_EXACT, b"x", body)
    for cut in range(len(body)):
        with pytest.raises(SummaryDecodeError):
            Summary.decode(KIND_EXACT, b"", body[:cut])
    # one key 2^64-1: k = 63, remainder = 63 one bits, quotient 1 = "01", 7 padding bits
    one = ExactSummary([U64]).encode()
    assert one == bytes.fromhex("00000001fffffffffffffffe80")
    with pytest.raises(SummaryDecodeError, match="padding"):
        Summary.decode(KIND_EXACT, b"", one[:-1] + b"\x81")


def test_exact_overflow_is_refused() -> None:
    # keys [2^63, 2^64-1] encode fine; bump the second gap's quotient to push past 2^64-1
    body = bytearray(ExactSummary([2**63, U64]).encode())
    good = Summary.decode(KIND_EXACT, b"", bytes(body))
    assert [int(k) for k in good.keys] == [2**63, U64]
    # n=2 -> k=62: low stream 124 bits, then unary; high bits start at bit 124 of the stream
    bits = np.unpackbits(np.frombuffer(bytes(body[4:]), dtype=np.uint8))
    ones = np.flatnonzero(bits[124:])
    assert ones.size == 2
    forged = bits.copy()
    forged[124:] = 0
    forged[124 + ones[0]] = 1
    forged[124 + ones[1] + 1] = 1  # second quotient one larger
    forged = np.concatenate([forged, np.zeros(8, dtype=np.uint8)])
    nbytes = (124 + ones[1] + 2 + 7) // 8
    data = bytes(body[:4]) + np.packbits(forged).tobytes()[:nbytes]
    with pytest.raises(SummaryDecodeError, match=r"2\^64-1|padding"):
        Summary.decode(KIND_EXACT, b"", data)


def test_bloom_params_are_checked() -> None:
    s = BloomSummary.from_keys(rng_keys(100, 4), 0.01, 5)
    assert roundtrip(s).same_bytes(s)
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_BLOOM, s.params()[:8], s.encode())
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_BLOOM, b"\x00" + s.params()[1:], s.encode())
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_BLOOM, s.params(), b"")


def test_fuse_rejects_noncanonical_bodies() -> None:
    s = FuseSummary.from_keys(rng_keys(2000, 5), 0.01, 6)
    params, body = s.params(), s.encode()
    assert (s.m, s.g, s.b) == (107, 4, 27)
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_FUSE, params, body + b"\x00")
    with pytest.raises(SummaryDecodeError):
        Summary.decode(KIND_FUSE, params, body[:-1])
    groups = -(-s.slots // s.g)
    if (groups * s.b) % 8:  # there are padding bits: set the last one
        with pytest.raises(SummaryDecodeError, match="padding"):
            Summary.decode(KIND_FUSE, params, body[:-1] + bytes([body[-1] | 1]))
    # first group all ones: 2^27-1 >= 107^4
    forged = b"\xff\xff\xff" + bytes([body[3] | 0xE0]) + body[4:]
    with pytest.raises(SummaryDecodeError, match="digits"):
        Summary.decode(KIND_FUSE, params, forged)
    bad_params = [
        b"\x05" + params[1:],  # arity
        params[:1] + b"\x11" + params[2:],  # seg_log2
        params[:6] + b"\x00\x00\x00\x01" + params[10:],  # alphabet 1
        params[:10] + b"\x00" + params[11:],  # group 0
        params[:11] + b"\x1a" + params[12:],  # 107^4 does not fit 26 bits
        params[:19],
    ]
    for p in bad_params:
        with pytest.raises(SummaryDecodeError):
            Summary.decode(KIND_FUSE, p, body)


def _regroup(body: bytes, groups: int, b: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8))[: groups * b].reshape(groups, b)
    return bits


def test_fuse_partial_last_group_digits_must_be_zero() -> None:
    s = FuseSummary.from_keys(rng_keys(300, 7), 0.01, 1)
    # the same table packed three digits to 20 bits (m = 101): slots % 3 != 0 here
    t = FuseSummary(
        np.asarray(s._table) % 101,
        arity=s.arity,
        seg_log2=s.seg_log2,
        segments=s.segments,
        m=101,
        g=3,
        b=20,
        seed=s.seed,
    )
    assert t.slots % 3 != 0
    body = t.encode()
    assert roundtrip(t).same_bytes(t)
    groups = -(-t.slots // 3)
    grid = _regroup(body, groups, 20)
    last = int("".join(map(str, grid[-1])), 2) + 101 ** (t.slots % 3)  # digit past the end
    assert last < 101**3
    grid[-1] = [int(c) for c in f"{last:020b}"]
    forged = np.packbits(np.concatenate([grid.reshape(-1), np.zeros(8, np.uint8)]))
    forged_body = forged.tobytes()[: len(body)]
    with pytest.raises(SummaryDecodeError, match="past the last"):
        Summary.decode(KIND_FUSE, t.params(), forged_body)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from([1, 2, 3, 4, 5]),
    params=st.binary(max_size=24),
    body=st.binary(max_size=64),
)
def test_random_bytes_parse_or_raise_the_codec_error(kind: int, params: bytes, body: bytes) -> None:
    try:
        s = Summary.decode(kind, params, body)
    except wire.CodecError:
        return
    assert s.params() == params and s.encode() == body


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.integers(0, U64), max_size=40), flip=st.integers(0, 10_000))
def test_mutated_bodies_parse_canonically_or_raise(keys: list[int], flip: int) -> None:
    for kind in (KIND_EXACT, KIND_FUSE):
        s = Summary.build(keys, 0.01, kind=kind)
        body = bytearray(s.encode())
        if not body:
            continue
        body[flip % len(body)] ^= 1 << (flip % 8)
        try:
            d = Summary.decode(kind, s.params(), bytes(body))
        except wire.CodecError:
            continue
        assert d.encode() == bytes(body)


def test_kind_choice_is_smallest() -> None:
    assert Summary.build([], 0.01).kind == KIND_EXACT
    assert Summary.build(rng_keys(5000, 8), 0.01).kind == KIND_FUSE
    assert Summary.build(rng_keys(5000, 8), 0.0).kind == KIND_EXACT
    for n in (0, 3, 100, 5000):
        keys = rng_keys(n, 9)
        chosen = Summary.build(keys, 0.01)
        for kind in SNAPSHOT_KINDS:
            assert chosen.size() <= Summary.build(keys, 0.01, kind=kind).size()
    with pytest.raises(ValueError):
        Summary.build([1], 0.01, kind=KIND_DELTA)
    with pytest.raises(ValueError):
        Summary.build([1], 1.5)
    with pytest.raises(ValueError):
        Summary.build([-1], 0.01)


@pytest.mark.parametrize("target", [0.05, 0.01, 0.001])
def test_fuse_fpr_meets_target(target: float) -> None:
    keys = rng_keys(20_000, 10)
    s = FuseSummary.from_keys(keys, target, 3)
    assert s.fpr <= 0.95 * target
    probes = np.random.default_rng(11).integers(0, 2**64, 400_000, dtype=np.uint64)
    measured = s.contains_many(probes).mean()
    sigma = (s.fpr / len(probes)) ** 0.5
    assert abs(measured - s.fpr) < 5 * sigma
    assert measured <= target
    assert s.size() * 8 / keys.size < 1.25 * np.log2(1 / target) + 1


def test_bloom_fpr_near_design() -> None:
    keys = rng_keys(20_000, 12)
    s = BloomSummary.from_keys(keys, 0.01, 3)
    probes = np.random.default_rng(13).integers(0, 2**64, 200_000, dtype=np.uint64)
    assert 0.007 < s.contains_many(probes).mean() < 0.013
    assert 0.007 < s.fpr < 0.013


def test_packing_choice() -> None:
    assert choose_packing(0.01) == (107, 4, 27)
    m, g, b = choose_packing(1 / 256)  # needs m >= 270 -> 8.x bits
    assert m**g <= 2**b and 1 / m <= 0.95 / 256
    assert choose_packing(1e-12) is None
    assert choose_packing(0.6) == (2, 1, 1)


def test_fuse_alphabet_fits_its_u32_field_at_the_tightest_targets():
    """m is a u32 on the wire: a target that needs m between 2^31 and 2^32-1 must still
    give a filter that encodes (it once chose m = 2^32 and failed to write its params)."""
    assert choose_packing(3e-10)[0] == (1 << 32) - 1
    assert choose_packing(2e-10) is None  # would need m above 2^32-1
    keys = np.arange(1, 2_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    s = Summary.build(keys, 3e-10, kind=3, seed=1)
    back = Summary.decode(3, s.params(), s.encode())
    assert back.same_bytes(s) and bool(back.contains_many(keys).all())

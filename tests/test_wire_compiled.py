"""The compiled decoders change speed only: same objects as the reference decoder, and
anything they do not take goes to the reference, whose error is the one raised."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catsproto import wire
from catsproto.wire import Reader
from catsproto.wire.advertisement import _FALLBACK, _Decided, _decode_compiled
from catsproto.wire.compiled import Fallback, compile_record
from catsproto.wire.fields import FieldCodec
from tests.strategies import advertisements

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(data: bytes, registry: wire.Registry = wire.DEFAULT_REGISTRY):
    """(advertisement, None) or (None, error) from the Reader-based reference decoder."""
    try:
        return wire.decode_from(Reader(data), registry), None
    except wire.CodecError as exc:
        return None, exc


def compiled(data: bytes, registry: wire.Registry = wire.DEFAULT_REGISTRY):
    """The compiled path alone: an advertisement, None where it defers, or the error it
    decided on itself (a 65th TLV after 64 good ones)."""
    try:
        return _decode_compiled(data, 0, len(data), registry)
    except _Decided as verdict:
        return verdict.error
    except _FALLBACK:
        return None


def _shape(error: wire.CodecError) -> tuple:
    return (type(error), error.reason, error.offset, error.tlv_type, error.framing, error.more)


def assert_agree(data: bytes, registry: wire.Registry = wire.DEFAULT_REGISTRY) -> bool:
    """Both paths agree on `data`; True if it was accepted."""
    ref, err = reference(data, registry)
    fast = compiled(data, registry)
    if err is not None:
        assert not isinstance(fast, wire.Advertisement), (
            f"compiled accepts what the reference refuses ({err}): {data.hex()}"
        )
        if fast is not None:  # decided by the compiled path: the reference's very error
            assert _shape(fast) == _shape(err)
        with pytest.raises(wire.CodecError) as raised:
            wire.decode(data, registry)
        got = raised.value
        assert (type(got), got.reason, got.offset, got.tlv_type) == (
            type(err),
            err.reason,
            err.offset,
            err.tlv_type,
        )
        return False
    # repr, not ==: an IntEnum member equals its int, and the JSON form would differ
    assert isinstance(fast, wire.Advertisement), (
        f"compiled defers on an accepted input: {data.hex()}"
    )
    assert repr(fast) == repr(ref)
    assert wire.decode(data, registry) == ref
    return True


@pytest.mark.parametrize("vector", VECTORS["positive"], ids=lambda v: v["name"])
def test_positive_vectors_take_the_compiled_path(vector):
    assert assert_agree(bytes.fromhex(vector["hex"]))


@pytest.mark.parametrize("vector", VECTORS["negative"], ids=lambda v: v["name"])
def test_negative_vectors_fall_back_to_the_reference_error(vector):
    data = bytes.fromhex(vector["hex"])
    assert not assert_agree(data)
    with pytest.raises(wire.CodecError) as raised:
        wire.decode(data)
    assert type(raised.value).__name__ == vector["error"]
    assert raised.value.offset == vector["offset"]


@pytest.mark.parametrize("vector", VECTORS["positive"], ids=lambda v: v["name"])
def test_every_single_byte_overwrite_of_a_vector_agrees(vector):
    # range limits (a CS-ID of 0, a score of 11, an unknown enum code, a length off by
    # one) sit one byte away from a valid vector: try a few values at every position
    data = bytes.fromhex(vector["hex"])
    for at in range(len(data)):
        for value in {0, 1, 10, 11, 0x7F, 0x80, 0xFF, (data[at] + 1) & 0xFF, data[at] - 1}:
            mutated = bytearray(data)
            mutated[at] = value & 0xFF
            assert_agree(bytes(mutated))


@SETTINGS
@given(advertisements())
def test_generated_advertisements_agree(adv):
    assert assert_agree(wire.encode(adv))


@SETTINGS
@given(advertisements(), st.data())
def test_mutated_advertisements_agree(adv, data):
    raw = bytearray(wire.encode(adv))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        kind = data.draw(st.sampled_from(["flip", "insert", "delete", "nudge"]))
        if kind == "flip" and raw:
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del raw[at : at + data.draw(st.integers(1, 4))]
        elif raw:
            raw[at] = (raw[at] + data.draw(st.sampled_from([-1, 1]))) & 0xFF
    assert_agree(bytes(raw))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=120))
def test_random_bytes_agree(data):
    assert_agree(data)


def test_attribute_value_window_keeps_offsets_from_the_flags_byte():
    value = bytes.fromhex(VECTORS["negative"][0]["hex"])
    attr = wire.encode_attribute(value)
    with pytest.raises(wire.CodecError) as from_value:
        wire.decode(value)
    with pytest.raises(wire.CodecError) as from_attr:
        wire.decode_attribute_value(attr)
    if from_value.value.offset is not None:
        assert from_attr.value.offset == from_value.value.offset + len(attr) - len(value)


def test_a_record_stops_at_its_window_not_at_the_buffer():
    # Sequence is 12 bytes; given a window of 11 inside a longer buffer it must defer
    data = bytes(range(1, 17))
    decode = compile_record(wire.Sequence)
    assert decode(data, 0, 12)[1] == 12
    with pytest.raises(Fallback):
        decode(data, 0, 11)


class Reversed(FieldCodec):
    """A codec the compiler does not know: four bytes, stored reversed."""

    def read(self, r: Reader, name: str) -> bytes:
        return r.bytes(4, name)[::-1]

    def write(self, w: wire.Writer, value: bytes) -> None:
        w.bytes(value[::-1])

    def check(self, value: object, name: str) -> None:
        if not (isinstance(value, bytes) and len(value) == 4):
            raise wire.BadValueError(f"{name} must be 4 bytes")


@wire.define_tlv(300, "experimental")
class Experimental(wire.TLV):
    tag: Annotated[bytes, Reversed()]
    count: Annotated[int, wire.fields.U16]


def test_unknown_codecs_run_through_a_reader_in_compiled_code():
    registry = wire.DEFAULT_REGISTRY.extended(Experimental)
    base = wire.decode(bytes.fromhex(VECTORS["positive"][0]["hex"]))
    adv = base.replace(Experimental(b"abcd", 7))
    data = wire.encode(adv)
    assert assert_agree(data, registry)
    assert compiled(data, registry).get(Experimental) == Experimental(b"abcd", 7)
    assert "Reader(" in registry.compiled[300].source
    assert dataclasses.is_dataclass(Experimental)


def test_twin_filled_records_are_ordinary_frozen_records():
    """Records filled through their slot twin (`filling_class`) are of the real class,
    frozen and hashable, and equal to the same records made by their constructors."""
    from catsproto.examples import examples, large_advertisement

    def records(obj: object):
        if dataclasses.is_dataclass(obj):
            yield obj
            for f in dataclasses.fields(obj):
                yield from records(getattr(obj, f.name))
        elif isinstance(obj, tuple):
            for item in obj:
                yield from records(item)

    for adv in [e.advertisement for e in examples()] + [large_advertisement()]:
        got = compiled(wire.encode(adv))
        assert got == adv
        made = list(records(adv))
        decoded = list(records(got))
        assert [type(r) for r in decoded] == [type(r) for r in made]
        for r in decoded:
            first = dataclasses.fields(r)[0].name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(r, first, getattr(r, first))
        assert {hash(t) for t in got.tlvs} == {hash(t) for t in adv.tlvs}

"""The shared vectors (tests/vectors/wire.json): both directions, byte for byte."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from catsproto import wire
from catsproto.examples import examples
from catsproto.vectors import wire_vectors

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())
POSITIVE = VECTORS["positive"]
NEGATIVE = VECTORS["negative"]
ERRORS = {
    cls.__name__: cls
    for cls in (
        wire.TruncatedError,
        wire.BadLengthError,
        wire.NonCanonicalError,
        wire.BadValueError,
    )
}


def test_vector_file_is_what_the_code_generates():
    assert wire_vectors() == VECTORS, "run `catsproto vectors` and review the diff"


def test_vectors_cover_every_tlv_type_ip_family_and_error_class():
    types = set()
    families = set()
    for v in POSITIVE:
        adv = wire.decode(bytes.fromhex(v["hex"]))
        types |= {type(t) for t in adv.tlvs}
        families.add(adv.origin.address.version)
    assert set(wire.DEFAULT_REGISTRY.by_type.values()) | {wire.UnknownTLV} <= types
    assert families == {4, 6}
    assert any(bytes.fromhex(v["attribute"])[0] & wire.FLAG_EXTENDED_LENGTH for v in POSITIVE)
    assert {v["error"] for v in NEGATIVE} == set(ERRORS)


@pytest.mark.parametrize("vector", POSITIVE, ids=lambda v: v["name"])
def test_positive_vector_both_ways(vector):
    value = bytes.fromhex(vector["hex"])
    adv = wire.decode(value)
    assert adv.to_json() == vector["json"]
    rebuilt = wire.Advertisement.from_json(vector["json"])
    assert rebuilt == adv
    assert wire.encode(rebuilt) == value
    attribute = bytes.fromhex(vector["attribute"])
    assert wire.encode_attribute(value) == attribute
    assert wire.decode_attribute_value(attribute) == adv


@pytest.mark.parametrize("vector", POSITIVE, ids=lambda v: v["name"])
def test_every_truncation_fails_or_ends_on_a_tlv_boundary(vector):
    value = bytes.fromhex(vector["hex"])
    whole = wire.decode(value).tlvs
    for cut in range(len(value)):
        try:
            got = wire.decode(value[:cut])
        except wire.CodecError:
            continue
        # Only a cut between TLVs, after the mandatory ones, can still decode.
        assert got.tlvs == whole[: len(got.tlvs)]
        assert wire.encode(got) == value[:cut]


@pytest.mark.parametrize("vector", POSITIVE, ids=lambda v: v["name"])
@pytest.mark.parametrize(
    ("garbage", "error"),
    [
        (b"\x00", wire.TruncatedError),  # half a TLV header
        (b"\xff\xff\x00\x05ab", wire.BadLengthError),  # length beyond the input
        (b"\x00\x01\x00\x01\x01", wire.NonCanonicalError),  # a second version TLV
    ],
)
def test_trailing_garbage_is_refused(vector, garbage, error):
    with pytest.raises(error):
        wire.decode(bytes.fromhex(vector["hex"]) + garbage)


@pytest.mark.parametrize("vector", NEGATIVE, ids=lambda v: v["name"])
def test_negative_vector(vector):
    with pytest.raises(ERRORS[vector["error"]]) as info:
        wire.decode(bytes.fromhex(vector["hex"]))
    assert info.value.offset == vector["offset"]
    assert info.value.tlv_type == vector["tlv_type"]
    assert str(info.value) == vector["message"]


def _annotated_hex(text: str) -> bytes:
    """Hex with `;` comments, dnspython style."""
    return bytes.fromhex(" ".join(re.sub(r";.*", "", line) for line in text.splitlines()))


def test_hand_annotated_vector_matches_the_encoder():
    """Written from the format description, not from the encoder's output."""
    expected = _annotated_hex(
        """
        00 01 00 01            ; version TLV, length 1
        01                     ;   format version 1
        00 02 00 0e            ; origin TLV, length 14
        00 00 00 64            ;   CS-ID 100
        00 00 00 01            ;   site 1
        00 01 c0 00 02 0a      ;   AFI 1, 192.0.2.10
        00 03 00 0c            ; sequence TLV, length 12
        00 00 00 01            ;   epoch 1
        00 00 00 00 00 00 00 01 ;  sequence 1
        00 04 00 08            ; timestamp TLV, length 8
        00 00 01 a1 ee 56 61 e8 ;  1795000001000 ms
        """
    )
    assert wire.encode(examples()[0].advertisement) == expected
    assert wire.decode(expected).timestamp_ms == 1_795_000_001_000

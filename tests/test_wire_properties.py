"""Properties: round trips are exact, and bad bytes only ever raise CodecError."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catsproto import wire
from tests.strategies import advertisements

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(advertisements())
def test_decode_encode_round_trip(adv):
    data = wire.encode(adv)
    back = wire.decode(data)
    assert back == adv
    assert wire.encode(back) == data


@FAST
@given(advertisements())
def test_json_round_trip_through_text(adv):
    text = json.dumps(adv.to_json())
    assert wire.Advertisement.from_json(json.loads(text)) == adv


@FAST
@given(advertisements())
def test_attribute_round_trip_with_partial_bit(adv):
    attr = bytearray(wire.encode_attribute(wire.encode(adv)))
    assert bool(attr[0] & wire.FLAG_EXTENDED_LENGTH) == (len(attr) > 258 + 1)
    attr[0] |= wire.FLAG_PARTIAL  # what a transit router does
    assert wire.decode_attribute_value(bytes(attr)) == adv


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_codec_error(data):
    try:
        adv = wire.decode(data)
    except wire.CodecError as exc:
        assert exc.reason
        return
    assert wire.encode(adv) == data


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(advertisements(), st.data())
def test_mutated_encodings_only_raise_codec_error(adv, data):
    raw = bytearray(wire.encode(adv))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        at = data.draw(st.integers(0, len(raw)))
        if kind == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif kind == "insert":
            raw[at:at] = bytes([data.draw(st.integers(0, 255))])
        elif at < len(raw):
            del raw[at]
    try:
        back = wire.decode(bytes(raw))
    except wire.CodecError:
        return
    assert wire.encode(back) == bytes(raw)

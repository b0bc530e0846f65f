"""Primitives, registry, framing and error reporting, one behaviour each."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Annotated

import pytest

from catsproto import wire
from catsproto.examples import examples, large_advertisement
from catsproto.wire import Reader, Writer
from catsproto.wire.bgp import build_update, parse_update


@pytest.mark.parametrize(
    ("method", "width"), [("u8", 1), ("u16", 2), ("u32", 4), ("u64", 8), ("f64", 8)]
)
def test_every_primitive_refuses_truncation(method, width):
    data = bytes(range(1, width + 1))
    assert getattr(Reader(data), method)("field") is not None
    for cut in range(width):
        r = Reader(data[:cut])
        with pytest.raises(wire.TruncatedError) as info:
            getattr(r, method)("field")
        assert info.value.offset == 0
        unit = "byte" if width == 1 else "bytes"
        assert f"field needs {width} {unit}, only {cut} remain" in str(info.value)


def test_restrict_to_requires_the_window_consumed_whole():
    r = Reader(b"\x01\x02\x03")
    with pytest.raises(wire.BadLengthError, match="leaves 1 of 2 bytes unread"):  # noqa: SIM117
        with r.restrict_to(2, "inner") as inner:
            inner.u8("a")
    r = Reader(b"\x01\x02\x03")
    with r.restrict_to(2, "inner") as inner:
        assert inner.u16("a") == 0x0102
        with pytest.raises(wire.TruncatedError):
            inner.u8("beyond the window")
    assert r.u8("after") == 3


def test_writer_refuses_a_value_longer_than_its_length_field():
    w = Writer()
    with pytest.raises(wire.BadLengthError), w.length_prefixed(1, "thing"):
        w.bytes(bytes(256))


def test_registry_refuses_a_type_twice():
    with pytest.raises(ValueError, match="registered twice"):
        wire.DEFAULT_REGISTRY.extended(wire.Version)


def test_unknown_type_becomes_known_with_a_bigger_registry():
    adv = examples()[4].advertisement
    data = wire.encode(adv)

    @wire.define_tlv(300, "experimental", wire.ErrorAction.ATTRIBUTE_DISCARD)
    class Experimental(wire.TLV):
        payload: Annotated[bytes, wire.Blob()]

    registry = wire.DEFAULT_REGISTRY.extended(Experimental)
    adv2 = wire.decode(data, registry)
    assert adv2.get(Experimental).payload == bytes.fromhex("deadbeef")
    assert wire.encode(adv2) == data


def test_construction_validates_ranges_and_order():
    with pytest.raises(wire.BadValueError, match=r"score 11 outside 0\.\.10"):
        wire.MetricsL2(11)
    with pytest.raises(wire.BadValueError, match="cs_id 0 outside"):
        wire.Origin(0, 1, ipaddress.ip_address("192.0.2.1"))
    with pytest.raises(wire.NonCanonicalError):
        wire.Advertisement(tuple(reversed(examples()[0].advertisement.tlvs)))
    with pytest.raises(wire.NonCanonicalError):
        wire.Advertisement.build(
            *examples()[0].advertisement.tlvs, wire.MetricsL2(1), wire.MetricsL2(2)
        )


def test_rfc7606_action_is_declared_per_tlv():
    assert wire.MetricsL0.ON_ERROR is wire.ErrorAction.ATTRIBUTE_DISCARD
    assert wire.CacheSummaries.ON_ERROR is wire.ErrorAction.TREAT_AS_WITHDRAW
    bad_metric = wire.BadValueError("x", 60, wire.TLVType.METRICS_L0)
    assert wire.error_action(bad_metric) is wire.ErrorAction.ATTRIBUTE_DISCARD
    assert wire.error_action(wire.TruncatedError("x", 2)) is wire.ErrorAction.TREAT_AS_WITHDRAW


def test_attribute_flags_and_lengths():
    short = wire.encode(examples()[0].advertisement)
    long = wire.encode(examples()[3].advertisement)
    assert wire.encode_attribute(short)[:3] == bytes([0xC0, 0xFF, len(short)])
    assert wire.encode_attribute(long)[:4] == bytes([0xD0, 0xFF]) + len(long).to_bytes(2, "big")
    assert wire.encode_attribute(short, 42)[1] == 42
    # Extended length on a short value, Partial bit, low bits: all accepted on receipt.
    odd = bytes([0xF7, 0xFF]) + len(short).to_bytes(2, "big") + short
    assert wire.decode_attribute(odd).value == short
    assert wire.decode_attribute(odd).partial


@pytest.mark.parametrize(
    ("attr", "error", "offset"),
    [
        (bytes([0x40, 0xFF, 0]), wire.BadValueError, 0),  # not optional
        (bytes([0xC0, 0x2A, 0]), wire.BadValueError, 1),  # another type code
        (bytes([0xC0, 0xFF, 5, 1]), wire.BadLengthError, 3),  # length beyond input
        (bytes([0xC0, 0xFF, 0, 0]), wire.BadValueError, 3),  # trailing byte
        (bytes([0xD0, 0xFF, 0]), wire.TruncatedError, 2),  # half an extended length
    ],
)
def test_attribute_framing_errors(attr, error, offset):
    with pytest.raises(error) as info:
        wire.decode_attribute(attr)
    assert info.value.offset == offset


def test_errors_inside_an_attribute_count_from_its_first_byte():
    value = bytearray(wire.encode(examples()[0].advertisement))
    value[4] = 9  # version 9
    attr = wire.encode_attribute(bytes(value))
    with pytest.raises(wire.BadValueError) as info:
        wire.decode_attribute_value(attr)
    assert info.value.offset == 3 + 4
    assert str(info.value) == "version TLV at offset 7: version 9 outside 1..1"


def test_update_message_round_trip_and_scapy_agrees():
    from scapy.contrib import bgp as scapy_bgp

    attr = wire.encode_attribute(wire.encode(large_advertisement(2000)))
    prefix = ipaddress.ip_network("10.255.0.1/32")
    msg = build_update([prefix], ipaddress.ip_address("10.0.12.1"), [attr], as_path=(65001,))
    update = parse_update(msg)
    assert update.nlri == (prefix,)
    ours = update.attribute(255)
    assert ours is not None and msg[ours.value_offset :][: len(ours.value)] == ours.value
    assert wire.encode_attribute(ours.value) == attr

    scapy_bgp.bgp_module_conf.use_2_bytes_asn = False
    parsed = scapy_bgp.BGPHeader(msg)
    path_attrs = parsed[scapy_bgp.BGPUpdate].path_attr
    seen = {pa.type_code: pa for pa in path_attrs}
    assert 255 in seen
    assert bytes(seen[255])[4:] == ours.value  # flags, type, 2-byte length, then value


def test_an_unknown_summary_kind_is_kept_and_skippable():
    """A receiver that does not know a kind keeps the entry's bytes (and the signature
    over them) and skips just that entry; the other tiers stay usable."""
    adv = examples()[3].advertisement
    entries = adv.cache_summaries.entries
    new = wire.CacheSummaries((entries[0], dataclasses.replace(entries[1], kind=200)))
    data = wire.encode(adv.replace(new))
    back = wire.decode(data)
    assert back.cache_summaries.entries[1].kind == 200
    assert back.to_json()["cache-summaries"][1]["kind"] == 200
    assert wire.encode(wire.Advertisement.from_json(back.to_json())) == data


def test_a_value_holds_at_most_max_tlvs_both_ways():
    """Framing rule 7: 64 TLVs decode and encode back; a 65th, however small, is refused
    by the decoder at its header (both decoders) and by the encoder's constructor."""
    base = examples()[0].advertisement
    room = wire.MAX_TLVS - len(base.tlvs)
    fill = [wire.UnknownTLV(0x1000 + i, b"") for i in range(room)]
    full = base.replace(*fill)
    assert len(full.tlvs) == wire.MAX_TLVS
    assert wire.decode(wire.encode(full)) == full
    with pytest.raises(wire.BadLengthError, match="at most 64"):
        base.replace(*fill, wire.UnknownTLV(0x2000, b""))
    over = wire.encode(full) + bytes.fromhex("2000 0000")
    for decode in (wire.decode, lambda b: wire.decode_from(Reader(b))):
        with pytest.raises(wire.BadLengthError) as info:
            decode(over)
        assert (info.value.offset, info.value.tlv_type) == (len(over) - 4, 0x2000)
        assert wire.error_action(info.value) is wire.ErrorAction.TREAT_AS_WITHDRAW


def test_the_header_walk_stops_at_the_65th_tlv():
    """A 64 KiB value of 16,000 empty TLVs is refused at TLV 65: the decoder never
    reaches the rest (a later framing error there is not what it reports)."""
    base = wire.encode(examples()[0].advertisement)
    n = len(wire.decode(base).tlvs)
    body = b"".join((0x1000 + i).to_bytes(2, "big") + b"\0\0" for i in range(16_000 - n))
    junk = body[:-4] + b"\xff"  # a truncated last header, far past TLV 65
    with pytest.raises(wire.BadLengthError) as info:
        wire.decode(base + junk)
    assert info.value.offset == len(base) + 4 * (wire.MAX_TLVS - n)

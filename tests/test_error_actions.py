"""RFC 7606 actions of a malformed attribute: framing errors, several errors, key schemes.

The rule (docs/wire.md, the draft's Error Handling): a broken TLV framing (truncated
header, length beyond the value, type out of order or repeated) is treat-as-withdraw
whatever the TLV; with the framing intact the strongest action of every malformed TLV
applies, so attribute-discard only when all of them are attribute-discard types.
"""

from __future__ import annotations

import ipaddress

import pytest

from catsproto import wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.adapters import pcap
from catsproto.commands.inspect import _status
from catsproto.wire.bgp import build_update

TAW = wire.ErrorAction.TREAT_AS_WITHDRAW
AD = wire.ErrorAction.ATTRIBUTE_DISCARD

# version, origin, sequence, timestamp: the mandatory TLVs (51 bytes)
HEADER = bytes.fromhex(
    "00010001 01 0002000e 00000064 00000001 0001 c000020a"
    "0003000c 00000001 0000000000000001 00040008 000001a1ee5661e8"
)
L0 = bytes.fromhex("0010000d 0001 02 02 02 4010000000000000")  # one valid L0 entry
L0_NAN = bytes.fromhex("0010000d 0001 02 02 02 7ff8000000000000")
L1_BAD = bytes.fromhex("00110002 01 0b")  # score 11
CAP = bytes.fromhex("00220010 0000000000000001 0000000000000002")
CAP_BAD = bytes.fromhex("00220010 0000000000000003 0000000000000002")  # free > total
SUMMARY_BAD_TIER = bytes.fromhex(
    "0021002d 002b 09 01 00000001 00000000 0000000000000000 ffffffffffffffff"
    "00000000 00040000 00000005 000c3500 00"
)
CACHE_MODEL = bytes.fromhex("0020000c 02 6d31 00000200 01 00000007")  # model "m1"


def _error(data: bytes) -> wire.CodecError:
    with pytest.raises(wire.CodecError) as raised:
        wire.decode(data)
    return raised.value


def _reference_error(data: bytes) -> wire.CodecError:
    with pytest.raises(wire.CodecError) as raised:
        wire.decode_from(wire.Reader(data))
    return raised.value


def _summary(exc: wire.CodecError) -> list[tuple[str, str, bool]]:
    return [(type(e).__name__, str(e), e.framing) for e in (exc, *exc.more)]


def test_the_header_decodes_and_each_attribute_discard_tlv_alone_is_attribute_discard():
    assert wire.decode(HEADER + L0 + CAP).capacity == wire.Capacity(1, 2)
    for bad, tlv_type in ((L0_NAN, 16), (L1_BAD, 17), (CAP_BAD, 34)):
        exc = _error(HEADER + bad)
        assert exc.tlv_type == tlv_type and not exc.framing and exc.more == ()
        assert wire.error_action(exc) is AD


FRAMING = {
    "length beyond the value": (
        HEADER + bytes.fromhex("0010ffff") + L0[4:],
        wire.BadLengthError,
        "metrics-l0 TLV at offset 55: TLV value length 65535 exceeds remaining 13 bytes",
    ),
    "repeated": (
        HEADER + L0 + L0,
        wire.NonCanonicalError,
        "metrics-l0 TLV at offset 68: type 16 repeats metrics-l0: "
        "types must be strictly increasing",
    ),
    "out of order": (
        HEADER + CAP + L0,
        wire.NonCanonicalError,
        "metrics-l0 TLV at offset 71: type 16 comes after capacity: "
        "types must be strictly increasing",
    ),
    "truncated header": (
        HEADER + CAP + b"\x00\x23\x00",
        wire.TruncatedError,
        "at offset 73: TLV length needs 2 bytes, only 1 remain",
    ),
}


@pytest.mark.parametrize("name", sorted(FRAMING))
def test_a_framing_error_is_treat_as_withdraw_even_in_an_attribute_discard_tlv(name):
    data, cls, message = FRAMING[name]
    exc = _error(data)
    assert type(exc) is cls and str(exc) == message
    assert exc.framing
    assert wire.error_action(exc) is TAW
    assert _summary(_reference_error(data)) == _summary(exc)
    # through the path-attribute framing: offsets move by the 3-byte header, marks stay
    attr = wire.encode_attribute(data)
    with pytest.raises(wire.CodecError) as raised:
        wire.decode_attribute_value(attr)
    assert raised.value.framing and raised.value.offset == exc.offset + 3
    assert wire.error_action(raised.value) is TAW


def test_a_malformed_value_inside_its_own_length_is_not_a_framing_error():
    # capacity's length says 15: its second u64 is cut short inside the TLV
    data = HEADER + bytes.fromhex("0022000f") + CAP[4:-1]
    exc = _error(data)
    assert isinstance(exc, wire.TruncatedError) and exc.tlv_type == 34 and not exc.framing
    assert wire.error_action(exc) is AD
    # a value with bytes left over once its fields are read is the TLV's own error too
    exc = _error(HEADER + bytes.fromhex("00120002 05 00"))
    assert str(exc) == "metrics-l2 TLV at offset 56: TLV value leaves 1 of 2 bytes unread"
    assert not exc.framing and wire.error_action(exc) is AD


def test_several_errors_the_strongest_action_applies():
    # an attribute-discard TLV, then a treat-as-withdraw one: the first error is still
    # the one reported (byte order), the action is treat-as-withdraw
    exc = _error(HEADER + L0_NAN + SUMMARY_BAD_TIER)
    assert exc.tlv_type == 16 and [e.tlv_type for e in exc.more] == [33]
    assert "tier" in str(exc.more[0])
    assert wire.error_action(exc) is TAW
    # an attribute-discard TLV, then a broken framing
    exc = _error(HEADER + L0_NAN + b"\x00\x21\x00")
    assert exc.tlv_type == 16 and [e.framing for e in exc.more] == [True]
    assert wire.error_action(exc) is TAW
    # two attribute-discard TLVs: attribute-discard, both reported
    exc = _error(HEADER + L0_NAN + L1_BAD + CAP_BAD)
    assert [e.tlv_type for e in (exc, *exc.more)] == [16, 17, 34]
    assert wire.error_action(exc) is AD
    # an attribute-discard TLV and a missing mandatory TLV (no sequence)
    no_sequence = HEADER[:23] + HEADER[39:]
    exc = _error(no_sequence + L0_NAN)
    assert [str(e) for e in exc.more] == ["at offset 0: mandatory sequence TLV is missing"]
    assert wire.error_action(exc) is TAW
    for data in (
        HEADER + L0_NAN + SUMMARY_BAD_TIER,
        HEADER + L0_NAN + b"\x00\x21\x00",
        HEADER + L0_NAN + L1_BAD + CAP_BAD,
        no_sequence + L0_NAN,
    ):
        assert _summary(_reference_error(data)) == _summary(_error(data))


def test_one_error_alone_keeps_its_message_and_the_action_of_its_tlv():
    exc = _error(HEADER + SUMMARY_BAD_TIER)
    assert exc.more == () and not exc.framing and wire.error_action(exc) is TAW
    exc = _error(HEADER[:23] + HEADER[39:])
    assert str(exc) == "at offset 0: mandatory sequence TLV is missing"
    assert exc.more == () and wire.error_action(exc) is TAW
    # an error built by hand (outside a decoder) is judged by its TLV type alone
    assert wire.error_action(wire.BadValueError("x", 60, 16)) is AD
    framed = wire.BadLengthError("x", 60, 16).as_framing()
    assert wire.error_action(framed) is TAW
    assert framed.located(None, None).framing


def test_error_action_callers_report_the_strongest_action(tmp_path):
    value = HEADER + L0 + L0  # a repeated attribute-discard TLV: treat-as-withdraw
    update = build_update(
        [ipaddress.ip_network("10.255.0.1/32")],
        ipaddress.ip_address("10.0.0.1"),
        [wire.encode_attribute(value)],
        as_path=(65001,),
    )
    flow = ("10.0.0.1", 40000, "10.0.0.2", 179)
    (finding,) = pcap.findings([pcap.BGPMessage(1.0, flow, update)])
    assert finding.to_json()["error"]["action"] == "treat-as-withdraw"
    assert _status(finding).endswith("(treat-as-withdraw)")
    rib = rx.CacheRib()
    message = {
        "type": "update",
        "neighbor": {
            "address": {"peer": "10.0.23.1"},
            "message": {
                "update": {
                    "attribute": {"attribute-0xFF-0xC0": "0x" + value.hex()},
                    "announce": {"ipv4 unicast": {"10.0.23.1": [{"nlri": "10.255.0.1/32"}]}},
                }
            },
        },
    }
    (event,) = rx.parse_message(message)
    (change,) = rib.apply(event, 1.0)
    assert change.kind == "treat-as-withdraw"
    assert change.reason.startswith("malformed (treat_as_withdraw): metrics-l0 TLV")


@pytest.mark.parametrize("scheme", [2, 7, 255])
def test_an_unknown_key_scheme_is_kept_as_a_number_not_malformed(scheme):
    data = HEADER + L0 + CACHE_MODEL[:-5] + bytes([scheme]) + CACHE_MODEL[-4:]
    adv = wire.decode(data)
    model = adv.cache_model
    assert model is not None and model.key_scheme == scheme
    assert type(model.key_scheme) is int and not model.has_known_key_scheme
    assert wire.encode(adv) == data
    assert repr(wire.decode_from(wire.Reader(data))) == repr(adv)
    assert adv.to_json()["cache-model"]["key_scheme"] == scheme
    assert wire.Advertisement.from_json(adv.to_json()) == adv
    assert adv.metrics_l0 == wire.decode(HEADER + L0).metrics_l0  # the metrics stay


def test_key_scheme_one_is_named_and_zero_is_malformed():
    adv = wire.decode(HEADER + CACHE_MODEL)
    assert adv.cache_model.key_scheme is wire.KeyScheme.BLAKE2B64_CHAINED
    assert adv.cache_model.has_known_key_scheme
    exc = _error(HEADER + CACHE_MODEL[:-5] + b"\x00" + CACHE_MODEL[-4:])
    assert str(exc) == "cache-model TLV at offset 62: key_scheme 0 outside 1..255"
    assert wire.error_action(exc) is TAW
    with pytest.raises(wire.BadValueError):
        wire.CacheModel("m1", 512, 0, 7)
    assert wire.CacheModel("m1", 512, 9, 7).key_scheme == 9

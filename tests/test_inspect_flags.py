"""`catsproto inspect` judges the attribute flags as the codec does: an attribute without
the Optional (0x80) or the Transitive (0x40) bit is malformed (treat-as-withdraw), the
Partial (0x20) and Extended Length (0x10) bits change nothing. The oracle is the draft's
attribute vectors (`tests/vectors/wire.json`, "attributes") and `wire.decode_attribute`;
the capture is the one docs/howto-wireshark.md writes from every vector, no root needed."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.adapters import pcap
from catsproto.cli import main
from catsproto.wire.bgp import build_update

VECTORS = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())
ATTRIBUTES = {v["name"]: v for v in VECTORS["attributes"]}
FLOW = ("10.0.0.1", 40000, "10.0.0.2", 179)
NEXT_HOP = ipaddress.ip_address("10.0.0.1")


def _update(attribute: bytes, route: str = "10.255.2.1/32") -> bytes:
    return build_update([ipaddress.ip_network(route)], NEXT_HOP, [attribute], as_path=(65001,))


def _always_verified(value: bytes, prefix: object, now: float) -> pcap.Check:
    """A verifier that accepts everything, as `--trust` does for a good signature: what
    inspect shows must not depend on it for an attribute the codec refuses."""
    return pcap.Check("verified", "stand-in")


def test_the_vectors_cover_both_missing_flags_and_both_ignored_ones():
    assert {n for n, v in ATTRIBUTES.items() if not v["accepted"]} == {
        "not-transitive",
        "not-optional",
    }
    assert {n for n, v in ATTRIBUTES.items() if v["accepted"]} == {
        "partial-bit-set",
        "extended-length-on-short-value",
    }


@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_findings_apply_the_codecs_flag_rule(name):
    vector = ATTRIBUTES[name]
    attribute = bytes.fromhex(vector["attribute"])
    found = list(
        pcap.findings([pcap.BGPMessage(1.0, FLOW, _update(attribute))], verify=_always_verified)
    )
    assert len(found) == 1
    (finding,) = found
    assert finding.flags == attribute[0]
    if vector["accepted"]:
        assert finding.error is None
        assert finding.status == "verified"
        assert finding.advertisement == wire.decode_attribute_value(attribute)
        return
    with pytest.raises(wire.CodecError) as codec:
        wire.decode_attribute(attribute)
    assert finding.status == "malformed"
    assert finding.advertisement is None
    assert type(finding.error).__name__ == vector["error"] == type(codec.value).__name__
    assert finding.error.reason == codec.value.reason
    assert f"attribute flags {attribute[0]:#04x} lack optional+transitive" in str(finding.error)
    # inspect's offsets count from the value; the flags byte precedes it, so none is given
    assert finding.error.offset is None and finding.error.tlv_type is None
    out = finding.to_json()
    assert out["status"] == "malformed"
    assert out["error"]["action"] == vector["action"] == "treat-as-withdraw"
    assert out["error"]["offset"] is None


def test_flag_refusal_keeps_extended_length_framing():
    """A long value behind flags 0x90 (Optional and Extended Length, no Transitive) is
    refused for its flags, not misread: the header sliced out of the UPDATE is 4 bytes."""
    value = bytes.fromhex(ATTRIBUTES["not-transitive"]["attribute"])[3:]
    attribute = bytes([0x90, 255]) + len(value).to_bytes(2, "big") + value
    (finding,) = pcap.findings([pcap.BGPMessage(1.0, FLOW, _update(attribute))])
    assert str(finding.error) == "attribute flags 0x90 lack optional+transitive (0xc0)"
    (accepted,) = pcap.findings(
        [pcap.BGPMessage(1.0, FLOW, _update(bytes([0xD0]) + attribute[1:]))]
    )
    assert accepted.error is None and accepted.status == "not-checked"


def _vectors_capture(path: Path) -> list[str]:
    """Every vector as one UPDATE on its own /32, in one TCP stream to port 179 (the
    script in docs/howto-wireshark.md); the routes in order."""
    attributes = [bytes.fromhex(v["attribute"]) for v in VECTORS["positive"]]
    attributes += [wire.encode_attribute(bytes.fromhex(v["hex"])) for v in VECTORS["negative"]]
    attributes += [bytes.fromhex(v["attribute"]) for v in VECTORS["attributes"]]
    ip, flow, seq = IP(src=FLOW[0], dst=FLOW[2]), {"sport": FLOW[1], "dport": FLOW[3]}, 1000
    packets = [Ether() / ip / TCP(seq=seq - 1, flags="S", **flow)]
    routes = []
    for i, attribute in enumerate(attributes):
        routes.append(f"10.255.2.{i}/32")
        update = _update(attribute, routes[-1])
        packets.append(Ether() / ip / TCP(seq=seq, flags="PA", **flow) / update)
        seq += len(update)
    wrpcap(str(path), packets)
    return routes


def test_inspect_refuses_every_malformed_vector_of_the_draft(tmp_path, capsys):
    capture = tmp_path / "vectors.pcap"
    routes = _vectors_capture(capture)
    refused = len(VECTORS["negative"]) + sum(not v["accepted"] for v in VECTORS["attributes"])
    accepted = len(routes) - refused
    assert (len(routes), refused) == (56, 44)

    assert main(["inspect", str(capture)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        f"{len(routes)} advertisement(s) of attribute type 255: "
        f"{refused} malformed, {accepted} not-checked"
    )

    assert main(["inspect", "--json", str(capture)]) == 1
    shown = json.loads(capsys.readouterr().out)["advertisements"]
    by_route = {a["prefix"]: a for a in shown}
    flag_routes = routes[-len(VECTORS["attributes"]) :]
    for route, vector in zip(flag_routes, VECTORS["attributes"], strict=True):
        row = by_route[route]
        assert row["flags"] == "0x" + vector["attribute"][:2]
        if vector["accepted"]:
            assert row["status"] == "not-checked", row
        else:
            assert row["status"] == "malformed", row
            assert row["error"]["action"] == "treat-as-withdraw"
            assert "lack optional+transitive" in row["error"]["message"]

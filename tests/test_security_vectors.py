"""tests/vectors/security.json, checked against the code and, independently, against the
byte layouts docs/security-reference.md states (built here by hand, checked with `cryptography`)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from catsproto import security, wire
from catsproto.security.vectors import security_vectors

VECTORS = json.loads((Path(__file__).parent / "vectors" / "security.json").read_text())
ADVS = VECTORS["advertisements"]


def test_vector_file_is_what_the_code_generates():
    assert security_vectors() == VECTORS, (
        "regenerate tests/vectors/security.json (docs/security-reference.md)"
    )


def test_key_ids_follow_the_documented_formula():
    for key in VECTORS["keys"].values():
        public = bytes.fromhex(key["public_key"])
        digest = hashlib.sha256(b"catsproto/v1 key-id\x00" + b"\x01" + public).digest()
        assert key["key_id"] == digest[:8].hex()
        assert security.SigningKey.from_seed(bytes.fromhex(key["seed"])).public.raw == public


def _by_hand_nlri(text: str) -> bytes:
    net = ipaddress.ip_network(text)
    afi = b"\x00\x01" if net.version == 4 else b"\x00\x02"
    return afi + bytes([net.prefixlen]) + net.network_address.packed


@pytest.mark.parametrize("vector", ADVS, ids=lambda v: v["name"])
def test_signature_covers_label_type_nlri_and_value_without_signature(vector):
    unsigned = bytes.fromhex(vector["unsigned_value"])
    message = (
        b"catsproto/v1 advertisement\x00"
        + bytes([vector["attribute_type"]])
        + _by_hand_nlri(vector["nlri"])
        + unsigned
    )
    assert message.hex() == vector["signed_message"]
    node = Ed25519PublicKey.from_public_bytes(bytes.fromhex(VECTORS["keys"]["node"]["public_key"]))
    node.verify(bytes.fromhex(vector["signature"]), message)
    with pytest.raises(InvalidSignature):
        node.verify(bytes.fromhex(vector["signature"]), message[:-1] + bytes([message[-1] ^ 1]))
    # The value is the unsigned value with the Signature TLV (type 255) put in type order.
    value = bytes.fromhex(vector["value"])
    sig_tlv = (
        b"\x00\xff"
        + (1 + 1 + 8 + 64).to_bytes(2, "big")
        + b"\x01\x08"
        + bytes.fromhex(VECTORS["keys"]["node"]["key_id"])
        + bytes.fromhex(vector["signature"])
    )
    assert sig_tlv in value and value.replace(sig_tlv, b"") == unsigned
    assert wire.encode_attribute(value).hex() == vector["attribute"]


def test_delegation_signature_covers_label_and_every_other_field():
    d = VECTORS["delegation"]
    value = bytes.fromhex(d["tlv_value"])
    signature = bytes.fromhex(d["json"]["operator_signature"])
    # algorithm, key id, node key, two u64 times: then the u8-prefixed signature, then scope
    head = 1 + 1 + 8 + 1 + 32 + 8 + 8
    assert value[head : head + 65] == b"\x40" + signature
    message = b"catsproto/v1 delegation\x00" + value[:head] + value[head + 65 :]
    assert message.hex() == d["signed_message"]
    operator = VECTORS["keys"]["operator"]
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(operator["public_key"])).verify(
        signature, message
    )
    assert security.delegation_from_json(d["json"]) == wire.Delegation.decode_from(
        wire.Reader(value)
    )


def test_sealed_vector_opens_with_the_documented_aad():
    v = next(a for a in ADVS if a["name"] == "sealed-signed")
    adv = wire.decode(bytes.fromhex(v["value"]))
    sealed = adv.get(wire.SealedCache)
    origin_and_sequence = wire.Writer()
    adv.origin.encode_tlv(origin_and_sequence)
    adv.sequence.encode_tlv(origin_and_sequence)
    aad = (
        b"catsproto/v1 sealed-cache\x00"
        + b"\x01"
        + v["group_key_id"].to_bytes(4, "big")
        + origin_and_sequence.getvalue()
    )
    assert aad.hex() == v["associated_data"]
    secret = bytes.fromhex(VECTORS["group_key"]["secret"])
    plaintext = ChaCha20Poly1305(secret).decrypt(sealed.nonce, sealed.ciphertext, aad)
    assert plaintext.hex() == v["plaintext"]
    assert {t.type for t in adv.tlvs}.isdisjoint({32, 33, 34, 35})
    keyring = security.GroupKeyring(security.GroupKey.of(v["group_key_id"], secret))
    opened = security.open_sealed(adv, keyring)
    assert wire.encode(opened).hex() == v["opened_value"]
    # the draft's Sealing: the clear TLVs, the Signature TLV included, the sealed ones
    # in place of the Sealed Cache TLV, in type order
    clear = [t.type for t in adv.tlvs if t.type != wire.TLVType.SEALED_CACHE]
    assert opened.signature == adv.signature
    assert [t.type for t in opened.tlvs] == sorted([*clear, 32, 33, 34, 35])


def test_trust_file_loads_and_the_receive_script_replays():
    trust = security.TrustStore.from_json(VECTORS["trust_file"])
    assert trust.to_json() == VECTORS["trust_file"]
    group = VECTORS["group_key"]
    keyring = security.GroupKeyring(
        security.GroupKey.of(group["key_id"], bytes.fromhex(group["secret"]))
    )
    receiver = security.Receiver(trust, group_keys=keyring)
    for step in VECTORS["receive"]:
        verdict, receiver = receiver.receive(
            bytes.fromhex(step["value"]), ipaddress.ip_network(step["nlri"]), step["now_ms"]
        )
        assert verdict.reason.value == step["reason"], step["name"]
        unopened, unheld = verdict.unknown_algorithm, verdict.unheld_group_key
        shown = None
        if unopened is not None:
            shown = f"not opened: unknown sealing algorithm {unopened}"
        elif unheld is not None:
            shown = f"not opened: group key {unheld} is not held"
        assert step.get("sealed_section") == shown, step["name"]
    # every verdict a receiver can reach from bytes alone, fixed keys and a fixed clock
    # (unknown-group-key is open_sealed's alone: a receiver accepts the section unopened)
    reachable = {r.value for r in security.Reason} - {"unknown-group-key"}
    assert {s["reason"] for s in VECTORS["receive"]} == reachable
    shown = [s.get("sealed_section", "") for s in VECTORS["receive"]]
    assert any(text.startswith("not opened: group key") for text in shown)


def test_an_unknown_sealing_algorithm_verifies_and_stays_sealed():
    """The sealed-algorithm-unknown vector: algorithm octet 200 right after the Sealed
    Cache header, a valid signature over it, and the receive step accepting it unopened
    although the receiver holds group key 7, the key id it names."""
    v = next(a for a in ADVS if a["name"] == "sealed-algorithm-unknown")
    value = bytes.fromhex(v["value"])
    at = value.index(bytes.fromhex("0024"), 51)  # after the 51 octets of mandatory TLVs
    assert value[at + 4] == 200
    assert int.from_bytes(value[at + 5 : at + 9], "big") == VECTORS["group_key"]["key_id"]
    (step,) = [s for s in VECTORS["receive"] if s["value"] == v["value"]]
    assert step["reason"] == "ok"
    assert step["sealed_section"] == "not opened: unknown sealing algorithm 200"

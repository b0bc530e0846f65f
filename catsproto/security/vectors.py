"""Test vectors for signing, delegation and sealing (tests/vectors/security.json).

Deterministic: keys come from fixed seeds (SHA-256 of a label), nonces are fixed, the
clock is `T0_MS`. The `receive` list is a scripted session against one receiver (it
trusts the operator and holds group key 7), each step with the reason it must end in
stated by hand; `security_vectors()` refuses to
produce a file in which the code disagrees. Pure: the caller writes the file
(``catsproto vectors`` or the one-liner in docs/security-reference.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress

from catsproto import wire
from catsproto.examples import T0_MS, examples
from catsproto.security.errors import Reason
from catsproto.security.identity import KeyFormatError, PublicKey, SigningKey, verify
from catsproto.security.receiver import Receiver
from catsproto.security.sealing import (
    GroupKey,
    GroupKeyring,
    associated_data,
    open_sealed,
    seal,
)
from catsproto.security.signing import sign, signed_message
from catsproto.security.trust import TrustStore, authorise, delegation_message, delegation_to_json
from catsproto.wire import Advertisement, Sequence, Timestamp
from catsproto.wire.fields import JSON

DAY_MS = 86_400_000
NOW_MS = T0_MS + 43_000
NLRI = ipaddress.ip_network("10.0.1.0/24")
OTHER_NLRI = ipaddress.ip_network("10.0.2.0/24")
NLRI6 = ipaddress.ip_network("2001:db8:100::/48")
UNAUTHORISED_NLRI = ipaddress.ip_network("172.16.0.0/24")  # outside the delegated routes


def seed(label: str) -> bytes:
    return hashlib.sha256(f"catsproto test key {label}".encode()).digest()


@dataclasses.dataclass(frozen=True)
class Fixture:
    """The keys, delegation and advertisement every security test starts from."""

    operator: SigningKey
    node: SigningKey
    stranger: SigningKey
    group: GroupKeyring
    delegation: wire.Delegation
    trust: TrustStore
    base: Advertisement  # unsigned, cache-state example, timestamp T0 + 42 s, seq (1, 42)

    def at(self, epoch: int, sequence: int, ms: int | None = None) -> Advertisement:
        return self.base.replace(
            Sequence(epoch, sequence), Timestamp(NOW_MS - 1000 if ms is None else ms)
        )


def fixture() -> Fixture:
    operator = SigningKey.from_seed(seed("operator"))
    node = SigningKey.from_seed(seed("node"))
    delegation = authorise(
        operator,
        node.public.raw,
        cs_ids=[100, 200],
        routes=["10.0.0.0/16", "2001:db8:100::/40"],
        addresses=["192.0.2.0/24", "2001:db8::/64"],
        not_before_ms=T0_MS - DAY_MS,
        not_after_ms=T0_MS + 30 * DAY_MS,
        sites=[1, 4],
    )
    trust = TrustStore().with_operator(operator.public.raw, "operator-1")
    return Fixture(
        operator=operator,
        node=node,
        stranger=SigningKey.from_seed(seed("stranger")),
        group=GroupKeyring(GroupKey.of(7, seed("group-7"))),
        delegation=delegation,
        trust=trust.with_delegation(delegation),
        base=examples()[2].advertisement.without(wire.TLVType.SIGNATURE),
    )


def tlv_offset(value: bytes, tlv_type: int) -> int:
    """Where the TLV of `tlv_type` starts in a canonical attribute value."""
    pos = 0
    while pos < len(value):
        t, n = (
            int.from_bytes(value[pos : pos + 2], "big"),
            int.from_bytes(value[pos + 2 : pos + 4], "big"),
        )
        if t == tlv_type:
            return pos
        pos += 4 + n
    raise ValueError(f"no TLV of type {tlv_type}")


def summary_body_offset(value: bytes) -> int:
    """Where the first summary entry's body starts in a value holding one."""
    entry_body = 4 + 2 + 42 + 1  # TLV header, entry length, fixed fields, params length
    at = tlv_offset(value, wire.TLVType.CACHE_SUMMARIES) + entry_body
    return at + value[at - 1]


def _signed_vector(name: str, adv: Advertisement, f: Fixture, nlri, note: str) -> JSON:
    unsigned = wire.encode(adv)
    signed = sign(adv, f.node, nlri)
    value = wire.encode(signed)
    return {
        "name": name,
        "description": note,
        "nlri": str(nlri),
        "attribute_type": wire.DEFAULT_ATTRIBUTE_TYPE,
        "unsigned_value": unsigned.hex(),
        "signed_message": signed_message(unsigned, nlri).hex(),
        "signature": signed.signature.signature.hex(),  # type: ignore[union-attr]
        "value": value.hex(),
        "attribute": wire.encode_attribute(value).hex(),
    }


def unknown_algorithm_advertisement(f: Fixture, sequence: int) -> Advertisement:
    """The fixture's advertisement at (1, `sequence`), its cache section replaced by a
    Sealed Cache TLV of AEAD algorithm 200 under group key 7 (a 24-octet nonce and 48
    octets of opaque ciphertext: no AEAD here can make or open it), unsigned."""
    clear = Advertisement(tuple(t for t in f.at(1, sequence).tlvs if not 32 <= t.type <= 35))
    nonce = hashlib.sha256(b"catsproto test nonce 200").digest()[:24]
    ciphertext = hashlib.sha512(b"catsproto test ciphertext 200").digest()[:48]
    return clear.replace(wire.SealedCache(200, f.group.active.key_id, nonce, ciphertext))


def _redelegated(
    f: Fixture, operator: SigningKey, not_before_ms: int, days: int
) -> wire.Delegation:
    """The fixture's delegation of the node key with another operator key or validity."""
    return authorise(
        operator,
        f.node.public.raw,
        cs_ids=[100, 200],
        routes=["10.0.0.0/16", "2001:db8:100::/40"],
        addresses=["192.0.2.0/24", "2001:db8::/64"],
        not_before_ms=not_before_ms,
        not_after_ms=T0_MS + days * DAY_MS,
        sites=[1, 4],
    )


def _receive_script(f: Fixture) -> list[tuple[str, bytes, object, int, Reason]]:
    """(name, value, nlri, now, expected reason), applied in order to one receiver."""
    good = wire.encode(sign(f.at(1, 42), f.node, NLRI))
    other_content = wire.encode(sign(f.at(1, 42).replace(wire.MetricsL2(9)), f.node, NLRI))
    unsigned = wire.encode(f.at(1, 43))
    flipped = bytearray(good)
    flipped[summary_body_offset(good) + 3] ^= 0x01
    nonce = hashlib.sha256(b"catsproto test nonce").digest()[:12]
    other_group = GroupKeyring(GroupKey.of(8, seed("group-8")))
    sealed = seal(f.at(1, 50), f.group, nonce)
    sealed_tlv = sealed.get(wire.SealedCache)
    assert sealed_tlv is not None
    tampered = bytearray(sealed_tlv.ciphertext)
    tampered[0] ^= 0x01
    broken = bytearray(f.delegation.operator_signature)
    broken[0] ^= 0x01
    bad_delegation = dataclasses.replace(f.delegation, operator_signature=bytes(broken))
    other_site = f.at(1, 49).replace(wire.Origin(100, 9, f.base.origin.address))
    by_stranger = _redelegated(f, f.stranger, T0_MS - DAY_MS, 30)
    same_start = _redelegated(f, f.operator, T0_MS - DAY_MS, 60)  # held one's Not Before
    renewal = _redelegated(f, f.operator, T0_MS - DAY_MS // 2, 60)
    return [
        ("accept", good, NLRI, NOW_MS, Reason.OK),
        ("malformed-truncated", good[:-1], NLRI, NOW_MS, Reason.MALFORMED),
        (
            "future-timestamp",
            wire.encode(sign(f.at(1, 46, NOW_MS + 10_000), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.FUTURE_TIMESTAMP,
        ),
        (
            "route-not-authorised",
            wire.encode(sign(f.at(1, 47), f.node, UNAUTHORISED_NLRI)),
            UNAUTHORISED_NLRI,
            NOW_MS,
            Reason.NOT_AUTHORISED,
        ),
        (
            "site-not-authorised",  # site 9: the delegation lists sites 1 and 4 only
            wire.encode(sign(other_site, f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.NOT_AUTHORISED,
        ),
        (
            "bad-delegation-signature",
            wire.encode(sign(f.at(1, 48).replace(bad_delegation), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.BAD_DELEGATION,
        ),
        (
            # signed by a key no trusted operator key is: the node key is held, but a
            # carried delegation is checked whatever else is held
            "delegation-by-unknown-operator",
            wire.encode(sign(f.at(1, 53).replace(by_stranger), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.UNKNOWN_KEY,
        ),
        (
            # the Not Before of the trust file's delegation, other content (Not After)
            "delegation-same-not-before",
            wire.encode(sign(f.at(1, 54).replace(same_start), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.BAD_DELEGATION,
        ),
        (
            "decryption-failed",
            wire.encode(
                sign(
                    sealed.replace(dataclasses.replace(sealed_tlv, ciphertext=bytes(tampered))),
                    f.node,
                    NLRI,
                )
            ),
            NLRI,
            NOW_MS,
            Reason.DECRYPTION_FAILED,
        ),
        ("duplicate", good, NLRI, NOW_MS, Reason.DUPLICATE),
        ("same-sequence-other-content", other_content, NLRI, NOW_MS, Reason.EQUIVOCATION),
        (
            "older-sequence",
            wire.encode(sign(f.at(1, 41), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.REPLAYED,
        ),
        ("moved-to-other-route", good, OTHER_NLRI, NOW_MS, Reason.BAD_SIGNATURE),
        ("bit-flipped-in-summary", bytes(flipped), NLRI, NOW_MS, Reason.BAD_SIGNATURE),
        ("signature-removed", unsigned, NLRI, NOW_MS, Reason.UNSIGNED),
        (
            "unknown-key",
            wire.encode(sign(f.at(1, 44), f.stranger, NLRI)),
            NLRI,
            NOW_MS,
            Reason.UNKNOWN_KEY,
        ),
        (
            "stale",
            wire.encode(sign(f.at(1, 45, NOW_MS - 200_000), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.STALE_TIMESTAMP,
        ),
        ("after-expiry", good, NLRI, T0_MS + 31 * DAY_MS, Reason.KEY_EXPIRED),
        (
            "sealed-algorithm-unknown",  # held key 7 or not: the section stays sealed
            wire.encode(sign(unknown_algorithm_advertisement(f, 51), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.OK,
        ),
        (
            "sealed-group-key-not-held",  # key 8, the receiver holds 7: a rollover it missed
            wire.encode(sign(seal(f.at(1, 52), other_group, nonce), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.OK,
        ),
        (
            "delegation-as-held",  # the trust file's delegation carried: changes nothing
            wire.encode(sign(f.at(1, 55).replace(f.delegation), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.OK,
        ),
        (
            "restart-new-epoch",
            wire.encode(sign(f.at(2, 0), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.OK,
        ),
        ("old-epoch-after-restart", good, NLRI, NOW_MS, Reason.REPLAYED),
        (
            # no state on this route yet, but the origin is at epoch 2 since the restart
            "old-epoch-on-another-route",
            wire.encode(sign(f.at(1, 60), f.node, OTHER_NLRI)),
            OTHER_NLRI,
            NOW_MS,
            Reason.REPLAYED,
        ),
        (
            "delegation-renewed",  # a later Not Before: replaces the trust file's one
            wire.encode(sign(f.at(2, 1).replace(renewal), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.OK,
        ),
        (
            "delegation-superseded",  # the trust file's one again, now older than held
            wire.encode(sign(f.at(2, 2).replace(f.delegation), f.node, NLRI)),
            NLRI,
            NOW_MS,
            Reason.BAD_DELEGATION,
        ),
    ]


ED25519_L = 2**252 + 27742317777372353535851937790883648493  # the group order (RFC 8032)
FORGED_MESSAGE = b"catsproto test forgery"


def _forgery() -> bytes:
    """A signature nobody made: R = [S]B and S = a mod L for the clamped scalar a of a
    test seed (R is then that seed's public key), so [S]B = R + [k]A for A the identity,
    whatever k."""
    seed_r = seed("forgery")
    a = int.from_bytes(hashlib.sha512(seed_r).digest()[:32], "little")
    a = (a & ((1 << 254) - 8)) | (1 << 254)
    return SigningKey.from_seed(seed_r).public.raw + (a % ED25519_L).to_bytes(32, "little")


def ed25519_key_cases() -> list[JSON]:
    """Public keys whose x coordinate is 0, with one forged signature (Signature TLV,
    rules 5 and 6): y = 1 with the sign bit clear is the identity, under which the
    forgery verifies (so it is refused where keys are loaded); with the sign bit set the
    octets do not decode (RFC 8032, Section 5.1.3) and verify nothing."""
    forged = _forgery()
    cases = [
        ("x-zero-sign-clear", (1).to_bytes(32, "little"), True, "small order"),
        ("x-zero-sign-set", ((1 << 255) | 1).to_bytes(32, "little"), False, "does not decode"),
    ]
    out = []
    for name, raw, verifies, refused in cases:
        got = verify(raw, forged, FORGED_MESSAGE)
        if got is not verifies:
            raise AssertionError(f"ed25519 case {name}: expected verifies={verifies}, got {got}")
        try:
            PublicKey.from_bytes(raw)
        except KeyFormatError as exc:
            if refused not in str(exc):
                raise AssertionError(f"ed25519 case {name}: refused as {exc}") from None
        else:
            raise AssertionError(f"ed25519 case {name}: the key loads")
        out.append(
            {
                "name": name,
                "public_key": raw.hex(),
                "message": FORGED_MESSAGE.hex(),
                "signature": forged.hex(),
                "verifies": verifies,
                "on_load": f"refused: {refused}",
            }
        )
    return out


def _tlv_value(tlv: wire.TLV) -> bytes:
    w = wire.Writer()
    tlv.encode_into(w)
    return w.getvalue()


def security_vectors() -> JSON:
    """The content of tests/vectors/security.json."""
    f = fixture()
    nonce = hashlib.sha256(b"catsproto test nonce").digest()[:12]
    sealed = seal(f.at(1, 42), f.group, nonce)
    sealed_tlv = sealed.get(wire.SealedCache)
    assert sealed_tlv is not None
    inner = wire.Writer()
    for t in f.at(1, 42).tlvs:
        if 32 <= t.type <= 35:
            t.encode_tlv(inner)
    v6 = f.at(1, 42).replace(
        wire.Origin(200, 4, ipaddress.ip_address("2001:db8::11")), f.delegation
    )
    advertisements = [
        _signed_vector("signed", f.at(1, 42), f, NLRI, "The cache-state example, signed."),
        {
            **_signed_vector(
                "sealed-signed",
                sealed,
                f,
                NLRI,
                "Cache section (types 32-35) sealed under group key 7, then signed.",
            ),
            "group_key_id": f.group.active.key_id,
            "nonce": nonce.hex(),
            "plaintext": inner.getvalue().hex(),
            "associated_data": associated_data(
                sealed, sealed_tlv.algorithm, sealed_tlv.key_id
            ).hex(),
            # what a receiver holds once it opened the section: the clear TLVs, the
            # Signature TLV included, the sealed ones back in type order (draft, Sealing)
            "opened_value": wire.encode(open_sealed(sign(sealed, f.node, NLRI), f.group)).hex(),
        },
        _signed_vector(
            "sealed-algorithm-unknown",
            unknown_algorithm_advertisement(f, 51),
            f,
            NLRI,
            "Cache section under Sealed Cache algorithm 200, which this document does not "
            "define (opaque nonce and ciphertext), then signed. The signature covers the "
            "sealed octets as they are: it verifies, the metrics are used and the section "
            "stays unopened, group key 7 held or not.",
        ),
        _signed_vector(
            "delegated-ipv6",
            v6,
            f,
            NLRI6,
            "IPv6 instance and route, the delegation carried in-band.",
        ),
    ]
    receiver = Receiver(f.trust, group_keys=f.group)
    steps = []
    for name, value, nlri, now, want in _receive_script(f):
        verdict, receiver = receiver.receive(value, nlri, now)  # type: ignore[arg-type]
        if verdict.reason is not want:
            raise AssertionError(f"receive step {name}: expected {want}, got {verdict}")
        step: JSON = {
            "name": name,
            "value": value.hex(),
            "nlri": str(nlri),
            "now_ms": now,
            "reason": want.value,
        }
        if verdict.unknown_algorithm is not None:
            step["sealed_section"] = (
                f"not opened: unknown sealing algorithm {verdict.unknown_algorithm}"
            )
        if verdict.unheld_group_key is not None:
            step["sealed_section"] = f"not opened: group key {verdict.unheld_group_key} is not held"
        steps.append(step)
    return {
        "keys": {
            name: {
                "seed": key.seed.hex(),
                "public_key": key.public.raw.hex(),
                "key_id": key.key_id.hex(),
            }
            for name, key in (("operator", f.operator), ("node", f.node))
        },
        "group_key": {"key_id": f.group.active.key_id, "secret": f.group.active.secret.hex()},
        "delegation": {
            "json": delegation_to_json(f.delegation),
            "tlv_value": _tlv_value(f.delegation).hex(),
            "signed_message": delegation_message(f.delegation).hex(),
        },
        "trust_file": f.trust.to_json(),
        "advertisements": advertisements,
        "receive": steps,
        "ed25519_keys": ed25519_key_cases(),
    }

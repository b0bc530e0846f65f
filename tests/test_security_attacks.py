"""The attack table: every attack is refused with its reason and changes no state.

Each row builds the bytes an attacker (or a broken origin) would put on the wire, hands
them to a receiver that has already accepted the route's advertisement at (1, 42), and
checks the verdict's reason, that trust store and replay window are the very same
objects afterwards, and that exactly that reason was counted.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable

import pytest

from catsproto import security, wire
from catsproto.examples import T0_MS
from catsproto.security import GroupKey, GroupKeyring, Reason, Receiver, seal, sign
from catsproto.security.vectors import (
    DAY_MS,
    NLRI,
    NOW_MS,
    OTHER_NLRI,
    Fixture,
    fixture,
    seed,
    summary_body_offset,
    tlv_offset,
)

F = fixture()
NONCE = bytes(range(12))
IN_SCOPE_NLRI = ipaddress.ip_network("10.0.9.0/24")  # inside the delegated 10.0.0.0/16


def receiver(group: GroupKeyring | None = F.group) -> Receiver:
    """A receiver that has accepted the (1, 42) advertisement of the route (sealed)."""
    first = wire.encode(sign(seal(F.at(1, 42), F.group, NONCE), F.node, NLRI))
    verdict, r = Receiver(F.trust, group_keys=group).receive(first, NLRI, NOW_MS)
    assert verdict.ok, verdict
    return r


def signed(adv: wire.Advertisement, key: security.SigningKey = F.node, nlri=NLRI) -> bytes:
    return wire.encode(sign(adv, key, nlri))


def flip(value: bytes, at: int, mask: int = 0x01) -> bytes:
    out = bytearray(value)
    out[at] ^= mask
    return bytes(out)


def _forged_signature(f: Fixture) -> bytes:
    # The attacker signs with its own key but names the node's key id.
    adv = sign(f.at(1, 43), f.stranger, NLRI)
    sig = dataclasses.replace(adv.signature, key_id=f.node.key_id)
    return wire.encode(adv.replace(sig))


def _untrusted_operator_delegation(f: Fixture) -> bytes:
    rogue = security.authorise(
        f.stranger,
        f.stranger.public.raw,
        cs_ids=[100],
        routes=["0.0.0.0/0"],
        addresses=["0.0.0.0/0"],
        not_before_ms=T0_MS - DAY_MS,
        not_after_ms=T0_MS + DAY_MS,
    )
    return signed(f.at(1, 43).replace(rogue), f.stranger)


def _widened_delegation(f: Fixture) -> tuple[security.SigningKey, bytes]:
    # A genuine delegation for a new key whose scope was widened after the operator signed.
    key = security.SigningKey.from_seed(seed("new-node"))
    genuine = security.authorise(
        f.operator,
        key.public.raw,
        cs_ids=[100],
        routes=["10.0.1.0/24"],
        addresses=["192.0.2.11/32"],
        not_before_ms=T0_MS - DAY_MS,
        not_after_ms=T0_MS + DAY_MS,
    )
    widened = dataclasses.replace(
        genuine,
        scope=(
            *genuine.scope[:1],
            wire.ScopeEntry.for_network(wire.ScopeKind.ROUTE, ipaddress.ip_network("0.0.0.0/0")),
            *genuine.scope[2:],
        ),
    )
    return key, signed(f.at(1, 43).replace(widened), key)


def _old_delegation_replayed(f: Fixture) -> bytes:
    # The node carries an older delegation of its own key (wider scope, still valid).
    older = security.authorise(
        f.operator,
        f.node.public.raw,
        cs_ids=[100, 300],
        routes=["0.0.0.0/0"],
        addresses=["0.0.0.0/0"],
        not_before_ms=f.delegation.not_before_ms - 1,
        not_after_ms=f.delegation.not_after_ms,
    )
    return signed(f.at(1, 43).replace(older))


def _delegation_for_another_key(f: Fixture) -> bytes:
    return signed(
        f.at(1, 43).replace(
            security.authorise(
                f.operator,
                f.stranger.public.raw,
                cs_ids=[100],
                routes=["10.0.0.0/16"],
                addresses=["192.0.2.0/24"],
                not_before_ms=T0_MS - DAY_MS,
                not_after_ms=T0_MS + DAY_MS,
            )
        )
    )


def _origin(f: Fixture, cs_id: int = 100, address: str = "192.0.2.11") -> wire.Advertisement:
    return f.at(1, 43).replace(wire.Origin(cs_id, 1, ipaddress.ip_address(address)))


def _truncated_signature(f: Fixture) -> bytes:
    value = signed(f.at(1, 43))
    at = tlv_offset(value, wire.TLVType.SIGNATURE)
    body = bytearray(value[at:-1])  # drop the last signature byte, fix the TLV length
    body[2:4] = (len(body) - 4).to_bytes(2, "big")
    return value[:at] + bytes(body)


def _sealed(f: Fixture, adv: wire.Advertisement, group: GroupKeyring = F.group) -> bytes:
    return signed(seal(adv, group, NONCE))


def _tampered_ciphertext(f: Fixture, resign: bool) -> bytes:
    sealed = seal(f.at(1, 43), f.group, NONCE)
    tlv = sealed.get(wire.SealedCache)
    bad = dataclasses.replace(tlv, ciphertext=flip(tlv.ciphertext, 5))
    if resign:  # an insider holding the node key but not the group key
        return signed(sealed.replace(bad))
    value = signed(sealed)
    at = tlv_offset(value, wire.TLVType.SEALED_CACHE) + 4 + 1 + 4 + 1 + 12 + 5
    return flip(value, at)


def _ciphertext_moved_to_other_origin(f: Fixture) -> bytes:
    sealed = seal(f.at(1, 43), f.group, NONCE)
    other = _origin(f, address="192.0.2.12").replace(sealed.get(wire.SealedCache))
    other = other.without(wire.TLVType.CACHE_MODEL).without(wire.TLVType.CACHE_SUMMARIES)
    other = other.without(wire.TLVType.CAPACITY).without(wire.TLVType.HOT_PREFIXES)
    return signed(other)


WRONG_SECRET = GroupKeyring(GroupKey.of(7, seed("not-the-group-key")))

# (name, value builder, nlri, now, receiver's group keyring, expected reason)
Attack = tuple[str, Callable[[Fixture], bytes], object, int, GroupKeyring | None, Reason]
ATTACKS: list[Attack] = [
    ("forged-signature", _forged_signature, NLRI, NOW_MS, F.group, Reason.BAD_SIGNATURE),
    (
        "unknown-key",
        lambda f: signed(f.at(1, 43), f.stranger),
        NLRI,
        NOW_MS,
        F.group,
        Reason.UNKNOWN_KEY,
    ),
    (
        "delegation-by-untrusted-operator",
        _untrusted_operator_delegation,
        NLRI,
        NOW_MS,
        F.group,
        Reason.UNKNOWN_KEY,
    ),
    (
        "delegation-scope-widened",
        lambda f: _widened_delegation(f)[1],
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_DELEGATION,
    ),
    (
        "older-delegation-replayed",
        _old_delegation_replayed,
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_DELEGATION,
    ),
    (
        "delegation-for-another-key",
        _delegation_for_another_key,
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_DELEGATION,
    ),
    (
        "cs-id-not-authorised",
        lambda f: signed(_origin(f, cs_id=300)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.NOT_AUTHORISED,
    ),
    (
        "instance-address-not-authorised",
        lambda f: signed(_origin(f, address="198.51.100.1")),
        NLRI,
        NOW_MS,
        F.group,
        Reason.NOT_AUTHORISED,
    ),
    (
        "route-not-authorised",
        lambda f: signed(f.at(1, 43), nlri=ipaddress.ip_network("10.1.0.0/24")),
        ipaddress.ip_network("10.1.0.0/24"),
        NOW_MS,
        F.group,
        Reason.NOT_AUTHORISED,
    ),
    (
        "route-wider-than-authorised",
        lambda f: signed(f.at(1, 43), nlri=ipaddress.ip_network("10.0.0.0/8")),
        ipaddress.ip_network("10.0.0.0/8"),
        NOW_MS,
        F.group,
        Reason.NOT_AUTHORISED,
    ),
    (
        "delegation-expired",
        lambda f: signed(f.at(1, 43, T0_MS + 31 * DAY_MS)),
        NLRI,
        T0_MS + 31 * DAY_MS,
        F.group,
        Reason.KEY_EXPIRED,
    ),
    (
        "delegation-not-yet-valid",
        lambda f: signed(f.at(1, 43, T0_MS - 2 * DAY_MS)),
        NLRI,
        T0_MS - 2 * DAY_MS,
        F.group,
        Reason.KEY_EXPIRED,
    ),
    (
        "replayed-older-sequence",
        lambda f: signed(f.at(1, 41)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.REPLAYED,
    ),
    (
        "replayed-older-epoch",
        lambda f: signed(f.at(0, 1000)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.REPLAYED,
    ),
    (
        "same-sequence-different-content",
        lambda f: _sealed(f, f.at(1, 42).replace(wire.MetricsL2(9))),
        NLRI,
        NOW_MS,
        F.group,
        Reason.EQUIVOCATION,
    ),
    (
        "stale-timestamp",
        lambda f: signed(f.at(1, 43, NOW_MS - 120_001)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.STALE_TIMESTAMP,
    ),
    (
        "future-timestamp",
        lambda f: signed(f.at(1, 43, NOW_MS + 5_001)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.FUTURE_TIMESTAMP,
    ),
    (
        "signature-moved-to-other-route",
        lambda f: signed(f.at(1, 43)),
        OTHER_NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_SIGNATURE,
    ),
    (
        "signature-moved-to-other-attribute-type",
        lambda f: wire.encode(sign(f.at(1, 43), f.node, NLRI, attribute_type=42)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_SIGNATURE,
    ),
    ("truncated-signature", _truncated_signature, NLRI, NOW_MS, F.group, Reason.MALFORMED),
    (
        "bit-flipped-in-summary",
        lambda f: flip(signed(f.at(1, 43)), summary_body_offset(signed(f.at(1, 43))) + 5),
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_SIGNATURE,
    ),
    (
        "bit-flipped-in-timestamp",
        lambda f: flip(signed(f.at(1, 43)), tlv_offset(signed(f.at(1, 43)), 4) + 11),
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_SIGNATURE,
    ),
    (
        "signature-removed",
        lambda f: wire.encode(f.at(1, 43)),
        NLRI,
        NOW_MS,
        F.group,
        Reason.UNSIGNED,
    ),
    (
        "wrong-group-key",
        lambda f: _sealed(f, f.at(1, 43)),
        NLRI,
        NOW_MS,
        WRONG_SECRET,
        Reason.DECRYPTION_FAILED,
    ),
    (
        "tampered-ciphertext",
        lambda f: _tampered_ciphertext(f, resign=False),
        NLRI,
        NOW_MS,
        F.group,
        Reason.BAD_SIGNATURE,
    ),
    (
        "tampered-ciphertext-re-signed",
        lambda f: _tampered_ciphertext(f, resign=True),
        NLRI,
        NOW_MS,
        F.group,
        Reason.DECRYPTION_FAILED,
    ),
    (
        "ciphertext-moved-to-other-origin",
        _ciphertext_moved_to_other_origin,
        NLRI,
        NOW_MS,
        F.group,
        Reason.DECRYPTION_FAILED,
    ),
    ("garbage", lambda f: b"\x00\x01\x00", NLRI, NOW_MS, F.group, Reason.MALFORMED),
]


def test_the_table_names_every_refusal_reason():
    # unknown-group-key is open_sealed's alone: a receiver accepts a section under a key
    # it does not hold unopened (tests/test_group_key_rollover.py)
    refusals = set(Reason) - {Reason.OK, Reason.DUPLICATE, Reason.UNKNOWN_GROUP_KEY}
    assert {row[-1] for row in ATTACKS} == refusals


@pytest.mark.parametrize("attack", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_is_refused_with_its_reason_and_changes_nothing(attack):
    _, build, nlri, now, group, reason = attack
    before = dataclasses.replace(receiver(), group_keys=group)
    value = build(F)
    verdict, after = before.receive(value, nlri, now)
    assert verdict.reason is reason, verdict.detail
    assert not verdict.ok and verdict.advertisement is None and verdict.state is None
    assert isinstance(verdict.error, security.ERROR_FOR_REASON[reason])
    assert isinstance(verdict.error, wire.CodecError)
    assert after.trust is before.trust
    assert after.window is before.window
    assert after.counters[reason] == before.counters[reason] + 1
    assert after.counters.refused == before.counters.refused + 1
    with pytest.raises(security.ERROR_FOR_REASON[reason]):
        security.verify_advertisement(
            value, nlri, now, before.trust, before.window, before.policy, group
        )


@pytest.mark.parametrize("attack", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_an_already_decoded_value_gets_the_same_verdict(attack):
    """The daemon decodes first (RFC 7606 answers) and hands its decode over: the
    verdict must be the one of the bytes alone."""
    _, build, nlri, now, group, reason = attack
    before = dataclasses.replace(receiver(), group_keys=group)
    value = build(F)
    try:
        decoded = wire.decode(value)
    except wire.CodecError:  # the daemon refuses it before verifying
        assert reason is Reason.MALFORMED
        return
    verdict, after = before.receive(value, nlri, now, decoded=decoded)
    assert verdict.reason is reason, verdict.detail
    assert after.window is before.window and after.counters[reason] == 1


def test_the_honest_versions_of_the_attacked_advertisements_pass():
    """Control for the table: each row fails only because of what the attacker changed."""
    r = receiver()
    for value, nlri, attribute_type in (
        (signed(F.at(1, 43)), NLRI, 255),
        (signed(F.at(1, 44), nlri=IN_SCOPE_NLRI), IN_SCOPE_NLRI, 255),
        (_sealed(F, F.at(1, 45)), NLRI, 255),
        (wire.encode(sign(F.at(1, 46), F.node, NLRI, attribute_type=42)), NLRI, 42),
        (signed(F.at(1, 47, NOW_MS - 120_000)), NLRI, 255),  # the window's edges
        (signed(F.at(1, 48, NOW_MS + 5_000)), NLRI, 255),
    ):
        policy = dataclasses.replace(r.policy, attribute_type=attribute_type)
        verdict, r = dataclasses.replace(r, policy=policy).receive(value, nlri, NOW_MS)
        assert verdict.ok, verdict.detail
    assert r.counters[Reason.OK] == 7 and r.counters.refused == 0


def test_a_rejected_carried_delegation_is_not_learned_but_an_accepted_one_is():
    key, _ = _widened_delegation(F)
    genuine = security.authorise(
        F.operator,
        key.public.raw,
        cs_ids=[100],
        routes=["10.0.1.0/24"],
        addresses=["192.0.2.11/32"],
        not_before_ms=T0_MS - DAY_MS,
        not_after_ms=T0_MS + DAY_MS,
    )
    r = receiver()
    assert r.trust.lookup(key.key_id) is None
    # Carried, valid, but the advertisement is stale: nothing learned.
    stale = signed(F.at(1, 43, NOW_MS - 200_000).replace(genuine), key)
    verdict, r2 = r.receive(stale, NLRI, NOW_MS)
    assert verdict.reason is Reason.STALE_TIMESTAMP and r2.trust is r.trust
    # Carried and accepted: the key is learned, later advertisements need not carry it.
    verdict, r3 = r.receive(signed(F.at(1, 43).replace(genuine), key), NLRI, NOW_MS)
    assert verdict.ok and verdict.learned is not None
    assert r3.trust.lookup(key.key_id).delegation == genuine
    verdict, _ = r3.receive(signed(F.at(1, 44), key), NLRI, NOW_MS)
    assert verdict.ok and verdict.learned is None

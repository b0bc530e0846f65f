"""Keys, delegations, the trust file, the replay window, group keys and the receiver,
one behaviour each."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from catsproto import security, wire
from catsproto.examples import T0_MS
from catsproto.security import GroupKey, GroupKeyring, Reason, Receiver, RouteKey, RouteState
from catsproto.security.vectors import DAY_MS, NLRI, NOW_MS, OTHER_NLRI, fixture, seed

F = fixture()


def test_signing_key_file_round_trip_and_no_seed_in_repr():
    obj = F.node.to_json("node-1")
    back = security.SigningKey.from_json(obj)
    assert back.public == F.node.public and back.seed == F.node.seed
    assert F.node.seed.hex() not in repr(F.node)
    with pytest.raises(security.KeyFormatError, match="does not match"):
        security.SigningKey.from_json({**obj, "public_key": F.operator.public.raw.hex()})
    with pytest.raises(security.KeyFormatError):
        security.SigningKey.from_json({**obj, "format": "other"})
    with pytest.raises(security.KeyFormatError, match="31 bytes"):
        security.SigningKey.from_seed(bytes(31))
    with pytest.raises(security.KeyFormatError):
        security.PublicKey.from_bytes(bytes(33))


def test_signatures_are_deterministic_and_key_ids_differ():
    assert F.node.sign(b"m") == F.node.sign(b"m")
    assert F.node.key_id != F.operator.key_id
    assert security.key_id(F.node.public.raw) == F.node.key_id


def test_signed_message_for_ipv6_route_and_other_attribute_type():
    nlri = ipaddress.ip_network("2001:db8:100::/48")
    msg = security.signed_message(b"VALUE", nlri, 42)
    assert msg == (
        b"catsproto/v1 advertisement\x00" + b"\x2a" + b"\x00\x02\x30" + nlri[0].packed + b"VALUE"
    )
    with pytest.raises(ValueError):
        security.signed_message(b"", nlri, 256)
    with pytest.raises(TypeError):
        security.nlri_bytes("10.0.0.0/8")  # type: ignore[arg-type]


def test_signature_covers_unknown_tlvs_after_its_own_type():
    adv = F.at(1, 43).replace(wire.UnknownTLV(300, b"\x01\x02"))
    value = wire.encode(security.sign(adv, F.node, NLRI))
    assert security.without_signature(value) == wire.encode(adv)
    assert Receiver(F.trust).check(value, NLRI, NOW_MS).ok
    changed = value[:-1] + b"\x03"  # the unknown TLV's last byte
    assert Receiver(F.trust).check(changed, NLRI, NOW_MS).reason is Reason.BAD_SIGNATURE


def test_received_message_is_the_signed_message_cut_from_the_wire_bytes():
    last = wire.encode(security.sign(F.at(1, 43), F.node, NLRI))
    middle = wire.encode(
        security.sign(F.at(1, 43).replace(wire.UnknownTLV(300, b"\x01")), F.node, NLRI)
    )
    unsigned = wire.encode(F.at(1, 43))
    for value in (last, middle, unsigned):
        expected = security.signed_message(security.without_signature(value), NLRI, 42)
        assert security.received_message(value, NLRI, 42) == expected
    start, stop = security.signature_span(last)
    assert stop == len(last) and last[start:stop][:2] == b"\x00\xff"
    assert security.signature_span(unsigned) == (len(unsigned), len(unsigned))


def test_scope_checks_match_ipaddress_containment():
    auth = F.trust.lookup(F.node.key_id)
    inside = [("10.0.0.0/16", "192.0.2.1"), ("10.0.255.0/24", "192.0.2.255")]
    outside = [
        ("10.1.0.0/24", "192.0.2.1"),
        ("10.0.0.0/15", "192.0.2.1"),
        ("10.0.0.0/16", "192.0.3.1"),
    ]
    v6 = [("2001:db8:100::/48", "2001:db8::1"), ("2001:db8:100::/40", "2001:db8::ffff")]
    for route, address in inside + v6:
        auth.check_scope(100, ipaddress.ip_address(address), ipaddress.ip_network(route), 1)
    for route, address in [*outside, ("2001:db8::/32", "2001:db8::1"), ("10.0.0.0/16", "::1")]:
        with pytest.raises(security.NotAuthorisedError):
            auth.check_scope(100, ipaddress.ip_address(address), ipaddress.ip_network(route), 1)
    with pytest.raises(security.NotAuthorisedError, match="CS-ID 7"):
        auth.check_scope(
            7, ipaddress.ip_address("192.0.2.1"), ipaddress.ip_network("10.0.0.0/16"), 1
        )


def test_site_entries_bind_the_origin_s_site_and_none_authorise_every_site():
    """The fixture's delegation lists sites 1 and 4: another site id, 0 included, is
    refused; a delegation without site entries (made before the kind existed) takes any."""
    auth = F.trust.lookup(F.node.key_id)
    address, route = ipaddress.ip_address("192.0.2.1"), ipaddress.ip_network("10.0.0.0/16")
    assert auth.sites == frozenset({1, 4})
    for site in (1, 4):
        auth.check_scope(100, address, route, site)
    for site in (0, 2, 0xFFFFFFFF):
        with pytest.raises(security.NotAuthorisedError, match=f"site {site} "):
            auth.check_scope(100, address, route, site)
    anywhere = security.authorise(
        F.operator,
        F.stranger.public.raw,
        cs_ids=[100],
        routes=["10.0.0.0/16"],
        addresses=["192.0.2.0/24"],
        not_before_ms=0,
        not_after_ms=1 << 50,
    )
    assert not anywhere.entries(wire.ScopeKind.SITE)
    open_auth = F.trust.check_delegation(anywhere)
    assert open_auth.sites is None
    for site in (0, 1, 2, 0xFFFFFFFF):
        open_auth.check_scope(100, address, route, site)
    assert "sites" not in security.delegation_to_json(anywhere)
    assert security.delegation_to_json(F.delegation)["sites"] == [1, 4]


def test_an_authorised_node_claiming_another_site_is_refused():
    """Issue #32 row 4: a node authorised for site 1 signs an advertisement whose Origin
    names site 2 (a site nearer the ingress, to be priced at its distance): the signature
    verifies, but the site is outside the delegation's scope."""
    claim = F.at(1, 42).replace(wire.Origin(100, 2, F.base.origin.address))
    nlri = ipaddress.ip_network("10.0.1.0/24")
    verdict = security.Receiver(F.trust).check(security.sign(claim, F.node, nlri), nlri, NOW_MS)
    assert verdict.reason is Reason.NOT_AUTHORISED, verdict
    assert "site 2" in verdict.detail
    honest = security.Receiver(F.trust).check(
        security.sign(F.at(1, 42), F.node, nlri), nlri, NOW_MS
    )
    assert honest.reason is Reason.OK


def test_policy_refuses_an_attribute_type_outside_a_byte():
    with pytest.raises(ValueError, match="256"):
        security.Policy(attribute_type=256)


def test_delegation_json_and_wire_forms_round_trip():
    obj = security.delegation_to_json(F.delegation)
    assert security.delegation_from_json(obj) == F.delegation
    adv = F.at(1, 43).replace(F.delegation)
    assert wire.decode(wire.encode(adv)).get(wire.Delegation) == F.delegation
    assert wire.Advertisement.from_json(adv.to_json()) == adv
    with pytest.raises(security.TrustFileError, match="node_key_id"):
        security.delegation_from_json({**obj, "node_key_id": "00" * 8})
    with pytest.raises(security.TrustFileError, match="lacks"):
        security.delegation_from_json({k: v for k, v in obj.items() if k != "routes"})


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"not_after_ms": T0_MS - DAY_MS}, wire.BadValueError),
        ({"scope": F.delegation.scope[:2]}, wire.BadValueError),  # no address entry
        ({"scope": tuple(reversed(F.delegation.scope))}, wire.NonCanonicalError),
        ({"node_key": bytes(31)}, wire.BadLengthError),
        ({"operator_signature": bytes(63)}, wire.BadLengthError),
    ],
)
def test_delegation_refuses_bad_fields(change, error):
    with pytest.raises(error):
        dataclasses.replace(F.delegation, **change)


def test_scope_entries_are_canonical():
    with pytest.raises(wire.NonCanonicalError, match="host bits"):
        wire.ScopeEntry(wire.ScopeKind.ROUTE, bytes([8, 10, 0, 0, 1]))
    with pytest.raises(wire.BadValueError):
        wire.ScopeEntry(wire.ScopeKind.CS_ID, bytes(4))
    with pytest.raises(wire.BadLengthError):
        wire.ScopeEntry(wire.ScopeKind.ADDRESS, bytes(6))
    with pytest.raises(wire.BadValueError, match="above 32"):
        wire.ScopeEntry(wire.ScopeKind.ADDRESS, bytes([33, 0, 0, 0, 0]))


def test_trust_file_refuses_tampering():
    obj = F.trust.to_json()
    assert security.TrustStore.from_json(obj).to_json() == obj
    wider = {**obj["delegations"][0], "cs_ids": [100, 200, 300]}
    with pytest.raises(security.TrustFileError, match="does not verify"):
        security.TrustStore.from_json({**obj, "delegations": [wider]})
    with pytest.raises(security.TrustFileError, match="not trusted"):
        security.TrustStore.from_json({**obj, "operators": []})
    bad_id = {**obj["operators"][0], "key_id": "00" * 8}
    with pytest.raises(security.TrustFileError, match="key_id"):
        security.TrustStore.from_json({**obj, "operators": [bad_id]})
    with pytest.raises(security.TrustFileError, match="format"):
        security.TrustStore.from_json({**obj, "format": "x"})


def test_renewal_replaces_and_revocation_removes():
    renewed = security.authorise(
        F.operator,
        F.node.public.raw,
        cs_ids=[100],
        routes=["10.0.1.0/24"],
        addresses=["192.0.2.11/32"],
        not_before_ms=T0_MS,
        not_after_ms=T0_MS + 60 * DAY_MS,
    )
    store = F.trust.with_delegation(renewed)
    assert store.lookup(F.node.key_id).delegation == renewed
    with pytest.raises(security.BadDelegationError, match="superseded"):
        store.with_delegation(F.delegation)
    value = wire.encode(security.sign(F.at(1, 43), F.node, NLRI))
    assert Receiver(store).check(value, NLRI, NOW_MS).ok
    assert Receiver(store.without_key(F.node.key_id)).check(value, NLRI, NOW_MS).reason is (
        Reason.UNKNOWN_KEY
    )
    revoked = store.without_operator(F.operator.key_id)
    assert not revoked.operators and not revoked.authorisations


def test_replay_window_is_an_immutable_value():
    routes = [RouteKey(100, ipaddress.ip_address(f"192.0.2.{i}"), NLRI) for i in range(200)]
    window = security.ReplayWindow()
    for i, route in enumerate(routes):
        window = window.with_entry(route, RouteState(1, i, T0_MS + i, b"s"))
    bigger = window.with_entry(routes[0], RouteState(1, 999, T0_MS, b"t"))
    assert len(window) == len(bigger) == 200
    assert window.get(routes[0]).sequence == 0 and bigger.get(routes[0]).sequence == 999
    kept = window.expire(now_ms=T0_MS + 150, max_age_ms=100)
    assert len(kept) == 150 and kept.get(routes[49]) is None and kept.get(routes[50])
    assert sorted(s.sequence for _, s in kept) == list(range(50, 200))


def test_receiver_expire_forgets_only_stale_routes():
    """Two routes whose last advertisements are 60 s apart: an expiry between their
    deadlines drops the older route's entry and keeps the younger one's, unchanged."""
    r = Receiver(F.trust)
    old_ms, young_ms = NOW_MS - 60_000, NOW_MS
    keys: list[RouteKey | None] = []
    for nlri, ms in ((NLRI, old_ms), (OTHER_NLRI, young_ms)):
        signed = wire.encode(security.sign(F.at(1, 43, ms), F.node, nlri))
        verdict, r = r.receive(signed, nlri, ms)
        assert verdict.reason == Reason.OK, verdict
        keys.append(verdict.route)
    old_key, young_key = keys
    assert len(r.window) == 2
    max_age = r.policy.max_age_ms
    between = r.expire(old_ms + max_age + 1)  # past the older deadline, before the younger
    assert between.window.get(old_key) is None
    assert between.window.get(young_key) == r.window.get(young_key)
    assert len(r.expire(young_ms + max_age).window) == 1  # at the deadline: still fresh
    assert len(r.expire(young_ms + max_age + 1).window) == 0


def test_group_key_rotation_overlaps_two_keys():
    k7, k8 = F.group.active, GroupKey.of(8, seed("group-8"))
    sealed_7 = security.seal(F.at(1, 43), F.group, bytes(12))
    staged = F.group.with_standby(k8)
    rotated = staged.rotated()
    assert rotated.active == k8 and rotated.standby == k7
    sealed_8 = security.seal(F.at(1, 43), rotated, bytes(12))
    assert sealed_8.get(wire.SealedCache).key_id == 8
    for keyring in (staged, rotated):  # both keys open during the overlap
        assert security.open_sealed(sealed_7, keyring) == F.at(1, 43)
        assert security.open_sealed(sealed_8, keyring) == F.at(1, 43)
    after_next = rotated.with_standby(GroupKey.of(9, seed("group-9"))).rotated()
    with pytest.raises(security.UnknownGroupKeyError):
        security.open_sealed(sealed_7, after_next)
    with pytest.raises(ValueError, match="share id"):
        GroupKeyring(k7, k7)
    with pytest.raises(ValueError, match="no standby"):
        F.group.rotated()
    assert GroupKey.from_json(k7.to_json()) == k7 and k7.secret.hex() not in repr(k7)


def test_seal_refuses_misuse_and_leaves_cacheless_advertisements_alone():
    with pytest.raises(wire.BadValueError, match="before signing"):
        security.seal(security.sign(F.at(1, 43), F.node, NLRI), F.group, bytes(12))
    with pytest.raises(wire.BadValueError, match="cannot be sealed"):
        security.seal(F.at(1, 43), F.group, bytes(12), types=(wire.TLVType.ORIGIN,))
    with pytest.raises(wire.BadValueError, match="nonce"):
        security.seal(F.at(1, 43), F.group, bytes(8))
    sealed = security.seal(F.at(1, 43), F.group, bytes(12))
    with pytest.raises(wire.BadValueError, match="already sealed"):
        security.seal(sealed, F.group, bytes(12))
    bare = F.at(1, 43).without(32).without(33).without(34).without(35)
    assert security.seal(bare, F.group, bytes(12)) is bare
    only_summaries = security.seal(F.at(1, 43), F.group, bytes(12), types=(33,))
    assert only_summaries.cache_model == F.base.cache_model
    assert security.open_sealed(only_summaries, F.group) == F.at(1, 43)


def _tlv_bytes(tlv: wire.TLV) -> bytes:
    w = wire.Writer()
    tlv.encode_tlv(w)
    return w.getvalue()


def _sealed_with_plaintext(plaintext: bytes) -> wire.Advertisement:
    adv = F.at(1, 43).without(33)
    key = F.group.active
    nonce = bytes(12)
    aad = security.associated_data(adv, 1, key.key_id)
    ct = key._aead.encrypt(nonce, plaintext, aad)
    return adv.replace(wire.SealedCache(wire.AeadAlgorithm.CHACHA20_POLY1305, 7, nonce, ct))


@pytest.mark.parametrize(
    "plaintext",
    [
        _tlv_bytes(F.base.cache_model),  # also in the clear
        _tlv_bytes(F.base.cache_summaries)[:-1],  # truncated
        wire.encode(wire.Advertisement.build(*F.at(1, 43).tlvs[:4]))[:5],  # version TLV
        b"\x00\x23\x00\x0c" + bytes(12) + b"\x00\x21\x00\x00",  # out of order
        b"\x00\xfe\x00\x00",  # a delegation may not be sealed
    ],
)
def test_open_refuses_a_plaintext_that_is_not_a_sealable_run(plaintext):
    with pytest.raises(security.DecryptionError):
        security.open_sealed(_sealed_with_plaintext(plaintext), F.group)


def test_counters_and_verdict_json():
    c = security.Counters().record(Reason.OK).record(Reason.REPLAYED).record(Reason.REPLAYED)
    assert c[Reason.REPLAYED] == 2 and c.refused == 2 and c.as_dict()["ok"] == 1
    verdict = Receiver(F.trust).check(
        wire.encode(security.sign(F.at(1, 43), F.node, NLRI)), NLRI, NOW_MS
    )
    assert verdict.to_json() == {
        "reason": "ok",
        "detail": "accepted",
        "route": {"cs_id": 100, "address": "192.0.2.11", "nlri": "10.0.1.0/24"},
        "key_id": F.node.key_id.hex(),
        "operator": "operator-1",
        "epoch": 1,
        "sequence": 43,
    }
    assert verdict.raise_if_refused() == security.sign(F.at(1, 43), F.node, NLRI)


def test_duplicate_is_not_an_attack_and_keeps_the_advertisement():
    value = wire.encode(security.sign(F.at(1, 43), F.node, NLRI))
    first, r = Receiver(F.trust).receive(value, NLRI, NOW_MS)
    again, r2 = r.receive(value, NLRI, NOW_MS + 10)
    assert again.reason is Reason.DUPLICATE and again.advertisement == first.advertisement
    assert r2.window is r.window and r2.counters.refused == 0
    with pytest.raises(security.DuplicateError):
        security.verify_advertisement(value, NLRI, NOW_MS, r.trust, r.window)


def test_without_group_keys_a_sealed_advertisement_verifies_unread():
    value = wire.encode(security.sign(security.seal(F.at(1, 43), F.group, bytes(12)), F.node, NLRI))
    verdict = Receiver(F.trust).check(value, NLRI, NOW_MS)
    assert verdict.ok and verdict.advertisement.cache_summaries is None
    assert verdict.advertisement.get(wire.SealedCache) is not None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "key_id null is not an integer"),
        ({"key_id": "7", "secret": "00" * 32}, 'key_id "7" is not an integer'),
        ({"key_id": True, "secret": "00" * 32}, "key_id true is not an integer"),
        ({"key_id": 7}, "secret missing"),
        ({"key_id": 7, "secret": "zz" * 32}, "secret is not hex"),
        ({"key_id": 7, "secret": "00" * 31}, "31 bytes, not 32"),
    ],
)
def test_group_key_file_errors_name_the_field_and_never_the_secret(fields, words):
    obj = {"format": F.group.active.to_json()["format"], **fields}
    with pytest.raises(ValueError, match=words) as info:
        GroupKey.from_json(obj)
    assert "zz" not in str(info.value)


def test_a_key_or_delegation_file_of_another_kind_is_refused():
    """Files say what they are: a private key of another algorithm, or a delegation of
    another format, is refused rather than read as ours (both fields may be left out)."""
    key = F.node.to_json("node-1")
    with pytest.raises(security.KeyFormatError, match="algorithm 'rsa' is not ed25519"):
        security.SigningKey.from_json({**key, "algorithm": "rsa"})
    del key["algorithm"]
    assert security.SigningKey.from_json(key).key_id == F.node.key_id
    delegation = security.delegation_to_json(F.delegation)
    with pytest.raises(security.TrustFileError, match='format "x/2" is not'):
        security.delegation_from_json({**delegation, "format": "x/2"})
    del delegation["format"]
    assert security.delegation_from_json(delegation) == F.delegation


def test_an_operator_scope_with_sites_requires_delegations_to_list_its_own():
    """An operator whose scope lists sites may not sign a delegation for every site (one
    without site entries) nor one naming another operator's site."""
    scope = security.OperatorScope.of(
        cs_ids=[100, 200],
        routes=["10.0.0.0/8", "2001:db8::/32"],
        addresses=["192.0.2.0/24", "2001:db8::/48"],
        sites=[1, 4],
    )
    store = security.TrustStore().with_operator(F.operator.public.raw, "operator-1", scope)
    assert store.check_delegation(F.delegation).sites == frozenset({1, 4})

    def delegated(sites):
        return security.authorise(
            F.operator,
            F.stranger.public.raw,
            cs_ids=[100],
            routes=["10.0.0.0/16"],
            addresses=["192.0.2.0/24"],
            sites=sites,
            not_before_ms=0,
            not_after_ms=1 << 50,
        )

    for sites, outside in (((), "every site"), ((1, 2), "site 2")):
        with pytest.raises(security.BadDelegationError, match=f"{outside}.* outside operator"):
            store.check_delegation(delegated(sites))
    obj = store.with_delegation(F.delegation).to_json()
    assert obj["operators"][0]["scope"]["sites"] == [1, 4]
    assert obj["delegations"][0]["sites"] == [1, 4]
    again = security.TrustStore.from_json(obj)
    assert again.to_json() == obj and again.operators[F.operator.key_id].scope == scope
    with pytest.raises(security.TrustFileError, match="sites is empty"):
        security.TrustStore.from_json(
            {
                **obj,
                "operators": [{**obj["operators"][0], "scope": {**scope.to_json(), "sites": []}}],
            }
        )
    with pytest.raises(security.TrustFileError, match=r"sites\[0\]"):
        security.delegation_from_json({**obj["delegations"][0], "sites": ["1"]})


def test_a_lower_epoch_of_an_origin_is_replayed_on_any_of_its_routes():
    """The per-route window cannot see a restart announced on another route; the
    per-origin epoch does, and forgets the origin only with its last route."""
    r = Receiver(F.trust)
    verdict, r = r.receive(security.sign(F.at(2, 0), F.node, NLRI), NLRI, NOW_MS)
    assert verdict.ok
    assert r.window.origin_epoch(verdict.route) == 2
    late, r2 = r.receive(security.sign(F.at(1, 99), F.node, OTHER_NLRI), OTHER_NLRI, NOW_MS)
    assert late.reason is Reason.REPLAYED and "epoch 1 is below epoch 2" in late.detail
    assert r2.window is r.window
    other_origin = F.at(1, 5).replace(wire.Origin(100, 1, ipaddress.ip_address("192.0.2.99")))
    fine, _ = r.receive(security.sign(other_origin, F.node, OTHER_NLRI), OTHER_NLRI, NOW_MS)
    assert fine.ok  # another origin (address) keeps its own epoch
    forgotten = r.expire(NOW_MS + 10 * 120_000)
    assert len(forgotten.window) == 0 and forgotten.window.origin_epoch(verdict.route) is None


def test_a_key_with_x_zero_and_the_sign_bit_set_does_not_decode():
    """Rule 5: y = 1 or p - 1 with the sign bit set names no point (RFC 8032 5.1.3); the
    library would take it as x = 0 and verify a forgery under y = 1."""
    from catsproto.security.identity import verify, x_zero_with_sign
    from catsproto.security.vectors import ed25519_key_cases

    p = 2**255 - 19
    for y in (1, p - 1, 1 + p):
        raw = (y | 1 << 255).to_bytes(32, "little")
        assert x_zero_with_sign(raw)
        assert not x_zero_with_sign((y).to_bytes(32, "little"))
        with pytest.raises(security.KeyFormatError, match="does not decode"):
            security.PublicKey.from_bytes(raw)
    clear, set_ = ed25519_key_cases()
    sig, msg = bytes.fromhex(clear["signature"]), bytes.fromhex(clear["message"])
    assert verify(bytes.fromhex(clear["public_key"]), sig, msg)
    assert not verify(bytes.fromhex(set_["public_key"]), sig, msg)

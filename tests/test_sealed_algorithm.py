"""A Sealed Cache TLV naming an AEAD this code does not implement: well formed, its section
left unopened as without the group key, everything else used.

The codec keeps codes 1-255 (0 stays malformed) and re-encodes them byte for byte; the
receiver accepts such an advertisement whether it holds group keys or not, naming the
code in the verdict and counting it; the signature covers the sealed octets as they are;
the selector RIB takes the metrics and drops what the origin claimed of its cache before;
the receive daemon accepts the route and counts it.
"""

from __future__ import annotations

import ipaddress
import json

import numpy as np
import pytest

from catsproto import security, wire
from catsproto.adapters import exabgp_receive as rx
from catsproto.security import Reason, Receiver
from catsproto.security.vectors import NLRI, NOW_MS, fixture
from catsproto.selector import RIB, Link, Network, PathSelector, Request
from tests.selector_fixtures import BLOCK, advert, entry
from tests.test_error_actions import HEADER, L0

F = fixture()
NONCE_24 = bytes(range(24))
CIPHERTEXT = bytes(range(100, 148))
KEYS = np.arange(7000, 7012, dtype=np.uint64)
ORIGIN = "192.0.2.11"  # inside the fixture's delegation (CS-ID 100, 10.0.0.0/16 routes)


def _sealed_tlv(algorithm: int, nonce: bytes) -> bytes:
    value = bytes([algorithm]) + (7).to_bytes(4, "big") + bytes([len(nonce)]) + nonce
    value += CIPHERTEXT
    return (36).to_bytes(2, "big") + len(value).to_bytes(2, "big") + value


def _unknown(adv: wire.Advertisement, algorithm: int = 200) -> wire.Advertisement:
    """`adv` with its cache section (32-35) replaced by a Sealed Cache TLV of `algorithm`."""
    clear = wire.Advertisement(tuple(t for t in adv.tlvs if not 32 <= t.type <= 35))
    return clear.replace(wire.SealedCache(algorithm, 7, NONCE_24, CIPHERTEXT))


# ---- codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", [2, 200, 255])
def test_an_unknown_algorithm_decodes_and_re_encodes_byte_for_byte(algorithm):
    data = HEADER + L0 + _sealed_tlv(algorithm, NONCE_24)
    adv = wire.decode(data)
    sealed = adv.get(wire.SealedCache)
    assert sealed is not None and sealed.algorithm == algorithm
    assert type(sealed.algorithm) is int and not sealed.has_known_algorithm
    assert (sealed.key_id, sealed.nonce, sealed.ciphertext) == (7, NONCE_24, CIPHERTEXT)
    assert wire.encode(adv) == data
    assert repr(wire.decode_from(wire.Reader(data))) == repr(adv)  # the reference decoder
    assert adv.to_json()["sealed-cache"]["algorithm"] == algorithm
    assert wire.Advertisement.from_json(adv.to_json()) == adv
    assert adv.metrics_l0 == wire.decode(HEADER + L0).metrics_l0


def test_algorithm_one_is_named_keeps_its_nonce_rule_and_zero_is_malformed():
    adv = wire.decode(HEADER + _sealed_tlv(1, bytes(12)))
    sealed = adv.get(wire.SealedCache)
    assert sealed.algorithm is wire.AeadAlgorithm.CHACHA20_POLY1305 and sealed.has_known_algorithm
    with pytest.raises(wire.BadLengthError, match="nonce is 24 bytes, not 12"):
        wire.decode(HEADER + _sealed_tlv(1, NONCE_24))
    with pytest.raises(wire.BadValueError) as raised:
        wire.decode(HEADER + _sealed_tlv(0, bytes(12)))
    assert str(raised.value) == "sealed-cache TLV at offset 55: algorithm 0 outside 1..255"
    assert wire.error_action(raised.value) is wire.ErrorAction.TREAT_AS_WITHDRAW
    with pytest.raises(wire.BadValueError):
        wire.SealedCache(0, 7, bytes(12), CIPHERTEXT)
    assert wire.SealedCache(9, 7, b"\x01", CIPHERTEXT).algorithm == 9  # any nonce length


def test_the_twenty_octet_ciphertext_minimum_is_algorithm_ones_alone():
    """Algorithm 1's tag and one TLV header; another AEAD may have a shorter output."""

    def tlv(algorithm: int, ciphertext: bytes) -> bytes:
        value = bytes([algorithm]) + (7).to_bytes(4, "big") + bytes([12]) + bytes(12)
        value += ciphertext
        return (36).to_bytes(2, "big") + len(value).to_bytes(2, "big") + value

    assert wire.decode(HEADER + tlv(1, bytes(20))).get(wire.SealedCache) is not None
    with pytest.raises(wire.BadLengthError) as raised:
        wire.decode(HEADER + tlv(1, bytes(19)))
    assert str(raised.value) == (
        "sealed-cache TLV at offset 55: ChaCha20-Poly1305 ciphertext is 19 bytes, fewer than "
        "20 (the 16-byte tag and a TLV header)"
    )
    with pytest.raises(wire.BadLengthError):
        wire.decode_from(wire.Reader(HEADER + tlv(1, bytes(19))))  # the reference decoder
    with pytest.raises(wire.BadLengthError):
        wire.SealedCache(1, 7, bytes(12), bytes(19))
    for short in (b"\x01", bytes(8), bytes(19)):
        data = HEADER + tlv(200, short)
        adv = wire.decode(data)
        assert adv.get(wire.SealedCache).ciphertext == short and wire.encode(adv) == data
    with pytest.raises(wire.BadLengthError):  # some ciphertext, whatever the algorithm
        wire.decode(HEADER + tlv(200, b""))


# ---- security ---------------------------------------------------------------------------


def _signed(adv: wire.Advertisement) -> bytes:
    return wire.encode(security.sign(adv, F.node, NLRI))


@pytest.mark.parametrize("keys", [None, F.group], ids=["no-group-keys", "group-key-7-held"])
def test_the_receiver_accepts_it_with_the_section_unopened_and_counts_it(keys):
    value = _signed(_unknown(F.at(1, 43)))
    receiver = Receiver(F.trust, group_keys=keys)
    verdict, receiver = receiver.receive(value, NLRI, NOW_MS)
    assert verdict.reason is Reason.OK
    assert verdict.unknown_algorithm == 200
    assert (
        verdict.detail == "accepted; sealed cache section not opened: unknown sealing algorithm 200"
    )
    assert verdict.to_json()["unknown_sealing_algorithm"] == 200
    adv = verdict.advertisement
    assert adv.get(wire.SealedCache).algorithm == 200 and adv.cache_summaries is None
    assert adv.metrics_l2 == F.at(1, 43).metrics_l2  # the clear part is there
    assert receiver.counters[Reason.OK] == 1 and receiver.counters.unknown_algorithm == 1
    again, receiver = receiver.receive(value, NLRI, NOW_MS + 10)  # BGP re-sends it
    assert again.reason is Reason.DUPLICATE and again.unknown_algorithm == 200
    assert receiver.counters.unknown_algorithm == 2 and receiver.counters.refused == 0


def test_a_known_algorithm_is_still_opened_and_not_counted():
    value = _signed(security.seal(F.at(1, 43), F.group, bytes(12)))
    verdict, receiver = Receiver(F.trust, group_keys=F.group).receive(value, NLRI, NOW_MS)
    assert verdict.ok and verdict.detail == "accepted" and verdict.unknown_algorithm is None
    assert verdict.unheld_group_key is None  # key 7 is held (tests/test_group_key_rollover.py)
    assert verdict.advertisement.cache_summaries == F.at(1, 43).cache_summaries
    assert receiver.counters.unknown_algorithm == 0 and receiver.counters.unheld_group_key == 0
    assert not {"unknown_sealing_algorithm", "unheld_group_key"} & verdict.to_json().keys()


def test_the_signature_covers_the_sealed_octets_of_an_unknown_algorithm():
    value = _signed(_unknown(F.at(1, 43)))
    at = value.index(CIPHERTEXT)
    algorithm_at = at - len(NONCE_24) - 1 - 4 - 1  # before nonce, its length, the key id
    assert value[algorithm_at] == 200
    for flip in (algorithm_at, at - 1, at + 10):  # the algorithm, the nonce, the ciphertext
        changed = bytearray(value)
        changed[flip] ^= 0x01
        verdict = Receiver(F.trust, group_keys=F.group).check(bytes(changed), NLRI, NOW_MS)
        assert verdict.reason is Reason.BAD_SIGNATURE, flip


def test_open_sealed_refuses_an_unknown_algorithm_as_a_key_not_held():
    adv = _unknown(F.at(1, 43))
    with pytest.raises(security.UnknownSealingAlgorithmError) as raised:
        security.open_sealed(adv, F.group)
    assert isinstance(raised.value, security.UnknownGroupKeyError)
    assert raised.value.why is Reason.UNKNOWN_GROUP_KEY
    assert "AEAD algorithm 200" in str(raised.value)
    assert security.unknown_algorithm(adv) == 200
    assert security.unknown_algorithm(security.seal(F.at(1, 43), F.group, bytes(12))) is None
    assert security.unknown_algorithm(F.at(1, 43)) is None


# ---- selector RIB -------------------------------------------------------------------------


def _net() -> Network:
    return Network([Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000)])


def _decide(rib: RIB):
    return PathSelector(rib, _net()).decide(
        Request(100, KEYS, 12 * BLOCK, "ingress"), now_ms=NOW_MS
    )


def _advert(seq: int, backlog: float, entries=()) -> wire.Advertisement:
    return advert(ORIGIN, 1, entries, seq=seq, ts=NOW_MS - 1000, backlog=backlog, cs_id=100)


def test_a_signed_unknown_algorithm_reaches_the_rib_with_its_metrics_and_no_cache_claims():
    receiver = Receiver(F.trust, group_keys=F.group)
    rib = RIB()
    clear, receiver = receiver.receive(_signed(_advert(1, 0.0, [entry(KEYS)])), NLRI, NOW_MS)
    assert clear.ok
    rib.accept(clear.advertisement, NOW_MS)
    assert _decide(rib).chosen.cached_blocks == 12  # the origin's claim in the clear
    verdict, receiver = receiver.receive(_signed(_unknown(_advert(2, 5000.0))), NLRI, NOW_MS)
    assert verdict.ok and verdict.unknown_algorithm == 200
    result = rib.accept(verdict.advertisement, NOW_MS)
    assert result.metrics_updated and result.outcomes == []
    inst = result.instance
    assert inst.backlog_tokens == 5000.0 and inst.tiers == {}
    assert rib.rejected_total == 1
    assert rib.rejected[-1] == (
        f"{ORIGIN}: sealed cache section not opened: unknown sealing algorithm 200"
    )
    d = _decide(rib)
    assert str(d.chosen.address) == ORIGIN and d.chosen.cached_blocks == 0


def test_a_section_sealed_under_a_key_not_held_drops_the_earlier_claims_the_same_way():
    """Without the group key the RIB gets the section still sealed too: the same path."""
    receiver = Receiver(F.trust)  # holds no group keys
    rib = RIB()
    clear, receiver = receiver.receive(_signed(_advert(1, 0.0, [entry(KEYS)])), NLRI, NOW_MS)
    rib.accept(clear.advertisement, NOW_MS)
    sealed = security.seal(_advert(2, 300.0, [entry(KEYS, version=2)]), F.group, bytes(12))
    verdict, receiver = receiver.receive(_signed(sealed), NLRI, NOW_MS)
    assert verdict.ok
    result = rib.accept(verdict.advertisement, NOW_MS)
    assert result.metrics_updated and result.instance.tiers == {}
    assert rib.rejected[-1] == f"{ORIGIN}: sealed cache section not opened: group key 7 not held"
    assert _decide(rib).chosen.cached_blocks == 0


# ---- the receive daemon's RIB -------------------------------------------------------------


def _announced(value: bytes) -> rx.Announced:
    return rx.Announced(
        peer="192.0.2.1",
        prefix=ipaddress.ip_network("10.0.1.0/24"),
        value=value,
        flags=wire.FLAG_OPTIONAL | wire.FLAG_TRANSITIVE,
    )


def test_the_receive_daemon_accepts_the_route_and_counts_the_unknown_algorithm():
    rib = rx.CacheRib()
    value = wire.encode(_unknown(F.at(1, 43)))
    (change,) = rib.apply(_announced(value), now=1.0)
    assert change.kind == "accept" and change.entry is not None
    assert change.reason == "sealed cache section not opened: unknown sealing algorithm 200"
    assert change.to_json()["reason"] == change.reason
    assert rib.counters["unknown_sealing_algorithm"] == 1 and rib.counters["malformed"] == 0
    sealed = wire.encode(security.seal(F.at(1, 44), F.group, bytes(12)))
    (change,) = rib.apply(_announced(sealed), now=2.0)
    assert change.kind == "accept" and change.reason == ""
    assert rib.counters["unknown_sealing_algorithm"] == 1
    assert rib.to_json()["counters"]["unknown_sealing_algorithm"] == 1


def test_the_receive_daemon_verifies_it_through_the_trust_file(tmp_path):
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(F.trust.to_json()))
    verifier = rx.TrustFileVerifier(trust, clock=lambda: NOW_MS / 1000)
    rib = rx.CacheRib(verifier=verifier)
    (change,) = rib.apply(_announced(_signed(_unknown(F.at(1, 43)))), now=1.0)
    assert change.kind == "accept" and change.entry.verified
    assert change.reason.endswith("unknown sealing algorithm 200")
    assert rib.counters["not_verified"] == 0 and rib.counters["unknown_sealing_algorithm"] == 1


def test_the_accepted_verdict_keeps_route_signer_and_state():
    """The verdict of an unknown algorithm is the accepted one with its detail and code
    set: the route, signer and replay state are those of any accepted advertisement."""
    verdict = Receiver(F.trust).check(_signed(_unknown(F.at(1, 43))), NLRI, NOW_MS)
    plain = Receiver(F.trust).check(_signed(F.at(1, 43)), NLRI, NOW_MS)
    assert verdict.route == plain.route and verdict.signer == plain.signer
    assert verdict.state is not None and verdict.state.position == (1, 43)
    assert verdict.state.signature != plain.state.signature  # signed over other octets


# ---- catsproto inspect --------------------------------------------------------------------


def test_inspect_with_a_group_key_and_no_trust_shows_it_not_checked(tmp_path):
    from catsproto.commands.inspect import make_verifier

    key = tmp_path / "group.key"
    key.write_text(json.dumps(F.group.active.to_json()))
    key.chmod(0o600)  # a group key file others may read is refused
    check = make_verifier(None, [str(key)])
    got = check(wire.encode(_unknown(F.at(1, 43))), None, 0.0)
    assert got.status == "not-checked"
    assert "AEAD algorithm 200, which this receiver does not implement" in got.detail
    opened = check(wire.encode(security.seal(F.at(1, 43), F.group, bytes(12))), None, 0.0)
    assert opened.status == "not-checked" and opened.advertisement == F.at(1, 43)


def test_a_known_code_given_as_a_bare_int_is_known():
    """A TLV built by hand with the plain integer of a registered code (not the enum
    member) is the same as the decoded one, so it is known too."""
    built = wire.SealedCache(1, 7, bytes(12), bytes(20))
    assert built.has_known_algorithm
    assert not wire.SealedCache(200, 7, bytes(24), bytes(20)).has_known_algorithm
    model = wire.CacheModel("m1", 512, 1, 7)
    assert model.has_known_key_scheme
    assert not wire.CacheModel("m1", 512, 200, 7).has_known_key_scheme

"""A sealed section that opens into more TLVs than an advertisement may hold is refused as
a decryption failure, never raised past the receiver (framing rule 7 counts the opened
TLVs: the draft's Sealed Cache section)."""

from __future__ import annotations

import ipaddress

import pytest

from catsproto import wire
from catsproto.security import Reason, Receiver, sign
from catsproto.security.errors import DecryptionError
from catsproto.security.sealing import associated_data, open_sealed
from catsproto.security.vectors import NLRI, NOW_MS, fixture
from catsproto.wire import AeadAlgorithm, Writer

F = fixture()


def _sealed_with(count: int) -> wire.Advertisement:
    """The fixture's advertisement with its cache section replaced by a Sealed Cache TLV
    whose plaintext is `count` unknown TLVs (types 100..), sealed under the fixture's
    group key: the tag authenticates, the opened form is what is too long."""
    clear = wire.Advertisement(tuple(t for t in F.base.tlvs if not 32 <= t.type <= 35))
    w = Writer()
    for k in range(count):
        wire.UnknownTLV(100 + k, b"\x00").encode_tlv(w)
    key = F.group.active
    algorithm = AeadAlgorithm.CHACHA20_POLY1305
    nonce = bytes(12)
    ciphertext = key._aead.encrypt(
        nonce, w.getvalue(), associated_data(clear, algorithm, key.key_id)
    )
    return clear.replace(wire.SealedCache(algorithm, key.key_id, nonce, ciphertext))


def test_opened_over_the_tlv_limit_is_a_decryption_failure():
    room = wire.codes.MAX_TLVS - len(_sealed_with(1).tlvs)  # what fits beside the rest
    fits = open_sealed(_sealed_with(room + 1), F.group)  # the sealed TLV itself goes
    assert len(fits.tlvs) == wire.codes.MAX_TLVS
    with pytest.raises(DecryptionError, match="at most"):
        open_sealed(_sealed_with(room + 2), F.group)


def test_the_receiver_refuses_it_and_counts_it():
    adv = sign(_sealed_with(61), F.node, ipaddress.ip_network(NLRI))
    receiver = Receiver(F.trust, group_keys=F.group)
    verdict, after = receiver.receive(wire.encode(adv), ipaddress.ip_network(NLRI), NOW_MS)
    assert verdict.reason is Reason.DECRYPTION_FAILED and verdict.advertisement is None
    assert "at most" in verdict.detail
    assert after.counters[Reason.DECRYPTION_FAILED] == 1 and after.counters.refused == 1
    assert after.window == receiver.window  # a refusal changes nothing but the counters

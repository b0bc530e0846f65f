"""Properties: honest advertisements always pass, any changed bit never does, any input
ends in a verdict (never an exception), and the replay window follows its model."""

from __future__ import annotations

import ipaddress

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catsproto import security, wire
from catsproto.examples import T0_MS
from catsproto.security import Reason, Receiver
from catsproto.security.vectors import DAY_MS, NOW_MS, fixture
from tests.strategies import advertisements

F = fixture()
WIDE = security.authorise(
    F.operator,
    F.node.public.raw,
    cs_ids=[1, 100, 0xFFFFFFFF],
    routes=["0.0.0.0/0", "::/0"],
    addresses=["0.0.0.0/0", "::/0"],
    not_before_ms=T0_MS - DAY_MS,
    not_after_ms=T0_MS + DAY_MS,
)
TRUST = security.TrustStore().with_operator(F.operator.public.raw).with_delegation(WIDE)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routed(draw):
    """An in-scope advertisement (any optional TLVs but a carried delegation) and a route
    of its address family. A generated Sealed Cache TLV of algorithm 1 is dropped (random
    octets do not open); one of an unknown algorithm stays (it is accepted unopened)."""
    adv = draw(advertisements())
    sealed = adv.get(wire.SealedCache)
    if sealed is not None and sealed.has_known_algorithm:
        adv = adv.without(wire.TLVType.SEALED_CACHE)
    address = adv.origin.address
    adv = adv.replace(
        wire.Origin(draw(st.sampled_from([1, 100, 0xFFFFFFFF])), adv.origin.site_id, address),
        wire.Timestamp(NOW_MS - draw(st.integers(0, 120_000))),
    ).without(wire.TLVType.SIGNATURE)
    adv = adv.without(wire.TLVType.DELEGATION)  # a random one would not verify
    bits = draw(st.integers(0, address.max_prefixlen))
    nlri = ipaddress.ip_network((address, bits), strict=False)
    return adv, nlri


def _seal(adv: wire.Advertisement, nonce: bytes) -> wire.Advertisement:
    """Sealed under group key 7, unless already sealed (with an unknown algorithm)."""
    return adv if adv.get(wire.SealedCache) is not None else security.seal(adv, F.group, nonce)


@SETTINGS
@given(routed(), st.binary(min_size=12, max_size=12), st.booleans())
def test_honest_advertisements_pass_and_open_to_what_was_sent(case, nonce, sealed):
    adv, nlri = case
    sent = _seal(adv, nonce) if sealed else adv
    value = wire.encode(security.sign(sent, F.node, nlri))
    verdict = Receiver(TRUST, group_keys=F.group).check(value, nlri, NOW_MS)
    assert verdict.ok, verdict.detail
    assert verdict.advertisement.without(wire.TLVType.SIGNATURE) == adv


@SETTINGS
@given(routed(), st.data())
def test_any_flipped_bit_is_refused_and_changes_nothing(case, data):
    adv, nlri = case
    value = wire.encode(security.sign(_seal(adv, bytes(12)), F.node, nlri))
    at = data.draw(st.integers(0, len(value) - 1))
    bit = data.draw(st.integers(0, 7))
    tampered = bytearray(value)
    tampered[at] ^= 1 << bit
    before = Receiver(TRUST, group_keys=F.group)
    verdict, after = before.receive(bytes(tampered), nlri, NOW_MS)
    assert not verdict.ok and verdict.reason is not Reason.DUPLICATE
    assert after.window is before.window and after.trust is before.trust


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_end_in_a_verdict(data):
    verdict = Receiver(TRUST).check(data, ipaddress.ip_network("10.0.0.0/8"), NOW_MS)
    assert verdict.reason is Reason.MALFORMED or not verdict.ok


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=12))
def test_replay_window_accepts_exactly_the_strictly_newer(positions):
    nlri = ipaddress.ip_network("10.0.1.0/24")
    receiver = Receiver(TRUST)
    best = None
    for epoch, sequence in positions:
        value = wire.encode(security.sign(F.at(epoch, sequence), F.node, nlri))
        verdict, receiver = receiver.receive(value, nlri, NOW_MS)
        if best is None or (epoch, sequence) > best:
            assert verdict.reason is Reason.OK
            best = (epoch, sequence)
        elif (epoch, sequence) == best:
            assert verdict.reason is Reason.DUPLICATE
        else:
            assert verdict.reason is Reason.REPLAYED
    assert receiver.window.get(next(iter(receiver.window))[0]).position == best

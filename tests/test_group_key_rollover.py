"""A group-key rollover that one receiver missed: an origin seals under the next key id
before that receiver holds it.

The receiver holds group keys, but not the one named: it accepts the advertisement with
the section unopened, as a receiver without group keys does, names the key id in the
verdict and counts it; the selector keeps the instance (its metrics) and drops what the
origin claimed of its cache. Once the receiver gets the key (as standby) it opens the
section again. A key that is held but does not authenticate the section is still refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from catsproto import security, wire
from catsproto.security import GroupKey, GroupKeyring, Reason, Receiver
from catsproto.security.vectors import NLRI, NOW_MS, fixture, seed
from catsproto.selector import RIB, Link, Network, PathSelector, Request
from tests.selector_fixtures import BLOCK, advert, entry

F = fixture()  # the receiver's ring: group key 7 only
NEXT = GroupKeyring(GroupKey.of(8, seed("group-8")))  # the origins' ring after rotation
KEYS = np.arange(9000, 9012, dtype=np.uint64)
ORIGIN = "192.0.2.11"  # inside the fixture's delegation


def _signed(adv: wire.Advertisement) -> bytes:
    return wire.encode(security.sign(adv, F.node, NLRI))


def _advert(seq: int, backlog: float, keys: np.ndarray | None = None) -> wire.Advertisement:
    entries = [] if keys is None else [entry(keys, version=seq)]
    return advert(ORIGIN, 1, entries, seq=seq, ts=NOW_MS - 1000, backlog=backlog, cs_id=100)


def _decide(rib: RIB):
    net = Network([Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000)])
    return PathSelector(rib, net).decide(Request(100, KEYS, 12 * BLOCK, "ingress"), now_ms=NOW_MS)


def test_a_section_under_a_key_not_held_is_accepted_unopened_and_counted():
    value = _signed(security.seal(F.at(1, 43), NEXT, bytes(12)))
    verdict, receiver = Receiver(F.trust, group_keys=F.group).receive(value, NLRI, NOW_MS)
    assert verdict.reason is Reason.OK and verdict.error is None
    assert verdict.unheld_group_key == 8 and verdict.unknown_algorithm is None
    assert verdict.detail == "accepted; sealed cache section not opened: group key 8 is not held"
    assert verdict.to_json()["unheld_group_key"] == 8
    adv = verdict.advertisement
    assert adv.get(wire.SealedCache).key_id == 8 and adv.cache_summaries is None
    assert adv.metrics_l2 == F.at(1, 43).metrics_l2
    assert receiver.counters[Reason.OK] == 1 and receiver.counters.refused == 0
    assert receiver.counters.unheld_group_key == 1 and receiver.counters.unknown_algorithm == 0
    assert receiver.window.get(verdict.route).position == (1, 43)  # the window moves on
    again, receiver = receiver.receive(value, NLRI, NOW_MS + 10)  # BGP re-sends it
    assert again.reason is Reason.DUPLICATE and again.unheld_group_key == 8
    assert receiver.counters.unheld_group_key == 2


def test_a_held_key_that_does_not_authenticate_is_still_refused():
    """Key id 7 named and held, but the section was sealed with another secret: damage or
    a signer without the group key, not a rollover."""
    forged = GroupKeyring(GroupKey.of(7, seed("not-the-group-secret")))
    value = _signed(security.seal(F.at(1, 43), forged, bytes(12)))
    before = Receiver(F.trust, group_keys=F.group)
    verdict, after = before.receive(value, NLRI, NOW_MS)
    assert verdict.reason is Reason.DECRYPTION_FAILED and verdict.advertisement is None
    assert after.window is before.window and after.counters.unheld_group_key == 0


def test_the_rib_keeps_the_instance_through_the_rollover_and_its_cache_after_it():
    receiver = Receiver(F.trust, group_keys=F.group)
    rib = RIB()
    # before the rotation: sealed under key 7, opened, the claim used
    v1, receiver = receiver.receive(
        _signed(security.seal(_advert(1, 0.0, KEYS), F.group, bytes(12))), NLRI, NOW_MS
    )
    assert v1.ok and v1.unheld_group_key is None
    rib.accept(v1.advertisement, NOW_MS)
    assert _decide(rib).chosen.cached_blocks == 12
    # the origin moved to key 8, this receiver has not got it: metrics in, claims out
    v2, receiver = receiver.receive(
        _signed(security.seal(_advert(2, 4000.0, KEYS), NEXT, bytes(12))), NLRI, NOW_MS
    )
    assert v2.ok and v2.unheld_group_key == 8
    result = rib.accept(v2.advertisement, NOW_MS)
    assert result.metrics_updated and result.instance.backlog_tokens == 4000.0
    assert result.instance.tiers == {}
    chosen = _decide(rib).chosen
    assert str(chosen.address) == ORIGIN and chosen.cached_blocks == 0
    # the key arrives (standby beside 7): the next advertisement opens, the claim is back
    receiver = dataclasses.replace(receiver, group_keys=F.group.with_standby(NEXT.active))
    v3, receiver = receiver.receive(
        _signed(security.seal(_advert(3, 0.0, KEYS), NEXT, bytes(12))), NLRI, NOW_MS
    )
    assert v3.ok and v3.unheld_group_key is None and v3.detail == "accepted"
    rib.accept(v3.advertisement, NOW_MS)
    assert _decide(rib).chosen.cached_blocks == 12
    assert receiver.counters[Reason.OK] == 3 and receiver.counters.unheld_group_key == 1

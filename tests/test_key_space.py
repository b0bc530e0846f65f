"""Block keys are only comparable within one key space (model, key scheme, keying secret):
a request that names its key space is matched only against instances advertising it, so
a fleet half-way through a secret rotation is not credited with the other half's cache."""

from __future__ import annotations

import numpy as np

from catsproto import wire
from catsproto.selector import RIB, Link, Network, PathSelector, Request
from tests.selector_fixtures import BLOCK, advert, entry

KEYS = np.arange(5000, 5012, dtype=np.uint64)
TOKENS = 12 * BLOCK
SCHEME = int(wire.KeyScheme.BLAKE2B64_CHAINED)


def _net() -> Network:
    return Network(
        [
            Link("ingress", "site1", delay_ms=5, bandwidth_mbps=10_000),
            Link("ingress", "site2", delay_ms=20, bandwidth_mbps=10_000),
        ]
    )


def _rib(near_secret: int, far_secret: int) -> RIB:
    """The same cached prompt at both sites: the near one under `near_secret`."""
    rib = RIB()
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS)], secret_id=near_secret), now_ms=1000)
    rib.accept(advert("10.0.2.1", 2, [entry(KEYS)], secret_id=far_secret), now_ms=1000)
    return rib


def _decide(rib: RIB, space: tuple[str, int, int] | None):
    return PathSelector(rib, _net()).decide(
        Request(7, KEYS, TOKENS, "ingress", key_space=space), now_ms=1000
    )


def test_only_instances_of_the_requests_key_space_count_as_holders():
    rib = _rib(near_secret=1, far_secret=2)
    # without a key space both hold the prompt and the nearer wins
    d = _decide(rib, None)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.cached_blocks == 12
    # keys of secret 2: the near instance's summaries are of secret 1 and hold none
    d = _decide(rib, ("test-model", SCHEME, 2))
    assert str(d.chosen.address) == "10.0.2.1" and d.chosen.cached_blocks == 12
    assert d.runner_up.cached_blocks == 0
    # another model, or an unknown scheme: nobody holds anything, the nearest wins
    for space in (("other-model", SCHEME, 1), ("test-model", 9, 1)):
        d = _decide(rib, space)
        assert str(d.chosen.address) == "10.0.1.1" and d.chosen.cached_blocks == 0


def test_an_instance_that_moves_to_the_new_secret_counts_again():
    rib = _rib(near_secret=1, far_secret=2)
    space = ("test-model", SCHEME, 2)
    assert str(_decide(rib, space).chosen.address) == "10.0.2.1"
    rib.accept(advert("10.0.1.1", 1, [entry(KEYS, version=2)], seq=2, secret_id=2), now_ms=1001)
    d = _decide(rib, space)
    assert str(d.chosen.address) == "10.0.1.1" and d.chosen.cached_blocks == 12


def test_an_unknown_key_scheme_keeps_the_metrics_and_drops_the_cache():
    """Keys derived by a scheme this receiver does not know mean nothing here: the
    route's load is used, its summaries are refused, and what the origin claimed before
    goes with them."""
    rib = _rib(near_secret=1, far_secret=1)
    adv = advert("10.0.1.1", 1, [entry(KEYS, version=2)], seq=2, backlog=5000.0, key_scheme=9)
    adv = wire.decode(wire.encode(adv))  # as a receiver gets it: the scheme kept as an int
    result = rib.accept(adv, now_ms=1001)
    assert result.metrics_updated
    assert [o[2] for o in result.outcomes] == ["rejected: unknown key scheme 9"]
    inst = result.instance
    assert inst.tiers == {} and inst.backlog_tokens == 5000.0
    assert rib.rejected_total == 1
    d = _decide(rib, None)
    assert str(d.chosen.address) == "10.0.2.1" and d.chosen.cached_blocks == 12
    near = d.runner_up
    assert str(near.address) == "10.0.1.1" and near.cached_blocks == 0 and near.queue_ms > 0


def _without_model(adv: wire.Advertisement) -> wire.Advertisement:
    """The same advertisement with its Cache Model TLV left out (summaries alone)."""
    kept = tuple(t for t in adv.tlvs if not isinstance(t, wire.CacheModel))
    return wire.decode(wire.encode(wire.Advertisement(kept)))


def test_summaries_without_a_cache_model_are_read_under_the_last_one_announced():
    """An origin that moves to an unknown key scheme and then sends summaries without a
    Cache Model: they are in the unknown scheme, so they are refused, not read under the
    scheme it announced before."""
    rib = _rib(near_secret=1, far_secret=1)
    moved = advert("10.0.1.1", 1, [], seq=2, key_scheme=200)
    rib.accept(wire.decode(wire.encode(moved)), now_ms=1001)
    later = _without_model(advert("10.0.1.1", 1, [entry(KEYS, version=2)], seq=3))
    result = rib.accept(later, now_ms=1002)
    assert [o[2] for o in result.outcomes] == ["rejected: unknown key scheme 200"]
    assert result.instance.key_scheme == 200 and result.instance.tiers == {}
    d = _decide(rib, None)
    assert str(d.chosen.address) == "10.0.2.1" and d.runner_up.cached_blocks == 0


def test_summaries_without_a_cache_model_under_a_known_scheme_are_used():
    rib = _rib(near_secret=1, far_secret=1)
    later = _without_model(advert("10.0.1.1", 1, [entry(KEYS[:6], version=2)], seq=2))
    result = rib.accept(later, now_ms=1001)
    assert len(result.outcomes) == 1 and rib.rejected_total == 0
    d = _decide(rib, None)
    near = d.chosen if str(d.chosen.address) == "10.0.1.1" else d.runner_up
    assert str(near.address) == "10.0.1.1" and near.cached_blocks == 6

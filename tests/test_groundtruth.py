"""Ground truth (catsproto.selector.groundtruth): hand-worked cases and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catsproto.selector.groundtruth import (
    Claim,
    GroundTruthError,
    GroundTruthLedger,
    judge,
)

BS = 32
KEYS = list(range(1001, 1101))  # a prompt's block keys, block 0 first
SEQ = (7, 10)  # the origin's advertisement the decision used


# ---- judge: one request, worked by hand ------------------------------------------------


@pytest.mark.parametrize(
    "expected, cached, n, confirmable, confirmed, unexpected",
    [
        # 64 tokens: 2 full blocks, but the last token is always computed: at most 1
        (2, 32, 64, 1, 1, 0),
        # 65 tokens: (65 - 1) // 32 = 2 blocks servable, both cached
        (2, 64, 65, 2, 2, 0),
        # expected 3 on a 100-token prompt: 3 servable ((100-1)//32), engine cached 2
        (3, 64, 100, 3, 2, 0),
        # nothing expected, engine had 2 blocks: 2 unexpected, nothing confirmable
        (0, 64, 100, 0, 0, 2),
        # expected 1, cached 3: 1 confirmed, 2 unexpected
        (1, 96, 100, 1, 1, 2),
        # a 1-token prompt can never be served from cache
        (5, 0, 1, 0, 0, 0),
        # an empty prompt
        (0, 0, 0, 0, 0, 0),
        # a claim beyond the prompt is capped by what the prompt has
        (40, 96, 129, 4, 3, 0),
    ],
)
def test_judge_by_hand(expected, cached, n, confirmable, confirmed, unexpected):
    v = judge(expected, cached, n, BS)
    assert (v.confirmable, v.confirmed, v.unexpected) == (confirmable, confirmed, unexpected)
    assert v.missed == confirmable - confirmed


@pytest.mark.parametrize(
    "args, field",
    [
        ((-1, 0, 10, BS), "expected"),
        ((0, -32, 10, BS), "cached_tokens"),
        ((0, 0, True, BS), "prompt_tokens"),
        ((0, 64, 10, BS), "exceeds"),
        ((0, 0, 10, 0), "block_size"),
    ],
)
def test_judge_refuses_reports_that_cannot_be_true(args, field):
    with pytest.raises(GroundTruthError, match=field):
        judge(*args)


@given(
    st.integers(0, 200),
    st.integers(0, 5000),
    st.integers(0, 5000),
    st.sampled_from([1, 16, 32, 512]),
)
def test_judge_properties(expected, cached, n, bs):
    cached = min(cached, n)
    v = judge(expected, cached, n, bs)
    assert 0 <= v.confirmed <= v.confirmable <= expected
    assert v.confirmable <= max(0, (n - 1) // bs)
    assert v.cached_blocks == cached // bs
    # a cached block is counted at most once: confirmed, or unexpected
    assert v.confirmed + v.unexpected <= v.cached_blocks
    assert v.unexpected == max(0, cached // bs - expected)
    if cached // bs >= min(expected, max(0, (n - 1) // bs)):
        assert v.missed == 0


# ---- the ledger ------------------------------------------------------------------------


def _record(ledger, expected, cached, n, *, origin="10.0.0.1", at=0, seq=SEQ):
    return ledger.record(
        origin, 100, expected, cached, n, BS, now_ms=at, sequence=seq, block_keys=KEYS
    )


def test_full_agreement_counts_blocks_not_requests():
    ledger = GroundTruthLedger()
    _record(ledger, 3, 96, 100)  # 3 of 3
    _record(ledger, 1, 32, 40)  # 1 of 1
    _record(ledger, 0, 0, 40)  # nothing confirmable
    t = ledger.total
    assert (t.requests, t.confirmable_blocks, t.confirmed_blocks) == (3, 4, 4)
    assert t.agreement == 1.0 and not ledger.pending
    assert ledger.to_json()["origins"]["10.0.0.1"]["agreement"] == 1.0


def test_a_miss_waits_then_a_newer_advertisement_without_the_block_makes_it_stale():
    ledger = GroundTruthLedger(grace_ms=5000, refreshes=2)
    v = _record(ledger, 3, 32, 100, at=1000)  # claimed 3, engine served 1: blocks 1, 2 missed
    assert v.missed == 2
    assert ledger.total.agreement == pytest.approx(1 / 3)
    (miss,) = ledger.pending
    assert miss.first_missed_key == KEYS[1] and miss.blocks == 2
    assert ledger.total.pending_requests == 1 and ledger.total.pending_blocks == 2
    # same advertisement, still claimed, within the grace: stays pending
    assert ledger.resolve(2000, lambda m: Claim(SEQ, True)) == 0
    # the next advertisement no longer claims block 1: the origin evicted it
    assert ledger.resolve(2100, lambda m: Claim((7, 11), False)) == 1
    t = ledger.total
    assert (t.stale_requests, t.stale_blocks, t.false_positive_requests) == (1, 2, 0)
    assert (t.pending_requests, t.pending_blocks) == (0, 0)


def test_a_claim_that_survives_the_grace_is_a_false_positive():
    ledger = GroundTruthLedger(grace_ms=5000, refreshes=2)
    _record(ledger, 2, 0, 100, at=1000)
    assert ledger.resolve(5999, lambda m: Claim((7, 11), True)) == 0  # 1 refresh, 4.999 s
    assert ledger.resolve(6000, lambda m: Claim((7, 11), True)) == 1  # 5 s
    assert ledger.total.false_positive_requests == 1
    assert ledger.total.false_positive_blocks == 2


def test_two_refreshes_still_claiming_settle_before_the_grace():
    ledger = GroundTruthLedger(grace_ms=5000, refreshes=2)
    _record(ledger, 2, 0, 100, at=1000)
    assert ledger.resolve(1500, lambda m: Claim((7, 12), True)) == 1
    assert ledger.total.false_positive_requests == 1


@pytest.mark.parametrize("claim", [None, Claim((8, 1), True)], ids=["withdrawn", "new-epoch"])
def test_withdrawn_or_restarted_origins_make_their_misses_stale(claim):
    ledger = GroundTruthLedger()
    _record(ledger, 2, 0, 100)
    assert ledger.resolve(1, lambda m: claim) == 1
    assert ledger.total.stale_requests == 1 and ledger.total.stale_blocks == 2


def test_unexpected_hits_are_counted_apart():
    ledger = GroundTruthLedger()
    _record(ledger, 1, 96, 100)
    t = ledger.total
    assert (t.unexpected_requests, t.unexpected_blocks, t.confirmed_blocks) == (1, 2, 1)
    assert t.agreement == 1.0 and not ledger.pending


def test_per_origin_and_total_counters_and_each_miss_resolved_on_its_own_origin():
    ledger = GroundTruthLedger()
    _record(ledger, 2, 64, 100, origin="a")
    _record(ledger, 2, 0, 100, origin="b")
    _record(ledger, 3, 32, 100, origin="c")

    def claim(m):
        return None if m.origin == "b" else Claim(SEQ, True)

    assert ledger.resolve(10, claim) == 1
    out = ledger.to_json()
    assert out["origins"]["a"]["agreement"] == 1.0
    assert out["origins"]["b"]["stale_requests"] == 1
    assert out["origins"]["c"]["pending_blocks"] == 2
    assert out["total"]["confirmable_blocks"] == 7 and out["total"]["confirmed_blocks"] == 3
    assert out["total"]["agreement"] == round(3 / 7, 6)
    assert [m.origin for m in ledger.pending] == ["c"]


def test_a_bad_report_changes_nothing_but_its_counter():
    ledger = GroundTruthLedger()
    with pytest.raises(GroundTruthError):
        _record(ledger, 2, 200, 100)
    assert ledger.bad_reports == 1 and ledger.total.requests == 0 and not ledger.origins


def test_pending_misses_beyond_the_bound_expire_oldest_first():
    ledger = GroundTruthLedger(max_pending=2)
    for at in range(3):
        _record(ledger, 1, 0, 100, at=at)
    assert [m.at_ms for m in ledger.pending] == [1, 2]
    assert ledger.total.expired_requests == 1 and ledger.total.pending_requests == 2


@pytest.mark.parametrize(
    "kwargs", [{"grace_ms": -1}, {"refreshes": 0}, {"max_pending": 0}, {"grace_ms": 1.5}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        GroundTruthLedger(**kwargs)

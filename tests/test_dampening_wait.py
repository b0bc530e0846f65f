"""The node re-advertises when its queue wait departs from what selectors predict."""

from __future__ import annotations

from catsproto.node import DampeningPolicy
from catsproto.node.dampening import Dampener, Reason


def test_wait_error_triggers_an_early_update_and_respects_the_minimum_interval():
    d = Dampener(
        DampeningPolicy(min_interval_ms=1000, max_interval_ms=30_000, wait_threshold_ms=100)
    )
    assert d.decide(0, 0, 100, 0).reason is Reason.INITIAL
    d.sent(0)
    # the wait is what receivers predicted: nothing to say
    assert d.decide(2000, 0, 100, 0, wait_error_ms=0.0).reason is Reason.IDLE
    assert d.decide(2000, 0, 100, 0, wait_error_ms=99.0).reason is Reason.BELOW_THRESHOLD
    assert d.decide(500, 0, 100, 0, wait_error_ms=4000.0).reason is Reason.SUPPRESSED
    assert d.decide(2000, 0, 100, 0, wait_error_ms=-250.0).reason is Reason.CHANGE

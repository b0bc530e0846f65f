"""Update dampening: when a changed cache state is worth a new advertisement.

Strategy. The CATS framework asks metric distribution to bound its own rate. Three knobs,
all in simulated milliseconds passed in by the caller:

* ``min_interval_ms`` — never two advertisements closer than this. It is a hard bound:
  an eviction storm of any rate yields at most one update per interval.
* ``max_interval_ms`` — refresh at least this often even when nothing changed, so a
  receiver's freshness check (timestamp) keeps passing and a lost update heals.
* ``change_threshold`` — between the two, an update goes out early only when the change
  is large enough: the net keys added or removed since the last advertisement, as a
  fraction of the keys it advertised (at least ``min_changed_keys``), an L1/L2 score
  moved by ``score_threshold`` points or more, or the queue wait off by
  ``wait_threshold_ms`` or more from what receivers predict (the advertised wait,
  drained at the prefill rate since: the selector's own model). Smaller changes wait
  for the refresh. Scores saturate (a 1 s and a 5 s queue both score 0); the wait
  trigger is what keeps selectors from piling onto an instance that looks idle.

`Dampener.decide` returns a `Decision` with the reason, which also says when a wanted
update was held back by the minimum interval (counted as suppressed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Dampener", "DampeningPolicy", "Decision", "Reason"]


@dataclass(frozen=True, slots=True)
class DampeningPolicy:
    min_interval_ms: int = 1_000
    max_interval_ms: int = 30_000
    change_threshold: float = 0.05
    min_changed_keys: int = 1
    score_threshold: int = 1
    wait_threshold_ms: float = 100.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_interval_ms <= self.max_interval_ms:
            raise ValueError(
                f"need 0 <= min_interval_ms ({self.min_interval_ms}) "
                f"<= max_interval_ms ({self.max_interval_ms})"
            )
        if self.max_interval_ms <= 0:
            raise ValueError("max_interval_ms must be > 0")
        if self.change_threshold < 0 or self.min_changed_keys < 1 or self.score_threshold < 1:
            raise ValueError("thresholds must be non-negative (counts >= 1)")
        if not self.wait_threshold_ms > 0:  # NaN too
            raise ValueError(f"wait_threshold_ms ({self.wait_threshold_ms}) must be > 0")


class Reason(enum.Enum):
    INITIAL = "initial"
    REFRESH = "refresh"
    CHANGE = "change"
    FORCED = "forced"
    SUPPRESSED = "suppressed by min interval"
    BELOW_THRESHOLD = "change below threshold"
    IDLE = "nothing changed"

    @property
    def sends(self) -> bool:
        return self in (Reason.INITIAL, Reason.REFRESH, Reason.CHANGE, Reason.FORCED)


@dataclass(frozen=True, slots=True)
class Decision:
    reason: Reason
    changed_keys: int
    score_delta: int

    @property
    def send(self) -> bool:
        return self.reason.sends


class Dampener:
    """Remembers when the last advertisement left and decides about the next."""

    def __init__(self, policy: DampeningPolicy) -> None:
        self.policy = policy
        self.last_sent_ms: int | None = None

    def wanted(
        self, changed_keys: int, advertised_keys: int, score_delta: int, wait_error_ms: float = 0.0
    ) -> bool:
        """Is this change large enough for an early update?"""
        p = self.policy
        if abs(score_delta) >= p.score_threshold or abs(wait_error_ms) >= p.wait_threshold_ms:
            return True
        if changed_keys < p.min_changed_keys:
            return False
        return changed_keys >= p.change_threshold * max(1, advertised_keys)

    def decide(
        self,
        now_ms: int,
        changed_keys: int,
        advertised_keys: int,
        score_delta: int,
        *,
        wait_error_ms: float = 0.0,
        force: bool = False,
    ) -> Decision:
        p = self.policy
        last = self.last_sent_ms
        if last is None:
            reason = Reason.INITIAL
        elif force:
            reason = Reason.FORCED
        elif now_ms - last >= p.max_interval_ms:
            reason = Reason.REFRESH
        elif not changed_keys and not score_delta and not wait_error_ms:
            reason = Reason.IDLE
        elif not self.wanted(changed_keys, advertised_keys, score_delta, wait_error_ms):
            reason = Reason.BELOW_THRESHOLD
        elif now_ms - last < p.min_interval_ms:
            reason = Reason.SUPPRESSED
        else:
            reason = Reason.CHANGE
        return Decision(reason, changed_keys, score_delta)

    def sent(self, now_ms: int) -> None:
        self.last_sent_ms = now_ms

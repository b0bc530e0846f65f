"""Ground truth: what the selector expected an engine to have cached, against what the
engine says it served from its cache.

Strategy. Each request the ingress steers carries the selector's claim: the chosen origin
holds the prompt's first ``expected`` blocks. The engine's answer reports
``cached_tokens`` (vLLM's ``usage.prompt_tokens_details.cached_tokens``). Two vLLM facts
bound what an answer can confirm: it caches only full blocks, and it always computes the
prompt's last token, so a prompt of ``n`` tokens is served at most ``(n - 1) // bs``
blocks from cache. Hence, per request:

    confirmable = min(expected, (n - 1) // bs)
    confirmed   = min(cached_tokens // bs, confirmable)
    missed      = confirmable - confirmed           (blocks the claim promised in vain)
    unexpected  = max(0, cached_tokens // bs - expected)   (hits nobody advertised)

Agreement is counted in blocks, sum(confirmed) / sum(confirmable).

A miss is not yet a verdict on the origin: it waits (``pending``) for the RIB to say
more, and `GroundTruthLedger.resolve` settles it with what the caller reads from the RIB
about that origin (a `Claim`):

* ``stale``: the origin held the blocks when it advertised and evicted them since. It
  said so: its routes are gone (withdrawn, or a new epoch: a restart loses the cache), or
  its summaries no longer claim the first missed block (a newer advertisement dropped
  it, or the shard route that carried it was withdrawn).
* ``false_positive``: its summary still claims the block after the grace period
  (``grace_ms`` since the miss, or ``refreshes`` newer advertisements, whichever comes
  first). This counts summary false positives and origins that claim what they do not
  hold; it also counts an eviction the origin never advertised before the missed
  request itself stored the block again (the engine recomputes a missed prefix and
  caches it, so the origin's next summary claims it again, rightly). The ingress cannot
  tell those two apart; the engine's own events could.

Nothing here reads a clock or a socket: time comes in as ``now_ms`` and the RIB's view
of an origin through the ``claim`` callable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Claim",
    "GroundTruthError",
    "GroundTruthLedger",
    "OriginCounts",
    "PendingMiss",
    "Verdict",
    "judge",
]

DEFAULT_GRACE_MS = 5_000
DEFAULT_REFRESHES = 2
DEFAULT_MAX_PENDING = 65_536  # misses waiting at once; the oldest expire beyond it


class GroundTruthError(ValueError):
    """An engine report that cannot be true (negative, or more cached than prompted)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request's comparison, in blocks."""

    confirmable: int
    confirmed: int
    cached_blocks: int  # what the engine reports, cached_tokens // block_size
    unexpected: int

    @property
    def missed(self) -> int:
        return self.confirmable - self.confirmed


def judge(expected: int, cached_tokens: int, prompt_tokens: int, block_size: int) -> Verdict:
    """Compare one request's expectation with the engine's report (module docstring)."""
    for name, value in (
        ("expected", expected),
        ("cached_tokens", cached_tokens),
        ("prompt_tokens", prompt_tokens),
    ):
        if type(value) is not int or value < 0:
            raise GroundTruthError(f"{name} must be a count, got {value!r}")
    if type(block_size) is not int or block_size < 1:
        raise GroundTruthError(f"block_size must be a positive integer, got {block_size!r}")
    if cached_tokens > prompt_tokens:
        raise GroundTruthError(
            f"cached_tokens {cached_tokens} exceeds the prompt's {prompt_tokens} tokens"
        )
    servable = max(0, (prompt_tokens - 1) // block_size)
    cached = cached_tokens // block_size
    confirmable = min(expected, servable)
    confirmed = min(cached, confirmable)
    return Verdict(confirmable, confirmed, cached, max(0, cached - expected))


@dataclass(frozen=True, slots=True)
class Claim:
    """What the RIB says now about a missed block's origin: its current advertisement's
    (epoch, sequence), and whether that still claims the first missed block. None in its
    place (from the ``claim`` callable) means the origin's routes are withdrawn."""

    sequence: tuple[int, int]
    claimed: bool


@dataclass(frozen=True, slots=True)
class PendingMiss:
    """A miss waiting for the RIB: who, which block, how many, when, under which
    advertisement the decision was taken."""

    origin: str
    cs_id: int
    first_missed_key: int
    blocks: int
    at_ms: int
    sequence: tuple[int, int]


@dataclass(slots=True)
class OriginCounts:
    """One origin's (or the total's) counters."""

    requests: int = 0
    confirmable_blocks: int = 0
    confirmed_blocks: int = 0
    cached_blocks: int = 0
    missed_requests: int = 0
    missed_blocks: int = 0
    stale_requests: int = 0
    stale_blocks: int = 0
    false_positive_requests: int = 0
    false_positive_blocks: int = 0
    expired_requests: int = 0  # pending misses dropped unresolved (max_pending)
    unexpected_requests: int = 0
    unexpected_blocks: int = 0
    pending_requests: int = 0
    pending_blocks: int = 0

    @property
    def agreement(self) -> float:
        """Confirmed over confirmable blocks (1.0 when nothing was confirmable)."""
        if not self.confirmable_blocks:
            return 1.0
        return self.confirmed_blocks / self.confirmable_blocks

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: getattr(self, name) for name in OriginCounts.__dataclass_fields__
        }
        out["agreement"] = round(self.agreement, 6)
        return out


@dataclass
class GroundTruthLedger:
    """Per-origin and total ground-truth counters, and the misses still pending."""

    grace_ms: int = DEFAULT_GRACE_MS
    refreshes: int = DEFAULT_REFRESHES
    max_pending: int = DEFAULT_MAX_PENDING
    total: OriginCounts = field(default_factory=OriginCounts)
    origins: dict[str, OriginCounts] = field(default_factory=dict)
    pending: deque[PendingMiss] = field(default_factory=deque)
    bad_reports: int = 0  # engine reports `judge` refused

    def __post_init__(self) -> None:
        if type(self.grace_ms) is not int or self.grace_ms < 0:
            raise ValueError(f"grace_ms must be a count of milliseconds, got {self.grace_ms!r}")
        if type(self.refreshes) is not int or self.refreshes < 1:
            raise ValueError(f"refreshes must be at least 1, got {self.refreshes!r}")
        if type(self.max_pending) is not int or self.max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {self.max_pending!r}")

    def _both(self, origin: str) -> tuple[OriginCounts, OriginCounts]:
        counts = self.origins.get(origin)
        if counts is None:
            counts = self.origins[origin] = OriginCounts()
        return self.total, counts

    def record(
        self,
        origin: str,
        cs_id: int,
        expected: int,
        cached_tokens: int,
        prompt_tokens: int,
        block_size: int,
        *,
        now_ms: int,
        sequence: tuple[int, int],
        block_keys: list[int] | tuple[int, ...],
    ) -> Verdict:
        """Count one proxied request; a miss goes pending under the first missed block's
        key (``block_keys`` are the prompt's, from block 0). A report `judge` refuses is
        counted in `bad_reports` and raises, changing no other counter."""
        try:
            verdict = judge(expected, cached_tokens, prompt_tokens, block_size)
        except GroundTruthError:
            self.bad_reports += 1
            raise
        if verdict.missed and verdict.confirmed >= len(block_keys):
            self.bad_reports += 1
            raise GroundTruthError(
                f"block {verdict.confirmed} missed, but only {len(block_keys)} keys given"
            )
        for c in self._both(origin):
            c.requests += 1
            c.confirmable_blocks += verdict.confirmable
            c.confirmed_blocks += verdict.confirmed
            c.cached_blocks += verdict.cached_blocks
            if verdict.unexpected:
                c.unexpected_requests += 1
                c.unexpected_blocks += verdict.unexpected
            if verdict.missed:
                c.missed_requests += 1
                c.missed_blocks += verdict.missed
                c.pending_requests += 1
                c.pending_blocks += verdict.missed
        if verdict.missed:
            self.pending.append(
                PendingMiss(
                    origin,
                    cs_id,
                    int(block_keys[verdict.confirmed]),
                    verdict.missed,
                    now_ms,
                    sequence,
                )
            )
            while len(self.pending) > self.max_pending:
                self._settle(self.pending.popleft(), "expired")
        return verdict

    def resolve(self, now_ms: int, claim: Callable[[PendingMiss], Claim | None]) -> int:
        """Settle the pending misses the RIB now explains (module docstring); the number
        settled. `claim` tells the origin's current state for one miss."""
        settled = 0
        keep: deque[PendingMiss] = deque()
        for miss in self.pending:
            outcome = self._outcome(miss, claim(miss), now_ms)
            if outcome is None:
                keep.append(miss)
            else:
                self._settle(miss, outcome)
                settled += 1
        self.pending = keep
        return settled

    def _outcome(self, miss: PendingMiss, now: Claim | None, now_ms: int) -> str | None:
        if now is None:
            return "stale"  # withdrawn: whatever it held is no longer claimed
        epoch, seq = now.sequence
        if epoch != miss.sequence[0]:
            return "stale"  # restarted: its cache went with the old epoch
        if not now.claimed:
            return "stale"  # a newer advertisement, or a withdrawn shard, dropped it
        if now_ms - miss.at_ms >= self.grace_ms or seq - miss.sequence[1] >= self.refreshes:
            return "false_positive"
        return None

    def _settle(self, miss: PendingMiss, outcome: str) -> None:
        for c in self._both(miss.origin):
            c.pending_requests -= 1
            c.pending_blocks -= miss.blocks
            if outcome == "stale":
                c.stale_requests += 1
                c.stale_blocks += miss.blocks
            elif outcome == "false_positive":
                c.false_positive_requests += 1
                c.false_positive_blocks += miss.blocks
            else:
                c.expired_requests += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total.to_json(),
            "origins": {o: c.to_json() for o, c in sorted(self.origins.items())},
            "bad_reports": self.bad_reports,
            "grace_ms": self.grace_ms,
            "refreshes": self.refreshes,
        }

"""Consistency bookkeeping that needs no IO: stale hits and what to recompute.

A selector steers a request to an instance expecting `expected` cached blocks (from the
advertisement it used); when the request arrives the instance (or, for "compute here,
pull from there", the holder) finds `found` blocks. `found < expected` is a *stale hit*:
the advertisement promised blocks that were evicted in between. The instance then
recomputes from block `found` on — it never waits for blocks that are gone. The ledger
counts both, so a run can report the stale-hit rate per update interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from catsproto.transfer.puller import Completed


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one steered request got: blocks reused and the first one recomputed."""

    expected: int
    found: int
    requested: int

    @property
    def stale(self) -> bool:
        return self.found < self.expected

    @property
    def recompute_from(self) -> int:
        return self.found

    @classmethod
    def of_transfer(cls, expected: int, completed: Completed) -> Outcome:
        return cls(expected, len(completed.blocks), completed.requested)


@dataclass(slots=True)
class StaleHitLedger:
    requests: int = 0
    expected_hits: int = 0  # requests steered expecting at least one cached block
    stale_hits: int = 0
    stale_blocks: int = 0  # blocks promised but gone
    recomputed_blocks: int = 0
    by_source: dict[str, int] = field(default_factory=dict)

    def record(self, outcome: Outcome, source: str = "local") -> Outcome:
        self.requests += 1
        if outcome.expected > 0:
            self.expected_hits += 1
        if outcome.stale:
            self.stale_hits += 1
            self.stale_blocks += outcome.expected - outcome.found
            self.by_source[source] = self.by_source.get(source, 0) + 1
        self.recomputed_blocks += outcome.requested - outcome.found
        return outcome

    @property
    def stale_hit_rate(self) -> float:
        """Stale hits per request steered expecting a hit."""
        return self.stale_hits / self.expected_hits if self.expected_hits else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "expected_hits": self.expected_hits,
            "stale_hits": self.stale_hits,
            "stale_hit_rate": round(self.stale_hit_rate, 6),
            "stale_blocks": self.stale_blocks,
            "recomputed_blocks": self.recomputed_blocks,
            "by_source": dict(sorted(self.by_source.items())),
        }

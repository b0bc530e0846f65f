"""Pacing a sender to a bandwidth budget: a token bucket driven by the caller's clock.

`TokenBucket(rate, burst)` holds at most `burst` bytes of credit and gains `rate`
bytes per second of `now` (seconds, any origin, never going backwards). A sender asks
`available(now)` before writing and `take(n, now)` after; `ready_at(n, now)` says when
`n` bytes will be affordable, so an adapter sleeps exactly that long (or a simulation
advances its clock to it). Rate 0 means unpaced. Pure: `now` is always a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    rate: float  # bytes per second; 0: unlimited
    burst: float  # bytes of credit at most (>= the largest single write)
    _credit: float = field(init=False)
    _last: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst <= 0:
            raise ValueError(f"rate must be >= 0 and burst > 0, got {self.rate}, {self.burst}")
        self._credit = self.burst

    @classmethod
    def for_rate(cls, rate: float, chunk: int) -> TokenBucket:
        """A bucket for `rate` bytes/s whose burst is two chunks or 2 ms of traffic."""
        return cls(rate, max(2.0 * chunk, rate * 0.002))

    def _refill(self, now: float) -> None:
        if self._last is None or now < self._last:
            self._last = now
            return
        self._credit = min(self.burst, self._credit + (now - self._last) * self.rate)
        self._last = now

    def available(self, now: float) -> float:
        if self.rate == 0:
            return float("inf")
        self._refill(now)
        return self._credit

    def take(self, n: int, now: float) -> None:
        if self.rate == 0:
            return
        self._refill(now)
        self._credit -= n  # may go negative by one write: paid back before the next

    def ready_at(self, n: int, now: float) -> float:
        """The earliest time at which `n` bytes (capped at the burst) are affordable."""
        if self.rate == 0:
            return now
        self._refill(now)
        need = min(n, self.burst) - self._credit
        return now if need <= 0 else now + need / self.rate

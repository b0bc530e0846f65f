"""Stopping a long-running command on SIGINT or SIGTERM without a deadlock.

Python runs a signal handler in the main thread between bytecodes, also while that
thread is inside a lock. A handler that sets a `threading.Event` the main thread waits on
needs the Event's own lock, which the interrupted `wait` may be holding: the process then
hangs for ever (seen once: `instance serve` stopped right after its ready line, its main
thread blocked in the handler's `Event.set`). So the handler here only sets a flag, and
waiting is a loop of short sleeps that looks at the flag after each: Python resumes a
sleep after a handler returns (PEP 475), so a stop is noticed within one tick.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable

TICK_S = 0.1  # the longest a stop waits to be noticed


class StopSignal:
    """Installed at once for `signals`; `wait()` returns when one has arrived."""

    def __init__(
        self, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM), tick: float = TICK_S
    ) -> None:
        if not tick > 0:
            raise ValueError(f"tick must be positive seconds, not {tick!r}")
        self.requested = False
        self.tick = tick
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.requested = True  # no lock, no allocation worth the name: safe anywhere

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop was requested; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.requested:
            left = self.tick if deadline is None else min(self.tick, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True

"""Waiting in tests for the state a test needs, with a deadline, instead of sleeping.

A lab test runs on a machine other jobs share: a fixed sleep is too short when the
cores are busy and too long when they are not. `wait_until` polls until the state is
there and, when the deadline passes, fails saying what it waited for and what it saw
last, so a failure on a loaded CI machine reads as what it is."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    what: str,
    check: Callable[[], T],
    timeout: float = 10.0,
    *,
    every: float = 0.05,
    seen: Callable[[], object] | None = None,
) -> T:
    """`check()` once it returns something true (its value). Past `timeout` seconds an
    AssertionError names `what` and shows the last value `check` returned (or what
    `seen()` shows, when the value alone says too little)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            shown = seen() if seen is not None else got
            raise AssertionError(f"not within {timeout} s: {what}; last seen: {shown!r}")
        time.sleep(every)

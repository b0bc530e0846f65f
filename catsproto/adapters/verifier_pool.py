"""Signature checks across cores for the receive daemon: a pool of worker processes.

Strategy: the Ed25519 check is most of what an accepted advertisement costs, and it is
the one step that needs no state: given the value, its route and the trust file, a
worker can do it (`security.presign`) while the daemon is still busy with the values
before it. Everything with state stays in the daemon's one process, in arrival order:
freshness, the replay window, equivocation, in-band delegations, the RIB, the files. So
per-route order, every verdict and every counter are those of the daemon without a pool,
by construction; a worker's answer only saves the daemon the check where the daemon
resolved the same key for the same signature (a trust file reloaded in between, a key
learned in-band: it checks itself).

`PooledRun` is the daemon's loop with a pool: each input line is parsed at once, and its
single-route announcements go to the workers in batches (`batch` lines a batch, at most
`window` batches out); a batch's events are applied, in order, once its answers are back,
and all of them (`settle`) whenever the input runs dry, so nothing waits for more input.
Workers are forked, hold their own copy of the trust file (read again when it changes),
and end when the pool closes or the daemon's process dies (their pipe closes).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from catsproto.adapters.cache_rib import CacheRib, Change
from catsproto.adapters.exabgp_json import Announced, Event, Prefix, parse_message
from catsproto.adapters.trust_verifier import TrustFileVerifier

__all__ = ["PooledRun", "VerifierPool"]

Job = tuple[bytes, Prefix]

_WORKER: TrustFileVerifier | None = None  # a worker process's own trust file reader


def _init_worker(path: str, optional: bool, attribute_type: int) -> None:
    global _WORKER
    # a reload failure is the daemon's to log (it reads the same file): workers are quiet
    _WORKER = TrustFileVerifier(
        path, optional=optional, attribute_type=attribute_type, log=lambda _m: None
    )


def _presign_batch(jobs: list[Job]) -> list[Any]:
    assert _WORKER is not None, "worker not initialised"
    return [_WORKER.presign(value, prefix) for value, prefix in jobs]


class VerifierPool:
    """`workers` processes that presign values against the trust file at `path` (as the
    daemon's `TrustFileVerifier` reads it: `optional`, `attribute_type`)."""

    def __init__(self, workers: int, path: str | Path, *, optional: bool, attribute_type: int):
        if workers < 1:
            raise ValueError(f"a verifier pool needs at least 1 worker, not {workers}")
        self.workers = workers
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init_worker,
            initargs=(str(path), optional, attribute_type),
        )

    def submit(self, jobs: list[Job]) -> Future[list[Any]]:
        """The `Presigned` (or None) of each (value, route), in order, when done."""
        return self._pool.submit(_presign_batch, jobs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class PooledRun:
    """`exabgp_receive.run` with the signature checks in a `VerifierPool`: `feed` each
    line, `settle` whenever the input runs dry and at its end."""

    def __init__(
        self,
        rib: CacheRib,
        on_change: Callable[[Change], None],
        pool: VerifierPool,
        *,
        type_code: int,
        clock: Callable[[], float],
        log: Callable[[str], None],
        parse: Callable[[str, int], list[Event] | None],
        batch: int = 32,
        window: int = 4,
    ) -> None:
        if batch < 1 or window < 1:
            raise ValueError("batch and window must be at least 1")
        self.rib, self.on_change, self.pool = rib, on_change, pool
        self.type_code, self.clock, self.log, self.parse = type_code, clock, log, parse
        self.batch, self.window = batch, window
        # events of the batch being filled, each with its job's index (or None)
        self._events: list[tuple[Event, int | None]] = []
        self._jobs: list[Job] = []
        self._lines = 0
        self._out: deque[tuple[list[tuple[Event, int | None]], Future[list[Any]] | None]] = deque()
        self.presigned = 0  # announcements whose check a worker did

    def feed(self, line: str) -> None:
        events = self.parse(line, self.type_code)
        if events is None:
            return
        for event in events:
            index = None
            if type(event) is Announced and event.value is not None and not event.malformed:
                index = len(self._jobs)
                self._jobs.append((event.value, event.prefix))
            self._events.append((event, index))
        self._lines += 1
        if self._lines >= self.batch:
            self._send()
            while len(self._out) > self.window:
                self._apply_oldest()

    def settle(self) -> None:
        """Apply every event taken so far (the input has run dry, or ended)."""
        self._send()
        while self._out:
            self._apply_oldest()

    def _send(self) -> None:
        if not self._events:
            return
        future = self.pool.submit(self._jobs) if self._jobs else None
        self._out.append((self._events, future))
        self._events, self._jobs, self._lines = [], [], 0

    def _apply_oldest(self) -> None:
        events, future = self._out.popleft()
        answers = future.result() if future is not None else []
        for event, index in events:
            presigned = answers[index] if index is not None else None
            self.presigned += presigned is not None
            for change in self.rib.apply(event, self.clock(), presigned):
                self.on_change(change)


def parser(rib: CacheRib, log: Callable[[str], None]) -> Callable[[str, int], list[Event] | None]:
    """One ExaBGP line to its events, as `exabgp_receive.run` parses it: a line that is
    not ExaBGP's JSON at all is counted (`unparsed_messages`), logged and gives None."""
    import json

    def parse(line: str, type_code: int) -> list[Event] | None:
        line = line.strip()
        if not line:
            return None
        try:
            return parse_message(json.loads(line), type_code)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            rib.counters["unparsed_messages"] += 1
            log(f"cannot parse ExaBGP message ({type(exc).__name__}: {exc}): {line[:200]}")
            return None

    return parse

"""The receive daemon: ExaBGP's JSON API in, a RIB of verified cache state out.

Strategy: ExaBGP runs this as `process rx { run python -m
catsproto.adapters.exabgp_receive --out DIR; encoder json; }` with
`api { processes [ rx ]; receive { parsed; update; } neighbor-changes; }`. Each stdin
line is one JSON message; `run` parses it into events (`exabgp_json`, pure), applies
them to the RIB (`cache_rib.CacheRib`, pure: RFC 7606 treat-as-withdraw of what a route
carried when its value does not decode or verify, the session untouched), which asks a
verifier (`trust_verifier.TrustFileVerifier`: the trust file, reloaded when it changes)
about each value, and hands every change to a sink. Only a message whose shape is not
ExaBGP's at all is dropped, counted (`unparsed_messages`) and logged. `FileSink` writes
changes as JSON lines and a snapshot file (with the counters); `main` is the process.
The names of those three modules are importable from here too.

ExaBGP reads this process's stdout as commands, so nothing here ever writes to it:
`main` points `sys.stdout` at stderr before doing anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from catsproto.adapters.cache_rib import (
    COUNTERS,
    CacheRib,
    Change,
    Entry,
)
from catsproto.adapters.exabgp_json import (
    Announced,
    AnnouncedMany,
    EndOfRib,
    Event,
    Prefix,
    Session,
    Unusable,
    Withdrawn,
    as_path_of,
    find_attribute,
    parse_message,
)
from catsproto.adapters.file_modes import read_secret_file
from catsproto.adapters.trust_verifier import (
    UNVERIFIED,
    TrustFileVerifier,
    Verification,
    Verifier,
)
from catsproto.adapters.verifier_pool import PooledRun, VerifierPool, parser
from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE

__all__ = [
    "COUNTERS",
    "UNVERIFIED",
    "Announced",
    "AnnouncedMany",
    "CacheRib",
    "Change",
    "EndOfRib",
    "Entry",
    "Event",
    "FileSink",
    "Prefix",
    "Session",
    "TrustFileVerifier",
    "Unusable",
    "Verification",
    "Verifier",
    "Withdrawn",
    "as_path_of",
    "drained",
    "find_attribute",
    "main",
    "parse_message",
    "run",
]


# ---- the API process ----------------------------------------------------------------


def run(
    lines: Iterable[str],
    rib: CacheRib,
    on_change: Callable[[Change], None],
    *,
    type_code: int = DEFAULT_ATTRIBUTE_TYPE,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    pool: VerifierPool | None = None,
    batch: int = 32,
) -> None:
    """Apply every line's events to `rib`, handing each change to `on_change`. With a
    `pool` the signature checks are done ahead in its workers (`PooledRun`, `batch`
    lines at a time): the same changes, in the same order."""
    verifier = rib.verifier
    if isinstance(verifier, TrustFileVerifier) and verifier.policy.attribute_type != type_code:
        raise ValueError(
            f"the trust-file verifier checks signatures for attribute type "
            f"{verifier.policy.attribute_type}, the attribute is read as type {type_code}"
        )
    parse = parser(rib, log)
    if pool is not None:
        runner = PooledRun(
            rib, on_change, pool, type_code=type_code, clock=clock, log=log, parse=parse,
            batch=batch,
        )  # fmt: skip
        for line in lines:
            runner.feed(line)
        runner.settle()
        return
    for line in lines:
        events = parse(line, type_code)
        if events is None:
            continue
        for event in events:
            for change in rib.apply(event, clock()):
                on_change(change)


EVENTS_MAX_BYTES = 64 * 2**20
EVENTS_BUFFER = 2**16  # bytes of event lines held before a write call


class FileSink:
    """Appends each change to `events.jsonl` and rewrites `rib.json` atomically: after
    every change, or with `coalesce` only on `flush()` (the event lines are then written
    out at that moment too: one write call a burst, not one a change). `rib.json` is the
    whole RIB, so a rewrite per change costs O(RIB) each, O(n^2) for a burst
    (docs/scale.md: 20 ms a route at 1,240 routes); `main` coalesces and flushes
    whenever its input runs dry.

    The event log is bounded: a re-sent unchanged value is a short line (no value hex,
    `Change.unchanged`), and once the file reaches `events_max_bytes` it is renamed to
    `events.jsonl.1` (replacing the one before) and a new one is started, so the two
    together stay under twice the limit whatever peers send."""

    def __init__(
        self,
        directory: str | Path,
        rib: CacheRib,
        *,
        coalesce: bool = False,
        events_max_bytes: int = EVENTS_MAX_BYTES,
        private: bool = False,
    ) -> None:
        if events_max_bytes <= 0:
            raise ValueError(f"events_max_bytes {events_max_bytes} is not above 0")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rib = rib
        self.coalesce = coalesce
        self.dirty = False
        self.events_max_bytes = events_max_bytes
        self.events_path = self.dir / "events.jsonl"
        # private: the files hold opened cache state, for the owner's eyes only
        self.private = private
        self.events = self._open_events()
        self._events_bytes = self.events_path.stat().st_size
        self.rotations = 0
        self._counted: dict[str, int] = {}
        self.write_snapshot()

    def __call__(self, change: Change) -> None:
        record = change.to_json()
        record["time"] = time.time()
        line = json.dumps(record) + "\n"  # ASCII (json escapes the rest): chars are bytes
        if self._events_bytes and self._events_bytes + len(line) > self.events_max_bytes:
            self._rotate()
        self.events.write(line)
        self._events_bytes += len(line)
        if self.coalesce:  # the line goes out with the snapshot, when the input runs dry
            self.dirty = True
        else:
            self.events.flush()
            self.write_snapshot()

    def _rotate(self) -> None:
        """events.jsonl becomes events.jsonl.1 (the older one goes); start a new one."""
        self.events.close()
        self.events_path.replace(self.dir / "events.jsonl.1")
        self.events = self._open_events()
        self._events_bytes = 0
        self.rotations += 1

    def _create(self, path: Path, flags: int) -> int:
        """A descriptor of `path`, mode 0600 when private (also a file already there),
        else as the umask makes it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600 if self.private else 0o666)
        if self.private:
            os.fchmod(fd, 0o600)
        return fd

    def _open_events(self) -> IO[str]:
        # a buffer that holds a dozen lines (a line is ~5 kB with its value's hex): one
        # write call per dozen, not about one a line as with the default 8 kB
        return os.fdopen(self._create(self.events_path, os.O_APPEND), "a", buffering=EVENTS_BUFFER)

    def flush(self) -> None:
        """Write the snapshot if a change (or a count, e.g. a message that did not parse)
        is not in it yet."""
        if self.dirty or self.rib.counters != self._counted:
            self.dirty = False
            self.events.flush()
            self.write_snapshot()

    def write_snapshot(self) -> None:
        self._counted = dict(self.rib.counters)
        tmp = self.dir / "rib.json.tmp"
        with os.fdopen(self._create(tmp, os.O_TRUNC), "w") as out:
            out.write(json.dumps(self.rib.to_json(), indent=1))
        tmp.replace(self.dir / "rib.json")


def drained(stream: IO[str], on_idle: Callable[[], None]) -> Iterator[str]:
    """The lines of `stream`; `on_idle()` runs before each read that would wait for
    more input, and at its end: a burst is taken in whole, then written out once."""
    fd = stream.fileno()
    while True:
        if not select.select([fd], [], [], 0)[0]:
            on_idle()
        line = stream.readline()
        if not line:
            on_idle()
            return
        yield line


def _tee(lines: Iterable[str], path: Path) -> Iterable[str]:
    with open(path, "a") as raw:
        for line in lines:
            raw.write(line)
            raw.flush()
            yield line


def _group_keys(p: argparse.ArgumentParser, paths: list[str]) -> Any:
    """The keyring of `--group-key` files (the first active, a second standby)."""
    from catsproto import security

    keys = []
    for path in paths:
        try:
            keys.append(
                security.GroupKey.from_json(json.loads(read_secret_file(path, "group key file")))
            )
        except OSError as exc:
            p.error(f"--group-key {path}: cannot read it: {exc.strerror}")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            p.error(f"--group-key {path}: not a group key file: {exc}")
    try:
        return security.GroupKeyring.of(keys)
    except ValueError as exc:
        p.error(f"--group-key: {exc}")


def main(argv: list[str] | None = None) -> int:
    from catsproto.adapters.cli_args import attribute_type_code

    sys.stdout = sys.stderr  # ExaBGP would read anything on our stdout as a command
    p = argparse.ArgumentParser(description="ExaBGP API process receiving cache state")
    p.add_argument("--out", required=True, help="directory for events.jsonl and rib.json")
    p.add_argument(
        "--type-code",
        type=attribute_type_code,
        default=DEFAULT_ATTRIBUTE_TYPE,
        help="attribute type code to read and to verify signatures for, 0..255",
    )
    p.add_argument(
        "--events-max-bytes",
        type=int,
        default=EVENTS_MAX_BYTES,
        metavar="BYTES",
        help="rotate events.jsonl to events.jsonl.1 when it would grow past this size",
    )
    trust = p.add_mutually_exclusive_group()
    trust.add_argument(
        "--trust",
        help="trust file (catsproto.security), read when it changes; until it loads every "
        "value is refused, and a later bad or missing file keeps the last good one",
    )
    trust.add_argument(
        "--trust-when-present",
        metavar="TRUST",
        help="lab only: like --trust, but while the file does not exist values are "
        "accepted unverified",
    )
    p.add_argument(
        "--group-key",
        action="append",
        default=[],
        metavar="FILE",
        help="group key file (`catsproto keygen --group ID`): verified sealed cache "
        "sections under it are opened and rib.json gives each route's opened_value; "
        "twice for the active and a standby key during a rotation; needs --trust or "
        "--trust-when-present; rib.json and events.jsonl are then written mode 0600",
    )
    p.add_argument(
        "--verify-workers",
        type=int,
        default=0,
        metavar="N",
        help="check signatures in N worker processes, ahead of the values' turn (0: in "
        "this process); every verdict and the per-route order are the same; needs --trust "
        "or --trust-when-present",
    )
    p.add_argument("--raw", action="store_true", help="also keep ExaBGP's lines in raw.jsonl")
    p.add_argument(
        "--graceful-restart",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep a downed peer's routes this long, marked stale, until its End-of-RIB "
        "(RFC 4724; configure the same capability on the session)",
    )
    args = p.parse_args(argv)
    if args.verify_workers < 0:
        p.error(f"--verify-workers {args.verify_workers}: give 0 or more")
    if args.verify_workers and not (args.trust or args.trust_when_present):
        p.error("--verify-workers: there are no signatures to check without --trust")
    if args.events_max_bytes <= 0:
        p.error(f"--events-max-bytes {args.events_max_bytes}: give a size above 0")
    keyring = None
    if args.group_key:
        if not (args.trust or args.trust_when_present):
            p.error("--group-key: opening sealed sections needs --trust or --trust-when-present")
        keyring = _group_keys(p, args.group_key)
    verifier = None
    if args.trust or args.trust_when_present:
        verifier = TrustFileVerifier(
            args.trust or args.trust_when_present,
            optional=bool(args.trust_when_present),
            attribute_type=args.type_code,
            group_keys=keyring,
        )
    rib = CacheRib(
        verifier=verifier,
        restart_time=args.graceful_restart,
    )
    sink = FileSink(
        args.out,
        rib,
        coalesce=True,
        events_max_bytes=args.events_max_bytes,
        private=keyring is not None,
    )
    if not args.verify_workers:
        lines: Iterable[str] = drained(sys.stdin, sink.flush)
        if args.raw:
            lines = _tee(lines, Path(args.out) / "raw.jsonl")
        with contextlib.suppress(KeyboardInterrupt):
            run(lines, rib, sink, type_code=args.type_code)
        return 0
    pool = VerifierPool(
        args.verify_workers,
        args.trust or args.trust_when_present,
        optional=bool(args.trust_when_present),
        attribute_type=args.type_code,
    )
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    runner = PooledRun(
        rib, sink, pool, type_code=args.type_code, clock=time.time, log=log,
        parse=parser(rib, log),
    )  # fmt: skip

    def idle() -> None:  # nothing more to read now: every value taken is applied first
        runner.settle()
        sink.flush()

    lines = drained(sys.stdin, idle)
    if args.raw:
        lines = _tee(lines, Path(args.out) / "raw.jsonl")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            for line in lines:
                runner.feed(line)
            runner.settle()
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

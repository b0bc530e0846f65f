"""Announce advertisements through ExaBGP's text API: an API process fed by a spool.

Strategy: the instance side (the node's advertisement builder and signer, or a test)
*publishes* the attribute value it wants on each route of its own into a spool
directory, one file per route, written atomically; removing the file withdraws the
route. The API process that ExaBGP runs (`process NAME { run python -m
catsproto.adapters.exabgp_announce --spool DIR; encoder text; }`) polls the spool and
turns differences into `announce route ... attribute [ 0xFF 0xC0 0xHEX ]` and
`withdraw route ...` lines on its stdout, reading ExaBGP's `done`/`error` answer to each.

Three rules live in the pure `Announcer` so they can be tested without ExaBGP:

* sizes are checked *before* anything reaches ExaBGP, which silently drops an UPDATE too
  large for the session and still answers `done` (the peer would keep the stale
  payload): an oversized value withdraws the route instead and says so on stderr;
* a route is re-announced at most once per `min_interval` (the latest value wins), the
  adapter-level half of the node's dampening;
* a route whose spool file has not been refreshed for `lease` seconds is withdrawn, so an
  instance that dies without cleaning up disappears too.

Never announce on the shared anycast CS-ID prefix: a transit passes on only its best path
per prefix. Each instance publishes on its CSCI-ID /32 and on one host route per summary
shard from a range it owns (`catsproto.summary.shard_prefix`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from catsproto.summary.shard import BGP_MAX_MESSAGE, attribute_value_budget
from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE, FLAG_OPTIONAL, FLAG_TRANSITIVE

Prefix = ipaddress.IPv4Network | ipaddress.IPv6Network


class OversizeError(ValueError):
    """An attribute value that would not fit one UPDATE on this session."""


def parse_prefix(text: str) -> Prefix:
    return ipaddress.ip_network(text.replace("_", "/"), strict=True)


def value_budget(prefix: Prefix, max_message: int, as_path_hops: int = 1) -> int:
    """The largest attribute value ExaBGP can send for `prefix` on this session."""
    return attribute_value_budget(
        max_message,
        ipv6=prefix.version == 6,
        prefix_len=prefix.prefixlen,
        as_path_hops=as_path_hops,
    )


def check_size(prefix: Prefix, value: bytes, max_message: int, as_path_hops: int = 1) -> None:
    budget = value_budget(prefix, max_message, as_path_hops)
    if len(value) > budget:
        raise OversizeError(
            f"{prefix}: attribute value of {len(value)} bytes exceeds the {budget} bytes "
            f"one {max_message}-byte UPDATE can carry; shard the summary"
        )


def announce_command(
    prefix: Prefix,
    value: bytes,
    next_hop: str = "self",
    type_code: int = DEFAULT_ATTRIBUTE_TYPE,
) -> str:
    flags = FLAG_OPTIONAL | FLAG_TRANSITIVE
    hexval = value.hex().upper() if value else ""
    return (
        f"announce route {prefix} next-hop {next_hop} "
        f"attribute [ {type_code:#04x} {flags:#04x} 0x{hexval} ]"
    )


def withdraw_command(prefix: Prefix) -> str:
    return f"withdraw route {prefix}"


# ---- the spool: how the instance side hands routes over ------------------------------


class Spool:
    """A directory of routes: file `10.1.0.11_32` holds the attribute value to announce."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, prefix: Prefix | str) -> Path:
        return self.path / str(ipaddress.ip_network(prefix)).replace("/", "_")

    def publish(self, prefix: Prefix | str, value: bytes) -> None:
        """Announce (or replace) `value` on `prefix`; atomic for the reader."""
        target = self._file(prefix)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(value)
        tmp.replace(target)

    def withdraw(self, prefix: Prefix | str) -> None:
        self._file(prefix).unlink(missing_ok=True)

    def refresh(self, prefix: Prefix | str) -> None:
        """Renew the lease of a route without changing it."""
        os.utime(self._file(prefix))

    def clear(self) -> None:
        for f in self.path.iterdir():
            if not f.name.startswith("."):
                f.unlink(missing_ok=True)

    def read(self) -> dict[Prefix, tuple[bytes, float]]:
        """Every published route: value and the time it was last written."""
        out: dict[Prefix, tuple[bytes, float]] = {}
        for f in self.path.iterdir():
            if f.name.startswith("."):
                continue
            try:
                prefix = parse_prefix(f.name)
                st = f.stat()
                out[prefix] = (f.read_bytes(), st.st_mtime)
            except (ValueError, OSError):
                continue  # not a route file, or withdrawn while we looked
        return out


# ---- the pure core ------------------------------------------------------------------


@dataclasses.dataclass
class _Route:
    sent: bytes | None = None  # what ExaBGP has; None when withdrawn
    sent_at: float = float("-inf")
    refused: bytes | None = None  # the last value refused as oversized


@dataclasses.dataclass
class Announcer:
    """Turns the wanted routes into ExaBGP commands: size checks, pacing, leases."""

    max_message: int = BGP_MAX_MESSAGE
    next_hop: str = "self"
    type_code: int = DEFAULT_ATTRIBUTE_TYPE
    min_interval: float = 0.0
    lease: float | None = None
    as_path_hops: int = 1
    routes: dict[Prefix, _Route] = dataclasses.field(default_factory=dict)
    diagnostics: list[str] = dataclasses.field(default_factory=list)

    def step(self, wanted: dict[Prefix, tuple[bytes, float]], now: float) -> list[str]:
        """Commands that bring ExaBGP from what it has to `wanted` (value, written-at)."""
        commands: list[str] = []
        live = {
            prefix: value
            for prefix, (value, written) in wanted.items()
            if self.lease is None or now - written <= self.lease
        }
        for prefix in sorted(self.routes.keys() - live.keys(), key=str):
            if self.routes.pop(prefix).sent is not None:
                if prefix in wanted:
                    self.diagnostics.append(f"{prefix}: lease of {self.lease:g}s expired")
                commands.append(withdraw_command(prefix))
        for prefix in sorted(live, key=str):
            value = live[prefix]
            route = self.routes.setdefault(prefix, _Route())
            if value in (route.sent, route.refused) or now - route.sent_at < self.min_interval:
                continue
            try:
                check_size(prefix, value, self.max_message, self.as_path_hops)
            except OversizeError as exc:
                self.diagnostics.append(f"refused: {exc}")
                if route.sent is not None:
                    commands.append(withdraw_command(prefix))
                route.sent, route.refused = None, value
                continue
            commands.append(announce_command(prefix, value, self.next_hop, self.type_code))
            route.sent, route.sent_at, route.refused = value, now, None
        return commands


# ---- the API process ----------------------------------------------------------------


def run(
    spool: Spool,
    announcer: Announcer,
    out: IO[str],
    acks: IO[str],
    *,
    poll: float = 0.02,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Poll the spool and feed ExaBGP until ExaBGP closes our stdin (or `stop()`)."""
    while not stop():
        commands = announcer.step(spool.read(), clock())
        for line in announcer.diagnostics:
            log(line)
        announcer.diagnostics.clear()
        if not _send(commands, out, acks, log):
            return
        time.sleep(poll)


def _send(commands: Iterable[str], out: IO[str], acks: IO[str], log: Callable[[str], None]) -> bool:
    for command in commands:
        out.write(command + "\n")
        out.flush()
        answer = acks.readline()
        if not answer:
            return False  # ExaBGP went away
        if answer.strip() != "done":
            log(f"exabgp answered {answer.strip()!r} to {command[:120]}")
        else:
            log(f"sent {command[:90]}{'...' if len(command) > 90 else ''}")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ExaBGP API process announcing a spool of routes")
    p.add_argument("--spool", required=True, help="directory of route files")
    p.add_argument(
        "--max-message",
        type=int,
        default=BGP_MAX_MESSAGE,
        help="4096, or 65535 with RFC 8654 extended messages",
    )
    p.add_argument("--next-hop", default="self")
    p.add_argument("--type-code", type=int, default=DEFAULT_ATTRIBUTE_TYPE)
    p.add_argument("--min-interval", type=float, default=0.0, help="seconds between updates")
    p.add_argument("--lease", type=float, default=None, help="withdraw routes not refreshed")
    p.add_argument("--poll", type=float, default=0.02)
    args = p.parse_args(argv)
    announcer = Announcer(
        max_message=args.max_message,
        next_hop=args.next_hop,
        type_code=args.type_code,
        min_interval=args.min_interval,
        lease=args.lease,
    )
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        run(Spool(args.spool), announcer, sys.stdout, sys.stdin, poll=args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import errno
import ipaddress
import json
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from catsproto.adapters.file_modes import file_kind, read_trust_file, refuse_open_folder
from catsproto.summary.shard import BGP_MAX_MESSAGE, attribute_value_budget
from catsproto.wire import DEFAULT_ATTRIBUTE_TYPE, FLAG_OPTIONAL, FLAG_TRANSITIVE, ScopeKind

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

ROUTE_FILE_MODE = 0o644  # the values are public: they go into BGP
SPOOL_FOLDER_MODE = 0o755
MAX_ROUTE_FILE = 65535  # no attribute value is longer, even with RFC 8654 messages
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Spool:
    """A directory of routes: file `10.1.0.11_32` holds the attribute value to announce.

    Whoever may write in the folder decides what is announced and, through a planted
    link, what is overwritten or read, so the folder is refused (`FileModeError`, naming
    the chmod) when group or others may write it or its parent (without the sticky bit),
    or when it belongs to another user; a missing one is made mode 0755. Writes go to a
    temporary name created fresh (``O_CREAT|O_EXCL|O_NOFOLLOW``, random, mode 0644
    whatever the umask) and renamed over the route file, which replaces a link there
    rather than writing through it. Reads take only regular files, opened with
    ``O_NOFOLLOW|O_NONBLOCK`` (a link or a FIFO never leads anywhere nor blocks), owned
    by us or by the folder's owner, of at most `MAX_ROUTE_FILE` bytes; anything else is
    left out and named in `refused`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.mkdir(mode=SPOOL_FOLDER_MODE)
                os.chmod(self.path, SPOOL_FOLDER_MODE)  # whatever the umask
            except FileExistsError:
                if not self.path.is_dir():
                    raise
        refuse_open_folder(self.path, "spool folder")
        self.refused: dict[str, str] = {}
        """Entries the last `read` left out: file name -> why."""

    def _file(self, prefix: Prefix | str) -> Path:
        return self.path / str(ipaddress.ip_network(prefix)).replace("/", "_")

    def publish(self, prefix: Prefix | str, value: bytes) -> None:
        """Announce (or replace) `value` on `prefix`; atomic for the reader."""
        target = self._file(prefix)
        for _ in range(8):
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
            try:
                fd = os.open(tmp, _CREATE_FLAGS, ROUTE_FILE_MODE)
            except FileExistsError:
                continue  # something is there already (planted?): another fresh name
            break
        else:
            raise FileExistsError(errno.EEXIST, "no fresh temporary name in 8 tries", str(tmp))
        try:
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), ROUTE_FILE_MODE)
                out.write(value)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def withdraw(self, prefix: Prefix | str) -> None:
        self._file(prefix).unlink(missing_ok=True)

    def refresh(self, prefix: Prefix | str) -> None:
        """Renew the lease of a route without changing it."""
        os.utime(self._file(prefix), follow_symlinks=False)

    def clear(self) -> None:
        for f in self.path.iterdir():
            if not f.name.startswith("."):
                f.unlink(missing_ok=True)

    def read(self) -> dict[Prefix, tuple[bytes, float]]:
        """Every published route: value and the time it was last written (entries that
        are not route files of ours are left out, and named in `refused`)."""
        out: dict[Prefix, tuple[bytes, float]] = {}
        refused: dict[str, str] = {}
        folder = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            owners = {os.geteuid(), os.fstat(folder).st_uid}
            for name in os.listdir(folder):
                if name.startswith("."):
                    continue
                try:
                    prefix = parse_prefix(name)
                except ValueError:
                    continue  # not a route file
                try:
                    out[prefix] = _read_route(folder, name, owners)
                except FileNotFoundError:
                    continue  # withdrawn while we looked
                except _Refused as exc:
                    refused[name] = str(exc)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        refused[name] = "not a regular file (a symbolic link)"
                    else:
                        refused[name] = f"cannot read: {exc.strerror or exc}"
        finally:
            os.close(folder)
        self.refused = refused
        return out


class _Refused(Exception):
    """A spool entry that is not a route file the announcer may read."""


def _read_route(folder: int, name: str, owners: set[int]) -> tuple[bytes, float]:
    fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"not a regular file ({file_kind(st.st_mode)})")
        if st.st_uid not in owners:
            raise _Refused(
                f"belongs to uid {st.st_uid}, not to this user nor the spool folder's owner"
            )
        if st.st_size > MAX_ROUTE_FILE:
            raise _Refused(f"{st.st_size} bytes, more than any attribute value ({MAX_ROUTE_FILE})")
        chunks, size = [], 0
        while size <= MAX_ROUTE_FILE:
            chunk = os.read(fd, MAX_ROUTE_FILE + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_ROUTE_FILE:
            raise _Refused(f"more than {MAX_ROUTE_FILE} bytes (it grew while read)")
        return b"".join(chunks), st.st_mtime
    finally:
        os.close(fd)


def read_route_scope(path: str | Path) -> tuple[Prefix, ...]:
    """The route networks of a delegation file (`catsproto authorize` writes one): the
    routes the node's key may sign for. OSError (a file others may write is a
    `FileModeError`) or ValueError naming what is wrong."""
    from catsproto import security

    raw = read_trust_file(path, "delegation file")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"delegation file {path}: not UTF-8 JSON: {exc}") from None
    d = security.delegation_from_json(obj)
    return tuple(e.network for e in d.entries(ScopeKind.ROUTE))


def route_problem(prefix: Prefix, scope: tuple[Prefix, ...] | None) -> str | None:
    """Why `prefix` may not be announced, or None: without a scope only host routes (a
    node announces its CSCI-ID and its shard addresses), with one exactly the routes the
    delegation's route entries cover (as a receiver checks them)."""
    if scope is None:
        if prefix.prefixlen == prefix.max_prefixlen:
            return None
        return "not a host route (/32, /128), and no delegation scope (--delegation) allows it"
    for n in scope:
        if n.version == prefix.version and prefix.subnet_of(n):  # type: ignore[arg-type]
            return None
    return f"outside the delegation's routes ({', '.join(map(str, scope)) or 'none'})"


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
    scope: tuple[Prefix, ...] | None = None
    """Route networks of the node's delegation; None: host routes only (`route_problem`)."""
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
                problem = route_problem(prefix, self.scope)
                if problem is not None:
                    raise OversizeError(f"{prefix}: {problem}")
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
    said: dict[str, str] = {}
    while not stop():
        commands = announcer.step(spool.read(), clock())
        for name, why in spool.refused.items():
            if said.get(name) != why:  # once per entry and reason, not every poll
                log(f"spool entry {name} left out: {why}")
        said = dict(spool.refused)
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
    p.add_argument(
        "--delegation",
        help="the node's delegation file: announce the routes its scope allows (without "
        "it, host routes only: /32 and /128)",
    )
    args = p.parse_args(argv)
    scope = None
    try:
        if args.delegation is not None:
            scope = read_route_scope(args.delegation)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"exabgp_announce: --delegation {args.delegation}: {why}", file=sys.stderr)
        return 2
    try:
        spool = Spool(args.spool)
    except OSError as exc:
        print(f"exabgp_announce: --spool {args.spool}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    announcer = Announcer(
        max_message=args.max_message,
        next_hop=args.next_hop,
        type_code=args.type_code,
        min_interval=args.min_interval,
        lease=args.lease,
        scope=scope,
    )
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        run(spool, announcer, sys.stdout, sys.stdin, poll=args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())

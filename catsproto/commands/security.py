"""`catsproto keygen | authorize | sign | verify`: keys, delegations and signatures.

The logic is in `catsproto.security.commands` (pure); this module reads files, draws
randomness and the clock, and prints. Private key files are created 0600 and never
overwritten; a key or group key file group or others may use, or a trust or delegation
file they may write, is refused (`catsproto.adapters.file_modes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from catsproto.adapters import file_modes
from catsproto.commands import UsageError, add_type_code, bytes_from_input, read_input
from catsproto.security import commands


def _read(path: str) -> tuple[bytes, int | None]:
    """The bytes of a file and its mode (`file_modes.read_with_mode`); stdin (`-`) has no
    mode to check."""
    if path == "-":
        return read_input(path), None
    try:
        return file_modes.read_with_mode(path)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _json(path: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON: line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deeply") from None


def _object(path: str, what: str, *, secret: bool | None) -> dict[str, Any]:
    """A JSON file that must hold one object (a key, delegation or trust file), refused
    if its mode lets others in (`file_modes`): `secret` True for a private or group key
    (nothing for group or others), False for a trust or delegation file (no writing for
    them), None for an operator key file, which is a secret when it holds a seed."""
    raw, mode = _read(path)
    obj = _json(path, raw)
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: a {what} file holds a JSON object, not {json.dumps(obj)[:20]}")
    if mode is not None:
        holds_secret = "seed" in obj if secret is None else secret
        try:
            file_modes.refuse_open_mode(path, mode, f"{what} file", secret=holds_secret)
        except file_modes.FileModeError as exc:
            raise UsageError(str(exc)) from None
    return obj


def _write_private(path: str, obj: object) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} exists; not overwriting a key file") from None
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(obj, indent=2) + "\n")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Security input errors are usage errors: one line, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except commands.CommandError as exc:
            raise UsageError(str(exc)) from None

    return run


@_guard
def cmd_keygen(args: argparse.Namespace) -> int:
    if args.group is not None:
        _write_private(args.out, commands.group_keygen(args.group, os.urandom(32)))
        print(f"wrote group key {args.group} to {args.out}")
    else:
        key = commands.keygen(os.urandom(32), args.name)
        _write_private(args.out, key)
        print(json.dumps(commands.public_key(key)))
    return 0


@_guard
def cmd_authorize(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.days) and args.days > 0):
        raise UsageError(f"--days {args.days}: give a finite number of days above 0")
    start = args.not_before_ms if args.not_before_ms is not None else _now_ms()
    delegation = commands.authorize(
        _object(args.operator_key, "key", secret=True),
        args.node_public_key,
        cs_ids=args.cs_id,
        routes=args.route,
        addresses=args.address,
        not_before_ms=start,
        not_after_ms=start + int(args.days * 86_400_000),
        sites=args.site,
    )
    print(json.dumps(delegation, indent=2))
    return 0


@_guard
def cmd_trust(args: argparse.Namespace) -> int:
    operators = []
    for path in args.operator:
        key = _object(path, "key", secret=None)  # private (a secret) or public
        operators.append(commands.public_key(key) if "seed" in key else key)
    trust = commands.build_trust(
        operators,
        [_object(p, "delegation", secret=False) for p in args.delegation],
        revoke=args.revoke,
        previous=_object(args.previous, "trust", secret=False) if args.previous else None,
    )
    print(json.dumps(trust, indent=2))
    return 0


@_guard
def cmd_sign(args: argparse.Namespace) -> int:
    value = bytes_from_input(read_input(args.file))
    if args.seal:
        keys = [_object(p, "group key", secret=True) for p in args.seal]
        value = commands.seal_value(value, keys, os.urandom(12))
    delegation = _object(args.delegation, "delegation", secret=False) if args.delegation else None
    signed = commands.sign_value(
        value,
        _object(args.key, "key", secret=True),
        commands.parse_nlri(args.route),
        args.type_code,
        delegation,
    )
    print(signed.hex())
    return 0


@_guard
def cmd_verify(args: argparse.Namespace) -> int:
    verdict = commands.verify_value(
        bytes_from_input(read_input(args.file)),
        commands.parse_nlri(args.route),
        _object(args.trust, "trust", secret=False),
        args.now_ms if args.now_ms is not None else _now_ms(),
        max_age_ms=args.max_age_ms,
        max_future_ms=args.max_future_ms,
        attribute_type=args.type_code,
        group_keys=[_object(p, "group key", secret=True) for p in args.group_key] or None,
    )
    out = verdict.to_json()
    if verdict.ok and args.show:
        out["advertisement"] = verdict.advertisement.to_json()
    print(json.dumps(out))
    return 0 if verdict.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keygen",
        help="new Ed25519 key file (or --group ID: an AEAD group key), mode 0600",
        description="Create a new Ed25519 key file and print its public half as JSON; with "
        "--group KEY_ID, an AEAD group key file (for sealing cache sections) instead. The "
        "file is created with mode 0600 and never overwritten.",
    )
    p.add_argument("out", help="file to create (refuses to overwrite)")
    p.add_argument("--name", default="", help="a label stored with the key")
    p.add_argument("--group", type=int, metavar="KEY_ID", help="make a group key with this id")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser(
        "authorize",
        help="operator key signs a delegation for a node key (JSON on stdout)",
        description="Authorise NODE_PUBLIC_KEY (hex) for CS-IDs, routes, addresses and sites.",
    )
    p.add_argument("operator_key", help="operator private key file")
    p.add_argument("node_public_key", help="node public key, hex")
    p.add_argument(
        "--cs-id",
        type=int,
        action="append",
        required=True,
        help="a CS-ID the node may advertise; repeatable",
    )
    p.add_argument(
        "--route",
        action="append",
        required=True,
        help="a prefix the node may announce on; repeatable",
    )
    p.add_argument(
        "--address",
        action="append",
        required=True,
        help="an instance address the node may advertise; repeatable",
    )
    p.add_argument(
        "--site",
        type=int,
        action="append",
        help="a site id the node may name in its Origin; repeatable (none: every site)",
    )
    p.add_argument("--days", type=float, default=30.0, help="days of validity")
    p.add_argument("--not-before-ms", type=int, help="start of validity (default now)")
    p.set_defaults(func=cmd_authorize)

    p = sub.add_parser(
        "trust",
        help="build a trust file from operator keys and delegations (JSON on stdout)",
        description="Build a trust file (catsproto-trust/1) from operator key files (of a "
        "private key only the public half is kept) and delegation files, check that it "
        "loads, and print it as JSON. To remove a node key, build the new file with "
        "--previous OLD (or --revoke KEY_ID): the key is then listed as revoked.",
    )
    p.add_argument(
        "--operator",
        action="append",
        required=True,
        help="operator key file (private or public); repeatable",
    )
    p.add_argument(
        "--delegation",
        action="append",
        default=[],
        help="delegation file from `catsproto authorize`; repeatable",
    )
    p.add_argument(
        "--revoke",
        action="append",
        default=[],
        metavar="KEY_ID",
        help="node key id (16 hex) to revoke: written into revoked_keys, so no delegation, "
        "not even one carried in an advertisement, authorises it again; repeatable",
    )
    p.add_argument(
        "--previous",
        metavar="TRUST",
        help="the trust file this one replaces: its revoked keys stay revoked, and every "
        "node key it delegated that no --delegation here does is revoked",
    )
    p.set_defaults(func=cmd_trust)

    p = sub.add_parser(
        "sign",
        help="sign an attribute value (hex or raw) for one route",
        description="Sign an attribute value (hex or raw, from FILE or stdin) with a node key "
        "for the route it is announced on, optionally carrying a delegation, and with "
        "--seal encrypting the cache section first; print the signed value in hex.",
    )
    p.add_argument("file", nargs="?", default="-", help="value file (hex or raw), or - for stdin")
    p.add_argument("--key", required=True, help="node private key file")
    p.add_argument("--route", required=True, help="the prefix the value is announced on")
    p.add_argument("--delegation", help="carry this delegation (JSON file) in the value")
    p.add_argument(
        "--seal",
        action="append",
        default=[],
        metavar="GROUP_KEY",
        help="group key file to encrypt the cache section with, for the selectors holding it; "
        "repeatable up to twice: the first is the active key, which seals; the second is "
        "the standby key (read and checked: another key id; it does not seal)",
    )
    add_type_code(p)
    p.set_defaults(func=cmd_sign)

    p = sub.add_parser(
        "verify",
        help="verify a signed value: exit 0 if accepted, 1 with the reason if not",
        description="Verify a signed value for the route it arrived on against a trust "
        "file: signature, the delegation's scope and validity, and the timestamp's "
        "freshness at --now-ms (each run starts with an empty replay window). Print the "
        "verdict as JSON; exit 0 if accepted, 1 if not.",
    )
    p.add_argument("file", nargs="?", default="-", help="value file (hex or raw), or - for stdin")
    p.add_argument("--trust", required=True, help="trust store file (catsproto-trust/1)")
    p.add_argument("--route", required=True, help="the prefix the value arrived on")
    p.add_argument("--now-ms", type=int, help="verification time (default now)")
    p.add_argument(
        "--max-age-ms",
        type=int,
        default=120_000,
        help="refuse a value whose timestamp is more than this many ms before --now-ms",
    )
    p.add_argument(
        "--max-future-ms",
        type=int,
        default=5_000,
        help="refuse a value whose timestamp is more than this many ms after --now-ms",
    )
    p.add_argument(
        "--group-key",
        action="append",
        default=[],
        metavar="FILE",
        help="group key file to open a sealed cache section; give it at most twice: the "
        "active key first, then a standby key (either opens). A section under another key "
        "id is left sealed and the value still accepted, as without a key",
    )
    add_type_code(p)
    p.add_argument("--show", action="store_true", help="print the verified advertisement too")
    p.set_defaults(func=cmd_verify)


__all__ = ["register"]

"""Subcommands of `catsproto` beyond the codec's, one module each.

Every module here defines `register(subparsers)`, which adds its parser(s) and sets
`func` to a callable taking the parsed arguments and returning an exit status. The CLI
finds the modules by listing this package, so adding a command touches no shared file.
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

from catsproto.wire.codes import DEFAULT_ATTRIBUTE_TYPE

_HEX = set(string.hexdigits + string.whitespace)


def add_type_code(parser: argparse.ArgumentParser) -> None:
    """The `--type-code` option every command that reads or writes the attribute takes."""
    parser.add_argument(
        "--type-code",
        type=int,
        default=DEFAULT_ATTRIBUTE_TYPE,
        help=f"path attribute type code (default {DEFAULT_ATTRIBUTE_TYPE}, RFC 2042 development)",
    )


class UsageError(Exception):
    """Input a command cannot use: the CLI prints it as one line and exits with 2."""


def read_input(source: str) -> bytes:
    """The bytes of a file, or of stdin for `-`."""
    if source == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(source).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None


def bytes_from_input(raw: bytes) -> bytes:
    """Hex text (whitespace and a leading 0x allowed) becomes bytes; anything else is raw."""
    text = raw.strip()
    if text[:2].lower() == b"0x":
        text = text[2:]
    try:
        decoded = text.decode("ascii")
    except UnicodeDecodeError:
        return raw
    if decoded and set(decoded) <= _HEX:
        try:
            return bytes.fromhex(decoded)
        except ValueError:
            raise UsageError("input looks like hex but has an odd number of digits") from None
    return raw

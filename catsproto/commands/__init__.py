"""Subcommands of `catsproto` beyond the codec's, one module each.

Every module here defines `register(subparsers)`, which adds its parser(s) and sets
`func` to a callable taking the parsed arguments and returning an exit status. The CLI
finds the modules by listing this package, so adding a command touches no shared file.

Every parser of the command is a `CommandParser`: `add_subparsers` hands its class on,
so each subcommand's `--help` uses `HelpFormatter` (defaults shown, descriptions kept as
written) without the modules asking for it. Every option needs a help string;
tests/test_cli.py walks the whole tree to keep it so.
"""

from __future__ import annotations

import argparse
import re
import string
import sys
import textwrap
from pathlib import Path
from typing import Any

from catsproto.wire.codes import DEFAULT_ATTRIBUTE_TYPE

_HEX = set(string.hexdigits + string.whitespace)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """An option's help ends with ``(default: X)`` unless its help already speaks of its
    default or there is none to show (None, a flag's False, an empty string or list).

    A description is filled paragraph by paragraph (blank lines between them); a
    paragraph with an indented line (example commands) is kept exactly as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for block in re.split(r"\n[ \t]*\n", text.strip("\n")):
            lines = block.splitlines()
            if any(line[:1].isspace() for line in lines):
                blocks.append("\n".join(indent + line for line in lines))
            else:
                words = " ".join(line.strip() for line in lines)
                blocks.append(
                    textwrap.fill(
                        words,
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(blocks)

    def _split_lines(self, text: str, width: int) -> list[str]:
        """Option help, wrapped without breaking names like least-loaded at the hyphen."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or not shows_default(action):
            return action.help
        if isinstance(default, list | tuple):
            shown = " ".join(str(v) for v in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def shows_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth printing in its help."""
    default = action.default
    if default is None or default is False or default == "" or default is argparse.SUPPRESS:
        return False
    if isinstance(default, list | tuple) and not default:
        return False
    optional = (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
    return bool(action.option_strings) or action.nargs in optional


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose help uses `HelpFormatter`; its subparsers are of this
    class too (argparse's `add_subparsers` defaults `parser_class` to the parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_type_code(parser: argparse.ArgumentParser) -> None:
    """The `--type-code` option every command that reads or writes the attribute takes."""
    parser.add_argument(
        "--type-code",
        type=int,
        default=DEFAULT_ATTRIBUTE_TYPE,
        help="path attribute type code (255 is reserved for development by RFC 2042)",
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

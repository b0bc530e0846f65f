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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from catsproto.adapters.cli_args import attribute_type_code
from catsproto.wire.codes import DEFAULT_ATTRIBUTE_TYPE


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


_UNKNOWN_IN = "_catsproto_unknown_in"  # namespace attribute: the parser extras were left in


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose help uses `HelpFormatter`; its subparsers are of this
    class too (argparse's `add_subparsers` defaults `parser_class` to the parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, and the `prog` of the innermost parser that left words it did not
        know, so `parse_args` can name that subcommand (argparse itself reports them
        from the top-level parser: `catsproto: unrecognized arguments`)."""
        ns, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(ns, _UNKNOWN_IN):
            setattr(ns, _UNKNOWN_IN, self.prog)
        return ns, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        prog = getattr(ns, _UNKNOWN_IN, self.prog)
        if hasattr(ns, _UNKNOWN_IN):
            delattr(ns, _UNKNOWN_IN)
        if extras:
            self.exit(
                2, f"{prog}: unrecognized arguments: {' '.join(extras)}; see `{prog} --help`\n"
            )
        return ns

    def error(self, message: str) -> NoReturn:
        """A command line argparse refuses: one line on stderr and exit 2, as for every
        other bad input (argparse's own form adds the usage lines above it)."""
        self.exit(2, f"{self.prog}: {message}; see `{self.prog} --help`\n")


def add_type_code(parser: argparse.ArgumentParser) -> None:
    """The `--type-code` option every command that reads or writes the attribute takes."""
    parser.add_argument(
        "--type-code",
        type=attribute_type_code,
        default=DEFAULT_ATTRIBUTE_TYPE,
        help="path attribute type code, 0..255 (255 is reserved for development by RFC 2042)",
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


_HEX_DIGITS = frozenset(string.hexdigits)
_HEX_TEXT = _HEX_DIGITS | frozenset(string.whitespace + ":")
_PRINTABLE = frozenset(string.printable)  # ASCII letters, digits, punctuation, whitespace
_COLON_PAIRS = re.compile(r"[0-9A-Fa-f]{2}(?:\s*:\s*[0-9A-Fa-f]{2}|\s+[0-9A-Fa-f]{2})*")
HEX_INPUT_RULE = (
    "hex digits, optionally after 0x, in groups separated by spaces or newlines "
    "(an even number of digits in all), or byte pairs separated by colons (aa:bb:cc); "
    "input with any byte that is not printable ASCII is taken as raw bytes"
)


def bytes_from_input(raw: bytes) -> bytes:
    """Hex text becomes bytes, raw bytes stay as they are, other text is refused.

    Hex: see `HEX_INPUT_RULE`. Raw: any input with a byte that is not printable ASCII.
    That is unambiguous because no well-formed input is all printable: an attribute value
    starts with 0x00 (the high byte of its first type, version = 1) and a whole attribute
    with its flags byte, 0x80 or above (optional). So printable text that is not hex
    (a typo, a file of the wrong kind) is a usage error naming the first wrong character,
    instead of a misleading codec error about TLVs read from ASCII codes."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return raw
    if not text or not set(text) <= _PRINTABLE:
        return raw
    body = text.strip()
    start = len(text) - len(text.lstrip())
    if body[:2].lower() == "0x":
        body, start = body[2:], start + 2
    for i, char in enumerate(body):
        if char not in _HEX_TEXT:
            raise UsageError(
                f"input is text but not hex: {char!r} at character {start + i + 1} is not "
                "a hex digit, space or colon (raw input has bytes that are not printable)"
            )
    if ":" in body:
        if _COLON_PAIRS.fullmatch(body) is None:
            raise UsageError(
                "input looks like colon-separated hex but is not byte pairs "
                "separated by single colons (aa:bb:cc)"
            )
        return bytes.fromhex(re.sub(r"[\s:]", "", body))
    digits = "".join(body.split())
    if len(digits) % 2:
        raise UsageError("input looks like hex but has an odd number of digits")
    return bytes.fromhex(digits)

"""The interop matrix's defaults and command-line options, cheap to import (the CLI
registers them on every start; the matrix itself loads the lab only when it runs)."""

from __future__ import annotations

import argparse

from catsproto.adapters.cli_args import seconds, whole_number

MAX_VALUE = 65535
"""The largest attribute value (an extended-length attribute's 16-bit length)."""
MAX_SIZES = 254
"""Payloads per lab: each rides its own /32, 10.255.0.1 to 10.255.0.254."""
SIZES: tuple[int, ...] = (0, 255, 256, 4044, 60_000)
TRANSITS: tuple[str, ...] = ("frr", "bird", "gobgp")
LIMIT_SIZES: tuple[int, ...] = (3040, 3041, 4039, 4040, 4041, 64479, 64480, 65478, 65479)
"""Either side of each transit's largest value as measured (docs/interop.md), probed in
the same labs with `--limits`."""


def size_list(text: str) -> list[int]:
    """`--sizes`: comma-separated byte counts, each 0..MAX_VALUE (argparse `type`, so a
    bad list is refused while the command line is parsed, before any lab is built)."""
    sizes = []
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a whole number") from None
        if not 0 <= size <= MAX_VALUE:
            raise argparse.ArgumentTypeError(
                f"{size} is outside 0..{MAX_VALUE} (an attribute value's largest length)"
            )
        sizes.append(size)
    if len(sizes) > MAX_SIZES:
        raise argparse.ArgumentTypeError(f"{len(sizes)} sizes, more than {MAX_SIZES}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transit",
        action="append",
        choices=TRANSITS,
        help="transit(s) to test (repeat; default all)",
    )
    p.add_argument(
        "--extended",
        choices=["on", "off", "both"],
        default="both",
        help="RFC 8654 extended messages at the ExaBGP ends: on, off, or both (a lab each)",
    )
    p.add_argument(
        "--sizes",
        type=size_list,
        default=list(SIZES),
        help=f"attribute value sizes in bytes, comma-separated, each 0..{MAX_VALUE}, at most "
        f"{MAX_SIZES} (default: {','.join(map(str, SIZES))})",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help=f"also probe the measured limits: {', '.join(map(str, LIMIT_SIZES))}",
    )
    p.add_argument(
        "--jobs", type=whole_number(1), default=3, help="labs run side by side (default 3)"
    )
    p.add_argument(
        "--settle",
        type=seconds(),
        default=2.0,
        help="seconds without a new arrival at the receiving ExaBGP before a lab is judged",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument("--markdown", metavar="FILE", help="write the markdown table to FILE")
    p.add_argument(
        "--update-doc",
        metavar="FILE",
        help="replace the table between the interop-matrix markers in FILE",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep run directories (captures, logs); each is named on stderr (kept: PATH)",
    )

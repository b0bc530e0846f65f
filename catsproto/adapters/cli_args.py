"""Argument types shared by the commands and the daemons the lab starts as processes
(which parse their own command lines and sit below `catsproto.commands`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def attribute_type_code(text: str) -> int:
    """A path attribute type code: one octet, 0..255 (argparse `type`, so a bad one is
    refused while the command line is parsed, before any input is read)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"{value} outside 0..255 (one octet)")
    return value


def whole_number(minimum: int, zero_means: str | None = None) -> Callable[[str], int]:
    """An argparse `type`: a whole number >= `minimum`. `zero_means` says what 0 stands
    for when it is allowed ("no limit"), and goes into the refusal."""
    note = f" (0: {zero_means})" if zero_means is not None else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{note}, not {value}")
        return value

    return parse


def seconds(*, zero_means: str | None = None) -> Callable[[str], float]:
    """An argparse `type`: a finite number of seconds, > 0; with `zero_means`, 0 is
    allowed too and stands for that ("no limit"). NaN and infinities are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if zero_means is None:
            if not (math.isfinite(value) and value > 0):
                raise argparse.ArgumentTypeError(f"must be finite and > 0 seconds, not {text}")
        elif not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(
                f"must be finite and >= 0 (0: {zero_means}), not {text}"
            )
        return value

    return parse

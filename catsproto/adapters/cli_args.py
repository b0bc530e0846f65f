"""Argument types shared by the commands and the daemons the lab starts as processes
(which parse their own command lines and sit below `catsproto.commands`)."""

from __future__ import annotations

import argparse


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

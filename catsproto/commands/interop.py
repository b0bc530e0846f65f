"""`catsproto interop`: the interop matrix, ExaBGP → FRR / BIRD / GoBGP → ExaBGP.

The matrix lives in the source checkout's `lab/interop/matrix.py` (next to the lab's
topologies, not in the installed package); this command puts the checkout on the import
path and runs it. Arguments are the matrix's own (`python -m lab.interop.matrix`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from catsproto.commands import UsageError

CHECKOUT = Path(__file__).resolve().parents[2]


def _load(module: str) -> ModuleType:
    """`lab.interop.<module>` from the checkout."""
    if not (CHECKOUT / "lab" / "interop" / f"{module}.py").is_file():
        raise UsageError(f"lab/interop/{module}.py is missing under {CHECKOUT} (not a checkout)")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(f"lab.interop.{module}")


def cmd_interop(args: argparse.Namespace) -> int:
    matrix = _load("matrix")
    try:
        return int(matrix.run_from_args(args))
    except matrix.ArgumentError as exc:
        raise UsageError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "interop",
        help="interop matrix: our attribute through FRR, BIRD and GoBGP (root)",
        description="ExaBGP -> transit (FRR, BIRD, GoBGP) -> ExaBGP, extended messages on "
        "and off, payloads of 0..60000 bytes: delivered, Partial bit, flags, bytes "
        "unchanged, from captures of both hops. Needs root. See docs/interop.md.",
    )
    try:
        _load("options").add_arguments(p)
    except (UsageError, ImportError) as exc:
        reason = str(exc)
        p.set_defaults(func=lambda _args: _fail(reason))
        return
    p.set_defaults(func=cmd_interop)


def _fail(reason: str) -> int:
    raise UsageError(reason)

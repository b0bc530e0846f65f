"""Reading traces and scenario files (the IO half of `catsproto.sim`).

A trace is JSON Lines, one request a line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (the Mooncake release's fields). A scenario is TOML or
JSON (by extension); the shipped ones live in ``catsproto/sim/scenarios/``.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from catsproto.sim.trace import TraceRequest

__all__ = [
    "MOONCAKE",
    "SCENARIO_DIR",
    "TraceFormatError",
    "find_trace",
    "load_scenario",
    "parse_trace_line",
    "read_trace",
]

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "sim" / "scenarios"
MOONCAKE = "mooncake-conversation.jsonl"
_REPO = Path(__file__).resolve().parents[2]


def find_trace(name: str = MOONCAKE) -> Path:
    """Where a trace lives: $CATSPROTO_TRACES, then the repository's data/traces, then
    ../shared/traces beside the checkout, then /work/shared/traces. Raises
    TraceFormatError naming every place tried."""
    places = [
        *([Path(os.environ["CATSPROTO_TRACES"])] if os.environ.get("CATSPROTO_TRACES") else []),
        _REPO / "data" / "traces",
        _REPO.parent / "shared" / "traces",
        Path.cwd().parent / "shared" / "traces",
        Path("/work/shared/traces"),
    ]
    for folder in places:
        if (folder / name).is_file():
            return folder / name
    tried = ", ".join(str(p / name) for p in places)
    raise TraceFormatError(f"trace {name} not found (tried {tried}; set CATSPROTO_TRACES)")


class TraceFormatError(ValueError):
    """A trace line or scenario file that cannot be used; says which line or file."""


def parse_trace_line(line: str, lineno: int = 0) -> TraceRequest:
    try:
        obj = json.loads(line)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
            raise ValueError("hash_ids must be a list of non-negative integers")
        req = TraceRequest(
            float(obj["timestamp"]),
            int(obj["input_length"]),
            int(obj.get("output_length", 0)),
            tuple(ids),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"trace line {lineno}: {exc}") from None
    if req.input_length < 0 or req.timestamp_ms < 0:
        raise TraceFormatError(f"trace line {lineno}: negative timestamp or input_length")
    return req


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace (the first `limit` if given)."""
    out: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if line.strip():
                    out.append(parse_trace_line(line, lineno))
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror}") from None
    return out


def load_scenario(path: str | Path) -> dict[str, Any]:
    """A scenario file as a nested mapping (a name without a directory is looked up
    among the shipped scenarios, e.g. ``s1`` or ``llama70b``)."""
    p = Path(path)
    if not p.exists() and p.parent == Path("."):
        for ext in ("", ".toml", ".json"):
            cand = SCENARIO_DIR / f"{p.name}{ext}"
            if cand.exists():
                p = cand
                break
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read scenario {path}: {exc.strerror}") from None
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TraceFormatError(f"scenario {p}: {exc}") from None

"""Reading traces and scenario files (the IO half of `catsproto.sim`).

A trace is JSON Lines, one request a line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (the Mooncake release's fields). A scenario is TOML or
JSON (by extension); the shipped ones live in ``catsproto/sim/scenarios/``.

`find_trace` looks for a trace by name in SEARCH_ORDER and only looks; fetching the
Mooncake trace when it is nowhere is `trace_download`'s.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from catsproto.sim.trace import TraceRequest

__all__ = [
    "CHECKOUT_TRACES",
    "MOONCAKE",
    "SCENARIO_DIR",
    "SEARCH_ORDER",
    "TraceFormatError",
    "TraceNotFound",
    "cache_folder",
    "find_trace",
    "load_scenario",
    "parse_trace_line",
    "read_trace",
    "trace_folders",
]

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "sim" / "scenarios"
MOONCAKE = "mooncake-conversation.jsonl"
_REPO = Path(__file__).resolve().parents[2]
CHECKOUT_TRACES = _REPO / "data" / "traces"

SEARCH_ORDER = (
    "$CATSPROTO_TRACES, then the checkout's data/traces, then the user's cache folder "
    "($XDG_CACHE_HOME/catsproto/traces, by default ~/.cache/catsproto/traces)"
)


def cache_folder() -> Path:
    """The user's cache folder for traces, where a downloaded trace is kept:
    $XDG_CACHE_HOME/catsproto/traces, or ~/.cache/catsproto/traces when XDG_CACHE_HOME
    is unset or relative (the XDG base directory spec ignores a relative one)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "catsproto" / "traces"


def trace_folders() -> list[Path]:
    """The folders `find_trace` looks in, in its order (SEARCH_ORDER), each once.
    Raises TraceFormatError when $CATSPROTO_TRACES is set but names no folder."""
    places = []
    env = os.environ.get("CATSPROTO_TRACES")
    if env:
        if not Path(env).is_dir():
            raise TraceFormatError(f"CATSPROTO_TRACES is {env!r}, which is not a folder")
        places.append(Path(env))
    places += [CHECKOUT_TRACES, cache_folder()]
    unique: list[Path] = []
    seen: set[Path] = set()
    for folder in places:
        real = folder.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(folder)
    return unique


def find_trace(name: str = MOONCAKE) -> Path:
    """Where a trace lives: the first of `trace_folders()` that holds it. Looks only,
    never downloads (`trace_download.find_or_download_trace` does). Raises TraceNotFound
    naming every place tried (each once)."""
    places = trace_folders()
    for folder in places:
        if (folder / name).is_file():
            return folder / name
    raise TraceNotFound(name, places)


class TraceFormatError(ValueError):
    """A trace or scenario file that cannot be used; says which line, file or folder."""


class TraceNotFound(TraceFormatError):
    """No folder of the search order holds the trace; `places` are the folders tried."""

    def __init__(self, name: str, places: list[Path]) -> None:
        self.name, self.places = name, places
        tried = ", ".join(str(p / name) for p in places)
        super().__init__(f"trace {name} not found (tried {tried}; set CATSPROTO_TRACES)")

    def __reduce__(self):  # picklable (to a worker process and back) with its fields
        return (TraceNotFound, (self.name, self.places))


_U64 = 1 << 64
MAX_TIMESTAMP_MS = 2.0**53  # ~285,000 years: every integer below it is an exact float


def _integer(obj: dict[str, Any], field: str, default: int | None = None) -> int:
    value = obj.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, not {value!r}")
    return value


def parse_trace_line(line: str, lineno: int = 0) -> TraceRequest:
    """One request of a trace line; a TraceFormatError names the line, the field and
    what is wrong with it (the line is a JSON object; timestamp a finite number of ms
    >= 0; input_length, output_length (default 0) integers >= 0; hash_ids a list of
    integers 0..2^64-1)."""
    where = f"trace line {lineno}"
    text = line.rstrip("\r\n")  # else an error at the end is "line 2, column 1"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        column = exc.pos + 1  # one line: the position in it, counted from 1
        end = " (the end of the line: cut short?)" if exc.pos >= len(text.rstrip()) else ""
        raise TraceFormatError(f"{where}: not JSON: {exc.msg} at column {column}{end}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: must be a JSON object, not {type(obj).__name__}")
    for field in ("timestamp", "input_length", "hash_ids"):
        if field not in obj:
            raise TraceFormatError(f"{where}: missing field {field!r}")
    try:
        stamp = obj["timestamp"]
        if not isinstance(stamp, int | float) or isinstance(stamp, bool):
            raise ValueError(f"timestamp must be a number of ms, not {stamp!r}")
        if not (math.isfinite(stamp) and 0 <= stamp <= MAX_TIMESTAMP_MS):
            raise ValueError(f"timestamp {stamp!r} outside 0..2^53 ms (finite, not negative)")
        ids = obj["hash_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"hash_ids must be a list of integers, not {type(ids).__name__}")
        for i, h in enumerate(ids):
            if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < _U64:
                raise ValueError(f"hash_ids[{i}] {h!r} is not an integer 0..2^64-1")
        return TraceRequest(
            float(stamp),
            _integer(obj, "input_length"),
            _integer(obj, "output_length", 0),
            tuple(ids),
        )
    except ValueError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace (the first `limit` if given)."""
    out: list[TraceRequest] = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceFormatError(
                        f"trace line {lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} "
                        f"at column {exc.start + 1})"
                    ) from None
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
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"scenario {p}: not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TraceFormatError(f"scenario {p}: {exc}") from None
    if not isinstance(doc, dict):
        raise TraceFormatError(
            f"scenario {p}: must be a JSON object (a table of keys), not {type(doc).__name__}"
        )
    return doc

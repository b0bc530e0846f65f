"""JSON bodies the daemons send: strict JSON (RFC 8259), which has no NaN or Infinity.

Python's `json.dumps` writes a non-finite float as the bare words NaN or Infinity, which
most JSON parsers refuse. A daemon's figure that is not a finite number (a time since
an event that never happened, a rate over nothing) is sent as null instead; the fast
path is one `allow_nan=False` dump, the slow one only for a body that holds such a value.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(obj: Any) -> Any:
    """`obj` with every non-finite float, at any depth of dicts, lists and tuples, None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_null(v) for v in obj]
    return obj


def json_body(obj: Any) -> bytes:
    """`obj` as strict JSON bytes: NaN and infinities become null."""
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except ValueError:  # a non-finite float somewhere (json raises nothing else here)
        return json.dumps(finite_or_null(obj), allow_nan=False).encode()

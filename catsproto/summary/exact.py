"""Kind 1, exact set: every block key, Golomb–Rice coded (see `riceset`).

params: empty. body: one Rice-coded key set, nothing after it. No false positives;
about log2(2^64 / n) + 1.5 bits per key, so it wins only for very small sets.
"""

from __future__ import annotations

import numpy as np

from catsproto.summary.base import (
    KIND_EXACT,
    Summary,
    SummaryDecodeError,
    in_sorted,
    register_kind,
    unique_keys,
)
from catsproto.summary.riceset import decode_rice_set, encode_rice_set, rice_set_size


@register_kind
class ExactSummary(Summary):
    """The exact set of block keys."""

    kind = KIND_EXACT

    def __init__(self, keys: object) -> None:
        self._keys = unique_keys(keys)
        self._keys.flags.writeable = False
        self._body: bytes | None = None

    @property
    def keys(self) -> np.ndarray:
        """Sorted distinct uint64 keys (read-only)."""
        return self._keys

    def __len__(self) -> int:
        return int(self._keys.size)

    @classmethod
    def from_keys(cls, keys: np.ndarray, target_fpr: float, seed: int) -> ExactSummary:
        return cls(keys)

    @classmethod
    def estimate_size(cls, keys: np.ndarray, target_fpr: float) -> int | None:
        return rice_set_size(keys)

    def params(self) -> bytes:
        return b""

    def encode(self) -> bytes:
        if self._body is None:
            self._body = encode_rice_set(self._keys)
        return self._body

    def size(self) -> int:
        return len(self._body) if self._body is not None else rice_set_size(self._keys)

    @classmethod
    def decode_body(cls, params: bytes, body: bytes) -> ExactSummary:
        if params:
            raise SummaryDecodeError(f"exact set takes no params, got {len(params)} bytes", 0)
        keys, end = decode_rice_set(body)
        if end != len(body):
            raise SummaryDecodeError(f"exact set ends at byte {end}, body has {len(body)}", end)
        out = cls(keys)
        out._body = body
        return out

    @property
    def fpr(self) -> float:
        return 0.0

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        return in_sorted(self._keys, np.asarray(keys, dtype=np.uint64))

"""Kind 4, delta: the keys added and removed since a base version, and applying it.

params: empty. body: the added keys, then the removed keys, each a Rice-coded set
(`riceset`, self-delimiting), nothing after them; a key in both sets is refused (a
delta has one canonical form). The base version is not in the body: it is the entry's
``base_version`` field.

Applying a delta to an exact set gives an exact set again (so in-order deltas equal a
fresh snapshot byte for byte). An approximate base cannot forget keys, so applying a
delta to a Bloom or fuse filter gives a `LayeredView`: member iff added, or in the base
filter and not removed. Removed keys are listed exactly, so a view never answers "no"
for a key the sender holds; its false-positive rate stays that of the base filter.
"""

from __future__ import annotations

import numpy as np

from catsproto.summary.base import (
    KIND_DELTA,
    Summary,
    SummaryDecodeError,
    in_sorted,
    register_kind,
    sorted_difference,
    unique_keys,
)
from catsproto.summary.exact import ExactSummary
from catsproto.summary.riceset import decode_rice_set, encode_rice_set, rice_set_size


@register_kind
class DeltaSummary(Summary):
    """Keys added and removed relative to a base version (membership: the added keys)."""

    kind = KIND_DELTA
    buildable = False

    def __init__(self, added: object, removed: object) -> None:
        self.added = unique_keys(added)
        self.removed = unique_keys(removed)
        if in_sorted(self.added, self.removed).any():
            raise ValueError("a key cannot be both added and removed")
        self._body: bytes | None = None
        self._size: int | None = None

    @classmethod
    def _of_sorted(cls, added: np.ndarray, removed: np.ndarray) -> DeltaSummary:
        """A delta of arrays known sorted, distinct and disjoint, which the caller hands
        over (a set difference, a decoded body): the constructor's checks skipped."""
        out = cls.__new__(cls)
        out.added, out.removed = added, removed
        out._body = None
        out._size = None
        return out

    @classmethod
    def between(cls, old_keys: object, new_keys: object) -> DeltaSummary:
        """The delta turning key set ``old_keys`` into ``new_keys``."""
        old, new = unique_keys(old_keys), unique_keys(new_keys)
        return cls._of_sorted(sorted_difference(new, old), sorted_difference(old, new))

    @property
    def changed(self) -> int:
        """Number of keys this delta adds or removes."""
        return int(self.added.size + self.removed.size)

    @classmethod
    def from_keys(cls, keys: np.ndarray, target_fpr: float, seed: int) -> DeltaSummary:
        raise ValueError("a delta is made with DeltaSummary.between(old, new)")

    @classmethod
    def estimate_size(cls, keys: np.ndarray, target_fpr: float) -> int | None:
        return None

    @staticmethod
    def size_between(old_keys: np.ndarray, new_keys: np.ndarray) -> int:
        """Body bytes of the delta between two sorted unique key arrays."""
        return rice_set_size(sorted_difference(new_keys, old_keys)) + (
            rice_set_size(sorted_difference(old_keys, new_keys))
        )

    def params(self) -> bytes:
        return b""

    def encode(self) -> bytes:
        if self._body is None:
            self._body = encode_rice_set(self.added) + encode_rice_set(self.removed)
        return self._body

    def size(self) -> int:
        """Body bytes, counted without encoding (a sender weighs many deltas it never
        sends against a snapshot)."""
        if self._size is None:
            self._size = (
                len(self._body)
                if self._body is not None
                else rice_set_size(self.added) + rice_set_size(self.removed)
            )
        return self._size

    @classmethod
    def decode_body(cls, params: bytes, body: bytes) -> DeltaSummary:
        if params:
            raise SummaryDecodeError(f"delta takes no params, got {len(params)} bytes", 0)
        added, mid = decode_rice_set(body)
        removed, end = decode_rice_set(body, mid)
        if end != len(body):
            raise SummaryDecodeError(f"delta ends at byte {end}, body has {len(body)}", end)
        if in_sorted(added, removed).any():
            raise SummaryDecodeError("delta adds and removes the same key", mid)
        out = cls._of_sorted(added, removed)
        out._body = body
        return out

    @property
    def fpr(self) -> float:
        return 0.0

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        return in_sorted(self.added, np.asarray(keys, dtype=np.uint64))


class LayeredView:
    """An approximate base filter with exact additions and removals on top."""

    def __init__(self, base: Summary, added: np.ndarray, removed: np.ndarray) -> None:
        self.base = base
        self.added = added
        self.removed = removed

    @property
    def fpr(self) -> float:
        return self.base.fpr

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        return in_sorted(self.added, keys) | (
            self.base.contains_many(keys) & ~in_sorted(self.removed, keys)
        )

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int | np.integer) or not 0 <= int(key) < 1 << 64:
            return False
        return bool(self.contains_many(np.array([int(key)], dtype=np.uint64))[0])


SummaryState = Summary | LayeredView


def apply_delta(state: SummaryState, delta: DeltaSummary) -> SummaryState:
    """The state after ``delta``: an exact set stays exact, a filter becomes a view."""
    if isinstance(state, DeltaSummary):
        raise ValueError("a delta applies to a snapshot or a view, not to another delta")
    if isinstance(state, ExactSummary):
        kept = sorted_difference(state.keys, delta.removed)
        return ExactSummary(np.union1d(kept, delta.added))
    if isinstance(state, LayeredView):
        base, added, removed = state.base, state.added, state.removed
    else:
        base, added = state, np.zeros(0, dtype=np.uint64)
        removed = np.zeros(0, dtype=np.uint64)
    added = np.union1d(sorted_difference(added, delta.removed), delta.added)
    removed = sorted_difference(np.union1d(removed, delta.removed), delta.added)
    return LayeredView(base, added, removed)

"""The summary abstraction shared by every kind, its error and the kind registry.

Strategy. A summary answers "might this block key be held?" for many keys at once. Each
kind is one class with `build`, `params`/`encode` (the opaque parameter and body bytes
of a cache-summary entry) and `decode`; `Summary.decode` dispatches through one explicit
dict from the wire's kind code to the class, filled by `register_kind`, which refuses a
code twice. Decoders accept exactly one encoding per summary (`encode(decode(b)) == b`)
and raise `SummaryDecodeError` — a `catsproto.wire.BadValueError`, so the codec's one
error family is all that ever escapes — with the byte offset inside the body.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from catsproto.wire import BadValueError

__all__ = [
    "KIND_BLOOM",
    "KIND_DELTA",
    "KIND_EXACT",
    "KIND_FUSE",
    "Summary",
    "SummaryDecodeError",
    "as_key_array",
    "register_kind",
]

KIND_EXACT = 1
KIND_BLOOM = 2
KIND_FUSE = 3
KIND_DELTA = 4

U64_MAX = (1 << 64) - 1
_BIG_U64 = np.dtype(">u8")


class SummaryDecodeError(BadValueError):
    """A summary's params or body are malformed or not in canonical form.

    ``offset`` is the byte offset inside the params (for parameter errors) or the body.
    """


def as_key_array(keys: object) -> np.ndarray:
    """Block keys as a 1-d uint64 array; Python ints must lie in 0..2^64-1."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys.reshape(-1)
        if keys.size and keys.dtype.kind == "i" and int(keys.min()) < 0:
            raise ValueError("block keys must be non-negative")
        if keys.size and keys.dtype.kind not in "iu":
            raise ValueError(f"block keys must be integers, got dtype {keys.dtype}")
        return keys.astype(np.uint64).reshape(-1)
    values = list(keys)  # type: ignore[call-overload]
    for v in values:
        if not isinstance(v, int | np.integer) or not 0 <= int(v) <= U64_MAX:
            raise ValueError(f"block key {v!r} is not a u64")
    return np.array([int(v) for v in values], dtype=np.uint64)


def unique_keys(keys: object) -> np.ndarray:
    """Sorted, duplicate-free uint64 keys (always a new array).

    Keys already strictly increasing (a shard's part, a decoded set, a set difference)
    are only checked and copied: one comparison instead of `np.unique`'s sort and mask.
    """
    arr = as_key_array(keys)
    if arr.size < 2 or (arr[1:] > arr[:-1]).all():
        return arr.copy()
    arr = np.sort(arr)  # distinct once sorted (an LRU's keys): no need for the mask
    if (arr[1:] > arr[:-1]).all():
        return arr
    return np.unique(arr)


def sorted_difference(keys: np.ndarray, other: np.ndarray) -> np.ndarray:
    """The keys of sorted unique `keys` not in sorted unique `other`, in order
    (`np.setdiff1d(keys, other, assume_unique=True)` by binary search, without its
    general set machinery)."""
    return keys[~in_sorted(other, keys)]


def in_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per key, whether it is in `sorted_keys` (sorted uint64): one binary search each,
    much cheaper than a general set test for the few keys of one request."""
    if sorted_keys.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    pos = np.searchsorted(sorted_keys, keys)
    pos[pos == sorted_keys.size] = 0
    return sorted_keys[pos] == keys


def low_bits(values: np.ndarray, width: int) -> np.ndarray:
    """The low ``width`` bits of every uint64 value, most significant first, as an
    (n, width) array of 0/1 bytes: one byte-order view and one `unpackbits`, instead of
    a shift and a mask per bit position."""
    big = np.ascontiguousarray(values, dtype=_BIG_U64).view(np.uint8)
    return np.unpackbits(big).reshape(-1, 64)[:, 64 - width :]


def from_bits(bits: np.ndarray) -> np.ndarray:
    """The inverse of `low_bits`: rows of at most 64 0/1 bytes (most significant first)
    as uint64 values, by packing each row, left-padded to 64 bits, into 8 bytes."""
    n, width = bits.shape
    padded = np.zeros((n, 64), dtype=np.uint8)
    padded[:, 64 - width :] = bits
    return np.packbits(padded, axis=1).view(_BIG_U64).reshape(n).astype(np.uint64)


class Summary(ABC):
    """A set of block keys answering membership, possibly with false positives."""

    kind: ClassVar[int]

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def build(keys: object, target_fpr: float, kind: int | None = None, seed: int = 0) -> Summary:
        """Summarise ``keys`` with false-positive rate at most ``target_fpr``.

        kind None picks the kind with the fewest params+body bytes that meets the target
        (ties go to the lower kind code); an exact set meets every target.
        """
        if not 0.0 <= target_fpr < 1.0:
            raise ValueError(f"target_fpr must be in [0, 1), got {target_fpr}")
        if not 0 <= seed <= U64_MAX:
            raise ValueError(f"seed {seed} is not a u64")
        ukeys = unique_keys(keys)
        if kind is None:
            kind = Summary.smallest_kind(ukeys, target_fpr)
        cls = kind_class(kind)
        if not cls.buildable:
            raise ValueError(f"summary kind {kind} cannot be built from a key set")
        return cls.from_keys(ukeys, target_fpr, seed)

    @staticmethod
    def estimates(keys: np.ndarray, target_fpr: float) -> dict[int, int]:
        """Expected params+body bytes of every buildable kind that meets the target."""
        out: dict[int, int] = {}
        for code in sorted(_KINDS):
            cls = _KINDS[code]
            size = cls.estimate_size(keys, target_fpr) if cls.buildable else None
            if size is not None:
                out[code] = size
        return out

    @staticmethod
    def smallest_kind(keys: np.ndarray, target_fpr: float) -> int:
        """The kind `build` picks: fewest expected bytes, ties to the lower code."""
        sizes = Summary.estimates(keys, target_fpr)
        return min(sizes, key=lambda code: (sizes[code], code))

    buildable: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def from_keys(cls, keys: np.ndarray, target_fpr: float, seed: int) -> Summary:
        """Build from sorted unique uint64 keys."""

    @classmethod
    @abstractmethod
    def estimate_size(cls, keys: np.ndarray, target_fpr: float) -> int | None:
        """Expected params+body bytes for these keys, or None if the kind cannot meet it."""

    # -- wire ------------------------------------------------------------------------
    @abstractmethod
    def params(self) -> bytes:
        """The kind's parameters (at most 255 bytes)."""

    @abstractmethod
    def encode(self) -> bytes:
        """The canonical body."""

    @classmethod
    @abstractmethod
    def decode_body(cls, params: bytes, body: bytes) -> Summary:
        """Parse params and body of this kind; raise SummaryDecodeError if malformed."""

    @staticmethod
    def decode(kind: int, params: bytes, body: bytes) -> Summary:
        """Parse a cache-summary entry's params and body for the given kind code."""
        cls = _KINDS.get(kind)
        if cls is None:
            raise SummaryDecodeError(f"unknown summary kind {kind}")
        if len(params) > 255:
            raise SummaryDecodeError(f"params of {len(params)} bytes exceed 255")
        return cls.decode_body(bytes(params), bytes(body))

    def size(self) -> int:
        """params + body bytes on the wire."""
        return len(self.params()) + len(self.encode())

    # -- membership ------------------------------------------------------------------
    @property
    @abstractmethod
    def fpr(self) -> float:
        """Expected false-positive rate for a key that is not a member."""

    @abstractmethod
    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        """Membership of every key of a uint64 array, as a bool array."""

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int | np.integer) or not 0 <= int(key) <= U64_MAX:
            return False
        return bool(self.contains_many(np.array([int(key)], dtype=np.uint64))[0])

    def same_bytes(self, other: Summary) -> bool:
        return (
            self.kind == other.kind
            and self.params() == other.params()
            and self.encode() == other.encode()
        )


_KINDS: dict[int, type[Summary]] = {}


def register_kind(cls: type[Summary]) -> type[Summary]:
    """Add a summary class under its kind code; a code registered twice raises."""
    code = cls.kind
    if not 1 <= code <= 255:
        raise ValueError(f"summary kind {code} is not a u8 code")
    if code in _KINDS:
        raise ValueError(f"summary kind {code} already registered by {_KINDS[code].__name__}")
    _KINDS[code] = cls
    return cls


def kind_class(kind: int) -> type[Summary]:
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown summary kind {kind}")
    return cls


def registered_kinds() -> dict[int, type[Summary]]:
    """A copy of the kind registry."""
    return dict(_KINDS)

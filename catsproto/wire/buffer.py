"""Bounded reading and length-prefixed writing of big-endian fields.

Strategy: a `Reader` is a window ``[pos, end)`` over one immutable buffer. Every inner
decoder gets its own window through `restrict_to(length)`, and leaving that window with
bytes unread is an error, so a TLV decoder can neither read past its value nor ignore
a tail of it. Offsets in errors are absolute (from the start of the whole buffer).
The `Writer` appends to a bytearray; `length_prefixed(width)` reserves a length field
and fills it in when the block closes, refusing values that do not fit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from math import copysign

from catsproto.wire.errors import BadLengthError, BadValueError, TruncatedError

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")


class Reader:
    """Reads big-endian fields from a window of a buffer; never past the window."""

    __slots__ = ("_data", "_end", "_pos", "tlv_type")

    def __init__(
        self, data: bytes, start: int = 0, end: int | None = None, tlv_type: int | None = None
    ):
        self._data = data
        self._pos = start
        self._end = len(data) if end is None else end
        self.tlv_type = tlv_type

    @property
    def offset(self) -> int:
        """Absolute offset of the next byte to read."""
        return self._pos

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def _take(self, n: int, field: str) -> int:
        start = self._pos
        if n > self._end - start:
            raise TruncatedError(
                f"{field} needs {n} byte{'' if n == 1 else 's'}, only {self._end - start} remain",
                start,
                self.tlv_type,
            )
        self._pos = start + n
        return start

    def u8(self, field: str) -> int:
        return self._data[self._take(1, field)]

    def u16(self, field: str) -> int:
        return _U16.unpack_from(self._data, self._take(2, field))[0]

    def u32(self, field: str) -> int:
        return _U32.unpack_from(self._data, self._take(4, field))[0]

    def u64(self, field: str) -> int:
        return _U64.unpack_from(self._data, self._take(8, field))[0]

    def f64(self, field: str) -> float:
        start = self._pos
        value = _F64.unpack_from(self._data, self._take(8, field))[0]
        if value != value or value in (float("inf"), float("-inf")):
            raise BadValueError(f"{field} is not a finite number", start, self.tlv_type)
        if value == 0.0 and copysign(1.0, value) < 0:
            raise BadValueError(f"{field} is -0.0 (zero is encoded as +0.0)", start, self.tlv_type)
        return value

    def unpack(self, fmt: struct.Struct) -> tuple | None:
        """All of `fmt` at once, or None (nothing consumed) if the window is too short."""
        start = self._pos
        if fmt.size > self._end - start:
            return None
        self._pos = start + fmt.size
        return fmt.unpack_from(self._data, start)

    def bytes(self, n: int, field: str) -> bytes:
        start = self._take(n, field)
        return bytes(self._data[start : start + n])

    def rest(self) -> bytes:
        """Everything left in the window (for opaque trailing fields)."""
        return self.bytes(self.remaining, "rest")

    def window(self, length: int, field: str, tlv_type: int | None = None) -> Reader:
        """A reader over the next `length` bytes; hand it back to `close` when done."""
        start = self._pos
        inner_type = self.tlv_type if tlv_type is None else tlv_type
        if length > self._end - start:
            raise BadLengthError(
                f"{field} length {length} exceeds remaining {self._end - start} bytes",
                start,
                inner_type,
            )
        return Reader(self._data, start, start + length, inner_type)

    def close(self, inner: Reader, field: str) -> None:
        """Step past `inner`'s window, which must have been consumed whole."""
        if inner._pos != inner._end:
            raise BadLengthError(
                f"{field} leaves {inner._end - inner._pos} of {inner._end - self._pos} "
                "bytes unread",
                inner._pos,
                inner.tlv_type,
            )
        self._pos = inner._end

    @contextmanager
    def restrict_to(self, length: int, field: str, tlv_type: int | None = None) -> Iterator[Reader]:
        """Yield a reader over the next `length` bytes that must be consumed whole."""
        inner = self.window(length, field, tlv_type)
        yield inner
        self.close(inner, field)


class Writer:
    """Appends big-endian fields; `length_prefixed` back-fills a length field."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def __len__(self) -> int:
        return len(self._buf)

    def getvalue(self) -> bytes:
        return bytes(self._buf)

    def u8(self, value: int) -> None:
        self._buf.append(value)

    def u16(self, value: int) -> None:
        self._buf += _U16.pack(value)

    def u32(self, value: int) -> None:
        self._buf += _U32.pack(value)

    def u64(self, value: int) -> None:
        self._buf += _U64.pack(value)

    def f64(self, value: float) -> None:
        self._buf += _F64.pack(value)

    def bytes(self, value: bytes) -> None:
        self._buf += value

    @contextmanager
    def length_prefixed(self, width: int, field: str = "value") -> Iterator[Writer]:
        """Reserve a `width`-byte length, let the caller write, then fill it in."""
        at = len(self._buf)
        self._buf += bytes(width)
        yield self
        length = len(self._buf) - at - width
        if length >= 1 << (8 * width):
            raise BadLengthError(f"{field} of {length} bytes does not fit a {width}-byte length")
        self._buf[at : at + width] = length.to_bytes(width, "big")

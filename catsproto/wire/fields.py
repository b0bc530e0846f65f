"""Declarative field layouts: one annotation per field says how it sits on the wire.

Strategy: a record is a frozen dataclass whose fields are annotated
``Annotated[python_type, codec]``. The `record` decorator reads those annotations once,
at class definition, into an immutable layout; encoding, decoding, range checks and the
JSON form are then the same short loops for every record instead of hand-written code
per TLV (the way scapy's ``fields_desc`` describes a packet). Range checks run when an
object is built, so an out-of-range object cannot exist and the encoder never has to
second-guess its input. A record adds its cross-field rules in ``validate()``.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import operator
import struct
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from catsproto.wire.buffer import Reader, Writer
from catsproto.wire.errors import BadLengthError, BadValueError, CodecError, NonCanonicalError

JSON = Any
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class FieldCodec:
    """How one field is read, written, range-checked and shown as JSON."""

    def read(self, r: Reader, name: str) -> Any:
        raise NotImplementedError

    def write(self, w: Writer, value: Any) -> None:
        raise NotImplementedError

    def check(self, value: Any, name: str) -> None:
        """Raise BadValueError if `value` cannot be encoded by this codec."""

    def to_json(self, value: Any) -> JSON:
        return value

    def from_json(self, obj: JSON, name: str) -> Any:
        return obj


def _require(ok: bool, name: str, what: str | Callable[[], str]) -> None:
    """Raise BadValueError naming the field unless `ok`. Pass `what` as a lambda when
    building its text costs something: checks run on every record built."""
    if not ok:
        raise BadValueError(f"{name} {what() if callable(what) else what}")


class UInt(FieldCodec):
    """Unsigned big-endian integer of 1, 2, 4 or 8 bytes, optionally narrowed to [lo, hi]."""

    def __init__(self, width: int, lo: int = 0, hi: int | None = None):
        self.width = width
        self.fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
        self.lo = lo
        self.hi = (1 << (8 * width)) - 1 if hi is None else hi
        self._read = {1: Reader.u8, 2: Reader.u16, 4: Reader.u32, 8: Reader.u64}[width]
        self._write = {1: Writer.u8, 2: Writer.u16, 4: Writer.u32, 8: Writer.u64}[width]

    def read(self, r: Reader, name: str) -> int:
        start = r.offset
        return self.convert(self._read(r, name), name, start, r.tlv_type)

    def convert(self, value: int, name: str, at: int, tlv_type: int | None) -> int:
        if not self.lo <= value <= self.hi:
            raise BadValueError(f"{name} {value} outside {self.lo}..{self.hi}", at, tlv_type)
        return value

    def write(self, w: Writer, value: int) -> None:
        self._write(w, value)

    def check(self, value: Any, name: str) -> None:
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            name,
            lambda: f"must be an integer, not {type(value).__name__}",
        )
        _require(self.lo <= value <= self.hi, name, lambda: f"{value} outside {self.lo}..{self.hi}")

    def from_json(self, obj: JSON, name: str) -> int:
        self.check(obj, name)
        return obj


class EnumCodec(FieldCodec):
    """An IntEnum carried as an unsigned integer; JSON shows the lower-case member name."""

    def __init__(self, inner: UInt, enum_type: type[enum.IntEnum]):
        self.inner = inner
        self.fmt = inner.fmt
        self.enum_type = enum_type
        self.members = {int(m): m for m in enum_type}
        self.names = ", ".join(m.name.lower() for m in enum_type)

    def read(self, r: Reader, name: str) -> enum.IntEnum:
        start = r.offset
        return self.convert(self.inner._read(r, name), name, start, r.tlv_type)

    def convert(self, value: int, name: str, at: int, tlv_type: int | None) -> enum.IntEnum:
        member = self.members.get(value)
        if member is None:
            raise BadValueError(f"{name} {value} is not one of {self.names}", at, tlv_type)
        return member

    def write(self, w: Writer, value: enum.IntEnum) -> None:
        self.inner.write(w, int(value))

    def check(self, value: Any, name: str) -> None:
        _require(
            isinstance(value, self.enum_type),
            name,
            lambda: f"must be one of {self.names}, not {value!r}",
        )

    def to_json(self, value: enum.IntEnum) -> JSON:
        return value.name.lower()

    def from_json(self, obj: JSON, name: str) -> enum.IntEnum:
        if isinstance(obj, str) and obj.upper() in self.enum_type.__members__:
            return self.enum_type[obj.upper()]
        raise BadValueError(f"{name} must be one of {self.names}, not {obj!r}")


class OpenEnum:
    """Marks an enum field that also carries codes the enum does not (yet) name: known
    codes decode to members, others stay plain ints and re-encode unchanged. For fields
    whose new values a receiver can skip, such as the kind of one summary entry."""

    def __init__(self, inner: UInt):
        self.inner = inner


class OpenEnumCodec(EnumCodec):
    def convert(self, value: int, name: str, at: int, tlv_type: int | None) -> int:
        value = self.inner.convert(value, name, at, tlv_type)  # the range still applies
        return self.members.get(value, value)

    def check(self, value: Any, name: str) -> None:
        if not isinstance(value, self.enum_type):
            self.inner.check(value, name)

    def to_json(self, value: int) -> JSON:
        return value.name.lower() if isinstance(value, self.enum_type) else value

    def from_json(self, obj: JSON, name: str) -> int:
        if isinstance(obj, int) and not isinstance(obj, bool):
            self.inner.check(obj, name)
            return self.members.get(obj, obj)
        return super().from_json(obj, name)


class Float64(FieldCodec):
    """IEEE 754 binary64; NaN and infinities are refused (they have no single encoding),
    and so is -0.0: it equals +0.0, so two byte strings would decode to equal objects."""

    fmt = "d"

    def read(self, r: Reader, name: str) -> float:
        return r.f64(name)

    def convert(self, value: float, name: str, at: int, tlv_type: int | None) -> float:
        if value != value or value in (float("inf"), float("-inf")):
            raise BadValueError(f"{name} is not a finite number", at, tlv_type)
        if value == 0.0 and math.copysign(1.0, value) < 0:
            raise BadValueError(f"{name} is -0.0 (zero is encoded as +0.0)", at, tlv_type)
        return value

    def write(self, w: Writer, value: float) -> None:
        w.f64(value)

    def check(self, value: Any, name: str) -> None:
        _require(
            isinstance(value, float) and value == value and abs(value) != float("inf"),
            name,
            lambda: f"must be a finite float, not {value!r}",
        )
        _require(
            value != 0.0 or math.copysign(1.0, value) > 0,
            name,
            "must not be -0.0 (zero is +0.0, its one encoding)",
        )

    def from_json(self, obj: JSON, name: str) -> float:
        if isinstance(obj, int) and not isinstance(obj, bool):
            obj = float(obj)
        self.check(obj, name)
        return obj


class Blob(FieldCodec):
    """Bytes behind a `width`-byte length, or (width 0) the rest of the window. JSON: hex."""

    def __init__(self, width: int = 0, min_len: int = 0, max_len: int | None = None):
        self.width = width
        self.min_len = min_len
        limit = (1 << (8 * width)) - 1 if width else 65535
        self.max_len = limit if max_len is None else min(max_len, limit)

    def read(self, r: Reader, name: str) -> bytes:
        start = r.offset
        n = {0: lambda: r.remaining, 1: lambda: r.u8(name), 2: lambda: r.u16(name)}[self.width]()
        if not self.min_len <= n <= self.max_len:
            raise BadLengthError(
                f"{name} length {n} outside {self.min_len}..{self.max_len}", start, r.tlv_type
            )
        return r.bytes(n, name)

    def write(self, w: Writer, value: bytes) -> None:
        if self.width == 1:
            w.u8(len(value))
        elif self.width == 2:
            w.u16(len(value))
        w.bytes(value)

    def check(self, value: Any, name: str) -> None:
        _require(
            isinstance(value, bytes), name, lambda: f"must be bytes, not {type(value).__name__}"
        )
        _require(
            self.min_len <= len(value) <= self.max_len,
            name,
            lambda: f"length {len(value)} outside {self.min_len}..{self.max_len}",
        )

    def to_json(self, value: bytes) -> JSON:
        return value.hex()

    def from_json(self, obj: JSON, name: str) -> bytes:
        try:
            value = bytes.fromhex(obj)
        except (TypeError, ValueError):
            raise BadValueError(f"{name} must be a hex string, not {obj!r}") from None
        self.check(value, name)
        return value


class Text(FieldCodec):
    """UTF-8 text behind a one-byte length (1..255 bytes once encoded)."""

    def __init__(self) -> None:
        self.blob = Blob(1, min_len=1)

    def read(self, r: Reader, name: str) -> str:
        start = r.offset
        raw = self.blob.read(r, name)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadValueError(
                f"{name} is not UTF-8 (byte {exc.start})", start + 1 + exc.start, r.tlv_type
            ) from None

    def write(self, w: Writer, value: str) -> None:
        self.blob.write(w, value.encode("utf-8"))

    def check(self, value: Any, name: str) -> None:
        _require(isinstance(value, str), name, "must be text")
        try:
            self.blob.check(value.encode("utf-8"), name)
        except UnicodeEncodeError:
            raise BadValueError(f"{name} cannot be encoded as UTF-8") from None


class Address(FieldCodec):
    """An IPv4 or IPv6 address after its AFI (u16: 1 = IPv4, 2 = IPv6, IANA numbers)."""

    def read(self, r: Reader, name: str) -> IPAddress:
        start = r.offset
        afi = r.u16(f"{name} AFI")
        if afi == 1:
            return ipaddress.IPv4Address(r.bytes(4, name))
        if afi == 2:
            return ipaddress.IPv6Address(r.bytes(16, name))
        raise BadValueError(f"{name} AFI {afi} is neither 1 (IPv4) nor 2 (IPv6)", start, r.tlv_type)

    def write(self, w: Writer, value: IPAddress) -> None:
        w.u16(1 if value.version == 4 else 2)
        w.bytes(value.packed)

    def check(self, value: Any, name: str) -> None:
        _require(
            isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address),
            name,
            "must be an IPv4 or IPv6 address",
        )

    def to_json(self, value: IPAddress) -> JSON:
        return str(value)

    def from_json(self, obj: JSON, name: str) -> IPAddress:
        try:
            return ipaddress.ip_address(obj)
        except ValueError:
            raise BadValueError(f"{name} {obj!r} is not an IP address") from None


class Items(FieldCodec):
    """A run of records filling the rest of the window (non-empty), each optionally
    behind its own `prefix`-byte length. Order and uniqueness are the owner's rule."""

    def __init__(self, item: type[Record], prefix: int = 0):
        self.item = item
        self.prefix = prefix

    def read(self, r: Reader, name: str) -> tuple[Record, ...]:
        items = []
        start = r.offset
        while r.remaining:
            index = len(items)
            if self.prefix:
                length = r.u16(f"{name}[{index}] length") if self.prefix == 2 else r.u8(name)
                with r.restrict_to(length, f"{name}[{index}]") as inner:
                    items.append(self.item.decode_from(inner))
            else:
                items.append(self.item.decode_from(r))
        if not items:
            raise NonCanonicalError(f"{name} is empty: omit the TLV instead", start, r.tlv_type)
        return tuple(items)

    def write(self, w: Writer, value: tuple[Record, ...]) -> None:
        for item in value:
            if self.prefix:
                with w.length_prefixed(self.prefix, self.item.__name__):
                    item.encode_into(w)
            else:
                item.encode_into(w)

    def check(self, value: Any, name: str) -> None:
        _require(isinstance(value, tuple), name, "must be a tuple")
        _require(len(value) > 0, name, "must not be empty (omit the TLV instead)")
        for i, item in enumerate(value):
            _require(
                isinstance(item, self.item), f"{name}[{i}]", lambda: f"must be {self.item.__name__}"
            )

    def to_json(self, value: tuple[Record, ...]) -> JSON:
        return [item.to_json() for item in value]

    def from_json(self, obj: JSON, name: str) -> tuple[Record, ...]:
        if not isinstance(obj, list):
            raise BadValueError(f"{name} must be a list")
        return tuple(self.item.from_json(x, f"{name}[{i}]") for i, x in enumerate(obj))


U8, U16, U32, U64 = UInt(1), UInt(2), UInt(4), UInt(8)
F64 = Float64()


def strictly_increasing(items: tuple[Any, ...], key: Callable[[Any], Any], name: str) -> None:
    """Canonical lists are sorted by `key` without repeats. (`key` is best an
    `operator.attrgetter`: the common, passing case then runs without a Python frame.)"""
    keys = list(map(key, items))
    if all(map(operator.lt, keys, keys[1:])):
        return
    for i in range(1, len(keys)):
        if keys[i - 1] >= keys[i]:
            raise NonCanonicalError(
                f"{name}[{i}] is not after {name}[{i - 1}]: entries must be strictly increasing"
            )


R = TypeVar("R", bound="Record")


class Record:
    """A frozen dataclass laid out field by field as its annotations say."""

    __slots__ = ()
    _LAYOUT: ClassVar[tuple[tuple[str, FieldCodec], ...]] = ()
    _STEPS: ClassVar[tuple[_FixedRun | tuple[str, FieldCodec], ...]] = ()
    # A record holding one canonical list says so here rather than in `validate`:
    # (the list field, the item fields of its key); the list must be strictly increasing
    # by that key. The compiled decoders then check the order while reading the items.
    SORTED_BY: ClassVar[tuple[str, tuple[str, ...]] | None] = None

    def __post_init__(self) -> None:
        for name, codec in self._LAYOUT:
            codec.check(getattr(self, name), name)
        self.validate()

    def validate(self) -> None:
        """Cross-field rules; raise a CodecError subclass (offset left to the decoder).
        This base form checks `SORTED_BY`; a record with other rules overrides it."""
        if self.SORTED_BY is not None:
            field, keys = self.SORTED_BY
            strictly_increasing(getattr(self, field), operator.attrgetter(*keys), field)

    def encode_into(self, w: Writer) -> None:
        for name, codec in self._LAYOUT:
            codec.write(w, getattr(self, name))

    @classmethod
    def decode_from(cls: type[R], r: Reader) -> R:
        """Read the fields in order. Runs of fixed-width fields are unpacked with one
        struct call; each value is range-checked as it is read, so only the record's
        cross-field `validate` runs afterwards."""
        start = r.offset
        obj = object.__new__(cls)
        for step in cls._STEPS:
            if isinstance(step, _FixedRun):
                at = r.offset
                values = r.unpack(step.struct)
                if values is None:  # too short: read field by field to say which one
                    for name, codec in step.fields:
                        object.__setattr__(obj, name, codec.read(r, name))
                    continue
                for (name, codec), offset, value in zip(
                    step.fields, step.offsets, values, strict=True
                ):
                    object.__setattr__(
                        obj, name, codec.convert(value, name, at + offset, r.tlv_type)
                    )
            else:
                name, codec = step
                object.__setattr__(obj, name, codec.read(r, name))
        try:
            obj.validate()
        except CodecError as exc:
            raise exc.located(start, r.tlv_type) from None
        return obj

    def to_json(self) -> JSON:
        return {name: codec.to_json(getattr(self, name)) for name, codec in self._LAYOUT}

    @classmethod
    def from_json(cls: type[R], obj: JSON, where: str = "") -> R:
        if not isinstance(obj, dict):
            raise BadValueError(f"{where or cls.__name__} must be an object")
        names = [name for name, _ in cls._LAYOUT]
        extra = sorted(set(obj) - set(names))
        missing = [n for n in names if n not in obj]
        if extra or missing:
            raise BadValueError(
                f"{where or cls.__name__}: unexpected {extra} / missing {missing} "
                f"(fields are {names})"
            )
        prefix = f"{where}." if where else ""
        return cls(*(codec.from_json(obj[n], prefix + n) for n, codec in cls._LAYOUT))


class _FixedRun:
    """Consecutive fixed-width fields, unpacked together."""

    def __init__(self, fields: list[tuple[str, FieldCodec]]):
        self.fields = tuple(fields)
        self.struct = struct.Struct(">" + "".join(c.fmt for _, c in fields))  # type: ignore[attr-defined]
        offsets, at = [], 0
        for _, codec in fields:
            offsets.append(at)
            at += struct.calcsize(">" + codec.fmt)  # type: ignore[attr-defined]
        self.offsets = tuple(offsets)


def _steps(layout: list[tuple[str, FieldCodec]]) -> tuple[_FixedRun | tuple[str, FieldCodec], ...]:
    steps: list[_FixedRun | tuple[str, FieldCodec]] = []
    run: list[tuple[str, FieldCodec]] = []
    for name, codec in layout:
        if hasattr(codec, "convert"):
            run.append((name, codec))
            continue
        if run:
            steps.append(_FixedRun(run))
            run = []
        steps.append((name, codec))
    if run:
        steps.append(_FixedRun(run))
    return tuple(steps)


def record(cls: type[R]) -> type[R]:
    """Make `cls` a frozen, slotted dataclass and fix its wire layout from annotations."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    layout = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is not typing.Annotated:
            raise TypeError(f"{cls.__name__}.{f.name} has no wire codec annotation")
        base, codec = typing.get_args(hint)[:2]
        if isinstance(codec, OpenEnum):
            members = [t for t in typing.get_args(base) if isinstance(t, type)]
            codec = OpenEnumCodec(
                codec.inner, next(t for t in members if issubclass(t, enum.IntEnum))
            )
        elif isinstance(base, type) and issubclass(base, enum.IntEnum):
            codec = EnumCodec(codec, base)
        layout.append((f.name, codec))
    cls._LAYOUT = tuple(layout)
    cls._STEPS = _steps(layout)
    return cls

"""TLV framing, the type registry and the RFC 7606 action each TLV type declares.

```
 0                   1                   2                   3
 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
|            Type (16)          |          Length (16)          |
+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
|                    Value (Length octets) ...                  |
+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
```

Types and lengths are 16 bits (the attribute itself is at most 65535 bytes long, RFC
4271 extended length). A registry maps each type code to one record class; a type not
in the registry decodes to `UnknownTLV` and is re-emitted byte for byte, so a selector
that knows fewer TLVs than the origin still verifies the origin's signature.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import ClassVar

from catsproto.wire.buffer import Reader, Writer
from catsproto.wire.codes import MANDATORY_TYPES, MAX_TLVS, tlv_name
from catsproto.wire.compiled import SequenceDecoder, compile_sequence, compile_tlv_value
from catsproto.wire.errors import BadLengthError, BadValueError, CodecError, NonCanonicalError
from catsproto.wire.fields import JSON, Record

TLV_HEADER_LEN = 4


class ErrorAction(enum.Enum):
    """What a receiver does with an attribute whose TLV of this type is malformed
    (RFC 7606 section 2 vocabulary; never a session reset)."""

    TREAT_AS_WITHDRAW = "treat-as-withdraw"
    ATTRIBUTE_DISCARD = "attribute-discard"


class TLV(Record):
    """A record that is also a top-level TLV of the advertisement."""

    __slots__ = ()
    TYPE: ClassVar[int]
    NAME: ClassVar[str]
    ON_ERROR: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW

    @property
    def type(self) -> int:
        return self.TYPE

    def encode_tlv(self, w: Writer) -> None:
        w.u16(self.TYPE)
        with w.length_prefixed(2, f"{self.NAME} TLV"):
            self.encode_into(w)


@dataclasses.dataclass(frozen=True, slots=True)
class UnknownTLV:
    """A TLV of a type this registry does not know: kept whole, re-emitted unchanged."""

    type: int
    value: bytes

    NAME: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        code = self.type
        if not (isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 0xFFFF):
            raise BadValueError(f"unknown TLV type {self.type!r} outside 0..65535")
        if not isinstance(self.value, bytes) or len(self.value) > 0xFFFF:
            raise BadValueError("unknown TLV value must be bytes of at most 65535")

    def encode_tlv(self, w: Writer) -> None:
        w.u16(self.type)
        w.u16(len(self.value))
        w.bytes(self.value)

    def to_json(self) -> JSON:
        return {"type": self.type, "value": self.value.hex()}


AnyTLV = TLV | UnknownTLV


def too_many_tlvs(at: int, tlv_type: int) -> BadLengthError:
    """The error of a value's 65th TLV (framing rule 7), whose header is at `at`."""
    return BadLengthError(f"one TLV more than the {MAX_TLVS} a value may hold", at, tlv_type)


class Registry:
    """Type code → TLV class. Immutable once built; `extended` returns a new one.

    `compiled` maps each type code to its class's compiled decoder and
    `compiled_sequence` decodes a run of registered TLVs inline (`wire.compiled`),
    both built here once; `decode_tlv` is the reference path.
    """

    def __init__(self, classes: Iterable[type[TLV]] = ()):
        by_type: dict[int, type[TLV]] = {}
        by_name: dict[str, type[TLV]] = {}
        for cls in classes:
            if cls.TYPE in by_type:
                raise ValueError(
                    f"TLV type {cls.TYPE} registered twice: "
                    f"{by_type[cls.TYPE].__name__} and {cls.__name__}"
                )
            if cls.NAME in by_name or cls.NAME == UnknownTLV.NAME:
                raise ValueError(f"TLV name {cls.NAME!r} registered twice")
            by_type[cls.TYPE] = cls
            by_name[cls.NAME] = cls
        self.by_type: Mapping[int, type[TLV]] = MappingProxyType(by_type)
        self.by_name: Mapping[str, type[TLV]] = MappingProxyType(by_name)
        # a plain dict, read-only by convention: the decode loop looks it up per TLV
        self.compiled: dict[int, Callable[[bytes, int, int], TLV]] = {
            code: compile_tlv_value(cls) for code, cls in by_type.items()
        }
        self.compiled_sequence: SequenceDecoder = compile_sequence(by_type, MANDATORY_TYPES)

    def extended(self, *classes: type[TLV]) -> Registry:
        return Registry([*self.by_type.values(), *classes])

    def decode_tlv(self, r: Reader) -> AnyTLV:
        """Read one TLV (header and value) from `r`."""
        tlv_type = r.u16("TLV type")
        length = r.u16("TLV length")
        cls = self.by_type.get(tlv_type)
        inner = r.window(length, "TLV value", tlv_type)
        tlv = UnknownTLV(tlv_type, inner.rest()) if cls is None else cls.decode_from(inner)
        r.close(inner, "TLV value")
        return tlv

    def decode_tlvs(self, r: Reader) -> tuple[AnyTLV, ...]:
        """The TLV sequence filling `r`'s window; on failure, every error RFC 7606 needs.

        Two passes. The first walks the TLV headers only, up to the first framing error:
        a truncated header, a length beyond the window, a type not above the previous
        one. Such an error is marked `framing` (no boundary after it can be trusted, so
        treat-as-withdraw applies whatever the TLV). The second decodes the values the
        first pass delimited and goes on past a malformed one. The error raised is the
        first in byte order (a TLV's own value comes before its order error), as the
        one-pass decoder raised it; it carries the others in `more`, and with the
        framing intact a missing mandatory TLV too.
        """
        start = r.offset
        spans: list[tuple[int, int, Reader]] = []  # (type, value length, value window)
        framing: CodecError | None = None
        previous = -1
        try:
            while r.remaining:
                at = r.offset
                tlv_type = r.u16("TLV type")
                length = r.u16("TLV length")
                inner = r.window(length, "TLV value", tlv_type)
                if len(spans) == MAX_TLVS:
                    raise too_many_tlvs(at, tlv_type)
                spans.append((tlv_type, length, inner))
                if tlv_type <= previous:
                    rule = "repeats" if tlv_type == previous else "comes after"
                    raise NonCanonicalError(
                        f"type {tlv_type} {rule} {tlv_name(previous)}: "
                        "types must be strictly increasing",
                        at,
                        tlv_type,
                    )
                previous = tlv_type
                r.bytes(length, "TLV value")  # step over it (the window checked the length)
        except CodecError as exc:
            framing = exc.as_framing()
        tlvs: list[AnyTLV] = []
        errors: list[CodecError] = []
        for tlv_type, length, inner in spans:
            cls = self.by_type.get(tlv_type)
            if cls is None:
                tlvs.append(UnknownTLV(tlv_type, inner.rest()))
                continue
            try:
                tlvs.append(cls.decode_from(inner))
                if inner.remaining:  # as `Reader.close` says it
                    raise BadLengthError(
                        f"TLV value leaves {inner.remaining} of {length} bytes unread",
                        inner.offset,
                        tlv_type,
                    )
            except CodecError as exc:
                errors.append(exc)
        if framing is not None:
            errors.append(framing)
        elif errors:
            present = {tlv_type for tlv_type, _, _ in spans}
            errors.extend(
                BadValueError(f"mandatory {tlv_name(code)} TLV is missing", start)
                for code in sorted(MANDATORY_TYPES - present)
            )
        else:
            return tuple(tlvs)
        first = errors[0]
        first.more = tuple(errors[1:])
        raise first

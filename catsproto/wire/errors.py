"""One error family for everything the codec refuses.

Every refusal says *where* (byte offset from the start of the buffer handed to the
decoder), *in what* (the TLV type being read, if any) and *why*, so that a log line
or the CLI can print `cache-summaries TLV at offset 41: length 9000 exceeds remaining
120 bytes` and an operator can find the byte in a capture.

Validation done while *building* an object (outside any buffer) raises the same
classes with ``offset=None``; the decoder fills the offset in as it re-raises.

Two marks feed the RFC 7606 action (`wire.error_action`): `framing` is true when the
TLV sequence itself is broken (a truncated TLV header, a TLV length beyond the value,
a type out of order or repeated), so no TLV boundary after it can be trusted; `more`
holds the errors of the other malformed TLVs the decoder found after the first one
(only when the framing is intact), so the strongest action among them all applies.
"""

from __future__ import annotations

from catsproto.wire.codes import tlv_name


class CodecError(Exception):
    """Base of every error the codec raises. Nothing else escapes `decode`."""

    framing: bool = False  # the TLV framing is broken (set on the instance by the decoder)
    more: tuple[CodecError, ...] = ()  # the other malformed TLVs' errors, first one aside

    def __init__(self, reason: str, offset: int | None = None, tlv_type: int | None = None):
        self.reason = reason
        self.offset = offset
        self.tlv_type = tlv_type
        super().__init__(reason)

    def located(self, offset: int | None, tlv_type: int | None) -> CodecError:
        """The same error with offset / TLV type filled in where they were unknown."""
        out = type(self)(
            self.reason,
            self.offset if self.offset is not None else offset,
            self.tlv_type if self.tlv_type is not None else tlv_type,
        )
        out.framing, out.more = self.framing, self.more
        return out

    def as_framing(self) -> CodecError:
        """This error, marked as breaking the TLV framing (treat-as-withdraw)."""
        self.framing = True
        return self

    def __str__(self) -> str:
        where = []
        if self.tlv_type is not None:
            where.append(f"{tlv_name(self.tlv_type)} TLV")
        if self.offset is not None:
            where.append(f"at offset {self.offset}")
        return f"{' '.join(where)}: {self.reason}" if where else self.reason


class TruncatedError(CodecError):
    """The input ended before a field it announced."""


class BadLengthError(CodecError):
    """A length field disagrees with the bytes its value needs or leaves."""


class NonCanonicalError(CodecError):
    """Well-formed but not the one canonical encoding (order, duplicates, padding)."""


class BadValueError(CodecError):
    """A field holds a value outside its documented range or meaning."""

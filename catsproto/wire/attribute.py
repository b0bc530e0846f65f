"""The BGP path attribute that carries an advertisement (RFC 4271 section 4.3).

```
+---------------+---------------+-------------------------------+
| Attr. Flags   | Attr. Type    | Length (1 octet, or 2 when    |
| O T P E 0 0 0 0               |  the Extended Length bit E)   |
+---------------+---------------+-------------------------------+
| Value: the advertisement's TLVs ...                           |
+---------------------------------------------------------------+
```

We send Optional + Transitive (0xC0), adding Extended Length (0x10) only when the value
exceeds 255 bytes. On receipt the Partial bit (0x20), which transit routers set on an
optional transitive attribute they do not recognise (RFC 4271 section 5), and an
Extended Length bit on a short value are both accepted: neither changes the value,
and only the value is signed. The four low flag bits are ignored, as RFC 4271 asks.
"""

from __future__ import annotations

import dataclasses

from catsproto.wire.buffer import Reader
from catsproto.wire.codes import DEFAULT_ATTRIBUTE_TYPE
from catsproto.wire.errors import BadValueError

FLAG_OPTIONAL = 0x80
FLAG_TRANSITIVE = 0x40
FLAG_PARTIAL = 0x20
FLAG_EXTENDED_LENGTH = 0x10
BARE_VALUE_START = b"\x00\x01"
"""How every attribute value starts (the Version TLV's type, first since types increase);
as a whole attribute it would be flags 0x00, which no valid attribute has."""


@dataclasses.dataclass(frozen=True, slots=True)
class PathAttribute:
    """A parsed attribute header and where its value sits in the input."""

    flags: int
    type_code: int
    value: bytes
    value_offset: int

    @property
    def partial(self) -> bool:
        return bool(self.flags & FLAG_PARTIAL)


def encode_attribute(value: bytes, type_code: int = DEFAULT_ATTRIBUTE_TYPE) -> bytes:
    """Flags, type, length and value of the attribute carrying `value`."""
    if not 0 <= type_code <= 255:
        raise BadValueError(f"attribute type code {type_code} outside 0..255")
    if len(value) > 0xFFFF:
        raise BadValueError(f"attribute value of {len(value)} bytes exceeds 65535")
    flags = FLAG_OPTIONAL | FLAG_TRANSITIVE
    if len(value) > 255:
        return (
            bytes([flags | FLAG_EXTENDED_LENGTH, type_code]) + len(value).to_bytes(2, "big") + value
        )
    return bytes([flags, type_code, len(value)]) + value


def read_attribute(r: Reader) -> PathAttribute:
    """Read one path attribute (any type) from `r`."""
    flags = r.u8("attribute flags")
    type_code = r.u8("attribute type")
    length = r.u16("attribute length") if flags & FLAG_EXTENDED_LENGTH else r.u8("attribute length")
    at = r.offset
    with r.restrict_to(length, "attribute value") as inner:
        return PathAttribute(flags, type_code, inner.rest(), at)


def decode_attribute(data: bytes, type_code: int = DEFAULT_ATTRIBUTE_TYPE) -> PathAttribute:
    """Parse exactly one whole attribute of `type_code`; the value is not decoded here."""
    wanted = FLAG_OPTIONAL | FLAG_TRANSITIVE
    if bytes(data[:2]) == BARE_VALUE_START:
        raise BadValueError(
            f"attribute flags 0x00 lack optional+transitive ({wanted:#04x}): the input starts "
            "00 01, the Version TLV's type, so it looks like an attribute value without its "
            "flags, type and length",
            0,
        )
    r = Reader(bytes(data))
    attr = read_attribute(r)
    if r.remaining:
        raise BadValueError(f"{r.remaining} bytes follow the attribute", r.offset)
    if attr.type_code != type_code:
        raise BadValueError(f"attribute type {attr.type_code}, expected {type_code}", 1)
    if attr.flags & wanted != wanted:
        raise BadValueError(
            f"attribute flags {attr.flags:#04x} lack optional+transitive ({wanted:#04x})", 0
        )
    return attr

"""Just enough of a BGP UPDATE (RFC 4271 section 4.3) to carry and find our attribute.

Used by tests, benchmarks and capture inspection: build an UPDATE for IPv4 /32 routes
with ORIGIN, a four-octet AS_PATH (RFC 6793), NEXT_HOP and extra attributes; split an
UPDATE back into its attributes with their absolute offsets. Not a BGP implementation:
sessions are ExaBGP's and the transit daemons' job.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from catsproto.wire.attribute import FLAG_TRANSITIVE, PathAttribute, read_attribute
from catsproto.wire.buffer import Reader, Writer
from catsproto.wire.errors import BadLengthError, BadValueError

MARKER = b"\xff" * 16
HEADER_LEN = 19
UPDATE = 2
MAX_MESSAGE = 4096  # RFC 4271
MAX_EXTENDED_MESSAGE = 65535  # RFC 8654


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    withdrawn: tuple[ipaddress.IPv4Network, ...]
    attributes: tuple[PathAttribute, ...]
    nlri: tuple[ipaddress.IPv4Network, ...]

    def attribute(self, type_code: int) -> PathAttribute | None:
        return next((a for a in self.attributes if a.type_code == type_code), None)


def _write_prefixes(w: Writer, prefixes: list[ipaddress.IPv4Network]) -> None:
    for p in prefixes:
        w.u8(p.prefixlen)
        w.bytes(p.network_address.packed[: (p.prefixlen + 7) // 8])


def _read_prefixes(r: Reader, what: str) -> tuple[ipaddress.IPv4Network, ...]:
    out = []
    while r.remaining:
        at = r.offset
        bits = r.u8(f"{what} prefix length")
        if bits > 32:
            raise BadValueError(f"{what} prefix length {bits} above 32", at)
        raw = r.bytes((bits + 7) // 8, f"{what} prefix").ljust(4, b"\0")
        try:
            out.append(ipaddress.IPv4Network((raw, bits)))
        except ValueError:
            raise BadValueError(f"{what} prefix has host bits set", at) from None
    return tuple(out)


def build_update(
    nlri: list[ipaddress.IPv4Network],
    next_hop: ipaddress.IPv4Address,
    extra_attributes: list[bytes],
    as_path: tuple[int, ...] = (),
) -> bytes:
    """A whole UPDATE message (header included) announcing `nlri`."""
    attrs = Writer()
    attrs.bytes(bytes([FLAG_TRANSITIVE, 1, 1, 0]))  # ORIGIN IGP
    attrs.bytes(bytes([FLAG_TRANSITIVE, 2]))  # AS_PATH
    with attrs.length_prefixed(1, "AS_PATH"):
        if as_path:
            attrs.u8(2)  # AS_SEQUENCE
            attrs.u8(len(as_path))
            for asn in as_path:
                attrs.u32(asn)
    attrs.bytes(bytes([FLAG_TRANSITIVE, 3, 4]) + next_hop.packed)  # NEXT_HOP
    for a in extra_attributes:
        attrs.bytes(a)
    body = Writer()
    body.u16(0)  # no withdrawn routes
    with body.length_prefixed(2, "path attributes"):
        body.bytes(attrs.getvalue())
    _write_prefixes(body, nlri)
    msg = Writer()
    msg.bytes(MARKER)
    msg.u16(HEADER_LEN + len(body))
    msg.u8(UPDATE)
    msg.bytes(body.getvalue())
    if len(msg) > MAX_EXTENDED_MESSAGE:
        raise BadLengthError(f"UPDATE of {len(msg)} bytes exceeds {MAX_EXTENDED_MESSAGE}")
    return msg.getvalue()


def parse_update(data: bytes) -> Update:
    """Split one whole UPDATE message; attribute values are not interpreted."""
    r = Reader(bytes(data))
    if r.bytes(16, "marker") != MARKER:
        raise BadValueError("BGP marker is not all ones", 0)
    length = r.u16("message length")
    if length != len(data):
        raise BadLengthError(f"message length {length} but {len(data)} bytes given", 16)
    if (kind := r.u8("message type")) != UPDATE:
        raise BadValueError(f"message type {kind} is not UPDATE (2)", 18)
    with r.restrict_to(r.u16("withdrawn length"), "withdrawn routes") as inner:
        withdrawn = _read_prefixes(inner, "withdrawn")
    attributes = []
    with r.restrict_to(r.u16("path attribute length"), "path attributes") as inner:
        while inner.remaining:
            attributes.append(read_attribute(inner))
    return Update(withdrawn, tuple(attributes), _read_prefixes(r, "NLRI"))

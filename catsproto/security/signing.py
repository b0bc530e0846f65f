"""What an advertisement's signature covers, and how it is made.

The signed message is, byte for byte::

    "catsproto/v1 advertisement" 0x00      domain-separation label (27 bytes)
    attribute type code                    u8 (255 in the lab)
    AFI                                    u16: 1 = IPv4, 2 = IPv6
    prefix length                          u8
    prefix address                         4 or 16 bytes, host bits zero
    attribute value without its signature  every TLV but type 255, in wire order

The attribute value is canonical (the decoder refuses any other form), so "without its
signature" is one cut out of the received bytes and the receiver never re-encodes.
TLVs the receiver does not know, before or after the signature's type, are covered as
they are. The route's NLRI is part of the message because BGP carries the attribute
*next to* the prefix, not inside it: without it an advertisement signed for one prefix
could be attached to another. One advertisement is signed for exactly one prefix; an
origin sends one route per prefix (its address, one per summary shard), and transit
routers may re-pack NLRI into UPDATEs freely without breaking anything.
"""

from __future__ import annotations

import ipaddress
import struct

from catsproto import wire
from catsproto.security.identity import SigningKey
from catsproto.wire import Advertisement, Signature, SignatureAlgorithm, TLVType

ADVERTISEMENT_LABEL = b"catsproto/v1 advertisement\x00"
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_TLV_HEADER = struct.Struct(">HH")


def nlri_bytes(nlri: IPNetwork) -> bytes:
    """AFI u16, prefix length u8 and the whole network address (host bits are zero)."""
    if isinstance(nlri, ipaddress.IPv4Network):
        return b"\x00\x01" + bytes((nlri.prefixlen,)) + nlri.network_address.packed
    if isinstance(nlri, ipaddress.IPv6Network):
        return b"\x00\x02" + bytes((nlri.prefixlen,)) + nlri.network_address.packed
    raise TypeError(f"nlri must be an IPv4Network or IPv6Network, not {type(nlri).__name__}")


def signature_span(value: bytes) -> tuple[int, int]:
    """Where the signature TLV sits in `value` (a canonical attribute value), header
    included, as [start, stop); (len, len) when there is none."""
    pos, end = 0, len(value)
    while pos + 4 <= end:
        tlv_type, length = _TLV_HEADER.unpack_from(value, pos)
        if tlv_type == TLVType.SIGNATURE:
            return pos, min(pos + 4 + length, end)
        pos += 4 + length
    return end, end


def without_signature(value: bytes) -> bytes:
    """`value` (a canonical attribute value) with its signature TLV cut out."""
    start, stop = signature_span(value)
    return value[:start] + value[stop:] if start < stop else value


def _prefix(nlri: IPNetwork, attribute_type: int) -> bytes:
    if not 0 <= attribute_type <= 255:
        raise ValueError(f"attribute type {attribute_type} outside 0..255")
    return ADVERTISEMENT_LABEL + bytes([attribute_type]) + nlri_bytes(nlri)


def signed_message(
    unsigned_value: bytes, nlri: IPNetwork, attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE
) -> bytes:
    """The exact bytes an Ed25519 signature covers (see the module docstring)."""
    return _prefix(nlri, attribute_type) + unsigned_value


def received_message(
    value: bytes,
    nlri: IPNetwork,
    attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE,
    span: tuple[int, int] | None = None,
) -> bytes:
    """`signed_message(without_signature(value), ...)` built with one copy of `value`:
    the receiver's form, the signature TLV (at `span`, found if not given) cut out of
    the bytes as received."""
    start, stop = signature_span(value) if span is None else span
    view = memoryview(value)
    return b"".join((_prefix(nlri, attribute_type), view[:start], view[stop:]))


def sign(
    adv: Advertisement,
    key: SigningKey,
    nlri: IPNetwork,
    attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE,
) -> Advertisement:
    """`adv` with a Signature TLV by `key` for the route `nlri` (any old signature goes).

    Seal the cache section (`sealing.seal`) before signing: the signature covers the
    ciphertext, so any receiver can check it without the group key.
    """
    unsigned = adv.without(TLVType.SIGNATURE)
    message = signed_message(wire.encode(unsigned), nlri, attribute_type)
    return unsigned.replace(Signature(SignatureAlgorithm.ED25519, key.key_id, key.sign(message)))

"""A scapy layer for the cache-state attribute: view it in captures, craft it for interop.

Strategy: one scapy `Packet` per TLV type, declared the scapy way (`fields_desc`, field
names identical to the codec's record fields so the two can be compared name by name),
and a type -> class dict (`TLV_CLASSES`) with a generic `CatsUnknownTLV` fallback.
Every length field defaults to `None` and is filled in at build time, so a test can
still forge a wrong one. Dissection is lenient, as scapy is: a TLV is cut at its
declared length, value bytes its fields leave unread show up as a `Raw` payload, and
nothing is rejected. The codec (`catsproto.wire`) is the reference; this layer is a
viewer and a packet crafter, never a validator.

scapy dissects the value of an unassigned or reserved attribute type (255 included) as
`Raw`, so `redissect(pkt)` replaces that payload of every `BGPPathAttr` of our type
code with `CatsAttributeValue`. `CatsPathAttr` builds (or dissects) the whole attribute
with its flags and length on its own, without scapy's BGP contrib.
"""

# ruff: noqa: RUF012  (scapy declares layouts as mutable class attributes: fields_desc)
from __future__ import annotations

import enum
import ipaddress
import struct
from typing import Any

from scapy.config import conf
from scapy.fields import (
    ByteEnumField,
    ByteField,
    Field,
    FieldLenField,
    IEEEDoubleField,
    IntField,
    LongField,
    PacketListField,
    ShortEnumField,
    ShortField,
    StrLenField,
    XByteField,
    XStrLenField,
)
from scapy.packet import Packet, Raw

from catsproto import wire
from catsproto.wire import codes

MAX_ITEMS = 65535  # scapy's default list limit (100) is far below what a TLV can hold


def _enum_names(e: type[enum.IntEnum]) -> dict[int, str]:
    return {m.value: m.name.lower().replace("_", "-") for m in e}


TLV_TYPE_NAMES = dict(codes.TLV_NAMES)


def _fill_u16(p: bytes, at: int, value: int) -> bytes:
    return p[:at] + struct.pack("!H", value) + p[at + 2 :]


class _Bounded(Packet):
    """A packet whose header holds the u16 length of what follows it (at `_LEN_AT`).

    Dissection stops at that length: unread value bytes become a `Raw` payload, bytes
    after it go back to the enclosing list as padding. Build fills a `None` length.
    """

    _LEN_AT = 2  # offset of the u16 length field; the header ends right after it

    def dissect(self, s: bytes) -> None:
        header = self._LEN_AT + 2
        end = (
            header + struct.unpack("!H", s[self._LEN_AT : header])[0]
            if len(s) >= header
            else len(s)
        )
        super().dissect(s[:end])
        if len(s) > end:
            self.add_payload(conf.padding_layer(s[end:]))

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        if self.getfieldval("len") is None:
            p = _fill_u16(p, self._LEN_AT, len(p) - self._LEN_AT - 2)
        return p + pay


class _Item(Packet):
    """A fixed record inside a TLV's list: consumes its fields, leaves the rest."""

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


class CatsTLV(_Bounded):
    """Common header of every TLV: type (u16) and length (u16) of the value."""

    name = "CATS TLV"
    TYPE = -1


def _tlv(code: int, name: str, fields: list[Field]) -> type[CatsTLV]:
    """Declare the scapy class of TLV `code` (header + `fields`)."""
    cls = type(
        name,
        (CatsTLV,),
        {
            "name": f"CATS {codes.tlv_name(code)}",
            "TYPE": code,
            "fields_desc": [
                ShortEnumField("type", code, TLV_TYPE_NAMES),
                ShortField("len", None),
                *fields,
            ],
        },
    )
    return cls


def _blob8(name: str) -> list[Field]:
    """Bytes behind a u8 length (`<name>_len`, filled at build)."""
    return [
        FieldLenField(f"{name}_len", None, length_of=name, fmt="B"),
        XStrLenField(name, b"", length_from=lambda p, n=name: p.getfieldval(f"{n}_len")),
    ]


class _AfiField(ShortField):
    """AFI before an address: 1 = IPv4, 2 = IPv6; `None` takes it from the address."""

    def i2m(self, pkt: Packet | None, x: Any) -> int:
        if x is None and pkt is not None:
            address = pkt.getfieldval("address")
            return 2 if isinstance(address, str) and ":" in address else 1
        return super().i2m(pkt, x)


class _AddressField(Field[Any, bytes]):
    """An IPv4 or IPv6 address, its size chosen by the `afi` field before it (shown as
    text); under an unknown AFI the rest of the value, as bytes."""

    def __init__(self, name: str, default: str):
        super().__init__(name, default, "4s")

    def h2i(self, pkt: Packet | None, x: Any) -> Any:
        if isinstance(x, ipaddress.IPv4Address | ipaddress.IPv6Address):
            return str(x)
        return x

    def i2m(self, pkt: Packet | None, x: Any) -> bytes:
        if isinstance(x, bytes):
            return x
        return ipaddress.ip_address(x).packed

    def addfield(self, pkt: Packet, s: bytes, val: Any) -> bytes:
        return s + self.i2m(pkt, val)

    def getfield(self, pkt: Packet, s: bytes) -> tuple[bytes, Any]:
        size = {1: 4, 2: 16}.get(pkt.getfieldval("afi"))
        if size is None or len(s) < size:
            return b"", s
        return s[size:], str(ipaddress.ip_address(s[:size]))

    def i2len(self, pkt: Packet, x: Any) -> int:
        return len(self.i2m(pkt, x))


def _rest(fixed: int, *blobs: str):
    """Length of a trailing field: the length field `len` minus `fixed` bytes and the
    named u8-length blobs before it."""

    def length(p: Packet) -> int:
        return max(0, (p.len or 0) - fixed - sum(p.getfieldval(f"{b}_len") or 0 for b in blobs))

    return length


# ---- records inside TLVs ---------------------------------------------------------------


class CatsL0Metric(_Item):
    name = "CATS L0 metric"
    fields_desc = [
        ShortEnumField("metric_type", 0, codes.L0_METRIC_NAMES),
        ByteEnumField("unit", 1, _enum_names(codes.Unit)),
        ByteEnumField("statistic", 1, _enum_names(codes.Statistic)),
        ByteEnumField("source", 1, _enum_names(codes.Source)),
        IEEEDoubleField("value", 0.0),
    ]


class CatsL1Score(_Item):
    name = "CATS L1 score"
    fields_desc = [
        ByteEnumField("category", 1, _enum_names(codes.MetricCategory)),
        ByteField("score", 0),
    ]


class CatsHotPrefix(_Item):
    name = "CATS hot prefix"
    fields_desc = [LongField("block_key", 0), IntField("depth", 1)]


class CatsScopeEntry(_Item):
    name = "CATS scope entry"
    fields_desc = [ByteEnumField("kind", 1, _enum_names(codes.ScopeKind)), *_blob8("value")]


class CatsSummaryEntry(_Bounded):
    """One cache-summary entry behind its own u16 length (`len`)."""

    name = "CATS summary entry"
    _LEN_AT = 0
    fields_desc = [
        ShortField("len", None),
        ByteEnumField("tier", 1, _enum_names(codes.Tier)),
        ByteEnumField("kind", 1, _enum_names(codes.SummaryKind)),
        IntField("version", 1),
        IntField("base_version", 0),
        LongField("key_lo", 0),
        LongField("key_hi", (1 << 64) - 1),
        IntField("entry_count", 0),
        IntField("bytes_per_block", 0),
        IntField("fetch_latency_us", 0),
        IntField("fetch_bandwidth_mbps", 0),
        *_blob8("params"),
        # after the length: 42 fixed bytes, params behind a u8 length, the body to the end
        XStrLenField("body", b"", length_from=_rest(43, "params")),
    ]


def _list(name: str, item: type[Packet], length_from) -> PacketListField:
    return PacketListField(name, [], item, length_from=length_from, max_count=MAX_ITEMS)


# ---- TLVs ------------------------------------------------------------------------------

CatsVersion = _tlv(codes.TLVType.VERSION, "CatsVersion", [ByteField("version", 1)])
CatsOrigin = _tlv(
    codes.TLVType.ORIGIN,
    "CatsOrigin",
    [
        IntField("cs_id", 1),
        IntField("site_id", 0),
        _AfiField("afi", None),
        _AddressField("address", "0.0.0.0"),
    ],
)
CatsSequence = _tlv(
    codes.TLVType.SEQUENCE, "CatsSequence", [IntField("epoch", 0), LongField("sequence", 0)]
)
CatsTimestamp = _tlv(codes.TLVType.TIMESTAMP, "CatsTimestamp", [LongField("ms", 0)])
CatsMetricsL0 = _tlv(
    codes.TLVType.METRICS_L0, "CatsMetricsL0", [_list("metrics", CatsL0Metric, _rest(0))]
)
CatsMetricsL1 = _tlv(
    codes.TLVType.METRICS_L1, "CatsMetricsL1", [_list("scores", CatsL1Score, _rest(0))]
)
CatsMetricsL2 = _tlv(codes.TLVType.METRICS_L2, "CatsMetricsL2", [ByteField("score", 0)])
CatsMetricsBasis = _tlv(
    codes.TLVType.METRICS_BASIS,
    "CatsMetricsBasis",
    [
        LongField("window_ms", 10_000),
        ByteEnumField("normalisation", 1, _enum_names(codes.NormalisationFunction)),
        IntField("reference_ms", 1000),
    ],
)
CatsCacheModel = _tlv(
    codes.TLVType.CACHE_MODEL,
    "CatsCacheModel",
    [
        FieldLenField("model_id_len", None, length_of="model_id", fmt="B"),
        StrLenField("model_id", b"", length_from=lambda p: p.model_id_len),
        IntField("block_size", 1),
        ByteEnumField("key_scheme", 1, _enum_names(codes.KeyScheme)),
        IntField("secret_id", 0),
    ],
)
CatsCacheSummaries = _tlv(
    codes.TLVType.CACHE_SUMMARIES,
    "CatsCacheSummaries",
    [_list("entries", CatsSummaryEntry, _rest(0))],
)
CatsCapacity = _tlv(
    codes.TLVType.CAPACITY,
    "CatsCapacity",
    [LongField("free_blocks", 0), LongField("total_blocks", 0)],
)
CatsHotPrefixes = _tlv(
    codes.TLVType.HOT_PREFIXES, "CatsHotPrefixes", [_list("prefixes", CatsHotPrefix, _rest(0))]
)
CatsSealedCache = _tlv(
    codes.TLVType.SEALED_CACHE,
    "CatsSealedCache",
    [
        ByteEnumField("algorithm", 1, _enum_names(codes.AeadAlgorithm)),
        IntField("key_id", 0),
        *_blob8("nonce"),
        XStrLenField("ciphertext", b"", length_from=_rest(6, "nonce")),
    ],
)
CatsDelegation = _tlv(
    codes.TLVType.DELEGATION,
    "CatsDelegation",
    [
        ByteEnumField("algorithm", 1, _enum_names(codes.SignatureAlgorithm)),
        *_blob8("operator_key_id"),
        *_blob8("node_key"),
        LongField("not_before_ms", 0),
        LongField("not_after_ms", 0),
        *_blob8("operator_signature"),
        _list(
            "scope",
            CatsScopeEntry,
            _rest(20, "operator_key_id", "node_key", "operator_signature"),
        ),
    ],
)
CatsSignature = _tlv(
    codes.TLVType.SIGNATURE,
    "CatsSignature",
    [
        ByteEnumField("algorithm", 1, _enum_names(codes.SignatureAlgorithm)),
        *_blob8("key_id"),
        XStrLenField("signature", b"", length_from=_rest(2, "key_id")),
    ],
)


class CatsUnknownTLV(CatsTLV):
    """A TLV type this layer does not know: its value as bytes."""

    name = "CATS unknown TLV"
    fields_desc = [
        ShortEnumField("type", 0, TLV_TYPE_NAMES),
        ShortField("len", None),
        XStrLenField("value", b"", length_from=_rest(0)),
    ]


TLV_CLASSES: dict[int, type[CatsTLV]] = {
    cls.TYPE: cls
    for cls in (
        CatsVersion,
        CatsOrigin,
        CatsSequence,
        CatsTimestamp,
        CatsMetricsL0,
        CatsMetricsL1,
        CatsMetricsL2,
        CatsMetricsBasis,
        CatsCacheModel,
        CatsCacheSummaries,
        CatsCapacity,
        CatsHotPrefixes,
        CatsSealedCache,
        CatsDelegation,
        CatsSignature,
    )
}


def _guess_tlv(s: bytes, **kwargs: Any) -> Packet:
    """Dispatch on the TLV type (the first two bytes); fewer than 4 bytes are Raw."""
    if len(s) < 4:
        return Raw(s, **{k: v for k, v in kwargs.items() if k == "_parent"})
    cls = TLV_CLASSES.get(struct.unpack("!H", s[:2])[0], CatsUnknownTLV)
    return cls(s, **kwargs)


def _tlvs_field(length_from=None) -> PacketListField:
    return PacketListField("tlvs", [], _guess_tlv, length_from=length_from, max_count=MAX_ITEMS)


class CatsAttributeValue(Packet):
    """The attribute value: a run of TLVs (what scapy's BGP layer leaves as `Raw`)."""

    name = "CATS attribute value"
    fields_desc = [_tlvs_field()]


class _AttrFlagsField(XByteField):
    """Flags; `None` means optional + transitive, plus extended length over 255 bytes."""

    def i2m(self, pkt: Packet | None, x: Any) -> int:
        if x is None and pkt is not None:
            ext = wire.FLAG_EXTENDED_LENGTH if _value_len(pkt) > 255 else 0
            return wire.FLAG_OPTIONAL | wire.FLAG_TRANSITIVE | ext
        return super().i2m(pkt, x)


def _value_len(pkt: Packet) -> int:
    return sum(len(bytes(t)) for t in pkt.getfieldval("tlvs"))


def _extended(pkt: Packet) -> bool:
    return bool(pkt.get_field("flags").i2m(pkt, pkt.getfieldval("flags")) & 0x10)


class _AttrLengthField(Field[int | None, int]):
    """Attribute length: u16 when the flags have extended length (0x10), else u8."""

    def __init__(self, name: str, default: int | None):
        super().__init__(name, default, "!H")

    def addfield(self, pkt: Packet, s: bytes, val: int | None) -> bytes:
        if val is None:
            val = _value_len(pkt)
        return s + struct.pack("!H" if _extended(pkt) else "!B", val)

    def getfield(self, pkt: Packet, s: bytes) -> tuple[bytes, int]:
        if _extended(pkt):
            return s[2:], struct.unpack("!H", s[:2])[0]
        return s[1:], s[0]

    def i2len(self, pkt: Packet, x: Any) -> int:
        return 2 if _extended(pkt) else 1


class CatsPathAttr(Packet):
    """The whole path attribute: flags, type code, length (u8 or u16), TLVs."""

    name = "CATS path attribute"
    fields_desc = [
        _AttrFlagsField("flags", None),
        ByteField("type_code", wire.DEFAULT_ATTRIBUTE_TYPE),
        _AttrLengthField("length", None),
        _tlvs_field(length_from=lambda p: p.length),
    ]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


# ---- glue to scapy's BGP contrib, and to the codec -------------------------------------


def redissect(pkt: Packet, type_code: int = wire.DEFAULT_ATTRIBUTE_TYPE) -> int:
    """Replace the `Raw` value of every BGP path attribute of `type_code` in `pkt` by a
    `CatsAttributeValue`; returns how many were replaced."""
    from scapy.contrib.bgp import BGPPathAttr

    count = 0
    # a TCP segment may hold several BGP messages, each UPDATE with its path_attr list
    for layer in pkt.iterpayloads():
        attrs = layer.getfieldval("path_attr") if "path_attr" in layer.fields else []
        if isinstance(layer, BGPPathAttr):
            attrs = [layer]
        for attr in attrs:
            if attr.type_code == type_code and isinstance(attr.attribute, Raw):
                attr.attribute = CatsAttributeValue(bytes(attr.attribute))
                count += 1
    return count


def from_codec(obj: wire.Record | wire.UnknownTLV) -> Packet:
    """The scapy packet of a codec TLV or list item, with every length left `None`."""
    if isinstance(obj, wire.UnknownTLV):
        return CatsUnknownTLV(type=obj.type, value=obj.value)
    cls = _CODEC_TO_SCAPY[type(obj)]
    kwargs: dict[str, Any] = {}
    for name, _codec in obj._LAYOUT:
        value = getattr(obj, name)
        if isinstance(value, tuple):
            value = [from_codec(item) for item in value]
        elif isinstance(value, enum.IntEnum):
            value = int(value)
        elif isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
            value = str(value)
        elif isinstance(value, str):
            value = value.encode("utf-8")
        kwargs[name] = value
    return cls(**kwargs)


def attribute_from_advertisement(
    adv: wire.Advertisement, type_code: int = wire.DEFAULT_ATTRIBUTE_TYPE
) -> CatsPathAttr:
    """A `CatsPathAttr` carrying `adv`, lengths and flags left to be filled at build."""
    return CatsPathAttr(type_code=type_code, tlvs=[from_codec(t) for t in adv.tlvs])


_CODEC_TO_SCAPY: dict[type, type[Packet]] = {
    wire.L0Metric: CatsL0Metric,
    wire.L1Score: CatsL1Score,
    wire.HotPrefix: CatsHotPrefix,
    wire.ScopeEntry: CatsScopeEntry,
    wire.SummaryEntry: CatsSummaryEntry,
    **{wire.DEFAULT_REGISTRY.by_type[t]: cls for t, cls in TLV_CLASSES.items()},
}

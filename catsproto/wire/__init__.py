"""Sans-IO codec for cache-state advertisements carried in a BGP path attribute.

Stable API::

    encode(adv: Advertisement) -> bytes        # attribute value, canonical TLVs
    decode(data: bytes) -> Advertisement       # raises CodecError and nothing else
    encode_attribute(value) / decode_attribute(data)   # the path-attribute framing

Pure standard library: no sockets, clocks or randomness.
"""

from catsproto.wire.advertisement import (
    Advertisement,
    decode,
    decode_from,
    decode_window,
    encode,
)
from catsproto.wire.attribute import (
    FLAG_EXTENDED_LENGTH,
    FLAG_OPTIONAL,
    FLAG_PARTIAL,
    FLAG_TRANSITIVE,
    PathAttribute,
    decode_attribute,
    encode_attribute,
)
from catsproto.wire.buffer import Reader, Writer
from catsproto.wire.codes import (
    DEFAULT_ATTRIBUTE_TYPE,
    FORMAT_VERSION,
    L0_METRIC_NAMES,
    MAX_TLVS,
    AeadAlgorithm,
    KeyScheme,
    L0MetricType,
    MetricCategory,
    NormalisationFunction,
    ScopeKind,
    SignatureAlgorithm,
    Source,
    Statistic,
    SummaryKind,
    Tier,
    TLVType,
    Unit,
    summary_kind_name,
    tlv_name,
)
from catsproto.wire.errors import (
    BadLengthError,
    BadValueError,
    CodecError,
    NonCanonicalError,
    TruncatedError,
)
from catsproto.wire.fields import Blob, Record, record
from catsproto.wire.tlv import TLV, ErrorAction, Registry, UnknownTLV
from catsproto.wire.tlvs import (
    DEFAULT_REGISTRY,
    CacheModel,
    CacheSummaries,
    Capacity,
    Delegation,
    HotPrefix,
    HotPrefixes,
    L0Metric,
    L1Score,
    MetricsBasis,
    MetricsL0,
    MetricsL1,
    MetricsL2,
    Origin,
    ScopeEntry,
    SealedCache,
    Sequence,
    Signature,
    SummaryEntry,
    Timestamp,
    Version,
    define_tlv,
)


def error_action(exc: CodecError, registry: Registry = DEFAULT_REGISTRY) -> ErrorAction:
    """RFC 7606 action for an attribute that failed to decode with `exc`.

    The strongest action of all its errors applies (RFC 7606, section 3 (j)):
    treat-as-withdraw when the TLV framing is broken (an error marked `framing`), when an
    error names no TLV (a missing mandatory TLV, the path-attribute framing) and when any
    malformed TLV is of a treat-as-withdraw type; attribute-discard only when the framing
    is intact and every malformed TLV (`exc` and `exc.more`) is of an attribute-discard
    type.
    """
    for err in (exc, *exc.more):
        cls = registry.by_type.get(err.tlv_type) if err.tlv_type is not None else None
        if err.framing or cls is None or cls.ON_ERROR is not ErrorAction.ATTRIBUTE_DISCARD:
            return ErrorAction.TREAT_AS_WITHDRAW
    return ErrorAction.ATTRIBUTE_DISCARD


def decode_attribute_value(
    data: bytes, type_code: int = DEFAULT_ATTRIBUTE_TYPE, registry: Registry = DEFAULT_REGISTRY
) -> Advertisement:
    """Decode a whole path attribute; error offsets count from its flags byte."""
    attr = decode_attribute(data, type_code)
    start = attr.value_offset
    return decode_window(bytes(data), start, start + len(attr.value), registry)


__all__ = [name for name in dir() if not name.startswith("_")]

"""Every TLV of a cache-state advertisement, with the units and ranges of its fields.

Each class is one TLV type: a frozen record whose field annotations are its wire layout
(fields in order, big-endian, no padding). Lists are canonical: strictly increasing by
the key named in `validate`, never empty (an empty list is an absent TLV).
"""

from __future__ import annotations

from typing import Annotated

from catsproto.wire.codes import (
    FORMAT_VERSION,
    KeyScheme,
    MetricCategory,
    SignatureAlgorithm,
    Source,
    Statistic,
    SummaryKind,
    Tier,
    TLVType,
    Unit,
    tlv_name,
)
from catsproto.wire.errors import BadLengthError, BadValueError
from catsproto.wire.fields import (
    F64,
    U8,
    U16,
    U32,
    U64,
    Address,
    Blob,
    IPAddress,
    Items,
    Record,
    Text,
    UInt,
    record,
    strictly_increasing,
)
from catsproto.wire.tlv import TLV, ErrorAction, Registry

U64_MAX = (1 << 64) - 1


def define_tlv(
    code: int, name: str | None = None, on_error: ErrorAction = ErrorAction.TREAT_AS_WITHDRAW
):
    """Class decorator: give a TLV class its type code, name and RFC 7606 action, then
    fix its wire layout from its annotations."""

    def wrap(cls: type[TLV]) -> type[TLV]:
        cls.TYPE = int(code)
        cls.NAME = name or tlv_name(code)
        cls.ON_ERROR = on_error
        return record(cls)

    return wrap


@define_tlv(TLVType.VERSION)
class Version(TLV):
    """Format version of the whole attribute; this code speaks version 1 only."""

    version: Annotated[int, UInt(1, FORMAT_VERSION, FORMAT_VERSION)]


@define_tlv(TLVType.ORIGIN)
class Origin(TLV):
    """Who speaks: the service (CS-ID), the instance (CSCI-ID address) and its site.

    cs_id: service identifier, 1..2^32-1 (0 reserved). site_id: 0 = not given.
    address: the instance's unicast address (AFI 1 + 4 bytes, or AFI 2 + 16 bytes).
    """

    cs_id: Annotated[int, UInt(4, 1)]
    site_id: Annotated[int, U32]
    address: Annotated[IPAddress, Address()]


@define_tlv(TLVType.SEQUENCE)
class Sequence(TLV):
    """Freshness: (epoch, sequence) only ever increases for one origin.

    epoch: u32, bumped on every restart that loses the sequence counter.
    sequence: u64 within the epoch.
    """

    epoch: Annotated[int, U32]
    sequence: Annotated[int, U64]


@define_tlv(TLVType.TIMESTAMP)
class Timestamp(TLV):
    """When the origin built the advertisement: milliseconds since 1970-01-01 UTC (u64)."""

    ms: Annotated[int, U64]


@record
class L0Metric(Record):
    """One raw CATS metric (L0): what, in which unit, summarised how, from where.

    metric_type: u16, see `codes.L0_METRIC_NAMES` (unlisted codes allowed).
    value: IEEE 754 binary64 in `unit`, finite.
    """

    metric_type: Annotated[int, U16]
    unit: Annotated[Unit, U8]
    statistic: Annotated[Statistic, U8]
    source: Annotated[Source, U8]
    value: Annotated[float, F64]

    def key(self) -> tuple[int, int, int]:
        return (self.metric_type, self.statistic, self.source)


@define_tlv(TLVType.METRICS_L0, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL0(TLV):
    """Raw metrics; strictly increasing by (metric type, statistic, source). 13 bytes each."""

    metrics: Annotated[tuple[L0Metric, ...], Items(L0Metric)]

    def validate(self) -> None:
        strictly_increasing(self.metrics, L0Metric.key, "metrics")


@record
class L1Score(Record):
    """A normalised score for one category, 0 (worst) to 10 (best)."""

    category: Annotated[MetricCategory, U8]
    score: Annotated[int, UInt(1, 0, 10)]


@define_tlv(TLVType.METRICS_L1, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL1(TLV):
    """Normalised scores, strictly increasing by category, 2 bytes each."""

    scores: Annotated[tuple[L1Score, ...], Items(L1Score)]

    def validate(self) -> None:
        strictly_increasing(self.scores, lambda s: s.category, "scores")


@define_tlv(TLVType.METRICS_L2, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL2(TLV):
    """One fully normalised score for the instance, 0 (worst) to 10 (best)."""

    score: Annotated[int, UInt(1, 0, 10)]


@define_tlv(TLVType.CACHE_MODEL)
class CacheModel(TLV):
    """What the block keys mean: model, block size and how keys were derived.

    model_id: UTF-8, 1..255 bytes (e.g. "meta-llama/Llama-3.1-8B-Instruct").
    block_size: tokens per block, 1..2^32-1. secret_id: which keying secret hashed the keys.
    """

    model_id: Annotated[str, Text()]
    block_size: Annotated[int, UInt(4, 1)]
    key_scheme: Annotated[KeyScheme, U8]
    secret_id: Annotated[int, U32]


@record
class SummaryEntry(Record):
    """The blocks one tier holds (or one shard of them), and what fetching them costs.

    version: u32 >= 1, this summary's version. base_version: 0 for a snapshot, else the
    version this delta applies to (< version). key_lo..key_hi: the inclusive block-key
    range covered (a shard; 0..2^64-1 when whole). entry_count: keys summarised.
    bytes_per_block: KV bytes of one block. fetch_latency_us: time to first byte of a
    fetch from this tier, microseconds. fetch_bandwidth_mbps: Mbit/s. params: the
    kind's parameters (at most 255 bytes). body: the summary itself (rest of entry).
    """

    tier: Annotated[Tier, U8]
    kind: Annotated[SummaryKind, U8]
    version: Annotated[int, UInt(4, 1)]
    base_version: Annotated[int, U32]
    key_lo: Annotated[int, U64]
    key_hi: Annotated[int, U64]
    entry_count: Annotated[int, U32]
    bytes_per_block: Annotated[int, U32]
    fetch_latency_us: Annotated[int, U32]
    fetch_bandwidth_mbps: Annotated[int, U32]
    params: Annotated[bytes, Blob(1)]
    body: Annotated[bytes, Blob()]

    @property
    def is_delta(self) -> bool:
        return self.base_version != 0

    def validate(self) -> None:
        if self.key_lo > self.key_hi:
            raise BadValueError(f"key_lo {self.key_lo:#x} above key_hi {self.key_hi:#x}")
        if self.base_version >= self.version:
            raise BadValueError(
                f"base_version {self.base_version} not below version {self.version}"
            )


@define_tlv(TLVType.CACHE_SUMMARIES)
class CacheSummaries(TLV):
    """One summary entry per tier, strictly increasing by tier, each behind a u16 length."""

    entries: Annotated[tuple[SummaryEntry, ...], Items(SummaryEntry, prefix=2)]

    def validate(self) -> None:
        strictly_increasing(self.entries, lambda e: e.tier, "entries")


@define_tlv(TLVType.CAPACITY, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class Capacity(TLV):
    """KV capacity in blocks over all tiers: free <= total (u64 each)."""

    free_blocks: Annotated[int, U64]
    total_blocks: Annotated[int, U64]

    def validate(self) -> None:
        if self.free_blocks > self.total_blocks:
            raise BadValueError(
                f"free_blocks {self.free_blocks} above total_blocks {self.total_blocks}"
            )


@record
class HotPrefix(Record):
    """A prefix worth naming exactly: the key of its last block and its depth in blocks."""

    block_key: Annotated[int, U64]
    depth: Annotated[int, UInt(4, 1)]


@define_tlv(TLVType.HOT_PREFIXES, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class HotPrefixes(TLV):
    """Explicit hot prefixes, strictly increasing by block key, 12 bytes each."""

    prefixes: Annotated[tuple[HotPrefix, ...], Items(HotPrefix)]

    def validate(self) -> None:
        strictly_increasing(self.prefixes, lambda p: p.block_key, "prefixes")


ED25519_SIGNATURE_LEN = 64


@define_tlv(TLVType.SIGNATURE)
class Signature(TLV):
    """Signature over the rest of the advertisement (rules in `catsproto.security`).

    algorithm: 1 = Ed25519 (64-byte signature). key_id: 1..255 bytes naming the
    signing key in the trust store. signature: the rest of the value.
    """

    algorithm: Annotated[SignatureAlgorithm, U8]
    key_id: Annotated[bytes, Blob(1, min_len=1)]
    signature: Annotated[bytes, Blob(min_len=1)]

    def validate(self) -> None:
        if (
            self.algorithm == SignatureAlgorithm.ED25519
            and len(self.signature) != ED25519_SIGNATURE_LEN
        ):
            raise BadLengthError(
                f"Ed25519 signature is {len(self.signature)} bytes, not {ED25519_SIGNATURE_LEN}"
            )


DEFAULT_REGISTRY = Registry(
    [
        Version,
        Origin,
        Sequence,
        Timestamp,
        MetricsL0,
        MetricsL1,
        MetricsL2,
        CacheModel,
        CacheSummaries,
        Capacity,
        HotPrefixes,
        Signature,
    ]
)
MANDATORY = (Version, Origin, Sequence, Timestamp)

"""Every TLV of a cache-state advertisement, with the units and ranges of its fields.

Each class is one TLV type: a frozen record whose field annotations are its wire layout
(fields in order, big-endian, no padding). Lists are canonical: strictly increasing by
the key named in `validate`, never empty (an empty list is an absent TLV).
"""

from __future__ import annotations

import hashlib
import ipaddress
from operator import attrgetter
from typing import Annotated

from catsproto.wire.codes import (
    FORMAT_VERSION,
    MANDATORY_TYPES,
    AeadAlgorithm,
    KeyScheme,
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
    tlv_name,
)
from catsproto.wire.errors import BadLengthError, BadValueError, NonCanonicalError
from catsproto.wire.fields import (
    F64,
    U8,
    U32,
    U64,
    Address,
    Blob,
    IPAddress,
    Items,
    OpenEnum,
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

    metric_type: u16, 1..65535, see `codes.L0_METRIC_NAMES` (unlisted codes allowed and
    skipped by a receiver; 0 is reserved and malformed, as Kind 0 of a summary entry).
    value: IEEE 754 binary64 in `unit`, finite.
    """

    metric_type: Annotated[int, UInt(2, 1)]
    unit: Annotated[Unit, U8]
    statistic: Annotated[Statistic, U8]
    source: Annotated[Source, U8]
    value: Annotated[float, F64]

    def key(self) -> tuple[int, int, int]:
        return _L0_KEY(self)


_L0_KEY = attrgetter("metric_type", "statistic", "source")
_BY_KIND_VALUE = attrgetter("kind", "value")


@define_tlv(TLVType.METRICS_L0, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL0(TLV):
    """Raw metrics; strictly increasing by (metric type, statistic, source). 13 bytes each."""

    metrics: Annotated[tuple[L0Metric, ...], Items(L0Metric)]

    SORTED_BY = ("metrics", ("metric_type", "statistic", "source"))


@record
class L1Score(Record):
    """A normalised score for one category, 0 (worst) to 10 (best)."""

    category: Annotated[MetricCategory, U8]
    score: Annotated[int, UInt(1, 0, 10)]


@define_tlv(TLVType.METRICS_L1, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL1(TLV):
    """Normalised scores, strictly increasing by category, 2 bytes each."""

    scores: Annotated[tuple[L1Score, ...], Items(L1Score)]

    SORTED_BY = ("scores", ("category",))


@define_tlv(TLVType.METRICS_L2, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsL2(TLV):
    """One fully normalised score for the instance, 0 (worst) to 10 (best); 11-255 are
    malformed, as an L1 score above 10 is."""

    score: Annotated[int, UInt(1, 0, 10)]


# The WG's default Measurement_Window (draft-ietf-cats-metric-definition, Sections
# 6.1.3.5 and 6.2.3.5 to 6.5.3.5 of the editor's copy of 2 March 2026): 10 s.
DEFAULT_WINDOW_MS = 10_000
U32_MAX = (1 << 32) - 1


@define_tlv(TLVType.METRICS_BASIS, on_error=ErrorAction.ATTRIBUTE_DISCARD)
class MetricsBasis(TLV):
    """What the origin's metrics are measured over and how its scores were computed.

    window_ms: the Measurement Window, u64 milliseconds, at least 1: the time before the
    Timestamp over which every L0 entry with a statistic other than `current` (mean,
    min, max, percentiles) was taken, and the L0 inputs of the L1 and L2 scores.
    normalisation: 1..255 (0 is malformed); 1 = queue-reference. A code
    `NormalisationFunction` does not name stays a plain int and re-encodes unchanged: a
    receiver cannot recompute such scores and uses them only as the WG's score bands.
    reference_ms: the reference delay R of queue-reference (the queueing delay that
    scores 5 on service), u32 milliseconds, at least 1. 13 bytes.
    """

    window_ms: Annotated[int, UInt(8, 1)]
    normalisation: Annotated[NormalisationFunction | int, OpenEnum(UInt(1, 1))]
    reference_ms: Annotated[int, UInt(4, 1)]

    @property
    def has_known_normalisation(self) -> bool:
        """Whether this codec names the function (else the scores cannot be recomputed)."""
        return int(self.normalisation) in NormalisationFunction._value2member_map_


@define_tlv(TLVType.CACHE_MODEL)
class CacheModel(TLV):
    """What the block keys mean: model, block size and how keys were derived.

    model_id: UTF-8, 1..255 bytes (e.g. "meta-llama/Llama-3.1-8B-Instruct").
    block_size: tokens per block, 1..2^32-1. key_scheme: 1..255 (0 is malformed); a code
    `KeyScheme` does not name stays a plain int and re-encodes unchanged, so the attribute
    stays well-formed and a receiver ignores just the cache state whose keys it cannot
    derive (`has_known_key_scheme`), keeping the metrics. secret_id: which keying secret
    hashed the keys.
    """

    model_id: Annotated[str, Text()]
    block_size: Annotated[int, UInt(4, 1)]
    key_scheme: Annotated[KeyScheme | int, OpenEnum(UInt(1, 1))]  # unknown schemes kept
    secret_id: Annotated[int, U32]

    @property
    def has_known_key_scheme(self) -> bool:
        """Whether this codec names the key scheme (else the block keys mean nothing here)."""
        return int(self.key_scheme) in KeyScheme._value2member_map_  # a bare int too


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
    kind: Annotated[SummaryKind | int, OpenEnum(UInt(1, 1))]  # unknown kinds kept
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

    SORTED_BY = ("entries", ("tier",))


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

    SORTED_BY = ("prefixes", ("block_key",))


CHACHA20_POLY1305_NONCE_LEN = 12
AEAD_TAG_LEN = 16
CHACHA20_POLY1305_MIN_CIPHERTEXT = AEAD_TAG_LEN + 4  # the tag and one TLV header


@define_tlv(TLVType.SEALED_CACHE)
class SealedCache(TLV):
    """The cache section (some of types 32-35), encrypted under a group key.

    algorithm: 1..255 (0 is malformed); 1 = ChaCha20-Poly1305 (12-byte nonce, 16-byte
    tag). A code `AeadAlgorithm` does not name stays a plain int and re-encodes unchanged,
    so the attribute stays well-formed and a receiver leaves just this section unopened
    (`has_known_algorithm`), as it does without the group key, using the rest. key_id:
    u32 naming the group key, in the clear so a receiver holding two keys during a
    rotation picks the right one. nonce: 1..255 bytes behind a u8 length (exactly 12 for
    ChaCha20-Poly1305; any length for an unknown algorithm). ciphertext: the rest, tag
    included, at least one byte; for ChaCha20-Poly1305 at least 20 (its 16-byte tag and
    one TLV header), a rule of that algorithm only, like its nonce length. Its plaintext
    is the sealed TLVs in canonical order (rules in `catsproto.security`).
    """

    algorithm: Annotated[AeadAlgorithm | int, OpenEnum(UInt(1, 1))]  # unknown ones kept
    key_id: Annotated[int, U32]
    nonce: Annotated[bytes, Blob(1, min_len=1)]
    ciphertext: Annotated[bytes, Blob(min_len=1)]

    @property
    def has_known_algorithm(self) -> bool:
        """Whether this codec names the AEAD (else no key here can open the section)."""
        return int(self.algorithm) in AeadAlgorithm._value2member_map_  # a bare int too

    def validate(self) -> None:
        if (
            self.algorithm == AeadAlgorithm.CHACHA20_POLY1305
            and len(self.nonce) != CHACHA20_POLY1305_NONCE_LEN
        ):
            raise BadLengthError(
                f"ChaCha20-Poly1305 nonce is {len(self.nonce)} bytes, "
                f"not {CHACHA20_POLY1305_NONCE_LEN}"
            )
        if (
            self.algorithm == AeadAlgorithm.CHACHA20_POLY1305
            and len(self.ciphertext) < CHACHA20_POLY1305_MIN_CIPHERTEXT
        ):
            raise BadLengthError(
                f"ChaCha20-Poly1305 ciphertext is {len(self.ciphertext)} bytes, fewer than "
                f"{CHACHA20_POLY1305_MIN_CIPHERTEXT} (the {AEAD_TAG_LEN}-byte tag and a TLV "
                "header)"
            )


_PREFIX_VALUE_LEN = {5: 32, 17: 128}  # value length -> address bits (u8 length + address)
# The scope kinds every delegation must hold an entry of; SITE is optional (none: any site).
REQUIRED_SCOPE_KINDS = frozenset({ScopeKind.CS_ID, ScopeKind.ROUTE, ScopeKind.ADDRESS})


@record
class ScopeEntry(Record):
    """One thing a delegation authorises: a CS-ID, a route prefix, an address range or a
    site.

    kind: see `codes.ScopeKind` (a kind not listed there is malformed: a receiver cannot
    skip a restriction it does not understand). value: behind a u8 length; CS_ID: u32
    (1..2^32-1); ROUTE and ADDRESS: prefix length u8 then the 4 (IPv4) or 16 (IPv6)
    address bytes, host bits zero; SITE: u32, any value (0 authorises an Origin that
    names no site).
    """

    kind: Annotated[ScopeKind, U8]
    value: Annotated[bytes, Blob(1)]

    def key(self) -> tuple[int, bytes]:
        return (self.kind, self.value)

    @property
    def cs_id(self) -> int:
        return int.from_bytes(self.value, "big")

    @property
    def site_id(self) -> int:
        return int.from_bytes(self.value, "big")

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        bits, raw = self.value[0], self.value[1:]
        if len(raw) == 4:
            return ipaddress.IPv4Network((raw, bits))
        return ipaddress.IPv6Network((raw, bits))

    @classmethod
    def for_cs_id(cls, cs_id: int) -> ScopeEntry:
        if not 1 <= cs_id <= 0xFFFFFFFF:
            raise BadValueError(f"cs_id {cs_id} outside 1..4294967295")
        return cls(ScopeKind.CS_ID, cs_id.to_bytes(4, "big"))

    @classmethod
    def for_site(cls, site_id: int) -> ScopeEntry:
        if not 0 <= site_id <= 0xFFFFFFFF:
            raise BadValueError(f"site_id {site_id} outside 0..4294967295")
        return cls(ScopeKind.SITE, site_id.to_bytes(4, "big"))

    @classmethod
    def for_network(
        cls, kind: ScopeKind, network: ipaddress.IPv4Network | ipaddress.IPv6Network
    ) -> ScopeEntry:
        return cls(kind, bytes([network.prefixlen]) + network.network_address.packed)

    def validate(self) -> None:
        if self.kind == ScopeKind.CS_ID:
            if len(self.value) != 4 or self.value == bytes(4):
                raise BadValueError(
                    f"cs-id scope value must be a u32 above 0, not {self.value.hex()}"
                )
            return
        if self.kind == ScopeKind.SITE:
            if len(self.value) != 4:
                raise BadLengthError(f"site scope value is {len(self.value)} bytes, not 4")
            return
        bits = _PREFIX_VALUE_LEN.get(len(self.value))
        if bits is None:
            raise BadLengthError(
                f"{self.kind.name.lower()} scope value is {len(self.value)} bytes, not 5 or 17"
            )
        if self.value[0] > bits:
            raise BadValueError(f"prefix length {self.value[0]} above {bits}")
        try:
            self.network  # noqa: B018  # host bits must be zero
        except ValueError:
            raise NonCanonicalError(f"prefix {self.value.hex()} has host bits set") from None


ED25519_PUBLIC_KEY_LEN = 32
# A Key ID (Signature, Delegation) is derived, never chosen: the first KEY_ID_LEN bytes of
# SHA-256(KEY_ID_LABEL || algorithm u8 || public key) (`key_id`).
KEY_ID_LABEL = b"catsproto/v1 key-id\x00"
KEY_ID_LEN = 8


def key_id(public_key: bytes, algorithm: int = SignatureAlgorithm.ED25519) -> bytes:
    """The 8-byte Key ID of `public_key`."""
    return hashlib.sha256(KEY_ID_LABEL + bytes([algorithm]) + public_key).digest()[:KEY_ID_LEN]


ED25519_SIGNATURE_LEN = 64


@define_tlv(TLVType.DELEGATION)
class Delegation(TLV):
    """An operator key's signed statement that a node key may speak for a scope.

    algorithm: 1 = Ed25519 for both keys. operator_key_id: behind a u8 length, naming the
    operator key in the receiver's trust store (exactly KEY_ID_LEN = 8 bytes for
    Ed25519, the derived `key_id`). node_key: the authorised public key (exactly 32
    bytes for Ed25519). not_before_ms / not_after_ms: the validity period, ms since 1970
    (not_before < not_after). operator_signature: over every other field, exactly 64
    bytes for Ed25519 (rules in `catsproto.security.trust`). scope: the rest, strictly
    increasing by (kind, value), with at least one CS-ID, one route and one address entry
    and any number of site entries (none: every site). Draft, Delegation (Type 254).
    """

    algorithm: Annotated[SignatureAlgorithm, U8]
    operator_key_id: Annotated[bytes, Blob(1, min_len=1)]
    node_key: Annotated[bytes, Blob(1, min_len=1)]
    not_before_ms: Annotated[int, U64]
    not_after_ms: Annotated[int, U64]
    operator_signature: Annotated[bytes, Blob(1, min_len=1)]
    scope: Annotated[tuple[ScopeEntry, ...], Items(ScopeEntry)]

    def validate(self) -> None:
        if self.algorithm == SignatureAlgorithm.ED25519:
            if len(self.operator_key_id) != KEY_ID_LEN:
                raise BadLengthError(
                    f"Ed25519 operator_key_id is {len(self.operator_key_id)} bytes, "
                    f"not {KEY_ID_LEN}"
                )
            if len(self.node_key) != ED25519_PUBLIC_KEY_LEN:
                raise BadLengthError(
                    f"Ed25519 node_key is {len(self.node_key)} bytes, not {ED25519_PUBLIC_KEY_LEN}"
                )
            if len(self.operator_signature) != ED25519_SIGNATURE_LEN:
                raise BadLengthError(
                    f"Ed25519 operator_signature is {len(self.operator_signature)} bytes, "
                    f"not {ED25519_SIGNATURE_LEN}"
                )
        if self.not_before_ms >= self.not_after_ms:
            raise BadValueError(
                f"not_before_ms {self.not_before_ms} not below not_after_ms {self.not_after_ms}"
            )
        strictly_increasing(self.scope, _BY_KIND_VALUE, "scope")
        missing = REQUIRED_SCOPE_KINDS - {e.kind for e in self.scope}
        if missing:
            names = ", ".join(sorted(k.name.lower() for k in missing))
            raise BadValueError(f"scope has no {names} entry")

    def entries(self, kind: ScopeKind) -> tuple[ScopeEntry, ...]:
        return tuple(e for e in self.scope if e.kind == kind)


@define_tlv(TLVType.SIGNATURE)
class Signature(TLV):
    """Signature over the rest of the advertisement (rules in `catsproto.security`).

    algorithm: 1 = Ed25519 (64-byte signature). key_id: behind a u8 length, naming the
    signing key in the trust store (exactly KEY_ID_LEN = 8 bytes for Ed25519, the
    derived `key_id`). signature: the rest of the value. Draft, Signature (Type 255).
    """

    algorithm: Annotated[SignatureAlgorithm, U8]
    key_id: Annotated[bytes, Blob(1, min_len=1)]
    signature: Annotated[bytes, Blob(min_len=1)]

    def validate(self) -> None:
        if self.algorithm == SignatureAlgorithm.ED25519 and len(self.key_id) != KEY_ID_LEN:
            raise BadLengthError(f"Ed25519 key_id is {len(self.key_id)} bytes, not {KEY_ID_LEN}")
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
        MetricsBasis,
        CacheModel,
        CacheSummaries,
        Capacity,
        HotPrefixes,
        SealedCache,
        Delegation,
        Signature,
    ]
)
MANDATORY = (Version, Origin, Sequence, Timestamp)
if {cls.TYPE for cls in MANDATORY} != MANDATORY_TYPES:  # pragma: no cover
    raise ImportError("tlvs.MANDATORY and codes.MANDATORY_TYPES disagree")

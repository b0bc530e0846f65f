"""Every number the format assigns, in one place (the draft's IANA section mirrors it).

TLV type codes are 16 bits. 0 is reserved; 65280-65534 are for experiments; 65535 is
reserved. Codes not listed here are kept and passed on unchanged by every receiver.
"""

from __future__ import annotations

import enum

# Default BGP path attribute type code: 255 is "reserved for development" (RFC 2042).
DEFAULT_ATTRIBUTE_TYPE = 255
FORMAT_VERSION = 1


class TLVType(enum.IntEnum):
    VERSION = 1
    ORIGIN = 2
    SEQUENCE = 3
    TIMESTAMP = 4
    METRICS_L0 = 16
    METRICS_L1 = 17
    METRICS_L2 = 18
    METRICS_BASIS = 19
    CACHE_MODEL = 32
    CACHE_SUMMARIES = 33
    CAPACITY = 34
    HOT_PREFIXES = 35
    SEALED_CACHE = 36
    DELEGATION = 254
    SIGNATURE = 255


# Every advertisement carries these (`tlvs.MANDATORY` are their classes).
MANDATORY_TYPES = frozenset({TLVType.VERSION, TLVType.ORIGIN, TLVType.SEQUENCE, TLVType.TIMESTAMP})

# TLVs in one attribute value, at most (and in one sealed section): a receiver walks
# every header before it can judge the value, so a value of thousands of empty TLVs would
# cost it that many steps; fifteen types are defined, 64 leaves room for extensions.
MAX_TLVS = 64

TLV_NAMES: dict[int, str] = {t.value: t.name.lower().replace("_", "-") for t in TLVType}


def tlv_name(tlv_type: int) -> str:
    """Name of a type code for messages and JSON (`type-300` when unassigned)."""
    return TLV_NAMES.get(tlv_type, f"type-{tlv_type}")


class Tier(enum.IntEnum):
    """Where the KV blocks of a summary live, fastest first."""

    HBM = 1
    DRAM = 2
    SSD = 3
    REMOTE = 4


class SummaryKind(enum.IntEnum):
    """Encoding of a summary body; bodies are defined in `catsproto.summary`."""

    EXACT = 1
    BLOOM = 2
    FUSE = 3
    DELTA = 4


def summary_kind_name(kind: int) -> str:
    """Name of a summary kind for messages (`kind-200` for a code the enum does not name;
    the codec keeps such entries, see `SummaryEntry.kind`)."""
    return kind.name.lower() if isinstance(kind, SummaryKind) else f"kind-{int(kind)}"


class KeyScheme(enum.IntEnum):
    """How block keys are derived from tokens (see `catsproto.keys`)."""

    BLAKE2B64_CHAINED = 1


class MetricCategory(enum.IntEnum):
    """CATS metric framework L1 categories, named as the WG's metric definitions name
    them ("computing", draft-ietf-cats-metric-definition Section 3.3); `COMPUTE` is the
    -00 name of code 1, kept as an alias for callers."""

    COMPUTING = 1
    COMPUTE = 1
    COMMUNICATION = 2
    SERVICE = 3
    COMPOSED = 4


class Unit(enum.IntEnum):
    """Unit of an L0 metric value."""

    COUNT = 1
    PERCENT = 2
    MILLISECONDS = 3
    MICROSECONDS = 4
    BITS_PER_SECOND = 5
    BYTES = 6
    TOKENS_PER_SECOND = 7
    REQUESTS_PER_SECOND = 8


class Statistic(enum.IntEnum):
    """How an L0 value summarises its measurements (CATS metric framework)."""

    CURRENT = 1
    MEAN = 2
    MIN = 3
    MAX = 4
    P50 = 5
    P95 = 6
    P99 = 7


class NormalisationFunction(enum.IntEnum):
    """How an origin computed its L1 and L2 scores from its L0 values (Metrics Basis TLV).

    QUEUE_REFERENCE: computing = 10 x (1 - utilisation), service = 10 x R / (R + W) with
    W the estimated queueing delay and R the advertised reference delay, L2 = the smaller
    (`catsproto.node.metrics`). Codes not listed are kept as numbers (`OpenEnum`).
    """

    QUEUE_REFERENCE = 1


class Source(enum.IntEnum):
    """Where an L0 value comes from (CATS metric framework)."""

    NOMINAL = 1
    MEASURED = 2
    ESTIMATED = 3
    AGGREGATED = 4


class SignatureAlgorithm(enum.IntEnum):
    ED25519 = 1


class AeadAlgorithm(enum.IntEnum):
    """AEAD of a sealed cache section (see `catsproto.security.sealing`)."""

    CHACHA20_POLY1305 = 1


class ScopeKind(enum.IntEnum):
    """What one scope entry of a key delegation authorises (see `catsproto.security.trust`).

    CS_ID: value is a u32 CS-ID. ROUTE: an NLRI prefix the key may sign for. ADDRESS: a
    range the instance (Origin) address must fall in. Prefix values: length u8, address.
    SITE: a u32 site id the Origin may name; optional (a delegation without SITE entries
    authorises every site, one with them only those), so that an authorised node cannot
    claim another site's id and be priced at that site's distance.
    """

    CS_ID = 1
    ROUTE = 2
    ADDRESS = 3
    SITE = 4


# L0 metric types are 16 bits; codes not listed below are allowed and shown as numbers.
class L0MetricType(enum.IntEnum):
    """The L0 metric type codes this implementation produces and reads by name."""

    GPU_UTILIZATION = 1
    RUNNING_REQUESTS = 2
    WAITING_REQUESTS = 3
    PREFILL_THROUGHPUT = 4
    DECODE_THROUGHPUT = 5
    KV_CACHE_UTILIZATION = 6
    QUEUE_DELAY = 7  # -00 called it TTFT; it is the queueing part of a TTFT only
    TTFT = 7
    INTER_TOKEN_LATENCY = 8
    NETWORK_DELAY = 9
    NETWORK_BANDWIDTH = 10
    OUTSTANDING_PREFILL_TOKENS = 11


L0_METRIC_NAMES: dict[int, str] = {m.value: m.name.lower().replace("_", "-") for m in L0MetricType}

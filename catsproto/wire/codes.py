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
    CACHE_MODEL = 32
    CACHE_SUMMARIES = 33
    CAPACITY = 34
    HOT_PREFIXES = 35
    SIGNATURE = 255


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


class KeyScheme(enum.IntEnum):
    """How block keys are derived from tokens (see `catsproto.keys`)."""

    BLAKE2B64_CHAINED = 1


class MetricCategory(enum.IntEnum):
    """CATS metric framework L1 categories."""

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


class Source(enum.IntEnum):
    """Where an L0 value comes from (CATS metric framework)."""

    NOMINAL = 1
    MEASURED = 2
    ESTIMATED = 3
    AGGREGATED = 4


class SignatureAlgorithm(enum.IntEnum):
    ED25519 = 1


# L0 metric types (16 bits; unlisted codes are allowed and shown as numbers).
L0_METRIC_NAMES: dict[int, str] = {
    1: "gpu-utilization",
    2: "running-requests",
    3: "waiting-requests",
    4: "prefill-throughput",
    5: "decode-throughput",
    6: "kv-cache-utilization",
    7: "ttft",
    8: "inter-token-latency",
    9: "network-delay",
    10: "network-bandwidth",
}

"""Cache summaries: which block keys an instance holds, compactly, with deltas and shards.

Kinds (the cache-summary entry's ``kind`` code): 1 exact set, 2 Bloom filter, 3 binary
fuse filter with modular fingerprints, 4 delta. See docs/summary.md for the formats and
measured sizes.
"""

from catsproto.summary.base import (
    KIND_BLOOM,
    KIND_DELTA,
    KIND_EXACT,
    KIND_FUSE,
    Summary,
    SummaryDecodeError,
    register_kind,
    registered_kinds,
)
from catsproto.summary.bloom import BloomSummary
from catsproto.summary.exact import ExactSummary
from catsproto.summary.fuse import FuseSummary

__all__ = [
    "KIND_BLOOM",
    "KIND_DELTA",
    "KIND_EXACT",
    "KIND_FUSE",
    "BloomSummary",
    "ExactSummary",
    "FuseSummary",
    "Summary",
    "SummaryDecodeError",
    "register_kind",
    "registered_kinds",
]

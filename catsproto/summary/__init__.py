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
from catsproto.summary.delta import DeltaSummary, LayeredView, apply_delta
from catsproto.summary.exact import ExactSummary
from catsproto.summary.fuse import FuseSummary
from catsproto.summary.shard import (
    ENTRY_OVERHEAD,
    NoRoomError,
    Shard,
    ShardedSender,
    ShardUpdate,
    attribute_value_budget,
    build_shards,
    entry_budget,
    shard_of,
    shard_prefix,
    shard_range,
)
from catsproto.summary.versioning import Outcome, SummaryReceiver, SummarySender, SummaryUpdate

__all__ = [
    "ENTRY_OVERHEAD",
    "KIND_BLOOM",
    "KIND_DELTA",
    "KIND_EXACT",
    "KIND_FUSE",
    "BloomSummary",
    "DeltaSummary",
    "ExactSummary",
    "FuseSummary",
    "LayeredView",
    "NoRoomError",
    "Outcome",
    "Shard",
    "ShardUpdate",
    "ShardedSender",
    "Summary",
    "SummaryDecodeError",
    "SummaryReceiver",
    "SummarySender",
    "SummaryUpdate",
    "apply_delta",
    "attribute_value_budget",
    "build_shards",
    "entry_budget",
    "register_kind",
    "registered_kinds",
    "shard_of",
    "shard_prefix",
    "shard_range",
]

"""The instance side (C-SMA): tiered cache model, engine-event ingestion, advertisements.

Pure: no sockets, threads, clocks or randomness; `now_ms`, epochs and seeds are
arguments. The adapters (`catsproto.adapters.vllm_events`, `.instance`, `.metrics`)
do the IO. See docs/node.md.

    cache = TieredCache([TierSpec(Tier.HBM, 1000, 5, 800_000), ...])
    ingest = VllmIngest(cache, BlockKeyer(secret, model_id, block_size))
    builder = AdvertisementBuilder(BuilderConfig(...), cache, epoch)
    for route in builder.poll(now_ms, ComputeState(...)):
        announce(route.prefix, sign(route.advertisement))
"""

from catsproto.node.builder import (
    AdvertisementBuilder,
    AdvertisementTooLarge,
    BuilderConfig,
    BuilderStats,
    RouteAdvertisement,
)
from catsproto.node.cache import (
    BlockEvent,
    BlockEventKind,
    ModelShape,
    PrefixHit,
    TieredCache,
    TierSpec,
)
from catsproto.node.dampening import Dampener, DampeningPolicy, Decision, Reason
from catsproto.node.metrics import CatsMetrics, ComputeState, ScoreScale, cats_metrics
from catsproto.node.vllm import (
    DEFAULT_MEDIA,
    END_SEQ,
    IngestStats,
    KeyMode,
    SeqAction,
    SequenceTracker,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmEventBatch,
    VllmEventError,
    VllmIngest,
    parse_batch,
    parse_event,
)

__all__ = [name for name in dir() if not name.startswith("_")]

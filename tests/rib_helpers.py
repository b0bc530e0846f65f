"""One instance with exact summaries on shard routes, for the RIB's receiver-side tests:
exact sets have no false positives, so every claim the RIB makes can be checked."""

from __future__ import annotations

import numpy as np

from catsproto import wire
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)
from catsproto.selector import RIB
from catsproto.summary import KIND_EXACT
from catsproto.wire import Tier

H = Tier.HBM
CS_ID = 7
ADDRESS = "10.0.0.5"
MAIN = "10.0.0.5/32"  # the instance's own host route


def instance(
    epoch: int = 1,
    *,
    snapshot_every: int = 8,
    shard_range: str = "10.255.1.0/24",
    capacity: int = 100_000,
) -> tuple[AdvertisementBuilder, TieredCache]:
    """A builder that announces every change at once, over an HBM tier of `capacity`."""
    cache = TieredCache([TierSpec(H, capacity, 0, 1_600_000)])
    cfg = BuilderConfig(
        cs_id=CS_ID,
        address=ADDRESS,
        model_id="test/model",
        block_size=4,
        bytes_per_block=65_536,
        site_id=3,
        summary_kind=KIND_EXACT,
        snapshot_every=snapshot_every,
        shard_range=shard_range,
        dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=10**9, change_threshold=0),
    )
    return AdvertisementBuilder(cfg, cache, epoch=epoch), cache


def keys(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(k) for k in rng.integers(1, 2**64 - 1, n, dtype=np.uint64)]


def poll(builder: AdvertisementBuilder, now: int) -> list[tuple[str, wire.Advertisement]]:
    """The routes of one poll, each (prefix, advertisement) after a trip through the codec."""
    return [
        (str(r.prefix), wire.decode(wire.encode(r.advertisement)))
        for r in builder.poll(now, ComputeState())
    ]


def claimed(rib: RIB, ks: list[int]) -> int:
    """How many of `ks` the RIB says the instance holds (0 when it is not there)."""
    table = rib.services.get(CS_ID)
    live = table.live() if table is not None else []
    if not live:
        return 0
    (inst,) = live
    return int(np.count_nonzero(inst.lookup(np.array(ks, dtype=np.uint64))))

"""C-SMA node figures, in one run, printed as JSON.

1. ingest: vLLM KV-event payloads (msgpack, map form, 16-token blocks) decoded and applied
   to the cache model, in block events per second on one core — re-keying every stored
   block from its token ids (real vLLM) and, for comparison, from engine ids (Mooncake).
2. churn: the Mooncake conversation trace replayed through a modelled instance (HBM and
   DRAM with LRU demotion); every cache change becomes the vLLM events a real engine
   would publish (512-token blocks with their token ids), the node ingests them and
   builds dampened, sharded advertisements on the trace's clock. Reported: advertisement
   bytes per second against the raw vLLM event-stream bytes per second for the same
   blocks, and their ratio.

    python benchmarks/node.py [--requests N] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from catsproto import wire
from catsproto.adapters.instance import MEDIUM_OF_TIER, mooncake_tokens
from catsproto.adapters.trace_download import find_or_download_trace
from catsproto.adapters.vllm_events import (
    decode_payload,
    encode_payload,
    removed_event,
    stored_event,
)
from catsproto.keys import ENGINE_MOONCAKE, BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    BlockEventKind,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    KeyMode,
    ModelShape,
    TieredCache,
    TierSpec,
    VllmIngest,
)
from catsproto.wire import Tier

TRACE = find_or_download_trace()
SECRET = b"benchmark-secret-0123456789abcdef"


def ingest_rate(key_mode: KeyMode, seconds: float) -> dict[str, float]:
    """Block events per second through decode_payload + VllmIngest.apply_batch."""
    bs = 16
    payloads = []
    for i in range(2_000):  # 16 stored blocks and 16 removed blocks per batch
        base = i * 16
        tokens = [(base * bs + t) % 50_000 for t in range(16 * bs)]
        events = [stored_event(list(range(base, base + 16)), None, tokens, bs)]
        if i >= 8:
            events.append(removed_event(list(range(base - 128, base - 112))))
        payloads.append(encode_payload(time.time(), events, 0))
    best = 0.0
    for _ in range(3):
        cache = TieredCache([TierSpec(Tier.HBM, 1 << 20, 5, 1)])
        ingest = VllmIngest(cache, BlockKeyer(SECRET, "m", bs), key_mode=key_mode)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 3:
            for p in payloads[n % len(payloads) : n % len(payloads) + 100]:
                ingest.apply_batch(decode_payload(p))
            n += 100
        elapsed = time.perf_counter() - start
        best = max(best, ingest.stats.block_events / elapsed)
    return {"block_events_per_s": round(best), "batches_per_s": round(best / 32)}


def vllm_events(cache_events: Any, parents: dict[int, int | None], bs: int) -> list[Any]:
    out: list[Any] = []
    for ev in cache_events:
        medium = MEDIUM_OF_TIER[ev.tier]
        if ev.kind is BlockEventKind.REMOVED:
            out.append(removed_event(list(ev.keys), medium=medium))
            continue
        if ev.kind is BlockEventKind.MOVED:
            out.append(removed_event(list(ev.keys), medium=medium))
            medium = MEDIUM_OF_TIER[ev.to_tier]
        for h in ev.keys:  # one event per block keeps the parent exact
            out.append(stored_event([h], parents[h], mooncake_tokens(h, bs), bs, medium=medium))
    return out


def churn(requests: int | None) -> dict[str, Any]:
    bs = 512
    tiers = [TierSpec(Tier.HBM, 600, 5, 1_600_000), TierSpec(Tier.DRAM, 8_000, 30, 400_000)]
    engine_cache = TieredCache(tiers)
    node_cache = TieredCache(tiers)
    keyer = BlockKeyer(SECRET, "m", bs)
    ingest = VllmIngest(node_cache, keyer, key_mode=KeyMode.ENGINE_IDS, engine=ENGINE_MOONCAKE)
    shape = ModelShape(32, 8, 128, 2, bs)
    builder = AdvertisementBuilder(
        BuilderConfig(
            cs_id=1,
            address="10.0.0.5",
            model_id="m",
            block_size=bs,
            bytes_per_block=shape.bytes_per_block,
            shard_range="10.255.1.0/24",
            dampening=DampeningPolicy(min_interval_ms=1_000, max_interval_ms=30_000),
        ),
        node_cache,
        epoch=1,
    )
    parents: dict[int, int | None] = {}
    raw_bytes = blocks_changed = 0
    first_ms = last_ms = None
    n = 0
    cpu = time.perf_counter()
    with TRACE.open() as f:
        for line in f:
            if requests is not None and n >= requests:
                break
            req = json.loads(line)
            n += 1
            ids = req["hash_ids"]
            for h, p in zip(ids, [None, *ids], strict=False):
                parents.setdefault(h, p)
            now = int(req["timestamp"])
            first_ms = now if first_ms is None else first_ms
            last_ms = now
            _, events = engine_cache.admit(ids)
            if events:
                out = vllm_events(events, parents, bs)
                payload = encode_payload(now / 1000, out, 0)
                raw_bytes += 8 + len(payload)  # topic (empty) + sequence + payload frames
                blocks_changed += sum(len(e.keys) for e in events)
                ingest.apply_batch(decode_payload(payload))
            builder.poll(now, ComputeState(prefill_rate_tps=8_000.0))
    assert first_ms is not None and last_ms is not None
    seconds = max(1e-3, (last_ms - first_ms) / 1000)
    mirrored = all(
        {keyer.engine_key(ENGINE_MOONCAKE, h) for h in engine_cache.lru_keys(t)}
        == set(node_cache.lru_keys(t))
        for t in engine_cache.order
    )
    st = builder.stats
    return {
        "requests": n,
        "trace_seconds": round(seconds, 1),
        "block_changes": blocks_changed,
        "raw_vllm_event_bytes": raw_bytes,
        "raw_vllm_event_bytes_per_s": round(raw_bytes / seconds),
        "advertisement_bytes": st.bytes,
        "advertisement_bytes_per_s": round(st.bytes / seconds),
        "advertisements": st.advertisements,
        "updates": st.updates,
        "suppressed_polls": st.suppressed,
        "ratio_raw_to_advertised": round(raw_bytes / max(1, st.bytes), 1),
        "node_mirrors_engine": mirrored,
        "shards": {t.name.lower(): 1 << s.shard_bits for t, s in builder._senders.items()},
        "cpu_seconds": round(time.perf_counter() - cpu, 1),
        "note": "advertisement bytes are unsigned attribute values; "
        "a signature adds about 70 bytes to each",
        "wire_version": wire.FORMAT_VERSION,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="trace prefix (default all)")
    parser.add_argument("--seconds", type=float, default=1.5, help="per ingest measurement")
    args = parser.parse_args()
    out = {
        "ingest_tokens_rekey": ingest_rate(KeyMode.TOKENS, args.seconds),
        "ingest_engine_ids": ingest_rate(KeyMode.ENGINE_IDS, args.seconds),
        "ingest_target_block_events_per_s": 50_000,
        "mooncake_churn": churn(args.requests),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Placement on two LRU caches: what the eviction term buys, without engines, in seconds.

The workload of `benchmarks/engine_e2e.py` (every turn of the trace's first
`--conversations` multi-turn conversations, in trace order, one request every 1/rate
seconds, 64 tokens per trace block, prompts cut at 3,500 tokens) placed by the real path
selector on two instances at sites of 7 and 12 ms one-way delay, each modelled as an LRU
cache of `--blocks` 32-token blocks (a hit refreshes the prefix it used; a new block
evicts the least recently used one when the cache is full). Every second each instance's
advertisement (an exact summary of its blocks, its Capacity TLV, its prefill rate) is
accepted into the selector's RIB, as BGP would deliver it. Placements:

- `catsproto`: the selector as shipped (eviction term on);
- `no-eviction-term`: the same selector with `price_evictions=False`;
- `conversation-affinity`: each new conversation to the next instance in turn, its later
  turns to the same one (what a hash of the conversation would do);
- `one-cache`: one LRU cache of both instances' blocks together (no split: a bound).

Prints JSON: per rate, each placement's share of prompt tokens served from cache and
where requests went; `reuse_ceiling` (an infinite cache). The engines' own eviction is
not LRU to the block: `benchmarks/engine_e2e.py` measures the real thing.

    .venv/bin/python benchmarks/placement.py [--rates 1 2 3] [--blocks 2048] [--horizon-ms 120000]
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from catsproto import wire  # noqa: E402
from catsproto.adapters.trace_download import find_or_download_trace  # noqa: E402
from catsproto.keys import BlockKeyer  # noqa: E402
from catsproto.selector import RIB, Link, Network, PathSelector, Request  # noqa: E402
from catsproto.selector.selector import SelectorConfig  # noqa: E402
from catsproto.summary import Summary  # noqa: E402

BLOCK = 32
CS_ID = 200
PREFILL_TPS = 6_000.0  # the lab's engines, about (docs/engine.md)
SITES = {"10.0.2.1": (2, 7.0), "10.0.3.1": (3, 12.0)}


def workload(trace: Path, conversations: int, tokens_per_block: int, max_prompt: int) -> list:
    """(conversation, block keys) per request, in trace order (engine_e2e's selection)."""
    by_conv: dict[int, list[dict]] = {}
    with trace.open() as f:
        for line in f:
            row = json.loads(line)
            if len(row["hash_ids"]) > 1:
                by_conv.setdefault(row["hash_ids"][1], []).append(row)
    multi = [turns for turns in by_conv.values() if len(turns) >= 2][:conversations]
    picked = sorted((r for turns in multi for r in turns), key=lambda r: r["timestamp"])
    keyer = BlockKeyer(b"placement-benchmark-secret-00001", "catsproto-tiny", BLOCK)
    out = []
    for row in picked:
        tokens: list[int] = []
        for h in row["hash_ids"]:
            tokens += np.random.default_rng(h).integers(7, 1024, tokens_per_block).tolist()
        keys = np.array(keyer.block_keys(tokens[:max_prompt]), dtype=np.uint64)
        out.append((row["hash_ids"][1], keys))
    return out


class LruCache:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def serve(self, keys: np.ndarray) -> int:
        """Blocks of the prompt served from cache; the rest stored."""
        k = 0
        while k < len(keys) and int(keys[k]) in self.lru:
            self.lru.move_to_end(int(keys[k]))
            k += 1
        for key in keys[k:].tolist():
            self.lru[key] = None
            if len(self.lru) > self.blocks:
                self.lru.popitem(last=False)
        return k


def advertisement(address: str, cache: LruCache, seq: int, now_ms: int) -> wire.Advertisement:
    site, _ = SITES[address]
    keys = np.fromiter(cache.lru, dtype=np.uint64, count=len(cache.lru))
    tlvs = [
        wire.Version(1),
        wire.Origin(CS_ID, site, ipaddress.ip_address(address)),
        wire.Sequence(1, seq),
        wire.Timestamp(now_ms),
        wire.MetricsL0(
            (
                wire.L0Metric(
                    wire.L0MetricType.PREFILL_THROUGHPUT,
                    wire.Unit.TOKENS_PER_SECOND,
                    wire.Statistic.MEAN,
                    wire.Source.MEASURED,
                    PREFILL_TPS,
                ),
            )
        ),
        wire.CacheModel("catsproto-tiny", BLOCK, wire.KeyScheme.BLAKE2B64_CHAINED, 1),
        wire.Capacity(max(0, cache.blocks - len(keys)), cache.blocks),
    ]
    if len(keys):
        s = Summary.build(keys, 0.0, kind=int(wire.SummaryKind.EXACT))
        entry = wire.SummaryEntry(
            tier=wire.Tier.HBM,
            kind=wire.SummaryKind(s.kind),
            version=seq,
            base_version=0,
            key_lo=0,
            key_hi=(1 << 64) - 1,
            entry_count=len(keys),
            bytes_per_block=BLOCK * 4096,
            fetch_latency_us=5,
            fetch_bandwidth_mbps=1_600_000,
            params=s.params(),
            body=s.encode(),
        )
        tlvs.append(wire.CacheSummaries((entry,)))
    return wire.Advertisement.build(*tlvs)


def run(items: list, rate: float, blocks: int, placement: str, horizon_ms: float) -> dict:
    caches = {a: LruCache(2 * blocks if placement == "one-cache" else blocks) for a in SITES}
    network = Network([Link("ingress", f"site{s}", d, 10_000) for s, d in SITES.values()])
    rib = RIB()
    config = SelectorConfig(
        site_nodes={s: f"site{s}" for s, _ in SITES.values()},
        default_block_size=BLOCK,
        allow_remote_kv=False,
        pending="drain",
        price_evictions=placement != "no-eviction-term",
        reuse_horizon_ms=horizon_ms,
    )
    selector = PathSelector(rib, network, config)
    owner: dict[int, str] = {}
    went: collections.Counter[str] = collections.Counter()
    seq, last, hit, total = 0, None, 0, 0
    for i, (conversation, keys) in enumerate(items):
        now = 1_000 + int(i * 1000 / rate)
        if last is None or now - last >= 1000:
            seq += 1
            for address, cache in caches.items():
                rib.accept(advertisement(address, cache, seq, now), now)
            last = now
        if placement == "one-cache":
            address = next(iter(SITES))
        elif placement == "conversation-affinity":
            address = owner.setdefault(conversation, list(SITES)[len(owner) % len(SITES)])
        else:
            request = Request(CS_ID, keys, len(keys) * BLOCK, "ingress")
            address = str(selector.decide(request, now).chosen.address)
        went[address] += 1
        hit += caches[address].serve(keys)
        total += len(keys)
    return {"cached_fraction": round(hit / total, 4), "instances": dict(went)}


def reuse_ceiling(items: list) -> float:
    seen: set[int] = set()
    hit = total = 0
    for _, keys in items:
        k = 0
        while k < len(keys) and int(keys[k]) in seen:
            k += 1
        hit, total = hit + k, total + len(keys)
        seen.update(keys.tolist())
    return hit / total


PLACEMENTS = ("catsproto", "no-eviction-term", "conversation-affinity", "one-cache")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="the Mooncake conversation trace (default: looked for)")
    p.add_argument("--conversations", type=int, default=100, help="multi-turn conversations")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 3.0], help="per second")
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks of each instance")
    p.add_argument(
        "--horizon-ms", type=float, default=120_000.0, help="the selector's reuse horizon"
    )
    args = p.parse_args()
    if args.blocks < 1 or args.conversations < 1 or any(r <= 0 for r in args.rates):
        p.error("--blocks, --conversations and --rates must be positive")
    if not 0 < args.horizon_ms < float("inf"):
        p.error("--horizon-ms must be a positive number")
    trace = Path(args.trace) if args.trace else find_or_download_trace()
    items = workload(trace, args.conversations, 64, 3500)
    sweep = [
        {
            "rate_per_s": rate,
            **{pl: run(items, rate, args.blocks, pl, args.horizon_ms) for pl in PLACEMENTS},
        }
        for rate in args.rates
    ]
    out = {
        "benchmark": "placement",
        "requests": len(items),
        "blocks_per_instance": args.blocks,
        "reuse_horizon_ms": args.horizon_ms,
        "reuse_ceiling": round(reuse_ceiling(items), 4),
        "sweep": sweep,
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

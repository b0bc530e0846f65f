"""Modelled inference instances for the lab: a stand-in for the node's builder.

`instance_routes` (pure) turns an instance's block keys into the routes it announces:
its CSCI-ID /32 carries its metrics and capacity, and one host route per summary shard
(`catsproto.summary.shard_prefix` inside the instance's own range) carries one
key range's cache summary, each shard sized by `catsproto.summary.build_shards` to fit
one UPDATE with room for the AS_PATH to grow on the way. The process (`main`) lets a
demo lab's instances gain and lose cached blocks every `--interval` seconds and
publishes their routes into the egress's spool. When `catsproto.node` lands, its
builder (with dampening) and `catsproto.security` signing replace this module's
advertisement building; the spool interface stays.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import time

import numpy as np

from catsproto import wire
from catsproto.adapters.exabgp_announce import Spool
from catsproto.lab.topology import InstanceSpec, load
from catsproto.summary import attribute_value_budget, build_shards, shard_prefix

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK_TOKENS = 512
PATH_MARGIN_HOPS = 8  # AS_PATH room for this many ASes on the way to the selector

Prefix = ipaddress.IPv4Network | ipaddress.IPv6Network


def _header(spec: InstanceSpec, sequence: int, now_ms: int) -> list:
    return [
        wire.Version(1),
        wire.Origin(spec.cs_id, spec.site_id, spec.address),
        wire.Sequence(epoch=1, sequence=sequence),
        wire.Timestamp(now_ms),
    ]


def instance_routes(
    spec: InstanceSpec,
    keys: np.ndarray,
    *,
    sequence: int,
    now_ms: int,
    max_message: int = 4096,
    target_fpr: float = 0.01,
    free_blocks: int = 0,
    total_blocks: int = 65536,
    score: int = 5,
) -> dict[Prefix, bytes]:
    """The attribute value for each of the instance's routes (sizes checked)."""
    routes: dict[Prefix, bytes] = {
        spec.csci: wire.encode(
            wire.Advertisement.build(
                *_header(spec, sequence, now_ms),
                wire.MetricsL2(score),
                wire.Capacity(free_blocks=free_blocks, total_blocks=total_blocks),
            )
        )
    }
    shard_base = [
        *_header(spec, sequence, now_ms),
        wire.CacheModel(MODEL, BLOCK_TOKENS, wire.KeyScheme.BLAKE2B64_CHAINED, 1),
    ]
    other = len(wire.encode(wire.Advertisement.build(*shard_base)))
    budget = attribute_value_budget(max_message, as_path_hops=PATH_MARGIN_HOPS) - other
    for shard in build_shards(keys, budget, target_fpr):
        entry = wire.SummaryEntry(
            tier=wire.Tier.HBM,
            kind=wire.SummaryKind(shard.summary.kind),
            version=sequence,
            base_version=0,
            key_lo=shard.key_lo,
            key_hi=shard.key_hi,
            entry_count=shard.entry_count,
            bytes_per_block=128 * 1024,
            fetch_latency_us=5,
            fetch_bandwidth_mbps=800_000,
            params=shard.summary.params(),
            body=shard.summary.encode(),
        )
        adv = wire.Advertisement.build(*shard_base, wire.CacheSummaries((entry,)))
        routes[shard_prefix(spec.shards, shard.index)] = wire.encode(adv)
    return routes


class ModelledInstance:
    """An instance whose cache drifts: some blocks evicted, some added, each step."""

    def __init__(self, spec: InstanceSpec, seed: int, blocks: int = 2000) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.keys = self.rng.integers(0, 2**63, size=blocks, dtype=np.uint64) * np.uint64(2)
        self.sequence = 0

    def step(self, churn: int = 50) -> None:
        keep = self.rng.permutation(self.keys.size)[churn:]
        fresh = self.rng.integers(0, 2**63, size=churn, dtype=np.uint64) * np.uint64(2)
        self.keys = np.concatenate([self.keys[keep], fresh])
        self.sequence += 1

    def routes(self, now_ms: int, max_message: int) -> dict[Prefix, bytes]:
        return instance_routes(
            self.spec,
            self.keys,
            sequence=self.sequence,
            now_ms=now_ms,
            max_message=max_message,
            free_blocks=int(65536 - self.keys.size),
        )


def publish(spool: Spool, routes: dict[Prefix, bytes], previous: set[Prefix]) -> set[Prefix]:
    """Write every route; withdraw routes (e.g. shards) no longer present."""
    for prefix, value in routes.items():
        spool.publish(prefix, value)
    for gone in previous - routes.keys():
        spool.withdraw(gone)
    return set(routes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="modelled inference instances behind one egress")
    p.add_argument("--topology", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--max-message", type=int, default=4096)
    args = p.parse_args(argv)
    node = load(args.topology).nodes[args.node]
    spool = Spool(args.spool)
    instances = [ModelledInstance(spec, seed=i + 1) for i, spec in enumerate(node.instances)]
    published: dict[str, set[Prefix]] = {i.spec.name: set() for i in instances}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping:
            for inst in instances:
                inst.step()
                routes = inst.routes(int(time.time() * 1000), args.max_message)
                published[inst.spec.name] = publish(spool, routes, published[inst.spec.name])
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:  # a stopped instance withdraws its routes
        for prefixes in published.values():
            for prefix in prefixes:
                spool.withdraw(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

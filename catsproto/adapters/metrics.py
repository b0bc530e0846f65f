"""Prometheus exposition of a C-SMA node (prometheus_client).

A collector reads the node's own counters at scrape time (nothing is counted twice, and
the pure core stays free of prometheus_client): blocks per tier, prefix hit ratio (when
the instance reports hits), block events ingested, advertisements built and suppressed
by dampening, bytes advertised, replay recoveries (and the failed ones, by reason),
blocks refused for a block size the node does not key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from catsproto.adapters.vllm_events import SubscriberStats
from catsproto.node import BuilderStats, IngestStats, TieredCache

__all__ = ["CONTENT_TYPE", "HitCounter", "NodeCollector", "node_registry", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class HitCounter:
    """Prefix-cache lookups and hits in blocks, as reported by the instance."""

    lookup_blocks: int = 0
    hit_blocks: int = 0

    @property
    def ratio(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


class NodeCollector(Collector):
    """Reads one node's state on every scrape."""

    def __init__(
        self,
        cache: TieredCache,
        builder_stats: Callable[[], BuilderStats],
        ingest_stats: Callable[[], IngestStats] | None = None,
        subscriber_stats: Callable[[], SubscriberStats] | None = None,
        hits: HitCounter | None = None,
        instance: str = "",
    ) -> None:
        self.cache = cache
        self.builder_stats = builder_stats
        self.ingest_stats = ingest_stats
        self.subscriber_stats = subscriber_stats
        self.hits = hits
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        inst = self.instance
        blocks = GaugeMetricFamily(
            "catsproto_node_blocks", "KV blocks held per tier", labels=["instance", "tier"]
        )
        capacity = GaugeMetricFamily(
            "catsproto_node_capacity_blocks",
            "KV block capacity per tier",
            labels=["instance", "tier"],
        )
        for tier in self.cache.order:
            name = tier.name.lower()
            blocks.add_metric([inst, name], self.cache.count(tier))
            capacity.add_metric([inst, name], self.cache.specs[tier].capacity_blocks)
        yield blocks
        yield capacity
        if self.hits is not None:
            g = GaugeMetricFamily(
                "catsproto_node_hit_ratio", "prefix-cache hit ratio in blocks", labels=["instance"]
            )
            g.add_metric([inst], self.hits.ratio)
            yield g
        b = self.builder_stats()
        for name, doc, value in (
            ("advertisements", "advertisements built", b.advertisements),
            ("updates", "polls that produced advertisements", b.updates),
            ("suppressed", "updates held back by the minimum interval", b.suppressed),
            ("advertised_bytes", "unsigned attribute bytes advertised", b.bytes),
        ):
            c = CounterMetricFamily(f"catsproto_node_{name}", doc, labels=["instance"])
            c.add_metric([inst], value)
            yield c
        if self.ingest_stats is not None:
            s = self.ingest_stats()
            c = CounterMetricFamily(
                "catsproto_node_block_events",
                "vLLM block events ingested",
                labels=["instance", "kind"],
            )
            c.add_metric([inst, "stored"], s.blocks_stored)
            c.add_metric([inst, "removed"], s.blocks_removed)
            yield c
            c = CounterMetricFamily(
                "catsproto_node_event_batches", "vLLM event batches ingested", labels=["instance"]
            )
            c.add_metric([inst], s.batches)
            yield c
            c = CounterMetricFamily(
                "catsproto_node_block_size_mismatch_blocks",
                "vLLM blocks refused: their block size is not the node's (never keyed)",
                labels=["instance"],
            )
            c.add_metric([inst], s.block_size_mismatch)
            yield c
        if self.subscriber_stats is not None:
            s2 = self.subscriber_stats()
            c = CounterMetricFamily(
                "catsproto_node_recoveries",
                "sequence gaps and how they ended",
                labels=["instance", "outcome"],
            )
            c.add_metric([inst, "replayed"], s2.gaps - s2.resyncs)
            c.add_metric([inst, "resync"], s2.resyncs)
            c.add_metric([inst, "restart"], s2.restarts)
            yield c
            c = CounterMetricFamily(
                "catsproto_node_bad_event_payloads",
                "vLLM event frames refused (not msgpack, or an event that fails its checks)",
                labels=["instance"],
            )
            c.add_metric([inst], s2.bad_payloads)
            yield c
            c = CounterMetricFamily(
                "catsproto_node_failed_recoveries",
                "sequence gaps the replay did not fill (each resynced its rank)",
                labels=["instance", "reason"],
            )
            for reason, n in s2.failed_by_reason.items():
                c.add_metric([inst, reason], n)
            yield c


def node_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format for an HTTP /metrics response."""
    return generate_latest(registry)

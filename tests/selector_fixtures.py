"""Small builders for selector tests: advertisements with real summaries."""

from __future__ import annotations

import ipaddress

import numpy as np

from catsproto import wire
from catsproto.summary import Summary

FULL = (0, (1 << 64) - 1)
BLOCK = 512
BYTES_PER_BLOCK = 64 * 1024 * 1024  # 512 tokens x 128 KiB (Llama-3.1-8B, fp16 KV)


def entry(
    keys,
    tier=wire.Tier.HBM,
    kind=wire.SummaryKind.EXACT,
    version=1,
    fpr=0.01,
    latency_us=5,
    mbps=800_000,
    base_version=0,
    summary=None,
):
    s = (
        summary
        if summary is not None
        else Summary.build(np.asarray(keys, dtype=np.uint64), fpr, kind=int(kind))
    )
    return wire.SummaryEntry(
        tier=tier,
        kind=wire.SummaryKind(s.kind),
        version=version,
        base_version=base_version,
        key_lo=FULL[0],
        key_hi=FULL[1],
        entry_count=len(keys),
        bytes_per_block=BYTES_PER_BLOCK,
        fetch_latency_us=latency_us,
        fetch_bandwidth_mbps=mbps,
        params=s.params(),
        body=s.encode(),
    )


def advert(
    address,
    site,
    entries=(),
    seq=1,
    ts=1000,
    tps=10_000.0,
    backlog=0.0,
    cs_id=7,
    epoch=1,
    block=BLOCK,
    secret_id=1,
    key_scheme=wire.KeyScheme.BLAKE2B64_CHAINED,
    capacity=None,
):
    """`capacity`: (free, total) KV blocks for a Capacity TLV; None: none."""
    tlvs = [
        wire.Version(1),
        wire.Origin(cs_id, site, ipaddress.ip_address(address)),
        wire.Sequence(epoch, seq),
        wire.Timestamp(ts),
        wire.MetricsL0(
            (
                wire.L0Metric(
                    wire.L0MetricType.PREFILL_THROUGHPUT,
                    wire.Unit.TOKENS_PER_SECOND,
                    wire.Statistic.MEAN,
                    wire.Source.MEASURED,
                    float(tps),
                ),
                wire.L0Metric(
                    wire.L0MetricType.OUTSTANDING_PREFILL_TOKENS,
                    wire.Unit.COUNT,
                    wire.Statistic.CURRENT,
                    wire.Source.MEASURED,
                    float(backlog),
                ),
            )
        ),
        wire.CacheModel("test-model", block, key_scheme, secret_id),
    ]
    if capacity is not None:
        tlvs.append(wire.Capacity(*capacity))
    if entries:
        tlvs.append(wire.CacheSummaries(tuple(entries)))
    return wire.Advertisement.build(*tlvs)

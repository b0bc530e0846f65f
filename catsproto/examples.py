"""Example advertisements: the demo's input and the source of the codec's test vectors.

Deterministic by construction (no clock, no randomness): the same bytes every run, so
the vectors in tests/vectors/ and the draft's appendix can be regenerated and compared.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, replace

import numpy as np

from catsproto.summary import Summary
from catsproto.wire import (
    Advertisement,
    AeadAlgorithm,
    CacheModel,
    CacheSummaries,
    Capacity,
    Delegation,
    HotPrefix,
    HotPrefixes,
    KeyScheme,
    L0Metric,
    L1Score,
    MetricCategory,
    MetricsL0,
    MetricsL1,
    MetricsL2,
    Origin,
    ScopeEntry,
    ScopeKind,
    SealedCache,
    Sequence,
    Signature,
    SignatureAlgorithm,
    Source,
    Statistic,
    SummaryEntry,
    SummaryKind,
    Tier,
    Timestamp,
    Unit,
    UnknownTLV,
    Version,
)

T0_MS = 1_795_000_000_000  # 2026-11-18T09:46:40Z, a fixed instant for examples
FULL_RANGE = (0, (1 << 64) - 1)
# KV bytes of one 512-token block of Llama-3.1-8B in fp16: 32 layers x 8 KV heads x
# 128 dims x 2 (K and V) x 2 bytes = 128 KiB per token, 64 MiB per block.
LLAMA_8B_BYTES_PER_BLOCK = 32 * 8 * 128 * 2 * 2 * 512


@dataclass(frozen=True)
class Example:
    name: str
    description: str
    advertisement: Advertisement


def _filler(label: str, n: int) -> bytes:
    """Deterministic stand-in bytes (for opaque bodies and signatures in framing vectors)."""
    out = b""
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return out[:n]


def _header(address: str, cs_id: int = 100, site_id: int = 1, seq: int = 1) -> list:
    return [
        Version(1),
        Origin(cs_id, site_id, ipaddress.ip_address(address)),
        Sequence(epoch=1, sequence=seq),
        Timestamp(T0_MS + seq * 1000),
    ]


def _metrics() -> list:
    return [
        MetricsL0(
            (
                L0Metric(1, Unit.PERCENT, Statistic.MEAN, Source.MEASURED, 63.5),
                L0Metric(3, Unit.COUNT, Statistic.CURRENT, Source.MEASURED, 4.0),
                L0Metric(7, Unit.MILLISECONDS, Statistic.P95, Source.ESTIMATED, 182.25),
            )
        ),
        MetricsL1(
            (
                L1Score(MetricCategory.COMPUTE, 6),
                L1Score(MetricCategory.COMMUNICATION, 8),
                L1Score(MetricCategory.SERVICE, 7),
                L1Score(MetricCategory.COMPOSED, 7),
            )
        ),
        MetricsL2(7),
    ]


def _summary(
    tier: Tier, kind: SummaryKind | int, body_len: int, latency_us: int, mbps: int, params=b""
):
    return SummaryEntry(
        tier=tier,
        kind=kind,
        version=3,
        base_version=0,
        key_lo=FULL_RANGE[0],
        key_hi=FULL_RANGE[1],
        entry_count=body_len,
        bytes_per_block=LLAMA_8B_BYTES_PER_BLOCK,
        fetch_latency_us=latency_us,
        fetch_bandwidth_mbps=mbps,
        params=params,
        body=_filler(f"{tier.name}-{getattr(kind, 'name', kind)}", body_len),
    )


# Block keys of the one example whose summary body is real (an exact set, kind 1).
EXACT_KEYS = (0x0123456789ABCDEF, 0x13579BDF2468ACE0, 0x8899AABBCCDDEEFF, 0xFEDCBA9876543210)


def _exact_summary(tier: Tier, keys: tuple[int, ...], latency_us: int, mbps: int):
    summary = Summary.build(np.array(keys, dtype=np.uint64), 0.0, kind=SummaryKind.EXACT)
    return replace(
        _summary(tier, SummaryKind.EXACT, 0, latency_us, mbps),
        entry_count=len(keys),
        params=summary.params(),
        body=summary.encode(),
    )


def examples() -> list[Example]:
    cache_model = CacheModel(
        "meta-llama/Llama-3.1-8B-Instruct", 512, KeyScheme.BLAKE2B64_CHAINED, 7
    )
    return [
        Example(
            "minimal-ipv4",
            "The four mandatory TLVs only, IPv4 instance address.",
            Advertisement.build(*_header("192.0.2.10")),
        ),
        Example(
            "metrics-ipv6",
            "CATS metrics at levels L0, L1 and L2 from an IPv6 instance.",
            Advertisement.build(*_header("2001:db8::10", site_id=2, seq=7), *_metrics()),
        ),
        Example(
            "cache-state",
            "Cache model, exact summary of 16 keys in HBM (opaque body), capacity, "
            "two hot prefixes and an Ed25519-shaped signature (placeholder bytes).",
            Advertisement.build(
                *_header("192.0.2.11", seq=42),
                MetricsL2(5),
                cache_model,
                CacheSummaries((_summary(Tier.HBM, SummaryKind.EXACT, 16, 5, 800_000),)),
                Capacity(free_blocks=1200, total_blocks=65536),
                HotPrefixes((HotPrefix(0x0123456789ABCDEF, 4), HotPrefix(0xFEDCBA9876543210, 31))),
                Signature(SignatureAlgorithm.ED25519, b"op1/inst11", _filler("sig", 64)),
            ),
        ),
        Example(
            "extended-length",
            "Three tiers of summaries: the value exceeds 255 bytes, so the path "
            "attribute uses the Extended Length flag (0xD0).",
            Advertisement.build(
                *_header("198.51.100.20", cs_id=200, site_id=3, seq=9),
                cache_model,
                CacheSummaries(
                    (
                        _summary(Tier.HBM, SummaryKind.FUSE, 96, 5, 800_000),
                        _summary(Tier.DRAM, SummaryKind.BLOOM, 128, 40, 200_000),
                        _summary(Tier.SSD, SummaryKind.FUSE, 64, 400, 25_000),
                    )
                ),
            ),
        ),
        Example(
            "unknown-tlv",
            "TLV types 300 and 40000 are not in the registry: kept and re-emitted byte for byte.",
            Advertisement.build(
                *_header("192.0.2.12", seq=3),
                UnknownTLV(300, bytes.fromhex("deadbeef")),
                UnknownTLV(40000, b""),
            ),
        ),
        Example(
            "sealed-delegated",
            "Cache section sealed under group key 7 (opaque ciphertext), the operator's "
            "delegation of the signing key carried in-band (CS-ID 100, route 10.0.0.0/16, "
            "instance range 192.0.2.0/24) and a signature (placeholder bytes throughout; "
            "tests/vectors/security.json has real ones).",
            Advertisement.build(
                *_header("192.0.2.14", seq=43),
                MetricsL2(6),
                SealedCache(
                    AeadAlgorithm.CHACHA20_POLY1305, 7, _filler("nonce", 12), _filler("ct", 48)
                ),
                Delegation(
                    algorithm=SignatureAlgorithm.ED25519,
                    operator_key_id=_filler("op-key-id", 8),
                    node_key=_filler("node-key", 32),
                    not_before_ms=T0_MS,
                    not_after_ms=T0_MS + 30 * 86_400_000,
                    operator_signature=_filler("op-sig", 64),
                    scope=(
                        ScopeEntry.for_cs_id(100),
                        ScopeEntry.for_network(
                            ScopeKind.ROUTE, ipaddress.ip_network("10.0.0.0/16")
                        ),
                        ScopeEntry.for_network(
                            ScopeKind.ADDRESS, ipaddress.ip_network("192.0.2.0/24")
                        ),
                    ),
                ),
                Signature(SignatureAlgorithm.ED25519, _filler("node-key-id", 8), _filler("s", 64)),
            ),
        ),
        Example(
            "unknown-summary-kind",
            "Two summaries: in HBM an exact set of four keys (a real Rice-coded body), in "
            "DRAM one of kind 200, which no registry names (placeholder params and body). "
            "The attribute is well formed: a receiver ignores the DRAM entry, uses the HBM "
            "one, and passes both on unchanged.",
            Advertisement.build(
                *_header("192.0.2.15", seq=44),
                cache_model,
                CacheSummaries(
                    (
                        _exact_summary(Tier.HBM, EXACT_KEYS, 5, 800_000),
                        _summary(Tier.DRAM, 200, 8, 40, 200_000, params=b"\x01\x02"),
                    )
                ),
            ),
        ),
    ]


def large_advertisement(summary_bytes: int = 16 * 1024) -> Advertisement:
    """A realistic big advertisement: metrics plus one summary body of `summary_bytes`."""
    return Advertisement.build(
        *_header("192.0.2.13", seq=11),
        *_metrics(),
        CacheModel("meta-llama/Llama-3.1-8B-Instruct", 512, KeyScheme.BLAKE2B64_CHAINED, 7),
        CacheSummaries((_summary(Tier.HBM, SummaryKind.FUSE, summary_bytes, 5, 800_000),)),
        Capacity(free_blocks=1200, total_blocks=65536),
    )


def small_advertisement() -> Advertisement:
    """Metrics only: the advertisement an instance sends when only its load changed."""
    return Advertisement.build(*_header("192.0.2.13", seq=12), *_metrics())

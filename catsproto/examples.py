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
from catsproto.summary.delta import DeltaSummary
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
    MetricsBasis,
    MetricsL0,
    MetricsL1,
    MetricsL2,
    NormalisationFunction,
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
from catsproto.wire.tlvs import key_id

T0_MS = 1_795_000_000_000  # 2026-11-18T09:46:40Z, a fixed instant for examples
FULL_RANGE = (0, (1 << 64) - 1)
# KV bytes of one 512-token block of Llama-3.1-8B in fp16: 32 layers x 8 KV heads x
# 128 dims x 2 (K and V) x 2 bytes = 128 KiB per token, 64 MiB per block.
LLAMA_8B_BYTES_PER_BLOCK = 32 * 8 * 128 * 2 * 2 * 512


@dataclass(frozen=True)
class Body:
    """What one summary entry of an example was built from, for the body vectors.

    keys: the key set the entry describes (for a delta, the set after applying it).
    For a delta also the keys it adds and removes and the example (same origin, same
    tier) whose snapshot is its base.
    """

    tier: Tier
    keys: tuple[int, ...]
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    base: str | None = None


@dataclass(frozen=True)
class Example:
    name: str
    description: str
    advertisement: Advertisement
    bodies: tuple[Body, ...] = ()


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
                L1Score(MetricCategory.COMPUTING, 6),
                L1Score(MetricCategory.COMMUNICATION, 8),
                L1Score(MetricCategory.SERVICE, 7),
                L1Score(MetricCategory.COMPOSED, 7),
            )
        ),
        MetricsL2(7),
        # The mean and the p95 above are over the WG's default 10 s window; the scores
        # were computed by queue-reference with R = 1000 ms.
        MetricsBasis(10_000, NormalisationFunction.QUEUE_REFERENCE, 1000),
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


def example_keys(label: str, n: int) -> tuple[int, ...]:
    """n distinct stand-in block keys, sorted: the first 8 bytes of SHA-256(label/i)."""
    keys = {int.from_bytes(hashlib.sha256(f"{label}/{i}".encode()).digest()[:8], "big")
            for i in range(n)}  # fmt: skip
    assert len(keys) == n
    return tuple(sorted(keys))


# Block keys of the unknown-summary-kind example's exact set (kind 1).
EXACT_KEYS = (0x0123456789ABCDEF, 0x13579BDF2468ACE0, 0x8899AABBCCDDEEFF, 0xFEDCBA9876543210)
# The cache-state example's 16 keys (an exact set in HBM; also the security vectors').
CACHE_KEYS = example_keys("cache-state/hbm", 16)
# The extended-length example: a fuse filter in HBM, a Bloom filter in DRAM, a fuse
# filter in SSD, all at a 1 % target; and the fuse-delta example's change to the HBM one.
FUSE_KEYS = example_keys("extended-length/hbm", 40)
BLOOM_KEYS = example_keys("extended-length/dram", 24)
SSD_KEYS = example_keys("extended-length/ssd", 12)
DELTA_ADDED = example_keys("fuse-delta/added", 3)
DELTA_REMOVED = FUSE_KEYS[:2]
SUMMARY_FPR = 0.01
# Filter seeds: fixed, so the bodies are the same every run.
SEEDS = {Tier.HBM: 0x00C0FFEE00000001, Tier.DRAM: 0x00C0FFEE00000002, Tier.SSD: 0x00C0FFEE00000003}


def _real_summary(
    tier: Tier, kind: SummaryKind, keys: tuple[int, ...], latency_us: int, mbps: int,
    version: int = 3,
) -> SummaryEntry:  # fmt: skip
    """An entry whose params and body are a real summary of `keys`, built by the code."""
    fpr = 0.0 if kind == SummaryKind.EXACT else SUMMARY_FPR
    summary = Summary.build(np.array(keys, dtype=np.uint64), fpr, kind=kind, seed=SEEDS[tier])
    return replace(
        _summary(tier, kind, 0, latency_us, mbps),
        version=version,
        entry_count=len(keys),
        params=summary.params(),
        body=summary.encode(),
    )


def _exact_summary(tier: Tier, keys: tuple[int, ...], latency_us: int, mbps: int):
    return _real_summary(tier, SummaryKind.EXACT, keys, latency_us, mbps)


def _delta_summary(tier: Tier, latency_us: int, mbps: int) -> SummaryEntry:
    """Version 4 of the extended-length example's HBM stream: a delta on its version 3."""
    delta = DeltaSummary(np.array(DELTA_ADDED, dtype=np.uint64),
                         np.array(DELTA_REMOVED, dtype=np.uint64))  # fmt: skip
    return replace(
        _summary(tier, SummaryKind.DELTA, 0, latency_us, mbps),
        version=4,
        base_version=3,
        entry_count=len(FUSE_KEYS) - len(DELTA_REMOVED) + len(DELTA_ADDED),
        params=delta.params(),
        body=delta.encode(),
    )


# Scope entries of the sealed-delegated example, in the order the codec requires:
# octet-wise on (Kind, Value), so 2001:db8::/32 (value 20 20 01 0d b8 ...) precedes
# 192.0.2.14/32 (value 20 c0 00 02 0e) although its value is longer.
SCOPE_ADDRESSES = (
    ScopeEntry.for_network(ScopeKind.ADDRESS, ipaddress.ip_network("2001:db8::/32")),
    ScopeEntry.for_network(ScopeKind.ADDRESS, ipaddress.ip_network("192.0.2.14/32")),
)
# The node key the sealed-delegated example's delegation authorises (placeholder octets);
# its Signature TLV names this key by its derived id, as a carried delegation requires.
SEALED_NODE_KEY = _filler("node-key", 32)
SITE_NODE_KEY = _filler("site-node-key", 32)  # the same for the site-delegated example


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
            "Cache model, exact set of 16 keys in HBM (a real Rice-coded body), "
            "capacity, two hot prefixes and an Ed25519-shaped signature (placeholder "
            "bytes; its 8-octet Key ID is derived from a placeholder public key).",
            Advertisement.build(
                *_header("192.0.2.11", seq=42),
                MetricsL2(5),
                cache_model,
                CacheSummaries((_exact_summary(Tier.HBM, CACHE_KEYS, 5, 800_000),)),
                Capacity(free_blocks=1200, total_blocks=65536),
                HotPrefixes((HotPrefix(0x0123456789ABCDEF, 4), HotPrefix(0xFEDCBA9876543210, 31))),
                Signature(
                    SignatureAlgorithm.ED25519,
                    key_id(_filler("cache-state-node-key", 32)),
                    _filler("sig", 64),
                ),
            ),
            (Body(Tier.HBM, CACHE_KEYS),),
        ),
        Example(
            "extended-length",
            "Three tiers of summaries, real filters at a 1 % target: a binary fuse "
            "filter of 40 keys in HBM, a Bloom filter of 24 keys in DRAM, a fuse filter "
            "of 12 keys in SSD. The value exceeds 255 bytes, so the path attribute uses "
            "the Extended Length flag (0xD0).",
            Advertisement.build(
                *_header("198.51.100.20", cs_id=200, site_id=3, seq=9),
                cache_model,
                CacheSummaries(
                    (
                        _real_summary(Tier.HBM, SummaryKind.FUSE, FUSE_KEYS, 5, 800_000),
                        _real_summary(Tier.DRAM, SummaryKind.BLOOM, BLOOM_KEYS, 40, 200_000),
                        _real_summary(Tier.SSD, SummaryKind.FUSE, SSD_KEYS, 400, 25_000),
                    )
                ),
            ),
            (
                Body(Tier.HBM, FUSE_KEYS),
                Body(Tier.DRAM, BLOOM_KEYS),
                Body(Tier.SSD, SSD_KEYS),
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
            "instance addresses 2001:db8::/32 and 192.0.2.14/32) and a signature "
            "(placeholder keys and signature bytes; tests/vectors/security.json has real "
            "ones). "
            f"The Signature TLV's Key ID {key_id(SEALED_NODE_KEY).hex()} is the one "
            "derived from the delegation's Node Public Key, so the delegation is for the "
            "key that signs. "
            "The two address entries are in octet order of (Kind, Value): the IPv6 one, "
            "longer, comes first because its second octet (0x20) is below 0xc0.",
            Advertisement.build(
                *_header("192.0.2.14", seq=43),
                MetricsL2(6),
                SealedCache(
                    AeadAlgorithm.CHACHA20_POLY1305, 7, _filler("nonce", 12), _filler("ct", 48)
                ),
                Delegation(
                    algorithm=SignatureAlgorithm.ED25519,
                    operator_key_id=_filler("op-key-id", 8),
                    node_key=SEALED_NODE_KEY,
                    not_before_ms=T0_MS,
                    not_after_ms=T0_MS + 30 * 86_400_000,
                    operator_signature=_filler("op-sig", 64),
                    scope=(
                        ScopeEntry.for_cs_id(100),
                        ScopeEntry.for_network(
                            ScopeKind.ROUTE, ipaddress.ip_network("10.0.0.0/16")
                        ),
                        *SCOPE_ADDRESSES,
                    ),
                ),
                Signature(SignatureAlgorithm.ED25519, key_id(SEALED_NODE_KEY), _filler("s", 64)),
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
            (Body(Tier.HBM, EXACT_KEYS),),
        ),
        Example(
            "fuse-delta",
            "The next update of the extended-length origin: its HBM stream at version 4, "
            "a delta on the fuse snapshot of version 3 that adds three keys and removes "
            "two. Applied to that snapshot it gives a layered view: added keys are "
            "members, removed keys are not, the others are answered by the fuse filter.",
            Advertisement.build(
                *_header("198.51.100.20", cs_id=200, site_id=3, seq=10),
                cache_model,
                CacheSummaries((_delta_summary(Tier.HBM, 5, 800_000),)),
            ),
            (
                Body(
                    Tier.HBM,
                    tuple(sorted(set(FUSE_KEYS) - set(DELTA_REMOVED) | set(DELTA_ADDED))),
                    added=DELTA_ADDED,
                    removed=DELTA_REMOVED,
                    base="extended-length",
                ),
            ),
        ),
        Example(
            "sealed-algorithm-unknown",
            "Cache section sealed with AEAD algorithm 200, which no registry names, under "
            "group key 7 with a 24-octet nonce (placeholder nonce and ciphertext). The "
            "attribute is well formed: the 12-octet nonce rule is that of algorithm 1 "
            "only. A receiver leaves the section unopened, as without the group key, uses "
            "the metrics and passes the TLV on unchanged.",
            Advertisement.build(
                *_header("192.0.2.16", seq=45),
                MetricsL2(4),
                SealedCache(200, 7, _filler("nonce-200", 24), _filler("ct-200", 48)),
            ),
        ),
        Example(
            "site-delegated",
            "A delegation carried in-band that binds the node key to site 1: CS-ID 100, "
            "route 10.0.0.0/16, instance address 192.0.2.17/32 and a site entry (kind "
            "4), the one optional scope kind (placeholder keys and signature bytes). The "
            "Origin names site 1; one naming any other site would be refused as "
            "not-authorised, whereas a delegation without site entries authorises every "
            f"site. The Signature TLV's Key ID {key_id(SITE_NODE_KEY).hex()} is the one "
            "derived from the delegation's Node Public Key.",
            Advertisement.build(
                *_header("192.0.2.17", seq=46),
                Delegation(
                    algorithm=SignatureAlgorithm.ED25519,
                    operator_key_id=_filler("op-key-id", 8),
                    node_key=SITE_NODE_KEY,
                    not_before_ms=T0_MS,
                    not_after_ms=T0_MS + 30 * 86_400_000,
                    operator_signature=_filler("site-op-sig", 64),
                    scope=(
                        ScopeEntry.for_cs_id(100),
                        ScopeEntry.for_network(
                            ScopeKind.ROUTE, ipaddress.ip_network("10.0.0.0/16")
                        ),
                        ScopeEntry.for_network(
                            ScopeKind.ADDRESS, ipaddress.ip_network("192.0.2.17/32")
                        ),
                        ScopeEntry.for_site(1),
                    ),
                ),
                Signature(SignatureAlgorithm.ED25519, key_id(SITE_NODE_KEY), _filler("s-17", 64)),
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

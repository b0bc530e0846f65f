"""Hypothesis strategies for every TLV and for whole advertisements."""

from __future__ import annotations

import ipaddress

from hypothesis import strategies as st

from catsproto import wire

U8 = st.integers(0, 0xFF)
U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFFFFFF)
U64 = st.integers(0, (1 << 64) - 1)
# -0.0 is refused (it equals +0.0, so it would be a second encoding of zero): + 0.0 maps
# it to +0.0 and leaves every other float as it is
FINITE = st.floats(allow_nan=False, allow_infinity=False).map(lambda v: v + 0.0)


def sorted_unique(items, key, max_size=8):
    return st.lists(items, min_size=1, max_size=max_size, unique_by=key).map(
        lambda xs: tuple(sorted(xs, key=key))
    )


addresses = st.one_of(
    st.builds(ipaddress.IPv4Address, U32),
    st.builds(ipaddress.IPv6Address, st.integers(0, (1 << 128) - 1)),
)
origins = st.builds(wire.Origin, st.integers(1, 0xFFFFFFFF), U32, addresses)
sequences = st.builds(wire.Sequence, U32, U64)
timestamps = st.builds(wire.Timestamp, U64)
l0 = st.builds(
    wire.L0Metric,
    st.integers(1, 0xFFFF),  # 0 is reserved and malformed
    st.sampled_from(wire.Unit),
    st.sampled_from(wire.Statistic),
    st.sampled_from(wire.Source),
    FINITE,
)
metrics_l0 = st.builds(wire.MetricsL0, sorted_unique(l0, wire.L0Metric.key))
metrics_l1 = st.builds(
    wire.MetricsL1,
    sorted_unique(
        st.builds(wire.L1Score, st.sampled_from(wire.MetricCategory), st.integers(0, 10)),
        lambda s: s.category,
    ),
)
metrics_l2 = st.builds(wire.MetricsL2, st.integers(0, 10))
metrics_bases = st.builds(
    wire.MetricsBasis,
    st.integers(1, (1 << 64) - 1),
    st.one_of(st.sampled_from(wire.NormalisationFunction), st.integers(1, 255)),
    st.integers(1, 0xFFFFFFFF),
)
cache_models = st.builds(
    wire.CacheModel,
    st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= 255),
    st.integers(1, 0xFFFFFFFF),
    st.sampled_from(wire.KeyScheme),
    U32,
)


@st.composite
def summary_entries(draw):
    lo, hi = sorted((draw(U64), draw(U64)))
    version = draw(st.integers(1, 0xFFFFFFFF))
    return wire.SummaryEntry(
        tier=draw(st.sampled_from(wire.Tier)),
        kind=draw(st.one_of(st.sampled_from(wire.SummaryKind), st.integers(5, 255))),
        version=version,
        base_version=draw(st.one_of(st.just(0), st.integers(0, version - 1))),
        key_lo=lo,
        key_hi=hi,
        entry_count=draw(U32),
        bytes_per_block=draw(U32),
        fetch_latency_us=draw(U32),
        fetch_bandwidth_mbps=draw(U32),
        params=draw(st.binary(max_size=24)),
        body=draw(st.binary(max_size=300)),
    )


cache_summaries = st.builds(
    wire.CacheSummaries, sorted_unique(summary_entries(), lambda e: e.tier, max_size=4)
)


@st.composite
def capacities(draw):
    total = draw(U64)
    return wire.Capacity(draw(st.integers(0, total)), total)


hot_prefixes = st.builds(
    wire.HotPrefixes,
    sorted_unique(
        st.builds(wire.HotPrefix, U64, st.integers(1, 0xFFFFFFFF)), lambda p: p.block_key
    ),
)
signatures = st.builds(
    wire.Signature,
    st.just(wire.SignatureAlgorithm.ED25519),
    st.binary(min_size=8, max_size=8),  # an Ed25519 Key ID is 8 octets
    st.binary(min_size=64, max_size=64),
)


def _networks(kind: wire.ScopeKind):
    v4 = st.builds(lambda a, n: ipaddress.ip_network((a, n), strict=False), U32, st.integers(0, 32))
    v6 = st.builds(
        lambda a, n: ipaddress.ip_network((a, n), strict=False),
        st.integers(0, (1 << 128) - 1),
        st.integers(0, 128),
    )
    return st.one_of(v4, v6).map(lambda n: wire.ScopeEntry.for_network(kind, n))


@st.composite
def delegations(draw):
    """Ed25519 delegations: at least one CS-ID, route and address entry, and zero to
    three site entries (none: every site)."""
    scope = draw(
        st.lists(st.integers(1, 0xFFFFFFFF).map(wire.ScopeEntry.for_cs_id), min_size=1, max_size=3)
    )
    scope += draw(st.lists(_networks(wire.ScopeKind.ROUTE), min_size=1, max_size=3))
    scope += draw(st.lists(_networks(wire.ScopeKind.ADDRESS), min_size=1, max_size=3))
    scope += draw(st.lists(U32.map(wire.ScopeEntry.for_site), max_size=3))
    not_before = draw(st.integers(0, (1 << 64) - 2))
    return wire.Delegation(
        algorithm=wire.SignatureAlgorithm.ED25519,
        operator_key_id=draw(st.binary(min_size=8, max_size=8)),
        node_key=draw(st.binary(min_size=32, max_size=32)),
        not_before_ms=not_before,
        not_after_ms=draw(st.integers(not_before + 1, (1 << 64) - 1)),
        operator_signature=draw(st.binary(min_size=64, max_size=64)),
        scope=tuple(sorted(set(scope), key=wire.ScopeEntry.key)),
    )


# algorithm 1 with its 12-octet nonce, or a code no registry names with any nonce length
sealed_caches = st.one_of(
    st.builds(
        wire.SealedCache,
        st.just(wire.AeadAlgorithm.CHACHA20_POLY1305),
        U32,
        st.binary(min_size=12, max_size=12),
        st.binary(min_size=20, max_size=80),
    ),
    st.builds(
        wire.SealedCache,
        st.integers(2, 255),
        U32,
        st.binary(min_size=1, max_size=255),
        st.binary(min_size=20, max_size=80),
    ),
)
unknown_tlvs = st.builds(
    wire.UnknownTLV,
    st.integers(0, 0xFFFF).filter(lambda t: t not in wire.DEFAULT_REGISTRY.by_type),
    st.binary(max_size=40),
)

OPTIONAL = [
    metrics_l0,
    metrics_l1,
    metrics_l2,
    metrics_bases,
    cache_models,
    cache_summaries,
    capacities(),
    hot_prefixes,
    sealed_caches,
    delegations(),
    signatures,
]


@st.composite
def advertisements(draw):
    tlvs = [wire.Version(1), draw(origins), draw(sequences), draw(timestamps)]
    for strategy in OPTIONAL:
        if draw(st.booleans()):
            tlvs.append(draw(strategy))
    tlvs.extend(draw(st.lists(unknown_tlvs, max_size=3, unique_by=lambda t: t.type)))
    return wire.Advertisement.build(*tlvs)

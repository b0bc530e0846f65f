"""Scale cost model, measured: per-instance versus site-aggregated cache state.

    python benchmarks/scale.py [--sites 10 100 1000 10000] [--per-instance-max 1000]
                               [--instances 100] [--window-s 60] [--plots docs/scale]
                               [--dampening builder|s1] [--site-interval-ms 10000] ...
    python benchmarks/scale.py --quality [POLICY ...] [--speedups 1 4] [--limit N]

Two parts, both through the real node builder, summaries, codec and selector RIB:

1. **Churn of one site** (Mooncake trace): `--instances` LRU caches of 1,000 HBM blocks,
   each serving the trace at its own rate (3.4 requests/s, about one 20k-token/s
   instance's prefill capacity), each starting at a different offset of the trace. Every
   second each instance's `AdvertisementBuilder` and the site's `SiteAggregator` are
   polled; every route is signed (Ed25519) and encoded. Gives bytes/s and UPDATEs/s per
   site, per-instance versus aggregated, and the key sets used below.
2. **Selector RIB for N sites**: every origin's advertisements (per-instance: N × I
   instances; aggregated: N sites) are re-stamped with their own Origin, encoded,
   decoded and accepted into one `selector.RIB` under tracemalloc; then
   `PathSelector.decide` on Mooncake prompts, with the origins whose updates would
   arrive in one millisecond (at the rate measured in part 1) invalidated before each
   decision. Summaries come from a pool of 16 salted copies of the measured key sets
   (building 100,000 distinct filters would take minutes; each origin still decodes and
   holds its own copy). Configurations above the limits are extrapolated linearly from
   the measured ones and flagged "model".

Whole UPDATE messages are counted beside the attribute values (`update_bytes`): what a
session across the site border carries per announcement. ``--dampening s1`` gives the
instances and the site egress S1's dampening, so the traffic ratio is measured with the
setting `--quality` (3.) steers with.

3. **Steering quality** (`--quality`): `catsproto eval`'s engine on S1 as shipped, the
   whole Mooncake trace at speedups 1 and 4, catsproto against `catsproto-agg*`
   (`catsproto.sim.aggregate`): hit rate, TTFT and beyond-the-site bytes.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path as FilePath

import numpy as np

from catsproto import wire
from catsproto.adapters.collector import DecisionCollector
from catsproto.adapters.trace_download import find_or_download_trace
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    TieredCache,
    TierSpec,
)
from catsproto.node.aggregate import SiteAggregator, SiteMember
from catsproto.security import Policy, Receiver, SigningKey, TrustStore, authorise, sign
from catsproto.selector import RIB, Network, Path, PathSelector, Request, SelectorConfig
from catsproto.selector.fleet import FleetProbe
from catsproto.wire import Origin, Tier
from catsproto.wire.attribute import encode_attribute
from catsproto.wire.bgp import build_update

TRACE = find_or_download_trace()
HBM_BLOCKS = 1000
PREFILL_TPS = 20_000.0
POOL = 16
CS_ID = 1
M64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised (uniform 64-bit keys from trace hash ids)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def load_trace(path: FilePath) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    times, keys, lengths = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                times.append(float(d["timestamp"]))
                keys.append(mix64(np.array(d["hash_ids"], dtype=np.uint64) + np.uint64(1)))
                lengths.append(int(d["input_length"]))
    return np.array(times), keys, np.array(lengths)


def salted(keys: np.ndarray, salt: int) -> np.ndarray:
    return keys ^ mix64(np.array([salt + 1], dtype=np.uint64))[0] if salt else keys


# ---- part 1: churn of one site ---------------------------------------------------------


@dataclass(frozen=True)
class Advertising:
    """How origins dampen: ``builder`` = the builder's defaults (5 % key change, score and
    100 ms wait triggers, 30 s refresh); ``s1`` = what S1 ships (`sim/scenarios/s1.toml`:
    15 % key change, no score trigger, 500 ms wait error, 60 s refresh, summary changes on
    shard routes only, no hot prefixes), so the traffic figure and `--quality` share it."""

    name: str = "builder"
    min_interval_ms: int = 1000
    max_interval_ms: int = 30_000
    change_threshold: float = 0.05
    score_threshold: int = 1
    wait_threshold_ms: float = 100.0
    main_on_summary_change: bool = True
    hot_prefixes: int = 8
    target_fpr: float = 0.01

    @classmethod
    def named(cls, name: str) -> Advertising:
        if name == "builder":
            return cls()
        if name == "s1":
            from catsproto.adapters.trace import load_scenario
            from catsproto.sim import Scenario

            sc = Scenario.from_mapping(load_scenario("s1"))
            return cls(
                "s1",
                sc.update_interval_ms,
                sc.refresh_interval_ms,
                sc.change_threshold,
                sc.score_threshold,
                sc.wait_threshold_ms,
                sc.main_on_summary_change,
                sc.hot_prefixes,
                sc.target_fpr,
            )
        raise ValueError(f"unknown dampening {name!r} (builder, s1)")

    def dampening(self, min_interval_ms: int | None = None) -> DampeningPolicy:
        low = self.min_interval_ms if min_interval_ms is None else min_interval_ms
        return DampeningPolicy(
            min_interval_ms=low,
            max_interval_ms=max(low, self.max_interval_ms),
            change_threshold=self.change_threshold,
            score_threshold=self.score_threshold,
            wait_threshold_ms=self.wait_threshold_ms,
        )


@dataclass(frozen=True)
class SiteOptions:
    """How the egress aggregates: min update interval, target FPR, holder threshold, and
    the dampening (thresholds and refresh) it shares with the instances."""

    interval_ms: int = 1000
    fpr: float = 0.01
    min_holders: int = 1
    advertising: Advertising = Advertising()
    max_depth: int = 0


def site_config(shard_range: str, address: str, site: SiteOptions) -> BuilderConfig:
    adv = site.advertising
    return BuilderConfig(
        cs_id=CS_ID,
        address=address,
        model_id="mooncake",
        block_size=512,
        bytes_per_block=0,
        site_id=1,
        shard_range=shard_range,
        target_fpr=site.fpr,
        hot_prefixes=adv.hot_prefixes,
        main_on_summary_change=adv.main_on_summary_change,
        dampening=adv.dampening(site.interval_ms),
    )


NEXT_HOP = ipaddress.IPv4Address("10.1.255.254")


def update_bytes(prefix: object, value: bytes) -> int:
    """Bytes of the whole eBGP UPDATE carrying one route with this attribute value (BGP
    header, ORIGIN, a one-AS AS_PATH, NEXT_HOP, the attribute, the NLRI): what one
    announcement costs on a session that crosses the site border."""
    assert isinstance(prefix, ipaddress.IPv4Network)
    return len(build_update([prefix], NEXT_HOP, [encode_attribute(value)], as_path=(65001,)))


def churn_site(
    times: np.ndarray,
    keys: list[np.ndarray],
    lengths: np.ndarray,
    instances: int,
    window_s: int,
    site: SiteOptions,
) -> dict:
    n = len(keys)
    spec = TierSpec(Tier.HBM, HBM_BLOCKS, 0, 8_000_000)
    caches = [TieredCache([spec]) for _ in range(instances)]
    builders = []
    key = SigningKey.from_seed(b"k" * 32)
    adv = site.advertising
    for j in range(instances):
        cfg = BuilderConfig(
            cs_id=CS_ID,
            address=f"10.1.{j // 250}.{j % 250 + 1}",
            model_id="mooncake",
            block_size=512,
            bytes_per_block=0,
            site_id=1,
            shard_range=f"10.200.{j}.0/24",
            target_fpr=adv.target_fpr,
            hot_prefixes=adv.hot_prefixes,
            main_on_summary_change=adv.main_on_summary_change,
            dampening=adv.dampening(),
        )
        builders.append(AdvertisementBuilder(cfg, caches[j], epoch=1))
    agg = SiteAggregator(
        site_config("10.254.0.0/22", "10.1.255.254", site),
        [TierSpec(Tier.HBM, HBM_BLOCKS * instances, 0, 8_000_000)],
        epoch=1,
        min_holders=site.min_holders,
        max_depth=site.max_depth,
    )
    # instance j serves the trace from request offset j*n/I, times relative to that start
    offsets = [j * n // instances for j in range(instances)]
    cursor = list(offsets)
    busy_until = [0.0] * instances
    period_ms = float(times[-1] - times[0]) if n > 1 else 1.0
    warmup_s = 30
    acc = dict.fromkeys(("inst_bytes", "inst_routes", "inst_msg", "site_bytes", "site_routes"), 0)
    acc["site_msg"] = 0
    origin_updates = {"inst": 0, "site": 0}
    inst_samples: list[int] = []
    site_samples: list[int] = []
    block_changes = 0
    t_build = time.perf_counter()
    for second in range(warmup_s + window_s):
        now = second * 1000
        for j in range(instances):
            cache = caches[j]
            while True:
                r = cursor[j] % n
                lap = cursor[j] // n
                t_rel = times[r] - times[offsets[j]] + lap * (period_ms + 1)
                if t_rel > now:
                    break
                _, events = cache.admit(keys[r].tolist())
                if second >= warmup_s:
                    block_changes += sum(len(e.keys) for e in events)
                cursor[j] += 1
                busy_until[j] = max(busy_until[j], t_rel) + lengths[r] / PREFILL_TPS * 1000
        states = [
            ComputeState(
                outstanding_prefill_tokens=round(
                    max(0.0, busy_until[j] - now) * PREFILL_TPS / 1000
                ),
                prefill_rate_tps=PREFILL_TPS,
                utilisation=min(1.0, max(0.0, busy_until[j] - now) / 1000),
            )
            for j in range(instances)
        ]
        members = [SiteMember.from_cache(caches[j], states[j]) for j in range(instances)]
        for j in range(instances):
            routes = builders[j].poll(now, states[j])
            if routes and second >= warmup_s:
                origin_updates["inst"] += 1
            for route in routes:
                value = wire.encode(sign(route.advertisement, key, route.prefix))
                b = len(value)
                if second >= warmup_s:
                    acc["inst_bytes"] += b
                    acc["inst_routes"] += 1
                    acc["inst_msg"] += update_bytes(route.prefix, value)
                    inst_samples.append(b)
        site_routes = agg.poll(now, members)
        if site_routes and second >= warmup_s:
            origin_updates["site"] += 1
        for route in site_routes:
            value = wire.encode(sign(route.advertisement, key, route.prefix))
            b = len(value)
            if second >= warmup_s:
                acc["site_bytes"] += b
                acc["site_routes"] += 1
                acc["site_msg"] += update_bytes(route.prefix, value)
                site_samples.append(b)
    elapsed = time.perf_counter() - t_build
    union = len(agg._held[Tier.HBM])
    held = sum(c.count(Tier.HBM) for c in caches)
    return {
        "instances": instances,
        "window_s": window_s,
        "warmup_s": warmup_s,
        "block_changes_per_instance_s": block_changes / window_s / instances,
        "per_instance": {
            "bytes_per_s": acc["inst_bytes"] / window_s,
            "updates_per_s": acc["inst_routes"] / window_s,
            "bytes_per_update": acc["inst_bytes"] / max(1, acc["inst_routes"]),
            "routes": sum(len(b.routes()) for b in builders),
            "origin_updates_per_s": origin_updates["inst"] / window_s,
            "update_message_bytes_per_s": acc["inst_msg"] / window_s,
        },
        "aggregated": {
            "bytes_per_s": acc["site_bytes"] / window_s,
            "updates_per_s": acc["site_routes"] / window_s,
            "bytes_per_update": acc["site_bytes"] / max(1, acc["site_routes"]),
            "routes": len(agg.routes()),
            "origin_updates_per_s": origin_updates["site"] / window_s,
            "update_message_bytes_per_s": acc["site_msg"] / window_s,
        },
        "keys_held_sum": held,
        "union_keys": union,
        "union_over_sum": union / max(1, held),
        # attribute values (as before), and whole UPDATE messages (what a session carries)
        "traffic_ratio": acc["site_bytes"] / max(1, acc["inst_bytes"]),
        "traffic_ratio_messages": acc["site_msg"] / max(1, acc["inst_msg"]),
        "run_s": elapsed,
        "_caches": caches,
        "_states": states,
    }


# ---- part 2: RIB and decisions for N sites -------------------------------------------


class StarNetwork(Network):
    """Ingress 'in' to every site node, delay by site (5..45 ms one way)."""

    def __init__(self) -> None:
        super().__init__([])

    def path(self, src: str, dst: str) -> Path | None:
        site = int(dst[4:]) if dst.startswith("site") else 0
        return Path((src, dst), 5.0 + (site * 7919) % 40, 100_000.0)


def origin_address(index: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address((10 << 24) + index + 1)


def build_pool(
    caches: list[TieredCache], state: ComputeState, instances: int, site: SiteOptions
) -> tuple[list[list[list[wire.Advertisement]]], list[list[wire.Advertisement]]]:
    """POOL salted copies: per-instance advertisements [salt][instance] -> routes, and
    the site's aggregated routes [salt]."""
    per_inst: list[list[list[wire.Advertisement]]] = []
    per_site: list[list[wire.Advertisement]] = []
    spec = TierSpec(Tier.HBM, HBM_BLOCKS, 0, 8_000_000)
    for salt in range(POOL):
        members = []
        row = []
        for j in range(instances):
            c = TieredCache([spec])
            for k in salted(caches[j].keys(Tier.HBM), salt).tolist():
                c.store(Tier.HBM, k)
            cfg = BuilderConfig(
                cs_id=CS_ID,
                address="10.0.0.1",
                model_id="mooncake",
                block_size=512,
                bytes_per_block=0,
                site_id=1,
                shard_range="10.200.0.0/24",
            )
            row.append([r.advertisement for r in AdvertisementBuilder(cfg, c, 1).poll(0, state)])
            members.append(SiteMember.from_cache(c, state))
        per_inst.append(row)
        agg = SiteAggregator(
            site_config("10.254.0.0/22", "10.0.0.1", site),
            [TierSpec(Tier.HBM, HBM_BLOCKS * instances, 0, 8_000_000)],
            epoch=1,
            min_holders=site.min_holders,
            max_depth=site.max_depth,
        )
        per_site.append([r.advertisement for r in agg.poll(0, members)])
    return per_inst, per_site


def load_rib(
    mode: str,
    sites: int,
    instances: int,
    pool_inst: list[list[list[wire.Advertisement]]],
    pool_site: list[list[wire.Advertisement]],
) -> tuple[RIB, dict]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    rib = RIB(hold_time_ms=1 << 40)
    routes = 0
    wire_bytes = 0
    t0 = time.perf_counter()
    for s in range(sites):
        salt = s % POOL
        if mode == "per-instance":
            origins = [
                (origin_address(s * instances + j), pool_inst[salt][j]) for j in range(instances)
            ]
        else:
            origins = [(origin_address(s), pool_site[salt])]
        for address, advs in origins:
            origin = Origin(CS_ID, s + 1, address)
            for adv in advs:
                value = wire.encode(adv.replace(origin))
                wire_bytes += len(value)
                rib.accept(wire.decode(value), 0)
                routes += 1
    elapsed = time.perf_counter() - t0
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base
    # the selector's fleet probe: every filter's slot values side by side, built once
    probe = FleetProbe(rib.services[CS_ID])
    probe.sync()
    gc.collect()
    index_mem = tracemalloc.get_traced_memory()[0] - base - mem
    del probe
    tracemalloc.stop()
    return rib, {
        "index_bytes": index_mem,
        "index_mib": index_mem / 2**20,
        "selector_mib": (mem + index_mem) / 2**20,
        "origins": sites * (instances if mode == "per-instance" else 1),
        "routes": routes,
        "rib_bytes": mem,
        "rib_mib": mem / 2**20,
        "snapshot_wire_bytes": wire_bytes,
        "load_s_traced": elapsed,
    }


def decisions(
    rib: RIB,
    requests: list[tuple[np.ndarray, int]],
    touches_per_decision: float,
    seed: int,
    lazy: bool = False,
    dump: list[str] | None = None,
    per_decision: list[dict] | None = None,
    gc_between: bool = True,
    warmup: list[tuple[np.ndarray, int]] | None = None,
) -> dict:
    """Decide `requests` in turn (the first one apart, as the cold one), touching origins
    between them; `dump` gets the repr of every Decision, `per_decision` each one's CPU
    and wall ms, fleet-probe pairs and passes and garbage collections inside it. With
    `gc_between` garbage is collected between decisions (`DecisionCollector`, as the
    steering daemon does), timed apart; else CPython collects where it will. `warmup`
    requests are decided first by a second selector over the same RIB, then dropped: the
    interpreter's and the caches' warm-up, without touching the measured selector's
    state (its own probe, chunks, plans and pending work), so its decisions stay the
    same."""
    if warmup:
        spare = PathSelector(rib, StarNetwork(), SelectorConfig(site_nodes={}))
        spare.prepare(CS_ID)
        for keys, length in warmup:
            spare.decide(Request(CS_ID, keys, length, "in"), 0)
        del spare
        gc.collect()
    sel = PathSelector(rib, StarNetwork(), SelectorConfig(site_nodes={}))
    collections = [0, 0.0, 0.0, 0]  # collections, their CPU ms, last start, oldest generation

    def count_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections[0] += 1
            collections[2] = time.thread_time()
            collections[3] = max(collections[3], info["generation"])
        else:
            collections[1] += (time.thread_time() - collections[2]) * 1000

    gc.callbacks.append(count_gc)
    # the path vectors from every site (control-plane state: redone only where sites
    # change), so that a decision never pays for a KV source at a site seen first
    t0 = time.perf_counter()
    sel.prepare(CS_ID)
    prepare_s = time.perf_counter() - t0
    table = rib.services[CS_ID]
    n = len(table.instances)
    rng = np.random.default_rng(seed)
    cold = []
    times: list[float] = []
    cpu: list[float] = []
    sync_cpu: list[float] = []  # bringing the probe up to the touched origins, apart
    gc_cpu: list[float] = []  # collections between decisions, apart
    inside = 0  # collections inside timed decisions
    collector = DecisionCollector() if gc_between else None
    if collector is not None:
        collector.start()
    carry = 0.0
    for i, (keys, length) in enumerate(requests):
        if i >= 1:  # the origins whose updates arrived since the last decision
            carry += touches_per_decision
            k = int(carry)
            carry -= k
            for slot in rng.integers(0, n, k).tolist():
                inst = table.instances[slot]
                if inst is not None:
                    table.touch(inst)
            if not lazy:  # as a receive loop does once it has merged the updates
                c0 = time.thread_time()
                sel.sync(CS_ID)
                sync_cpu.append((time.thread_time() - c0) * 1000)
        fleet = sel._index_of(table).fleet if per_decision is not None else None
        pairs0 = fleet.pairs if fleet is not None else 0
        passes0 = sel._index[CS_ID].probes if fleet is not None else 0
        gc0, gc_ms0 = collections[0], collections[1]
        collections[3] = -1
        c0, t0 = time.thread_time(), time.perf_counter()
        decision = sel.decide(Request(CS_ID, keys, length, "in"), 0)
        dt = (time.perf_counter() - t0) * 1000
        c1 = time.thread_time()
        inside += collections[0] - gc0
        (cold if i == 0 else times).append(dt)
        if i:  # this thread's CPU time: the same figure, less the scheduler's stalls
            cpu.append((c1 - c0) * 1000)
        if dump is not None:
            dump.append(repr(decision))
        if per_decision is not None and fleet is not None:
            per_decision.append(
                {
                    "i": i,
                    "cpu_ms": (c1 - c0) * 1000,
                    "wall_ms": dt,
                    "pairs": fleet.pairs - pairs0,
                    "passes": sel._index[CS_ID].probes - passes0,
                    "gc": collections[0] - gc0,
                    "gc_ms": collections[1] - gc_ms0,
                    "gc_generation": collections[3],
                    "keys": len(keys),
                }
            )
        if collector is not None:  # as the daemon does once it has answered
            c0 = time.thread_time()
            collector.between()
            gc_cpu.append((time.thread_time() - c0) * 1000)
    gc.callbacks.remove(count_gc)
    if collector is not None:
        collector.stop()
    arr = np.array(times)
    return {
        "decisions": len(times),
        "cold_first_ms": cold[0],
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
        "cpu_p50_ms": float(np.percentile(cpu, 50)),
        "cpu_p99_ms": float(np.percentile(cpu, 99)),
        "invalidated_per_decision": touches_per_decision,
        "prepare_paths_s": prepare_s,
        # rows of touched origins rebuilt before each decision (None: inside it)
        "sync_cpu_mean_ms": float(np.mean(sync_cpu)) if sync_cpu else None,
        "sync_cpu_p99_ms": float(np.percentile(sync_cpu, 99)) if sync_cpu else None,
        # garbage collected between decisions (None: inside them, where CPython chose)
        "gc_between_cpu_mean_ms": float(np.mean(gc_cpu)) if gc_cpu else None,
        "gc_between_cpu_max_ms": float(np.max(gc_cpu)) if gc_cpu else None,
        "gc_between_collections": collector.collections if collector is not None else None,
        "gc_inside_decisions": inside,
        "warmup_decisions": len(warmup) if warmup else 0,
    }


def verify_rate(pool_inst: list[list[list[wire.Advertisement]]], samples: int = 300) -> float:
    """Full receive-path checks (decode, Ed25519, scope, replay) per second, one core."""
    operator = SigningKey.from_seed(b"o" * 32)
    key = SigningKey.from_seed(b"i" * 32)
    trust = TrustStore().with_operator(operator.public.raw, "op")
    trust = trust.with_delegation(
        authorise(
            operator,
            key.public.raw,
            cs_ids=[CS_ID],
            routes=["0.0.0.0/0"],
            addresses=["0.0.0.0/0"],
            not_before_ms=0,
            not_after_ms=1 << 62,
        )
    )
    receiver = Receiver(trust, policy=Policy())
    items = []
    for i in range(samples):
        adv = pool_inst[i % POOL][i % len(pool_inst[0])][-1]
        adv = adv.replace(Origin(CS_ID, 1, origin_address(i)))
        prefix = ipaddress.ip_network(f"{origin_address(i)}/32")
        items.append((wire.encode(sign(adv, key, prefix)), prefix))
    t0 = time.perf_counter()
    for value, prefix in items:
        v = receiver.check(value, prefix, 0)
        assert v.ok, v.reason
        receiver = receiver.commit(v)
    return samples / (time.perf_counter() - t0)


def accept_rate(pool: list[wire.Advertisement], samples: int = 2000) -> float:
    """Decode + RIB accept per second (no signature), one core, no tracemalloc."""
    rib = RIB()
    values = [
        wire.encode(pool[i % len(pool)].replace(Origin(CS_ID, 1, origin_address(i))))
        for i in range(samples)
    ]
    t0 = time.perf_counter()
    for v in values:
        rib.accept(wire.decode(v), 0)
    return samples / (time.perf_counter() - t0)


def fit_linear(points: list[tuple[float, float]], x: float) -> float:
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    if len(xs) == 1:
        return float(ys[0] / xs[0] * x)
    slope, icpt = np.polyfit(xs, ys, 1)
    return float(slope * x + icpt)


def run(args: argparse.Namespace) -> dict:
    times, keys, lengths = load_trace(FilePath(args.trace))
    advertising = Advertising.named(args.dampening)
    site = SiteOptions(
        args.site_interval_ms, args.site_fpr, args.min_holders, advertising, args.max_depth
    )
    churn = churn_site(times, keys, lengths, args.instances, args.window_s, site)
    churn["site_options"] = {
        "interval_ms": site.interval_ms,
        "target_fpr": site.fpr,
        "min_holders": site.min_holders,
        "dampening": advertising.name,
        "max_depth": site.max_depth,
    }
    caches, states = churn.pop("_caches"), churn.pop("_states")
    if args.churn_only:
        return {"churn_one_site": churn, "rows": []}
    state = states[0]
    pool_inst, pool_site = build_pool(caches, state, args.instances, site)
    flat_inst = [r for row in pool_inst for advs in row for r in advs]
    flat_site = [r for advs in pool_site for r in advs]
    rates = {
        "verify_per_s": verify_rate(pool_inst),
        "accept_per_s_per_instance_routes": accept_rate(flat_inst),
        "accept_per_s_site_routes": accept_rate(flat_site, 500),
    }
    rng = np.random.default_rng(7)
    req_idx = rng.integers(0, len(keys), args.decisions + 1)
    modes = {
        "per-instance": (churn["per_instance"], args.instances),
        "aggregated": (churn["aggregated"], 1),
    }
    rows = []
    measured: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for mode, (figs, origins_per_site) in modes.items():
        for sites in args.sites:
            origins = sites * origins_per_site
            row: dict = {"mode": mode, "sites": sites, "instances_per_site": args.instances}
            upd_s = figs["updates_per_s"] * sites
            row["routes"] = figs["routes"] * sites
            row["updates_per_s"] = upd_s
            row["bytes_per_s"] = figs["bytes_per_s"] * sites
            row["bytes_per_update"] = figs["bytes_per_update"]
            accept = rates[
                "accept_per_s_per_instance_routes"
                if mode == "per-instance"
                else "accept_per_s_site_routes"
            ]
            row["selector_cores_to_verify"] = upd_s / rates["verify_per_s"]
            row["selector_cores_to_accept"] = upd_s / accept
            limit = args.per_instance_max if mode == "per-instance" else args.aggregated_max
            if sites <= limit:
                rib, mem = load_rib(mode, sites, args.instances, pool_inst, pool_site)
                row.update(mem)
                row["measured"] = True
                measured[mode].append((origins, mem["rib_bytes"]))
                reqs = []
                for r in req_idx.tolist():
                    salt = int(rng.integers(0, min(POOL, sites)))
                    reqs.append((salted(keys[r], salt), int(lengths[r])))
                # warm-up requests of their own (a generator apart: the measured ones and
                # their salts stay those of a run without)
                warm_rng = np.random.default_rng(8)
                warm = [
                    (salted(keys[r], int(warm_rng.integers(0, min(POOL, sites)))), int(lengths[r]))
                    for r in warm_rng.integers(0, len(keys), args.warmup).tolist()
                ]
                # origins whose updates land in 1 ms (decisions 1 ms apart)
                touched = figs["origin_updates_per_s"] * sites / 1000
                dump: list[str] | None = [] if args.dump_decisions else None
                each: list[dict] | None = [] if args.per_decision else None
                row["decide"] = decisions(
                    rib,
                    reqs,
                    touched,
                    1,
                    lazy=args.lazy_rebuild,
                    dump=dump,
                    per_decision=each,
                    gc_between=args.gc == "between",
                    warmup=warm,
                )
                if dump is not None:
                    name = f"{args.dump_decisions}.{mode}.{sites}"
                    FilePath(name).write_text("\n".join(dump) + "\n")
                if each is not None:
                    name = f"{args.per_decision}.{mode}.{sites}.json"
                    FilePath(name).write_text(json.dumps(each))
                del rib
                gc.collect()
            else:
                row["measured"] = False
                row["rib_bytes"] = fit_linear(measured[mode], origins) if measured[mode] else None
                row["rib_mib"] = row["rib_bytes"] / 2**20 if row["rib_bytes"] else None
                row["origins"] = origins
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()}, default=float), file=sys.stderr)
    return {"churn_one_site": churn, "rates_one_core": rates, "rows": rows}


def targets(result: dict, sites: int = 1000) -> dict:
    rows = {(r["mode"], r["sites"]): r for r in result["rows"]}
    agg, per = rows.get(("aggregated", sites)), rows.get(("per-instance", sites))
    out: dict = {}
    if agg:
        out["aggregated_rib_mib"] = agg["rib_mib"]
        # with the selector's fleet probe (its copy of the filters) where it was measured
        whole = agg.get("selector_mib", agg["rib_mib"])
        out["aggregated_selector_mib"] = whole
        out["aggregated_rib_le_1GiB"] = whole is not None and whole <= 1024
        if "decide" in agg:
            out["aggregated_decision_p99_ms"] = agg["decide"]["p99_ms"]
            out["decision_le_1ms_p99"] = agg["decide"]["p99_ms"] <= 1.0
    if per:
        out["per_instance_rib_mib"] = per["rib_mib"]
        out["per_instance_measured"] = per["measured"]
        if "decide" in per:
            out["per_instance_decision_p99_ms"] = per["decide"]["p99_ms"]
    out["traffic_ratio"] = result["churn_one_site"]["traffic_ratio"]
    out["traffic_le_10pct"] = out["traffic_ratio"] <= 0.10
    return out


def plots(result: dict, folder: FilePath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for metric, label, fname in (
        ("rib_mib", "selector RIB (MiB)", "rib_memory.png"),
        ("routes", "routes at the selector", "routes.png"),
        ("bytes_per_s", "advertisement bytes/s at the selector", "bytes_per_s.png"),
        ("updates_per_s", "UPDATEs/s at the selector", "updates_per_s.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("per-instance", "aggregated"):
            rows = [r for r in result["rows"] if r["mode"] == mode and r.get(metric)]
            xs = [r["sites"] for r in rows]
            ys = [r[metric] for r in rows]
            ax.plot(xs, ys, marker="o", label=mode)
            for r in rows:
                if not r["measured"] and metric == "rib_mib":
                    ax.annotate("model", (r["sites"], r[metric]), fontsize=7)
        if metric == "rib_mib":
            ax.axhline(1024, color="red", linestyle="--", linewidth=0.8, label="1 GiB target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"sites ({result['churn_one_site']['instances']} instances each)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("per-instance", "aggregated"):
        rows = [r for r in result["rows"] if r["mode"] == mode and "decide" in r]
        ax.plot(
            [r["sites"] for r in rows],
            [r["decide"]["p99_ms"] for r in rows],
            marker="o",
            label=f"{mode} p99",
        )
        ax.plot(
            [r["sites"] for r in rows],
            [r["decide"]["p50_ms"] for r in rows],
            marker=".",
            linestyle=":",
            label=f"{mode} p50",
        )
    ax.axhline(1.0, color="red", linestyle="--", linewidth=0.8, label="1 ms target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sites")
    ax.set_ylabel("decision time (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "decision_ms.png", dpi=110)
    plt.close(fig)


# ---- steering quality with aggregated remote state (S1, `catsproto.sim`) ---------------


def quality(
    policies: list[str], speedups: list[float], limit: int | None, overrides: list[str]
) -> dict:
    """catsproto (per-instance state everywhere) against the aggregated policies on S1 as
    shipped, the whole trace unless `limit`: hit rate, TTFT, and advertisement bytes in
    all and across site borders, with each policy's hit rate relative to catsproto's."""
    from catsproto.adapters.trace import load_scenario, read_trace
    from catsproto.keys import BlockKeyer
    from catsproto.sim import PreparedTrace, Scenario, apply_overrides, run_policy
    from catsproto.sim.aggregate import register

    register()
    requests = read_trace(TRACE, limit=limit)
    rows = []
    for speedup in speedups:
        raw = apply_overrides(load_scenario("s1"), [*overrides, f"speedup={speedup}"])
        sc = Scenario.from_mapping(raw)
        keyer = BlockKeyer(sc.secret, sc.model_id, sc.block_tokens)
        tr = PreparedTrace.build(
            requests, keyer, len(sc.sites), sc.speedup, sc.ingress_index, spread=sc.arrival_spread
        )
        base = None
        for name in ["catsproto", *[p for p in policies if p != "catsproto"]]:
            t0 = time.perf_counter()
            out = run_policy(name, tr, sc, seed=1).summary()
            row = {
                k: out[k]
                for k in (
                    "policy", "speedup", "requests", "hit_rate", "ttft_mean_ms", "ttft_p50_ms",
                    "ttft_p99_ms", "rtt_mean_ms", "wait_mean_ms", "adv_bytes", "adv_bytes_per_s",
                    "adv_beyond_site_bytes", "advertisements", "refused",
                )
            }  # fmt: skip
            row["adv_beyond_site_bytes_per_s"] = out["adv_beyond_site_bytes"] / out["duration_s"]
            row["run_s"] = time.perf_counter() - t0
            if base is None:
                base = row
            row["hit_rate_vs_catsproto"] = row["hit_rate"] / base["hit_rate"] - 1
            row["ttft_mean_vs_catsproto"] = row["ttft_mean_ms"] / base["ttft_mean_ms"] - 1
            row["beyond_site_bytes_vs_catsproto"] = (
                row["adv_beyond_site_bytes"] / base["adv_beyond_site_bytes"]
            )
            rows.append(row)
            print(json.dumps(row, default=float), file=sys.stderr)
    return {"quality_s1": rows, "overrides": overrides}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--sites", nargs="+", type=int, default=[10, 100, 1000, 10000])
    p.add_argument("--instances", type=int, default=100)
    p.add_argument(
        "--per-instance-max", type=int, default=100, help="largest N loaded per-instance"
    )
    p.add_argument("--aggregated-max", type=int, default=10000, help="largest N loaded aggregated")
    p.add_argument("--window-s", type=int, default=60)
    p.add_argument("--decisions", type=int, default=300)
    p.add_argument(
        "--lazy-rebuild",
        action="store_true",
        help="rebuild touched origins' probe rows inside the next decision "
        "(default: apart, before it, as a receive loop does)",
    )
    p.add_argument(
        "--dump-decisions",
        metavar="PREFIX",
        help="write the repr of every Decision to PREFIX.<mode>.<sites> (to compare code)",
    )
    p.add_argument(
        "--per-decision",
        metavar="PREFIX",
        help="write each decision's CPU/wall ms, probe pairs and passes, garbage "
        "collections to PREFIX.<mode>.<sites>.json",
    )
    p.add_argument(
        "--gc",
        default="between",
        choices=("between", "auto"),
        help="garbage collection: between decisions, as the steering daemon does "
        "(default), or wherever CPython's automatic collector runs",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="decide N other requests first, with a second selector over the same RIB "
        "(interpreter and caches warm; the measured selector's state untouched)",
    )
    p.add_argument("--plots", help="folder for PNG growth curves")
    p.add_argument("--site-interval-ms", type=int, default=1000, help="aggregate min interval")
    p.add_argument("--site-fpr", type=float, default=0.01, help="aggregate summary target FPR")
    p.add_argument("--min-holders", type=int, default=1, help="advertise keys held this often")
    p.add_argument("--churn-only", action="store_true", help="part 1 only")
    p.add_argument("--max-depth", type=int, default=0, help="site: first N blocks only (0: all)")
    p.add_argument(
        "--dampening", default="builder", choices=("builder", "s1"), help="origins' dampening"
    )
    p.add_argument(
        "--quality",
        nargs="*",
        metavar="POLICY",
        help="instead: S1 steering quality, catsproto vs these (default all catsproto-agg*)",
    )
    p.add_argument("--speedups", nargs="+", type=float, default=[1.0, 4.0], help="--quality")
    p.add_argument("--limit", type=int, help="--quality: first N requests (default all)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="--quality: S1 override"
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.quality is not None:
        from catsproto.sim.aggregate import AGGREGATED_POLICIES

        names = args.quality or list(AGGREGATED_POLICIES)
        result = quality(names, args.speedups, args.limit, args.set)
        result["run_s"] = time.perf_counter() - t0
        print(json.dumps(result, indent=2, default=float))
        return 0
    result = run(args)
    if result["rows"]:
        result["targets_1000x100"] = targets(result)
    result["run_s"] = time.perf_counter() - t0
    if args.plots:
        plots(result, FilePath(args.plots))
    print(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

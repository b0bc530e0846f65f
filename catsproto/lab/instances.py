"""Modelled inference instances for the lab: the real modelled instance, or a stand-in.

With `--serve` (what `lab up` runs in namespaces) each instance behind the egress is the
real modelled instance of `catsproto.adapters.instance` — FCFS engine with a tiered
cache, its C-SMA (`NodeAgent`, vLLM KV events over ZMQ, `AdvertisementBuilder` with
dampening) and its HTTP face on the instance's own address (on the egress's loopback,
port `INSTANCE_PORT`) — and every route the builder emits is signed with the
instance's lab key and written to the egress's spool (`ServedInstance`). The first
instance of each site computes that site's demo conversation at start, so its cache
really holds it; `--background-blocks` keeps a trickle of random prompts flowing so
caches and load move. Each served instance also stores a synthetic KV payload per cached
block (`--payload-bytes`, default 256 KiB: the model's 64 MiB scaled down 256 times) and
serves pulls of them over mutually authenticated TLS 1.3 on its own address, port
`TRANSFER_PORT`, with a transfer certificate made from its lab node key and checked
against the lab's trust store (`lab_trust`, the same one the receivers use). It
advertises the model's real 64 MiB per block unless `--kv-bytes` says otherwise (a lab
that wants the selector to price exactly the bytes that cross its links sets both equal).

Without `--serve` (the loopback mode, some tests) the stand-in below publishes
drifting random keys instead:

`instance_routes` (pure) turns an instance's block keys into the routes it announces:
its CSCI-ID /32 carries its metrics and capacity, and one host route per summary shard
(`catsproto.summary.shard_prefix` inside the instance's own range) carries one
key range's cache summary, each shard sized by `catsproto.summary.build_shards` to fit
one UPDATE with room for the AS_PATH to grow on the way. The process (`main`) lets a
demo lab's instances gain and lose cached blocks every `--interval` seconds and
publishes their routes into the egress's spool.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from catsproto import security, wire
from catsproto.adapters.exabgp_announce import Spool
from catsproto.adapters.file_modes import write_trust_file
from catsproto.adapters.signed_routes import SignedRoutes
from catsproto.adapters.transfer_tls import TRANSFER_PORT
from catsproto.keys import BlockKeyer
from catsproto.lab.engine import EngineSpec
from catsproto.lab.sealing import sealed
from catsproto.lab.topology import InstanceSpec, Topology, load
from catsproto.node import (
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    ModelShape,
    RouteAdvertisement,
    TierSpec,
)
from catsproto.summary import attribute_value_budget, build_shards, shard_prefix
from catsproto.wire import Tier

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK_TOKENS = 512
PATH_MARGIN_HOPS = 8  # AS_PATH room for this many ASes on the way to the selector
# BIRD 2.0 sends no UPDATE that would leave less than 1,000 bytes of the message free
# (docs/interop.md): values bigger than the budget minus this never cross a BIRD transit.
BIRD_RESERVE = 1000
# Lab-only keying secret for block keys (public on purpose: anyone can run the demo).
DEMO_SECRET = b"catsproto-lab-demo-secret-000001"
DEMO_SECRET_ID = 1  # advertised in the Cache Model TLV; the steering daemon names it too
DEMO_PROMPT_BLOCKS = 24
INSTANCE_PORT = 8100  # every served instance's HTTP port, on its own address
# Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16: 64 MiB of KV per 512-token block
LAB_SHAPE = ModelShape(32, 8, 128, 2, BLOCK_TOKENS)
LAB_TIERS = (TierSpec(Tier.HBM, 256, 5, 1_600_000), TierSpec(Tier.DRAM, 2_048, 30, 400_000))
LAB_PREFILL_TPS = 8_000.0
PAYLOAD_BYTES = LAB_SHAPE.bytes_per_block // 256  # stored per block: 256 KiB


def demo_prompt(site_id: int, blocks: int = DEMO_PROMPT_BLOCKS) -> list[int]:
    """Token ids of the conversation the first instance of `site_id` has cached."""
    rng = np.random.default_rng(10_000 + site_id)
    return rng.integers(0, 128_000, size=blocks * BLOCK_TOKENS).tolist()


def demo_prefix_keys(site_id: int) -> np.ndarray:
    """Block keys of `demo_prompt(site_id)`, as an instance and a selector derive them."""
    keyer = BlockKeyer(DEMO_SECRET, MODEL, BLOCK_TOKENS)
    return np.array(keyer.block_keys(demo_prompt(site_id)), dtype=np.uint64)


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
    signer: security.SigningKey | None = None,
    group_keys: security.GroupKeyring | None = None,
) -> dict[Prefix, bytes]:
    """The attribute value for each of the instance's routes (sizes checked), each signed
    for its own route when `signer` is given, its cache section sealed first when
    `group_keys` are."""

    def finish(adv: wire.Advertisement, prefix: Prefix) -> bytes:
        adv = sealed(adv, group_keys)
        return wire.encode(security.sign(adv, signer, prefix) if signer else adv)

    csci_adv = wire.Advertisement.build(
        *_header(spec, sequence, now_ms),
        wire.MetricsL2(score),
        wire.Capacity(free_blocks=free_blocks, total_blocks=total_blocks),
    )
    routes: dict[Prefix, bytes] = {spec.csci: finish(csci_adv, spec.csci)}
    shard_base = [
        *_header(spec, sequence, now_ms),
        wire.CacheModel(MODEL, BLOCK_TOKENS, wire.KeyScheme.BLAKE2B64_CHAINED, DEMO_SECRET_ID),
    ]
    other = len(finish(wire.Advertisement.build(*shard_base), spec.csci))
    budget = (
        attribute_value_budget(max_message, as_path_hops=PATH_MARGIN_HOPS) - other - BIRD_RESERVE
    )
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
        prefix = shard_prefix(spec.shards, shard.index)
        routes[prefix] = finish(adv, prefix)
    return routes


class ModelledInstance:
    """An instance whose cache drifts: some blocks evicted, some added, each step."""

    def __init__(
        self,
        spec: InstanceSpec,
        seed: int,
        blocks: int = 2000,
        signer: security.SigningKey | None = None,
        pinned: np.ndarray | None = None,
        group_keys: security.GroupKeyring | None = None,
    ) -> None:
        self.spec = spec
        self.signer = signer
        self.group_keys = group_keys
        self.pinned = np.zeros(0, dtype=np.uint64) if pinned is None else pinned
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
            np.concatenate([self.keys, self.pinned]),
            sequence=self.sequence,
            now_ms=now_ms,
            max_message=max_message,
            free_blocks=int(65536 - self.keys.size),
            signer=self.signer,
            group_keys=self.group_keys,
        )


def lab_tiers(text: str) -> tuple[TierSpec, ...]:
    """'hbm:64,dram:512' -> the lab's tiers with those capacities (same latency, rate)."""
    base = {spec.tier: spec for spec in LAB_TIERS}
    out = []
    for part in text.split(","):
        name, _, blocks = part.partition(":")
        try:
            tier = Tier[name.strip().upper()]
            spec = base[tier]
            latency, rate = spec.fetch_latency_us, spec.fetch_bandwidth_mbps
            out.append(TierSpec(tier, int(blocks), latency, rate))
        except (KeyError, ValueError):
            raise ValueError(f"tier {part!r} is not like hbm:256 (tiers: hbm, dram)") from None
    return tuple(out)


def lab_key(topology: Topology, name: str) -> security.SigningKey:
    """A deterministic demo key (lab only: anyone can derive it from the topology)."""
    return security.SigningKey.from_seed(
        hashlib.sha256(f"catsproto-lab/{topology.name}/{name}".encode()).digest()
    )


def lab_group_keys(topology: Topology) -> security.GroupKeyring:
    """The lab's group key (id 1), deterministic like `lab_key` (lab only: anyone can
    derive it from the topology). `catsproto lab up --seal` seals with it."""
    secret = hashlib.sha256(f"catsproto-lab/{topology.name}/group-key".encode()).digest()
    return security.GroupKeyring(security.GroupKey.of(1, secret))


def lab_trust(topology: Topology, now_ms: int, days: int = 7) -> dict:
    """Trust file authorising every modelled instance's lab key for its own routes,
    address and site (an instance claiming another site's id is refused, not priced at
    that site's distance)."""
    operator = lab_key(topology, "operator")
    store = security.TrustStore().with_operator(operator.public.raw, f"{topology.name} lab")
    for node in topology.nodes.values():
        for spec in node.instances:
            store = store.with_delegation(
                security.authorise(
                    operator,
                    lab_key(topology, spec.name).public.raw,
                    cs_ids=[spec.cs_id],
                    routes=[spec.csci, spec.shards],
                    addresses=[spec.csci],
                    sites=[spec.site_id],
                    not_before_ms=now_ms - 3_600_000,
                    not_after_ms=now_ms + days * 86_400_000,
                )
            )
    return store.to_json()


def write_lab_trust(topology: Topology, path: str, now_ms: int) -> None:
    """The lab's trust file, mode 0644 (a receiver refuses one others may write)."""
    write_trust_file(path, json.dumps(lab_trust(topology, now_ms)).encode())


def publish(spool: Spool, routes: dict[Prefix, bytes], previous: set[Prefix]) -> set[Prefix]:
    """Write every route; withdraw routes (e.g. shards) no longer present."""
    for prefix, value in routes.items():
        spool.publish(prefix, value)
    for gone in previous - routes.keys():
        spool.withdraw(gone)
    return set(routes)


class ServedInstance:
    """One real modelled instance: engine, C-SMA and HTTP on the instance's address;
    every route its builder emits is signed for that route and spooled."""

    def __init__(
        self,
        spec: InstanceSpec,
        spool: Spool,
        signer: security.SigningKey,
        *,
        host: str | None = None,
        port: int = INSTANCE_PORT,
        time_scale: float = 1.0,
        prefill_tps: float = LAB_PREFILL_TPS,
        min_interval_ms: int = 1_000,
        max_message: int = 4096,
        trust: security.TrustStore | None = None,
        kv_bytes: int = LAB_SHAPE.bytes_per_block,
        payload_bytes: int = PAYLOAD_BYTES,
        transfer_port: int = TRANSFER_PORT,
        tiers: tuple[TierSpec, ...] = LAB_TIERS,
        change_threshold: float = 0.05,
        group_keys: security.GroupKeyring | None = None,
        api_token: bytes | None = None,
    ) -> None:
        from catsproto.adapters.instance import (
            EngineConfig,
            InstanceServer,
            KvPuller,
            ModelledEngine,
            NodeAgent,
        )
        from catsproto.adapters.transfer_tls import (
            PeerPolicy,
            ServerOptions,
            TransferIdentity,
            TransferServer,
        )
        from catsproto.adapters.vllm_events import RankEndpoint

        self.spec, self.spool, self.signer = spec, spool, signer
        self.group_keys = group_keys
        self.routes = SignedRoutes(signer, group_keys=group_keys, spool=spool)
        host = host or str(spec.address)
        keyer = BlockKeyer(DEMO_SECRET, MODEL, BLOCK_TOKENS)
        self.identity = TransferIdentity(signer) if trust is not None else None
        puller = (  # dials only lab holders, at their own address and transfer port
            KvPuller(
                self.identity,
                trust,
                source_address=host,
                holder_port=transfer_port,
                max_block_bytes=payload_bytes,  # what every lab instance stores per block
            )
            if self.identity is not None and trust is not None
            else None
        )
        self.engine = ModelledEngine(
            EngineConfig(
                block_size=BLOCK_TOKENS,
                prefill_rate_tps=prefill_tps,
                time_scale=time_scale,
                tiers=tiers,
                payload_bytes=payload_bytes if trust is not None else 0,
            ),
            keyer=keyer,
            puller=puller,
        )
        self.transfer: TransferServer | None = None
        try:
            self.node = NodeAgent(
                BuilderConfig(
                    cs_id=spec.cs_id,
                    address=str(spec.address),
                    model_id=MODEL,
                    block_size=BLOCK_TOKENS,
                    secret_id=DEMO_SECRET_ID,
                    bytes_per_block=kv_bytes,
                    site_id=spec.site_id,
                    max_message_bytes=max_message,
                    as_path_hops=PATH_MARGIN_HOPS,
                    reserve_bytes=384 + BIRD_RESERVE,  # signature, delegation; BIRD
                    shard_range=str(spec.shards),
                    # every update a snapshot: the receiver's rib.json (latest value per
                    # route) must stand alone for the selectors that read it
                    snapshot_every=1,
                    dampening=DampeningPolicy(
                        min_interval_ms,
                        max(min_interval_ms, 10_000),
                        change_threshold=change_threshold,
                        wait_threshold_ms=50.0,
                    ),
                ),
                tiers,
                keyer,
                [
                    RankEndpoint(
                        0, self.engine.publisher.endpoint, self.engine.publisher.replay_endpoint
                    )
                ],
                self._compute_state,
                on_routes=self._publish,
                hits=self.engine.hits,
            )
            self.server = InstanceServer(self.engine, self.node, host, port, api_token=api_token)
            if self.identity is not None and trust is not None:
                self.transfer = TransferServer(
                    self.identity,
                    PeerPolicy(trust),
                    self.engine.lookup_payload,
                    host,
                    transfer_port,
                    # the holder's epoch is its advertisements' epoch: a restarted
                    # instance's old staged blocks are replaced, never merged
                    ServerOptions(epoch=self.node.builder.epoch),
                )
        except BaseException:
            self.engine.close()
            if self.identity is not None:
                self.identity.close()
            raise

    def _compute_state(self) -> ComputeState:
        """The engine's load, its prefill rate in wall-clock tokens per second (the
        engine's model rate × its time scale), so the selector's queue and prefill
        estimates share the network's clock."""
        state = self.engine.compute_state()
        scale = self.engine.config.time_scale
        if scale == 1.0:
            return state
        return dataclasses.replace(state, prefill_rate_tps=state.prefill_rate_tps * scale)

    def _publish(self, routes: list[RouteAdvertisement]) -> None:
        self.engine.last_advertised = time.monotonic()
        self.routes.publish(routes)

    def warm(self, tokens: list[int], timeout: float = 30.0) -> None:
        """Serve `tokens` once (its cache then holds them) and let the C-SMA see it
        before the first advertisement, so the first summary already names them."""
        self.engine.submit({"prompt_token_ids": tokens}, timeout=timeout)
        deadline = time.monotonic() + timeout
        want = sum(self.engine.state()["blocks"].values())
        while time.monotonic() < deadline:
            self.node.subscriber.poll(50)
            if sum(self.node.cache.count(t) for t in self.node.cache.order) >= want:
                return

    def start(self) -> ServedInstance:
        self.node.start()
        self.server.start()
        if self.transfer is not None:
            self.transfer.start()
        return self

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        self.server.close()  # closes the node and the engine too
        if self.identity is not None:
            self.identity.close()
        self.routes.withdraw_all()


def serve(
    topology: Topology,
    node: str,
    spool: Spool,
    stop: threading.Event,
    *,
    interval: float,
    max_message: int,
    time_scale: float = 1.0,
    background_blocks: int = 1,
    port: int = INSTANCE_PORT,
    ready: Path | None = None,
    kv_bytes: int = LAB_SHAPE.bytes_per_block,
    payload_bytes: int = PAYLOAD_BYTES,
    tiers: tuple[TierSpec, ...] = LAB_TIERS,
    warm: bool = True,
    change_threshold: float = 0.05,
    group_keys: security.GroupKeyring | None = None,
    api_token: bytes | None = None,
    engines: dict[str, EngineSpec] | None = None,
    engine_timeout: float = 300.0,
) -> None:
    """Run the node's instances until `stop` is set; the first one of each site serves
    the site's demo conversation first (unless `warm` is off). Background:
    `background_blocks` random blocks per instance every `interval` seconds (0: none).
    With `group_keys` every route's cache section is sealed under them. An instance
    named in `engines` is a real engine the runner started: its C-SMA runs here
    (`EngineCsma`), and `ready` is written once every engine answers."""
    from catsproto.lab.engine_site import ENGINE_MIN_INTERVAL_MS, EngineCsma

    engines = engines or {}
    instances: list[ServedInstance] = []
    csmas: list[EngineCsma] = []
    trust = security.TrustStore.from_json(lab_trust(topology, int(time.time() * 1000)))
    try:
        for spec in topology.nodes[node].instances:
            if spec.name in engines:
                csmas.append(
                    EngineCsma(
                        spec,
                        engines[spec.name],
                        spool,
                        lab_key(topology, spec.name),
                        secret=DEMO_SECRET,
                        secret_id=DEMO_SECRET_ID,
                        min_interval_ms=ENGINE_MIN_INTERVAL_MS,
                        max_message=max_message,
                        as_path_hops=PATH_MARGIN_HOPS,
                        reserve_bytes=384 + BIRD_RESERVE,
                        group_keys=group_keys,
                    )
                )
                continue
            instances.append(
                ServedInstance(
                    spec,
                    spool,
                    lab_key(topology, spec.name),
                    port=port,
                    time_scale=time_scale,
                    min_interval_ms=int(interval * 1000),
                    max_message=max_message,
                    trust=trust,
                    kv_bytes=kv_bytes,
                    payload_bytes=payload_bytes,
                    tiers=tiers,
                    change_threshold=change_threshold,
                    group_keys=group_keys,
                    api_token=api_token,
                )
            )
        warmers = [
            threading.Thread(target=inst.warm, args=(demo_prompt(inst.spec.site_id),))
            for inst in instances[: 1 if warm else 0]
        ]
        for w in warmers:
            w.start()
        for w in warmers:
            w.join()
        for inst in instances:
            inst.start()
        for csma in csmas:
            if not csma.wait_ready(engine_timeout):
                raise SystemExit(f"engine {csma.engine.url} not healthy after {engine_timeout} s")
            csma.start()
        if ready is not None:
            urls = [inst.server.url for inst in instances] + [c.engine.url for c in csmas]
            ready.write_text(json.dumps(urls))
        rng = np.random.default_rng(sum(i.spec.site_id for i in instances) + 7)
        while not stop.wait(interval):
            for inst in instances:
                if background_blocks > 0:
                    tokens = rng.integers(0, 128_000, size=background_blocks * BLOCK_TOKENS)
                    threading.Thread(
                        target=inst.engine.submit,
                        args=({"prompt_token_ids": tokens.tolist()}, 60),
                        daemon=True,
                    ).start()
    finally:
        for csma in csmas:
            csma.close()
        for inst in instances:
            inst.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="modelled inference instances behind one egress")
    p.add_argument("--topology", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--max-message", type=int, default=4096)
    p.add_argument("--serve", action="store_true", help="real modelled instances (HTTP)")
    p.add_argument("--port", type=int, default=INSTANCE_PORT)
    p.add_argument("--time-scale", type=float, default=1.0, help="model s per wall s")
    p.add_argument("--background-blocks", type=int, default=1)
    p.add_argument("--ready", help="file written with the instances' URLs once serving")
    p.add_argument(
        "--kv-bytes", type=int, default=LAB_SHAPE.bytes_per_block, help="advertised per block"
    )
    p.add_argument(
        "--payload-bytes", type=int, default=PAYLOAD_BYTES, help="synthetic KV stored per block"
    )
    p.add_argument(
        "--tiers", help="TIER:BLOCKS[,TIER:BLOCKS] cache capacities (default hbm:256,dram:2048)"
    )
    p.add_argument("--no-warm", action="store_true", help="no demo conversation at start")
    p.add_argument(
        "--seal",
        action="store_true",
        help="seal every route's cache section under the lab's group key (lab_group_keys)",
    )
    p.add_argument(
        "--change-threshold",
        type=float,
        default=0.05,
        help="fraction of advertised keys changed that is worth an early update (0: any)",
    )
    p.add_argument(
        "--api-token-file",
        help="bearer token the served instances' HTTP APIs require (see instance serve)",
    )
    p.add_argument(
        "--engines", help="JSON file naming the instances that are real engines (the runner's)"
    )
    args = p.parse_args(argv)
    if args.kv_bytes < 1 or args.payload_bytes < 1:
        p.error("--kv-bytes and --payload-bytes must be >= 1")
    from catsproto.adapters.http import token_option
    from catsproto.lab.engine_site import load_engines

    try:
        api_token = token_option(args.api_token_file, "--api-token-file")
    except ValueError as exc:
        p.error(str(exc))
    topology = load(args.topology)
    group_keys = lab_group_keys(topology) if args.seal else None
    node = topology.nodes[args.node]
    spool = Spool(args.spool)
    if args.serve:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        serve(
            topology,
            args.node,
            spool,
            stop,
            interval=args.interval,
            max_message=args.max_message,
            time_scale=args.time_scale,
            background_blocks=args.background_blocks,
            port=args.port,
            ready=Path(args.ready) if args.ready else None,
            kv_bytes=args.kv_bytes,
            payload_bytes=args.payload_bytes,
            tiers=lab_tiers(args.tiers) if args.tiers else LAB_TIERS,
            warm=not args.no_warm,
            change_threshold=args.change_threshold,
            group_keys=group_keys,
            api_token=api_token,
            engines=load_engines(args.engines) if args.engines else None,
        )
        return 0
    instances = [
        ModelledInstance(
            spec,
            seed=spec.site_id * 100 + i + 1,
            signer=lab_key(topology, spec.name),
            # the first instance of each site holds that site's demo conversation
            pinned=demo_prefix_keys(spec.site_id) if i == 0 else None,
            group_keys=group_keys,
        )
        for i, spec in enumerate(node.instances)
    ]
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

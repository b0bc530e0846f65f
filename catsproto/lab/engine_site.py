"""An engine site's C-SMA in the lab: a real vLLM's KV events in, signed routes out.

Strategy. Where a topology's instance is a real engine (`lab up --engine vllm`), the
runner starts `vllm serve` on the instance's address in its egress's namespace
(`catsproto.lab.engine`), and the egress's instances process runs this C-SMA beside the
modelled ones: the same `NodeAgent` as `instance node` (subscribed to the engine's own
KV events and replay socket, keyed with the lab's secret at the engine's block size),
its capacity the engine's real KV blocks, its load scraped from the engine's
Prometheus ``/metrics``. Every route the builder emits is sealed (when the lab is),
signed with the instance's lab key and spooled, exactly as for a modelled instance, so
BGP, the receivers and the selector cannot tell the two apart (`SignedRoutes`, the
step `catsproto instance node --signing-key --spool` takes too).

The C-SMA speaks only for a live engine: nothing is announced before the engine's
``/health`` answers, and an engine that stops answering (`HealthGate`: three probes in a
row) has every route withdrawn, so the selector stops choosing it once BGP carries
the withdrawals. When the engine answers again the builder sends everything afresh.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catsproto import security
from catsproto.adapters.engine_health import HealthGate, healthy
from catsproto.adapters.exabgp_announce import Spool
from catsproto.adapters.signed_routes import SignedRoutes
from catsproto.keys import BlockKeyer
from catsproto.lab.engine import EngineSpec
from catsproto.lab.topology import InstanceSpec
from catsproto.node import (
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    ModelShape,
    RouteAdvertisement,
    TierSpec,
)
from catsproto.wire import Tier

ENGINE_CS_ID = 200  # the service the lab's engines serve (the modelled ones serve 100)
ENGINE_PREFILL_TPS = 4_000.0  # until the engine has prefilled enough to measure it
# a real cache evicts under load within a second: its C-SMA may advertise four times a
# second (the modelled instances' lab default is once), so fewer hits are claimed stale
ENGINE_MIN_INTERVAL_MS = 250


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_shape(model_dir: Path, block_size: int) -> ModelShape:
    """The KV block shape of the engine's model, from its Hugging Face `config.json`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    return ModelShape(
        layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim", int(config["hidden_size"]) // heads)),
        dtype_bytes=_DTYPE_BYTES[config.get("torch_dtype", "bfloat16")],
        block_size=block_size,
    )


@dataclass(frozen=True)
class EngineSite:
    """One instance served by a real engine: its lab identity and its engine."""

    instance: InstanceSpec
    engine: EngineSpec

    def to_json(self) -> dict[str, Any]:
        e = self.engine
        return {
            "instance": self.instance.name,
            "host": e.host,
            "port": e.port,
            "events_port": e.events_port,
            "replay_port": e.replay_port,
            "num_gpu_blocks": e.num_gpu_blocks,
            "cpu": e.cpu,
            "log": None,
        }


def engine_spec_from_json(obj: dict[str, Any]) -> EngineSpec:
    return EngineSpec(
        host=str(obj["host"]),
        port=int(obj["port"]),
        events_port=int(obj["events_port"]),
        replay_port=int(obj["replay_port"]),
        num_gpu_blocks=int(obj["num_gpu_blocks"]),
        cpu=obj.get("cpu"),
    )


def load_engines(path: str | Path) -> dict[str, EngineSpec]:
    """instance name -> its engine, from the runner's engines file."""
    doc = json.loads(Path(path).read_text())
    return {str(e["instance"]): engine_spec_from_json(e) for e in doc}


class EngineCsma:
    """The C-SMA of one real engine: NodeAgent + metrics scrape + health gate + spool."""

    def __init__(
        self,
        spec: InstanceSpec,
        engine: EngineSpec,
        spool: Spool,
        signer: security.SigningKey,
        *,
        secret: bytes,
        secret_id: int,
        min_interval_ms: int = 1_000,
        max_message: int = 4096,
        as_path_hops: int = 8,
        reserve_bytes: int = 1384,
        group_keys: security.GroupKeyring | None = None,
    ) -> None:
        self.spec, self.engine, self.spool, self.signer = spec, engine, spool, signer
        self.group_keys = group_keys
        # sealed (if the lab is), signed and spooled as a modelled instance's routes
        self.routes = SignedRoutes(signer, group_keys=group_keys, spool=spool)
        self.up = False
        self.withdrawals = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._secret, self._secret_id = secret, secret_id
        self._limits = (min_interval_ms, max_message, as_path_hops, reserve_bytes)
        self.scraper: Any = None  # the engine's /metrics, scraped once it answers
        self.node = self._make_node()
        # withdraws every route after three failed probes a second apart, and starts a
        # new C-SMA when the engine answers again
        self.gate = HealthGate(engine.url, self._down, self._back)

    def _make_node(self) -> Any:
        """A C-SMA with a new epoch (the wall-clock second): after the engine was down,
        the next one starts afresh, as a restarted instance does."""
        from catsproto.adapters.instance import NodeAgent
        from catsproto.adapters.vllm_events import RankEndpoint

        engine, spec = self.engine, self.spec
        min_interval_ms, max_message, as_path_hops, reserve_bytes = self._limits
        shape = model_shape(engine.model_dir, engine.block_size)
        return NodeAgent(
            BuilderConfig(
                cs_id=ENGINE_CS_ID,
                address=str(spec.address),
                model_id=engine.served_model_name,
                block_size=engine.block_size,
                secret_id=self._secret_id,
                bytes_per_block=shape.bytes_per_block,
                site_id=spec.site_id,
                max_message_bytes=max_message,
                as_path_hops=as_path_hops,
                reserve_bytes=reserve_bytes,
                shard_range=str(spec.shards),
                snapshot_every=1,  # the receiver's rib.json keeps the latest value only
                dampening=DampeningPolicy(
                    min_interval_ms,
                    max(min_interval_ms, 10_000),
                    change_threshold=0.0,  # every change of a real cache is news
                    wait_threshold_ms=50.0,
                ),
            ),
            [TierSpec(Tier.HBM, engine.num_gpu_blocks, 5, 1_600_000)],
            BlockKeyer(self._secret, engine.served_model_name, engine.block_size),
            [RankEndpoint(0, engine.events, engine.replay)],
            self._compute_state,
            on_routes=self._publish,
        )

    def _compute_state(self) -> ComputeState:
        if self.scraper is None:
            return ComputeState(prefill_rate_tps=ENGINE_PREFILL_TPS)
        state: ComputeState = self.scraper.compute_state()
        return state

    def _publish(self, routes: list[RouteAdvertisement]) -> None:
        with self._lock:
            if not self.up:
                return  # an engine not (or no longer) answering is not advertised
            self.routes.publish(routes)

    def _withdraw_all(self) -> None:
        with self._lock:
            if self.routes.withdraw_all():
                self.withdrawals += 1

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the engine answers /health (True), or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if healthy(self.engine.url):
                return True
            time.sleep(0.5)
        return False

    def _down(self) -> None:
        with self._lock:
            self.up = False
        self._withdraw_all()

    def _back(self) -> None:
        """The engine answers again: a new C-SMA, a new epoch, everything afresh."""
        old, self.node = self.node, self._make_node()
        old.close()
        with self._lock:
            self.up = True
        self.node.start()

    def start(self) -> EngineCsma:
        """Start the C-SMA (its engine answers by now: `wait_ready`): the engine's load
        scraped from its /metrics, whose block size and KV blocks must be the spec's."""
        from catsproto.adapters.vllm_metrics import EngineScraper, scrape

        first = scrape(self.engine.url)
        if (first.block_size, first.num_gpu_blocks) != (
            self.engine.block_size,
            self.engine.num_gpu_blocks,
        ):
            raise ValueError(
                f"engine {self.engine.url} runs {first.num_gpu_blocks} blocks of "
                f"{first.block_size} tokens, not {self.engine.num_gpu_blocks} of "
                f"{self.engine.block_size}"
            )
        # an engine restarted faster than the gate notices is known by its process start
        self.scraper = EngineScraper(
            self.engine.url,
            first,
            ENGINE_PREFILL_TPS,
            on_restart=lambda m: self.node.engine_restarted(),
        ).start()
        self.up = True
        self.node.start()
        self.gate.start()
        return self

    def state(self) -> dict[str, Any]:
        return {
            "instance": self.spec.name,
            "engine": self.engine.url,
            "up": self.up,
            "health_failures": self.gate.failures,
            "withdrawals": self.withdrawals,
            "routes": len(self.routes.spooled),
            "scrape": self.scraper.state() if self.scraper is not None else None,
            **self.node.state(),
        }

    def close(self) -> None:
        self._stop.set()
        self.gate.close()
        self.node.close()
        if self.scraper is not None:
            self.scraper.close()
        self._withdraw_all()

"""The C-SMA next to an engine: its KV events in, dampened signed advertisements out.

Strategy: `NodeAgent` knows the engine only through its KV events (a
`VllmEventSubscriber` feeding a mirror `TieredCache`), builds advertisements with an
`AdvertisementBuilder` and hands them to ``on_routes``; compute metrics come from a
callable. `catsproto.adapters.instance` explains it with the HTTP face that serves it.

One lock guards the mirror cache, the builder and the counters; the subscriber takes it
only to apply what it received and never while it waits on a socket (its poll, a
replay), so /state and the advertisements never wait for the network. An engine restart
(`engine_restarted`, from the scraper's thread) forgets the old process' blocks before
it returns: no reader sees the restart counted and the old blocks still held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from catsproto import wire
from catsproto.adapters.metrics import (
    HitCounter,
    NodeCollector,
    node_registry,
    render,
)
from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventSubscriber,
)
from catsproto.keys import BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    BuilderConfig,
    ComputeState,
    KeyMode,
    RouteAdvertisement,
    TieredCache,
    TierSpec,
    VllmIngest,
)

if TYPE_CHECKING:
    pass


class NodeAgent:
    """The C-SMA: vLLM events in, advertisements out, on its own thread.

    on_routes receives every non-empty list of `RouteAdvertisement`s (unsigned). The
    epoch defaults to the wall-clock second of the start (new on every restart).
    """

    def __init__(
        self,
        builder_config: BuilderConfig,
        tiers: Sequence[TierSpec],
        keyer: BlockKeyer,
        endpoints: Sequence[RankEndpoint],
        compute_state: Callable[[], ComputeState],
        *,
        key_mode: KeyMode = KeyMode.TOKENS,
        engine: str = "vllm",
        on_routes: Callable[[list[RouteAdvertisement]], None] | None = None,
        epoch: int | None = None,
        poll_ms: int = 20,
        hits: HitCounter | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.cache = TieredCache(tiers)
        self.ingest = VllmIngest(
            self.cache,
            keyer,
            key_mode=key_mode,
            engine=engine,
            max_known_hashes=known_hashes_bound(tiers),
        )
        self._lock = threading.Lock()
        self.subscriber = VllmEventSubscriber(
            self.ingest, endpoints, context=context, lock=self._lock
        )
        self.builder = AdvertisementBuilder(
            builder_config, self.cache, int(time.time()) if epoch is None else epoch
        )
        self.compute_state = compute_state
        self.on_routes = on_routes
        self.poll_ms = poll_ms
        self.latest: dict[str, RouteAdvertisement] = {}
        self.error: str = ""
        self.ingest_errors = 0
        """Subscriber polls that raised (the subscriber itself counts refused batches)."""
        self.registry = node_registry(
            NodeCollector(
                self.cache,
                lambda: self.builder.stats,
                lambda: self.ingest.stats,
                lambda: self.subscriber.stats,
                hits,
                builder_config.address,
            )
        )
        self._stop = threading.Event()
        self._force = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="c-sma")

    def start(self) -> NodeAgent:
        self._thread.start()
        return self

    def readvertise(self) -> None:
        """Have the next round send every route, dampening or not (the routes were
        withdrawn meanwhile: an engine that stopped answering is back)."""
        with self._lock:
            self._force = True

    def engine_restarted(self) -> None:
        """The engine is a new process: what the old one held is forgotten before this
        returns (any thread may call this); the next round takes in what the new one
        published (its replay buffer) and sends every route."""
        self.subscriber.forget_engine()
        with self._lock:
            self._force = True

    def step(self, timeout_ms: int = 0) -> list[RouteAdvertisement]:
        """One round: take in events (the subscriber takes the lock only to apply them),
        then ask the builder (exposed for tests)."""
        try:
            self.subscriber.poll(timeout_ms)
        except Exception as exc:  # the builder still runs: its refreshes are due anyway
            with self._lock:
                self.ingest_errors += 1
                self.error = f"event ingest: {type(exc).__name__}: {exc}"
        with self._lock:
            routes = self.builder.poll(
                int(time.time() * 1000), self.compute_state(), force=self._force
            )
            self._force = False
            for r in routes:
                self.latest[str(r.prefix)] = r
        if routes and self.on_routes is not None:
            self.on_routes(routes)
        return routes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(self.poll_ms)
            except Exception as exc:  # keep serving; the error shows in /state
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(1.0)

    def advertisements(self) -> list[dict[str, Any]]:
        with self._lock:
            routes = list(self.latest.values())
        return [route_json(r) for r in routes]

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "blocks": {t.name.lower(): self.cache.count(t) for t in self.cache.order},
                "ingest": {
                    **{
                        k: getattr(self.ingest.stats, k)
                        for k in (
                            "batches",
                            "events",
                            "blocks_stored",
                            "blocks_removed",
                            "orphans",
                            "block_size_mismatch",
                        )
                    },
                    # engine block size -> blocks refused (the node keys another size)
                    "mismatched_block_sizes": {
                        str(size): n for size, n in self.ingest.stats.mismatched_block_sizes.items()
                    },
                },
                "subscriber": {
                    **{
                        k: getattr(self.subscriber.stats, k)
                        for k in (
                            "frames",
                            "bytes",
                            "gaps",
                            "resyncs",
                            "restarts",
                            "engine_restarts",
                            "bad_payloads",
                            "bad_replay_frames",
                            "foreign_rank_batches",
                            "replays_cut_short",
                            "failed_recoveries",
                            "last_error",
                        )
                    },
                    "failed_by_reason": dict(self.subscriber.stats.failed_by_reason),
                },
                "ingest_errors": self.ingest_errors,
                "builder": {
                    "advertisements": self.builder.stats.advertisements,
                    "suppressed": self.builder.stats.suppressed,
                    "bytes": self.builder.stats.bytes,
                    "epoch": self.builder.epoch,
                    "sequence": self.builder.sequence,
                },
                "error": self.error,
            }

    def metrics(self) -> bytes:
        with self._lock:
            return render(self.registry)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # a replay under way ends within its deadline
            self._thread.join(timeout=5 + self.subscriber.replay_deadline_ms / 1000)
        self.subscriber.close()


def known_hashes_bound(tiers: Sequence[TierSpec]) -> int:
    """How many engine hashes the ingest remembers (oldest forgotten first): twice the
    blocks the tiers can hold, and a few thousand more. A held block needs its hash
    known; an orphan (a block whose parent is unknown) adds one too, so a flood of
    orphans costs at most this many entries, and forgetting a held block's hash only
    makes the node under-claim its children."""
    return 2 * sum(t.capacity_blocks for t in tiers) + 4096


def route_json(route: RouteAdvertisement) -> dict[str, Any]:
    """A route advertisement as one JSON object (what `--adverts-out` writes per line)."""
    value = wire.encode(route.advertisement)
    return {
        "prefix": str(route.prefix),
        "tier": route.tier.name.lower() if route.tier is not None else None,
        "shard": route.shard,
        "epoch": route.epoch,
        "sequence": route.sequence,
        "reason": route.reason.value,
        "value": value.hex(),
        "advertisement": route.advertisement.to_json(),
    }


# what a caller without the API token is told of a /generate reply (here, and by the
# steering daemon of the chosen instance's reply): an allow-list, so a field added to the
# reply later is withheld until someone decides it is safe. `blocks` is the prompt's count
# of full blocks, which the caller can work out from its own prompt. The modelled instance
# generates no output (it answers when prefill ends, the first token); an engine that
# returns output names its field here. Everything else the reply carries says how much of
# the prompt was cached: cached_blocks(_by_tier), cached_tokens, prefill_tokens,
# model_prefill_ms, expected_blocks, stale, stale_cause, evicted_ms_ago,
# lost_while_queued, transfer, and queue_wall_ms (the queue's wait is the prefill of the
# requests ahead, so it tells of other callers' cache hits).

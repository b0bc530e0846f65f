"""The node's engine side attacked through ZMQ, as issue #41 rows 11-14 found it.

Whoever answers at the KV-event endpoints is trusted with nothing: a replay is bounded by
time, replies and bytes (row 11); the node's lock is never held while a socket is waited
on, so /state and the advertisements never wait for a replay (row 12); blocks stored by
a batch that names another rank go with the socket that brought them, so its restart or
clear removes them (row 13); every socket has a maximum message size and the table of
engine hashes (orphans included) is bounded (row 14). An engine restart is forgotten
before `NodeAgent.engine_restarted` returns (the ordering the restart lab test caught).
All on loopback, against real ZMQ sockets."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import zmq

from catsproto.adapters.node_agent import known_hashes_bound
from catsproto.adapters.vllm_events import (
    MAX_MESSAGE_BYTES,
    RankEndpoint,
    VllmEventSubscriber,
    cleared_event,
    decode_payload,
    encode_payload,
    stored_event,
)
from catsproto.node import VllmIngest
from catsproto.wire import Tier
from tests.test_vllm_events import BS, END, KEYER, RawEngine, drain, new_cache, node_agent


class ReplayStandIn:
    """A ROUTER at a replay endpoint that answers each request with `count` replies of
    `size` bytes, one every `every` seconds, and an end marker only if `end`."""

    def __init__(
        self, ctx: zmq.Context, *, count: int, size: int = 16, every: float = 0.0, end: bool
    ) -> None:
        self.count, self.size, self.every, self.end = count, size, every, end
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = 0
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            if not self.router.poll(20, zmq.POLLIN):
                continue
            client, _, _start = self.router.recv_multipart()
            self.requests += 1
            payload = b"\x00" * self.size
            for i in range(self.count):
                if not self.running:
                    return
                self.router.send_multipart(
                    [client, b"", b"", (100 + i).to_bytes(8, "big"), payload]
                )
                if self.every:
                    time.sleep(self.every)
            if self.end:
                self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.router.close(linger=0)


@pytest.fixture
def stand_ins(ctx: zmq.Context) -> Iterator[list[ReplayStandIn]]:
    made: list[ReplayStandIn] = []
    yield made
    for r in made:
        r.close()


def gap(engine: RawEngine) -> None:
    """Batch 0 arrives, batch 1 is lost, batch 2 shows the gap."""
    engine.wait_subscriber()
    engine.publish(encode_payload(0.0, [], 0))
    engine.publish(encode_payload(1.0, [], 0), lose=True)
    engine.publish(encode_payload(2.0, [], 0))


# ---- row 11: replay bounded by time, replies and bytes -------------------------------


def test_a_replay_that_never_ends_is_cut_at_its_deadline(
    ctx: zmq.Context, engine: RawEngine, stand_ins: list[ReplayStandIn]
) -> None:
    """One reply every 50 ms and never the end marker: the wait between replies never
    runs out; the deadline in all does."""
    drip = ReplayStandIn(ctx, count=10_000, every=0.05, end=False)
    stand_ins.append(drip)
    ep = RankEndpoint(0, engine.pub_endpoint, drip.endpoint)
    with VllmEventSubscriber(
        VllmIngest(new_cache(), KEYER), [ep], context=ctx, replay_timeout_ms=500,
        replay_deadline_ms=1_000,
    ) as sub:  # fmt: skip
        gap(engine)
        started = time.monotonic()
        drain(sub, 2, timeout_s=20)
        took = time.monotonic() - started
        assert took < 3.0, f"the recovery held the subscriber {took:.1f} s"
        assert sub.stats.failed_by_reason["timeout"] == 1 and sub.stats.replays_cut_short == 1
        assert "cut short at 1000 ms in all" in sub.stats.last_error


@pytest.mark.parametrize(
    ("count", "size", "limits", "said"),
    [
        (40, 1 << 20, {"max_replay_bytes": 4 << 20}, "bytes (more than 4194304)"),
        (50, 16, {"max_replay_messages": 10}, "cut short at 10 replies"),
    ],
)
def test_a_replay_too_large_is_cut_at_its_bounds_and_kept_nowhere(
    ctx: zmq.Context,
    engine: RawEngine,
    stand_ins: list[ReplayStandIn],
    count: int,
    size: int,
    limits: dict[str, int],
    said: str,
) -> None:
    big = ReplayStandIn(ctx, count=count, size=size, end=True)
    stand_ins.append(big)
    ep = RankEndpoint(0, engine.pub_endpoint, big.endpoint)
    with VllmEventSubscriber(VllmIngest(new_cache(), KEYER), [ep], context=ctx, **limits) as sub:
        gap(engine)
        tracemalloc.start()
        try:
            drain(sub, 2)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert sub.stats.failed_by_reason["incomplete"] == 1 and sub.stats.replays_cut_short == 1
        assert said in sub.stats.last_error
        assert peak < 12 << 20, f"the replay held {peak / 2**20:.0f} MiB at its peak"
        assert sub.stats.bytes < 8 << 20


# ---- row 12: no network wait under the node's lock ------------------------------------


def test_the_node_state_never_waits_for_a_replay(
    ctx: zmq.Context, engine: RawEngine, stand_ins: list[ReplayStandIn]
) -> None:
    silent = ReplayStandIn(ctx, count=0, end=False)  # takes the request, answers nothing
    stand_ins.append(silent)
    node = node_agent(RankEndpoint(0, engine.pub_endpoint, silent.endpoint), ctx)
    node.start()
    try:
        gap(engine)
        deadline = time.monotonic() + 5
        while silent.requests == 0:
            assert time.monotonic() < deadline, "no replay was requested"
            time.sleep(0.01)
        # the node's thread now waits up to 2 s for a reply that never comes
        waits = []
        for _ in range(5):
            started = time.monotonic()
            node.state()
            node.advertisements()
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
        assert max(waits) < 0.3, f"/state waited {max(waits):.2f} s for the replay"
        assert silent.requests == 1 and node.subscriber.stats.failed_recoveries == 0
    finally:
        node.close()
    assert node.subscriber.stats.failed_by_reason["timeout"] == 1


# ---- row 13: blocks go with the socket that stored them -------------------------------


def stores(first_hash: int, n: int, rank: int) -> bytes:
    tokens = [first_hash * 100 + t for t in range(n * BS)]
    hashes = list(range(first_hash, first_hash + n))
    return encode_payload(0.0, [stored_event(hashes, None, tokens, BS)], rank)


@pytest.mark.parametrize("then", ["restart", "clear"])
def test_blocks_a_batch_names_for_another_rank_go_with_its_socket(
    ctx: zmq.Context, engine: RawEngine, then: str
) -> None:
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        engine.publish(stores(10, 2, rank=7))  # rank 7's batch on rank 0's socket
        engine.publish(stores(20, 3, rank=0))
        drain(sub, 2)
        assert cache.count(Tier.HBM) == 5 and sub.stats.foreign_rank_batches == 1
        if then == "restart":
            engine.restart()  # the sequence starts at 0 again
            engine.publish(encode_payload(1.0, [], 0))
        else:
            engine.publish(encode_payload(1.0, [cleared_event()], 0))
        drain(sub, 3)
        assert cache.count(Tier.HBM) == 0, f"{cache.count(Tier.HBM)} blocks still held"


# ---- row 14: message size and the table of engine hashes ------------------------------


def test_every_socket_has_a_maximum_message_size_and_a_larger_frame_never_lands(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    with VllmEventSubscriber(VllmIngest(new_cache(), KEYER), [ep], context=ctx) as sub:
        for s in sub._streams.values():
            assert s.sub.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES == 16 << 20
            assert s.replay is not None and s.replay.getsockopt(zmq.MAXMSGSIZE) == 16 << 20
    cache = new_cache()
    with VllmEventSubscriber(
        VllmIngest(cache, KEYER), [ep], context=ctx, max_message_bytes=1 << 20
    ) as sub:
        engine.wait_subscriber()
        engine.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\x00" * (2 << 20)])
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            sub.poll(50)
        assert sub.stats.frames == 0 and sub.stats.bytes == 0


def test_a_flood_of_orphan_blocks_is_bounded_by_the_node_capacity(ctx: zmq.Context) -> None:
    engine = RawEngine(ctx)
    node = node_agent(RankEndpoint(0, engine.pub_endpoint, None), ctx)
    try:
        bound = known_hashes_bound([t for t in node.cache.specs.values()])
        assert node.ingest.max_known_hashes == bound == 2 * 10_000 + 4096
        for b in range(50):  # 50,000 blocks whose parent the node never saw
            hashes = list(range(1_000_000 + b * 1000, 1_000_000 + (b + 1) * 1000))
            ev = stored_event(hashes, 999, [1] * (1000 * BS), BS)
            node.ingest.apply_batch(decode_payload(encode_payload(0.0, [ev], 0)), 0)
        assert (
            node.ingest.stats.orphans + node.ingest.stats.skipped_extra == 50_000
            and node.cache.count(Tier.HBM) == 0
        )
        assert len(node.ingest._known) <= bound
    finally:
        node.close()
        engine.close()


# ---- the restart ordering --------------------------------------------------------------


def test_an_engine_restart_is_forgotten_before_engine_restarted_returns(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    node = node_agent(RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint), ctx)
    try:
        engine.wait_subscriber()
        engine.publish(stores(10, 3, rank=0))
        deadline = time.monotonic() + 5
        while node.state()["blocks"]["hbm"] != 3:
            assert time.monotonic() < deadline, node.state()
            node.step(50)
        engine.restart()
        node.engine_restarted()  # as the scraper calls it, on another thread than the node's
        s = node.state()
        assert (s["blocks"]["hbm"], s["subscriber"]["engine_restarts"]) == (0, 1)
        engine.publish(stores(30, 2, rank=0))  # the new process' first batch
        while node.state()["blocks"]["hbm"] != 2:
            assert time.monotonic() < deadline, node.state()
            node.step(50)
    finally:
        node.close()

"""vLLM KV events: byte-exact payloads, both event forms, copy counting, real ZMQ sockets,
gap recovery through the replay socket, resync and engine restarts."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import msgpack
import pytest
import zmq

from catsproto.adapters.instance import NodeAgent
from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventPublisher,
    VllmEventSubscriber,
    cleared_event,
    decode_payload,
    encode_payload,
    engine_binds,
    offset_endpoint_port,
    removed_event,
    stored_event,
    subscriber_endpoints,
)
from catsproto.keys import BlockKeyer
from catsproto.node import (
    DEFAULT_MEDIA,
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    KeyMode,
    TieredCache,
    TierSpec,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventError,
    VllmIngest,
    parse_batch,
)
from catsproto.wire import Tier

BS = 4
KEYER = BlockKeyer(b"s" * 32, "test/model", BS)
END = b"\xff" * 8


def new_cache() -> TieredCache:
    return TieredCache(
        [
            TierSpec(Tier.HBM, 10_000, 5, 1),
            TierSpec(Tier.DRAM, 10_000, 20, 1),
            TierSpec(Tier.SSD, 10_000, 200, 1),
        ]
    )


def snapshot(cache: TieredCache) -> dict[Tier, set[int]]:
    return {t: set(cache.lru_keys(t)) for t in cache.order}


# ---- payloads ----------------------------------------------------------------------------


def test_payload_bytes_match_a_hand_written_vector() -> None:
    # [1.5, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}], 0]
    vector = bytes.fromhex(
        "93"  # array of 3: ts, events, data_parallel_rank
        "cb3ff8000000000000"  # float64 1.5
        "91"  # one event
        "83"  # map of 3
        "a474797065"
        "ac426c6f636b52656d6f766564"  # "type": "BlockRemoved"
        "ac626c6f636b5f686173686573"
        "9107"  # "block_hashes": [7]
        "a66d656469756d"
        "a3475055"  # "medium": "GPU"
        "00"  # rank 0
    )
    assert encode_payload(1.5, [removed_event([7])], 0) == vector
    batch = decode_payload(vector)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    assert batch.events == (VllmBlockRemoved([7], "GPU"),)


def test_stored_event_leaves_out_defaults_and_keeps_required_nones() -> None:
    ev = stored_event([1], None, [0, 1, 2, 3], 4, medium=None)
    assert list(ev) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    ev = stored_event([1], None, [0, 1, 2, 3], 4, group_idx=1, kv_cache_spec_kind="full")
    assert ev["group_idx"] == 1 and "extra_keys" not in ev


def test_both_event_forms_parse_to_the_same_events() -> None:
    new = [
        stored_event([1, 2], 9, list(range(8)), 4, medium="CPU"),
        removed_event([2], medium="CPU"),
        cleared_event(),
    ]
    old = [
        stored_event([1, 2], 9, list(range(8)), 4, medium="CPU", legacy=True),
        removed_event([2], medium="CPU", legacy=True),
        cleared_event(legacy=True),
    ]
    a = decode_payload(encode_payload(2.0, new, 1))
    b = decode_payload(encode_payload(2.0, old, 1))
    assert a == b
    assert a.events[0] == VllmBlockStored([1, 2], 9, list(range(8)), 4, None, "CPU", None)
    assert isinstance(a.events[2], VllmAllBlocksCleared)
    # vLLM <= 0.23 without medium, a batch without rank, a batch as a map
    legacy = parse_batch([0.0, [["BlockRemoved", [5]]]])
    assert legacy.events == (VllmBlockRemoved([5]),) and legacy.data_parallel_rank is None
    as_map = parse_batch({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]})
    assert as_map.events == (VllmAllBlocksCleared(),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb([1.0]),
        msgpack.packb([1.0, [{"type": "Nope"}], 0]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", 0, "extra"]], 0]),
        msgpack.packb(["x", [], 0]),
    ],
)
def test_bad_payloads_raise_one_error(payload: bytes) -> None:
    with pytest.raises(VllmEventError):
        decode_payload(payload)


# ---- ingestion (pure) ---------------------------------------------------------------------


def test_ingest_rekeys_from_tokens_and_chains_from_the_parent() -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER)
    tokens = list(range(100, 112))
    # the engine publishes the prompt in two events; hashes are opaque ints
    ingest.apply_batch(parse_batch([0.0, [stored_event([-5, 6], None, tokens[:8], BS)], 0]))
    ingest.apply_batch(parse_batch([0.1, [stored_event([7], 6, tokens[8:], BS)], 0]))
    assert snapshot(cache)[Tier.HBM] == set(KEYER.block_keys(tokens))
    assert cache.depth[KEYER.block_keys(tokens)[2]] == 3


def test_ingest_counts_copies_media_ranks_and_clears() -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER)
    toks = [1, 2, 3, 4]
    (key,) = KEYER.block_keys(toks)
    stored = parse_batch([0.0, [stored_event([11], None, toks, BS)], 0])
    removed = parse_batch([0.0, [removed_event([11])], 0])
    ingest.apply_batch(stored)
    ingest.apply_batch(stored)  # vLLM does not de-duplicate: a second copy
    ingest.apply_batch(removed)
    assert key in cache.lru_keys(Tier.HBM)
    ingest.apply_batch(removed)
    assert key not in cache
    ingest.apply_batch(removed)
    assert ingest.stats.unknown_removals == 1
    # medium -> tier; None is GPU
    ingest.apply_batch(
        parse_batch(
            [
                0.0,
                [
                    stored_event([11], None, toks, BS, medium="CPU"),
                    stored_event([11], None, toks, BS, medium=None),
                    stored_event([11], None, toks, BS, medium="DISK"),
                ],
            ]
        )
    )
    assert cache.tier_of(key) == Tier.HBM and key in cache.lru_keys(Tier.SSD)
    # rank 1 holds the block in HBM too; AllBlocksCleared of rank 0 clears rank 0's GPU only
    ingest.apply_batch(parse_batch([0.0, [stored_event([11], None, toks, BS)], 1]))
    ingest.apply_batch(parse_batch([0.0, [cleared_event()], 0]))
    assert key in cache.lru_keys(Tier.HBM) and key in cache.lru_keys(Tier.DRAM)
    ingest.apply_batch(parse_batch([0.0, [cleared_event()], 1]))
    assert key not in cache.lru_keys(Tier.HBM) and key in cache.lru_keys(Tier.DRAM)
    # unknown media and LoRA blocks are skipped, and so are children of skipped blocks
    ingest.apply_batch(
        parse_batch(
            [
                0.0,
                [
                    stored_event([12], None, toks, BS, medium="TAPE"),
                    stored_event([13], None, toks, BS, lora_name="adapter"),
                    stored_event([14], 13, [5, 6, 7, 8], BS),
                    stored_event([15], 999, [5, 6, 7, 8], BS),
                ],
            ]
        )
    )
    s = ingest.stats
    assert (s.unknown_media, s.skipped_extra, s.orphans) == (1, 2, 1)


def test_ingest_engine_id_mode_keys_mooncake_ids() -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER, key_mode=KeyMode.ENGINE_IDS, engine="mooncake")
    ingest.apply_batch(parse_batch([0.0, [stored_event([0, 14], None, [0] * 8, BS)], 0]))
    assert snapshot(cache)[Tier.HBM] == {
        KEYER.engine_key("mooncake", 0),
        KEYER.engine_key("mooncake", 14),
    }


# ---- real sockets --------------------------------------------------------------------------


class RawEngine:
    """A vLLM-like engine written against raw pyzmq: XPUB (so the test can wait for the
    subscription; frames are those of a PUB) and a ROUTER replay served by a thread."""

    def __init__(self, ctx: zmq.Context, buffer_steps: int = 10_000) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.lock = threading.Lock()
        self.replay_requests: list[list[bytes]] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def pub_endpoint(self) -> str:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def wait_subscriber(self) -> None:
        assert self.pub.poll(5_000, zmq.POLLIN), "no subscription arrived"
        assert self.pub.recv() == b"\x01"  # subscribe to the empty topic

    def publish(self, payload: bytes, *, lose: bool = False) -> None:
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if not lose:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        while self.running:
            if not self.router.poll(20, zmq.POLLIN):
                continue
            frames = self.router.recv_multipart()
            self.replay_requests.append(frames[1:])
            client, _, start = frames
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= int.from_bytes(start, "big")]
            for s, p in items:
                self.router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", END, b""])

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def workload(n: int) -> list[bytes]:
    """n batches: prompts that share prefixes, evictions, offloads, one clear."""
    out = []
    for i in range(n):
        base = (i % 5) * 1000
        tokens = [base + t for t in range(12)] + [i * 10 + t for t in range(8)]
        events = [
            stored_event([base + 1, base + 2, base + 3], None, tokens[:12], BS),
            stored_event([i * 7 + 100_001, i * 7 + 100_002], base + 3, tokens[12:], BS),
        ]
        if i % 3 == 2:
            events.append(removed_event([(i - 2) * 7 + 100_002]))
            events.append(
                stored_event(
                    [(i - 2) * 7 + 100_002],
                    (i - 2) * 7 + 100_001,
                    [(i - 2) * 10 + t for t in range(4, 8)],
                    BS,
                    medium="CPU",
                )
            )
        if i == n // 2:
            events.append(cleared_event())
        out.append(encode_payload(float(i), events, 0))
    return out


def drain(sub: VllmEventSubscriber, until: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.ingest.stats.batches < until and time.monotonic() < deadline:
        sub.poll(50)
    assert sub.ingest.stats.batches >= until, sub.stats


def reference_state(payloads: list[bytes]) -> dict[Tier, set[int]]:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER)
    for p in payloads:
        ingest.apply_batch(decode_payload(p))
    return snapshot(cache)


def test_subscriber_connects_and_mirrors_the_engine(ctx: zmq.Context, engine: RawEngine) -> None:
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        payloads = workload(30)
        for p in payloads:
            engine.publish(p)
        drain(sub, 30)
        assert sub.stats.gaps == 0 and sub.stats.frames == 30
    assert snapshot(cache) == reference_state(payloads)
    assert cache.count(Tier.HBM) > 0 and cache.count(Tier.DRAM) > 0


def test_a_gap_recovers_through_replay_to_the_gap_free_state(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    payloads = workload(40)
    lost = {5, 6, 7, 21, 39}
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        for lo, hi in ((0, 11), (11, 31), (31, 40)):  # one gap per phase
            for i in range(lo, hi):
                engine.publish(payloads[i], lose=i in lost)
            drain(sub, hi - (hi == 40))
        # seq 39 is lost and nothing follows: the gap is only seen on the next batch
        extra = encode_payload(40.0, [removed_event([1])], 0)
        engine.publish(extra)
        drain(sub, 41)
        assert sub.stats.gaps == 3 and sub.stats.resyncs == 0
        assert [r[1] for r in sub.stats.recoveries] == [5, 21, 39]
        assert sub.stats.duplicates >= 1  # PUB copies of replayed batches were dropped
    assert [f[0] for f in engine.replay_requests] == [b""] * 3  # DEALER: [b"", start]
    assert snapshot(cache) == reference_state([*payloads, extra])


def test_replay_buffer_too_short_resyncs_without_overclaiming(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    engine.buffer = deque(maxlen=3)
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    payloads = workload(20)
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        for i, p in enumerate(payloads[:16]):
            engine.publish(p, lose=5 <= i < 15)  # ten lost, only 13..15 kept for replay
        drain(sub, 5 + 3)
        for p in payloads[16:]:
            engine.publish(p)
        drain(sub, 12)
        assert sub.stats.resyncs == 1 and sub.stats.recoveries == [(0, 5, 13)]
    truth = reference_state(payloads)
    got = snapshot(cache)
    window = reference_state(payloads[13:])
    for t in got:
        assert window[t] <= got[t] <= truth[t]  # never claims what the engine dropped


def test_engine_restart_resets_the_rank(ctx: zmq.Context, engine: RawEngine) -> None:
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    payloads = workload(6)
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        for p in payloads:
            engine.publish(p)
        drain(sub, 6)
        engine.restart()
        for p in payloads[:2]:
            engine.publish(p)
        drain(sub, 8)
        assert sub.stats.restarts == 1 and sub.ingest.stats.rank_resets == 1
    assert snapshot(cache) == reference_state(payloads[:2])


def test_endpoint_rules_follow_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert engine_binds("tcp://*:5557") and engine_binds("ipc:///tmp/x")
    assert not engine_binds("tcp://10.0.0.9:5557")
    eps = subscriber_endpoints("tcp://*:5557", "tcp://*:5558", [0, 1], "10.0.0.2")
    assert eps == [
        RankEndpoint(0, "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", False),
        RankEndpoint(1, "tcp://10.0.0.2:5558", "tcp://10.0.0.2:5559", False),
    ]
    eps = subscriber_endpoints("tcp://10.0.0.1:6000", None, [1], "10.0.0.2")
    assert eps == [RankEndpoint(1, "tcp://10.0.0.1:6001", None, True)]


def free_base_port(span: int) -> int:
    """A port p with p..p+span-1 all free on 127.0.0.1 (checked by binding them)."""
    import socket

    for base in range(41_000, 60_000, 37):
        socks = []
        try:
            for i in range(span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_bind_mode_two_ranks_with_our_publisher(ctx: zmq.Context) -> None:
    """vLLM connects its PUB to a non-wildcard endpoint, so the node binds; each DP rank
    adds its rank to both ports. Batches a PUB sends before the subscription reached it
    are lost: the first batch seen is then above 0 and the join replay fetches them."""
    base = free_base_port(4)
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    eps = subscriber_endpoints(endpoint, replay, [0, 1], "127.0.0.1")
    assert all(e.bind for e in eps)
    cache = new_cache()
    tokens = [[r * 100 + t for t in range(8)] for r in (0, 1)]
    with VllmEventSubscriber(VllmIngest(cache, KEYER), eps, context=ctx) as sub:
        pubs = [
            VllmEventPublisher(endpoint, replay, data_parallel_rank=r, context=ctx) for r in (0, 1)
        ]
        try:
            assert [p.endpoint for p in pubs] == [eps[0].pub, eps[1].pub]
            for p, toks in zip(pubs, tokens, strict=True):
                p.publish(0.0, [stored_event([1, 2], None, toks, BS)])
            for _ in range(6):  # the node's loop runs (a socket acts on commands in calls)
                sub.poll(50)
            for p, toks in zip(pubs, tokens, strict=True):
                p.publish(1.0, [removed_event([2])])
                p.publish(2.0, [stored_event([3], 1, toks[4:], BS, medium="CPU")])
            drain(sub, 6)
        finally:
            for p in pubs:
                p.close()
        assert sub.ingest.stats.by_rank.keys() == {0, 1}
        assert sub.stats.recoveries == [(0, 0, 0), (1, 0, 0)]  # seq 0 came by replay
    first = {KEYER.block_keys(t)[0] for t in tokens}
    assert snapshot(cache)[Tier.HBM] == first
    assert snapshot(cache)[Tier.DRAM] == {KEYER.block_keys(t)[1] for t in tokens}


# ---- offload media are sets -------------------------------------------------------------


@pytest.mark.parametrize("medium", ["CPU", "DISK", "STORAGE"])
def test_an_offload_store_is_a_set_while_gpu_copies_are_counted(medium: str) -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER)
    toks = [1, 2, 3, 4]
    (key,) = KEYER.block_keys(toks)
    tier = DEFAULT_MEDIA[medium]
    for m in ("GPU", medium):
        store = parse_batch([0.0, [stored_event([11], None, toks, BS, medium=m)], 0])
        ingest.apply_batch(store)
        ingest.apply_batch(store)  # stored twice, no removal between
    assert ingest.copies(0) == {("GPU", None, 11): 2, (medium, None, 11): 1}
    ingest.apply_batch(parse_batch([0.0, [removed_event([11], medium=medium)], 0]))
    assert key not in cache.lru_keys(tier)  # the store dropped it: one removal is enough
    ingest.apply_batch(parse_batch([0.0, [removed_event([11], medium="GPU")], 0]))
    assert key in cache.lru_keys(Tier.HBM)  # a second GPU copy is still held
    ingest.apply_batch(parse_batch([0.0, [removed_event([11], medium="GPU")], 0]))
    assert key not in cache and ingest.copies(0) == {}
    ingest.apply_batch(parse_batch([0.0, [removed_event([11], medium=medium)], 0]))
    assert ingest.stats.unknown_removals == 1 and ingest.stats.unknown_media == 0


# ---- a block size the node does not key --------------------------------------------------


@pytest.mark.parametrize("mode", list(KeyMode))
def test_blocks_of_another_size_are_refused_and_never_keyed(mode: KeyMode) -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER, key_mode=mode)
    toks = list(range(2 * BS))
    wide = parse_batch([0.0, [stored_event([1], None, toks, 2 * BS)], 0])
    ingest.apply_batch(wide)
    ingest.apply_batch(wide)
    ingest.apply_batch(parse_batch([0.0, [stored_event([2, 3], None, toks, BS // 2)], 1]))
    # a child of a refused block is not keyed from it either
    ingest.apply_batch(parse_batch([0.0, [stored_event([4], 1, toks[:BS], BS)], 0]))
    assert all(not keys for keys in snapshot(cache).values())
    s = ingest.stats
    assert s.block_size_mismatch == 4 and s.mismatched_block_sizes == {2 * BS: 2, BS // 2: 2}
    assert s.orphans == 1 and s.blocks_stored == 5
    notices = ingest.take_notices()
    assert [(n.rank, n.engine_block_size, n.node_block_size) for n in notices] == [
        (0, 2 * BS, BS),
        (1, BS // 2, BS),
    ]
    assert f"blocks of {2 * BS} tokens" in notices[0].message
    assert f"node keys blocks of {BS} tokens" in notices[0].message
    assert ingest.take_notices() == []


def test_a_block_size_mismatch_is_an_error_in_the_log_and_the_node_state(
    ctx: zmq.Context, engine: RawEngine, caplog: pytest.LogCaptureFixture
) -> None:
    node = node_agent(RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint), ctx)
    caplog.set_level(logging.WARNING, logger="catsproto.adapters.vllm_events")
    try:
        engine.wait_subscriber()
        toks = list(range(4 * BS))
        for _ in range(3):  # one size, three times: one ERROR
            engine.publish(encode_payload(0.0, [stored_event([1], None, toks, 4 * BS)], 0))
        engine.publish(encode_payload(0.0, [stored_event([2], None, toks[: 2 * BS], 2 * BS)], 0))
        engine.publish(encode_payload(0.0, [stored_event([3], None, toks[:BS], BS)], 0))
        step_until(node, lambda: node.ingest.stats.batches == 5)
        errors = [r for r in caplog.records if r.name == "catsproto.adapters.vllm_events"]
        assert [r.levelno for r in errors] == [logging.ERROR] * 2
        assert f"blocks of {4 * BS} tokens" in errors[0].getMessage()
        state = node.state()
        assert state["ingest"]["block_size_mismatch"] == 4
        assert state["ingest"]["mismatched_block_sizes"] == {str(4 * BS): 3, str(2 * BS): 1}
        last = state["subscriber"]["last_error"]
        assert f"blocks of {2 * BS} tokens" in last and f"keys blocks of {BS} tokens" in last
        assert node.cache.count(Tier.HBM) == 1  # the block of the right size
        scraped = node.metrics().decode().splitlines()
        assert 'catsproto_node_block_size_mismatch_blocks_total{instance="10.0.0.5"} 4.0' in (
            scraped
        )
    finally:
        node.close()


def node_agent(endpoint: RankEndpoint, ctx: zmq.Context) -> NodeAgent:
    cfg = BuilderConfig(
        cs_id=1,
        address="10.0.0.5",
        model_id="test/model",
        block_size=BS,
        bytes_per_block=1 << 20,
        dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
    )
    tiers = [TierSpec(Tier.HBM, 10_000, 5, 1)]
    return NodeAgent(cfg, tiers, KEYER, [endpoint], ComputeState, epoch=1, context=ctx)


def step_until(node: NodeAgent, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not done():
        assert time.monotonic() < deadline, node.state()
        node.step(50)

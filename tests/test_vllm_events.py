"""vLLM KV events: byte-exact payloads, both event forms, copy counting (GPU) and sets
(offload media), block sizes the node does not key, real ZMQ sockets, gap recovery through
both replay formats, failed recoveries (warned, counted, resynced), engine restarts, and
vLLM's own publisher in its own process (the engine python of `tests.engine_helpers`)."""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

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
    replay_reply,
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
from tests import vllm_publisher_script
from tests.engine_helpers import require_engine_python
from tests.waits import wait_until

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
    subscription; frames are those of a PUB) and a ROUTER replay served by a thread.

    Replay replies are vLLM >= 0.26's ``[b"", topic, seq, payload]`` (``legacy_replay``:
    <= 0.25's ``[b"", seq, payload]``); `answer` may rewrite the replies (end marker
    included) of each request, to lose, break or withhold them."""

    def __init__(
        self, ctx: zmq.Context, buffer_steps: int = 10_000, *, legacy_replay: bool = False
    ) -> None:
        self.legacy_replay = legacy_replay
        self.answer: Callable[[list[list[bytes]]], list[list[bytes]]] = lambda replies: replies
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
        self.answered = 0  # replay requests whose replies have all been sent
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
            if self.legacy_replay:
                replies = [[b"", s.to_bytes(8, "big"), p] for s, p in items]
                replies.append([b"", END, b""])
            else:
                replies = [[b"", b"", s.to_bytes(8, "big"), p] for s, p in items]
                replies.append([b"", b"", END, b""])
            for reply in self.answer(replies):
                self.router.send_multipart([client, *reply])
            self.answered += 1

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


# ---- replay formats: vLLM <= 0.25 and >= 0.26 ---------------------------------------------


def test_replay_reply_reads_both_vllm_formats_and_refuses_other_shapes() -> None:
    seq = (5).to_bytes(8, "big")
    assert replay_reply([b"", b"kv", seq, b"payload"]) == (seq, b"payload")  # >= 0.26
    assert replay_reply([b"", seq, b"payload"]) == (seq, b"payload")  # <= 0.25
    assert replay_reply([b"", b"", END, b""]) == (END, b"")  # end marker, >= 0.26
    assert replay_reply([b"", END, b""]) == (END, b"")  # end marker, <= 0.25
    for frames, reason in (
        ([b"", seq], "not 2"),
        ([b"", b"kv", seq, b"p", b"extra"], "not 5"),
        ([b"x", seq, b"p"], "empty frame"),
        ([b"", b"kv", seq[:7], b"p"], "8 bytes, not 7"),
        ([b"", seq + b"\x00", b"p"], "8 bytes, not 9"),
    ):
        with pytest.raises(VllmEventError, match=reason):
            replay_reply(frames)


@pytest.mark.parametrize("legacy", [False, True], ids=["vllm>=0.26", "vllm<=0.25"])
def test_our_publisher_replays_what_vllm_sends(ctx: zmq.Context, legacy: bool) -> None:
    """Byte for byte: the topic frame (and the empty-topic end marker) unless legacy."""
    with VllmEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", context=ctx, legacy_replay=legacy
    ) as pub:
        payloads = [encode_payload(float(i), [removed_event([i])], 0) for i in range(3)]
        for i in range(3):
            assert pub.publish(float(i), [removed_event([i])]) == i
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            got = []
            while dealer.poll(2_000, zmq.POLLIN):
                got.append(dealer.recv_multipart())
                if END in got[-1]:
                    break
        finally:
            dealer.close(linger=0)
    seqs = [(i).to_bytes(8, "big") for i in range(3)]
    if legacy:
        assert got == [[b"", seqs[1], payloads[1]], [b"", seqs[2], payloads[2]], [b"", END, b""]]
    else:
        assert got == [
            [b"", b"kv", seqs[1], payloads[1]],
            [b"", b"kv", seqs[2], payloads[2]],
            [b"", b"", END, b""],
        ]


def prompt_batches(prompts: int, blocks: int) -> tuple[list[list[object]], set[int]]:
    """Batches storing `prompts` prompts of `blocks` blocks, one block a batch chained to the
    previous one; and the keys of every block."""
    batches, keys = [], set()
    for p in range(prompts):
        tokens = [p * 1000 + t for t in range(blocks * BS)]
        keys |= set(KEYER.block_keys(tokens))
        for b in range(blocks):
            h = p * 100 + b + 1
            parent = h - 1 if b else None
            batches.append([stored_event([h], parent, tokens[b * BS : (b + 1) * BS], BS)])
    return batches, keys


def wait_first_batch(sub: VllmEventSubscriber, pub: VllmEventPublisher) -> int:
    """Publish empty batches until the subscriber has taken one in (a PUB drops what it
    sends before the subscription reaches it); returns how many were published."""
    deadline = time.monotonic() + 5
    sent = 0
    while sub.ingest.stats.batches == 0:
        assert time.monotonic() < deadline, sub.stats
        pub.publish(1.0, [])
        sent += 1
        sub.poll(50)
    return sent


@pytest.mark.parametrize("legacy", [False, True], ids=["vllm>=0.26", "vllm<=0.25"])
def test_a_node_started_late_gets_every_block_by_replay(ctx: zmq.Context, legacy: bool) -> None:
    """The node starts after the engine stored 31 of 62 blocks; the join replay brings them.
    (Before, a topic-framed replay was skipped whole: 31 of 62 advertised, silently.)"""
    batches, keys = prompt_batches(2, 31)
    cache = new_cache()
    with VllmEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, legacy_replay=legacy
    ) as pub:
        for events in batches[:31]:
            pub.publish(0.0, events)
        assert pub.replay_endpoint is not None
        ep = RankEndpoint(0, pub.endpoint, pub.replay_endpoint)
        with VllmEventSubscriber(
            VllmIngest(cache, KEYER), [ep], context=ctx, replay_timeout_ms=500
        ) as sub:
            probes = wait_first_batch(sub, pub)
            for events in batches[31:]:
                pub.publish(2.0, events)
            drain(sub, len(batches) + probes)
            assert sub.stats.recoveries[0][1:] == (0, 0)
            assert sub.stats.failed_recoveries == 0 and sub.stats.bad_replay_frames == 0
            assert sub.ingest.stats.orphans == 0
    assert snapshot(cache)[Tier.HBM] == keys and len(keys) == 62


def reopened(endpoint: str, replay: str, ctx: zmq.Context | None) -> VllmEventPublisher:
    """A publisher on the endpoints one just closed used (its replay port is free once
    ZeroMQ's own thread has closed the old socket)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return VllmEventPublisher(endpoint, replay, context=ctx)
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"{replay} still in use"
            time.sleep(0.05)


def test_a_restart_the_sequence_cannot_show_is_undone_when_the_node_is_told(
    ctx: zmq.Context,
) -> None:
    """Engine A stores 3 blocks of prompt 0. A new process B on the same endpoints stores
    prompt 1 (4 blocks) and more, all before the subscription reaches it; its first batch
    that gets through has a sequence beyond A's next one, so it reads as a gap, and the
    replay lays B's later batches on A's blocks: prompt 0 stays claimed, prompt 1 is
    missing (what a node that only reads sequences advertises). Told of the new process
    (the start time in its /metrics), the subscriber forgets A's blocks and replays B's
    from 0: prompt 1 exactly, and B's next batch applies in turn."""
    batches, _ = prompt_batches(2, 4)
    keys0 = KEYER.block_keys(list(range(3 * BS)))
    keys1 = KEYER.block_keys([1000 + t for t in range(4 * BS)])
    cache = new_cache()
    base = free_base_port(2)  # the node binds (vLLM connects to a named host), as in a lab
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    [ep] = subscriber_endpoints(endpoint, replay, [0], "127.0.0.1")
    sub = VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx)
    with VllmEventPublisher(endpoint, replay, context=ctx) as a:
        sent_by_a = wait_first_batch(sub, a) + 3
        for events in batches[:3]:
            a.publish(1.0, events)
        drain(sub, sent_by_a)
    with sub, reopened(endpoint, replay, ctx) as b:
        for events in batches[4:8] + [[]] * sent_by_a:  # B's sequence passes A's
            b.publish(2.0, events, lose=True)
        seen, gaps = sub.ingest.stats.batches, sub.stats.gaps
        deadline = time.monotonic() + 5
        while sub.ingest.stats.batches == seen:  # until one of B's gets through
            assert time.monotonic() < deadline, sub.stats
            b.publish(2.0, [])
            sub.poll(50)
        assert (sub.stats.restarts, sub.stats.gaps - gaps, sub.stats.failed_recoveries) == (0, 1, 0)
        assert snapshot(cache)[Tier.HBM] == set(keys0)  # A's blocks, B's prompt missing
        assert sub.engine_restarted() >= 4 + sent_by_a and sub.stats.engine_restarts == 1
        assert snapshot(cache)[Tier.HBM] == set(keys1)
        b.publish(3.0, [removed_event([104])])  # prompt 1's last block
        drain(sub, sub.ingest.stats.batches + 1)
        assert snapshot(cache)[Tier.HBM] == set(keys1[:3])
        assert sub.stats.failed_recoveries == 0 and sub.stats.restarts == 0


# ---- failed recoveries: warned, counted, resynced -----------------------------------------


def _withhold(replies: list[list[bytes]]) -> list[list[bytes]]:
    return []


def _end_early(replies: list[list[bytes]]) -> list[list[bytes]]:
    return [*replies[:1], replies[-1]]  # the first missing batch, then the end marker


def _break_one(replies: list[list[bytes]]) -> list[list[bytes]]:
    broken = [b"", b"", b"\x00" * 7, b"?"]  # a 7-byte sequence frame
    return [replies[0], broken, *replies[2:]]


def _begin_late(replies: list[list[bytes]]) -> list[list[bytes]]:
    return replies[1:]  # the buffer no longer holds the first missing batch


@pytest.mark.parametrize(
    ("answer", "replay", "reason", "applied", "held"),
    [
        (_withhold, True, "timeout", [0, 4], {3}),
        (None, False, "no-replay-endpoint", [0, 4], {3}),
        (_end_early, True, "incomplete", [0, 4], {3}),
        (_break_one, True, "incomplete", [0, 3, 4], {2, 3}),
        (_begin_late, True, "incomplete", [0, 2, 3, 4], {2, 3}),
    ],
    ids=["timeout", "no-replay-socket", "ends-early", "malformed-reply", "begins-late"],
)
def test_a_failed_recovery_warns_counts_and_never_overclaims(
    ctx: zmq.Context,
    engine: RawEngine,
    caplog: pytest.LogCaptureFixture,
    answer: Callable[[list[list[bytes]]], list[list[bytes]]] | None,
    replay: bool,
    reason: str,
    applied: list[int],
    held: set[int],
) -> None:
    """Batches 1-3 are lost and batch 2 removed block 0. Whatever the replay lacks, the
    rank is resynced, so block 0 is never advertised again; replayed batches are applied
    only after the last one missing, and only when they reach the gap's end."""
    if answer is not None:
        engine.answer = answer
    toks = [[b * 10 + t for t in range(BS)] for b in range(4)]
    keys = [KEYER.block_keys(t)[0] for t in toks]
    payloads = [
        encode_payload(0.0, [stored_event([10], None, toks[0], BS)], 0),  # block 0
        encode_payload(1.0, [stored_event([11], None, toks[1], BS)], 0),  # lost
        encode_payload(2.0, [removed_event([10])], 0),  # lost: block 0 is gone
        encode_payload(3.0, [stored_event([12], None, toks[2], BS)], 0),  # lost
        encode_payload(4.0, [stored_event([13], None, toks[3], BS)], 0),  # shows the gap
    ]
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint if replay else None)
    caplog.set_level(logging.WARNING, logger="catsproto.adapters.vllm_events")
    with VllmEventSubscriber(
        VllmIngest(cache, KEYER), [ep], context=ctx, replay_timeout_ms=300
    ) as sub:
        engine.wait_subscriber()
        for i, p in enumerate(payloads):
            engine.publish(p, lose=i in (1, 2, 3))
        drain(sub, len(applied))
        assert sub.stats.gaps == 1 and sub.stats.failed_recoveries == 1
        assert sub.stats.failed_by_reason[reason] == 1 and sub.stats.resyncs == 1
        assert sum(sub.stats.failed_by_reason.values()) == 1
        assert sub.stats.bad_replay_frames == int(answer is _break_one)
        assert "its blocks are forgotten" in sub.stats.last_error
        assert sub.ingest.stats.batches == len(applied)
    assert snapshot(cache)[Tier.HBM] == {keys[i] for i in held}
    # what the node holds is what the batches applied after the resync hold
    assert snapshot(cache) == reference_state([payloads[i] for i in applied[1:]])
    warnings = [r for r in caplog.records if r.name == "catsproto.adapters.vllm_events"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "rank 0:" in warnings[0].getMessage()


def test_a_timed_out_replay_does_not_answer_the_next_request(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    """Replies that arrive after the timeout must not be taken for the next request's."""
    slow: list[list[list[bytes]]] = []

    def late(replies: list[list[bytes]]) -> list[list[bytes]]:
        if not slow:
            slow.append(replies)
            time.sleep(0.4)  # past the subscriber's 200 ms
        return replies

    engine.answer = late
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    with VllmEventSubscriber(
        VllmIngest(cache, KEYER), [ep], context=ctx, replay_timeout_ms=200
    ) as sub:
        engine.wait_subscriber()
        engine.publish(encode_payload(0.0, [], 0))
        engine.publish(encode_payload(1.0, [], 0), lose=True)
        engine.publish(encode_payload(2.0, [], 0))
        drain(sub, 2)
        assert sub.stats.failed_by_reason["timeout"] == 1
        # the late answer to the first request is on its way before the next one is asked
        wait_until("the late replay answer sent", lambda: engine.answered == 1, 10)
        toks = list(range(40, 40 + BS))
        engine.publish(encode_payload(3.0, [], 0), lose=True)
        engine.publish(encode_payload(4.0, [stored_event([9], None, toks, BS)], 0))
        drain(sub, 4)
        assert sub.stats.failed_recoveries == 1 and sub.stats.recoveries[-1] == (0, 3, 3)
    assert snapshot(cache)[Tier.HBM] == set(KEYER.block_keys(toks))


def test_a_failed_recovery_shows_in_the_node_state_and_metrics(ctx: zmq.Context) -> None:
    with VllmEventPublisher("tcp://127.0.0.1:*", None, context=ctx) as pub:
        for _ in range(3):  # sent before the node exists: a gap it cannot replay
            pub.publish(0.0, [])
        node = node_agent(RankEndpoint(0, pub.endpoint, None), ctx)
        try:
            deadline = time.monotonic() + 5
            while node.subscriber.stats.frames == 0:
                assert time.monotonic() < deadline
                pub.publish(0.0, [])
                node.step(50)
            state = node.state()["subscriber"]
            assert state["failed_recoveries"] == 1 and state["resyncs"] == 1
            assert state["failed_by_reason"] == {
                "no-replay-endpoint": 1,
                "timeout": 0,
                "incomplete": 0,
            }
            assert "no replay endpoint" in state["last_error"]
            scraped = node.metrics().decode().splitlines()
            line = 'catsproto_node_failed_recoveries_total{instance="10.0.0.5",reason="%s"} %s'
            assert line % ("no-replay-endpoint", "1.0") in scraped
            assert line % ("timeout", "0.0") in scraped
        finally:
            node.close()


# ---- vLLM's own publisher ------------------------------------------------------------------

PUBLISHER_SCRIPT = Path(__file__).with_name("vllm_publisher_script.py")
ENGINE_BS = 32  # what vLLM on CPU runs with (a multiple of 32)
ENGINE_KEYER = BlockKeyer(b"s" * 32, "test/model", ENGINE_BS)


class LossyLink:
    """The network between vLLM's PUB and the node's SUB: a forwarder that loses the batches
    `lose(seq)` names. vLLM connects its PUB to a non-wildcard endpoint; the link binds it.
    Batches are forwarded only once the node's subscription has reached the link."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.lose: Callable[[int], bool] = lambda seq: False
        self.lost: list[int] = []
        self.subscribed = threading.Event()
        self.inbound = ctx.socket(zmq.SUB)
        self.inbound.setsockopt(zmq.LINGER, 0)
        self.inbound.setsockopt(zmq.SUBSCRIBE, b"")
        self.inbound.bind("tcp://127.0.0.1:*")
        self.outbound = ctx.socket(zmq.XPUB)
        self.outbound.setsockopt(zmq.LINGER, 0)
        self.outbound.bind("tcp://127.0.0.1:*")
        self.engine_endpoint = self.inbound.getsockopt_string(zmq.LAST_ENDPOINT)
        self.node_endpoint = self.outbound.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbound, zmq.POLLIN)
        poller.register(self.outbound, zmq.POLLIN)
        while self._running:
            ready = dict(poller.poll(20))
            if self.outbound in ready and self.outbound.recv()[:1] == b"\x01":
                self.subscribed.set()
            if self.inbound in ready:
                frames = self.inbound.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                if not self.subscribed.is_set() or self.lose(seq):
                    self.lost.append(seq)
                else:
                    self.outbound.send_multipart(frames)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)


class PublisherProcess:
    """tests/vllm_publisher_script.py under the engine python, one command a line."""

    def __init__(self, python: Path, endpoint: str, replay: str, log: Path) -> None:
        self._log = log.open("w")
        args = ["--endpoint", endpoint, "--replay-endpoint", replay, "--topic", "kv"]
        self.proc = subprocess.Popen(
            [str(python), str(PUBLISHER_SCRIPT), *args, "--block-size", str(ENGINE_BS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.log = log
        self.published = 0
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", 180)  # importing vllm takes seconds

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def expect(self, want: str, timeout: float = 20) -> None:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = f"nothing in {timeout} s"
        assert line == want, f"vLLM publisher said {line!r}: {self.log.read_text()[-3000:]}"

    def publish(self, n: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"publish {n}\n")
        self.proc.stdin.flush()
        self.published += n
        self.expect(f"published {self.published}")

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def expected_keys(batches: int) -> set[int]:
    keys: set[int] = set()
    for seq in range(batches):
        tokens = vllm_publisher_script.prompt_tokens(seq // 2, ENGINE_BS)
        keys |= set(ENGINE_KEYER.block_keys(tokens)[: 3 if seq % 2 else 2])
    return keys


def test_vllms_own_publisher_late_join_and_a_lost_stretch(ctx: zmq.Context, tmp_path: Path) -> None:
    """vLLM's ZmqEventPublisher (made from a KVEventsConfig, as the engine makes it) in its
    own process: the node joins after 20 batches and later loses three on the way; both
    gaps are filled by vLLM's replay (topic-framed since 0.26) and every block stored is
    in the node's cache, none more."""
    python = require_engine_python()
    link = LossyLink(ctx)
    replay = f"tcp://127.0.0.1:{free_base_port(1)}"
    engine = PublisherProcess(python, link.engine_endpoint, replay, tmp_path / "vllm.log")
    cache = TieredCache([TierSpec(Tier.HBM, 10_000, 5, 1)])
    try:
        engine.publish(20)  # the node is not running yet
        link.lose = lambda seq: seq < 20  # (the link may still carry some: not to the node)
        ep = RankEndpoint(0, link.node_endpoint, replay)
        with VllmEventSubscriber(
            VllmIngest(cache, ENGINE_KEYER), [ep], context=ctx, replay_timeout_ms=5_000
        ) as sub:
            deadline = time.monotonic() + 10
            while not link.subscribed.is_set():
                assert time.monotonic() < deadline, "the node's subscription never arrived"
                sub.poll(20)
            while sub.ingest.stats.batches == 0:  # vLLM's PUB may still be connecting
                assert time.monotonic() < deadline, (link.lost, engine.log.read_text()[-2000:])
                engine.publish(1)
                sub.poll(200)
            first = sub.stats.recoveries[0]
            assert first == (0, 0, 0), sub.stats  # the join: replay from 0
            joined = engine.published - 1  # the batch that showed the join gap
            lost = {joined + 2, joined + 3, joined + 4}
            link.lose = lambda seq: seq < 20 or seq in lost
            engine.publish(10)
            deadline = time.monotonic() + 10
            while sub.ingest.stats.batches < engine.published:
                assert time.monotonic() < deadline, sub.stats
                sub.poll(50)
            assert lost <= set(link.lost)
            assert sub.stats.gaps == 2 and sub.stats.recoveries[1][1] == joined + 2
            assert sub.stats.failed_recoveries == sub.stats.resyncs == 0
            assert sub.stats.bad_replay_frames == sub.stats.bad_payloads == 0
            assert sub.ingest.stats.orphans == 0 and sub.ingest.stats.block_size_mismatch == 0
    finally:
        engine.close()
        link.close()
    assert engine.proc.returncode == 0, engine.log.read_text()[-3000:]
    assert set(cache.lru_keys(Tier.HBM)) == expected_keys(engine.published)

"""The node's KV-event subscriber against a real vLLM engine (the session's `vllm_engine`):
a node that joins late and a node that loses batches on the way both get every block back
through the engine's replay socket; a node without one under-claims after a late join,
and says so.

Strategy. The engine is shared with other tests, so every prompt here is fresh (seeded
random token ids, checked uncached by the engine's own ``cached_tokens``) and the
expectations come from the prompts: the keys of their full blocks (`BlockKeyer`). What
the node holds is also compared with the engine's own record, its whole replay buffer
from batch 0 applied to a fresh `VllmIngest` in order: that is everything the engine still
holds, whatever other tests left in it. Batching is the engine's business (one batch may
carry several requests' events, one request's may span batches), so a test waits until
a prompt's blocks have gone by before it sends the next one, and drops whole batches.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import zmq

from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventSubscriber,
    decode_payload,
)
from catsproto.keys import BlockKeyer
from catsproto.node import TieredCache, TierSpec, VllmBlockStored, VllmIngest
from catsproto.wire import Tier
from tests.engine_helpers import EngineHandle

SECRET = bytes(range(32))
MODEL_ID = "catsproto-engine-events"
WAIT_S = 20.0  # generous: another engine or benchmark may be loading the machine
END_SEQ = b"\xff" * 8

Batch = tuple[int, bytes]  # (sequence, msgpack payload) as the engine published it
Block = tuple[int, ...]  # the token ids of one full block


# ---- the engine --------------------------------------------------------------------------


def fresh_prompt(rnd: random.Random, engine: EngineHandle, blocks: int) -> list[int]:
    """`blocks` full blocks and a partial one (which no engine stores and no key names)."""
    return [rnd.randrange(7, 1024) for _ in range(blocks * engine.block_size + 5)]


def complete(engine: EngineHandle, tokens: list[int]) -> None:
    """One completion; the engine must have computed the whole prompt (none of it cached),
    so it stores, and publishes, every full block of it."""
    body = {"model": engine.model, "prompt": tokens, "max_tokens": 1}
    req = urllib.request.Request(
        engine.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        usage = json.loads(r.read())["usage"]
    assert usage["prompt_tokens"] == len(tokens), usage
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage


def engine_history(ctx: zmq.Context, engine: EngineHandle) -> list[Batch]:
    """Every batch the engine has published, from its replay ROUTER (asked from batch 0
    on a DEALER of our own; vLLM >= 0.26 replies ``[b"", topic, seq, payload]`` and ends
    with seq -1). Its buffer keeps 10,000 batches: far more than a test session makes."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.replay)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        history: list[Batch] = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000), zmq.POLLIN), "the engine's replay went silent"
            empty, _topic, seq, payload = dealer.recv_multipart()
            assert empty == b"" and len(seq) == 8
            if seq == END_SEQ:
                break
            history.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
    assert [s for s, _ in history] == list(range(len(history))), "a hole in the engine's buffer"
    return history


def stored_blocks(batches: Iterable[Batch], block_size: int) -> set[Block]:
    """The token ids of every block the batches store."""
    blocks: set[Block] = set()
    for _, payload in batches:
        for ev in decode_payload(payload).events:
            if isinstance(ev, VllmBlockStored):
                t = ev.token_ids
                blocks.update(tuple(t[i : i + block_size]) for i in range(0, len(t), block_size))
    return blocks


def full_blocks(prompts: Iterable[list[int]], block_size: int) -> set[Block]:
    """The token ids of every full block of the prompts (what the engine will store)."""
    out: set[Block] = set()
    for p in prompts:
        out.update(
            tuple(p[i : i + block_size])
            for i in range(0, len(p) // block_size * block_size, block_size)
        )
    return out


def wait_published(ctx: zmq.Context, engine: EngineHandle, prompts: list[list[int]]) -> int:
    """Until the engine has published every full block of `prompts` (its publisher is a
    thread behind a queue: the HTTP answer may come first); returns its batches so far."""
    want = full_blocks(prompts, engine.block_size)
    deadline = time.monotonic() + WAIT_S
    while True:
        history = engine_history(ctx, engine)
        if want <= stored_blocks(history, engine.block_size):
            return len(history)
        assert time.monotonic() < deadline, "the engine never published the prompts' blocks"
        time.sleep(0.05)


# ---- the node ----------------------------------------------------------------------------


def keys_of(keyer: BlockKeyer, prompts: Iterable[list[int]]) -> set[int]:
    return {k for p in prompts for k in keyer.block_keys(p)}


def held_after(batches: Iterable[Batch], keyer: BlockKeyer) -> set[int]:
    """What a node holds that applied exactly these batches, in order, from nothing."""
    cache = new_cache()
    ingest = VllmIngest(cache, keyer)
    for _, payload in batches:
        ingest.apply_batch(decode_payload(payload))
    return held(cache)


def new_cache() -> TieredCache:
    return TieredCache([TierSpec(Tier.HBM, 100_000, 5, 1)])


def held(cache: TieredCache) -> set[int]:
    return set(cache.lru_keys(Tier.HBM))


def new_subscriber(
    ctx: zmq.Context, keyer: BlockKeyer, pub: str, replay: str | None
) -> tuple[VllmEventSubscriber, TieredCache]:
    cache = new_cache()
    endpoint = RankEndpoint(0, pub, replay)
    sub = VllmEventSubscriber(
        VllmIngest(cache, keyer), [endpoint], context=ctx, replay_timeout_ms=5_000
    )
    return sub, cache


def poll_until(sub: VllmEventSubscriber, what: str, done: Callable[[], bool]) -> None:
    """Poll until `done()`, then until nothing more arrives for 300 ms (settled)."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s ({sub.stats})"
        sub.poll(50)
    while sub.poll(300):
        pass


def send_until_heard(
    engine: EngineHandle, sub: VllmEventSubscriber, rnd: random.Random, blocks: int
) -> list[list[int]]:
    """Fresh prompts, one at a time, until the node has received a batch (its subscription
    may still be on its way to the PUB when the first one is published); returns them."""
    sent: list[list[int]] = []
    deadline = time.monotonic() + WAIT_S
    while sub.stats.frames == 0:
        assert time.monotonic() < deadline, f"the node heard no batch in {WAIT_S} s"
        sent.append(fresh_prompt(rnd, engine, blocks))
        complete(engine, sent[-1])
        waited = time.monotonic() + 3
        while sub.stats.frames == 0 and time.monotonic() < waited:
            sub.poll(50)
    return sent


# ---- (a) a late join ---------------------------------------------------------------------


def test_a_node_started_late_gets_the_earlier_blocks_by_replay(
    vllm_engine: EngineHandle, ctx: zmq.Context
) -> None:
    """Prompts A and B are stored and published before the node starts; its first batch
    (prompt C's) shows the join gap, the replay from 0 brings A and B: the node holds
    every full block of A, B and C and everything else the engine holds, after one
    recovery that worked. (Before, a topic-framed replay was skipped whole: the node
    held only what came after it joined, 31 of 62 blocks in the modelled engine.)"""
    e = vllm_engine
    keyer = BlockKeyer(SECRET, MODEL_ID, e.block_size)
    rnd = random.Random(0xA)
    start = len(engine_history(ctx, e))
    a, b = fresh_prompt(rnd, e, 4), fresh_prompt(rnd, e, 3)
    for p in (a, b):
        complete(e, p)
    before = wait_published(ctx, e, [a, b])  # in the buffer, not only on its way
    sub, cache = new_subscriber(ctx, keyer, e.events, e.replay)
    with sub:
        c = send_until_heard(e, sub, rnd, 4)
        want = keys_of(keyer, [a, b, *c])
        poll_until(sub, "A, B and C in the node", lambda: want <= held(cache))
        history = engine_history(ctx, e)
        stats = sub.stats
        assert stats.gaps == 1 and stats.recoveries == [(0, 0, 0)], stats
        assert stats.replayed >= before > 0, stats
        assert stats.failed_recoveries == stats.resyncs == stats.restarts == 0, stats
        assert stats.bad_payloads == stats.bad_replay_frames == 0, stats
        assert sub.ingest.stats.orphans == sub.ingest.stats.block_size_mismatch == 0
    assert len(want) == 4 + 3 + 4 * len(c)
    # the engine stored exactly the full blocks of A, B and C since the test began ...
    assert held_after(history[start:], keyer) == want
    # ... and the node holds them, and everything else the engine still holds, no more
    assert want <= held(cache)
    assert held(cache) == held_after(history, keyer)


# ---- (b) batches lost on the way ---------------------------------------------------------


class DroppingLink:
    """A forwarder between the engine's PUB and the node's SUB that loses whole batches
    on command: each ``[topic, seq, payload]`` that arrives while `dropping` is set is
    dropped, every other one forwarded as it came. It keeps what it passed and dropped,
    so the test knows when a prompt's blocks have gone by. Its PUB is an XPUB: `subscribed`
    is set when the node's subscription reached it."""

    def __init__(self, ctx: zmq.Context, engine_events: str, endpoint: str) -> None:
        self.endpoint = endpoint
        self.dropping = threading.Event()
        self.subscribed = threading.Event()
        self.passed: list[Batch] = []
        self.dropped: list[Batch] = []
        self._lock = threading.Lock()
        self._inbound = ctx.socket(zmq.SUB)
        self._inbound.setsockopt(zmq.LINGER, 0)
        self._inbound.setsockopt(zmq.SUBSCRIBE, b"")
        self._inbound.connect(engine_events)
        self._outbound = ctx.socket(zmq.XPUB)
        self._outbound.setsockopt(zmq.LINGER, 0)
        self._outbound.bind(endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbound, zmq.POLLIN)
        poller.register(self._outbound, zmq.POLLIN)
        while self._running:
            ready = dict(poller.poll(20))
            if self._outbound in ready and self._outbound.recv()[:1] == b"\x01":
                self.subscribed.set()
            if self._inbound in ready:
                frames = self._inbound.recv_multipart()
                batch = (int.from_bytes(frames[1], "big"), frames[2])
                drop = self.dropping.is_set()
                if not drop:
                    self._outbound.send_multipart(frames)
                with self._lock:
                    (self.dropped if drop else self.passed).append(batch)

    def seen(self) -> list[Batch]:
        with self._lock:
            return sorted(self.passed + self.dropped)

    def wait_for(self, prompts: list[list[int]], block_size: int) -> None:
        """Until every full block of `prompts` has gone by (passed or dropped)."""
        want = full_blocks(prompts, block_size)
        deadline = time.monotonic() + WAIT_S
        while not want <= stored_blocks(self.seen(), block_size):
            assert time.monotonic() < deadline, "the prompts' blocks never reached the link"
            time.sleep(0.02)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._inbound.close(linger=0)
        self._outbound.close(linger=0)


def test_batches_lost_between_engine_and_node_come_back_by_replay(
    vllm_engine: EngineHandle, ctx: zmq.Context, tmp_path: Path
) -> None:
    """Mid-stream: the link passes P1, drops every batch of P2 and P3, passes P4; P4's
    batch shows the gap and the engine's replay fills it: the node holds every full block
    of every prompt (and all the engine holds), after one more gap, recovered whole."""
    e = vllm_engine
    keyer = BlockKeyer(SECRET, MODEL_ID, e.block_size)
    rnd = random.Random(0xB)
    link = DroppingLink(ctx, e.events, f"ipc://{tmp_path}/link.sock")
    try:
        sub, cache = new_subscriber(ctx, keyer, link.endpoint, e.replay)
        with sub:
            assert link.subscribed.wait(WAIT_S), "the node's subscription never reached the link"
            # the join: whatever came before (other tests, batches the link missed while
            # it was connecting) is replayed, if anything
            sent = send_until_heard(e, sub, rnd, 2)
            poll_until(sub, "the join", lambda: keys_of(keyer, sent) <= held(cache))
            gaps, replayed = sub.stats.gaps, sub.stats.replayed
            assert sub.stats.failed_recoveries == 0, sub.stats

            p1, p2, p3, p4 = (fresh_prompt(rnd, e, n) for n in (3, 4, 2, 3))
            complete(e, p1)
            link.wait_for([p1], e.block_size)
            link.dropping.set()
            for p in (p2, p3):
                complete(e, p)
            link.wait_for([p2, p3], e.block_size)
            link.dropping.clear()
            complete(e, p4)
            link.wait_for([p4], e.block_size)
            sent += [p1, p2, p3, p4]
            want = keys_of(keyer, sent)
            poll_until(sub, "every prompt in the node", lambda: want <= held(cache))
            history = engine_history(ctx, e)
            stats = sub.stats
            lost = [s for s, _ in link.dropped]
            # the link lost P2's and P3's blocks, in one run of whole batches, and no more
            assert full_blocks([p2, p3], e.block_size) <= stored_blocks(link.dropped, e.block_size)
            assert lost == list(range(lost[0], lost[0] + len(lost))), lost
            assert not full_blocks([p1, p4], e.block_size) & stored_blocks(
                link.dropped, e.block_size
            )
            assert stats.gaps == gaps + 1 and stats.recoveries[-1] == (0, lost[0], lost[0])
            assert stats.replayed - replayed >= len(lost), (stats, lost)
            assert stats.failed_recoveries == stats.resyncs == stats.restarts == 0, stats
            assert stats.bad_payloads == stats.bad_replay_frames == 0, stats
            assert sub.ingest.stats.orphans == sub.ingest.stats.block_size_mismatch == 0
    finally:
        link.close()
    assert len(keys_of(keyer, [p1, p2, p3, p4])) == 3 + 4 + 2 + 3
    assert want <= held(cache)
    assert held(cache) == held_after(history, keyer)


# ---- (c) a late join without a replay socket ------------------------------------------------


def test_a_late_join_without_replay_is_a_logged_resync_that_under_claims(
    vllm_engine: EngineHandle, ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The same late join with no replay endpoint: the gap cannot be filled, so the node
    counts a failed recovery, logs a WARNING, resyncs and holds only what came after it
    joined (C, then D), never A or B, which the engine still holds."""
    e = vllm_engine
    keyer = BlockKeyer(SECRET, MODEL_ID, e.block_size)
    rnd = random.Random(0xC)
    a, b = fresh_prompt(rnd, e, 4), fresh_prompt(rnd, e, 3)
    for p in (a, b):
        complete(e, p)
    before = wait_published(ctx, e, [a, b])
    caplog.set_level(logging.WARNING, logger="catsproto.adapters.vllm_events")
    sub, cache = new_subscriber(ctx, keyer, e.events, None)
    with sub:
        c = send_until_heard(e, sub, rnd, 4)[-1]  # the first batch it heard is C's
        poll_until(sub, "C in the node", lambda: keys_of(keyer, [c]) <= held(cache))
        d = fresh_prompt(rnd, e, 2)  # after the resync the stream goes on as usual
        complete(e, d)
        poll_until(sub, "D in the node", lambda: keys_of(keyer, [d]) <= held(cache))
        history = engine_history(ctx, e)
        stats = sub.stats
        assert stats.gaps == 1 and stats.recoveries == [(0, 0, -1)], stats
        assert stats.failed_recoveries == stats.resyncs == 1 and stats.replayed == 0, stats
        assert stats.failed_by_reason == {"no-replay-endpoint": 1, "timeout": 0, "incomplete": 0}
        assert "its blocks are forgotten (resync)" in stats.last_error
        joined = len(history) - sub.ingest.stats.batches  # the first batch it applied
    assert joined >= before  # after A's and B's
    # it holds exactly what the batches since it joined hold: C and D, not A or B ...
    assert held(cache) == held_after(history[joined:], keyer) == keys_of(keyer, [c, d])
    engine_holds = held_after(history, keyer)
    assert keys_of(keyer, [a, b, c, d]) <= engine_holds  # ... which the engine holds:
    assert held(cache) < engine_holds  # the node under-claims, never over-claims
    warnings = [r for r in caplog.records if r.name == "catsproto.adapters.vllm_events"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "rank 0: no replay endpoint to ask for batches 0.." in warnings[0].getMessage()

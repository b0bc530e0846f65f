"""Bad input on the node's event ingest and on the KV transfer server: every malformed
field is refused with one error naming it, a refused batch changes nothing it should not,
and the daemons count what they refuse and keep serving."""

from __future__ import annotations

import math
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from catsproto.adapters.instance import NodeAgent
from catsproto.adapters.transfer_tls import ServerOptions, TransferServer, pull
from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventSubscriber,
    decode_payload,
    encode_payload,
    removed_event,
    stored_event,
)
from catsproto.node import (
    BuilderConfig,
    ComputeState,
    DampeningPolicy,
    KeyMode,
    TierSpec,
    VllmEventError,
    VllmIngest,
    parse_batch,
)
from catsproto.transfer import Puller, StoredBlock, synthetic_keys, synthetic_store
from catsproto.transfer.frames import MAX_BODY
from catsproto.wire import Tier
from tests.test_vllm_events import KEYER, RawEngine, new_cache, snapshot

BS = KEYER.block_size
TOKENS = list(range(100, 100 + 2 * BS))
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def good_stored(**fields: Any) -> dict[str, Any]:
    ev: dict[str, Any] = stored_event([1, 2], None, TOKENS, BS)
    ev.update(fields)
    return ev


def good_removed(**fields: Any) -> dict[str, Any]:
    ev: dict[str, Any] = removed_event([1])
    ev.update(fields)
    return ev


# ---- every field of every event is checked --------------------------------------------

BAD_EVENTS = [
    ("medium", good_removed(medium=[])),
    ("medium", good_stored(medium=1.5)),
    ("medium", good_stored(medium=b"GPU")),
    ("parent_block_hash", good_stored(parent_block_hash={})),
    ("parent_block_hash", good_stored(parent_block_hash=1.5)),
    ("block_hashes", good_removed(block_hashes=[{}])),
    ("block_hashes", good_stored(block_hashes=[[[1]], 2])),
    ("block_hashes", good_stored(block_hashes=[1, 2**64])),
    ("block_hashes", good_stored(block_hashes=[1, -(2**63) - 1])),
    ("block_hashes", good_stored(block_hashes=[True, 2])),
    ("block_hashes", good_stored(block_hashes=None)),
    ("token_ids", good_stored(token_ids=[*TOKENS[:-1], -1])),
    ("token_ids", good_stored(token_ids=[*TOKENS[:-1], None])),
    ("token_ids", good_stored(token_ids=[*TOKENS[:-1], []])),
    ("token_ids", good_stored(token_ids=[*TOKENS[:-1], 2**32])),
    ("token_ids", good_stored(token_ids=[*TOKENS[:-1], 1.5])),
    ("token_ids", good_stored(token_ids="abc")),
    ("block_size", good_stored(block_size=0)),
    ("block_size", good_stored(block_size=True)),
    ("block_size", good_stored(block_size=4.0)),
    ("lora_id", good_stored(lora_id="x")),
    ("lora_id", good_stored(lora_id=1.5)),
    ("lora_name", good_stored(lora_name=7)),
    ("extra_keys", good_stored(extra_keys=5)),
    ("group_idx", good_stored(group_idx=[])),
    ("group_idx", good_removed(group_idx="0")),
    ("kv_cache_spec_kind", good_stored(kv_cache_spec_kind=1)),
    ("kv_cache_spec_sliding_window", good_stored(kv_cache_spec_sliding_window="w")),
]


@pytest.mark.parametrize(
    ("name", "event"), BAD_EVENTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_EVENTS)]
)
def test_a_bad_field_is_refused_by_name(name: str, event: dict[str, Any]) -> None:
    with pytest.raises(VllmEventError, match=rf"\.{name} .* is not "):
        parse_batch([1.0, [good_stored(), event], 0])
    try:
        payload = encode_payload(1.0, [good_stored(), event], 0)
    except OverflowError:
        pass  # beyond 64 bits: msgpack cannot carry it, only a Python caller can pass it
    else:
        with pytest.raises(VllmEventError, match=rf"\.{name} .* is not "):
            decode_payload(payload)
    # the tagged-array form of vLLM <= 0.23 goes through the same checks
    names = STORED_FIELDS if event["type"] == "BlockStored" else REMOVED_FIELDS
    last = max(names.index(k) for k in event if k != "type")
    legacy = [event["type"], *(event.get(n) for n in names[: last + 1])]
    with pytest.raises(VllmEventError, match=rf"\.{name} .* is not "):
        parse_batch([1.0, [legacy], 0])


@pytest.mark.parametrize(
    "hashes",
    [[5, 2**64 - 1], [-(2**63), 3], [b"\x01" * 32, b"\x02" * 32]],
    ids=["u64", "i64", "bytes"],
)
def test_every_hash_vllm_sends_is_accepted(hashes: list[int | bytes]) -> None:
    for mode in KeyMode:
        cache = new_cache()
        ingest = VllmIngest(cache, KEYER, key_mode=mode)
        ingest.apply_batch(decode_payload(encode_payload(1.0, [good_stored(block_hashes=hashes)])))
        assert len(snapshot(cache)[Tier.HBM]) == 2


def test_bytes_hashes_key_like_vllm_int_hashes_in_engine_mode() -> None:
    as_bytes = [b"\xaa" * 24 + (7).to_bytes(8, "big"), b"\xbb" * 24 + (9).to_bytes(8, "big")]
    got = []
    for hashes in (as_bytes, [7, 9]):
        cache = new_cache()
        ingest = VllmIngest(cache, KEYER, key_mode=KeyMode.ENGINE_IDS)
        ingest.apply_batch(parse_batch([1.0, [good_stored(block_hashes=hashes)], 0]))
        got.append(snapshot(cache)[Tier.HBM])
    assert got[0] == got[1] == {KEYER.engine_key("vllm", 7), KEYER.engine_key("vllm", 9)}


@pytest.mark.parametrize("rank", [-1, 1.5, True, "0", 2**32])
def test_a_bad_rank_is_refused(rank: object) -> None:
    with pytest.raises(VllmEventError, match="data_parallel_rank"):
        parse_batch([1.0, [good_stored()], rank])


def test_an_unhashable_map_key_is_a_payload_error() -> None:
    # msgpack lets a map key be an array; Python cannot hash the list it becomes
    payload = msgpack.packb([1.0, [{(1,): 1}], 0], use_bin_type=True)
    with pytest.raises(VllmEventError, match="not msgpack"):
        decode_payload(payload)


def test_a_refused_batch_changes_nothing_in_the_ingest() -> None:
    cache = new_cache()
    ingest = VllmIngest(cache, KEYER)
    ingest.apply_batch(decode_payload(encode_payload(0.0, [good_stored()], 0)))
    before, stats = snapshot(cache), ingest.stats.batches
    # a good store first, then a removal with a bad hash: nothing of it may land
    bad = encode_payload(
        1.0, [stored_event([3], 2, list(range(BS)), BS), good_removed(block_hashes=[{}])], 0
    )
    with pytest.raises(VllmEventError):
        ingest.apply_batch(decode_payload(bad))
    assert snapshot(cache) == before and ingest.stats.batches == stats


# ---- the subscriber counts a refused batch, resyncs the rank, and goes on ---------------


def drain(sub: VllmEventSubscriber, frames: int) -> None:
    deadline = time.monotonic() + 5
    while sub.stats.frames < frames and time.monotonic() < deadline:
        sub.poll(50)
    assert sub.stats.frames == frames


BAD_PAYLOADS = [
    encode_payload(1.0, [stored_event([3], 2, list(range(BS)), BS), good_removed(medium=[])], 0),
    encode_payload(1.0, [good_stored(token_ids=[*TOKENS[:-1], -1])], 0),
    encode_payload(1.0, [good_removed(block_hashes=[[[1]]])], 0),
    msgpack.packb([1.0, [{(1,): 1}], 0], use_bin_type=True),
    b"\xc1",
]


@pytest.mark.parametrize("bad", BAD_PAYLOADS, ids=range(len(BAD_PAYLOADS)))
def test_subscriber_refuses_a_bad_batch_and_applies_the_next(
    ctx: zmq.Context, engine: RawEngine, bad: bytes
) -> None:
    cache = new_cache()
    ep = RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint)
    with VllmEventSubscriber(VllmIngest(cache, KEYER), [ep], context=ctx) as sub:
        engine.wait_subscriber()
        engine.publish(encode_payload(0.0, [good_stored()], 0))
        drain(sub, 1)
        assert len(snapshot(cache)[Tier.HBM]) == 2
        engine.publish(bad)
        drain(sub, 2)
        # refused and counted; the rank is forgotten (the batch may have removed blocks)
        assert sub.stats.bad_payloads == 1 and "batch 1 refused" in sub.stats.last_error
        assert snapshot(cache)[Tier.HBM] == set()
        assert sub.ingest.stats.rank_resets == 1
        # its sequence is consumed: the next batch applies without a replay request
        later = list(range(500, 500 + BS))
        engine.publish(encode_payload(2.0, [stored_event([40], None, later, BS)], 0))
        drain(sub, 3)
        assert sub.stats.gaps == 0 and engine.replay_requests == []
        assert snapshot(cache)[Tier.HBM] == set(KEYER.block_keys(later))


# ---- the node agent keeps building advertisements -------------------------------------


def agent(endpoint: RankEndpoint, ctx: zmq.Context) -> NodeAgent:
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


def test_node_agent_step_survives_bad_batches(ctx: zmq.Context, engine: RawEngine) -> None:
    node = agent(RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint), ctx)
    try:
        engine.wait_subscriber()
        for bad in BAD_PAYLOADS:
            engine.publish(bad)
        engine.publish(encode_payload(1.0, [good_stored()], 0))
        deadline = time.monotonic() + 5
        while node.subscriber.stats.frames < len(BAD_PAYLOADS) + 1:
            assert time.monotonic() < deadline
            node.step(50)  # raised on the first bad batch before
        assert node.subscriber.stats.bad_payloads == len(BAD_PAYLOADS)
        assert node.state()["subscriber"]["bad_payloads"] == len(BAD_PAYLOADS)
        scraped = node.metrics().decode()  # and the Prometheus scrape says so too
        line = (
            f'catsproto_node_bad_event_payloads_total{{instance="10.0.0.5"}} {len(BAD_PAYLOADS)}.0'
        )
        assert line in scraped.splitlines()
        assert node.cache.count(Tier.HBM) == 2 and node.error == ""
        assert node.builder.stats.advertisements >= 1
    finally:
        node.close()


def test_node_agent_still_builds_when_the_subscriber_fails(
    ctx: zmq.Context, engine: RawEngine
) -> None:
    node = agent(RankEndpoint(0, engine.pub_endpoint, engine.replay_endpoint), ctx)
    try:
        node.subscriber.close()  # its sockets are gone: every poll now raises
        first = node.step(0)
        assert node.ingest_errors == 1 and node.error.startswith("event ingest: ")
        assert first and node.builder.stats.advertisements == 1  # the first advertisement
    finally:
        node.close()


# ---- the transfer server --------------------------------------------------------------

XFER_KEYS = synthetic_keys(7, 12)
XFER_STORE = synthetic_store(XFER_KEYS, 40_000)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk", 0),
        ("chunk", MAX_BODY + 1),
        ("epoch", 0),
        ("epoch", -1),
        ("epoch", 1 << 64),
        ("rate_bps", -5),
        ("rate_bps", math.nan),
        ("timeout", -1.0),
        ("timeout", 0.0),
        ("timeout", math.nan),
        ("max_connections", 0),
        ("max_records", -1),
    ],
)
def test_server_options_are_checked_when_made(field: str, value: float) -> None:
    name = {"rate_bps": "rate", "timeout": "timeout"}.get(field, field)
    with pytest.raises(ValueError, match=rf"^{name} {value}"):
        ServerOptions(**{field: value})


def wait_for(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_failing_lookup_costs_one_connection_not_the_server() -> None:
    calls = []

    def lookup(key: int) -> StoredBlock | None:
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("store unavailable")
        return XFER_STORE.get(key)

    with TransferServer(None, None, lookup, options=ServerOptions(plaintext=True)) as srv:
        first = pull(srv.address, None, None, XFER_KEYS, timeout=5)
        assert first.completed is None
        wait_for(lambda: bool(srv.served and srv.served[0].error))  # "" before: thread died
        assert srv.served[0].error == "internal RuntimeError: store unavailable"
        wait_for(lambda: srv.stats.errors == 1)  # counted as the thread ends
        second = pull(srv.address, None, None, XFER_KEYS, timeout=5)
        assert second.error is None and second.completed is not None
        assert len(second.completed.blocks) == len(XFER_KEYS)
        wait_for(lambda: srv.stats.completed == 1)


def test_a_puller_that_stops_reading_is_dropped_after_the_timeout() -> None:
    keys = synthetic_keys(9, 64)
    store = synthetic_store(keys, 1 << 20)  # 64 MiB: far more than the socket buffers
    options = ServerOptions(plaintext=True, timeout=0.5)
    with TransferServer(None, None, store.get, options=options) as srv:
        stalled = socket.create_connection(srv.address, timeout=5)
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.sendall(Puller(1, keys).start())  # then never reads
            wait_for(lambda: bool(srv.served and srv.served[0].error))  # wedged before
            assert "timed out" in srv.served[0].error
            wait_for(lambda: srv.stats.errors == 1)
        finally:
            stalled.close()


def test_connections_above_the_limit_are_refused_at_once() -> None:
    options = ServerOptions(plaintext=True, timeout=10.0, max_connections=2)
    with TransferServer(None, None, XFER_STORE.get, options=options) as srv:
        idle = [socket.create_connection(srv.address, timeout=5) for _ in range(2)]
        try:
            wait_for(lambda: srv.stats.connections == 2)
            extra = socket.create_connection(srv.address, timeout=5)
            with extra:
                assert extra.recv(16) == b""  # closed by the server, nothing sent
            wait_for(lambda: srv.stats.busy == 1)
            assert srv.served[-1].error.startswith("busy: 2 connections")
        finally:
            for s in idle:
                s.close()
        # the idle ones end (closed before a PULL) and free their slots
        wait_for(lambda: srv.stats.errors == 2)
        r = pull(srv.address, None, None, XFER_KEYS, timeout=5)
        assert r.error is None and r.completed is not None


def test_finished_connections_leave_no_thread_and_bounded_records() -> None:
    options = ServerOptions(plaintext=True, max_records=3)
    with TransferServer(None, None, XFER_STORE.get, options=options) as srv:
        for _ in range(5):
            r = pull(srv.address, None, None, XFER_KEYS[:2], timeout=5)
            assert r.error is None
        wait_for(lambda: srv.stats.completed == 5)
        wait_for(lambda: not srv._threads)
        assert len(srv.served) == 3 and srv.stats.connections == 5


# ---- command-line options that used to be accepted and then break ----------------------

SECRET_HEX = "ab" * 16
SERVE = ["transfer", "serve", "--plaintext", "--listen", "127.0.0.1:0"]
INSTANCE = ["instance", "serve", "--secret", SECRET_HEX, "--port", "0"]
NODE = ["instance", "node", "--secret", SECRET_HEX, "--endpoint", "tcp://127.0.0.1:5999"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["transfer", "serve", "--plaintext", "--listen", "127.0.0.1:99999",
          "--synthetic", "7:4:1024"], "port 99999 is not 0..65535"),
        (["transfer", "pull", "--plaintext", "--from", "127.0.0.1:9", "--synthetic", "7:4",
          "--timeout", "-1"], "--timeout -1.0 is not"),
        (["transfer", "pull", "--plaintext", "--from", "127.0.0.1:9", "--synthetic", "7:4",
          "--rate", "-5"], "--rate -5 is not"),
        ([*SERVE, "--synthetic", "7:4:1024", "--rate", "-5"], "--rate -5 is not"),
        ([*SERVE, "--synthetic", "7:4:0"], "BYTES 0 is not >= 1"),
        ([*SERVE, "--synthetic", "7:4:1024", "--chunk", "0"], "--chunk 0 bytes is not"),
        ([*SERVE, "--synthetic", "7:4:1024", "--epoch", "-1"], "--epoch -1 is not"),
        (["instance", "serve", "--no-node", "--port", "99999"], "--port 99999 is not"),
        ([*INSTANCE, "--target-fpr", "2"], "--target-fpr 2.0 is not"),
        ([*INSTANCE, "--target-fpr", "nan"], "--target-fpr nan is not"),
        ([*INSTANCE, "--max-message", "100"], "does not fit --max-message 100"),
        ([*INSTANCE, "--max-message", "787"], "does not fit --max-message 787"),
        ([*INSTANCE, "--max-message", "70000"], "--max-message 70000 is not"),
        ([*INSTANCE, "--time-scale", "nan"], "--time-scale nan is not"),
        ([*INSTANCE, "--prefill-rate", "inf"], "--prefill-rate inf is not"),
        ([*INSTANCE, "--pub-endpoint", "bogus"], "--pub-endpoint 'bogus'"),
        ([*NODE, "--dp-ranks", "0"], "--dp-ranks 0 is not >= 1"),
        ([*NODE, "--dp-ranks", "-1"], "--dp-ranks -1 is not >= 1"),
    ],
)  # fmt: skip
def test_bad_options_exit_2_with_one_line(argv: list[str], says: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "catsproto", *argv], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert r.stdout == ""


def test_the_smallest_message_for_the_default_node_is_accepted() -> None:
    # 788 bytes: the empty-cache advertisement with the defaults (IPv4, one route, the
    # default model id) and the 384 bytes kept for signature and delegation
    argv = [sys.executable, "-m", "catsproto", *INSTANCE, "--max-message", "788"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 20)
        assert ready, "no line from instance serve"
        assert proc.stderr is not None
        assert '"listening"' in proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        # a clean exit (0, not killed by the signal); closing waits up to 5 s for the
        # node's thread and 5 s for the engine's worker, so allow for both
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("command", ["serve", "pull"])
def test_a_key_file_that_is_not_utf8_is_a_usage_error(command: str, tmp_path: Path) -> None:
    bad = tmp_path / "key.json"
    bad.write_bytes(b"\xc3\x28")
    bad.chmod(0o600)  # refused for what it holds, not for its mode
    rest = ["--synthetic", "7:4:1024", "--listen", "127.0.0.1:0"]
    if command == "pull":
        rest = ["--synthetic", "7:4", "--from", "127.0.0.1:9"]
    r = subprocess.run(
        [sys.executable, "-m", "catsproto", "transfer", command, "--key", str(bad),
         "--trust", str(bad), *rest],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr == f"catsproto transfer: --key {bad}: not UTF-8 text\n"

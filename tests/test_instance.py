"""The modelled instance end to end: HTTP prompts -> its cache -> vLLM events over ZMQ ->
the node's mirror -> advertisements and Prometheus metrics; and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from catsproto import wire
from catsproto.adapters.instance import EngineConfig, InstanceServer, ModelledEngine, NodeAgent
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.commands import UsageError
from catsproto.commands.instance import parse_tier
from catsproto.keys import BlockKeyer
from catsproto.node import BuilderConfig, DampeningPolicy, KeyMode, TierSpec
from catsproto.summary import SummaryReceiver
from catsproto.wire import Tier

SECRET = b"i" * 32
BS = 16
TIERS = (TierSpec(Tier.HBM, 8, 5, 1_600_000), TierSpec(Tier.DRAM, 64, 30, 400_000))
TOKEN = b"instance-test-token-0123456789"  # the tests below hold the API token
AUTH = {"Authorization": "Bearer " + TOKEN.decode()}


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json", **AUTH}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url + path, None, AUTH), timeout=10) as resp:
        return resp.read()


def start(key_mode: KeyMode = KeyMode.TOKENS) -> tuple[InstanceServer, NodeAgent]:
    engine = ModelledEngine(EngineConfig(block_size=BS, prefill_rate_tps=1e6, tiers=TIERS))
    cfg = BuilderConfig(
        cs_id=1,
        address="10.0.0.5",
        model_id="m",
        block_size=BS,
        bytes_per_block=1 << 20,
        dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
    )
    node = NodeAgent(
        cfg,
        TIERS,
        BlockKeyer(SECRET, "m", BS),
        [RankEndpoint(0, engine.publisher.endpoint, engine.publisher.replay_endpoint)],
        engine.compute_state,
        key_mode=key_mode,
        engine="mooncake" if key_mode is KeyMode.ENGINE_IDS else "vllm",
        hits=engine.hits,
    )
    return InstanceServer(engine, node, api_token=TOKEN).start(), node


@pytest.fixture
def served() -> Iterator[tuple[InstanceServer, NodeAgent]]:
    server, node = start()
    yield server, node
    server.close()


def settle(node: NodeAgent, engine: ModelledEngine) -> None:
    """Step the node until its mirror matches the engine (events are asynchronous)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        node.step(20)
        if all(node.cache.count(t) == engine.cache.count(t) for t in engine.cache.order) and (
            node.ingest.stats.batches and node.subscriber.stats.frames
        ):
            return
    raise AssertionError(f"node did not catch up: {node.state()} vs {engine.state()}")


def test_prompts_hit_their_cache_and_the_node_mirrors_it(served) -> None:  # type: ignore[no-untyped-def]
    server, node = served
    keyer = BlockKeyer(SECRET, "m", BS)
    a = list(range(1000, 1000 + 5 * BS + 3))  # five full blocks and a partial one
    status, first = post(server.url, {"prompt_token_ids": a})
    assert status == 200 and first["cached_blocks"] == 0 and first["prefill_tokens"] == len(a)
    b = a[: 3 * BS] + list(range(7000, 7000 + 2 * BS))
    status, second = post(server.url, {"prompt_token_ids": b})
    assert second["cached_blocks"] == 3 and second["cached_tokens"] == 3 * BS
    assert second["cached_blocks_by_tier"] == {"hbm": 3}
    # push the first prompt's private blocks down to DRAM
    post(server.url, {"prompt_token_ids": list(range(20_000, 20_000 + 6 * BS))})
    settle(node, server.engine)
    engine_keys = {t: server.engine.cache.count(t) for t in TIERS_ORDER}
    assert engine_keys[Tier.DRAM] > 0
    wanted = set(keyer.block_keys(a)) | set(keyer.block_keys(b))
    held = set(node.cache.lru_keys(Tier.HBM)) | set(node.cache.lru_keys(Tier.DRAM))
    assert wanted <= held  # the node re-keyed every block from the published token ids
    assert node.ingest.stats.orphans == 0

    routes = node.step(0) or list(node.latest.values())
    adv = wire.decode(wire.encode(routes[-1].advertisement))
    receiver = SummaryReceiver()
    hbm = next(e for e in adv.cache_summaries.entries if e.tier == Tier.HBM)  # type: ignore[union-attr]
    receiver.apply_entry(hbm)
    in_hbm = np.array(node.cache.lru_keys(Tier.HBM), dtype=np.uint64)
    assert receiver.contains_many(in_hbm).all()

    state = json.loads(get(server.url, "/state"))
    assert state["engine"]["hit_ratio"] > 0 and state["node"]["ingest"]["batches"] > 0
    ads = json.loads(get(server.url, "/advertisements"))
    assert ads and wire.decode(bytes.fromhex(ads[0]["value"])).origin.cs_id == 1
    metrics = get(server.url, "/metrics").decode()
    assert 'catsproto_node_blocks{instance="10.0.0.5",tier="hbm"}' in metrics
    assert "catsproto_node_advertisements_total" in metrics
    assert 'catsproto_node_block_events_total{instance="10.0.0.5",kind="stored"}' in metrics


TIERS_ORDER = [t.tier for t in TIERS]


def _strict(text: bytes) -> Any:
    """Parse `text` as strict JSON: NaN and Infinity are not JSON (RFC 8259)."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a JSON body: {text[:200]!r}")

    return json.loads(text, parse_constant=refuse)


def test_state_is_strict_json_with_null_for_never_advertised(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    state = _strict(get(server.url, "/state"))
    assert state["engine"]["last_advertised_s_ago"] is None  # nothing advertised yet
    server.engine.last_advertised = time.monotonic() - 2.0
    again = _strict(get(server.url, "/state"))
    assert 2.0 <= again["engine"]["last_advertised_s_ago"] < 60


def test_hash_ids_up_to_2_64_minus_1_are_served_and_mirrored() -> None:
    server, node = start(KeyMode.ENGINE_IDS)
    try:
        top = (1 << 64) - 1
        status, reply = post(server.url, {"hash_ids": [top, 1 << 63], "input_length": 2 * BS})
        assert status == 200, reply
        status, again = post(server.url, {"hash_ids": [top, 1 << 63], "input_length": 2 * BS})
        assert again["cached_blocks"] == 2
        status, reply = post(server.url, {"hash_ids": [1 << 64], "input_length": BS})
        assert status == 400 and "0..2^64-1" in reply["error"]
        settle(node, server.engine)  # the ids crossed the KV-event stream as u64
        keys = BlockKeyer(SECRET, "m", BS).engine_keys("mooncake", [top, 1 << 63])
        assert {int(k) for k in keys} <= set(node.cache.lru_keys(Tier.HBM))
    finally:
        server.close()


def test_bad_requests_get_400(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    assert post(server.url, {"prompt_token_ids": "x"})[0] == 400
    assert post(server.url, {"hash_ids": [1], "input_length": -1})[0] == 400
    assert post(server.url, {})[0] == 400


def test_mooncake_prompts_key_by_hash_ids() -> None:
    server, node = start(KeyMode.ENGINE_IDS)
    try:
        keyer = BlockKeyer(SECRET, "m", BS)
        status, r = post(server.url, {"hash_ids": [0, 1, 2], "input_length": 40})
        assert status == 200 and r["prefill_tokens"] == 40
        status, r = post(server.url, {"hash_ids": [0, 1, 9], "input_length": 45})
        assert r["cached_blocks"] == 2 and r["cached_tokens"] == 32 and r["prefill_tokens"] == 13
        settle(node, server.engine)
        assert set(node.cache.lru_keys(Tier.HBM)) == {
            keyer.engine_key("mooncake", i) for i in (0, 1, 2, 9)
        }
    finally:
        server.close()


def test_fcfs_queue_and_scaled_clock() -> None:
    engine = ModelledEngine(
        EngineConfig(block_size=BS, prefill_rate_tps=1000.0, time_scale=10.0, tiers=TIERS)
    )
    try:
        import threading

        results: list[dict[str, Any]] = []

        def body(k: int) -> dict[str, Any]:
            """1000 tokens (1 model s = 0.1 wall s) in 63 blocks; all share the first two."""
            return {"hash_ids": [1, 2, *range(100 * k, 100 * k + 61)], "input_length": 1000}

        threads = [
            threading.Thread(target=lambda k=k: results.append(engine.submit(body(k))))
            for k in range(1, 4)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        # the first computes everything; the others hit both blocks (32 of 1000 tokens)
        assert sorted(r["prefill_tokens"] for r in results) == [968, 968, 1000]
        assert wall > 0.25  # (1000 + 968 + 968) / 1000 / 10 s at least: served one by one
        assert max(r["queue_wall_ms"] for r in results) > 150
    finally:
        engine.close()


def test_tier_option_parsing() -> None:
    assert parse_tier("dram:10:20:30") == TierSpec(Tier.DRAM, 10, 20, 30)
    for bad in ("gpu:1:2:3", "hbm:1:2", "hbm:x:2:3", "hbm:-1:2:3"):
        with pytest.raises(UsageError):
            parse_tier(bad)


def test_cli_serve_runs_and_stops_on_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "adverts.jsonl"
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)  # a token file others may read is refused
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "catsproto",
            "instance",
            "serve",
            "--port",
            "0",
            "--secret",
            SECRET.hex(),
            "--block-size",
            "16",
            "--prefill-rate",
            "1000000",
            "--min-interval-ms",
            "0",
            "--adverts-out",
            str(out),
            "--api-token-file",
            str(token_file),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = json.loads(proc.stderr.readline())  # type: ignore[union-attr]
        url = line["listening"]
        status, _ = post(url, {"prompt_token_ids": list(range(64))})
        assert status == 200
        deadline = time.monotonic() + 30  # the events reach the node soon; a busy machine is slow
        while time.monotonic() < deadline:
            state = json.loads(get(url, "/state"))
            if state["node"]["blocks"]["hbm"] == 4 and out.exists() and out.read_text():
                break
            time.sleep(0.05)
        assert state["node"]["blocks"]["hbm"] == 4, state["node"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert rows[0]["prefix"] == "127.0.0.1/32" and rows[0]["sequence"] == 1
        wire.decode(bytes.fromhex(rows[-1]["value"]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("rest", "says"),
    [
        (
            ["serve", "--port", "0", "--adverts-out", "/nonexistent-dir/a.jsonl"],
            "--adverts-out /nonexistent-dir/a.jsonl: cannot open: No such file or directory",
        ),
        (
            ["node", "--endpoint", "tcp://127.0.0.1:1", "--adverts-out", "/nonexistent-dir/a"],
            "--adverts-out /nonexistent-dir/a: cannot open: No such file or directory",
        ),
        (
            ["serve", "--port", "0", "--host", "192.0.2.77"],
            "--host 192.0.2.77 --port 0: cannot listen: Cannot assign requested address",
        ),
    ],
)
def test_os_errors_name_the_option_and_the_address_once(rest: list[str], says: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "catsproto", "instance", *rest, "--secret", SECRET.hex()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"catsproto instance {rest[0]}: {says}\n"


def test_max_message_help_says_what_is_accepted() -> None:
    from catsproto.cli import build_parser
    from catsproto.commands.instance import _builder_config

    for command in ("serve", "node"):
        r = subprocess.run(
            [sys.executable, "-m", "catsproto", "instance", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        text = " ".join(r.stdout.split())
        assert "--max-message MAX_MESSAGE largest BGP message in bytes, 1..65535," in text
    args = build_parser().parse_args(["instance", "serve", "--max-message", "70000"])
    with pytest.raises(UsageError, match=r"--max-message 70000 is not 1..65535"):
        _builder_config(args, [])


def test_the_dampening_thresholds_reach_the_builder_and_bad_ones_are_refused() -> None:
    """--score-threshold and --wait-threshold-ms (the draft's score and queue-wait
    triggers) reach the builder's dampening policy; a wait threshold of 0 or NaN is a
    usage error naming it."""
    from catsproto.cli import build_parser
    from catsproto.commands.instance import _builder_config

    args = build_parser().parse_args(
        ["instance", "serve", "--score-threshold", "11", "--wait-threshold-ms", "500"]
    )
    policy = _builder_config(args, [TierSpec(Tier.HBM, 64, 0, 1000)]).dampening
    assert (policy.score_threshold, policy.wait_threshold_ms) == (11, 500.0)
    for bad in ("0", "-5", "nan"):
        args = build_parser().parse_args(["instance", "serve", "--wait-threshold-ms", bad])
        with pytest.raises(UsageError, match="wait_threshold_ms"):
            _builder_config(args, [TierSpec(Tier.HBM, 64, 0, 1000)])

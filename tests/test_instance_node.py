"""`catsproto instance node`, the command a vLLM user runs next to the engine: its
options, its ready line, its HTTP face, and what it learns from a real engine (its KV
events and its /metrics: block size, KV blocks, queue, prefill rate)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catsproto import wire
from catsproto.adapters.node_http import NodeServer
from catsproto.adapters.vllm_metrics import EngineScraper, scrape
from catsproto.cli import build_parser
from catsproto.keys import BlockKeyer
from catsproto.summary import SummaryReceiver
from catsproto.wire import Tier
from tests.engine_helpers import EngineHandle
from tests.waits import wait_until

SECRET = "ab" * 16
MODEL_ID = "catsproto-node-test"
TOKEN = "node-test-token-0123456789abcdef"


# ---- the engine ------------------------------------------------------------------------


def complete(engine: EngineHandle, tokens: list[int], max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": engine.model, "prompt": tokens, "max_tokens": max_tokens}
    if max_tokens > 1:
        body["ignore_eos"] = True
    req = urllib.request.Request(
        engine.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def fresh_prompt(n: int) -> list[int]:
    """Token ids no other test sends: a cold prompt for the engine's prefix cache."""
    rnd = random.Random()
    return [rnd.randrange(1024) for _ in range(n)]


# ---- helpers -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)  # a token file others may read is refused
    return path


def http(url: str, token: str | None = TOKEN) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, None, headers), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def state(url: str) -> dict[str, Any]:
    status, body = http(url + "/state")
    assert status == 200, body
    return json.loads(body)


NODE = [sys.executable, "-m", "catsproto", "instance", "node", "--secret", SECRET]


class Node:
    """`catsproto instance node` as a subprocess; `ready` is its JSON line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*NODE, "--model-id", MODEL_ID, *args],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self.proc.stderr.readline()  # type: ignore[union-attr]
        try:
            self.ready = json.loads(line)
        except ValueError:
            self.stop()
            raise AssertionError(f"no ready line: {line!r}{self.proc.stderr.read()}") from None  # type: ignore[union-attr]
        self.url = self.ready["listening"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stderr.close()  # type: ignore[union-attr]


def run_node(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NODE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


# ---- options and help ------------------------------------------------------------------


def test_the_defaults_are_vllms_and_the_help_shows_both_sides() -> None:
    args = build_parser().parse_args(["instance", "node", "--secret", SECRET])
    assert args.endpoint == "tcp://*:5557"  # vLLM's KVEventsConfig default
    assert args.replay_endpoint is None  # vLLM has none unless asked
    assert (args.port, args.engine_url, args.engine_wait, args.scrape_interval) == (
        8101,
        None,
        300.0,
        1.0,
    )
    assert args.block_size is None  # taken from the engine, or 16 without one
    r = subprocess.run(
        [*NODE[:-2], "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    text = r.stdout
    assert '--kv-events-config \'{"enable_kv_cache_events": true' in text
    assert '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567"' in text
    assert "--endpoint 'tcp://*:5557'" in text and "--replay-endpoint 'tcp://*:5567'" in text
    assert "--engine-url http://127.0.0.1:8000" in text
    flat = " ".join(text.split())
    assert "(5557 and 5567 serve up to ten ranks)" in flat


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--engine-url", "ftp://127.0.0.1:1"], "--engine-url ftp://127.0.0.1:1: expected http"),
        (["--engine-url", "http://127.0.0.1:8000/metrics"], "give the engine's base URL"),
        (["--engine-url", "http://127.0.0.1:x"], "--engine-url http://127.0.0.1:x: "),
        (["--scrape-interval", "0"], "--scrape-interval 0.0 is not a positive number"),
        (["--scrape-interval", "nan"], "--scrape-interval nan is not a positive number"),
        (["--engine-wait", "-1"], "--engine-wait -1.0 is not a number"),
        (["--health-interval", "0"], "--health-interval 0.0 is not a positive number"),
        (["--health-interval", "inf"], "--health-interval inf is not a positive number"),
        (["--down-after", "0"], "--down-after 0 is not >= 1"),
        (["--port", "70000"], "--port 70000 is not 0..65535"),
        (["--block-size", "0"], "--block-size 0 is not >= 1"),
    ],
)
def test_bad_options_exit_2_naming_them(extra: list[str], says: str) -> None:
    r = run_node("--endpoint", f"tcp://127.0.0.1:{free_port()}", *extra)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("catsproto instance node: ") and says in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_a_short_token_file_and_a_taken_port_are_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    short.chmod(0o600)
    r = run_node("--api-token-file", str(short))
    assert r.returncode == 2 and "--api-token-file: API token file" in r.stderr, r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_node("--port", str(port), "--engine-url", "http://127.0.0.1:9")
    assert r.returncode == 2
    assert r.stderr == (
        f"catsproto instance node: --host 127.0.0.1 --port {port}: cannot listen: "
        "Address already in use\n"
    )


# ---- the HTTP face, without an engine --------------------------------------------------


def test_without_an_engine_the_node_serves_its_configuration(token_file: Path) -> None:
    events, replay = free_port(), free_port()
    node = Node(
        "--endpoint",
        f"tcp://*:{events}",
        "--replay-endpoint",
        f"tcp://*:{replay}",
        "--port",
        "0",
        "--api-token-file",
        str(token_file),
    )
    try:
        assert node.ready == {
            "listening": node.url,
            "kv_events": [f"tcp://127.0.0.1:{events}"],
            "replay": [f"tcp://127.0.0.1:{replay}"],
            "node_binds": False,
            "engine": None,
            "block_size": 16,
            "capacity_blocks": {"hbm": 2048, "dram": 16384},
            "prefill_rate_tps": 8000.0,
            "prefill_rate": "configured",
            "signing_key_id": None,  # unsigned: no --signing-key, --group-key, --spool
            "group_key_id": None,
            "spool": None,
        }
        assert http(node.url + "/health", None) == (
            200,
            b'{"ok": true, "ready": true, "unauthorised": 0}',
        )
        for path in ("/state", "/advertisements", "/metrics"):
            status, _ = http(node.url + path, "wrong-token-0123456789")
            assert status == 401
        assert json.loads(http(node.url + "/health", None)[1])["unauthorised"] == 3
        s = state(node.url)
        assert s["engine"] is None and s["http"]["unauthorised"] == 3
        assert s["node"]["blocks"] == {"hbm": 0, "dram": 0}
        for key in ("gaps", "resyncs", "bad_payloads"):
            assert s["node"]["subscriber"][key] == 0
        status, body = http(node.url + "/metrics")
        assert status == 200 and b'catsproto_node_capacity_blocks{instance="127.0.0.1"' in body
        assert b"catsproto_node_engine_scrapes_total" not in body
        assert http(node.url + "/nothing")[0] == 404
    finally:
        assert node.stop() == 0


def test_the_views_need_a_token_and_wait_for_the_node() -> None:
    """In process: no token configured -> the views are refused (403); with one, before
    the node runs they answer 503 naming what it waits for; /health is open throughout."""
    open_server = NodeServer(port=0).start()
    try:
        for path in ("/state", "/advertisements", "/metrics"):
            status, body = http(open_server.url + path)
            assert status == 403 and b"start the node with --api-token-file" in body
    finally:
        open_server.close()
    server = NodeServer(
        port=0, api_token=TOKEN.encode(), waiting_for="its engine at http://e:1"
    ).start()
    try:
        assert json.loads(http(server.url + "/health", None)[1])["ready"] is False
        status, body = http(server.url + "/state")
        assert status == 503
        assert json.loads(body) == {"error": "the node is waiting for its engine at http://e:1"}
    finally:
        server.close()


def test_an_engine_that_never_answers_is_named_after_the_wait(token_file: Path) -> None:
    engine = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = run_node("--engine-url", engine, "--engine-wait", "0.5", "--port", "0")
    assert r.returncode == 2
    assert r.stderr.startswith(
        f"catsproto instance node: the engine at {engine} did not serve usable metrics "
        "within 0.5 s (last: "
    ), r.stderr
    assert time.monotonic() - t0 < 30
    # while it waits, its HTTP face is up (not ready), and SIGTERM ends the wait cleanly
    port = free_port()
    proc = subprocess.Popen(
        [*NODE, "--engine-url", engine, "--port", str(port), "--api-token-file", str(token_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def health() -> Any:
            try:
                return json.loads(http(f"http://127.0.0.1:{port}/health", None)[1])
            except OSError:
                return None

        assert wait_until("the waiting node's /health", health, 30)["ready"] is False
        status, body = http(f"http://127.0.0.1:{port}/state")
        assert status == 503 and engine.encode() in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stderr.read() == ""  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()  # type: ignore[union-attr]


# ---- against the real engine -----------------------------------------------------------


def test_a_block_size_or_hbm_capacity_unlike_the_engines_is_refused(
    vllm_engine: EngineHandle,
) -> None:
    e = vllm_engine
    other = 16 if e.block_size != 16 else 64
    r = run_node("--engine-url", e.url, "--block-size", str(other), "--endpoint", e.events)
    assert r.returncode == 2
    assert r.stderr == (
        f"catsproto instance node: --block-size {other} differs from the engine's block size "
        f"{e.block_size} (vllm:cache_config_info at {e.url}/metrics): the node would key no "
        "block the engine publishes; leave --block-size out (the node takes the engine's) or "
        "start vLLM with the same --block-size\n"
    )
    r = run_node("--engine-url", e.url, "--tier", "hbm:2048:5:1600000", "--endpoint", e.events)
    assert r.returncode == 2
    assert (
        f"--tier hbm capacity 2048 blocks differs from the engine's {e.num_gpu_blocks} "
        f"(num_gpu_blocks at {e.url}/metrics): write --tier hbm:{e.num_gpu_blocks}:5:1600000"
    ) in r.stderr


def test_the_engine_gives_the_node_its_block_size_and_capacity(vllm_engine: EngineHandle) -> None:
    """The engine's block size and KV blocks replace the node's defaults (16 tokens,
    2,048 + 16,384 blocks); a --tier for another medium is kept; the same --block-size
    as the engine's is accepted."""
    e = vllm_engine
    node = Node(
        "--engine-url",
        e.url + "/",
        "--endpoint",
        e.events,
        "--port",
        "0",
        "--block-size",
        str(e.block_size),
        "--tier",
        f"hbm:{e.num_gpu_blocks}:7:800000",
        "--tier",
        "dram:100:30:400000",
    )
    try:
        assert node.ready["engine"] == e.url
        assert node.ready["block_size"] == e.block_size
        assert node.ready["capacity_blocks"] == {"hbm": e.num_gpu_blocks, "dram": 100}
        assert node.ready["kv_events"] == [e.events] and node.ready["replay"] == [None]
    finally:
        assert node.stop() == 0


def test_the_node_follows_a_real_engine(
    vllm_engine: EngineHandle, token_file: Path, tmp_path
) -> None:
    """End to end: a prompt sent to the engine reaches the node as KV events, keyed with
    the engine's block size, and goes out in the node's advertisements; /state shows the
    engine's scraped metrics and /metrics the scrapes."""
    e = vllm_engine
    adverts = tmp_path / "adverts.jsonl"
    node = Node(
        "--engine-url",
        e.url,
        "--endpoint",
        e.events,
        "--replay-endpoint",
        e.replay,
        "--port",
        "0",
        "--api-token-file",
        str(token_file),
        "--scrape-interval",
        "0.2",
        "--min-interval-ms",
        "0",
        "--change-threshold",
        "0",
        "--adverts-out",
        str(adverts),
    )
    try:
        assert node.ready["block_size"] == e.block_size
        assert node.ready["capacity_blocks"] == {"hbm": e.num_gpu_blocks}
        assert node.ready["replay"] == [e.replay]
        before = state(node.url)["engine"]["metrics"]["prompt_tokens_total"]
        prompt = fresh_prompt(5 * e.block_size + 7)
        usage = complete(e, prompt)["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        keyer = BlockKeyer(bytes.fromhex(SECRET), MODEL_ID, e.block_size)
        keys = np.array(keyer.block_keys(prompt), dtype=np.uint64)
        assert len(keys) == 5

        def advertised() -> bool:
            receiver = SummaryReceiver()
            lines = adverts.read_text().splitlines() if adverts.exists() else []
            for line in lines:
                adv = wire.decode(bytes.fromhex(json.loads(line)["value"]))
                for entry in adv.cache_summaries.entries:  # type: ignore[union-attr]
                    if entry.tier == Tier.HBM:
                        receiver.apply_entry(entry)
            return bool(lines) and bool(receiver.contains_many(keys).all())

        wait_until("the prompt's blocks in the node's advertisements", advertised, 15)
        s = wait_until(
            "a scrape after the prompt",
            lambda: (
                (
                    (got := state(node.url))["engine"]["metrics"]["prompt_tokens_total"]
                    >= before + len(prompt)
                )
                and got
            ),
        )
        assert s["node"]["blocks"]["hbm"] >= 5
        assert s["node"]["subscriber"]["bad_payloads"] == 0
        engine = s["engine"]
        assert engine["url"] == e.url and engine["scrape_failures"] == 0
        assert engine["metrics"]["block_size"] == e.block_size
        assert engine["metrics"]["num_gpu_blocks"] == e.num_gpu_blocks
        assert engine["prefill_rate"]["tps"] == engine["compute_state"]["prefill_rate_tps"]
        status, body = http(node.url + "/metrics")
        assert status == 200
        ok = next(
            line
            for line in body.decode().splitlines()
            if line.startswith('catsproto_node_engine_scrapes_total{outcome="ok"}')
        )
        assert float(ok.split()[-1]) >= 2
        capacity = 'catsproto_node_capacity_blocks{instance="127.0.0.1",tier="hbm"}'
        assert f"{capacity} {float(e.num_gpu_blocks)}" in body.decode()
        status, body = http(node.url + "/advertisements")
        assert status == 200 and json.loads(body)[0]["prefix"] == "127.0.0.1/32"
    finally:
        assert node.stop() == 0


def test_a_restarted_engine_is_known_at_the_first_scrape(
    token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A real engine of its own (not the session's: this one is killed and started
    again on the same ports): a prompt leaves blocks at the node; the engine is killed
    (the node withdraws after its /health probes fail) and a new process starts. At the
    first scrape the node counts the restart and holds nothing of the old process' blocks
    before the new one has served anything; one prompt to the new engine brings blocks
    back.

    The node's own count of the restart (`subscriber.engine_restarts`) is read: it moves
    under the node's lock together with the forgetting, so one /state shows both or
    neither. The scraper's count (`engine.restarts`) moves just before it tells the node,
    and /state reads the node first, so a /state between the two could show the
    scraper's count with the old blocks (issue 41: the node used to forget only at its
    next round, which left that window open for a round; now it forgets before the
    scraper's call returns)."""
    from catsproto.lab.engine import EngineSpec, LocalEngine
    from tests.engine_helpers import require_engine_python

    python = require_engine_python()
    d = tmp_path_factory.mktemp("restart")
    spec = EngineSpec(host="127.0.0.1", port=free_port(), ipc_dir=d)
    handle = EngineHandle.of(spec)
    engine = LocalEngine(spec, d / "first.log", python=python)
    node = None
    last: dict[str, Any] = {}

    def seen() -> dict[str, Any]:
        s = last.get("state") or {}
        return {
            "blocks": s.get("node", {}).get("blocks"),
            "node_restarts": s.get("node", {}).get("subscriber", {}).get("engine_restarts"),
            "engine": {k: (s.get("engine") or {}).get(k) for k in ("restarts", "last_error")},
        }

    def node_state() -> dict[str, Any]:
        assert node is not None
        last["state"] = state(node.url)
        return last["state"]

    try:
        engine.wait_ready()
        node = Node(
            "--engine-url", spec.url, "--endpoint", spec.events, "--replay-endpoint",
            spec.replay, "--port", "0", "--api-token-file", str(token_file),
            "--scrape-interval", "0.2", "--health-interval", "0.5",
        )  # fmt: skip
        complete(handle, fresh_prompt(10 * spec.block_size))
        wait_until(
            "the first engine's blocks", lambda: node_state()["node"]["blocks"]["hbm"], seen=seen
        )
        assert node_state()["engine"]["restarts"] == 0
        engine.close()
        engine = LocalEngine(spec, d / "second.log", python=python)
        engine.wait_ready()
        s = wait_until(
            "the node told of the restart",
            lambda: (x := node_state())["node"]["subscriber"]["engine_restarts"] and x,
            30,
            seen=seen,
        )
        assert s["node"]["blocks"]["hbm"] == 0 and s["node"]["subscriber"]["engine_restarts"] == 1
        assert s["engine"]["restarts"] == 1
        complete(handle, fresh_prompt(10 * spec.block_size))
        wait_until(
            "the new engine's blocks", lambda: node_state()["node"]["blocks"]["hbm"], seen=seen
        )
    finally:
        if node is not None:
            assert node.stop() == 0
        engine.close()


def test_the_prefill_rate_and_queue_are_measured_on_the_real_engine(
    vllm_engine: EngineHandle,
) -> None:
    """In process, the scraper against the engine: cold prompts close a measuring window
    (the rate is the engine's, not the configured 1 token/s), and a burst larger than the
    KV cache leaves requests waiting, which the node prices as outstanding prefill."""
    e = vllm_engine
    first = scrape(e.url)
    assert (first.block_size, first.num_gpu_blocks) == (e.block_size, e.num_gpu_blocks)
    scraper = EngineScraper(e.url, first, 1.0, min_tokens=1024)
    windows = scraper.rate.windows
    for _ in range(3):
        complete(e, fresh_prompt(20 * e.block_size))  # 640 cold tokens each with 32
    assert wait_until(
        "a scrape that closes a window",
        lambda: scraper.scrape_once() and scraper.rate.windows > windows,
    )
    assert scraper.rate.measured and 100 < scraper.rate.tps < 1e8
    assert scraper.compute_state().prefill_rate_tps == scraper.rate.tps

    # a third of the KV cache per prompt (at most the model's 4,096 positions, less one
    # for the output): about three run at once and the rest wait
    length = min(4000, e.block_size * e.num_gpu_blocks // 3)
    burst = [threading.Thread(target=complete, args=(e, fresh_prompt(length), 8)) for _ in range(8)]
    for t in burst:
        t.start()
    try:
        queued = None
        while any(t.is_alive() for t in burst) and queued is None:
            if scraper.scrape_once():
                now = scraper.compute_state()
                if now.waiting > 0 and now.running > 0:
                    queued, per_request = now, scraper.rate.tokens_per_request
    finally:
        for t in burst:
            t.join(timeout=120)
    assert queued is not None, "no scrape saw requests waiting behind running ones"
    assert per_request is not None and per_request > 0
    # the waiting ones whole, the running ones with half a prefill left
    expected = (queued.waiting + queued.running / 2) * per_request
    assert queued.outstanding_prefill_tokens == round(expected)
    assert queued.wait_ms > 0 and queued.utilisation == 1.0 and queued.kv_utilisation > 0
    assert scraper.failures == 0

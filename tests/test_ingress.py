"""The OpenAI ingress in front of a real vLLM engine, steered by a RIB that a real C-SMA
builds from that engine's KV events; the official `openai` client as the caller.

The RIB is built as the steering tests build theirs (a receiver's rib.json, routes
signed as the lab signs them), but its content comes from a `NodeAgent` subscribed to the
engine's events, keyed in the ingress's key space: what the ingress expects is what the
engine told its C-SMA, and the engine's own usage report checks it."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from catsproto import security, wire
from catsproto.adapters.ingress import IngressService, ModelSpec, ServedModel, load_models
from catsproto.adapters.ingress_http import IngressServer
from catsproto.adapters.instance import NodeAgent
from catsproto.adapters.steering import SteeringConfig
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.keys import BlockKeyer
from catsproto.node import BuilderConfig, ComputeState, DampeningPolicy, RouteAdvertisement
from catsproto.node.cache import TierSpec
from catsproto.summary import KIND_EXACT
from catsproto.wire import Tier
from tests.waits import wait_until

SECRET = b"catsproto-ingress-tests-secret-1"
SECRET_ID = 7
CS_ID = 100
API_TOKEN = "a-token-for-the-ingress-tests"
SIGNER = security.SigningKey.from_seed(hashlib.sha256(b"catsproto-tests/ingress").digest())


class RibWriter:
    """The receiver's rib.json, from a C-SMA's routes: latest signed value per prefix."""

    def __init__(self, path: Path, origin: str) -> None:
        self.path = path
        self.origin = origin
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()
        self.writes = 0

    def publish(self, routes: list[RouteAdvertisement]) -> None:
        with self.lock:
            for r in routes:
                adv = security.sign(r.advertisement, SIGNER, r.prefix)
                self.values[str(r.prefix)] = wire.encode(adv).hex()
            doc = {
                "sessions": {},
                "routes": [
                    {
                        "peer": "127.0.0.2",
                        "prefix": prefix,
                        "origin": self.origin,
                        "cs_id": CS_ID,
                        "value": value,
                        "verified": True,
                        "received_at": time.time(),
                    }
                    for prefix, value in sorted(self.values.items())
                ],
            }
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
            self.writes += 1


@dataclass
class Front:
    """The ingress under test: the service, a server with a token and one without."""

    service: IngressService
    server: IngressServer
    open_server: IngressServer
    agent: NodeAgent
    engine: object
    dead_port: int
    paced: PacedEngine

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.url + "/v1", api_key=API_TOKEN, max_retries=0, **kw
        )

    def model(self, name: str | None = None) -> ServedModel:
        return self.service.models[name or self.engine.served_model_name]

    def totals(self, name: str | None = None) -> dict:
        return self.service.ground_truth()[name or self.engine.served_model_name]["total"]


def steering_config(rib_file: Path, engine) -> SteeringConfig:
    """The ingress at site 1 ("e1"), the engine on the same host: no graph, no routes."""
    return SteeringConfig(
        ingress="e1",
        rib_file=str(rib_file),
        links=(),
        sites={1: "e1"},
        next_hops={},
        secret=SECRET,
        secret_id=SECRET_ID,
        model_id=engine.served_model_name,
        block_size=engine.block_size,
        instance_port=engine.port,
    )


def c_sma(engine, rib: RibWriter) -> NodeAgent:
    """A real C-SMA on the engine's KV events, keying as the ingress does, announcing
    every change at once with exact summaries (no false positives to allow for)."""
    keyer = BlockKeyer(SECRET, engine.served_model_name, engine.block_size)
    return NodeAgent(
        BuilderConfig(
            cs_id=CS_ID,
            address=engine.host,
            model_id=engine.served_model_name,
            block_size=engine.block_size,
            secret_id=SECRET_ID,
            bytes_per_block=engine.block_size * 4096,
            site_id=1,
            summary_kind=KIND_EXACT,
            snapshot_every=1,  # each route's value stands alone in rib.json
            shard_range="10.255.7.0/24",  # an exact list of 512 keys needs a few routes
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=2_000, change_threshold=0),
        ),
        [TierSpec(Tier.HBM, 512, 0, 1_600_000)],
        keyer,
        [RankEndpoint(0, engine.events, engine.replay)],
        lambda: ComputeState(prefill_rate_tps=8_000.0),  # the tiny model on 2 cores
        on_routes=rib.publish,
        poll_ms=10,
    ).start()


def read_request(conn: socket.socket) -> bytes:
    """One HTTP request off `conn` (head and a Content-Length body); its body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += conn.recv(65536)
    return body


class DyingEngine:
    """A peer that answers like an engine, then dies mid-answer: a stream's head and one
    event, or a JSON answer's head and ten of its bytes, then the connection is cut."""

    STREAM_EVENT = (
        b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
    )

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                body = read_request(conn)
                if json.loads(body).get("stream"):
                    chunk = b"%x\r\n%s\r\n" % (len(self.STREAM_EVENT), self.STREAM_EVENT)
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n" + chunk
                    )
                else:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b'content-length: 1000\r\n\r\n{"id": "x",'
                    )

    def close(self) -> None:
        self.sock.close()


class PacedEngine:
    """A peer that streams one event, then waits until the test says the client has it
    (or 20 s), then the second event and the end: an ingress that held events back until
    the end of the stream would show the client nothing before the wait runs out."""

    EVENT = DyingEngine.STREAM_EVENT
    DONE = b"data: [DONE]\n\n"

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.client_has_first = threading.Event()
        self.second_sent = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                read_request(conn)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + self._chunk(self.EVENT)
                )
                self.client_has_first.wait(20)
                self.second_sent.set()
                conn.sendall(self._chunk(self.EVENT) + self._chunk(self.DONE) + b"0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def front(vllm_engine, tmp_path_factory) -> Iterator[Front]:
    d = tmp_path_factory.mktemp("ingress")
    rib = RibWriter(d / "rib.json", vllm_engine.host)
    agent = c_sma(vllm_engine, rib)
    wait_until("the C-SMA's first advertisement", lambda: rib.writes, 30, seen=agent.state)
    config = steering_config(rib.path, vllm_engine)
    dead = closed_port()
    dying = DyingEngine()
    paced = PacedEngine()
    models = load_models(
        [
            ModelSpec(vllm_engine.served_model_name, CS_ID, vllm_engine.model_dir),
            ModelSpec("dead-engine", CS_ID, vllm_engine.model_dir, dead),
            ModelSpec("no-instance", 999, vllm_engine.model_dir),
            ModelSpec("dying-engine", CS_ID, vllm_engine.model_dir, dying.port),
            ModelSpec("paced-engine", CS_ID, vllm_engine.model_dir, paced.port),
        ],
        config,
        install_routes=False,
        grace_ms=5_000,
    )
    service = IngressService(models)
    server = IngressServer(
        service, api_token=API_TOKEN.encode(), install_routes=False, max_body=256 << 10
    ).start()
    open_server = IngressServer(service, install_routes=False).start()
    try:
        yield Front(service, server, open_server, agent, vllm_engine, dead, paced)
    finally:
        server.close()
        open_server.close()
        agent.close()
        dying.close()
        paced.close()


def fresh_text(words: int = 150) -> str:
    """A prompt no earlier request shares a block with (random first words)."""
    return f"{secrets.token_hex(8)} " + " ".join(
        secrets.choice(["kv", "block", "cache", "route", "steer", "prefix", "token", "bgp"])
        for _ in range(words)
    )


def fresh_prompt_with_a_tail(front: Front, words: int = 150) -> tuple[str, int]:
    """A fresh prompt whose last block is partial, and its token count. With the engine on
    the ingress's host every term of the estimate but the prefill is 0, so a prompt of
    whole blocks, all cached, is estimated at exactly 0 ms (one prompt in 32 by chance)."""
    while True:
        prompt = fresh_text(words)
        n = len(front.model().tokenizer.completion_ids(prompt))
        if n % front.engine.block_size:
            return prompt, n


def wait_advertised(front: Front, body: dict, path: str, blocks: int, timeout=30.0) -> None:
    """Until the selector, fed by the C-SMA's advertisements, expects `blocks` cached."""
    raw = json.dumps(body).encode()
    claimed: list[int] = [-1]

    def enough() -> bool:
        steered = front.service.decide(front.service.prepare(path, raw), install=False)
        claimed.append(steered.expected_blocks)
        return claimed[-1] >= blocks

    wait_until(
        f"the RIB claims {blocks} blocks of the prompt",
        enough,
        timeout,
        seen=lambda: f"{claimed[-1]} blocks claimed; the C-SMA: {front.agent.state()}",
    )


# ---- completions and chat, not streamed ------------------------------------------------


def test_the_second_identical_completion_is_served_from_cache_as_the_selector_expected(front):
    client = front.client()
    model = front.engine.served_model_name
    prompt, n = fresh_prompt_with_a_tail(front)
    full = n // front.engine.block_size
    assert full >= 3
    before = front.totals()

    first = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
    assert first.headers["x-catsproto-expected-cached-blocks"] == "0"
    assert first.headers["x-catsproto-instance"] == front.engine.host
    done = first.parse()
    assert done.usage.prompt_tokens == n
    assert done.usage.prompt_tokens_details.cached_tokens == 0

    wait_advertised(front, {"model": model, "prompt": prompt}, "/v1/completions", full)
    second = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
    assert second.headers["x-catsproto-expected-cached-blocks"] == str(full)
    assert float(second.headers["x-catsproto-estimated-ttft-ms"]) > 0  # the tail's prefill
    assert float(second.headers["x-catsproto-decision-ms"]) >= 0
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    servable = (n - 1) // front.engine.block_size
    assert cached == servable * front.engine.block_size  # vLLM recomputes the last token

    after = front.totals()
    assert after["requests"] - before["requests"] == 2
    assert after["confirmable_blocks"] - before["confirmable_blocks"] == servable
    assert after["confirmed_blocks"] - before["confirmed_blocks"] == servable
    assert after["missed_blocks"] == before["missed_blocks"]
    assert after["agreement"] >= 0.99


def test_a_chat_is_keyed_through_its_template_and_confirmed_by_the_engine(front):
    client = front.client()
    model = front.engine.served_model_name
    messages = [
        {"role": "system", "content": fresh_text(30)},
        {"role": "user", "content": [{"type": "text", "text": fresh_text(40)}]},
    ]
    ids = front.model().tokenizer.chat_ids(messages)
    full = len(ids) // front.engine.block_size
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == len(ids)  # the engine's count is the ingress's
    wait_advertised(front, {"model": model, "messages": messages}, "/v1/chat/completions", full)
    before = front.totals()
    second = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=2
    )
    assert second.headers["x-catsproto-expected-cached-blocks"] == str(full)
    servable = (len(ids) - 1) // front.engine.block_size
    assert second.parse().usage.prompt_tokens_details.cached_tokens == servable * 32
    after = front.totals()
    assert after["confirmed_blocks"] - before["confirmed_blocks"] == servable
    assert after["confirmable_blocks"] - before["confirmable_blocks"] == servable


def test_the_models_list_is_the_configured_models(front):
    listed = front.client().models.list()
    assert [m.id for m in listed.data] == [
        front.engine.served_model_name,
        "dead-engine",
        "no-instance",
        "dying-engine",
        "paced-engine",
    ]
    assert all(m.owned_by == "catsproto" and m.object == "model" for m in listed.data)


# ---- streams ----------------------------------------------------------------------------


def _engine_stream(engine, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        engine.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = r.read().split(b"\n\n")
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def _shape(chunks: list[dict]) -> tuple:
    """What a stream looks like, its generated text and ids aside: the first chunk's
    fields, the set of the middle chunks' (a busy engine may merge tokens into fewer
    chunks), the last chunk's, and whether any carries usage."""

    def one(c: dict) -> tuple:
        return (
            tuple(sorted(c)),
            tuple((ch.get("index"), ch.get("finish_reason") is not None) for ch in c["choices"]),
        )

    return (
        one(chunks[0]),
        {one(c) for c in chunks[1:-1]},
        one(chunks[-1]),
        any("usage" in c for c in chunks),
    )


def test_a_stream_without_usage_reaches_the_client_as_the_engine_sends_it(front):
    """The ingress asks for usage and drops that chunk: the client sees the stream it
    asked for, system_fingerprint where vLLM puts it, and the ground truth is taken."""
    model = front.engine.served_model_name
    messages = [{"role": "user", "content": fresh_text(50)}]
    body = {"model": model, "messages": messages, "max_tokens": 3, "stream": True}
    direct = _engine_stream(front.engine, "/v1/chat/completions", body)
    before = front.totals()
    stream = front.client().chat.completions.create(
        model=model, messages=messages, max_tokens=3, stream=True
    )
    chunks = [c.model_dump(exclude_unset=True) for c in stream]
    assert _shape(chunks) == _shape(direct)
    assert not any("usage" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["system_fingerprint"].startswith("vllm-")
    after = front.totals()
    assert after["requests"] == before["requests"] + 1  # the dropped usage was recorded


def test_a_stream_that_asks_for_usage_gets_it_and_a_cached_second_one_agrees(front):
    client = front.client()
    model = front.engine.served_model_name
    prompt = fresh_text()
    n = len(front.model().tokenizer.completion_ids(prompt))
    kw = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
    first = list(client.completions.create(**kw, stream_options={"include_usage": True}))
    assert first[-1].usage.prompt_tokens == n and first[-1].choices == []
    wait_advertised(front, {"model": model, "prompt": prompt}, "/v1/completions", n // 32)
    before = front.totals()
    with client.completions.with_streaming_response.create(
        **kw, stream_options={"include_usage": True}
    ) as resp:
        assert resp.headers["x-catsproto-expected-cached-blocks"] == str(n // 32)
        assert resp.headers["content-type"].startswith("text/event-stream")
        second = list(resp.parse())
    assert second[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 32 * 32
    after = front.totals()
    assert after["confirmed_blocks"] - before["confirmed_blocks"] == (n - 1) // 32
    assert after["agreement"] >= 0.99


def test_stream_chunks_arrive_as_the_engine_sends_them(front):
    """Flushed per event: the client has the first event while the engine still holds
    back the second (it sends it only once the client has the first)."""
    stream = front.client().completions.create(
        model="paced-engine", prompt="hello", max_tokens=2, stream=True
    )
    texts = []
    for chunk in stream:
        if not texts:  # the first event, through the ingress
            assert not front.paced.second_sent.is_set()
            front.paced.client_has_first.set()
        texts.append(chunk.choices[0].text)
    assert texts == ["a", "a"]
    assert front.paced.second_sent.is_set()


def test_a_real_engines_stream_comes_through_whole(front):
    """The real engine's 200 tokens come through as a stream of events (a busy engine may
    put several tokens in one)."""
    stream = front.client().completions.create(
        model=front.engine.served_model_name,
        prompt=fresh_text(20),
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert sum(1 for chunk in stream if chunk.choices) >= 100


# ---- errors, OpenAI-shaped --------------------------------------------------------------


def _post(url: str, body: bytes, token: str | None = API_TOKEN, **headers) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **headers}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, body, h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _is_openai_error(body: dict) -> bool:
    return isinstance(body.get("error"), dict) and set(body["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"model": "catsproto-tiny"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "catsproto-tiny", "prompt": ["a", "b"]}', 400, "prompt"),
        ("/v1/completions", b'{"model": "catsproto-tiny", "prompt": [1, -1]}', 400, "prompt"),
        (
            "/v1/completions",
            b'{"model": "catsproto-tiny", "prompt": "x", "stream": "yes"}',
            400,
            "stream",
        ),
        ("/v1/chat/completions", b'{"model": "catsproto-tiny", "messages": []}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"model": "catsproto-tiny", "messages": [{"role": "user", "content": 5}]}',
            400,
            "messages",
        ),
        ("/v1/embeddings", b"{}", 404, None),
    ],
)
def test_bad_requests_get_openai_errors_and_change_nothing(front, path, body, status, param):
    before = front.totals()
    got, answer = _post(front.server.url + path, body)
    assert got == status and _is_openai_error(answer), answer
    assert answer["error"]["param"] == param
    assert front.totals() == before


def test_the_openai_client_sees_its_own_error_classes(front):
    client = front.client()
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=front.engine.served_model_name, prompt=["a", "b"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=front.server.url + "/v1", api_key="wrong-token-0000000", max_retries=0
        ).models.list()


def test_no_token_or_a_wrong_one_is_401_and_health_stays_open(front):
    status, answer = _post(front.server.url + "/v1/completions", b"{}", token=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, answer = _post(front.server.url + "/v1/completions", b"{}", token="x" * 20)
    assert status == 401 and _is_openai_error(answer)
    with urllib.request.urlopen(front.server.url + "/health", timeout=10) as r:
        assert json.loads(r.read())["ok"]  # open, and says no more without the token
    req = urllib.request.Request(
        front.server.url + "/health", headers={"Authorization": f"Bearer {API_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        health = json.loads(r.read())
    assert health["ok"] and health["unauthorised"] >= 2


def test_a_body_over_the_limit_is_413(front):
    big = json.dumps({"model": front.engine.served_model_name, "prompt": "x" * (300 << 10)})
    status, answer = _post(front.server.url + "/v1/completions", big.encode())
    assert status == 413 and _is_openai_error(answer)


def test_an_unreachable_engine_is_502_and_no_instance_is_503(front):
    client = front.client()
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="dead-engine", prompt="hello", max_tokens=1)
    assert exc.value.status_code == 502
    assert exc.value.body["code"] == "engine_unreachable"
    assert str(front.dead_port) in exc.value.body["message"]
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="no-instance", prompt="hello", max_tokens=1)
    assert exc.value.status_code == 503 and exc.value.body["code"] == "no_instance"
    # and the ingress serves on
    ok = client.completions.create(
        model=front.engine.served_model_name, prompt="after", max_tokens=1
    )
    assert ok.choices


def test_an_engine_that_dies_mid_answer_gives_a_clean_502(front):
    client = front.client()
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="dying-engine", prompt="hello", max_tokens=5)
    assert exc.value.status_code == 502 and "died mid-answer" in exc.value.body["message"]
    assert exc.value.body["code"] == "engine_died"


def test_a_stream_whose_engine_dies_ends_with_an_sse_error_event(front):
    """The head and the first event went out already: the client gets that event, then
    an OpenAI error event, then the end of the stream; the ingress serves on."""
    stream = front.client().completions.create(
        model="dying-engine", prompt="hello", max_tokens=5, stream=True
    )
    got = []
    with pytest.raises(openai.APIError, match="died mid-stream"):
        for chunk in stream:
            got.append(chunk.choices[0].text)
    assert got == ["a"]
    # the raw stream: the event as sent, then the error event
    req = urllib.request.Request(
        front.server.url + "/v1/completions",
        json.dumps({"model": "dying-engine", "prompt": "x", "stream": True}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        events = r.read().split(b"\n\n")
    assert events[0] + b"\n\n" == DyingEngine.STREAM_EVENT
    error = json.loads(events[1][len(b"data: ") :])
    assert _is_openai_error(error) and error["error"]["code"] == "engine_died"
    ok = front.client().completions.create(
        model=front.engine.served_model_name, prompt="still here", max_tokens=1
    )
    assert ok.choices


def test_the_engines_own_errors_go_back_unchanged(front):
    """A request the ingress can steer but the engine refuses (max_tokens over the
    context): vLLM's answer, status and body, reaches the client as it is."""
    client = front.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=front.engine.served_model_name, prompt="x", max_tokens=10**6
        )
    assert exc.value.status_code == 400
    assert "max_tokens" in json.dumps(exc.value.body) or "context" in json.dumps(exc.value.body)


# ---- the token rule and metrics -----------------------------------------------------------


def test_without_a_token_nothing_tells_where_a_prompt_went_and_metrics_are_refused(front):
    """A guessed prompt, asked twice without a token: the second is served from the
    engine's cache, and neither answer says where it went or what was cached."""
    client = openai.OpenAI(base_url=front.open_server.url + "/v1", api_key="none", max_retries=0)
    model = front.engine.served_model_name
    prompt, n = fresh_prompt_with_a_tail(front, 60)
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    wait_advertised(front, {"model": model, "prompt": prompt}, "/v1/completions", n // 32)
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1)
    assert not [h for h in raw.headers if h.lower().startswith("x-catsproto-")], raw.headers
    answer = raw.parse()
    assert answer.usage.prompt_tokens == n and answer.usage.prompt_tokens_details is None
    assert answer.system_fingerprint is None
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(front.open_server.url + "/metrics", timeout=10)
    assert exc.value.code == 403


def test_metrics_count_requests_decisions_errors_and_ground_truth(front):
    client = front.client()
    client.completions.create(model=front.engine.served_model_name, prompt="m", max_tokens=1)
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model="dead-engine", prompt="m", max_tokens=1)
    req = urllib.request.Request(
        front.server.url + "/metrics", headers={"Authorization": f"Bearer {API_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    model = front.engine.served_model_name
    for line in (
        f'catsproto_ingress_requests_total{{endpoint="/v1/completions",model="{model}",status="200"}}',
        'catsproto_ingress_proxy_errors_total{kind="unreachable",model="dead-engine"}',
        f'catsproto_ingress_decisions_total{{instance="{front.engine.host}",model="{model}"}}',
        f'catsproto_ingress_groundtruth_agreement{{model="{model}",origin="total"}}',
        f'catsproto_ingress_groundtruth_blocks_total{{model="{model}",origin="total",outcome="confirmed"}}',
        f'catsproto_ingress_decision_seconds_bucket{{le="0.001",model="{model}"}}',
        f'catsproto_ingress_upstream_seconds_count{{model="{model}"}}',
    ):
        assert line in text, line

"""`ingress serve` as an attacker meets it (issue 41, rows 6 to 10): idle connections by
the hundred, a request smuggled in a chunked body, a guessed prompt and the headers
that would say where it is cached, a prompt of megabytes, a Content-Length of Unicode
digits, a client that stops reading. A real `IngressServer` on loopback with the lab's
tokenizer, a RIB written as the receiver writes it (one instance, 127.0.0.1), and a
small HTTP peer in the engine's place that answers in vLLM's shapes: no real engine is
needed for what is refused before one would be asked."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from catsproto.adapters.ingress import IngressService, ModelSpec, load_models
from catsproto.adapters.ingress_http import IngressServer
from catsproto.adapters.transfer_server import handshake_source
from catsproto.lab.engine import MODEL_DIR
from catsproto.node import AdvertisementBuilder, BuilderConfig, ComputeState, DampeningPolicy
from catsproto.node.cache import TieredCache, TierSpec
from catsproto.summary import KIND_EXACT
from catsproto.wire import Tier
from tests.test_ingress import CS_ID, RibWriter, steering_config
from tests.waits import wait_until

TOKEN = "a-token-for-the-attack-tests-0123"
MODEL = "catsproto-tiny"
BLOCK = 32
FINGERPRINT = "vllm-0.32.0-abcdef"
CACHED = 64  # what the peer says it had cached of every prompt


def compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()  # as vLLM writes its JSON


def completion(stream: bool) -> list[bytes]:
    """What the peer answers, in vLLM's shapes: a JSON completion with usage details
    and a fingerprint, or the stream of a request with include_usage."""
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 1,
        "total_tokens": 101,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    if not stream:
        body = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
            "usage": usage,
            "system_fingerprint": FINGERPRINT,
        }
        return [compact(body)]
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    return [
        b"data: " + compact({**chunk, "choices": [{"index": 0, "text": "a"}]}),
        b"data: "
        + compact({**chunk, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
        b"data: "
        + compact({**chunk, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT}),
        b"data: [DONE]",
    ]


class PeerEngine:
    """An HTTP peer in a vLLM engine's place: `completion()` for every POST, or with
    `huge` a JSON answer of that many bytes (for a client that will not read it)."""

    def __init__(self, huge: int = 0) -> None:
        self.requests = 0
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def do_POST(self) -> None:
                peer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if huge:
                    data = b'{"pad": "' + b"x" * huge + b'"}'
                    self._head("application/json", len(data))
                    with contextlib.suppress(OSError):
                        self.wfile.write(data)
                    return
                if not body.get("stream"):
                    (data,) = completion(False)
                    self._head("application/json", len(data))
                    self.wfile.write(data)
                    return
                self._head("text/event-stream", None)
                for event in completion(True):
                    data = event + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")

            def _head(self, kind: str, length: int | None) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                if length is None:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(length))
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Ingress:
    service: IngressService
    server: IngressServer  # with the API token
    open_server: IngressServer  # without one
    peer: PeerEngine


def rib_of_one_instance(path) -> RibWriter:
    """rib.json with one instance, 127.0.0.1 at site 1, as its C-SMA advertises it."""
    builder = AdvertisementBuilder(
        BuilderConfig(
            cs_id=CS_ID,
            address="127.0.0.1",
            model_id=MODEL,
            block_size=BLOCK,
            secret_id=7,
            bytes_per_block=BLOCK * 4096,
            site_id=1,
            summary_kind=KIND_EXACT,
            snapshot_every=1,
            shard_range="10.255.9.0/24",
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=10**9, change_threshold=0),
        ),
        TieredCache([TierSpec(Tier.HBM, 512, 0, 1_600_000)]),
        epoch=1,
    )
    rib = RibWriter(path, "127.0.0.1")
    rib.publish(builder.poll(int(time.time() * 1000), ComputeState(prefill_rate_tps=8_000.0)))
    return rib


@pytest.fixture
def ingress(tmp_path) -> Iterator[Ingress]:
    peer = PeerEngine()
    huge = PeerEngine(huge=16 << 20)
    rib = rib_of_one_instance(tmp_path / "rib.json")
    engine = SimpleNamespace(served_model_name=MODEL, block_size=BLOCK, port=peer.port)
    models = load_models(
        [
            ModelSpec(MODEL, CS_ID, MODEL_DIR),
            ModelSpec("huge-answer", CS_ID, MODEL_DIR, huge.port),
            ModelSpec("dead-engine", CS_ID, MODEL_DIR, closed_port()),
        ],
        steering_config(rib.path, engine),
        install_routes=False,
    )
    service = IngressService(models)
    kw = {"install_routes": False, "max_handlers": 8, "read_timeout": 2.0}
    server = IngressServer(service, api_token=TOKEN.encode(), **kw).start()
    open_server = IngressServer(service, **kw).start()
    try:
        yield Ingress(service, server, open_server, peer)
    finally:
        server.close()
        open_server.close()
        peer.close()
        huge.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address(server: IngressServer) -> tuple[str, int]:
    host, port = server.httpd.server_address[:2]
    return host, port


def get(server: IngressServer, path: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(server.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post(
    server: IngressServer, body: dict | bytes, token: str | None = TOKEN
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(server.url + "/v1/completions", data, headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def raw_exchange(server: IngressServer, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data` on one connection; all the server sends until it closes."""
    with socket.create_connection(address(server), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                out += chunk
    return out


def idle_from(server: IngressServer, source: str) -> socket.socket:
    """A connection from `source` (any 127/8 address is this host's) that sends nothing."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(address(server))
    return sock


def closed_by_server(sock: socket.socket, within: float = 0.05) -> bool:
    """The server closed `sock` (or does within `within` seconds)."""
    try:
        sock.settimeout(within)
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


# ---- row 6: idle connections do not lock anybody out ---------------------------------------


def test_idle_connections_from_many_sources_cannot_lock_out_health_or_a_token_holder(ingress):
    srv = ingress.server
    # every handler taken by a connection that sends nothing, two from each of four sources
    idle = [idle_from(srv, f"127.0.0.{2 + i // 2}") for i in range(8)]
    try:
        wait_until(
            "all 8 handlers held by idle connections",
            lambda: srv.in_service == 8 and srv.waiting == 8,
            seen=lambda: (srv.in_service, srv.waiting),
        )
        status, models = get(srv, "/v1/models", TOKEN)
        assert status == 200 and [m["id"] for m in models["data"]] == [
            MODEL,
            "huge-answer",
            "dead-engine",
        ]
        wait_until("the token holder's connection ended", lambda: srv.in_service == 7)
        idle.append(idle_from(srv, "127.0.0.6"))  # all taken again
        wait_until("all 8 handlers held again", lambda: srv.waiting == 8)
        status, health = get(srv, "/health")
        assert status == 200 and health["ok"]
        # each newcomer evicted the oldest idle connection of all
        assert srv.stats.evicted == 2 and srv.stats.busy_refused == 0
        assert closed_by_server(idle[0], 5) and closed_by_server(idle[1], 5)
        assert not any(closed_by_server(s) for s in idle[2:])
    finally:
        for s in idle:
            s.close()


def test_one_source_keeps_only_its_share_of_connections_waiting_for_a_head(ingress):
    srv = ingress.server  # 8 handlers: a source's share is 2
    idle = []
    try:
        for _ in range(6):
            idle.append(idle_from(srv, "127.0.0.2"))
        wait_until(
            "the source's oldest four evicted",
            lambda: srv.stats.evicted == 4 and srv.waiting == 2,
            seen=lambda: (srv.stats.to_json(), srv.waiting),
        )
        assert all(closed_by_server(s, 5) for s in idle[:4])
        assert not any(closed_by_server(s) for s in idle[4:])
        # another source is not pushed out by it
        other = idle_from(srv, "127.0.0.3")
        idle.append(other)
        wait_until("the other source waiting too", lambda: srv.waiting == 3)
        assert not closed_by_server(other) and srv.stats.evicted == 4
    finally:
        for s in idle:
            s.close()


def test_an_ipv6_source_is_counted_by_its_64():
    assert handshake_source("2001:db8:1:2::1") == handshake_source("2001:db8:1:2:ffff::9")
    assert handshake_source("2001:db8:1:2::1") != handshake_source("2001:db8:1:3::1")
    assert handshake_source("::ffff:192.0.2.7") == "192.0.2.7"


def test_connections_serving_requests_are_not_evicted_and_a_newcomer_gets_503(ingress):
    srv = ingress.server
    held = []
    try:
        for n in range(1, 9):  # heads in, bodies not sent: in service, not evictable
            held.append(socket.create_connection(address(srv), timeout=5))
            held[-1].sendall(
                b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer "
                + TOKEN.encode()
                + b"\r\nContent-Length: 50\r\n\r\n"
            )
            wait_until(
                f"request {n}'s head read",
                lambda n=n: srv.in_service == n and srv.waiting == 0,
                seen=lambda: (srv.in_service, srv.waiting),
            )
        reply = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply
        assert srv.stats.evicted == 0
    finally:
        for s in held:
            s.close()


# ---- row 7: no request smuggled in a body ------------------------------------------------------


SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "framing, status",
    [
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400),
        (b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400),
        (b"Transfer-Encoding: chunked\r\n", 411),
        (b"Transfer-Encoding: gzip, chunked\r\n", 411),
        (b"Content-Length: 5\r\nContent-Length: 5\r\n", 400),
    ],
)
def test_a_request_with_unclear_framing_is_refused_and_its_connection_closed(
    ingress, framing, status
):
    chunked = b'5\r\n{"a":\r\n0\r\n\r\n' + SMUGGLED
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
    reply = raw_exchange(ingress.server, head + b"\r\n" + framing + b"\r\n" + chunked)
    assert reply.startswith(b"HTTP/1.1 %d" % status), reply[:100]
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the GET in the body was never served
    assert b"Connection: close" in reply
    error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "bad_framing" and "Content-Length" in error["message"]
    assert ingress.service.internal_errors == 0 and ingress.peer.requests == 0
    assert ingress.server.stats.bad_framing == 1


# ---- row 8: a caller without a token learns nothing of where a prompt is cached -----------


def test_without_a_token_no_header_or_body_tells_where_or_whether_a_prompt_is_cached(ingress):
    body = {"model": MODEL, "prompt": "a guessed prompt", "max_tokens": 1}
    status, headers, raw = post(ingress.open_server, body, token=None)
    assert status == 200
    assert not [h for h in headers if h.startswith("x-catsproto-")], headers
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens_details"] is None
    assert answer["system_fingerprint"] is None
    assert answer["choices"][0]["text"] == "a" and answer["usage"]["prompt_tokens"] == 100
    # a token holder is told all of it, and the answer unchanged
    status, headers, raw = post(ingress.server, body)
    assert headers["x-catsproto-instance"] == "127.0.0.1"
    assert {"x-catsproto-site", "x-catsproto-expected-cached-blocks"} <= set(headers)
    assert json.loads(raw) == json.loads(completion(False)[0])


def test_without_a_token_a_stream_carries_no_cache_detail_or_fingerprint(ingress):
    body = {
        "model": MODEL,
        "prompt": "a guessed prompt",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = post(ingress.open_server, body, token=None)
    assert status == 200 and not [h for h in headers if h.startswith("x-catsproto-")]
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) == 3 and events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens_details"] is None
    assert all(e.get("system_fingerprint") is None for e in events)
    assert raw.endswith(b"data: [DONE]\n\n")
    # without include_usage, the ingress's own usage chunk is dropped and no fingerprint
    # is put back on the finishing chunk
    status, _, raw = post(ingress.open_server, {**body, "stream_options": None}, token=None)
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) == 2 and all("system_fingerprint" not in e for e in events)
    # the ground truth was still taken from both
    totals = ingress.service.ground_truth()[MODEL]["total"]
    assert totals["requests"] == 2


def test_without_a_token_an_engine_failure_does_not_name_the_engine(ingress):
    body = {"model": "dead-engine", "prompt": "a guessed prompt"}
    status, _, raw = post(ingress.open_server, body, token=None)
    error = json.loads(raw)["error"]
    assert status == 502 and error["code"] == "engine_unreachable"
    assert error["message"].startswith("the chosen engine unreachable")
    assert "127.0.0.1" not in error["message"]
    status, _, raw = post(ingress.server, body)  # a token holder is told which
    assert status == 502 and "engine 127.0.0.1:" in json.loads(raw)["error"]["message"]


def test_health_without_the_token_says_only_that_the_ingress_is_up(ingress):
    status, health = get(ingress.server, "/health")
    assert status == 200 and health["ok"] is True
    assert set(health) == {"ok", "withheld"} and MODEL not in json.dumps(health)
    status, health = get(ingress.server, "/health", TOKEN)
    assert health["models"] == [MODEL, "huge-answer", "dead-engine"] and "http" in health
    status, health = get(ingress.open_server, "/health")
    assert set(health) == {"ok", "withheld"}


# ---- row 9: a prompt over the context is refused before it is tokenized ----------------------


def test_a_text_prompt_of_megabytes_is_refused_by_its_size_before_tokenizing(ingress):
    tokenizer = ingress.service.models[MODEL].tokenizer
    assert tokenizer.max_tokens == 4096  # the model directory's max_position_embeddings
    bound = tokenizer.max_tokens * tokenizer.max_token_bytes
    text = "hello world " * ((4 << 20) // 12 - 10)
    status, _, raw = post(ingress.server, {"model": MODEL, "prompt": text})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    # refused by the byte bound, not by a token count
    assert f"{len(text)} bytes of text are more than 4096 tokens" in error["message"]
    assert len(text) > bound and ingress.peer.requests == 0
    assert ingress.service.internal_errors == 0


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "a b " * 3000}, "over the model's context of 4096 tokens"),
        ({"prompt": list(range(5000))}, "5000 token ids, over the model's context"),
        ({"prompt": [[*range(4097)]]}, "4097 token ids"),
    ],
)
def test_a_prompt_over_the_context_is_refused_naming_the_numbers(ingress, body, words):
    status, _, raw = post(ingress.server, {"model": MODEL, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert words in error["message"] and ingress.peer.requests == 0


def test_a_chat_over_the_context_is_refused_before_tokenizing(ingress):
    tokenizer = ingress.service.models[MODEL].tokenizer
    messages = [{"role": "user", "content": "x" * (tokenizer.max_tokens * 17)}]
    req = urllib.request.Request(
        ingress.server.url + "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": messages}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=20)
    error = json.loads(exc.value.read())["error"]
    assert exc.value.code == 400 and error["param"] == "messages"
    assert "bytes of text are more than 4096 tokens" in error["message"]


def test_a_prompt_that_fits_the_context_is_served(ingress):
    status, _, _ = post(ingress.server, {"model": MODEL, "prompt": list(range(4096))})
    assert status == 200 and ingress.peer.requests == 1


# ---- row 10: odd lengths, a client that stops reading ---------------------------------------


@pytest.mark.parametrize("length", [b"\xb2", b"\xd9\xa3", b"1_0", b"+5", b"0x10"])
def test_a_content_length_of_other_digits_is_a_400_not_an_internal_error(ingress, length):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nContent-Length: "
        + length
        + b"\r\n\r\n{}"
    )
    reply = raw_exchange(ingress.server, head)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
    assert "not a byte count" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert ingress.service.internal_errors == 0
    assert get(ingress.server, "/health")[0] == 200


def test_a_client_that_stops_reading_is_counted_disconnected_not_an_internal_error(ingress):
    body = json.dumps({"model": "huge-answer", "prompt": "x"}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(address(ingress.server))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        # the ingress gives up once a send waits its read timeout (2 s) and closes
        labels = {"model": "huge-answer", "endpoint": "/v1/completions"}

        def counted(status: str) -> float | None:
            return ingress.service.registry.get_sample_value(
                "catsproto_ingress_requests_total", {**labels, "status": status}
            )

        wait_until(
            "the request counted disconnected",
            lambda: counted("disconnected") == 1,
            30,
            seen=lambda: (counted("disconnected"), counted("500"), ingress.service.internal_errors),
        )
    finally:
        sock.close()
    assert ingress.service.internal_errors == 0

"""The HTTP APIs (steering daemon, modelled instance) under hostile clients: bodies that
would expand into gigabytes, deep nesting, clients that trickle or never finish, more
connections than handlers, and callers using /decide to ask whether a guessed prompt is
cached. Real servers, real sockets on loopback; bad bytes sent as they are."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import socket
import time
import urllib.request

import numpy as np
import pytest

from catsproto.adapters import http, steering
from catsproto.adapters.instance import (
    EngineConfig,
    InstanceServer,
    ModelledEngine,
    mooncake_block_keys,
    mooncake_tokens,
)
from catsproto.adapters.steering import (
    PUBLIC_FIELDS,
    Forwarder,
    SteeringConfig,
    SteeringServer,
    SteeringService,
    post_json,
)
from catsproto.keys import BlockKeyer
from catsproto.lab import instances
from tests.test_steering import NEXT_HOPS, _config, _rib_json
from tests.waits import wait_until

TOKEN = b"t0k3n-for-the-hostile-tests-0123456789"
RIGHT_GUESS = {"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)}  # cached at site 3


def _service(tmp_path, **config: object) -> SteeringService:
    rib = tmp_path / "rib.json"
    rib.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    cfg = dataclasses.replace(_config(str(rib)), **config)
    return SteeringService(cfg, Forwarder(NEXT_HOPS, dry_run=True))


@pytest.fixture
def service(tmp_path):
    return _service(tmp_path)


@pytest.fixture
def server(service):
    srv = SteeringServer(service, read_timeout=1.0).start()
    try:
        yield srv
    finally:
        srv.close()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _raw(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes as they are; everything the server answers until it closes (or stops
    sending for `timeout`)."""
    with socket.create_connection(_address(url), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # a server that answers first may close first
            sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if _complete(out):
                    break
        except TimeoutError:
            pass
    return out


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _body(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def _post(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + headers
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


# ---- hash_ids: counted before anything is expanded or keyed ---------------------------


@pytest.mark.parametrize("block_size", [1, 16, 512])
def test_hash_ids_keyed_one_block_at_a_time_give_the_same_keys(block_size):
    keyer = BlockKeyer(instances.DEMO_SECRET, instances.MODEL, block_size)
    rng = random.Random(block_size)
    ids = [0, 1, (1 << 63) - 1, (1 << 31) - 1, 1 << 31, 1 << 40]
    ids += [rng.randrange(1 << 63) for _ in range(40)]
    expanded = [t for h in ids for t in mooncake_tokens(h, block_size)]
    got = mooncake_block_keys(keyer, ids)
    assert got.dtype == np.uint64
    assert [int(k) for k in got] == keyer.block_keys(expanded)
    assert mooncake_block_keys(keyer, []).size == 0


def test_the_service_keys_hash_ids_as_the_instance_does(service):
    ids = [7, 8, 9, 1 << 50]
    request = service.request({"cs_id": 100, "hash_ids": ids, "input_length": 2048})
    bs = service.config.block_size
    expected = service.keyer.block_keys([t for h in ids for t in mooncake_tokens(h, bs)])
    assert [int(k) for k in request.block_keys] == expected


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("hash_ids", list(range(9)), "hash_ids: 9 ids, over the limit of 8 blocks"),
        ("block_keys", list(range(9)), "block_keys: 9 keys, over the limit of 8"),
        ("prompt_token_ids", list(range(9 * 512)), "4608 tokens are 9 blocks, over the limit"),
    ],
)
def test_a_prompt_over_the_block_limit_is_a_400_naming_it(tmp_path, field, value, words):
    service = _service(tmp_path, max_blocks=8)
    srv = SteeringServer(service).start()
    try:
        body = {"cs_id": 100, field: value, "input_length": 10, "prompt_tokens": 10}
        status, answer = post_json(srv.url + "/decide", body)
        assert status == 400 and words in answer["error"], answer
        assert service.decisions == 0 and service.bad_requests == 1
        # the limit itself is allowed
        status, _ = post_json(srv.url + "/decide", {**body, field: value[: 8 * len(value) // 9]})
        assert status == 200
    finally:
        srv.close()


def test_the_default_limit_refuses_a_body_that_used_to_expand_to_gigabytes(server, service):
    # 65,537 hash ids (131 kB of JSON) were 33.5 million Python ints before being keyed
    n = steering.DEFAULT_MAX_BLOCKS + 1
    status, answer = post_json(
        server.url + "/decide", {"cs_id": 100, "hash_ids": [0] * n, "input_length": 1}
    )
    assert status == 400 and f"{n} ids, over the limit of {n - 1} blocks" in answer["error"]
    assert service.block_limit == n - 1


def test_the_block_limit_never_exceeds_a_whole_prompt_of_blocks(tmp_path):
    service = _service(tmp_path, block_size=1 << 31)
    assert service.block_limit == steering.MAX_PROMPT_TOKENS // (1 << 31) == 1
    with pytest.raises(steering.SteeringError, match="2 ids, over the limit of 1 blocks"):
        service.request({"cs_id": 100, "hash_ids": [1, 2], "input_length": 1})


@pytest.mark.parametrize("bad", [0, -1, "8", True, 2.0])
def test_a_bad_max_blocks_is_refused_at_start(tmp_path, bad):
    config = _config(str(tmp_path / "rib.json"))
    with pytest.raises(ValueError, match="max_blocks"):
        SteeringConfig.from_json({**config.to_json(), "max_blocks": bad})
    path = tmp_path / "steering.json"
    path.write_text(json.dumps({**config.to_json(), "max_blocks": bad}))
    with pytest.raises(SystemExit) as exc:
        steering.main(["--config", str(path)])
    assert exc.value.code == 2


def test_max_blocks_round_trips_through_the_config(tmp_path):
    config = dataclasses.replace(_config(str(tmp_path / "rib.json")), max_blocks=300)
    assert SteeringConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


# ---- deep nesting ------------------------------------------------------------------


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deeply_nested_json_is_a_400_not_a_500(server, opener):
    reply = _raw(server.url, _post("/decide", opener * 100_000))
    assert _status(reply) == 400 and "nest deeper" in _body(reply)["error"]
    health = _health(server.url)
    assert health["internal_errors"] == 0 and health["bad_requests"] == 1
    assert post_json(server.url + "/decide", RIGHT_GUESS)[0] == 200


def test_moderate_nesting_is_still_json(server):
    # a legitimate body with nested values is not refused by the nesting guard
    body = {"cs_id": 100, "block_keys": [], "prompt_tokens": 512, "extra": [[[[{"a": [1]}]]]]}
    assert post_json(server.url + "/decide", body)[0] == 200


# ---- slow clients: one deadline per request ----------------------------------------


def _trickle(url: str, head: bytes, every: float, for_at_most: float) -> tuple[float, bytes]:
    """Send `head`, then one byte every `every` seconds, until the server closes the
    connection; (seconds it stayed open, what the server answered)."""
    sock = socket.create_connection(_address(url), timeout=5)
    try:
        sock.sendall(head)
        started = time.monotonic()
        answer = b""
        sock.settimeout(every)
        while time.monotonic() - started < for_at_most:
            try:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
                continue
            except TimeoutError:
                pass
            try:
                sock.sendall(b" ")
            except OSError:
                break
        return time.monotonic() - started, answer
    finally:
        sock.close()


def test_a_body_trickled_byte_by_byte_is_cut_at_the_deadline(server):
    # every byte comes well within the per-read timeout; the request as a whole does not
    head = b"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    held, answer = _trickle(server.url, head, every=0.2, for_at_most=6.0)
    assert held < 3.0, f"a trickling client held a handler for {held:.1f} s"
    assert _status(answer) == 408 and "not sent in time" in _body(answer)["error"]
    assert _health(server.url)["http"]["deadline_expired"] == 1


def test_headers_trickled_byte_by_byte_are_cut_at_the_deadline(server):
    held, answer = _trickle(server.url, b"POST /decide HTTP/1.1\r\nX-Slow: ", 0.2, 6.0)
    assert held < 3.0, f"a trickling client held a handler for {held:.1f} s"
    assert answer == b""  # no request to answer: the connection is closed
    assert _health(server.url)["http"]["deadline_expired"] == 1


def test_a_keepalive_connection_serves_many_requests_each_under_the_deadline(server):
    # the deadline is per request, not per connection: 3 requests over 1.5 s on one
    # keep-alive connection with a 1 s deadline are all answered
    body = json.dumps({"cs_id": 100, "block_keys": [], "prompt_tokens": 512}).encode()
    with socket.create_connection(_address(server.url), timeout=5) as sock:
        for _ in range(3):
            time.sleep(0.5)
            sock.sendall(_post("/decide", body))
            reply = b""
            while not _complete(reply):
                reply += sock.recv(65536)
            assert _status(reply) == 200


# ---- too many connections: a bound, and a 503 beyond it --------------------------------


def test_connections_over_the_bound_get_503_and_the_bound_frees_up(service):
    srv = SteeringServer(service, read_timeout=5.0, max_handlers=2).start()
    holders = []
    try:
        for n in (1, 2):  # each holds a handler: a request whose body is not sent
            holders.append(socket.create_connection(_address(srv.url), timeout=5))
            holders[-1].sendall(b"POST /decide HTTP/1.1\r\nContent-Length: 50\r\n\r\n")
            # its head is in: no longer a connection a newcomer may evict
            wait_until(
                f"holder {n}'s head read",
                lambda n=n: srv.in_service == n and srv.waiting == 0,
                5,
                seen=lambda: (srv.in_service, srv.waiting),
            )
        reply = _raw(srv.url, _post("/decide", json.dumps(RIGHT_GUESS).encode()))
        assert _status(reply) == 503 and "too many connections" in _body(reply)["error"]
        assert b"Connection: close" in reply
        assert srv.stats.to_json()["busy_refused"] == 1
    finally:
        for s in holders:
            s.close()
    try:
        deadline = time.monotonic() + 5
        while True:  # the two handlers notice the closes and give their slots back
            try:
                status, _ = post_json(srv.url + "/decide", RIGHT_GUESS)
            except OSError:  # answered 503 and closed before our request was sent
                status = 0
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200
        assert service.decisions >= 1
    finally:
        srv.close()


def test_a_zero_bound_is_refused(service):
    with pytest.raises(ValueError, match="max_handlers"):
        SteeringServer(service, max_handlers=0)
    with pytest.raises(SystemExit) as exc:
        steering.main(["--config", "/nonexistent", "--max-connections", "0"])
    assert exc.value.code == 2


# ---- the prompt oracle: cached-block counts only for token holders ---------------------

DETAIL = ("chosen", "runner_up", "explanation", "expected_cached_blocks", "kv_source",
          "kv_pull", "estimated_ttft_ms", "candidates")  # fmt: skip


def test_without_a_token_decide_names_only_the_choice(server):
    status, answer = post_json(server.url + "/decide", RIGHT_GUESS)
    assert status == 200
    assert answer["instance"] == "10.103.0.11" and answer["url"] == "http://10.103.0.11:8100"
    assert set(answer) == {*PUBLIC_FIELDS, "withheld"}
    assert not set(DETAIL) & set(answer)
    assert "no API token configured" in answer["withheld"]
    assert "cached" not in json.dumps({k: v for k, v in answer.items() if k != "withheld"})


@pytest.fixture
def token_server(service):
    srv = SteeringServer(service, read_timeout=1.0, api_token=TOKEN).start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.parametrize(
    "authorization",
    [None, b"", b"Bearer", b"Bearer " + TOKEN[:-1], b"Bearer " + TOKEN + b"x", b"Basic " + TOKEN,
     b"Bearer " + TOKEN.upper()],
)  # fmt: skip
def test_with_a_token_a_missing_or_wrong_one_is_a_401(token_server, service, authorization):
    header = b"" if authorization is None else b"Authorization: " + authorization + b"\r\n"
    reply = _raw(token_server.url, _post("/decide", json.dumps(RIGHT_GUESS).encode(), header))
    assert _status(reply) == 401 and "API token" in _body(reply)["error"]
    assert b"WWW-Authenticate: Bearer" in reply
    assert service.decisions == 0
    assert _health(token_server.url)["unauthorised"] == 1


def test_with_the_token_the_whole_decision_is_answered(token_server):
    status, answer = post_json(token_server.url + "/decide", RIGHT_GUESS, token=TOKEN)
    assert status == 200 and answer["chosen"]["cached_blocks"] == 24
    assert "cached 24 blocks" in answer["explanation"]
    assert answer["runner_up"] is not None and "withheld" not in answer
    status, _ = post_json(token_server.url + "/decide", RIGHT_GUESS, token=TOKEN.decode())
    assert status == 200


class _Instance:
    """A real modelled instance on loopback, answering the steering proxy."""

    def __enter__(self) -> InstanceServer:
        engine = ModelledEngine(
            EngineConfig(block_size=instances.BLOCK_TOKENS, time_scale=1000.0, replay_endpoint=None)
        )
        self.server = InstanceServer(engine, None, request_deadline=1.0).start()
        return self.server

    def __exit__(self, *exc: object) -> None:
        self.server.close()


@pytest.mark.parametrize("with_token", [False, True])
def test_generate_withholds_the_decision_detail_without_a_token(service, with_token):
    with _Instance() as instance:
        decide = service.decide  # the chosen instance's address is a lab one: ask ours
        service.decide = lambda body: {**decide(body), "url": instance.url}  # type: ignore[method-assign]
        srv = SteeringServer(service, api_token=TOKEN if with_token else None).start()
        try:
            token = TOKEN if with_token else None
            status, answer = post_json(srv.url + "/generate", RIGHT_GUESS, token=token)
        finally:
            srv.close()
    assert status == 200 and answer["reply"]["blocks"] == 24
    if with_token:
        assert answer["steering"]["chosen"]["cached_blocks"] == 24
    else:
        assert set(answer["steering"]) == {*PUBLIC_FIELDS, "withheld"}


@pytest.mark.parametrize(
    ("content", "words"),
    [("", "0 characters"), ("short", "5 characters"), ("has a space in it, long", "printable")],
)
def test_a_bad_token_file_stops_the_daemon_at_start(tmp_path, content, words, capsys):
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(0o600)  # refused for what it holds, not for its mode
    with pytest.raises(ValueError, match=words):
        http.read_api_token(path)
    with pytest.raises(SystemExit) as exc:
        steering.main(["--config", "/nonexistent", "--api-token-file", str(path)])
    assert exc.value.code == 2 and "--api-token-file" in capsys.readouterr().err


def test_a_token_file_is_read_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN.decode() + "\n")
    path.chmod(0o600)
    assert http.read_api_token(path) == TOKEN


# ---- the modelled instance's HTTP API -----------------------------------------------


@pytest.fixture
def instance():
    with _Instance() as srv:
        yield srv


@pytest.mark.parametrize(
    ("length", "body", "status", "words"),
    [
        ("99999999999999", b"", 413, "over the"),  # used to be allocated: MemoryError
        ("-1", b"{}", 400, "not a byte count"),  # used to read until the client closed
        ("abc", b"", 400, "not a byte count"),
        ("10", b'{"a":', 408, "not sent in time"),
        ("100000", b"[" * 100_000, 400, "nest deeper"),
        ("2", b"[]", 400, "JSON object"),
    ],
)
def test_instance_refuses_a_bad_body_and_serves_on(instance, length, body, status, words):
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    reply = _raw(instance.url, head + body)
    assert _status(reply) == status and words in _body(reply)["error"], reply[:200]
    good = {"prompt_token_ids": list(range(2 * instances.BLOCK_TOKENS))}
    status, answer = post_json(instance.url + "/generate", good)
    assert status == 200 and answer["blocks"] == 2


def test_instance_drops_an_idle_connection_at_the_deadline(instance):
    with socket.create_connection(_address(instance.url), timeout=5) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed by the server, having sent nothing
        assert time.monotonic() - started < 3.0
    assert instance.stats.to_json()["deadline_expired"] == 1

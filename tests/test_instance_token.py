"""The modelled instance's HTTP API and its bearer token: /generate replies say which
prompts are cached and /state, /advertisements, /metrics show the cache, so with a token
configured they answer only its holders (401 otherwise, the body unread), and without one
/generate tells the block count alone and the views are refused (403). The steering
daemon sends the instances' token on what it proxies. Real servers, real sockets on
loopback; the instance is primed with one prompt so its cache holds it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from catsproto.adapters import steering
from catsproto.adapters.http import MIN_TOKEN_CHARS
from catsproto.adapters.instance import (
    EngineConfig,
    InstanceServer,
    ModelledEngine,
    NodeAgent,
    public_reply,
)
from catsproto.adapters.steering import SteeringServer, get_json, post_json
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.keys import BlockKeyer
from catsproto.lab import instances
from catsproto.node import BuilderConfig, DampeningPolicy
from tests.test_http_hostile import _body, _raw, _service, _status

TOKEN = b"token-of-the-instance-tests-0123456789"
BS = instances.BLOCK_TOKENS
CACHED = {"prompt_token_ids": instances.demo_prompt(3)}  # primed below
COLD = {"prompt_token_ids": instances.demo_prompt(2)}  # same length, never sent
PROTECTED = ["/generate", "/state", "/advertisements", "/metrics"]
WRONG = [None, b"", b"Bearer", b"Bearer " + TOKEN[:-1], b"Basic " + TOKEN,
         b"Bearer " + TOKEN.upper(), TOKEN]  # fmt: skip


def _instance(token: bytes | None, request_deadline: float = 5.0) -> InstanceServer:
    """A modelled instance with its node, primed with CACHED (through the engine, so
    the HTTP counters start at zero)."""
    engine = ModelledEngine(
        EngineConfig(
            block_size=BS, time_scale=1000.0, replay_endpoint=None, tiers=instances.LAB_TIERS
        )
    )
    node = NodeAgent(
        BuilderConfig(
            cs_id=1,
            address="10.0.0.5",
            model_id="m",
            block_size=BS,
            bytes_per_block=1 << 20,
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
        ),
        instances.LAB_TIERS,
        BlockKeyer(b"k" * 32, "m", BS),
        [RankEndpoint(0, engine.publisher.endpoint, None)],
        engine.compute_state,
        hits=engine.hits,
    )
    engine.submit(dict(CACHED), timeout=30)
    server = InstanceServer(
        engine, node, request_deadline=request_deadline, api_token=token
    ).start()
    return server


@pytest.fixture
def with_token() -> Iterator[InstanceServer]:
    srv = _instance(TOKEN)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def without_token() -> Iterator[InstanceServer]:
    srv = _instance(None)
    try:
        yield srv
    finally:
        srv.close()


def _request(path: str, authorization: bytes | None, body: bytes = b"{}") -> bytes:
    header = b"" if authorization is None else b"Authorization: " + authorization + b"\r\n"
    if path == "/generate":
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        return head.encode() + header + b"\r\n" + body
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + header + b"\r\n"


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


# ---- with a token configured --------------------------------------------------------


@pytest.mark.parametrize("path", PROTECTED)
@pytest.mark.parametrize("authorization", WRONG)
def test_with_a_token_configured_a_caller_without_it_gets_a_401(with_token, path, authorization):
    reply = _raw(with_token.url, _request(path, authorization, json.dumps(CACHED).encode()))
    assert _status(reply) == 401, reply[:300]
    assert b'WWW-Authenticate: Bearer realm="instance"' in reply
    body = _body(reply)
    assert set(body) == {"error"} and "Bearer" in body["error"]
    assert with_token.unauthorised == 1
    assert with_token.engine.hits.lookup_blocks == 24  # the priming request only
    assert _health(with_token.url) == {"ok": True, "unauthorised": 1}


@pytest.mark.parametrize("length", [1 << 20, 10**14])
def test_a_401_is_answered_at_once_without_reading_the_body(length):
    """The body is never read: a Content-Length the caller never sends gets its 401 at
    once, not when the request deadline runs out (nor a 413 that tells the limit)."""
    srv = _instance(TOKEN, request_deadline=4.0)
    try:
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
        started = time.monotonic()
        reply = _raw(srv.url, head.encode(), timeout=10)
        took = time.monotonic() - started
    finally:
        srv.close()
    assert _status(reply) == 401, reply[:300]
    assert took < 2.0
    assert srv.stats.to_json()["deadline_expired"] == 0


def test_with_the_token_every_endpoint_answers_in_full(with_token):
    status, cached = post_json(with_token.url + "/generate", CACHED, token=TOKEN)
    assert status == 200 and cached["cached_blocks"] == 24 and cached["prefill_tokens"] == 0
    status, cold = post_json(with_token.url + "/generate", COLD, token=TOKEN)
    assert status == 200 and cold["cached_blocks"] == 0
    status, state = get_json(with_token.url + "/state", token=TOKEN)
    assert status == 200 and state["engine"]["hit_ratio"] > 0
    status, adverts = get_json(with_token.url + "/advertisements", token=TOKEN)
    assert status == 200 and isinstance(adverts, list)
    req = urllib.request.Request(
        with_token.url + "/metrics", headers={"Authorization": "Bearer " + TOKEN.decode()}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200 and b"# TYPE" in r.read()
    assert with_token.unauthorised == 0


# ---- without a token configured -----------------------------------------------------


@pytest.mark.parametrize("path", ["/state", "/advertisements", "/metrics"])
@pytest.mark.parametrize("authorization", [None, b"Bearer " + TOKEN])
def test_without_a_token_configured_the_views_are_refused(without_token, path, authorization):
    reply = _raw(without_token.url, _request(path, authorization))
    assert _status(reply) == 403, reply[:300]
    error = _body(reply)["error"]
    assert "--api-token-file" in error and path in error


def test_without_a_token_a_cached_and_a_cold_prompt_get_the_same_reply(without_token):
    answers = [post_json(without_token.url + "/generate", body) for body in (CACHED, COLD)]
    assert [status for status, _ in answers] == [200, 200]
    cached, cold = answers[0][1], answers[1][1]
    assert cached == cold
    assert set(cached) == {"blocks", "withheld"} and cached["blocks"] == 24
    assert "--api-token-file" in cached["withheld"]
    # the engine did serve both, the first from its cache: only the reply is cut
    assert without_token.engine.hits.hit_blocks == 24


def test_public_reply_is_an_allow_list():
    reply = {"blocks": 3, "cached_blocks": 3, "stale": False, "a_field_added_later": 1}
    out = public_reply(reply)
    assert set(out) == {"blocks", "withheld"} and out["blocks"] == 3


@pytest.mark.parametrize("token", [None, TOKEN])
def test_health_is_open(token):
    srv = _instance(token)
    try:
        assert _health(srv.url) == {"ok": True, "unauthorised": 0}
        reply = _raw(srv.url, _request("/health", b"Bearer wrong"))
        assert _status(reply) == 200
    finally:
        srv.close()


# ---- the command line -----------------------------------------------------------------


def _serve(*options: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "catsproto", "instance", "serve", "--no-node", "--port", "0"]
    return subprocess.run([*argv, *options], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content", ["short-token\n", "", "a token with spaces in it\n"])
def test_a_token_file_that_is_not_a_token_is_refused_at_start(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(0o600)  # refused for what it holds, not for its mode
    r = _serve("--api-token-file", str(path))
    assert r.returncode == 2
    assert r.stderr.startswith(f"catsproto instance serve: --api-token-file: API token file {path}")
    assert f"need at least {MIN_TOKEN_CHARS} printable ASCII characters" in r.stderr
    assert r.stderr.count("\n") == 1


def test_a_missing_token_file_is_refused_at_start(tmp_path):
    r = _serve("--api-token-file", str(tmp_path / "absent"))
    assert r.returncode == 2
    assert r.stderr == (
        f"catsproto instance serve: --api-token-file {tmp_path / 'absent'}: cannot read it: "
        "No such file or directory\n"
    )


def test_instance_serve_errors_name_the_subcommand():
    r = _serve("--port", "70000")
    assert (
        r.returncode == 2 and r.stderr == "catsproto instance serve: --port 70000 is not 0..65535\n"
    )
    r = _serve("--port", "x")
    assert r.returncode == 2 and r.stderr.startswith("catsproto instance serve: argument --port")


# ---- the steering daemon in front -----------------------------------------------------


def _steering(
    tmp_path, instance: InstanceServer, instance_token: bytes | None, api_token: bytes | None = None
) -> SteeringServer:
    service = _service(tmp_path)
    service.instance_token = instance_token
    decide = service.decide  # the chosen instance's address is a lab one: send it to ours
    service.decide = lambda body: {**decide(body), "url": instance.url}  # type: ignore[method-assign]
    return SteeringServer(service, read_timeout=5.0, api_token=api_token).start()


@pytest.mark.parametrize("instance_token", [None, b"not-the-instances-token-0123"])
def test_steering_answers_502_naming_the_option_when_the_instance_refuses(
    tmp_path, with_token, instance_token
):
    srv = _steering(tmp_path, with_token, instance_token)
    try:
        body = {"cs_id": 100, **CACHED}
        first = post_json(srv.url + "/generate", body)
        second = post_json(srv.url + "/generate", body)
        health = get_json(srv.url + "/health")[1]
    finally:
        srv.close()
    for status, answer in (first, second):  # the daemon serves on
        assert status == 502, answer
        assert "--instance-token-file" in answer["error"] and "401" in answer["error"]
    assert health["instance_refused"] == 2 and health["bad_requests"] == 0
    assert with_token.unauthorised == 2


def test_a_403_from_the_instance_is_the_same_fault_as_a_401(tmp_path, monkeypatch):
    service = _service(tmp_path)
    monkeypatch.setattr(steering, "post_json", lambda *a, **k: (403, {"error": "refused"}))
    with pytest.raises(steering.UpstreamError, match=r"answered 403.*--instance-token-file"):
        service.generate({"cs_id": 100, **CACHED})
    assert service.instance_refused == 1 and service.bad_requests == 0


def test_steering_with_the_instances_token_passes_the_whole_reply_on(tmp_path, with_token):
    steering_token = b"token-of-the-steering-api-0123"
    srv = _steering(tmp_path, with_token, TOKEN, steering_token)
    try:
        body = {"cs_id": 100, **CACHED}
        status, answer = post_json(srv.url + "/generate", body, token=steering_token)
    finally:
        srv.close()
    assert status == 200 and answer["reply"]["cached_blocks"] == 24
    assert with_token.unauthorised == 0

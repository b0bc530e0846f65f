"""The steering API and its RIB feed against bad input: every malformed request gets a
4xx answer naming the problem and is counted, the server answers the next request, and a
bad rib.json changes nothing. Real server, real sockets on loopback."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from catsproto.adapters.http import BackgroundHTTPServer
from catsproto.adapters.steering import (
    Forwarder,
    RibFeed,
    SteeringServer,
    SteeringService,
    post_json,
)
from tests.test_steering import NEXT_HOPS, _config, _rib_json


@pytest.fixture
def server(tmp_path):
    rib = tmp_path / "rib.json"
    rib.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    service = SteeringService(_config(str(rib)), Forwarder(NEXT_HOPS, dry_run=True))
    srv = SteeringServer(service, read_timeout=0.5).start()
    try:
        yield srv
    finally:
        srv.close()


def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send bytes as they are (no client library fixing them up); the status and JSON."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _post(length: str) -> bytes:
    return (
        b"POST /decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
    )


def _health(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


GOOD = {"cs_id": 100, "block_keys": [], "prompt_tokens": 512}


@pytest.mark.parametrize(
    ("length", "body", "status", "words"),
    [
        ("abc", b"", 400, "not a byte count"),
        ("-1", b"", 400, "not a byte count"),
        ("99999999999", b"", 413, "over the"),
        ("3", b"\xff\xfe\x00", 400, "not UTF-8"),
        ("5", b"[1, 2", 400, "not JSON"),
        ("10", b'{"cs_id":', 408, "not sent in time"),  # short body: the read times out
    ],
)
def test_a_broken_body_is_answered_and_counted(server, length, body, status, words):
    got, answer = _raw(server.url, _post(length), body)
    assert got == status and words in answer["error"]
    health = _health(server.url)
    # a Content-Length that is no byte count is refused by the server before the daemon
    # reads anything (the connection closed: RFC 9112 section 6.3); the rest by the daemon
    framing = not length.isdigit()
    assert health["http"]["bad_framing"] == int(framing)
    assert health["bad_requests"] == int(not framing) and health["internal_errors"] == 0
    assert post_json(server.url + "/decide", GOOD)[0] == 200  # and it serves on


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cs_id": True, "block_keys": []}, "cs_id"),
        ({"cs_id": 100.0, "block_keys": []}, "cs_id"),
        ({"cs_id": 1 << 32, "block_keys": []}, "cs_id"),
        ({"cs_id": 100, "block_keys": [1.5]}, "block_keys"),
        ({"cs_id": 100, "block_keys": [True]}, "block_keys"),
        ({"cs_id": 100, "block_keys": ["0x10"]}, "block_keys"),
        ({"cs_id": 100, "block_keys": ["1_0"]}, "block_keys"),
        ({"cs_id": 100, "block_keys": ["1" * 17]}, "block_keys"),
        ({"cs_id": 100, "block_keys": [], "prompt_tokens": 1e23}, "prompt_tokens"),
        ({"cs_id": 100, "block_keys": [], "prompt_tokens": 1 << 40}, "prompt_tokens"),
        ({"cs_id": 100, "prompt_token_ids": [False]}, "prompt_token_ids"),
    ],
)
def test_nonsense_fields_are_refused_not_rounded(server, body, field):
    status, answer = post_json(server.url + "/decide", body)
    assert status == 400 and field in answer["error"]


def test_an_infinite_number_is_a_400_not_a_crash(server):
    # 1e400 parses as float('inf'); int() of it used to raise OverflowError unanswered
    raw = b'{"cs_id": 100, "block_keys": [1e400]}'
    status, answer = _raw(server.url, _post(str(len(raw))), raw)
    assert status == 400 and "block_keys" in answer["error"]
    assert _health(server.url)["internal_errors"] == 0


def test_a_malformed_instance_reply_is_a_502(tmp_path):
    """/generate proxies to the chosen instance; an answer missing its counts is the
    instance's fault (502), not a crash of the handler."""
    from http.server import BaseHTTPRequestHandler

    class Broken(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"expected_blocks": 3, "stale": "yes"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    instance = BackgroundHTTPServer(Broken, "127.0.0.1", 0).start()
    rib = tmp_path / "rib.json"
    rib.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    service = SteeringService(_config(str(rib)), Forwarder(NEXT_HOPS, dry_run=True))
    decide = service.decide
    service.decide = lambda body: {**decide(body), "url": instance.url}  # type: ignore[method-assign]
    srv = SteeringServer(service).start()
    try:
        status, answer = post_json(srv.url + "/generate", GOOD)
        assert status == 502 and "malformed reply" in answer["error"]
        assert (
            service.ledger.to_json()
            == SteeringService(service.config, Forwarder(NEXT_HOPS, dry_run=True)).ledger.to_json()
        )  # nothing recorded
    finally:
        srv.close()
        instance.close()


def test_a_bad_rib_document_changes_nothing_and_is_read_again(tmp_path):
    path = tmp_path / "rib.json"
    now = int(time.time() * 1000)
    good = _rib_json(now)
    path.write_text(json.dumps(good))
    feed = RibFeed(path)
    assert feed.refresh(now)
    before = {str(i.address) for i in feed.rib.services[100].live()}
    path.write_text(json.dumps({"routes": 5}))
    assert not feed.refresh(now) and feed.bad_documents == 1
    assert {str(i.address) for i in feed.rib.services[100].live()} == before
    path.write_text(json.dumps(good) + " ")  # fixed: a new stamp, read again
    assert feed.refresh(now)


def test_unusable_routes_are_left_out_and_counted(tmp_path):
    now = int(time.time() * 1000)
    doc = _rib_json(now, sites=(1,))
    doc["routes"] += [
        {"peer": "p", "value": "00"},  # no prefix
        {"peer": "p", "prefix": "10.9.0.0/32", "value": "zz"},  # not hex
        {"peer": "p", "prefix": "10.9.0.1/32", "value": "00", "origin": "nowhere"},
        {"peer": "p", "prefix": "10.9.0.2/32", "value": "00", "origin": "10.9.0.2", "cs_id": "x"},
        7,
    ]
    feed = RibFeed(tmp_path / "none.json")
    assert feed.apply(doc, now)
    assert feed.bad_routes == 5
    assert {str(i.address) for i in feed.rib.services[100].live()} == {
        "10.101.0.11",
        "10.101.0.12",
    }


def test_a_same_size_rewrite_within_one_file_clock_tick_is_still_seen(tmp_path):
    # On a coarse file clock two writes inside one tick share their mtime; a rewrite of
    # the same size then looks unchanged to a stat. Shown here with os.utime.
    path = tmp_path / "rib.json"
    now = int(time.time() * 1000)
    three = json.dumps(_rib_json(now, sites=(1, 3)))
    path.write_text(three)
    feed = RibFeed(path)
    assert feed.refresh(now)
    tick = path.stat().st_mtime_ns
    one = json.dumps(_rib_json(now, sites=(1,)))
    path.write_text(one.ljust(len(three)))  # same size: JSON allows trailing blanks
    os.utime(path, ns=(tick, tick))
    assert path.stat().st_size == len(three) and path.stat().st_mtime_ns == tick
    assert feed.refresh(now)
    assert {str(i.address)[:8] for i in feed.rib.services[100].live()} == {"10.101.0"}
    assert not feed.refresh(now)  # read again, same content: nothing to do

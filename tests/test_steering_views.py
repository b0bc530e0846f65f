"""The steering daemon's GET views must not tell a caller without the API token what its
prompt endpoints withhold. GET /stale's totals move with each proxied request (diffed
around one's own /generate on an idle ingress they say whether the selector expected the
prompt to be cached), /flows gains a route towards a pull source, and /rib's sequence,
age and load move when an instance caches a new prompt. Real steering server, real
modelled instance, real HTTP on loopback; the instance is primed with one prompt."""

from __future__ import annotations

import json
import time

import pytest

from catsproto.adapters.steering import PUBLIC_RIB_FIELDS, get_json, post_json
from tests import test_generate_withheld as withheld
from tests.test_generate_withheld import CACHED, UNCACHED, _steering
from tests.test_http_hostile import TOKEN, _raw, _status
from tests.test_steering import _rib_json

instance = withheld.instance  # the fixture: a modelled instance primed with CACHED

WRONG = [None, b"", b"Bearer", b"Bearer " + TOKEN[:-1], b"Basic " + TOKEN,
         b"Bearer " + TOKEN.upper()]  # fmt: skip


def _get_raw(url: str, path: str, authorization: bytes | None) -> bytes:
    header = b"" if authorization is None else b"Authorization: " + authorization + b"\r\n"
    return _raw(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + header + b"\r\n")


# ---- /stale ---------------------------------------------------------------------------


def test_with_the_token_stale_tells_whether_a_prompt_was_expected_cached(tmp_path, instance):
    """What the view gives away, and why it is closed: its totals, read around one request,
    answer "did the selector expect this prompt to be cached?"."""
    srv = _steering(tmp_path, instance, TOKEN)
    try:
        moves = []
        for body in (CACHED, UNCACHED):
            before = get_json(srv.url + "/stale", token=TOKEN)[1]
            assert post_json(srv.url + "/generate", body, token=TOKEN)[0] == 200
            after = get_json(srv.url + "/stale", token=TOKEN)[1]
            moves.append(after["expected_hits"] - before["expected_hits"])
    finally:
        srv.close()
    assert moves == [1, 0]


def test_without_a_token_configured_stale_is_refused_and_says_how_to_serve_it(tmp_path, instance):
    srv = _steering(tmp_path, instance, None)
    try:
        before = get_json(srv.url + "/stale")
        assert post_json(srv.url + "/generate", CACHED)[0] == 200
        after = get_json(srv.url + "/stale")
        assert srv.service.ledger.expected_hits == 1  # still counted, just not told
    finally:
        srv.close()
    status, body = before
    assert status == 403 and set(body) == {"error"}
    assert "--api-token-file" in body["error"] and "/stale" in body["error"]
    assert after == before  # nothing in the answer moved with the request


@pytest.mark.parametrize("authorization", WRONG)
@pytest.mark.parametrize("path", ["/stale", "/flows", "/rib"])
def test_with_a_token_configured_a_view_without_it_is_a_401(
    tmp_path, instance, path, authorization
):
    srv = _steering(tmp_path, instance, TOKEN)
    try:
        assert post_json(srv.url + "/generate", CACHED, token=TOKEN)[0] == 200
        reply = _get_raw(srv.url, path, authorization)
        health = get_json(srv.url + "/health")[1]
    finally:
        srv.close()
    assert _status(reply) == 401 and b"WWW-Authenticate: Bearer" in reply
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert set(body) == {"error"} and "API token" in body["error"]
    assert health["unauthorised"] == 1


def test_with_the_token_the_views_answer_in_full(tmp_path, instance):
    srv = _steering(tmp_path, instance, TOKEN)
    try:
        assert post_json(srv.url + "/generate", CACHED, token=TOKEN)[0] == 200
        stale = get_json(srv.url + "/stale", token=TOKEN)
        flows = get_json(srv.url + "/flows", token=TOKEN.decode())
        rib = get_json(srv.url + "/rib", token=TOKEN)
    finally:
        srv.close()
    assert stale[0] == 200 and stale[1]["requests"] == 1 and stale[1]["expected_hits"] == 1
    assert stale[1]["stale_hits"] == 0
    assert flows[0] == 200 and [f["address"] for f in flows[1]] == ["10.103.0.11"]
    assert rib[0] == 200 and all("backlog_tokens" in r and "sequence" in r for r in rib[1])


# ---- /flows ---------------------------------------------------------------------------


def test_without_a_token_configured_flows_is_refused(tmp_path, instance):
    srv = _steering(tmp_path, instance, None)
    try:
        assert post_json(srv.url + "/generate", CACHED)[0] == 200
        status, body = get_json(srv.url + "/flows")
    finally:
        srv.close()
    assert status == 403 and "--api-token-file" in body["error"] and "/flows" in body["error"]


# ---- /rib -----------------------------------------------------------------------------


def test_without_a_token_the_rib_names_instances_only_and_does_not_move_with_them(
    tmp_path, instance
):
    srv = _steering(tmp_path, instance, None)
    rib_file = srv.service.config.rib_file
    try:
        status, first = get_json(srv.url + "/rib")
        full_first = srv.service.rib_view()
        # the instances re-advertise (as one does after caching a new prompt)
        time.sleep(0.01)
        with open(rib_file, "w") as f:
            json.dump(_rib_json(int(time.time() * 1000), sequence=2), f)
        status2, second = get_json(srv.url + "/rib")
        full_second = srv.service.rib_view()
    finally:
        srv.close()
    assert status == status2 == 200
    assert {r["instance"] for r in first} >= {"10.101.0.11", "10.103.0.11"}
    for entry in first:
        assert set(entry) == {*PUBLIC_RIB_FIELDS, "withheld"}
        assert "--api-token-file" in entry["withheld"]
    # what the daemon knows moved; what it tells a caller without a token did not
    assert {tuple(r["sequence"]) for r in full_first} != {tuple(r["sequence"]) for r in full_second}
    assert first == second


# ---- /health --------------------------------------------------------------------------


def test_health_is_open_and_moves_alike_for_a_cached_and_a_cold_prompt(tmp_path, instance):
    """Why /health stays open: none of its counters depends on what any cache holds."""
    seen = []
    for i, body in enumerate((CACHED, UNCACHED)):
        (tmp_path / str(i)).mkdir()
        srv = _steering(tmp_path / str(i), instance, None)
        try:
            before = get_json(srv.url + "/health")
            assert post_json(srv.url + "/generate", body)[0] == 200
            after = get_json(srv.url + "/health")
        finally:
            srv.close()
        assert before[0] == after[0] == 200
        seen.append((before[1], after[1]))
    assert seen[0] == seen[1]
    assert seen[0][1]["decisions"] == seen[0][0]["decisions"] + 1

"""POST /generate without the API token must not pass on what the chosen instance says of
its cache: the instance's reply to a guessed prompt would otherwise tell the caller how many
of its blocks were cached (a prompt oracle). Real steering server, real modelled instance,
real HTTP on loopback; the instance is primed with the prompt so its cache holds it."""

from __future__ import annotations

import json

import pytest

from catsproto.adapters.instance import EngineConfig, InstanceServer, ModelledEngine
from catsproto.adapters.steering import (
    PUBLIC_FIELDS,
    PUBLIC_REPLY_FIELDS,
    SteeringServer,
    post_json,
    public_generate,
)
from catsproto.lab import instances
from tests.test_http_hostile import TOKEN, _post, _raw, _service, _status

CACHED = {"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)}  # primed below
UNCACHED = {"cs_id": 100, "prompt_token_ids": instances.demo_prompt(2)}  # same length, cold
INSTANCE_TOKEN = b"instance-token-of-the-withheld-tests"  # the instance's; steering sends it
# every field the modelled instance's /generate reply can carry that tells of its cache
CACHE_STATE = ("cached_blocks", "cached_blocks_by_tier", "cached_tokens", "prefill_tokens",
               "model_prefill_ms", "queue_wall_ms", "expected_blocks", "stale", "stale_cause",
               "evicted_ms_ago", "lost_while_queued", "transfer")  # fmt: skip


@pytest.fixture
def instance():
    engine = ModelledEngine(
        EngineConfig(block_size=instances.BLOCK_TOKENS, time_scale=1000.0, replay_endpoint=None)
    )
    srv = InstanceServer(engine, None, request_deadline=5.0, api_token=INSTANCE_TOKEN).start()
    try:
        prime = {"prompt_token_ids": CACHED["prompt_token_ids"]}
        status, primed = post_json(srv.url + "/generate", prime, token=INSTANCE_TOKEN)
        assert status == 200 and primed["cached_blocks"] == 0
        yield srv
    finally:
        srv.close()


def _steering(tmp_path, instance: InstanceServer, token: bytes | None) -> SteeringServer:
    service = _service(tmp_path)
    service.instance_token = INSTANCE_TOKEN
    decide = service.decide  # the chosen instance's address is a lab one: send it to ours
    service.decide = lambda body: {**decide(body), "url": instance.url}  # type: ignore[method-assign]
    return SteeringServer(service, read_timeout=5.0, api_token=token).start()


def test_without_a_token_the_instance_reply_tells_nothing_of_its_cache(tmp_path, instance):
    srv = _steering(tmp_path, instance, None)
    try:
        answers = [post_json(srv.url + "/generate", body) for body in (CACHED, UNCACHED)]
    finally:
        srv.close()
    replies = []
    for status, answer in answers:
        assert status == 200
        assert set(answer) == {"steering", "reply", "proxy_ttft_ms"}
        assert set(answer["steering"]) == {*PUBLIC_FIELDS, "withheld"}
        reply = answer["reply"]
        assert set(reply) == {"blocks", "withheld"} and reply["blocks"] == 24
        assert "no API token configured" in reply["withheld"]
        shown = json.dumps({k: v for k, v in reply.items() if k != "withheld"})
        assert not any(word in shown for word in ("cached", "stale", "prefill", "expected"))
        replies.append(reply)
    # a cached and a cold prompt of the same length get the same reply
    assert replies[0] == replies[1]
    assert isinstance(answers[0][1]["proxy_ttft_ms"], float)


def test_with_the_token_the_whole_instance_reply_is_passed_on(tmp_path, instance):
    srv = _steering(tmp_path, instance, TOKEN)
    try:
        status, cached = post_json(srv.url + "/generate", CACHED, token=TOKEN)
        status2, cold = post_json(srv.url + "/generate", UNCACHED, token=TOKEN)
    finally:
        srv.close()
    assert status == status2 == 200
    assert cached["reply"]["cached_blocks"] == 24 and cold["reply"]["cached_blocks"] == 0
    assert cached["reply"]["cached_tokens"] == 24 * instances.BLOCK_TOKENS
    assert cached["reply"]["expected_blocks"] == 24 and cached["reply"]["stale"] is False
    assert cached["steering"]["chosen"]["cached_blocks"] == 24
    assert "withheld" not in cached["reply"] and "withheld" not in cached["steering"]


def test_with_a_token_configured_but_not_sent_generate_is_a_401_and_never_proxied(
    tmp_path, instance
):
    srv = _steering(tmp_path, instance, TOKEN)
    try:
        reply = _raw(srv.url, _post("/generate", json.dumps(CACHED).encode()))
        assert _status(reply) == 401
        assert srv.service.decisions == 0
    finally:
        srv.close()
    assert instance.engine.hits.lookup_blocks == 24  # the priming request only


@pytest.mark.parametrize("field", CACHE_STATE)
def test_every_cache_field_the_instance_can_report_is_withheld(field):
    reply = {"blocks": 3, field: 1}
    out = public_generate({"steering": {"instance": "10.0.0.1"}, "reply": reply, "x": 1})
    assert out["reply"] == {"blocks": 3, "withheld": out["reply"]["withheld"]}
    assert field not in PUBLIC_REPLY_FIELDS


def test_a_field_no_one_has_judged_is_withheld_and_a_non_object_reply_too():
    out = public_generate({"steering": {}, "reply": {"blocks": 1, "new_metric": 7}})
    assert "new_metric" not in out["reply"]
    out = public_generate({"steering": {}, "reply": [1, 2]})
    assert set(out["reply"]) == {"withheld"}

"""The steering API without root: RIB feed, request parsing, decisions over HTTP, routes
the forwarder would install (dry run). The lab test (test_steering_lab.py) does it for real."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from catsproto.adapters import steering
from catsproto.adapters.steering import (
    Forwarder,
    RibFeed,
    SteeringConfig,
    SteeringError,
    SteeringServer,
    SteeringService,
    get_json,
    post_json,
)
from catsproto.lab import instances
from catsproto.lab.steering import rate_mbps
from catsproto.lab.topology import load
from catsproto.selector import Link

TOPOLOGY = load(Path(__file__).resolve().parent.parent / "lab" / "cats4.clab.yml")
NEXT_HOPS = {"c1": "10.0.11.2", "client": "10.100.1.2"}


def _rib_json(now_ms: int, sites: tuple[int, ...] = (1, 3), sequence: int = 1) -> dict:
    """What the ingress's receiver would hold: each site's instances, site 3's first one
    caching its demo conversation; values signed as the lab signs them."""
    routes = []
    for node in TOPOLOGY.nodes.values():
        for i, spec in enumerate(node.instances):
            if spec.site_id not in sites:
                continue
            keys = instances.demo_prefix_keys(spec.site_id) if i == 0 else np.zeros(0, np.uint64)
            values = instances.instance_routes(
                spec,
                np.asarray(keys, dtype=np.uint64),
                sequence=sequence,
                now_ms=now_ms,
                signer=instances.lab_key(TOPOLOGY, spec.name),
            )
            for prefix, value in values.items():
                routes.append(
                    {
                        "peer": "10.0.11.2",
                        "prefix": str(prefix),
                        "origin": str(spec.address),
                        "cs_id": spec.cs_id,
                        "value": value.hex(),
                        "verified": True,
                    }
                )
    return {"sessions": {}, "routes": routes}


def _config(rib_file: str) -> SteeringConfig:
    sites = {s.site_id: n for n, node in TOPOLOGY.nodes.items() for s in node.instances}
    links = tuple(Link(k.a.node, k.b.node, k.delay_ms, rate_mbps(k.rate)) for k in TOPOLOGY.links)
    return SteeringConfig(
        ingress="e1",
        rib_file=rib_file,
        links=links,
        sites=sites,
        next_hops=NEXT_HOPS,
        secret=instances.DEMO_SECRET,
        secret_id=instances.DEMO_SECRET_ID,
        model_id=instances.MODEL,
        block_size=instances.BLOCK_TOKENS,
        source="10.100.1.1",
    )


@pytest.fixture
def service(tmp_path):
    rib_file = tmp_path / "rib.json"
    rib_file.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    return SteeringService(_config(str(rib_file)), Forwarder(NEXT_HOPS, dry_run=True))


def test_config_round_trips_through_json(tmp_path):
    config = _config(str(tmp_path / "rib.json"))
    assert SteeringConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    drain = dataclasses.replace(config, pending="drain")
    assert SteeringConfig.from_json(json.loads(json.dumps(drain.to_json()))) == drain


def test_pending_mode_reaches_the_selector_and_a_bad_one_is_refused(tmp_path):
    rib_file = tmp_path / "rib.json"
    rib_file.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    config = dataclasses.replace(_config(str(rib_file)), pending="drain")
    service = SteeringService(config, Forwarder(NEXT_HOPS, dry_run=True))
    assert service.selector.config.pending == "drain"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**config.to_json(), "pending": "fifo"}))
    with pytest.raises(SystemExit) as exc:
        steering.main(["--config", str(bad)])
    assert exc.value.code == 2


def test_cached_remote_site_wins_and_the_route_goes_via_the_first_hop(service):
    answer = service.decide({"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)})
    assert answer["instance"] == "10.103.0.11" and answer["site"] == 3
    assert answer["path"] == ["e1", "c1", "c3", "e3"]  # shortest delay: c1-c3 direct
    assert answer["route"]["gateway"] == "10.0.11.2"
    assert answer["url"] == "http://10.103.0.11:8100"
    assert answer["chosen"]["cached_blocks"] == 24
    assert "cached 24 blocks" in answer["explanation"]
    assert answer["runner_up"] is not None and answer["runner_up"]["instance"] != "10.103.0.11"
    assert service.forwarder.installed["10.103.0.11"].path == ("e1", "c1", "c3", "e3")


def test_block_keys_give_the_same_decision_as_token_ids(service):
    keys = [f"{int(k):016x}" for k in instances.demo_prefix_keys(3)]
    answer = service.decide({"cs_id": 100, "block_keys": keys})
    assert answer["instance"] == "10.103.0.11" and answer["chosen"]["cached_blocks"] == 24


def test_nothing_cached_goes_to_the_ingress_site_without_a_route(service):
    answer = service.decide({"cs_id": 100, "block_keys": [], "prompt_tokens": 12288})
    assert answer["site"] == 1 and answer["path"] == ["e1"]
    assert answer["route"]["gateway"] is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt_token_ids": [1, 2]}, "cs_id"),
        ({"cs_id": 100}, "prompt_token_ids"),
        ({"cs_id": 100, "prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"cs_id": 100, "block_keys": ["zz"]}, "block_keys"),
        ({"cs_id": 100, "block_keys": [], "prompt_tokens": -5}, "prompt_tokens"),
    ],
)
def test_bad_requests_name_the_field(service, body, field):
    with pytest.raises(SteeringError, match=field):
        service.request(body)


API_TOKEN = b"a-token-for-the-steering-tests"


def test_http_api_decides_and_reports_errors(service):
    server = SteeringServer(service, api_token=API_TOKEN).start()
    try:
        status, answer = post_json(
            server.url + "/decide",
            {"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)},
            token=API_TOKEN,
        )
        assert status == 200 and answer["instance"] == "10.103.0.11"
        assert isinstance(answer["decision_ms"], float) and answer["decision_ms"] >= 0
        status, err = post_json(server.url + "/decide", {"cs_id": 100}, token=API_TOKEN)
        assert status == 400 and "prompt_token_ids" in err["error"]
        status, err = post_json(
            server.url + "/decide", {"cs_id": 7, "block_keys": []}, token=API_TOKEN
        )
        assert status == 503 and "CS-ID 7" in err["error"]
        status, flows = get_json(server.url + "/flows", token=API_TOKEN)
        assert status == 200 and flows[0]["route"].startswith("10.103.0.11/32 via 10.0.11.2")
        status, rib = get_json(server.url + "/rib", token=API_TOKEN)
        assert {r["instance"] for r in rib} >= {"10.101.0.11", "10.103.0.11"}
    finally:
        server.close()


def test_feed_follows_the_file_and_withdraws_vanished_origins(tmp_path):
    path = tmp_path / "rib.json"
    now = int(time.time() * 1000)
    path.write_text(json.dumps(_rib_json(now)))
    feed = RibFeed(path)
    assert feed.refresh(now) and not feed.refresh(now)  # unchanged file: nothing to do
    assert {str(i.address) for i in feed.rib.services[100].live()} == {
        "10.101.0.11",
        "10.101.0.12",
        "10.103.0.11",
        "10.103.0.12",
    }
    path.write_text(json.dumps(_rib_json(now, sites=(1,))))
    assert feed.refresh(now)
    assert {str(i.address) for i in feed.rib.services[100].live()} == {
        "10.101.0.11",
        "10.101.0.12",
    }


def test_unverified_routes_are_left_out(tmp_path):
    doc = _rib_json(int(time.time() * 1000))
    for r in doc["routes"]:
        r["verified"] = r["origin"] not in ("10.103.0.11",)
    feed = RibFeed(tmp_path / "none.json")
    feed.apply(doc, int(time.time() * 1000))
    assert "10.103.0.11" not in {str(i.address) for i in feed.rib.services[100].live()}


def test_an_ingress_on_another_keying_secret_credits_no_cache(tmp_path):
    """The ingress names its key space: instances advertising another secret id (a
    rotation half done) hold none of its keys, so the nearest site wins, prefilling all."""
    rib_file = tmp_path / "rib.json"
    rib_file.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    config = dataclasses.replace(_config(str(rib_file)), secret_id=instances.DEMO_SECRET_ID + 1)
    service = SteeringService(config, Forwarder(NEXT_HOPS, dry_run=True))
    answer = service.decide({"cs_id": 100, "prompt_token_ids": instances.demo_prompt(3)})
    assert answer["site"] != 3 and answer["chosen"]["cached_blocks"] == 0
    assert SteeringConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(ValueError, match="secret_id"):
        dataclasses.replace(config, secret_id=-1)


def test_hash_ids_up_to_2_64_minus_1_are_keyed_as_the_instance_keys_them(service):
    from catsproto.adapters.instance import mooncake_block_keys

    top = (1 << 64) - 1
    request = service.request({"cs_id": 100, "hash_ids": [top, 5, 1 << 63], "input_length": 48})
    assert [int(k) for k in request.block_keys] == [
        int(k) for k in mooncake_block_keys(service.keyer, [top, 5, 1 << 63])
    ]
    assert request.block_keys[0] != mooncake_block_keys(service.keyer, [top - 1])[0]
    with pytest.raises(SteeringError, match=r"hash_ids must be a list of integers 0..2\^64-1"):
        service.request({"cs_id": 100, "hash_ids": [1 << 64], "input_length": 16})
    with pytest.raises(SteeringError, match="hash_ids"):
        service.request({"cs_id": 100, "hash_ids": [True], "input_length": 16})


def test_json_bodies_are_strict_json():
    from catsproto.adapters.strict_json import json_body

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a JSON body")

    body = {"a": float("inf"), "b": [1.5, float("nan"), {"c": float("-inf")}], "d": (2.0,)}
    assert json.loads(json_body(body), parse_constant=refuse) == {
        "a": None,
        "b": [1.5, None, {"c": None}],
        "d": [2.0],
    }
    assert json_body({"x": 1, "y": "z"}) == b'{"x": 1, "y": "z"}'

"""Steering real flows in the 4-site lab (root; under CI=true it always runs).

A client behind the ingress e1 asks the steering API where site 3's cached conversation
should go; the C-PS (fed by BGP: ExaBGP -> FRR -> ExaBGP, signed and verified) picks the
instance at site 3, the forwarder installs a host route in e1, and the client's request
travels e1 > c1 > c3 > e3 — seen by tcpdump on the c3-e3 link. The same request sent
straight to the nearest site's instance (site 1, at e1 itself) is slower: there it has to
prefill all 12,288 tokens. This kernel has no netem, so link delays are not applied and
the difference is prefill time (on the real clock: time scale 1).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from catsproto.adapters.steering import Forwarder, SteeringService
from catsproto.lab import flows, instances, runner
from tests.lab_helpers import cats4_lab, client_to_site
from tests.waits import wait_until

LAB = Path(__file__).resolve().parent.parent / "lab"
REMOTE = "10.103.0.11"  # site 3's first instance: it computed site 3's conversation
NEAREST = "10.101.0.11"  # site 1's first instance, on the ingress itself
CS_ID = 100  # the lab's service (the flows client's default --cs-id)

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="the steering lab test needs root (namespaces, FRR)")


def _site3_cached_at_ingress(lab: runner.Lab) -> bool:
    routes = [r for r in lab.routes("e1") if r.get("verified")]
    if len({r["origin"] for r in routes}) < 8:
        return False
    # site 3's first instance announced its shard routes with the conversation's keys
    return any(r["origin"] == REMOTE and r["prefix"].startswith("10.203.11.") for r in routes)


def _claims_at_e1(lab: runner.Lab) -> Callable[[], tuple[str, int]]:
    """Where the steering API would send site 3's conversation now, and the blocks it
    would credit there: the API's own decision on e1's rib.json, nothing installed."""
    config = flows.steering_config(lab)
    service = SteeringService(config, Forwarder(config.next_hops, dry_run=True))
    body = {"cs_id": CS_ID, "prompt_token_ids": instances.demo_prompt(3)}

    def claim() -> tuple[str, int]:
        answer = service.decide(body, install=False)
        return answer["instance"], answer["chosen"]["cached_blocks"]

    return claim


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with cats4_lab(
        tmp_path_factory.mktemp("steer"),
        f"s{os.getpid()}",
        feed_interval=1.0,
    ) as lab:
        yield lab


def test_cached_prefix_is_steered_to_the_remote_site_on_that_path_and_is_faster(lab):
    lab.wait_for(lambda: _site3_cached_at_ingress(lab), 40, "site 3's cache summary at e1")
    # the summaries of every tier are in: e1's RIB, as the API will read it, credits site 3
    claim, claimed = _claims_at_e1(lab), [("", -1)]
    wait_until(
        "e1's RIB crediting site 3's instance with the conversation's 24 blocks",
        lambda: claimed.append(claim()) or claimed[-1] == (REMOTE, 24),
        40,
        every=0.25,
        seen=lambda: claimed[-1],
    )
    assert "proto 250" not in lab.handle.run("e1", ["ip", "route"])  # no decision yet
    bpf = f"host {REMOTE} and tcp port 8100"
    with (
        flows.Capture(lab, "c3-e3", bpf, node="c3") as on_path,
        flows.Capture(lab, "c1-c2", bpf, node="c1") as off_path,
    ):
        result = client_to_site(lab, 3, 3, "--compare", f"http://{NEAREST}:8100", "--proxy")
    for decision in result["decisions"]:
        assert decision["instance"] == REMOTE and decision["site"] == 3
        assert decision["path"] == ["e1", "c1", "c3", "e3"]
        assert decision["route"]["gateway"] == "10.0.11.2"
        assert decision["chosen"]["cached_blocks"] == 24
    # the forwarder's route is in the ingress's table
    routes = lab.handle.run("e1", ["ip", "route", "show", "proto", "250"])
    assert f"{REMOTE} via 10.0.11.2" in routes
    # the flow's packets crossed c3-e3, both ways, and not the other branch of the core
    seen = on_path.packets()
    assert any("10.100.1.2." in line and f"> {REMOTE}.8100" in line for line in seen), seen[:5]
    assert any(f"{REMOTE}.8100 > 10.100.1.2." in line for line in seen), seen[:5]
    assert off_path.packets() == []
    # client-measured TTFT: steered (cache hit at site 3) vs nearest (site 1, no cache)
    steered = [s["ttft_ms"] for s in result["steered"]]
    nearest = [s["ttft_ms"] for s in result["nearest"]]
    assert all(s["reply"]["cached_blocks"] == 24 for s in result["steered"])
    assert result["nearest"][0]["reply"]["cached_blocks"] == 0
    assert max(steered) < min(nearest), (steered, nearest)
    proxied = result["proxied"]  # the API's proxy mode: same instance, same path
    assert proxied["reply"]["steering"]["instance"] == REMOTE
    assert proxied["reply"]["reply"]["cached_blocks"] == 24
    assert proxied["ttft_ms"] < min(nearest)
    print(
        f"\nsteered TTFT ms {steered}, nearest {nearest}; API decide (client) ms "
        f"{[d['client_api_ms'] for d in result['decisions']]}, "
        f"selector ms {[d['decision_ms'] for d in result['decisions']]}, "
        f"proxied TTFT ms {proxied['ttft_ms']}"
    )


def test_select_command_explains_a_decision_against_the_running_lab(lab):
    # site 4's conversation (the other test sent site 3's to site 1 too: cached there now)
    lab.wait_for(lambda: _site3_cached_at_ingress(lab), 40, "summaries at e1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "catsproto",
            "select",
            "--lab",
            lab.tag,
            "--root",
            str(lab.run_dir.parent),
            "--site",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "-> 10.104.0.11 (site 4), path e1 > c1 > c3 > b4 > e4" in text
    assert "cached 24 blocks" in text and "runner-up:" in text
    assert "would install): 10.104.0.11/32 via 10.0.11.2" in text
    assert "network-only CATS (no cache knowledge) would pick 10.101.0." in text


# GET an instance's /state and /health with the token read from argv[2] (or none: "-")
ASK_INSTANCE = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from catsproto.adapters.steering import get_json\n"
    "token = None if sys.argv[2] == '-' else Path(sys.argv[2]).read_text().strip()\n"
    "print(json.dumps([get_json(sys.argv[1] + p, 10, token) for p in ('/state', '/health')]))\n"
)


def test_the_lab_instances_answer_only_the_holders_of_the_lab_token(lab):
    token = flows.instances_token_file(lab)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 32
    url = f"http://{REMOTE}:8100"

    def ask(token_file: str) -> list:
        argv = [sys.executable, "-c", ASK_INSTANCE, url, token_file]
        return json.loads(lab.handle.run("client", argv, 20))

    (state_status, _), (_, health) = ask("-")
    assert state_status == 401 and health["unauthorised"] >= 1
    (state_status, state), _ = ask(str(token))
    assert state_status == 200 and sum(state["engine"]["blocks"].values()) >= 24

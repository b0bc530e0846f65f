"""The engine health gate (`adapters/engine_health.py`) and the node's re-advertising.

`healthy` is asked of a real HTTP server on 127.0.0.1 answering as vLLM does (200, 503)
and of a port nobody listens on; the gate's changes are driven by a scripted probe, one
`check` at a time (no thread, no sleeps). `NodeAgent.readvertise` is checked with a real
node whose subscriber waits on a port no engine publishes to."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import zmq

from catsproto.adapters.engine_health import HealthGate, healthy
from catsproto.adapters.instance import NodeAgent
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.node import BuilderConfig, ComputeState, DampeningPolicy, TierSpec
from catsproto.wire import Tier
from tests.test_vllm_events import KEYER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def health_server() -> Iterator[tuple[str, dict[str, int]]]:
    """A server whose /health answers the status in the returned dict (200 at first)."""
    answer = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            self.send_response(answer["status"] if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answer
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_healthy_is_a_200_from_health_and_nothing_else(
    health_server: tuple[str, dict[str, int]],
) -> None:
    url, answer = health_server
    assert healthy(url)
    answer["status"] = 503  # vLLM's answer once its engine core has died
    assert not healthy(url)
    assert not healthy(f"http://127.0.0.1:{free_port()}", timeout=1)  # nobody listens
    assert not healthy("http://[::1", timeout=1)  # not a URL: no exception either


class Script:
    """A probe answering from a list, and the calls the gate made."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = iter(answers)
        self.calls: list[str] = []

    def probe(self, url: str) -> bool:
        return next(self.answers)

    def gate(self, down_after: int = 3) -> HealthGate:
        return HealthGate(
            "http://engine",
            lambda: self.calls.append("down"),
            lambda: self.calls.append("up"),
            down_after=down_after,
            probe=self.probe,
        )


def test_the_gate_goes_down_after_failures_in_a_row_and_up_on_the_first_answer() -> None:
    script = Script([False, False, True, False, False, False, False, True, True])
    gate = script.gate(down_after=3)
    ups = [gate.check() for _ in range(9)]
    # two failures, an answer (the count starts again), then three in a row: down once,
    # the fourth failure changes nothing, the first answer brings it back
    assert ups == [True, True, True, True, True, False, False, True, True]
    assert script.calls == ["down", "up"]
    state = gate.state()
    assert state == {
        "url": "http://engine",
        "up": True,
        "probes": 9,
        "failed_probes": 6,
        "failed_in_a_row": 0,
        "down_after": 3,
        "times_down": 1,
    }
    text = gate.metrics().decode()
    assert "catsproto_node_engine_up 1.0" in text
    assert 'catsproto_node_engine_health_probes_total{outcome="ok"} 3.0' in text
    assert 'catsproto_node_engine_health_probes_total{outcome="failed"} 6.0' in text


def test_one_failure_is_enough_when_asked() -> None:
    script = Script([False, True])
    gate = script.gate(down_after=1)
    assert gate.check() is False
    assert "catsproto_node_engine_up 0.0" in gate.metrics().decode()
    assert gate.check() is True
    assert script.calls == ["down", "up"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [({"down_after": 0}, "down_after 0 is not >= 1"), ({"interval_s": 0.0}, "interval_s 0.0")],
)
def test_bad_gate_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        HealthGate("http://engine", lambda: None, lambda: None, **kwargs)


def test_the_gate_thread_probes_until_closed(health_server: tuple[str, dict[str, int]]) -> None:
    url, answer = health_server
    answer["status"] = 503
    went_down = threading.Event()
    gate = HealthGate(url, went_down.set, lambda: None, interval_s=0.05, down_after=2).start()
    try:
        assert went_down.wait(10)
        assert gate.up is False and gate.failures >= 2
    finally:
        gate.close()
    probes = gate.probes
    assert not gate._thread.is_alive()
    assert gate.probes == probes  # nothing probes after close


def test_readvertise_sends_every_route_in_the_next_round() -> None:
    """With nothing changed and the refresh a minute away a round sends nothing; after
    `readvertise` the next round sends every route again, with a higher sequence, and
    the one after is quiet again."""
    ctx = zmq.Context()
    config = BuilderConfig(
        cs_id=1,
        address="10.0.0.5",
        model_id="test/model",
        block_size=KEYER.block_size,
        bytes_per_block=1 << 20,
        dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
    )
    node = NodeAgent(
        config,
        [TierSpec(Tier.HBM, 1_000, 5, 1)],
        KEYER,
        [RankEndpoint(0, f"tcp://127.0.0.1:{free_port()}", None)],
        ComputeState,
        epoch=1,
        context=ctx,
    )
    try:
        first = node.step(0)
        assert first, "the first round advertises"
        assert node.step(0) == []
        node.readvertise()
        again = node.step(0)
        assert [r.prefix for r in again] == [r.prefix for r in first]
        assert min(r.sequence for r in again) > max(r.sequence for r in first)
        assert node.step(0) == []
    finally:
        node.close()
        ctx.term()

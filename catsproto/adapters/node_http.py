"""The HTTP face of `catsproto instance node`: health, state, advertisements, metrics.

    GET /health          {"ok": true, "ready": bool, "unauthorised": N}: open to all;
                         ready once the node runs (it may first wait for its engine)
    GET /state           the node's counters (blocks per tier, gaps, resyncs, refused
                         payloads, builder), the engine's last scraped metrics and
                         scrape errors, and whether its /health answers
    GET /advertisements  the latest advertisement per route (hex and JSON)
    GET /metrics         Prometheus text: the node's metrics, the engine scrapes' and
                         the /health probes'

The three views show the cache, so they follow `instance serve`'s rule
(`adapters/instance.py`): with an API token they answer only ``Authorization: Bearer
TOKEN`` (others get 401, counted); without one they are refused (403). Before the node
runs they answer 503. The server listens before the node waits for its engine, so a
supervisor sees the process alive (and a taken port fails at once, not after the wait).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from catsproto.adapters.http import (
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    JsonHandler,
    bearer_authorised,
    bearer_challenge,
)
from catsproto.adapters.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from catsproto.adapters.engine_health import HealthGate
    from catsproto.adapters.instance import NodeAgent
    from catsproto.adapters.vllm_metrics import EngineScraper

__all__ = ["NODE_VIEWS", "NodeServer"]

NODE_VIEWS = ("/state", "/advertisements", "/metrics")


def refused_without_token(path: str) -> str:
    return (
        f"GET {path} is served only to API token holders and no API token is configured: "
        "start the node with --api-token-file (it shows the cache, which would tell "
        "anyone whether a prompt of theirs was sent before)"
    )


class NodeServer(BackgroundHTTPServer):
    """HTTP face of a `NodeAgent` (and its `EngineScraper`, when it reads an engine's
    metrics). `attach` them once they run; until then the views answer 503."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_token: bytes | None = None,
        waiting_for: str = "",
    ) -> None:
        self.api_token = api_token
        self.node: NodeAgent | None = None
        self.scraper: EngineScraper | None = None
        self.engine_health: HealthGate | None = None
        self.waiting_for = waiting_for
        self.unauthorised = 0
        self._count_lock = threading.Lock()
        super().__init__(_handler(self), host, port)

    def attach(
        self,
        node: NodeAgent,
        scraper: EngineScraper | None = None,
        health: HealthGate | None = None,
    ) -> None:
        self.scraper, self.engine_health = scraper, health
        self.node = node

    def count_unauthorised(self) -> None:
        with self._count_lock:
            self.unauthorised += 1

    def health(self) -> dict[str, Any]:
        return {"ok": True, "ready": self.node is not None, "unauthorised": self.unauthorised}

    def state(self) -> dict[str, Any]:
        assert self.node is not None
        # the engine's state first: a restart it counts is already forgotten by the node
        engine = self.scraper.state() if self.scraper is not None else None
        return {
            "node": self.node.state(),
            "engine": engine,
            "engine_health": (
                self.engine_health.state() if self.engine_health is not None else None
            ),
            "http": {**self.stats.to_json(), "unauthorised": self.unauthorised},
        }

    def metrics(self) -> bytes:
        assert self.node is not None
        text = self.node.metrics()
        if self.scraper is not None:
            text += self.scraper.metrics()
        if self.engine_health is not None:
            text += self.engine_health.metrics()
        return text


def _handler(server: NodeServer) -> type[BaseHTTPRequestHandler]:
    token = server.api_token

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, server.health())
            elif self.path not in NODE_VIEWS:
                self._json(404, {"error": f"no {self.path}"})
            elif token is not None and not bearer_authorised(self.headers, token):
                server.count_unauthorised()
                self.close_connection = True
                self._json(401, {"error": UNAUTHORISED_ERROR}, bearer_challenge("node"))
            elif token is None:
                self._json(403, {"error": refused_without_token(self.path)})
            elif server.node is None:
                self._json(503, {"error": f"the node is waiting for {server.waiting_for}"})
            else:
                try:
                    if self.path == "/state":
                        self._json(200, server.state())
                    elif self.path == "/advertisements":
                        self._json(200, server.node.advertisements())
                    else:
                        self._send(200, server.metrics(), CONTENT_TYPE)
                except Exception as exc:  # a bug in a view: say so, keep serving
                    self._json(500, {"error": f"GET {self.path}: {type(exc).__name__}: {exc}"})

        def do_POST(self) -> None:
            self.close_connection = True  # any body is left unread
            self._json(405, {"error": "the node serves GET only"}, {"Allow": "GET"})

    return Handler

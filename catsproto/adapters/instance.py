"""A modelled inference instance that speaks vLLM's KV-event protocol, and its C-SMA.

Strategy. `ModelledEngine` stands in for a vLLM engine: it takes a prompt (token ids, or
Mooncake ``hash_ids`` plus a length), queues it FCFS, looks up its own tiered cache
(`catsproto.node.TieredCache`, exclusive LRU with demotion), sleeps for the prefill of
the uncached tokens (÷ prefill rate, on a clock scaled by ``time_scale`` so demos run
fast) and publishes every cache change as vLLM KV events on a real ZMQ PUB socket
(`VllmEventPublisher`, replay included). Block hashes are vLLM-like: the last 8 bytes of
SHA-256 over the parent hash and the block's tokens; for Mooncake prompts the trace's
hash_ids are the hashes and the token ids are synthetic.

`NodeAgent` is the C-SMA, and it knows the engine only through those events: a
`VllmEventSubscriber` feeds a mirror `TieredCache`, an `AdvertisementBuilder` turns it
into dampened advertisements (handed to ``on_routes``), and a Prometheus collector
exposes its counters. Compute metrics come from a callable (here the engine's queue).

`InstanceServer` is the HTTP face (stdlib ``http.server``, one thread per request):

    POST /generate   {"prompt_token_ids": [...]} or {"hash_ids": [...], "input_length": n}
                     -> answered when prefill ends (the first token): the client measures
                        time to first token; the body tells cached and computed tokens
                        (n at most ids × block size, every prompt at most
                        ``max_prompt_tokens``: else 400; a request the worker fails on,
                        or does not serve within ``generate_timeout`` seconds, is a 500,
                        counted in /state, and the worker serves the next)
    GET  /state      the engine's queue and cache, the node's counters, stale hits
    GET  /advertisements   the latest advertisement per route (hex and JSON)
    GET  /metrics    Prometheus text
    GET  /health     {"ok": true, "unauthorised": N}: open, counts nothing of any cache

Who may ask. A /generate reply says how much of the prompt was cached, so anyone who can
guess a prompt learns whether somebody else sent it; /state, /advertisements and
/metrics show the cache itself. With an API token (``api_token``; `instance serve
--api-token-file`) those four take only callers that send ``Authorization: Bearer
TOKEN`` (others get 401, their body unread, counted in ``unauthorised``). Without one,
/generate still serves everybody but answers with the block count alone
(`public_reply`: a cached and a cold prompt get the same body; only the time the
answer takes still differs, as it does on any engine that reuses a cache), and the
three views are refused (403). The KV events carry the prompts' token ids, and ZMQ asks
no credential, so the engine publishes them only where others cannot connect (inproc,
loopback tcp, ipc in a folder of mode 0700 of ours) unless ``accept_open_events`` says
otherwise (`catsproto.adapters.event_endpoints`).

KV payloads and pulls. With ``payload_bytes`` > 0 (and a `BlockKeyer`) the engine keeps a
synthetic payload per cached block under its advertised block key (`StoredBlock`, digest
taken at admission), dropped when the block leaves the cache: `lookup_payload` is what
its `TransferServer` serves. A /generate body may carry the steering API's instruction
``"kv_source": {"address", "port", "key_id", "expected_blocks"}``: before the request
queues, the engine pulls the prompt's block keys from that holder over mutually
authenticated TLS (`KvPuller`; the holder must be exactly ``key_id``, and a source whose key
the trust store does not authorise for that address is never dialled), admits the verified
run into its cache (so the C-SMA advertises it next) and prefills only the rest. A pull cut
off midway is resumed once from the last verified block; one that fails admits nothing.
``"expected_cached_blocks"`` is what the selector claimed; an instance that finds fewer
when the request arrives (blocks evicted while it waits in the queue are reported apart,
``lost_while_queued``) counts a *stale hit* (`transfer.StaleHitLedger`) and says whether
the first missing block was evicted after its latest advertisement (``stale_cause:
evicted``), evicted before it (``evicted-advertised``: the news was on its way, or a
false positive on a block once held), never held here (``not-held``: a summary's false
positive), or was missing at the holder (``holder``). A pull asks for the run the source
claims (``expected_blocks``), or for the whole prompt when no claim is given.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from catsproto.adapters.http import (
    READ_TIMEOUT_S,
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    BodyError,
    JsonHandler,
    bearer_authorised,
    bearer_challenge,
    read_json_body,
    withheld,
)
from catsproto.adapters.metrics import (
    CONTENT_TYPE,
)
from catsproto.adapters.modelled_engine import (
    MEDIUM_OF_TIER,
    EngineConfig,
    EngineError,
    KvPuller,
    KvSource,
    ModelledEngine,
    PromptError,
    mooncake_block_keys,
    mooncake_tokens,
    vllm_block_hash,
)
from catsproto.adapters.node_agent import NodeAgent, route_json

if TYPE_CHECKING:
    pass

__all__ = [
    "MEDIUM_OF_TIER",
    "EngineConfig",
    "EngineError",
    "InstanceServer",
    "KvPuller",
    "KvSource",
    "ModelledEngine",
    "NodeAgent",
    "PromptError",
    "mooncake_block_keys",
    "mooncake_tokens",
    "public_reply",
    "route_json",
    "vllm_block_hash",
]

PUBLIC_REPLY_FIELDS = ("blocks",)
REPLY_WITHHELD_NOTE = (
    "no API token configured: cached-block and cached-token counts, stale-hit verdict, "
    "transfer and prefill/queue timings are withheld (start the instance with "
    "--api-token-file to serve them to token holders)"
)
# the GET views that show the cache; an instance without a token refuses them (403)
TOKEN_VIEWS = ("/state", "/advertisements", "/metrics")
GENERATE_TIMEOUT_S = 600.0  # a /generate not served within this is answered 500


def public_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """A /generate reply as a caller gets it from an instance without an API token."""
    return withheld(reply, PUBLIC_REPLY_FIELDS, REPLY_WITHHELD_NOTE)


def refused_without_token(path: str) -> str:
    """The error an instance without an API token answers a GET of `path` with (403)."""
    return (
        f"GET {path} is served only to API token holders and no API token is configured: "
        "start the instance with --api-token-file (it shows the cache, which would tell "
        "anyone whether a prompt of theirs was sent before)"
    )


class InstanceServer(BackgroundHTTPServer):
    """HTTP front of an engine and (optionally) its node agent. With an `api_token`,
    POST /generate and GET /state, /advertisements, /metrics take only callers that send
    it as a bearer token (others get 401); without one, /generate answers everyone with
    `public_reply` and the views are refused (403). GET /health is open."""

    def __init__(
        self,
        engine: ModelledEngine,
        node: NodeAgent | None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        request_deadline: float = READ_TIMEOUT_S,
        api_token: bytes | None = None,
        generate_timeout: float = GENERATE_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.node = node
        self.api_token = api_token
        self.generate_timeout = generate_timeout  # seconds a /generate may wait for its prefill
        self.unauthorised = 0  # answered 401: a missing or wrong API token
        self._count_lock = threading.Lock()
        super().__init__(_handler(self), host, port, request_deadline=request_deadline)
        self.httpd.socket.listen(256)  # bursts from a steering proxy; the stdlib's is 5

    def count_unauthorised(self) -> None:
        with self._count_lock:
            self.unauthorised += 1

    def count_timeout(self) -> str:
        """Count a request not served within `generate_timeout` as the worker's failures
        are counted (``worker_errors`` in /state); the error to answer with."""
        error = f"the engine did not serve this request within {self.generate_timeout:g} s"
        self.engine.count_failure(error)
        return error

    def health(self) -> dict[str, Any]:
        return {"ok": True, "unauthorised": self.unauthorised}

    def close(self) -> None:
        super().close()
        if self.node is not None:
            self.node.close()
        self.engine.close()


def _handler(server: InstanceServer) -> type[BaseHTTPRequestHandler]:
    token = server.api_token

    class Handler(JsonHandler):
        def _refused(self) -> bool:
            """With a token configured, answer 401 to a caller without it (counted; any
            body is left unread and the connection closed) and return True."""
            if token is None or bearer_authorised(self.headers, token):
                return False
            server.count_unauthorised()
            self.close_connection = True
            self._json(401, {"error": UNAUTHORISED_ERROR}, bearer_challenge("instance"))
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, server.health())
                return
            known = self.path == "/state" or (self.path in TOKEN_VIEWS and server.node is not None)
            if not known:
                self._json(404, {"error": f"no {self.path}"})
            elif self._refused():
                return
            elif token is None:
                self._json(403, {"error": refused_without_token(self.path)})
            elif self.path == "/state":
                node = server.node.state() if server.node is not None else None
                self._json(200, {"engine": server.engine.state(), "node": node})
            elif self.path == "/advertisements" and server.node is not None:
                self._json(200, server.node.advertisements())
            elif server.node is not None:
                self._send(200, server.node.metrics(), CONTENT_TYPE)

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._json(404, {"error": f"no {self.path}"})
                return
            if self._refused():
                return
            try:
                body = read_json_body(self)
                if not isinstance(body, dict):
                    raise PromptError("the body must be a JSON object")
                result = server.engine.submit(body, timeout=server.generate_timeout)
            except BodyError as exc:
                self.close_connection = True  # what follows on the stream is unknown
                self._json(exc.status, {"error": str(exc)})
                return
            except (PromptError, ValueError) as exc:
                self._json(400, {"error": str(exc)})
                return
            except EngineError as exc:
                self._json(500, {"error": str(exc)})
                return
            except TimeoutError:  # still queued or prefilling: the worker serves it later
                self._json(500, {"error": server.count_timeout()})
                return
            self._json(200, result if token is not None else public_reply(result))

    return Handler

"""The OpenAI-compatible ingress at the C-PS: steer each request to the engine instance
with the lowest estimated time to first token, proxy it there unchanged, and check the
engine's word on what it had cached against what the selector expected.

Strategy. Three pure steps around one proxy:

    body ─▶ prompt → token ids (`tokenizer.PromptTokenizer`: the engine's own ids)
         ─▶ block keys (`SteeringService.request`: BlockKeyer at the engine's block size,
            the key space the engines' C-SMAs advertise in)
         ─▶ `PathSelector.decide` (the RIB that follows the receiver's rib.json), a host
            route installed towards the chosen instance (`steering.Forwarder`)
         ─▶ the body, unchanged, to http://<instance>:<engine port><same path>; the
            answer back unchanged, an SSE stream chunk by chunk as it arrives

    POST /v1/completions, /v1/chat/completions   (stream or not)
    GET  /v1/models     the configured models
    GET  /metrics       Prometheus text (token holders only when a token is configured)
    GET  /health        open; counts nothing of any cache

The decision goes back in headers: ``x-catsproto-instance``, ``x-catsproto-site`` and
``x-catsproto-decision-ms`` always; ``x-catsproto-expected-cached-blocks`` and
``x-catsproto-estimated-ttft-ms`` only when an API token is configured (then every
caller holds it): like the steering API's withheld fields, they tell whoever guesses a
prompt whether it is cached. (The engine's own ``usage.prompt_tokens_details`` tells the
same, and goes back unchanged: docs/ingress.md.)

Ground truth. vLLM reports ``usage.prompt_tokens_details.cached_tokens`` per request.
A non-streaming answer carries it; a stream carries it only when the client asked for
``stream_options.include_usage``. When it did not, the ingress asks on its behalf and
drops the usage-only last chunk before the client sees it (the one change to what is
forwarded; vLLM then moves ``system_fingerprint`` from the finishing chunks to that
usage chunk, so the ingress puts it back where vLLM puts it without usage). The report
goes to a `groundtruth.GroundTruthLedger` per model; RIB refreshes settle its misses.

Errors are OpenAI's (`openai_wire.IngressError`): 400 a bad body or field, 401 no or a
wrong token, 404 an unknown path or model, 413 a body over the limit, 503 no instance,
502 an engine that cannot be reached or dies mid-answer (a stream already under way
ends with an SSE error event). An engine's own 4xx/5xx answer goes back as it is.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from catsproto.adapters.http import (
    READ_TIMEOUT_S,
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    BodyError,
    bearer_authorised,
    bearer_challenge,
)
from catsproto.adapters.metrics import CONTENT_TYPE, render
from catsproto.adapters.openai_wire import (
    EnginePool,
    IngressError,
    SseSplitter,
    error_body,
    event_data,
    model_list,
    sse_event,
    usage_chunk,
    usage_of,
    with_fingerprint,
)
from catsproto.adapters.steering import (
    LISTEN_BACKLOG,
    Forwarder,
    SteeringConfig,
    SteeringService,
)
from catsproto.adapters.strict_json import json_body
from catsproto.adapters.tokenizer import PromptError, PromptTokenizer
from catsproto.selector import NoInstanceError, Request, SelectorConfig
from catsproto.selector.groundtruth import Claim, GroundTruthError, GroundTruthLedger, PendingMiss

__all__ = ["IngressServer", "IngressService", "ModelSpec", "ServedModel"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_BODY = 4 << 20  # bytes: a request body over this is refused (413)
RESOLVE_EVERY_S = 0.25  # how often pending ground-truth misses are held against the RIB
OWNER = "catsproto"
PUBLIC_HEADERS = ("instance", "site", "decision-ms")
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class ModelSpec:
    """``NAME=CS_ID:MODEL_DIR[:ENGINE_PORT]``: the model name clients send, the CS-ID
    its instances advertise, the directory of its tokenizer, its engines' HTTP port
    (None: the steering config's ``instance_port``)."""

    name: str
    cs_id: int
    model_dir: Path
    engine_port: int | None = None

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        name, eq, rest = text.partition("=")
        cs_id, colon, where = rest.partition(":")
        if not (eq and colon and name and where and cs_id.isdigit()):
            raise ValueError(f"--model {text!r} is not NAME=CS_ID:MODEL_DIR[:ENGINE_PORT]")
        port = None
        head, _, tail = where.rpartition(":")
        if head and tail.isdigit():
            where, port = head, int(tail)
            if not 1 <= port <= 65535:
                raise ValueError(f"--model {text!r}: engine port {port} is not 1..65535")
        if int(cs_id) > 0xFFFFFFFF:
            raise ValueError(f"--model {text!r}: CS-ID {cs_id} is not a u32")
        return cls(name, int(cs_id), Path(where), port)


@dataclass
class ServedModel:
    """One model: its tokenizer, its own selector (its key space), its ground truth."""

    spec: ModelSpec
    tokenizer: PromptTokenizer
    service: SteeringService
    ledger: GroundTruthLedger
    created: int

    @property
    def engine_port(self) -> int:
        return self.spec.engine_port or self.service.config.instance_port


def served_model(
    spec: ModelSpec,
    config: SteeringConfig,
    *,
    install_routes: bool = True,
    forwarder: Forwarder | None = None,
    grace_ms: int = 5_000,
) -> ServedModel:
    """A model served with `config`'s key space. Real engines cannot pull KV from one
    another on the selector's word, so the selector prices only local caches."""
    forwarder = forwarder or Forwarder(
        config.next_hops, source=config.source, netns=config.netns, dry_run=not install_routes
    )
    selector = SelectorConfig(
        site_nodes=config.sites,
        default_block_size=config.block_size,
        pending=config.pending,
        allow_remote_kv=False,
    )
    service = SteeringService(config, forwarder, selector_config=selector)
    return ServedModel(
        spec,
        PromptTokenizer(spec.model_dir),
        service,
        GroundTruthLedger(grace_ms=grace_ms),
        int(time.time()),
    )


@dataclass
class Prepared:
    """A request ready to steer: its model, token ids, the bytes to forward."""

    model: ServedModel
    path: str
    token_ids: list[int]
    forward: bytes
    stream: bool
    drop_usage: bool  # the ingress asked for usage the client did not: drop that chunk


@dataclass
class Steered:
    """Where a request goes, and what the selector expected there."""

    address: str
    site: int
    expected_blocks: int
    estimated_ttft_ms: float
    decision_ms: float
    sequence: tuple[int, int]
    block_keys: np.ndarray

    def headers(self, full: bool) -> dict[str, str]:
        out = {
            "x-catsproto-instance": self.address,
            "x-catsproto-site": str(self.site),
            "x-catsproto-decision-ms": f"{self.decision_ms:.3f}",
        }
        if full:
            out["x-catsproto-expected-cached-blocks"] = str(self.expected_blocks)
            out["x-catsproto-estimated-ttft-ms"] = f"{self.estimated_ttft_ms:.3f}"
        return out


def _option(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise IngressError(400, f"{name} has the wrong type", param=name, code="invalid_type")
    return value


class IngressService:
    """Request in, steered and proxied; the counters behind /metrics and /health."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        *,
        pool: EnginePool | None = None,
        instance_token: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not models:
            raise ValueError("the ingress needs at least one model")
        self.models = models
        self.pool = pool or EnginePool()
        self.instance_token = instance_token
        self.clock = clock
        self.fingerprints: dict[tuple[str, int], str] = {}  # engine -> system_fingerprint
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "catsproto_ingress_requests",
            "requests answered, by model, endpoint and HTTP status",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "catsproto_ingress_decisions",
            "steering decisions, by model and chosen instance",
            ["model", "instance"],
            registry=self.registry,
        )
        self.proxy_errors = Counter(
            "catsproto_ingress_proxy_errors",
            "requests the engine could not answer: unreachable, refused our token, died mid-answer",
            ["model", "kind"],
            registry=self.registry,
        )
        self.token_mismatch = Counter(
            "catsproto_ingress_prompt_token_mismatch",
            "answers whose prompt_tokens differ from the ingress's own token count "
            "(a tokenizer that is not the engine's: block keys name nothing)",
            ["model"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "catsproto_ingress_decision_seconds",
            "tokenize, key and decide, per request",
            ["model"],
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "catsproto_ingress_upstream_seconds",
            "from sending to the engine to its response headers (streams: the first token)",
            ["model"],
            buckets=UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(GroundTruthCollector(self))
        self.unauthorised = 0
        self.bad_requests = 0
        self.internal_errors = 0
        self._count_lock = threading.Lock()

    def count(self, name: str) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + 1)

    # ---- the pure steps -------------------------------------------------------------------

    def prepare(self, path: str, raw: bytes) -> Prepared:
        """The request's model, token ids and the bytes to forward, or IngressError."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise IngressError(400, f"body is not JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise IngressError(400, "the body must be a JSON object", code="invalid_json")
        name = body.get("model")
        if not isinstance(name, str):
            raise IngressError(400, "model is required (a string)", param="model")
        model = self.models.get(name)
        if model is None:
            raise IngressError(
                404,
                f"the model {name!r} does not exist here (served: {', '.join(self.models)})",
                param="model",
                code="model_not_found",
            )
        stream = _option(body, "stream", bool, False)
        options = _option(body, "stream_options", dict, {})
        try:
            if path == COMPLETIONS:
                if "prompt" not in body:
                    raise IngressError(400, "prompt is required", param="prompt")
                ids = model.tokenizer.completion_ids(body["prompt"])
            else:
                if "messages" not in body:
                    raise IngressError(400, "messages is required", param="messages")
                ids = model.tokenizer.chat_ids(
                    body["messages"],
                    add_generation_prompt=_option(body, "add_generation_prompt", bool, True),
                    continue_final_message=_option(body, "continue_final_message", bool, False),
                    chat_template_kwargs=_option(body, "chat_template_kwargs", dict, {}),
                    tools=_option(body, "tools", list, None),
                    documents=_option(body, "documents", list, None),
                )
        except PromptError as exc:
            raise IngressError(400, str(exc), param=exc.param) from None
        drop_usage = stream and options.get("include_usage") is not True
        forward = raw
        if drop_usage:  # ask for the usage; continuous stats stay off, as they were
            body["stream_options"] = {
                **options,
                "include_usage": True,
                "continuous_usage_stats": False,
            }
            forward = json.dumps(body).encode()
        return Prepared(model, path, ids, forward, stream, drop_usage)

    def decide(self, prepared: Prepared, *, install: bool = True) -> Steered:
        """Key the prompt's blocks and choose (`SteeringService`), the route installed."""
        model = prepared.model
        service = model.service
        started = time.perf_counter()
        ids = prepared.token_ids  # checked by the tokenizer: no second pass over them
        config = service.config
        if len(ids) // config.block_size > service.block_limit:
            raise IngressError(
                400,
                f"the prompt's {len(ids)} tokens are {len(ids) // config.block_size} blocks, "
                f"over the limit of {service.block_limit}",
                code="prompt_too_long",
            )
        # keyed exactly as the engines' C-SMAs key what their engine stores
        keys = np.array(service.keyer.block_keys(ids), dtype=np.uint64)
        request = Request(
            model.spec.cs_id, keys, len(ids), config.ingress, key_space=config.key_space
        )
        with service._lock:
            now_ms = int(self.clock() * 1000)
            service.feed.refresh(now_ms)
            try:
                decision = service.selector.decide(request, now_ms)
            except NoInstanceError as exc:
                raise IngressError(503, str(exc), code="no_instance") from None
            chosen = decision.chosen
            table = service.feed.rib.services.get(model.spec.cs_id)
            inst = table.by_address.get(chosen.address) if table is not None else None
            sequence = inst.epoch_seq if inst is not None else (0, 0)
            service.decisions += 1
        if install:
            service.forwarder.install(str(chosen.address), chosen.path)
        elapsed = time.perf_counter() - started
        self.decision_seconds.labels(model.spec.name).observe(elapsed)
        self.decisions.labels(model.spec.name, str(chosen.address)).inc()
        return Steered(
            str(chosen.address),
            chosen.site_id,
            chosen.cached_blocks,
            chosen.total_ms,
            1000 * elapsed,
            sequence,
            request.block_keys,
        )

    # ---- ground truth -----------------------------------------------------------------------

    def record(self, prepared: Prepared, steered: Steered, usage: dict[str, Any]) -> None:
        """The engine's report into the model's ledger (counted in bad_reports if it
        cannot be true; an engine without prompt-token details reports nothing)."""
        model = prepared.model
        details = usage.get("prompt_tokens_details")
        prompt_tokens = usage.get("prompt_tokens")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            return
        if prompt_tokens != len(prepared.token_ids):
            self.token_mismatch.labels(model.spec.name).inc()
        service = model.service
        with service._lock:
            now_ms = int(self.clock() * 1000)
            with contextlib.suppress(GroundTruthError):
                model.ledger.record(
                    steered.address,
                    model.spec.cs_id,
                    steered.expected_blocks,
                    cached,
                    prompt_tokens,
                    service.config.block_size,
                    now_ms=now_ms,
                    sequence=steered.sequence,
                    block_keys=steered.block_keys,
                )

    def resolve(self) -> int:
        """Hold every model's pending misses against its RIB as it stands now."""
        settled = 0
        for model in self.models.values():
            service = model.service
            with service._lock:
                if not model.ledger.pending:
                    continue
                now_ms = int(self.clock() * 1000)
                service.feed.refresh(now_ms)
                settled += model.ledger.resolve(now_ms, _claims(service))
        return settled

    def ground_truth(self) -> dict[str, Any]:
        out = {}
        for name, model in self.models.items():
            with model.service._lock:
                out[name] = model.ledger.to_json()
        return out

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "models": list(self.models),
            "bad_requests": self.bad_requests,
            "unauthorised": self.unauthorised,
            "internal_errors": self.internal_errors,
        }


def _claims(service: SteeringService) -> Callable[[PendingMiss], Claim | None]:
    """What the RIB says now of a miss's origin (the service's lock is held)."""

    def claim(miss: PendingMiss) -> Claim | None:
        table = service.feed.rib.services.get(miss.cs_id)
        inst = table.by_address.get(ipaddress.ip_address(miss.origin)) if table else None
        if inst is None:
            return None
        held = inst.lookup(np.array([miss.first_missed_key], dtype=np.uint64))
        return Claim(inst.epoch_seq, bool(held[0]))

    return claim


class GroundTruthCollector(Collector):
    """The ledgers' counters at scrape time, per model and origin."""

    def __init__(self, service: IngressService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        blocks = CounterMetricFamily(
            "catsproto_ingress_groundtruth_blocks",
            "blocks by ground-truth outcome: confirmable (the selector's claim the "
            "answer can confirm), confirmed, missed, stale, false_positive, unexpected",
            labels=["model", "origin", "outcome"],
        )
        requests = CounterMetricFamily(
            "catsproto_ingress_groundtruth_requests",
            "requests by ground-truth outcome (all, missed, stale, false_positive, "
            "unexpected, expired)",
            labels=["model", "origin", "outcome"],
        )
        agreement = GaugeMetricFamily(
            "catsproto_ingress_groundtruth_agreement",
            "confirmed over confirmable blocks",
            labels=["model", "origin"],
        )
        pending = GaugeMetricFamily(
            "catsproto_ingress_groundtruth_pending_blocks",
            "missed blocks not yet settled stale or false positive",
            labels=["model", "origin"],
        )
        for name, view in self.service.ground_truth().items():
            rows = [("total", view["total"]), *view["origins"].items()]
            for origin, c in rows:
                for outcome in ("confirmable", "confirmed", "missed", "stale"):
                    blocks.add_metric([name, origin, outcome], c[f"{outcome}_blocks"])
                blocks.add_metric([name, origin, "false_positive"], c["false_positive_blocks"])
                blocks.add_metric([name, origin, "unexpected"], c["unexpected_blocks"])
                requests.add_metric([name, origin, "all"], c["requests"])
                for outcome in ("missed", "stale", "false_positive", "unexpected", "expired"):
                    requests.add_metric([name, origin, outcome], c[f"{outcome}_requests"])
                agreement.add_metric([name, origin], c["agreement"])
                pending.add_metric([name, origin], c["pending_blocks"])
        yield from (blocks, requests, agreement, pending)


# ---- HTTP ---------------------------------------------------------------------------------


class IngressServer(BackgroundHTTPServer):
    """The OpenAI front door over HTTP (stdlib server, one thread per connection). With
    an `api_token`, everything but GET /health takes only callers that send it as a
    bearer token (others get 401) and the decision headers are given in full; without
    one, requests are served to all with the public decision headers only and /metrics
    is refused (403). A thread holds pending ground-truth misses against the RIB."""

    def __init__(
        self,
        service: IngressService,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_token: bytes | None = None,
        install_routes: bool = True,
        max_body: int = MAX_BODY,
        read_timeout: float = READ_TIMEOUT_S,
        max_handlers: int = 512,
    ) -> None:
        self.service = service
        super().__init__(
            _handler(service, api_token, install_routes, max_body, read_timeout),
            host,
            port,
            max_handlers=max_handlers,
            request_deadline=read_timeout,
        )
        self.httpd.socket.listen(LISTEN_BACKLOG)
        self._stop = threading.Event()
        self._resolver = threading.Thread(target=self._resolve, daemon=True, name="groundtruth")

    def start(self) -> IngressServer:
        super().start()
        self._resolver.start()
        return self

    def _resolve(self) -> None:
        while not self._stop.wait(RESOLVE_EVERY_S):
            try:
                self.service.resolve()
            except Exception as exc:  # a bug of ours: say so, keep serving
                print(f"ingress: ground truth: {type(exc).__name__}: {exc}", file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        super().close()
        self.service.pool.close()


def read_body(handler: BaseHTTPRequestHandler, max_bytes: int) -> bytes:
    """The request body as bytes, by its Content-Length (BodyError otherwise)."""
    if "Content-Length" not in handler.headers:
        if handler.headers.get("Transfer-Encoding"):
            raise BodyError(411, "send the body with a Content-Length (no chunked bodies)")
        raise BodyError(400, "a JSON body is required")
    raw_length = handler.headers.get("Content-Length", "").strip()
    if not raw_length.isdigit():
        raise BodyError(400, f"Content-Length {raw_length[:40]!r} is not a byte count")
    length = int(raw_length)
    if length > max_bytes:
        raise BodyError(413, f"body of {length} bytes is over the {max_bytes}-byte limit")
    try:
        raw = handler.rfile.read(length)
    except TimeoutError:
        raise BodyError(408, f"body: {length} bytes announced, not sent in time") from None
    if len(raw) < length:
        raise BodyError(400, f"body: {length} bytes announced, {len(raw)} sent")
    return raw


class _UpstreamFailed(Exception):
    """The engine could not be asked (before any answer): a 502."""


def _handler(
    service: IngressService,
    api_token: bytes | None,
    install_routes: bool,
    max_body: int,
    read_timeout: float,
) -> type[BaseHTTPRequestHandler]:
    full = api_token is not None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        timeout = read_timeout

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(
            self,
            status: int,
            body: bytes,
            content_type: str = "application/json",
            headers: dict[str, str] | None = None,
        ) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, exc: IngressError, headers: dict[str, str] | None = None) -> None:
            self._send(exc.status, json_body(exc.to_json()), headers=headers)

        def _authorised(self) -> bool:
            if api_token is None or bearer_authorised(self.headers, api_token):
                return True
            service.count("unauthorised")
            self.close_connection = True  # the body, if any, is left unread
            self._error(
                IngressError(401, UNAUTHORISED_ERROR, code="invalid_api_key"),
                bearer_challenge("ingress"),
            )
            return False

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                body = {**service.health(), "http": self.server.stats.to_json()}  # type: ignore[attr-defined]
                self._send(200, json_body(body))
            elif path not in ("/v1/models", "/metrics"):
                self._error(IngressError(404, f"no GET {path}", code="not_found"))
            elif not self._authorised():
                return
            elif path == "/v1/models":
                models = [(m.spec.name, m.created, OWNER) for m in service.models.values()]
                self._send(200, json_body(model_list(models)))
            elif api_token is None:
                self._error(
                    IngressError(
                        403,
                        "GET /metrics is served only to API token holders and no API token "
                        "is configured: start the ingress with --api-token-file (its "
                        "ground-truth counters move with each request's cache outcome)",
                        code="forbidden",
                    )
                )
            else:
                self._send(200, render(service.registry), CONTENT_TYPE)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            endpoint = path if path in (COMPLETIONS, CHAT) else "other"
            if endpoint == "other":
                self.close_connection = True  # its body is left unread
                self._error(IngressError(404, f"no POST {path}", code="not_found"))
                return
            if not self._authorised():
                service.requests.labels("", endpoint, "401").inc()
                return
            name, status = "", 500
            try:
                raw = read_body(self, max_body)
                prepared = service.prepare(path, raw)
                name = prepared.model.spec.name
                steered = service.decide(prepared, install=install_routes)
                status = self._proxy(prepared, steered)
            except BodyError as exc:
                service.count("bad_requests")
                self.close_connection = True
                status = exc.status
                self._error(IngressError(exc.status, str(exc)))
            except IngressError as exc:
                if exc.status < 500:
                    service.count("bad_requests")
                status = exc.status
                self._error(exc)
            except _UpstreamFailed as exc:
                status = 502
                self._error(IngressError(502, str(exc), code="engine_unreachable"))
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client left: nobody to answer
            except Exception as exc:  # a bug of ours: answer, count, log, serve on
                service.count("internal_errors")
                print(f"ingress: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self._error(IngressError(500, f"internal error: {type(exc).__name__}"))
            finally:
                service.requests.labels(name, endpoint, str(status)).inc()

        # ---- the proxy ----------------------------------------------------------------

        def _ask(
            self, prepared: Prepared, steered: Steered
        ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
            """Send the body to the chosen engine on a pooled connection (a reused one
            the engine closed meanwhile is replaced once); its response's head."""
            port = prepared.model.engine_port
            headers = {
                "Content-Type": "application/json",
                "Accept": "text/event-stream" if prepared.stream else "application/json",
            }
            if service.instance_token is not None:
                headers["Authorization"] = "Bearer " + service.instance_token.decode()
            where = f"{steered.address}:{port}"
            for attempt in (0, 1):
                try:
                    conn, reused = service.pool.take(steered.address, port)
                except OSError as exc:
                    raise _UpstreamFailed(f"engine {where} unreachable: {exc}") from None
                try:
                    conn.request("POST", prepared.path, prepared.forward, headers)
                    return conn, conn.getresponse()
                except (http.client.HTTPException, OSError) as exc:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # an idle keep-alive the engine had closed
                    raise _UpstreamFailed(
                        f"engine {where} failed before answering: {type(exc).__name__}: {exc}"
                    ) from None
            raise AssertionError("unreachable")

        def _proxy(self, prepared: Prepared, steered: Steered) -> int:
            name = prepared.model.spec.name
            started = time.perf_counter()
            try:
                conn, resp = self._ask(prepared, steered)
            except _UpstreamFailed:
                service.proxy_errors.labels(name, "unreachable").inc()
                raise
            service.upstream_seconds.labels(name).observe(time.perf_counter() - started)
            if resp.status in (401, 403):  # the engine's API key, not the caller's fault
                resp.read()
                conn.close()
                service.proxy_errors.labels(name, "refused").inc()
                sent = "a wrong token" if service.instance_token is not None else "no token"
                raise IngressError(
                    502,
                    f"engine {steered.address} answered {resp.status} ({sent} sent): start "
                    "the ingress with --instance-token-file holding the engines' API key",
                    code="engine_refused",
                )
            headers = steered.headers(full)
            kind = resp.getheader("Content-Type", "application/json")
            if not (resp.status == 200 and kind.startswith("text/event-stream")):
                try:
                    body = resp.read()
                except (http.client.HTTPException, OSError) as exc:
                    conn.close()
                    service.proxy_errors.labels(name, "died").inc()
                    raise _UpstreamFailed(
                        f"engine {steered.address} died mid-answer: {type(exc).__name__}"
                    ) from None
                self._done(prepared, steered, conn, resp)
                if resp.status == 200:
                    usage = usage_of(body)
                    if usage is not None:
                        service.record(prepared, steered, usage)
                self._send(resp.status, body, kind, headers)
                return resp.status
            self._stream(prepared, steered, conn, resp, kind, headers)
            return 200

        def _done(
            self,
            prepared: Prepared,
            steered: Steered,
            conn: http.client.HTTPConnection,
            resp: http.client.HTTPResponse,
        ) -> None:
            if resp.will_close:
                conn.close()
            else:
                service.pool.give_back(steered.address, prepared.model.engine_port, conn)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _stream(
            self,
            prepared: Prepared,
            steered: Steered,
            conn: http.client.HTTPConnection,
            resp: http.client.HTTPResponse,
            kind: str,
            headers: dict[str, str],
        ) -> None:
            """Forward the engine's events as they come (chunked), usage read on the way."""
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", kind)
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            engine = (steered.address, prepared.model.engine_port)
            splitter = SseSplitter()
            held: list[bytes] = []  # finishing chunks waiting for the fingerprint
            try:
                while True:
                    try:
                        data = resp.read1(65536)
                    except (http.client.HTTPException, OSError) as exc:
                        raise _UpstreamFailed(f"{type(exc).__name__}: {exc}") from None
                    if not data:
                        break
                    out = []
                    for event in splitter.feed(data):
                        payload = event_data(event)
                        if prepared.drop_usage:
                            chunk = usage_chunk(payload)
                            if chunk is not None:
                                service.record(prepared, steered, chunk.usage)
                                if chunk.system_fingerprint:
                                    service.fingerprints[engine] = chunk.system_fingerprint
                                out += [self._fingerprinted(e, engine) for e in held]
                                held.clear()
                                continue
                            if b'"finish_reason":"' in payload:
                                if engine in service.fingerprints:
                                    event = self._fingerprinted(event, engine)
                                else:
                                    held.append(event)
                                    continue
                        elif (
                            usage := usage_of(payload)
                        ) is not None and b'"choices":[]' in payload:
                            service.record(prepared, steered, usage)
                        out.append(event)
                    if out:
                        self._chunk(b"".join(out))
                tail = b"".join(held) + splitter.rest
                if tail:
                    self._chunk(tail)
                self._done(prepared, steered, conn, resp)
            except _UpstreamFailed as exc:
                conn.close()
                service.proxy_errors.labels(prepared.model.spec.name, "died").inc()
                error = error_body(
                    502,
                    f"engine {steered.address} died mid-stream: {exc}",
                    code="engine_died",
                )
                self._chunk(sse_event(error))
                self.close_connection = True
            except BaseException:
                conn.close()
                raise
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _fingerprinted(self, event: bytes, engine: tuple[str, int]) -> bytes:
            fingerprint = service.fingerprints.get(engine)
            if fingerprint is None:
                return event
            payload = event_data(event)
            return b"data: " + with_fingerprint(payload, fingerprint) + b"\n\n"

    return Handler


def load_models(
    specs: list[ModelSpec],
    config: SteeringConfig,
    configs: dict[str, SteeringConfig] | None = None,
    *,
    install_routes: bool = True,
    grace_ms: int = 5_000,
) -> dict[str, ServedModel]:
    """One `ServedModel` per spec, each with its own config (`configs`) or the shared one;
    one forwarder for all, so a route is installed once whichever model steered there."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a model is named twice: {names}")
    forwarder = Forwarder(
        config.next_hops, source=config.source, netns=config.netns, dry_run=not install_routes
    )
    out = {}
    for spec in specs:
        own = (configs or {}).get(spec.name, config)
        out[spec.name] = served_model(
            spec, own, install_routes=install_routes, forwarder=forwarder, grace_ms=grace_ms
        )
    return out

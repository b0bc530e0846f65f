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

What a caller may learn. A token holder (an API token is configured, and then every
caller but GET /health's holds it) is told the whole decision in headers
(`DECISION_HEADERS`: the instance, its site, the expected cached blocks, the estimated
TTFT, the decision's time) and gets the engine's answer unchanged. Anybody else (no
token is configured) is told nothing of where a prompt went or what was cached there:
no decision header, and the answer with ``usage.prompt_tokens_details`` and
``system_fingerprint`` set to null (`openai_wire.public_answer`), as an engine without
prompt-token details would send it. Which instance holds a guessed prompt, or that it
is held at all, would otherwise be one request away (docs/security.md). GET /health
without the token says only that the ingress is up.

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
import dataclasses
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from catsproto.adapters.openai_wire import (
    EnginePool,
    IngressError,
)
from catsproto.adapters.steering import (
    Forwarder,
    SteeringConfig,
    SteeringService,
)
from catsproto.adapters.tokenizer import PromptError, PromptTokenizer
from catsproto.selector import Estimate, NoInstanceError, Request, SelectorConfig
from catsproto.selector.groundtruth import Claim, GroundTruthError, GroundTruthLedger, PendingMiss

__all__ = ["IngressService", "ModelSpec", "ServedModel", "load_models"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_BODY = 4 << 20  # bytes: a request body over this is refused (413)
RESOLVE_EVERY_S = 0.25  # how often pending ground-truth misses are held against the RIB
OWNER = "catsproto"
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
    """Where a request goes, and what the selector expected there (`estimate`: every
    term of the chosen candidate's TTFT)."""

    address: str
    site: int
    expected_blocks: int
    estimated_ttft_ms: float
    decision_ms: float
    sequence: tuple[int, int]
    block_keys: np.ndarray
    estimate: Estimate

    def headers(self, token_holder: bool) -> dict[str, str]:
        """The decision headers a caller is sent: all of `DECISION_HEADERS` to a token
        holder, none to anybody else (the module's "What a caller may learn")."""
        if not token_holder:
            return {}
        return {name: value(self) for name, value in DECISION_HEADERS}


# The decision as a token holder is told it, one header a row; nobody else gets any
# (docs/security.md, "What a caller without a token may learn"). A new term of the
# estimate is a new row here, e.g. ("x-catsproto-x-ms", lambda s: f"{s.estimate.x_ms:.3f}").
DECISION_HEADERS: tuple[tuple[str, Callable[[Steered], str]], ...] = (
    ("x-catsproto-instance", lambda s: s.address),
    ("x-catsproto-site", lambda s: str(s.site)),
    ("x-catsproto-decision-ms", lambda s: f"{s.decision_ms:.3f}"),
    ("x-catsproto-expected-cached-blocks", lambda s: str(s.expected_blocks)),
    ("x-catsproto-estimated-ttft-ms", lambda s: f"{s.estimated_ttft_ms:.3f}"),
    # the eviction term (part of the estimate): blocks the placement evicts, their ms
    ("x-catsproto-evicted-blocks", lambda s: f"{s.estimate.evicted_blocks:g}"),
    ("x-catsproto-evict-ms", lambda s: f"{s.estimate.evict_ms:.3f}"),
)


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
            "requests, by model, endpoint and the HTTP status sent (disconnected: none was)",
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
            raise IngressError(400, str(exc), param=exc.param, code=exc.code) from None
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

    def decide(
        self, prepared: Prepared, *, install: bool = True, policy: str = "catsproto"
    ) -> Steered:
        """Key the prompt's blocks and choose (`SteeringService`), the route installed.
        `policy` (a token holder's ``x-catsproto-policy``, for comparisons): "catsproto"
        (the path selector with the engines' caches), "compute-aware" (the same selector
        without the prompt's block keys: network and load, no cache) or "nearest" (the
        live instance with the shortest path, nothing else), as network-only CATS would."""
        if policy not in POLICIES:
            raise IngressError(
                400,
                f"x-catsproto-policy {policy!r}: one of {', '.join(POLICIES)}",
                code="invalid_policy",
            )
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
                if policy == "nearest":
                    chosen = _nearest(service, request)
                else:
                    if policy == "compute-aware":
                        request = dataclasses.replace(request, block_keys=keys[:0])
                    chosen = service.selector.decide(request, now_ms).chosen
            except NoInstanceError as exc:
                raise IngressError(503, str(exc), code="no_instance") from None
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
            keys,
            chosen,
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

    def health(self, token_holder: bool = True) -> dict[str, Any]:
        """GET /health: in full for a token holder; anybody else is told only that the
        ingress is up (the model names and counters are what /v1/models and /metrics
        keep for token holders)."""
        if not token_holder:
            return {
                "ok": True,
                "withheld": "the models and counters are served to API token holders only",
            }
        return {
            "ok": True,
            "models": list(self.models),
            "bad_requests": self.bad_requests,
            "unauthorised": self.unauthorised,
            "internal_errors": self.internal_errors,
        }


POLICIES = ("catsproto", "compute-aware", "nearest")


def _nearest(service: SteeringService, request: Request) -> Estimate:
    """Network-only CATS at its plainest: the live instance of the request's service at
    the end of the shortest path from the ingress (ties: the lower address); nothing of
    its cache or load is looked at, so it is expected to hold nothing. Lock held."""
    table = service.feed.rib.services.get(request.cs_id)
    selector = service.selector
    best: tuple[float, int, Any, Any] | None = None
    for inst in table.live() if table is not None else []:
        path = selector.network.path(request.ingress, selector.config.node_of(inst.site_id))
        if path is None:
            continue
        key = (path.delay_ms, int(inst.address), inst, path)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        raise NoInstanceError(f"no reachable instance for CS-ID {request.cs_id}")
    delay, _, inst, path = best
    nan = float("nan")
    return Estimate(
        address=inst.address,
        site_id=inst.site_id,
        path=tuple(path.nodes),
        rtt_ms=2 * delay,
        upload_ms=nan,
        queue_ms=nan,
        cached_blocks=0,
        expected_cached_blocks=0.0,
        fpr=0.0,
        stale=False,
        kv_source=None,
        fetch_ms=nan,
        prefill_ms=nan,
        total_ms=nan,
    )


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

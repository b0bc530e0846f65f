"""docs/openapi.yaml against the real servers: the steering API, the OpenAI ingress, the
modelled instance (`instance serve`) and the node's HTTP face (`instance node`).

Strategy. The document is first checked as a document (OpenAPI 3.1 shape, every
`$ref` resolves, every schema is valid JSON Schema 2020-12). Then each server runs in
this process on 127.0.0.1 at a free port, as the existing tests start them: the steering
service over the lab's cats4 RIB (dry-run forwarder), a modelled instance with its node
agent, a node face whose engine metrics are the captured vLLM text, and the ingress with
the lab's tiny-llama tokenizer in front of `StubEngine`, a small stand-in answering as vLLM's
OpenAI server does (no real engine). Every documented operation is called, with valid
requests and with each documented error provoked; every reply's status must be documented
for that operation and that server, its content type listed and its body valid against
the documented schema (`Contract.check`). Each server's test ends by asserting that every
(operation, status) the document gives that server was seen. The reverse holds too: the
paths and methods each handler tests for in its source (`routes_in_code`, read with `ast`)
must all be documented, so a new endpoint without a document fails here.

Shared paths (`/health` is on all four servers, `/state` on two) hold one operation each;
a body that differs by server is an `anyOf` whose branches name their servers in
``x-catsproto-servers``, and a status only some servers answer says so on the response.
`Contract` validates a reply only against the branches of its own server.

No root, no engine, no subprocess: the `core` kind of tests/conftest.py (about 6 s for the
module; the three server tests take about a second each).
"""

from __future__ import annotations

import ast
import contextlib
import http.client
import importlib
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from catsproto.adapters.engine_health import HealthGate
from catsproto.adapters.ingress import IngressService, ModelSpec, load_models
from catsproto.adapters.ingress_http import IngressServer
from catsproto.adapters.instance import (
    EngineConfig,
    EngineError,
    InstanceServer,
    ModelledEngine,
    NodeAgent,
)
from catsproto.adapters.node_http import NodeServer
from catsproto.adapters.steering import (
    Forwarder,
    SteeringConfig,
    SteeringServer,
    SteeringService,
)
from catsproto.adapters.tokenizer import PromptTokenizer
from catsproto.adapters.vllm_events import RankEndpoint
from catsproto.adapters.vllm_metrics import EngineScraper, parse_metrics
from catsproto.keys import BlockKeyer
from catsproto.lab import instances
from catsproto.lab.topology import InstanceSpec
from catsproto.node import BuilderConfig, DampeningPolicy
from tests.test_steering import NEXT_HOPS, _config, _rib_json

ROOT = Path(__file__).resolve().parents[1]
DOC_PATH = ROOT / "docs" / "openapi.yaml"
DOC_URI = "urn:catsproto:openapi"
TINY_LLAMA = ROOT / "lab" / "engine" / "tiny-llama"
VLLM_IDLE = ROOT / "tests" / "data" / "vllm_metrics" / "idle.txt"

SERVERS = ("steering", "ingress", "instance", "node")
DEFAULT_URLS = {  # where each server listens by default (the document's `servers`)
    "steering": "http://127.0.0.1:8080",
    "ingress": "http://127.0.0.1:8000",
    "instance": "http://127.0.0.1:8100",
    "node": "http://127.0.0.1:8101",
}
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# each server's handler module: where `routes_in_code` reads the paths it serves
HANDLER_MODULES = {
    "steering": "catsproto.adapters.steering",
    "ingress": "catsproto.adapters.ingress_http",
    "instance": "catsproto.adapters.instance",
    "node": "catsproto.adapters.node_http",
}
PATH_LITERAL = re.compile(r"^/[A-Za-z0-9_./-]+$")

TOKEN = b"token-of-the-openapi-tests-0123456789"
INSTANCE_TOKEN = b"instance-token-of-the-openapi-tests"
DEADLINE_S = 1.0  # each server's request deadline: a body not sent within it is a 408
CS_ID = 100  # the lab's service: cats4's instances, and the ingress's stub engine
DEMO = {"cs_id": CS_ID, "prompt_token_ids": instances.demo_prompt(3)}  # cached at site 3


# ---- the document ---------------------------------------------------------------------


def load_document(path: Path = DOC_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def escape(part: str) -> str:
    """One JSON Pointer reference token (RFC 6901)."""
    return part.replace("~", "~0").replace("/", "~1")


def pointer(*parts: str | int) -> str:
    return "#/" + "/".join(escape(str(p)) for p in parts)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    """The value a local reference (``#/a/b``) points at; KeyError if it points nowhere."""
    if not ref.startswith("#/"):
        raise KeyError(f"{ref}: only local references are used in this document")
    node: Any = doc
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def walk(node: Any, at: str = "#") -> Iterator[tuple[str, Any]]:
    """Every (pointer, value) under `node`, depth first, in a loop (no recursion)."""
    stack = [(at, node)]
    while stack:
        here, value = stack.pop()
        yield here, value
        if isinstance(value, dict):
            stack += [(f"{here}/{escape(str(k))}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{here}/{i}", v) for i, v in enumerate(value)]


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method, item[method]


def servers_of(node: dict[str, Any]) -> tuple[str, ...]:
    """The servers a response or schema is for (``x-catsproto-servers``; absent: all)."""
    return tuple(node.get("x-catsproto-servers", SERVERS))


class Contract:
    """The document as a checker of replies. `seen` collects (server, method, path,
    status) of every reply checked, so a test can ask what it has not yet exercised."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry: Registry = Registry().with_resource(DOC_URI, resource)
        self.seen: set[tuple[str, str, str, str]] = set()

    def deref(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = resolve(self.doc, node["$ref"])
        return node

    def response(self, server: str, method: str, path: str, status: int) -> dict[str, Any]:
        """The documented response of `server` to `method path` with `status`."""
        item = self.doc["paths"].get(path)
        assert item is not None, f"{path} is not in the document"
        op = item.get(method)
        assert op is not None, f"{method.upper()} {path} is not in the document"
        assert server in op.get("tags", ()), (
            f"{method.upper()} {path} is not documented for the {server} server"
        )
        raw = op["responses"].get(str(status))
        assert raw is not None, (
            f"{server}: {method.upper()} {path} answered {status}, which is not documented "
            f"(documented: {sorted(op['responses'])})"
        )
        response = self.deref(raw)
        assert server in servers_of(response), (
            f"{server}: {method.upper()} {path} answered {status}, documented only for "
            f"{servers_of(response)}"
        )
        return response

    def branches(self, location: str, server: str) -> list[str]:
        """The pointers of the schema at `location` that apply to `server`: the `anyOf`
        branches naming it, or the schema itself (none if it names other servers)."""
        schema = resolve(self.doc, location)
        if "anyOf" in schema and set(schema) <= {"anyOf", "description"}:
            candidates = [f"{location}/anyOf/{i}" for i in range(len(schema["anyOf"]))]
        else:
            candidates = [location]
        return [c for c in candidates if server in servers_of(self.deref(resolve(self.doc, c)))]

    def validate(self, location: str, instance: Any) -> None:
        """`instance` against the schema at `location` (a pointer into the document)."""
        validator = jsonschema.Draft202012Validator(
            {"$ref": DOC_URI + location}, registry=self.registry
        )
        validator.validate(instance)

    def check(self, server: str, method: str, path: str, reply: Reply) -> None:
        """`reply` (to `method path` on `server`) is documented: status, required
        headers, content type, and the body valid against one of its server's schemas."""
        method = method.lower()
        response = self.response(server, method, path, reply.status)
        where = f"{server}: {method.upper()} {path} -> {reply.status}"
        for name, header in response.get("headers", {}).items():
            header = self.deref(header)
            if header.get("required"):
                assert name.lower() in reply.headers, f"{where}: no {name} header"
            if name.lower() in reply.headers and "schema" in header:
                jsonschema.validate(reply.headers[name.lower()], header["schema"])
        content = response.get("content", {})
        media = reply.headers.get("content-type", "").split(";")[0].strip()
        assert media in content, f"{where}: content type {media!r}, documented {list(content)}"
        location = self.location_of(method, path, reply.status, media)
        candidates = self.branches(location, server)
        assert candidates, f"{where}: no schema of {media} names the {server} server"
        body = reply.json() if media == "application/json" else reply.body.decode()
        errors = []
        for candidate in candidates:
            try:
                self.validate(candidate, body)
            except jsonschema.ValidationError as exc:
                errors.append(f"{candidate}: {exc.message} at {list(exc.absolute_path)}")
            else:
                self.seen.add((server, method, path, str(reply.status)))
                return
        raise AssertionError(f"{where}: the body fits no documented schema:\n" + "\n".join(errors))

    def location_of(self, method: str, path: str, status: int, media: str) -> str:
        """The pointer of the schema for `media` in the documented response (following
        a response `$ref` to where the schema really is)."""
        at = pointer("paths", path, method, "responses", str(status))
        node = resolve(self.doc, at)
        while "$ref" in node:
            at = node["$ref"]
            node = resolve(self.doc, at)
        return f"{at}/content/{escape(media)}/schema"

    def documented(self, server: str) -> set[tuple[str, str, str, str]]:
        """Every (server, method, path, status) the document gives `server`: the
        statuses whose response, and some schema of it, name the server."""
        out = set()
        for path, method, op in operations(self.doc):
            if server not in op.get("tags", ()):
                continue
            for status in op["responses"]:
                if status == "default":
                    continue
                response = self.deref(op["responses"][status])
                if server not in servers_of(response):
                    continue
                media = response.get("content", {})
                if not media or any(
                    self.branches(self.location_of(method, path, int(status), m), server)
                    for m in media
                ):
                    out.add((server, method, path, status))
        return out

    def missing(self, server: str) -> list[tuple[str, str, str, str]]:
        return sorted(self.documented(server) - self.seen)


# ---- HTTP on loopback ------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: bytes | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> Reply:
    """One request on a fresh connection (a JSON `body`, or `raw` bytes as they are)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    sent = dict(headers or {})
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    if token is not None:
        sent["Authorization"] = "Bearer " + token.decode()
    try:
        conn.request(method, path, data, sent)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def raw_exchange(url: str, data: bytes, timeout: float = 5.0) -> Reply:
    """Bytes sent as they are (a head announcing more body than follows, a chunked
    body); the reply read until the server closes or its Content-Length is in."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        out = b""
        with contextlib.suppress(TimeoutError, OSError):
            while chunk := sock.recv(65536):
                out += chunk
                head, sep, body = out.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if sep and length and len(body) >= int(length.group(1)):
                    break
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(lines[0].split(" ", 2)[1]), headers, body)


def post_head(path: str, length: int | str, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def chunked_post(path: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ).encode()


@contextlib.contextmanager
def one_slot_taken(server: Any) -> Iterator[None]:
    """A server's only handler slot taken, as a connection being served holds it (one
    that has sent no complete request head would be evicted for the newcomer,
    `adapters/http.py`): every other connection meanwhile gets the busy 503."""
    server.httpd._slots.acquire()
    try:
        yield
    finally:
        server.httpd._slots.release()


def one_slot(server: Any) -> Any:
    """`server` with one handler slot (InstanceServer and NodeServer take no
    `max_handlers`; the bound itself is the shared `_BoundedHTTPServer`'s)."""
    server.httpd._slots = threading.BoundedSemaphore(1)
    return server


# ---- a vLLM stand-in behind the ingress -----------------------------------------------


class StubEngine:
    """What the ingress needs of a vLLM OpenAI server, on 127.0.0.1: completions and chat
    completions, JSON or SSE, with ``usage.prompt_tokens_details.cached_tokens``. The
    `model` the ingress forwards says how to behave: "refusing" answers 401 (a wrong
    API key), "dying" cuts its answer short, "paced" waits for `paced_release` (a stream
    after its first event, a JSON answer before it starts); a prompt containing "mismatch"
    reports one prompt token too many; ``max_tokens`` 999999 is refused with vLLM's 400."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.answer(self, body)

        self.tokenizer = tokenizer
        self.paced_asked = threading.Event()  # a "paced" request has arrived
        self.paced_release = threading.Event()  # the test lets it go on
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def usage(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/chat/completions"):
            ids = self.tokenizer.chat_ids(body["messages"])
        else:
            ids = self.tokenizer.completion_ids(body["prompt"])
        n = len(ids) + (1 if "mismatch" in json.dumps(body) else 0)
        return {
            "prompt_tokens": n,
            "completion_tokens": 1,
            "total_tokens": n + 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def answer(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        chat = handler.path.endswith("/chat/completions")
        model = body.get("model")
        if model == "refusing":
            self.send(handler, 401, {"error": "Unauthorized"})
            return
        if model == "paced":
            self.paced_asked.set()
            if not body.get("stream"):
                self.paced_release.wait(10)
        if body.get("max_tokens") == 999999:
            error = {"message": "max_tokens is too large", "type": "BadRequestError"}
            self.send(handler, 400, {"error": {**error, "param": None, "code": 400}})
            return
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if not chat:
            choice["text"] = "a"
        elif body.get("stream"):
            choice["delta"] = {"role": "assistant", "content": "a"}
        else:
            choice["message"] = {"role": "assistant", "content": "a"}
        usage = self.usage(handler.path, body)
        if not body.get("stream"):
            if model == "dying":
                handler.close_connection = True
                handler.wfile.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 1000\r\n\r\n{"id": "x",'
                )
                return
            answer = {"id": "cmpl-1", "object": kind, "created": created, "model": model}
            self.send(handler, 200, {**answer, "choices": [choice], "usage": usage})
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        kind += ".chunk" if chat else ""
        head = {"id": "cmpl-1", "object": kind, "created": created, "model": model}
        events = [{**head, "choices": [choice]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": usage, "system_fingerprint": "fp"})
        for event in events:
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            if model == "dying":
                handler.close_connection = True
                return
            if model == "paced":
                self.paced_release.wait(10)
        done = b"data: [DONE]\n\n"
        handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---- the servers ------------------------------------------------------------------------


def steering_service(tmp: Path, instance_url: str, instance_token: bytes | None) -> SteeringService:
    """The lab's ingress e1 over cats4's RIB (site 3 caches the demo prompt), routes
    not installed; /generate goes to `instance_url` instead of the lab address."""
    rib = tmp / "rib.json"
    rib.write_text(json.dumps(_rib_json(int(time.time() * 1000))))
    service = SteeringService(_config(str(rib)), Forwarder(NEXT_HOPS, dry_run=True))
    service.instance_token = instance_token
    decide = service.decide
    service.decide = lambda body, **kw: {**decide(body, **kw), "url": instance_url}  # type: ignore[method-assign]
    return service


def modelled_engine() -> ModelledEngine:
    return ModelledEngine(
        EngineConfig(
            block_size=instances.BLOCK_TOKENS,
            time_scale=1000.0,
            replay_endpoint=None,
            tiers=instances.LAB_TIERS,
        )
    )


def node_agent(engine: ModelledEngine, **kw: Any) -> NodeAgent:
    """A C-SMA on `engine`'s KV events (keyed as the lab keys), announcing at once."""
    bs = instances.BLOCK_TOKENS
    return NodeAgent(
        BuilderConfig(
            cs_id=CS_ID,
            address="127.0.0.1",
            model_id=instances.MODEL,
            block_size=bs,
            bytes_per_block=1 << 20,
            dampening=DampeningPolicy(min_interval_ms=0, max_interval_ms=60_000),
        ),
        instances.LAB_TIERS,
        BlockKeyer(instances.DEMO_SECRET, instances.MODEL, bs),
        [RankEndpoint(0, engine.publisher.endpoint, engine.publisher.replay_endpoint)],
        engine.compute_state,
        **kw,
    ).start()


def ingress_rib(path: Path) -> None:
    """The receiver's rib.json with one instance, the stub engine's 127.0.0.1, site 1."""
    spec = InstanceSpec("stub", IPv4Network("127.0.0.1/32"), IPv4Network("10.255.9.0/24"), CS_ID, 1)
    now_ms = int(time.time() * 1000)
    values = instances.instance_routes(spec, np.zeros(0, np.uint64), sequence=1, now_ms=now_ms)
    routes = [
        {
            "peer": "127.0.0.2",
            "prefix": str(prefix),
            "origin": "127.0.0.1",
            "cs_id": CS_ID,
            "value": value.hex(),
            "verified": True,
            "received_at": now_ms / 1000,
        }
        for prefix, value in values.items()
    ]
    path.write_text(json.dumps({"sessions": {}, "routes": routes}))


def ingress_service(tmp: Path, engine: StubEngine) -> IngressService:
    """One site ("e1"), the stub engine its one instance; models named for what the
    stub does with them, plus one on a closed port and one no instance serves."""
    ingress_rib(tmp / "ingress-rib.json")
    config = SteeringConfig(
        ingress="e1",
        rib_file=str(tmp / "ingress-rib.json"),
        links=(),
        sites={1: "e1"},
        next_hops={},
        secret=instances.DEMO_SECRET,
        secret_id=instances.DEMO_SECRET_ID,
        model_id=instances.MODEL,
        block_size=4,
        max_blocks=64,  # a prompt of more than 256 tokens is too long
        instance_port=engine.port,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    specs = [
        ModelSpec("tiny", CS_ID, TINY_LLAMA),
        ModelSpec("refusing", CS_ID, TINY_LLAMA),
        ModelSpec("dying", CS_ID, TINY_LLAMA),
        ModelSpec("paced", CS_ID, TINY_LLAMA),
        ModelSpec("unreachable", CS_ID, TINY_LLAMA, closed),
        ModelSpec("nobody", 999, TINY_LLAMA),
    ]
    return IngressService(load_models(specs, config, install_routes=False))


@dataclass
class Servers:
    steering: SteeringServer
    steering_open: SteeringServer
    steering_untrusted: SteeringServer  # sends the instance no token: it refuses
    instance: InstanceServer
    instance_open: InstanceServer
    instance_bare: InstanceServer  # no node agent: /advertisements and /metrics are 404
    node: NodeServer
    node_open: NodeServer
    node_waiting: NodeServer  # not attached yet: the views are 503
    ingress: IngressServer
    ingress_open: IngressServer
    engine: StubEngine
    tmp: Path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("openapi")
    closers: list[Callable[[], None]] = []

    def started(server: Any) -> Any:
        server.start()
        closers.append(server.close)
        return server

    try:
        engine = modelled_engine()
        instance = started(
            InstanceServer(
                engine,
                node_agent(engine, hits=engine.hits),
                request_deadline=DEADLINE_S,
                api_token=INSTANCE_TOKEN,
            )
        )
        open_engine = modelled_engine()
        instance_open = started(
            InstanceServer(open_engine, node_agent(open_engine), request_deadline=DEADLINE_S)
        )
        instance_bare = started(
            InstanceServer(modelled_engine(), None, request_deadline=DEADLINE_S, api_token=TOKEN)
        )
        steering = started(
            SteeringServer(
                steering_service(tmp, instance.url, INSTANCE_TOKEN),
                read_timeout=DEADLINE_S,
                api_token=TOKEN,
            )
        )
        steering_open = started(
            SteeringServer(
                steering_service(tmp, instance.url, INSTANCE_TOKEN), read_timeout=DEADLINE_S
            )
        )
        steering_untrusted = started(
            SteeringServer(steering_service(tmp, instance.url, None), api_token=TOKEN)
        )
        watched = modelled_engine()  # the engine the node watches (vLLM's place)
        closers.append(watched.close)
        text = VLLM_IDLE.read_text()
        scraper = EngineScraper(
            "http://127.0.0.1:8000",
            parse_metrics(text, time.monotonic()),
            8_000.0,
            fetch=lambda: parse_metrics(text, time.monotonic()),
        )
        agent = node_agent(watched, hits=scraper.hits)
        closers.append(agent.close)
        node = started(NodeServer(api_token=TOKEN))
        # the engine's /health as the gate saw it: one probe failed, the next answered
        answers = iter([False, True])
        gate = HealthGate(
            "http://127.0.0.1:8000", lambda: None, lambda: None, probe=lambda _: next(answers)
        )
        gate.check(), gate.check()
        node.attach(agent, scraper, gate)
        node_open = started(NodeServer())
        node_waiting = started(NodeServer(api_token=TOKEN, waiting_for="its engine at http://e:1"))
        stub = StubEngine(PromptTokenizer(TINY_LLAMA))
        closers.append(stub.close)
        service = ingress_service(tmp, stub)
        ingress = started(
            IngressServer(
                service,
                api_token=TOKEN,
                install_routes=False,
                max_body=64 << 10,
                read_timeout=DEADLINE_S,
            )
        )
        ingress_open = started(
            IngressServer(service, install_routes=False, read_timeout=DEADLINE_S)
        )
        yield Servers(
            steering,
            steering_open,
            steering_untrusted,
            instance,
            instance_open,
            instance_bare,
            node,
            node_open,
            node_waiting,
            ingress,
            ingress_open,
            stub,
            tmp,
        )
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(load_document())


def call(
    contract: Contract, server: str, url: str, method: str, path: str, body: Any = None, **kw: Any
) -> Reply:
    """`method path` on `url`, the reply checked against the document; the reply."""
    reply = request(url, method.upper(), path, body, **kw)
    contract.check(server, method, path, reply)
    return reply


def call_raw(contract: Contract, server: str, url: str, path: str, data: bytes) -> Reply:
    """A POST sent as raw bytes (`post_head`, `chunked_post`), the reply checked."""
    reply = raw_exchange(url, data)
    contract.check(server, "post", path, reply)
    return reply


def busy_exchange(url: str, method: str, path: str) -> Reply:
    """A request to a server whose handlers are all taken: its 503 is read first (it is
    sent on accept, before any request is read), then the request is sent anyway."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
        with contextlib.suppress(OSError):
            sock.sendall(f"{method.upper()} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return Reply(int(lines[0].split(" ", 2)[1]), headers, body)


def check_busy(contract: Contract, server: str, busy: Any) -> None:
    """Every operation of `server`, sent to `busy` (one handler slot) while a silent
    connection holds that slot: each is the documented 503."""
    try:
        with one_slot_taken(busy):
            for path, method, op in operations(contract.doc):
                if server in op["tags"]:
                    contract.check(server, method, path, busy_exchange(busy.url, method, path))
    finally:
        busy.close()


def check_late_bodies(contract: Contract, server: str, late: Any, paths: tuple[str, ...]) -> None:
    """A body announced and never finished, on a server with a short deadline: 408."""
    try:
        for path in paths:
            reply = call_raw(contract, server, late.url, path, post_head(path, 10) + b'{"c')
            assert reply.status == 408, reply
    finally:
        late.close()


def check_request(contract: Contract, server: str, method: str, path: str, body: Any) -> bool:
    """Whether `body` fits the documented request body of `server` for `method path`."""
    location = pointer("paths", path, method, "requestBody", "content", "application/json")
    for candidate in contract.branches(location + "/schema", server):
        try:
            contract.validate(candidate, body)
        except jsonschema.ValidationError:
            continue
        return True
    return False


def refused(contract: Contract, server: str, url: str, path: str, body: Any, **kw: Any) -> Reply:
    """A body the document's request schema refuses: the server refuses it too (400)."""
    assert not check_request(contract, server, "post", path, body), body
    reply = call(contract, server, url, "post", path, body, **kw)
    assert reply.status == 400, (body, reply)
    return reply


def raising(exc: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


# ---- the document as a document ---------------------------------------------------------


def test_the_document_is_openapi_3_1_with_one_tag_per_server() -> None:
    doc = load_document()
    assert doc["openapi"].startswith("3.1.")
    assert doc["jsonSchemaDialect"] == "https://json-schema.org/draft/2020-12/schema"
    assert {"title", "version"} <= set(doc["info"])
    assert [t["name"] for t in doc["tags"]] == list(SERVERS)
    assert [x["url"] for x in doc["servers"]] == list(DEFAULT_URLS.values())
    for path, item in doc["paths"].items():
        assert path.startswith("/") and set(item) <= {*METHODS, "servers", "summary"}, path
        tags = {t for m in METHODS if m in item for t in item[m]["tags"]}
        urls = [x["url"] for x in item.get("servers", doc["servers"])]
        assert urls == [DEFAULT_URLS[t] for t in SERVERS if t in tags], path


def test_every_operation_has_an_id_its_servers_and_described_responses() -> None:
    doc = load_document()
    contract = Contract(doc)
    ids = [op["operationId"] for _, _, op in operations(doc)]
    assert len(ids) == len(set(ids)), "operationIds repeat"
    for path, method, op in operations(doc):
        where = f"{method.upper()} {path}"
        assert op["tags"] and set(op["tags"]) <= set(SERVERS), where
        assert op["responses"], f"{where}: no responses"
        for status, raw in op["responses"].items():
            assert status == "default" or re.fullmatch(r"[1-5][0-9][0-9]", status), where
            response = contract.deref(raw)
            assert response["description"].strip(), f"{where} {status}: no description"
            assert set(servers_of(response)) <= set(SERVERS), f"{where} {status}"
            for media, content in response.get("content", {}).items():
                assert "schema" in content, f"{where} {status} {media}: no schema"
        if method == "post" and "405" not in op["responses"]:
            assert op["requestBody"]["content"]["application/json"]["schema"], where


def test_every_reference_resolves() -> None:
    doc = load_document()
    refs = [
        (at, value["$ref"])
        for at, value in walk(doc)
        if isinstance(value, dict) and "$ref" in value
    ]
    assert len(refs) > 100
    for at, ref in refs:
        try:
            resolve(doc, ref)
        except (KeyError, IndexError, ValueError):
            pytest.fail(f"{at}: $ref {ref} points nowhere")


def test_every_schema_is_valid_json_schema_2020_12() -> None:
    doc = load_document()
    schemas = [
        (pointer("components", "schemas", k), v) for k, v in doc["components"]["schemas"].items()
    ]
    schemas += [
        (at, value["schema"])
        for at, value in walk(doc)
        if isinstance(value, dict) and isinstance(value.get("schema"), dict)
    ]
    assert len(schemas) > 80
    for at, schema in schemas:
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            pytest.fail(f"{at}: not a valid JSON Schema 2020-12 schema: {exc.message}")
    for name, schema in doc["components"]["schemas"].items():
        assert set(servers_of(schema)) <= set(SERVERS), name


def test_a_wrong_type_in_the_document_fails_against_the_real_server(servers: Servers) -> None:
    """The check can fail: the real /health against a document that says a counter is a
    string, and against one that forgets a member the server sends."""
    reply = request(servers.steering.url, "GET", "/health")
    Contract(load_document()).check("steering", "get", "/health", reply)
    wrong = load_document()
    wrong["components"]["schemas"]["SteeringHealth"]["properties"]["decisions"] = {"type": "string"}
    with pytest.raises(AssertionError, match="fits no documented schema"):
        Contract(wrong).check("steering", "get", "/health", reply)
    forgot = load_document()
    del forgot["components"]["schemas"]["SteeringHealth"]["properties"]["bad_rib_routes"]
    with pytest.raises(AssertionError, match="fits no documented schema"):
        Contract(forgot).check("steering", "get", "/health", reply)


# ---- the code's routes, all documented ---------------------------------------------------


def routes_in_code(server: str) -> dict[str, set[str]]:
    """Method -> the paths `server`'s handler tests for, read from its source: the path
    literals in each ``do_METHOD``, and module constants it names that hold paths (a
    method that names none answers every path alike: an empty set)."""
    module = importlib.import_module(HANDLER_MODULES[server])
    tree = ast.parse(Path(module.__file__ or "").read_text())
    routes: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("do_")):
            continue
        found = routes.setdefault(fn.name[3:].lower(), set())
        for node in ast.walk(fn):
            values: list[Any] = []
            if isinstance(node, ast.Constant):
                values = [node.value]
            elif isinstance(node, ast.Name) and hasattr(module, node.id):
                held = getattr(module, node.id)
                values = list(held) if isinstance(held, tuple | frozenset | dict) else [held]
            found |= {v for v in values if isinstance(v, str) and PATH_LITERAL.match(v)}
    return routes


def test_every_route_the_handlers_serve_is_documented_and_nothing_more() -> None:
    doc = load_document()
    for server in SERVERS:
        routes = routes_in_code(server)
        assert routes, f"{server}: no do_METHOD handlers found in {HANDLER_MODULES[server]}"
        own_paths = {p for p, _, op in operations(doc) if server in op["tags"]}
        served = set()
        for method, paths in routes.items():
            for path in paths or own_paths:  # no path named: every path alike
                served.add((method, path))
        documented = {(m, p) for p, m, op in operations(doc) if server in op["tags"]}
        assert served - documented == set(), f"{server}: served but not documented"
        assert documented - served == set(), f"{server}: documented but not served"


def test_no_other_module_serves_http() -> None:
    """A new HTTP server in the package must be added to HANDLER_MODULES (and the doc)."""
    handlers = set()
    for source in sorted((ROOT / "catsproto").rglob("*.py")):
        text = source.read_text()
        if "def do_" not in text:
            continue
        tree = ast.parse(text)
        if any(isinstance(n, ast.FunctionDef) and n.name.startswith("do_") for n in ast.walk(tree)):
            handlers.add(".".join(source.relative_to(ROOT).with_suffix("").parts))
    assert handlers == set(HANDLER_MODULES.values())


# ---- the servers ---------------------------------------------------------------------------

COLD = {"cs_id": CS_ID, "prompt_token_ids": instances.demo_prompt(2)}  # cached nowhere
MISSING = {"cs_id": 999, "prompt_token_ids": [1, 2, 3]}  # no instance serves CS-ID 999
BAD_BODIES = [
    {"cs_id": True, "prompt_token_ids": [1]},
    {"cs_id": CS_ID, "prompt_token_ids": [-1]},
    {"cs_id": CS_ID, "block_keys": ["0x12"]},
    {"cs_id": CS_ID, "hash_ids": [1], "input_length": 1.5},
    {"cs_id": CS_ID},
]


def test_steering_api_matches_the_document(
    servers: Servers, contract: Contract, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, name = servers, "steering"
    url, open_url = s.steering.url, s.steering_open.url
    assert call(contract, name, url, "get", "/health").status == 200
    for path in ("/decide", "/generate"):
        # DEMO is cached at site 3: a decision may pull it from there, which this
        # instance (no transfer credentials) refuses; /generate then says so (502,
        # test_steering_answers_502_when_the_instance_fails_or_cannot_pull)
        for body in (DEMO, COLD) if path == "/decide" else (COLD,):
            head = {**body, "prompt_token_ids": body["prompt_token_ids"][:64]}  # quicker
            assert check_request(contract, name, "post", path, head)
            assert call(contract, name, url, "post", path, body, token=TOKEN).status == 200
            public = call(contract, name, open_url, "post", path, body)
            assert public.status == 200 and "withheld" in public.body.decode()
        assert call(contract, name, url, "post", path, COLD).status == 401
        for body in BAD_BODIES:
            refused(contract, name, url, path, body, token=TOKEN)
        call_raw(contract, name, open_url, path, post_head(path, "12a") + b"{}")
        assert call_raw(contract, name, open_url, path, post_head(path, 2 << 20)).status == 413
        assert call(contract, name, url, "post", path, MISSING, token=TOKEN).status == 503
        with monkeypatch.context() as m:
            m.setattr(s.steering.service, "decide", raising(RuntimeError("a bug")))
            reply = call(contract, name, url, "post", path, COLD, token=TOKEN)
            assert reply.json() == {"error": "internal error: RuntimeError"}
        with monkeypatch.context() as m:
            m.setattr(s.steering.service.forwarder, "install", raising(PermissionError(1, "no")))
            assert call(contract, name, url, "post", path, DEMO, token=TOKEN).status == 502
    reply = call(contract, name, s.steering_untrusted.url, "post", "/generate", COLD, token=TOKEN)
    assert reply.status == 502 and "--instance-token-file" in reply.json()["error"]
    for path in ("/flows", "/rib", "/stale"):
        assert call(contract, name, url, "get", path, token=TOKEN).status == 200
        assert call(contract, name, url, "get", path).status == 401
        assert call(contract, name, open_url, "get", path).status == (
            200 if path == "/rib" else 403
        )
    service = steering_service(s.tmp, s.instance.url, INSTANCE_TOKEN)
    late = SteeringServer(service, read_timeout=0.2).start()
    check_late_bodies(contract, name, late, ("/decide", "/generate"))
    check_busy(contract, name, SteeringServer(service, max_handlers=1).start())
    assert contract.missing(name) == []


def test_steering_answers_502_when_the_instance_fails_or_cannot_pull(
    servers: Servers, contract: Contract, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's body was checked before it was proxied, so an instance's non-200 is
    not the caller's fault: its worker failing (500), or a decision to pull the prefix
    sent to an instance without transfer credentials (its 400), is a 502 quoting it,
    counted in `upstream_errors` and not in `bad_requests` (it used to be a 400)."""
    s, name, url = servers, "steering", servers.steering.url
    service = s.steering.service
    before = call(contract, name, url, "get", "/health").json()
    with monkeypatch.context() as m:
        m.setattr(s.instance.engine, "submit", raising(EngineError("the worker failed")))
        reply = call(contract, name, url, "post", "/generate", COLD, token=TOKEN)
    assert reply.status == 502, reply
    assert "answered 500" in reply.json()["error"] and "the worker failed" in reply.json()["error"]
    decide = service.decide
    pull = {"address": "10.103.0.11", "port": 7470, "key_id": "ab" * 32, "expected_blocks": 24}
    with monkeypatch.context() as m:  # "compute here, pull from there", to our instance
        m.setattr(service, "decide", lambda body, **kw: {**decide(body, **kw), "kv_pull": pull})
        reply = call(contract, name, url, "post", "/generate", COLD, token=TOKEN)
    assert reply.status == 502, reply
    assert "answered 400" in reply.json()["error"]
    assert "no transfer credentials" in reply.json()["error"]
    after = call(contract, name, url, "get", "/health").json()
    assert after["bad_requests"] == before["bad_requests"]
    assert after["upstream_errors"] == before["upstream_errors"] + 2
    assert after["instance_refused"] == before["instance_refused"]


def test_instance_api_matches_the_document(
    servers: Servers, contract: Contract, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, name, token = servers, "instance", INSTANCE_TOKEN
    url, open_url, bare_url = s.instance.url, s.instance_open.url, s.instance_bare.url

    def generate(body: Any, *, to: str = url, **kw: Any) -> Reply:
        if to == url:
            kw.setdefault("token", token)
        return call(contract, name, to, "post", "/generate", body, **kw)

    prompt = instances.demo_prompt(1)[:1536]  # three blocks
    for body in (
        {"prompt_token_ids": prompt},
        {"prompt_token_ids": prompt, "expected_cached_blocks": 3},
        {"hash_ids": [1, 2, 3], "input_length": 1500},
    ):
        assert check_request(contract, name, "post", "/generate", body)
        assert generate(body).status == 200
        assert set(generate(body, to=open_url).json()) == {"blocks", "withheld"}
    assert generate({}, token=TOKEN).status == 401
    for body in (
        {"prompt_token_ids": "1 2 3"},
        {"hash_ids": [1], "input_length": -1},
        {"prompt_token_ids": [1], "expected_cached_blocks": -1},
        {"input_length": 5},
    ):
        refused(contract, name, url, "/generate", body, token=token)
    reply = generate({"hash_ids": [1], "input_length": 9999})  # more than one block holds
    assert reply.status == 400 and "exceeds" in reply.json()["error"]
    call_raw(contract, name, open_url, "/generate", post_head("/generate", "-1"))
    reply = call_raw(contract, name, open_url, "/generate", post_head("/generate", 2 << 20))
    assert reply.status == 413
    with monkeypatch.context() as m:
        m.setattr(s.instance.engine, "submit", raising(EngineError("the worker failed")))
        assert generate({"prompt_token_ids": [1]}).status == 500
    assert call(contract, name, url, "get", "/health").status == 200
    time.sleep(0.1)  # the C-SMA advertises what the requests above stored
    for path in ("/state", "/advertisements", "/metrics"):
        assert call(contract, name, url, "get", path, token=token).status == 200
        assert call(contract, name, url, "get", path, token=TOKEN).status == 401
        assert call(contract, name, open_url, "get", path).status == 403
    assert call(contract, name, bare_url, "get", "/state", token=TOKEN).json()["node"] is None
    for path in ("/advertisements", "/metrics"):
        assert call(contract, name, bare_url, "get", path, token=TOKEN).status == 404
    late = InstanceServer(modelled_engine(), None, request_deadline=0.2).start()
    check_late_bodies(contract, name, late, ("/generate",))
    check_busy(contract, name, one_slot(InstanceServer(modelled_engine(), None).start()))
    assert contract.missing(name) == []


def test_node_face_matches_the_document(
    servers: Servers, contract: Contract, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, name = servers, "node"
    for server in (s.node, s.node_open, s.node_waiting):
        assert call(contract, name, server.url, "get", "/health").status == 200
    views = ("/state", "/advertisements", "/metrics")
    for path in views:
        assert call(contract, name, s.node.url, "get", path, token=TOKEN).status == 200
        assert call(contract, name, s.node.url, "get", path, token=INSTANCE_TOKEN).status == 401
        assert call(contract, name, s.node_open.url, "get", path).status == 403
        assert call(contract, name, s.node_waiting.url, "get", path, token=TOKEN).status == 503
    for path in ("/health", *views):
        reply = call(contract, name, s.node.url, "post", path, {"x": 1}, token=TOKEN)
        assert reply.status == 405
    with monkeypatch.context() as m:
        m.setattr(s.node, "state", raising(RuntimeError("a bug")))
        m.setattr(s.node, "metrics", raising(RuntimeError("a bug")))
        m.setattr(s.node.node, "advertisements", raising(RuntimeError("a bug")))
        for path in views:
            assert call(contract, name, s.node.url, "get", path, token=TOKEN).status == 500
    check_busy(contract, name, one_slot(NodeServer().start()))
    assert contract.missing(name) == []


def completion_body(path: str, text: str = "Hello KV", **extra: Any) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}
    return {"model": "tiny", "prompt": text, **extra}


def test_ingress_matches_the_document(
    servers: Servers, contract: Contract, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, name = servers, "ingress"
    url, open_url = s.ingress.url, s.ingress_open.url
    full_headers = {
        "x-catsproto-instance",
        "x-catsproto-site",
        "x-catsproto-decision-ms",
        "x-catsproto-expected-cached-blocks",
        "x-catsproto-estimated-ttft-ms",
        "x-catsproto-evicted-blocks",
        "x-catsproto-evict-ms",
    }
    nearest, bogus = {"x-catsproto-policy": "nearest"}, {"x-catsproto-policy": "bogus"}
    for path in ("/v1/completions", "/v1/chat/completions"):

        def post(body: Any, *, to: str = url, **kw: Any) -> Reply:
            if to == url:
                kw.setdefault("token", TOKEN)
            return call(contract, name, to, "post", path, body, **kw)  # noqa: B023

        def code(reply: Reply) -> str | None:
            return reply.json()["error"]["code"]

        plain = completion_body(path)
        for extra in ({}, {"stream": True}, {"stream_options": {"include_usage": True}}):
            body = {**plain, **extra, "stream": bool(extra)}
            assert check_request(contract, name, "post", path, body)
            reply = post(body)
            assert reply.status == 200 and full_headers <= set(reply.headers)
            reply = post(body, to=open_url)
            assert reply.status == 200 and not full_headers & set(reply.headers)
        assert post(plain, headers=nearest).status == 200
        assert post(plain, to=open_url, headers=nearest).status == 403
        assert code(post(plain, headers=bogus)) == "invalid_policy"
        assert post(plain, token=None).status == 401
        # refused by the document's request schema and by the ingress alike
        for bad, why in (
            ({**plain, "stream": "yes"}, "invalid_type"),
            ({"model": "tiny"}, None),
            ({**plain, "model": 7}, None),
        ):
            assert not check_request(contract, name, "post", path, bad)
            assert code(post(bad)) == why
        too_long = completion_body(path, "word " * 400)  # over 64 blocks of 4 tokens
        assert check_request(contract, name, "post", path, too_long)  # the limit is config
        assert code(post(too_long)) == "prompt_too_long"
        assert code(post(None, raw=b"not json")) == "invalid_json"
        assert code(post({**plain, "model": "nope"})) == "model_not_found"
        for model, failure in (
            ("refusing", "engine_refused"),
            ("dying", "engine_died"),
            ("unreachable", "engine_unreachable"),
        ):
            assert code(post({**plain, "model": model})) == failure
        reply = post({**plain, "model": "dying", "stream": True})
        assert reply.status == 200 and b'"code": "engine_died"' in reply.body  # mid-stream
        assert code(post({**plain, "model": "nobody"})) == "no_instance"
        assert call_raw(contract, name, open_url, path, chunked_post(path)).status == 411
        assert call_raw(contract, name, open_url, path, post_head(path, 8 << 20)).status == 413
        with monkeypatch.context() as m:
            m.setattr(s.ingress.service, "prepare", raising(RuntimeError("a bug")))
            assert post(plain).status == 500
        # the engine's own error answer comes back as it is (the `default` response)
        reply = request(url, "POST", path, completion_body(path, max_tokens=999999), token=TOKEN)
        assert reply.status == 400 and reply.json()["error"]["code"] == 400
    for path in ("/v1/models", "/metrics"):
        assert call(contract, name, url, "get", path, token=TOKEN).status == 200
        assert call(contract, name, url, "get", path).status == 401
    assert call(contract, name, open_url, "get", "/v1/models").status == 200
    assert call(contract, name, open_url, "get", "/metrics").status == 403
    assert call(contract, name, url, "get", "/health").status == 200
    service = s.ingress.service
    late = IngressServer(service, install_routes=False, read_timeout=0.2).start()
    check_late_bodies(contract, name, late, ("/v1/completions", "/v1/chat/completions"))
    check_busy(contract, name, IngressServer(service, install_routes=False, max_handlers=1).start())
    assert contract.missing(name) == []


def requests_counted(url: str, model: str) -> dict[str, float]:
    """`catsproto_ingress_requests_total` of `model` on /v1/completions, by `status`."""
    text = request(url, "GET", "/metrics", token=TOKEN).body.decode()
    counted: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "catsproto_ingress_requests":
            for sample in family.samples:
                labels = sample.labels
                ours = labels["model"] == model and labels["endpoint"] == "/v1/completions"
                if ours and sample.name.endswith("_total"):
                    counted[labels["status"]] = sample.value
    return counted


def counted_once_more(url: str, model: str, before: dict[str, float]) -> dict[str, float]:
    """The statuses whose count grew since `before` (waits until one has, up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        now = requests_counted(url, model)
        grown = {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        if grown or time.monotonic() > deadline:
            return grown
        time.sleep(0.02)


def hang_up(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): the ingress's next write to it fails at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_client_that_hangs_up_is_counted_by_what_it_was_sent(servers: Servers) -> None:
    """`requests_total` counts what was answered: a client that leaves a stream after its
    200 head is a 200, one that leaves before any head went out is
    `status="disconnected"`. Both used to be counted as 500s nobody was sent."""
    url, stub = servers.ingress.url, servers.engine
    host, port = url.removeprefix("http://").split(":")
    for stream, expected in ((True, "200"), (False, "disconnected")):
        stub.paced_asked.clear()
        stub.paced_release.clear()
        before = requests_counted(url, "paced")
        body = json.dumps({"model": "paced", "prompt": "Hello KV", "stream": stream}).encode()
        head = post_head(
            "/v1/completions", len(body), f"Authorization: Bearer {TOKEN.decode()}\r\n"
        )
        sock = socket.create_connection((host, int(port)), timeout=5)
        try:
            sock.sendall(head + body)
            if stream:  # the 200 head and the first event, then the client leaves
                got = b""
                while b"\r\n\r\n" not in got or b"\n\n" not in got.partition(b"\r\n\r\n")[2]:
                    chunk = sock.recv(65536)
                    assert chunk, got
                    got += chunk
                assert got.startswith(b"HTTP/1.1 200 "), got
            else:  # the engine has it and has not answered: the client leaves
                assert stub.paced_asked.wait(5)
        finally:
            hang_up(sock)
        stub.paced_release.set()  # the engine answers; the ingress writes to nobody
        assert counted_once_more(url, "paced", before) == {expected: 1.0}
    assert request(url, "GET", "/health").status == 200  # and it serves on


def test_a_bug_after_a_streams_head_sends_no_second_head(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of ours once the 200 head is out cannot become a 500 any more: the stream
    is cut (counted in `internal_errors`) and the request counted as the 200 it got; a
    500 head used to be written into the stream's body."""
    url, service = servers.ingress.url, servers.ingress.service
    before, errors = requests_counted(url, "tiny"), service.health()["internal_errors"]
    body = json.dumps({"model": "tiny", "prompt": "Hello KV", "stream": True}).encode()
    head = post_head("/v1/completions", len(body), f"Authorization: Bearer {TOKEN.decode()}\r\n")
    with monkeypatch.context() as m:
        m.setattr(service, "record", raising(RuntimeError("a bug")))  # at the usage chunk
        reply = raw_exchange(url, head + body)
    assert reply.status == 200 and b"HTTP/1.1" not in reply.body, reply
    assert counted_once_more(url, "tiny", before) == {"200": 1.0}
    assert service.health()["internal_errors"] == errors + 1


def test_unknown_paths_and_methods_get_the_answers_the_document_describes(
    servers: Servers, contract: Contract
) -> None:
    """Outside the operations (the document's description): an unknown path is a 404,
    `{"error": "no PATH"}` or OpenAI's `not_found`; a method with no handler the standard
    library's 501."""
    plain = pointer("components", "schemas", "Error")
    openai_error = pointer("components", "schemas", "IngressError")
    for server, url, schema in (
        ("steering", servers.steering.url, plain),
        ("instance", servers.instance.url, plain),
        ("node", servers.node.url, plain),
        ("ingress", servers.ingress.url, openai_error),
    ):
        for method in ("GET", "POST"):
            reply = request(url, method, "/nothing-here", token=TOKEN)
            if server == "node" and method == "POST":
                assert reply.status == 405
                continue
            assert reply.status == 404, (server, method, reply)
            contract.validate(schema, reply.json())
        assert request(url, "PUT", "/health").status == 501

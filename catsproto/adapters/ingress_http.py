"""The ingress's HTTP face: the OpenAI endpoints over the stdlib server, the proxy to
the chosen engine, SSE streamed per event (the service, decisions and ground truth are
in `catsproto.adapters.ingress`, whose docstring tells the whole design).

Strategy. A handler thread per client connection does the whole request: read the body
(bounded), `IngressService.prepare` and `decide`, then send the body on a pooled
keep-alive connection to the engine and copy the answer back. A JSON answer is read
whole (it is small) and sent with its length; a stream is copied event by event as
`read1` hands bytes over, each event flushed in its own HTTP chunk, so the client's first
token leaves when the engine's does. An engine that fails before its first byte is a 502
in OpenAI's shape; one that fails once the stream's head went out gets an SSE error
event and the stream's end; a client that leaves closes the engine's connection too
(vLLM then aborts the request).

Each request is counted by the status its client was sent (`Handler.sent`, set once the
head is out): a stream the client leaves after its 200 is a 200, and a client that
leaves, or stops reading, before any head went out is ``status="disconnected"``
(`DISCONNECTED`), not a 500 nobody received: a failed write to the client is
`_ClientGone`, never an internal error.

What a caller without the token is told (no decision headers, the answer without cache
details) is decided in `catsproto.adapters.ingress` ("What a caller may learn"); here
each answer's headers come from `Steered.headers` and its body, or each stream event,
goes through `openai_wire.public_answer` for such a caller.
"""

from __future__ import annotations

import contextlib
import http.client
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

from catsproto.adapters.http import (
    READ_TIMEOUT_S,
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    BodyError,
    JsonHandler,
    bearer_authorised,
    bearer_challenge,
    read_body_bytes,
)
from catsproto.adapters.ingress import (
    CHAT,
    COMPLETIONS,
    MAX_BODY,
    OWNER,
    RESOLVE_EVERY_S,
    IngressService,
    Prepared,
    Steered,
)
from catsproto.adapters.metrics import CONTENT_TYPE, render
from catsproto.adapters.openai_wire import (
    IngressError,
    SseSplitter,
    error_body,
    event_data,
    model_list,
    public_answer,
    public_event,
    sse_event,
    usage_chunk,
    usage_of,
    with_fingerprint,
)
from catsproto.adapters.steering import LISTEN_BACKLOG
from catsproto.adapters.strict_json import json_body

__all__ = ["POLICY_HEADER", "IngressServer", "read_body"]

POLICY_HEADER = "x-catsproto-policy"  # a token holder's choice of policy (comparisons)
# the `status` label of a request whose client left before any answer's head was sent
DISCONNECTED = "disconnected"


class IngressServer(BackgroundHTTPServer):
    """The OpenAI front door over HTTP (stdlib server, one thread per connection). With
    an `api_token`, everything but GET /health takes only callers that send it as a
    bearer token (others get 401) and the decision headers are given in full; without
    one, requests are served to all without decision headers or cache details, and
    /metrics is refused (403). A thread holds pending ground-truth misses against the RIB."""

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
    """The request body as bytes, by its Content-Length (BodyError otherwise; a head
    with Transfer-Encoding never gets here: `http.framing_problem`)."""
    if "Content-Length" not in handler.headers:
        raise BodyError(400, "a JSON body is required")
    return read_body_bytes(handler, max_bytes)


class _ClientGone(Exception):
    """A write to the client failed: it left, or stopped reading until the send timed out."""


class _UpstreamFailed(Exception):
    """The engine could not be asked, or died before its answer ended: a 502 (`code`)."""

    def __init__(self, message: str, code: str = "engine_unreachable") -> None:
        super().__init__(message)
        self.code = code


def _handler(
    service: IngressService,
    api_token: bytes | None,
    install_routes: bool,
    max_body: int,
    read_timeout: float,
) -> type[BaseHTTPRequestHandler]:
    full = api_token is not None  # every caller of a POST holds the token (or is refused)

    def engine_named(steered: Steered, port: int | None = None) -> str:
        """The engine as an error message names it: its address for token holders only
        (for anybody else it would say where the prompt went)."""
        if not full:
            return "the chosen engine"
        return f"engine {steered.address}" + (f":{port}" if port is not None else "")

    class Handler(JsonHandler):
        timeout = read_timeout
        sent: int | None = None  # the status whose head went out for this request
        _head: int | None = None  # the status of the head being written

        def send_response_only(self, code: int, message: str | None = None) -> None:
            self._head = code
            super().send_response_only(code, message)

        def flush_headers(self) -> None:
            try:
                super().flush_headers()  # raises if the client left: then nothing was sent
            except OSError as exc:
                self._head = None
                raise _ClientGone(f"{type(exc).__name__}: {exc}") from None
            if self._head is not None:
                self.sent, self._head = self._head, None

        def _write(self, data: bytes) -> None:
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except OSError as exc:
                raise _ClientGone(f"{type(exc).__name__}: {exc}") from None

        def refuse_framing(self, status: int, reason: str) -> None:
            """A head whose body length is unclear (`http.framing_problem`): an OpenAI
            error, then the connection is closed."""
            service.count("bad_requests")
            self._error(IngressError(status, reason, code="bad_framing"), {"Connection": "close"})

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
                holder = api_token is not None and bearer_authorised(self.headers, api_token)
                body = service.health(token_holder=holder)
                if holder:
                    body["http"] = self.server.stats.to_json()  # type: ignore[attr-defined]
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
            name, self.sent = "", None
            try:
                raw = read_body(self, max_body)
                prepared = service.prepare(path, raw)
                name = prepared.model.spec.name
                policy = self.headers.get(POLICY_HEADER)
                if policy is not None and api_token is None:
                    raise IngressError(
                        403,
                        f"{POLICY_HEADER} is for API token holders (comparisons), and no API "
                        "token is configured",
                        code="forbidden",
                    )
                steered = service.decide(
                    prepared, install=install_routes, policy=policy or "catsproto"
                )
                self._proxy(prepared, steered)
            except BodyError as exc:
                service.count("bad_requests")
                self.close_connection = True
                self._error(IngressError(exc.status, str(exc)))
            except IngressError as exc:
                if exc.status < 500:
                    service.count("bad_requests")
                self._error(exc)
            except _UpstreamFailed as exc:
                self._error(IngressError(502, str(exc), code=exc.code))
            except (_ClientGone, BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client left: nobody to answer
            except Exception as exc:  # a bug of ours: answer, count, log, serve on
                service.count("internal_errors")
                print(f"ingress: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                self.close_connection = True
                if self.sent is None:  # a head already sent cannot be taken back
                    with contextlib.suppress(OSError):
                        self._error(IngressError(500, f"internal error: {type(exc).__name__}"))
            finally:  # what the client was sent, not what it would have been
                status = DISCONNECTED if self.sent is None else str(self.sent)
                service.requests.labels(name, endpoint, status).inc()

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
            where = engine_named(steered, port)
            for attempt in (0, 1):
                try:
                    conn, reused = service.pool.take(steered.address, port, fresh=attempt > 0)
                except OSError as exc:
                    raise _UpstreamFailed(f"{where} unreachable: {exc}") from None
                try:
                    conn.request("POST", prepared.path, prepared.forward, headers)
                    return conn, conn.getresponse()
                except (http.client.HTTPException, OSError) as exc:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # an idle keep-alive the engine had closed
                    raise _UpstreamFailed(
                        f"{where} failed before answering: {type(exc).__name__}: {exc}"
                    ) from None
            raise AssertionError("unreachable")

        def _proxy(self, prepared: Prepared, steered: Steered) -> None:
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
                    f"{engine_named(steered)} answered {resp.status} ({sent} sent): start "
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
                        f"{engine_named(steered)} died mid-answer: {type(exc).__name__}",
                        "engine_died",
                    ) from None
                self._done(prepared, steered, conn, resp)
                if resp.status == 200:
                    usage = usage_of(body)
                    if usage is not None:
                        service.record(prepared, steered, usage)
                self._send(resp.status, body if full else public_answer(body), kind, headers)
                return
            self._stream(prepared, steered, conn, resp, kind, headers)

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
            self._write(b"%x\r\n%s\r\n" % (len(data), data))

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
                            if b'"finish_reason":"' in payload and full:
                                if engine in service.fingerprints:
                                    event = self._fingerprinted(event, engine)
                                else:
                                    held.append(event)
                                    continue
                        elif (
                            usage := usage_of(payload)
                        ) is not None and b'"choices":[]' in payload:
                            service.record(prepared, steered, usage)
                        out.append(event if full else public_event(event))
                    if out:
                        self._chunk(b"".join(out))
                rest = splitter.rest if full else public_event(splitter.rest)
                tail = b"".join(held) + rest
                if tail:
                    self._chunk(tail)
                self._done(prepared, steered, conn, resp)
            except _UpstreamFailed as exc:
                conn.close()
                service.proxy_errors.labels(prepared.model.spec.name, "died").inc()
                error = error_body(
                    502,
                    f"{engine_named(steered)} died mid-stream: {exc}",
                    code="engine_died",
                )
                self._chunk(sse_event(error))
                self.close_connection = True
            except BaseException:
                conn.close()
                raise
            self._write(b"0\r\n\r\n")

        def _fingerprinted(self, event: bytes, engine: tuple[str, int]) -> bytes:
            fingerprint = service.fingerprints.get(engine)
            if fingerprint is None:
                return event
            payload = event_data(event)
            return b"data: " + with_fingerprint(payload, fingerprint) + b"\n\n"

    return Handler

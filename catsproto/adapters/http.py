"""A stdlib HTTP server on a background thread, shared by the modelled instance and the
steering API (one thread per connection; the handler class comes from the caller).

Strategy. A peer must not be able to hold the server by being slow or many. Two bounds,
both here so every server built on `BackgroundHTTPServer` has them:

* at most `max_handlers` connections are served at once; one more is answered
  ``503`` with ``Connection: close`` by the accepting thread (a non-blocking send of a
  fixed reply) and closed, without a thread of its own;
* each request, request line and headers and body, must arrive within one deadline
  (`READ_TIMEOUT_S`) of the moment the handler starts waiting for it: every read from
  the socket gets only the time left, so trickling one byte at a time does not extend
  it. A keep-alive connection that sends no next request is closed at the same deadline.

Both are counted in `HTTPStats` (``server.httpd.stats``), which the daemons show.

Bearer tokens. A daemon that serves what must not reach everybody takes a token from a
file (`read_api_token`) and checks ``Authorization: Bearer TOKEN`` on each request with
`bearer_authorised` (constant time); a caller without it is answered ``401`` with the
`bearer_challenge` of the daemon's realm, before any body is read.
"""

from __future__ import annotations

import hmac
import io
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from catsproto.adapters.file_modes import FileModeError, read_secret_file

MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413)
READ_TIMEOUT_S = 10.0  # one request (line, headers, body) must arrive within this
MAX_HANDLERS = 512  # connections served at once (twice the listen backlog daemons use)
MIN_TOKEN_CHARS = 16  # an API token shorter than this is refused at start
UNAUTHORISED_ERROR = "missing or wrong API token (Authorization: Bearer TOKEN)"

_BUSY_BODY = b'{"error": "server busy: too many connections, try again"}'
_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: "
    + str(len(_BUSY_BODY)).encode()
    + b"\r\nConnection: close\r\n\r\n"
    + _BUSY_BODY
)


@dataclass
class HTTPStats:
    """What the server refused or cut short, counted across its handler threads."""

    busy_refused: int = 0  # connections answered 503: all handlers were taken
    deadline_expired: int = 0  # requests (or idle keep-alives) dropped at the deadline
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def to_json(self) -> dict[str, int]:
        with self._lock:
            return {"busy_refused": self.busy_refused, "deadline_expired": self.deadline_expired}


class _DeadlineSocketReader(io.RawIOBase):
    """Raw reads from a connection that never wait past the handler's deadline."""

    def __init__(self, sock: socket.socket, handler: _DeadlineHandler) -> None:
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._handler.deadline - time.monotonic()
        if left <= 0:
            self._handler.deadline_passed()
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            self._handler.deadline_passed()
            raise
        finally:
            self._sock.settimeout(self._handler.send_timeout)


class _DeadlineHandler(BaseHTTPRequestHandler):
    """Put in front of the caller's handler class: one deadline per request."""

    server: _BoundedHTTPServer
    deadline: float = 0.0
    send_timeout: float = READ_TIMEOUT_S
    _expired = False

    def setup(self) -> None:
        super().setup()
        # sends wait at most the handler's own timeout (else the deadline's length) each
        self.send_timeout = self.timeout or self.server.request_deadline
        self.connection.settimeout(self.send_timeout)
        self.rfile = io.BufferedReader(_DeadlineSocketReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.server.request_deadline
        self._expired = False
        super().handle_one_request()

    def deadline_passed(self) -> None:
        self.close_connection = True
        if not self._expired:  # once per request, however many reads notice it
            self._expired = True
            self.server.stats.count("deadline_expired")


class _BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_handlers: int,
        request_deadline: float,
    ) -> None:
        if max_handlers < 1:
            raise ValueError(f"max_handlers must be at least 1, got {max_handlers}")
        if not request_deadline > 0:
            raise ValueError(f"request deadline must be positive, got {request_deadline}")
        self.stats = HTTPStats()
        self.max_handlers = max_handlers
        self.request_deadline = request_deadline
        self._slots = threading.BoundedSemaphore(max_handlers)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.stats.count("busy_refused")
            try:
                request.setblocking(False)
                request.send(_BUSY_REPLY)
                request.shutdown(socket.SHUT_WR)
                while request.recv(65536):  # what has arrived, so the close sends no reset
                    pass
            except OSError:
                pass  # nothing more to read now, or gone already: closing says enough
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread took the slot
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line on stderr, not a traceback: a peer that hangs up mid-answer is common."""
        exc = sys.exc_info()[1]
        print(f"http: {client_address}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


# how often the serving loop looks for a shutdown: `close` waits up to this long (the
# standard library's 0.5 s made every stop of a daemon, and every test server, half a
# second long)
SHUTDOWN_POLL_S = 0.05


class BackgroundHTTPServer:
    def __init__(
        self,
        handler: type[BaseHTTPRequestHandler],
        host: str,
        port: int,
        *,
        max_handlers: int = MAX_HANDLERS,
        request_deadline: float = READ_TIMEOUT_S,
    ):
        bounded = type(handler.__name__, (_DeadlineHandler, handler), {})
        self.httpd = _BoundedHTTPServer((host, port), bounded, max_handlers, request_deadline)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def stats(self) -> HTTPStats:
        return self.httpd.stats

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class BodyError(Exception):
    """A request body that cannot be taken: the HTTP status to answer, and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def read_body_bytes(handler: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY) -> bytes:
    """The request's body by its Content-Length (none: empty), which must be a decimal
    count within `max_bytes`; a short body (the read times out) raises `BodyError`."""
    raw_length = handler.headers.get("Content-Length", "0").strip()
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


class JsonHandler(BaseHTTPRequestHandler):
    """What the project's HTTP faces share: HTTP/1.1 keep-alive without the delayed-ACK
    stall, no access log, and one send for a reply's head and body."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # quiet
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
        # head and body in one send (end_headers would send the head alone first)
        self._headers_buffer.extend((b"\r\n", body))  # type: ignore[attr-defined]
        self.flush_headers()

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        from catsproto.adapters.strict_json import json_body

        self._send(status, json_body(obj), headers=headers)


def read_json_body(handler: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY) -> object:
    """The request's JSON body (None when empty), read by its Content-Length, which must
    be a decimal count within `max_bytes`; a body that is short (the read times out),
    not UTF-8, not JSON or nested deeper than the parser's recursion limit raises
    `BodyError`, never anything else."""
    raw = read_body_bytes(handler, max_bytes)
    if not raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"body is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and numbers Python cannot hold
        raise BodyError(400, f"body is not JSON: {exc}") from None
    except RecursionError:  # the parser counts its nesting against Python's limit
        limit = sys.getrecursionlimit()
        raise BodyError(400, f"body: arrays/objects nest deeper than about {limit}") from None


# ---- bearer tokens --------------------------------------------------------------------


def read_api_token(path: str | Path) -> bytes:
    """The API token in a file (surrounding whitespace stripped): at least 16 characters
    of printable ASCII, the form a bearer token takes in an HTTP header. A file group or
    others may read or write is refused (`file_modes.FileModeError`, an OSError)."""
    raw = read_secret_file(path, "API token file")
    text = raw.decode("ascii", errors="replace").strip()
    if len(text) < MIN_TOKEN_CHARS or not all(33 <= ord(c) <= 126 for c in text):
        raise ValueError(
            f"API token file {path}: {len(text)} characters; need at least "
            f"{MIN_TOKEN_CHARS} printable ASCII characters without spaces"
        )
    return text.encode("ascii")


def token_option(path: str | None, option: str) -> bytes | None:
    """The token a command line option names (`read_api_token`), None without one; a
    ValueError worded for that option when the file cannot be read or is not a token."""
    if path is None:
        return None
    try:
        return read_api_token(path)
    except FileModeError as exc:
        raise ValueError(f"{option}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def bearer_authorised(headers: Message, token: bytes | None) -> bool:
    """True if the request's Authorization header is ``Bearer TOKEN`` for the configured
    `token` (compared in constant time); always False when no token is configured."""
    if token is None:
        return False
    sent = headers.get("Authorization", "").strip().encode("latin-1", "replace")
    return hmac.compare_digest(sent, b"Bearer " + token)


def bearer_challenge(realm: str) -> dict[str, str]:
    """The header a 401 answer carries (RFC 6750 section 3)."""
    return {"WWW-Authenticate": f'Bearer realm="{realm}"'}


def withheld(obj: dict[str, Any], fields: tuple[str, ...], note: str) -> dict[str, Any]:
    """What a caller without the token is told of `obj`: the `fields` on an allow-list
    (so a field added later stays withheld until someone judges it safe) and a
    ``withheld`` note saying why not more and how to serve it."""
    return {**{k: obj[k] for k in fields if k in obj}, "withheld": note}

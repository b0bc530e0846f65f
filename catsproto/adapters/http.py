"""A stdlib HTTP server on a background thread, shared by the modelled instance and the
steering API (one thread per connection; the handler class comes from the caller).

Strategy. A peer must not be able to hold the server by being slow or many, nor to
smuggle a second request inside the first. The bounds are here so every server built on
`BackgroundHTTPServer` has them:

* at most `max_handlers` connections are served at once. A connection that has not yet
  sent a complete request head (a new one, or a keep-alive waiting for its next
  request) costs the server nothing to drop, so those wait in a table, oldest first,
  counted per source (an IPv4 address, an IPv6 /64: `transfer_server.handshake_source`):
  a newcomer over its source's share (`max_waiting_per_source`, a quarter of the
  handlers) evicts that source's oldest, and a newcomer that finds every handler taken
  evicts the oldest of all. Only when every handler is serving a request whose head has
  arrived is the newcomer answered ``503`` with ``Connection: close`` by the accepting
  thread (a non-blocking send of a fixed reply). So idle connections, however many,
  cannot lock out GET /health or a token holder;
* each request, request line and headers and body, must arrive within one deadline
  (`READ_TIMEOUT_S`) of the moment the handler starts waiting for it: every read from
  the socket gets only the time left, so trickling one byte at a time does not extend
  it. A keep-alive connection that sends no next request is closed at the same deadline;
* a head whose body length is not one plain decimal Content-Length (any
  Transfer-Encoding, both, several or a non-digit Content-Length: RFC 9112 section 6.3)
  is answered 400 (411 for a chunked body alone) and the connection is closed, so no
  bytes after it are ever read as a request of their own (`framing_problem`).

All are counted in `HTTPStats` (``server.httpd.stats``), which the daemons show.

Bearer tokens. A daemon that serves what must not reach everybody takes a token from a
file (`read_api_token`) and checks ``Authorization: Bearer TOKEN`` on each request with
`bearer_authorised` (constant time); a caller without it is answered ``401`` with the
`bearer_challenge` of the daemon's realm, before any body is read.
"""

from __future__ import annotations

import contextlib
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
from catsproto.adapters.transfer_server import HandshakeTable, handshake_source

MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413)
READ_TIMEOUT_S = 10.0  # one request (line, headers, body) must arrive within this
MAX_HANDLERS = 512  # connections served at once (twice the listen backlog daemons use)
EVICT_WAIT_S = 2.0  # how long a newcomer waits for an evicted connection's handler to end
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

    busy_refused: int = 0  # connections answered 503: all handlers were serving requests
    deadline_expired: int = 0  # requests (or idle keep-alives) dropped at the deadline
    evicted: int = 0  # connections without a complete request head dropped for a newcomer
    bad_framing: int = 0  # heads refused for their body framing (Transfer-Encoding, ...)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def to_json(self) -> dict[str, int]:
        with self._lock:
            return {
                "busy_refused": self.busy_refused,
                "deadline_expired": self.deadline_expired,
                "evicted": self.evicted,
                "bad_framing": self.bad_framing,
            }


def _plain_length(value: str) -> bool:
    """A Content-Length value RFC 9110 section 8.6 allows: ASCII digits only (str.isdigit
    also takes '²' and other Unicode digits, which int() then refuses)."""
    return value.isascii() and value.isdigit()


def framing_problem(headers: Message) -> tuple[int, str] | None:
    """Why a request head's body length cannot be trusted (status, reason), or None.
    These servers read bodies by one Content-Length only: a chunked body would be left on
    the connection and read as the next request (RFC 9112 section 6.3, items 3 to 5)."""
    coding = headers.get_all("Transfer-Encoding") or []
    lengths = headers.get_all("Content-Length") or []
    if coding and lengths:
        return 400, "both Transfer-Encoding and Content-Length: the body's length is unclear"
    if coding:
        return 411, "send the body with a Content-Length (no Transfer-Encoding, no chunked bodies)"
    if len(lengths) > 1:
        return 400, f"{len(lengths)} Content-Length headers: send one"
    if lengths and not _plain_length(lengths[0].strip()):
        return 400, f"Content-Length {lengths[0].strip()[:40]!r} is not a byte count"
    return None


@dataclass(eq=False)
class _Waiting:
    """A connection that has not sent a complete request head; `evicted` once it was
    shut down to make room (its handler then ends without serving anything)."""

    sock: socket.socket
    waiting: bool = False  # in the table now
    evicted: bool = False


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
        if not self.server.wait_for_head(self.connection):
            self.close_connection = True  # evicted before this request began
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        """The head as the standard library parses it, then: an evicted connection ends
        here, and a head whose body framing is unclear is refused and the connection
        closed (`framing_problem`)."""
        parsed = super().parse_request()
        if not self.server.head_arrived(self.connection):
            self.close_connection = True  # shut down for a newcomer: what it read is cut
            return False
        if not parsed:
            return False
        problem = framing_problem(self.headers)
        if problem is None:
            return True
        self.server.stats.count("bad_framing")
        self.close_connection = True
        # the handler's own `refuse_framing(status, reason)` if it has one (its error shape)
        getattr(self, "refuse_framing", self._refuse_framing)(*problem)
        self.close_connection = True  # whatever the handler's answer said
        return False

    def _refuse_framing(self, status: int, reason: str) -> None:
        """Answer a head `framing_problem` refused, with Connection: close."""
        body = json.dumps({"error": reason}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

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
        max_waiting_per_source: int | None = None,
    ) -> None:
        if max_handlers < 1:
            raise ValueError(f"max_handlers must be at least 1, got {max_handlers}")
        if not request_deadline > 0:
            raise ValueError(f"request deadline must be positive, got {request_deadline}")
        per_source = max_waiting_per_source
        if per_source is None:
            per_source = max(1, max_handlers // 4)
        if not 1 <= per_source <= max_handlers:
            raise ValueError(
                f"max_waiting_per_source must be 1..max_handlers ({max_handlers}), got {per_source}"
            )
        self.stats = HTTPStats()
        self.max_handlers = max_handlers
        self.request_deadline = request_deadline
        self._slots = threading.BoundedSemaphore(max_handlers)
        # connections without a complete request head, oldest first, by source
        self._waiting: HandshakeTable[_Waiting] = HandshakeTable(max_handlers, per_source)
        self._entries: dict[socket.socket, tuple[_Waiting, str]] = {}
        self._waiting_lock = threading.Lock()
        super().__init__(address, handler)

    # ---- the table of connections waiting for their head ------------------------------

    def _shut(self, entry: _Waiting) -> None:
        """Evict `entry` (lock held, so its socket is still open): its handler's read
        ends at once and it serves nothing more."""
        entry.evicted = True
        with contextlib.suppress(OSError):  # the peer is gone already
            entry.sock.shutdown(socket.SHUT_RDWR)
        self.stats.count("evicted")

    def _enter(self, entry: _Waiting, source: str) -> None:
        """Put `entry` in the table (lock held), evicting the one it displaces."""
        out = self._waiting.admit(entry, source)
        entry.waiting = True
        if out is not None:
            self._shut(out[0])

    def _admit(self, request: socket.socket, source: str) -> None:
        """A newcomer, which has sent no head yet."""
        entry = _Waiting(request)
        with self._waiting_lock:
            self._entries[request] = (entry, source)
            self._enter(entry, source)

    def wait_for_head(self, request: socket.socket) -> bool:
        """A handler begins waiting for a request head (a keep-alive's next one: the
        connection is evictable again); False if the connection was evicted."""
        with self._waiting_lock:
            known = self._entries.get(request)
            if known is None or known[0].evicted:
                return False
            if not known[0].waiting:
                self._enter(*known)
            return True

    def head_arrived(self, request: socket.socket) -> bool:
        """The head is complete (or the attempt to read it ended): no longer evictable.
        False if the connection was evicted while it waited."""
        with self._waiting_lock:
            known = self._entries.get(request)
            if known is None or known[0].evicted:
                return False
            self._waiting.remove(known[0])
            known[0].waiting = False
            return True

    @property
    def waiting(self) -> int:
        """Connections that have not sent a complete request head, now."""
        with self._waiting_lock:
            return len(self._waiting)

    @property
    def in_service(self) -> int:
        """Connections that hold a handler, now (waiting for a head or not)."""
        with self._waiting_lock:
            return len(self._entries)

    def _evict_oldest(self) -> bool:
        with self._waiting_lock:
            oldest = self._waiting.pop_oldest()
            if oldest is None:
                return False
            self._shut(oldest)
            return True

    def _take_slot(self) -> bool:
        """A handler for a newcomer: a free one, or the one of the oldest connection that
        has not sent a complete request head, evicted for it."""
        if self._slots.acquire(blocking=False):
            return True
        return self._evict_oldest() and self._slots.acquire(timeout=EVICT_WAIT_S)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._take_slot():
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
        host = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        self._admit(request, handshake_source(host))
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            self._slots.release()  # no thread took the slot
            raise

    def _forget(self, request: socket.socket) -> None:
        with self._waiting_lock:
            known = self._entries.pop(request, None)
            if known is not None:
                self._waiting.remove(known[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line on stderr, not a traceback: a peer that hangs up mid-answer is common."""
        exc = sys.exc_info()[1]
        print(f"http: {client_address}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._forget(request)  # before the close: an evicting thread may still shut it
            self.shutdown_request(request)
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
        max_waiting_per_source: int | None = None,
    ):
        bounded = type(handler.__name__, (_DeadlineHandler, handler), {})
        self.httpd = _BoundedHTTPServer(
            (host, port), bounded, max_handlers, request_deadline, max_waiting_per_source
        )
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

    @property
    def waiting(self) -> int:
        """Connections that have not sent a complete request head, now (evictable)."""
        return self.httpd.waiting

    @property
    def in_service(self) -> int:
        """Connections that hold a handler, now."""
        return self.httpd.in_service

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
    if not _plain_length(raw_length):
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

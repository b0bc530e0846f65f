"""A stdlib HTTP server on a background thread, shared by the modelled instance and the
steering API (one thread per request; the handler class comes from the caller)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class BackgroundHTTPServer:
    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str, port: int):
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413)
READ_TIMEOUT_S = 10.0  # a client that stops sending mid-body is dropped after this


class BodyError(Exception):
    """A request body that cannot be taken: the HTTP status to answer, and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def read_json_body(handler: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY) -> object:
    """The request's JSON body (None when empty), read by its Content-Length, which must
    be a decimal count within `max_bytes`; a body that is short (the read times out),
    not UTF-8 or not JSON raises `BodyError`, never anything else."""
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
    if not raw:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"body is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError, and numbers Python cannot hold
        raise BodyError(400, f"body is not JSON: {exc}") from None

"""OpenAI wire shapes for the ingress: errors, the model list, server-sent events, and a
keep-alive connection pool towards the engines.

Strategy. The ingress forwards bodies byte for byte, so it needs little of the OpenAI
API: enough of a request to steer it (`model`, the prompt or messages, `stream`,
`stream_options`), the error object every OpenAI client understands
(``{"error": {"message", "type", "param", "code"}}``), and a splitter that cuts an SSE
byte stream into whole events as they arrive, so each can be looked at (usage) and
forwarded at once. Nothing here decides anything.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EnginePool",
    "IngressError",
    "SseSplitter",
    "error_body",
    "model_list",
    "public_answer",
    "public_event",
    "sse_event",
    "usage_of",
]

# OpenAI's error types by HTTP status (the `type` field; `code` names the case)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class IngressError(Exception):
    """A request the ingress answers with an OpenAI error: status, message, and the
    request field it is about (``param``) and a short machine-readable ``code``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def to_json(self) -> dict[str, Any]:
        return error_body(self.status, str(self), param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def model_list(models: list[tuple[str, int, str]]) -> dict[str, Any]:
    """GET /v1/models: (name, created, owner) per model, OpenAI's list shape."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owner}
            for name, created, owner in models
        ],
    }


# ---- server-sent events -----------------------------------------------------------------


def sse_event(obj: Any) -> bytes:
    """One ``data:`` event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class SseSplitter:
    """Cuts an SSE byte stream into whole events (each with its blank-line end), in the
    order they arrive; what is left at the end of the stream is in `rest`."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        events = []
        while True:
            cut = _event_end(self._buf)
            if cut < 0:
                return events
            events.append(self._buf[:cut])
            self._buf = self._buf[cut:]

    @property
    def rest(self) -> bytes:
        return self._buf


def _event_end(buf: bytes) -> int:
    """Where the first whole event in `buf` ends (after its blank line), -1 if none."""
    ends = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.find(sep)) >= 0]
    if not ends:
        return -1
    i, n = min(ends)
    return i + n


def event_data(event: bytes) -> bytes:
    """The data of one event (its ``data:`` lines joined), b"" if it has none."""
    lines = [
        line[5:].lstrip(b" ")
        for line in event.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines)


def usage_of(data: bytes) -> dict[str, Any] | None:
    """The usage object of an OpenAI answer or stream chunk (None if it carries none)."""
    if b'"usage"' not in data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


@dataclass(frozen=True, slots=True)
class UsageChunk:
    """A stream's usage-only chunk (``choices: []``), as vLLM ends a stream with
    ``stream_options.include_usage``: the usage, and the system fingerprint it carries."""

    usage: dict[str, Any]
    system_fingerprint: str | None


def usage_chunk(data: bytes) -> UsageChunk | None:
    """`data` as a usage-only chunk, or None if it is anything else."""
    if b'"usage"' not in data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if (
        not isinstance(obj, dict)
        or obj.get("choices") != []
        or not isinstance(obj.get("usage"), dict)
    ):
        return None
    fp = obj.get("system_fingerprint")
    return UsageChunk(obj["usage"], fp if isinstance(fp, str) else None)


def with_fingerprint(data: bytes, fingerprint: str) -> bytes:
    """A chunk's JSON with ``system_fingerprint`` added as its last member (where vLLM puts
    it on a stream's last chunk when no usage chunk follows); unchanged if it has one."""
    if b'"system_fingerprint"' in data:
        return data
    body = data.rstrip()
    if not body.endswith(b"}"):
        return data
    return body[:-1] + b',"system_fingerprint":' + json.dumps(fingerprint).encode() + b"}"


def public_answer(data: bytes) -> bytes:
    """An engine's JSON answer, or one stream chunk's, as a caller without the API token
    gets it: ``usage.prompt_tokens_details`` (the cached tokens) and ``system_fingerprint``
    (which engine configuration answered) null, as an engine without prompt-token
    details sends them; everything else as it was. Bytes that are not a JSON object, or
    carry neither, come back as they are (the same object)."""
    if b'"prompt_tokens_details"' not in data and b'"system_fingerprint"' not in data:
        return data
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(obj, dict):
        return data
    changed = False
    if obj.get("system_fingerprint") is not None:
        obj["system_fingerprint"] = None
        changed = True
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens_details") is not None:
        usage["prompt_tokens_details"] = None
        changed = True
    return json.dumps(obj, separators=(",", ":")).encode() if changed else data


def public_event(event: bytes) -> bytes:
    """One SSE event as a caller without the API token gets it (`public_answer`)."""
    data = event_data(event)
    public = public_answer(data)
    return event if public is data else b"data: " + public + b"\n\n"


# ---- the engines --------------------------------------------------------------------------


class _EngineConnection(http.client.HTTPConnection):
    """An HTTPConnection that sends a request's head and a bytes body in one send: the
    standard library sends them apart, and with TCP_NODELAY each send is a segment of
    its own (and on loopback a wake-up of the engine's reader) per request."""

    def _send_output(self, message_body: Any = None, encode_chunked: bool = False) -> None:
        if not isinstance(message_body, bytes):
            super()._send_output(message_body, encode_chunked=encode_chunked)
            return
        self._buffer.extend((b"", b""))  # type: ignore[attr-defined]
        msg = b"\r\n".join(self._buffer) + message_body  # type: ignore[attr-defined]
        del self._buffer[:]  # type: ignore[attr-defined]
        self.send(msg)


class EnginePool:
    """Idle keep-alive connections per engine (host, port): a request takes one (or opens
    one), gives it back when its answer was read to the end, drops it otherwise. A
    connection idle for `idle_s` or longer is closed instead of reused: vLLM's server
    (uvicorn) closes keep-alive connections idle for 5 s, and a request sent on one it is
    closing meets a connection closed without an answer."""

    def __init__(
        self,
        connect_timeout: float = 3.0,
        read_timeout: float = 600.0,
        max_idle: int = 64,
        idle_s: float = 4.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.idle_s = idle_s
        self._idle: dict[
            tuple[str, int], queue.LifoQueue[tuple[float, http.client.HTTPConnection]]
        ] = {}
        self._lock = threading.Lock()
        self.opened = 0  # connections opened (the rest of the requests reused one)

    def _queue(
        self, key: tuple[str, int]
    ) -> queue.LifoQueue[tuple[float, http.client.HTTPConnection]]:
        with self._lock:
            q = self._idle.get(key)
            if q is None:
                q = self._idle[key] = queue.LifoQueue()
            return q

    def take(
        self, host: str, port: int, *, fresh: bool = False
    ) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to the engine and whether it was reused (an idle one); `fresh`:
        a new one whatever is idle."""
        q = self._queue((host, port))
        while not fresh:
            try:
                since, idle = q.get_nowait()
            except queue.Empty:
                break
            if time.monotonic() - since < self.idle_s:
                return idle, True
            idle.close()  # the engine may be closing it right now
        conn = _EngineConnection(host, port, timeout=self.connect_timeout)
        conn.connect()  # refused or unreachable: OSError, within connect_timeout
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self.opened += 1
        return conn, False

    def give_back(self, host: str, port: int, conn: http.client.HTTPConnection) -> None:
        q = self._queue((host, port))
        if q.qsize() >= self.max_idle:
            conn.close()
        else:
            q.put((time.monotonic(), conn))

    def close(self) -> None:
        with self._lock:
            queues = list(self._idle.values())
            self._idle.clear()
        for q in queues:
            while True:
                try:
                    q.get_nowait()[1].close()
                except queue.Empty:
                    break

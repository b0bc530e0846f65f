"""A hostile BGP test speaker: just enough BGP to hold a session and send crafted UPDATEs.

Strategy: ExaBGP's text API cannot set every flag or send every byte string we want to
throw at the receiver, so this process speaks BGP itself over a plain socket, in its own
namespace. It listens on port 179 (ExaBGP connects out and does not listen), answers
OPEN with OPEN (four-octet AS and IPv4 unicast capabilities, hold time 9 s) and
KEEPALIVE, sends a KEEPALIVE every 3 s, and watches for a NOTIFICATION (which would mean
the peer reset the session: a failure for the campaign).

The UPDATEs to send come as *plan files*: `<dir>/plans/NNN.json`, each
`{"rate": per second, "messages": [{"case", "prefix", "flags", "value"(hex)}, ...]}`;
every message is one UPDATE announcing `prefix` with ORIGIN, AS_PATH (our AS), NEXT_HOP
and attribute 255 with exactly `flags` and `value` (the length is one or two bytes as
the Extended Length flag says, whatever that means for the value). `<dir>/status.json`
says what happened: state, messages sent per case, notifications, errors.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from catsproto.wire.bgp import build_update

MARKER = b"\xff" * 16
OPEN, UPDATE, NOTIFICATION, KEEPALIVE = 1, 2, 3, 4
HOLD_TIME = 9
KEEPALIVE_EVERY = 3.0


def attribute_bytes(flags: int, value: bytes, type_code: int = 255) -> bytes:
    """Flags, type, length and value exactly as asked (the length width follows the
    Extended Length flag, 0x10; a value too long for it is cut, which is the point)."""
    if flags & 0x10:
        return bytes([flags, type_code]) + struct.pack("!H", min(len(value), 0xFFFF)) + value
    return bytes([flags, type_code, min(len(value), 0xFF)]) + value[:0xFF]


def open_message(asn: int, router_id: str, hold: int = HOLD_TIME) -> bytes:
    caps = bytes([1, 4, 0, 1, 0, 1])  # multiprotocol: IPv4 unicast
    caps += bytes([65, 4]) + struct.pack("!I", asn)  # four-octet AS
    params = bytes([2, len(caps)]) + caps
    body = struct.pack(
        "!BHH4sB",
        4,
        asn if asn < 65536 else 23456,
        hold,
        ipaddress.IPv4Address(router_id).packed,
        len(params),
    )
    return _message(OPEN, body + params)


def _message(kind: int, body: bytes) -> bytes:
    return MARKER + struct.pack("!HB", 19 + len(body), kind) + body


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf


class HostileSpeaker:
    """One passive BGP session; `send(update_bytes)` once established."""

    def __init__(self, asn: int, router_id: str, listen: str, status_path: Path) -> None:
        self.asn, self.router_id, self.listen = asn, router_id, listen
        self.status_path = status_path
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.status_lock = threading.Lock()
        self.status: dict[str, Any] = {
            "state": "idle",
            "established_at": None,
            "sessions": 0,
            "sent": {},
            "sent_total": 0,
            "notifications": [],
            "errors": [],
            "plans_done": [],
        }
        self.write_status()

    def write_status(self) -> None:
        with self.status_lock:
            text = json.dumps(self.status, indent=1)
            tmp = self.status_path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.status_path)

    def serve(self) -> None:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.listen, 179))
        server.listen(1)
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._session(conn)
            except (OSError, ConnectionError) as exc:
                self.status["errors"].append(f"{time.time():.3f} session: {exc}")
            finally:
                with self.lock:
                    self.sock = None
                self.status["state"] = "idle"
                self.write_status()
                with contextlib.suppress(OSError):
                    conn.close()

    def _session(self, conn: socket.socket) -> None:
        conn.sendall(open_message(self.asn, self.router_id))
        self.status["state"] = "open-sent"
        last_sent = time.monotonic()
        conn.settimeout(KEEPALIVE_EVERY / 2)
        while True:
            try:
                header = _read_exact(conn, 19)
            except TimeoutError:
                header = b""
            if header:
                length, kind = struct.unpack("!HB", header[16:19])
                body = _read_exact(conn, length - 19) if length > 19 else b""
                if kind == OPEN:
                    conn.sendall(_message(KEEPALIVE, b""))
                    last_sent = time.monotonic()
                elif kind == KEEPALIVE and self.status["state"] != "established":
                    self.status.update(state="established", established_at=time.time())
                    self.status["sessions"] += 1
                    self.write_status()
                    with self.lock:
                        self.sock = conn
                elif kind == NOTIFICATION:
                    code, sub = (body + b"\0\0")[:2]
                    self.status["notifications"].append(
                        {"time": time.time(), "code": code, "subcode": sub, "data": body[2:].hex()}
                    )
                    self.write_status()
                    raise ConnectionError(f"NOTIFICATION {code}/{sub}")
            if time.monotonic() - last_sent >= KEEPALIVE_EVERY:
                with self.lock:
                    conn.sendall(_message(KEEPALIVE, b""))
                last_sent = time.monotonic()

    def send(self, data: bytes) -> bool:
        with self.lock:
            if self.sock is None:
                return False
            self.sock.sendall(data)
            return True


def run_plan(speaker: HostileSpeaker, plan: dict[str, Any], next_hop: str) -> None:
    """Send a plan's messages at its rate (one UPDATE each), counting per case."""
    rate = float(plan.get("rate", 100.0))
    start = time.monotonic()
    hop = ipaddress.IPv4Address(next_hop)
    for i, m in enumerate(plan["messages"]):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        update = build_update(
            [ipaddress.IPv4Network(m["prefix"])],
            hop,
            [attribute_bytes(int(m["flags"]), bytes.fromhex(m["value"]))],
            as_path=(speaker.asn,),
        )
        if not speaker.send(update):
            speaker.status["errors"].append(f"{time.time():.3f} not established: message {i}")
            continue
        sent = speaker.status["sent"]
        sent[m["case"]] = sent.get(m["case"], 0) + 1
        speaker.status["sent_total"] += 1
        if i % 100 == 0:
            speaker.write_status()
    speaker.write_status()


def write_plan(speaker_dir: Path, name: str, the_plan: dict) -> None:
    """Hand the speaker a plan: written beside and renamed into place, so the speaker,
    which polls plans/*.json, never reads half a file."""
    tmp = speaker_dir / "plans" / f".{name}.tmp"
    tmp.write_text(json.dumps(the_plan))
    tmp.rename(speaker_dir / "plans" / name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="hostile BGP test speaker (lab only)")
    p.add_argument("--dir", required=True, help="plans/ in, status.json out")
    p.add_argument("--asn", type=int, required=True)
    p.add_argument("--router-id", required=True)
    p.add_argument("--listen", required=True, help="local address (the next hop too)")
    args = p.parse_args(argv)
    base = Path(args.dir)
    (base / "plans").mkdir(parents=True, exist_ok=True)
    speaker = HostileSpeaker(args.asn, args.router_id, args.listen, base / "status.json")
    threading.Thread(target=speaker.serve, daemon=True).start()
    done: set[str] = set()
    try:
        while True:
            for f in sorted((base / "plans").glob("*.json")):
                if f.name in done or speaker.sock is None:
                    continue
                try:
                    the_plan = json.loads(f.read_text())
                except ValueError:  # a writer that did not rename into place: next round
                    continue
                done.add(f.name)
                run_plan(speaker, the_plan, args.listen)
                speaker.status["plans_done"].append(f.name)
                speaker.write_status()
            time.sleep(0.05)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())

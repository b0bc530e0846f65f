"""The holder: a threaded server that serves blocks to authenticated pullers.

Strategy: one thread per connection runs the transfer core's `Holder` over the
authenticated channel; connections not yet authenticated are capped in all and per
source (an IPv4 address, an IPv6 /64), the oldest evicted for a newcomer
(`HandshakeTable`), so idle peers cannot shut pulls out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from catsproto.adapters.transfer_channel import (
    OFFER_TIMEOUT,
    RECV_SIZE,
    SLOT_WAIT,
    Deadline,
    HandshakeDeadlineError,
    RequestDeadlineError,
    _readable,
    secure,
)
from catsproto.adapters.transfer_identity import PeerAuthError, PeerPolicy, TransferIdentity
from catsproto.transfer import (
    Holder,
    PeerCancelled,
    StoredBlock,
    TransferError,
)
from catsproto.transfer.frames import MAX_BODY

# ---- the holder: a threaded server -----------------------------------------------------


@dataclass
class ServedTransfer:
    """What the server did for one connection (tests and the CLI read these)."""

    peer: str
    peer_key_id: str = ""
    transfer_id: int = 0
    blocks_sent: int = 0
    payload_bytes: int = 0
    evicted_at: int | None = None
    cancelled: bool = False
    error: str = ""


@dataclass
class ServerOptions:
    """How the holder serves. Checked when made: a bad value raises ValueError naming it,
    rather than every later pull failing on it.

    timeout: seconds any one read or write may block (a stalled puller is dropped).
    handshake_timeout: seconds from accept to the end of the TLS handshake, in all.
    offer_timeout: seconds from accept until the peer's offer is in whole (default
        2 s, or handshake_timeout if shorter): a peer that sends nothing is dropped then.
    request_timeout: seconds from then (from accept over bare TCP) until the PULL (or a
        CANCEL) has come in whole, in all (default handshake_timeout).
    max_connections: connections served at once; one more is closed at accept, unserved,
        unless one of them is still unauthenticated: then the oldest such is closed.
    max_handshakes: of those, how many may still be unauthenticated (default half of
        max_connections, at least 1), so peers that never authenticate cannot take every
        slot; max_handshakes_per_source: the same per source, an IPv4 address or an
        IPv6 /64 (default a quarter of max_handshakes, at least 1), so one source cannot
        take all of those. Over either cap the *oldest* unauthenticated connection (of
        that source, or of all) is closed to make room: a new peer is never refused.
    min_rate_bps: the lowest rate a PULL may ask (lower is refused with BAD_REQUEST); a
        pull must also end within `timeout` plus its blocks' bytes at this rate.
    max_records: how many `ServedTransfer` records the server keeps (the newest).
    """

    epoch: int = 1
    rate_bps: float = 0
    chunk: int = 256 << 10
    plaintext: bool = False  # benchmarks only: the same frames over bare TCP
    timeout: float = 30.0
    handshake_timeout: float = 5.0
    offer_timeout: float | None = None
    request_timeout: float | None = None
    max_connections: int = 64
    max_handshakes: int | None = None
    max_handshakes_per_source: int | None = None
    min_rate_bps: float = 125_000
    max_records: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.epoch < 1 << 64:
            raise ValueError(f"epoch {self.epoch} is not 1..2^64-1 (0 means none on the wire)")
        if not 0 <= self.rate_bps < 2**64:  # also refuses NaN
            raise ValueError(f"rate {self.rate_bps} bytes/s is not 0 (none)..2^64-1")
        if not 0 < self.chunk <= MAX_BODY:
            raise ValueError(f"chunk {self.chunk} bytes is not 1..{MAX_BODY}")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout {self.timeout} s is not a positive number")
        if not 0 < self.handshake_timeout < math.inf:
            raise ValueError(
                f"handshake_timeout {self.handshake_timeout} s is not a positive number"
            )
        if self.offer_timeout is None:
            self.offer_timeout = min(OFFER_TIMEOUT, self.handshake_timeout)
        if not 0 < self.offer_timeout <= self.handshake_timeout:
            raise ValueError(
                f"offer_timeout {self.offer_timeout} s is not a positive number up to "
                f"handshake_timeout ({self.handshake_timeout} s)"
            )
        if self.request_timeout is None:
            self.request_timeout = self.handshake_timeout
        if not 0 < self.request_timeout < math.inf:
            raise ValueError(f"request_timeout {self.request_timeout} s is not a positive number")
        if self.max_connections < 1:
            raise ValueError(f"max_connections {self.max_connections} is not >= 1")
        if self.max_handshakes is None:
            self.max_handshakes = max(1, self.max_connections // 2)
        if not 1 <= self.max_handshakes <= self.max_connections:
            raise ValueError(
                f"max_handshakes {self.max_handshakes} is not 1..max_connections "
                f"({self.max_connections})"
            )
        if self.max_handshakes_per_source is None:
            self.max_handshakes_per_source = max(1, self.max_handshakes // 4)
        if not 1 <= self.max_handshakes_per_source <= self.max_handshakes:
            raise ValueError(
                f"max_handshakes_per_source {self.max_handshakes_per_source} is not "
                f"1..max_handshakes ({self.max_handshakes})"
            )
        if not 0 <= self.min_rate_bps < 2**64:  # also refuses NaN
            raise ValueError(f"min_rate_bps {self.min_rate_bps} bytes/s is not 0 (none)..2^64-1")
        if self.max_records < 0:
            raise ValueError(f"max_records {self.max_records} is not >= 0")


@dataclass
class ServerStats:
    """Counters over the server's whole life (`served` keeps only the newest records)."""

    connections: int = 0
    """Connections taken in and served (busy refusals not included)."""
    completed: int = 0
    """Served to the end of the pull (all blocks, or up to an eviction)."""
    cancelled: int = 0
    errors: int = 0
    """Connections that ended in an error (refused peers, timeouts, bad frames ...)."""
    busy: int = 0
    """Connections closed at once because max_connections were being served, all of
    them authenticated."""
    handshakes_evicted: int = 0
    """Unauthenticated connections closed to make room for a newer one: over
    max_handshakes (in all, or from that source), or for a slot when max_connections
    were in service (also counted in `errors`)."""
    handshake_timeouts: int = 0
    """Connections dropped when handshake_timeout passed before they authenticated
    (also counted in `errors`)."""
    request_timeouts: int = 0
    """Connections dropped when request_timeout passed after authentication before the
    PULL had come in whole (also counted in `errors`)."""
    too_slow: int = 0
    """Pulls dropped when they outlived timeout plus their bytes at min_rate_bps (also
    counted in `errors`)."""


def handshake_source(host: str) -> str:
    """What a per-source cap counts by: an IPv4 address, or an IPv6 address's /64 (a
    host commonly has a whole /64, so counting IPv6 by address would give one host
    2^64 sources); an IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


T = TypeVar("T")


class HandshakeTable(Generic[T]):
    """The connections not yet authenticated, oldest first, each with its source
    (`handshake_source`): bookkeeping only, no sockets.

    `admit` never refuses: over `per_source` from the new one's source, that source's
    oldest goes; else over `limit` in all, the oldest of all goes. A peer that parks idle
    connections so makes room for the next newcomer instead of shutting it out; to push
    an honest peer out before it authenticates (a few milliseconds) it must open `limit`
    connections in that time. `per_source` must not exceed `limit`."""

    def __init__(self, limit: int, per_source: int) -> None:
        if not 1 <= per_source <= limit:
            raise ValueError(f"per_source {per_source} is not 1..limit ({limit})")
        self.limit, self.per_source = limit, per_source
        self._source: dict[T, str] = {}  # item -> its source, in arrival order
        self._count: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._source)

    def count(self, source: str) -> int:
        return self._count.get(source, 0)

    def admit(self, item: T, source: str) -> tuple[T, str] | None:
        """Add `item` from `source`; the item removed to make room and why, if any."""
        evicted = None
        if self.count(source) >= self.per_source:
            oldest = next(i for i, s in self._source.items() if s == source)
            evicted = (oldest, f"{self.per_source} from {source} not yet authenticated")
        elif len(self._source) >= self.limit:
            evicted = (next(iter(self._source)), f"{self.limit} not yet authenticated")
        if evicted is not None:
            self.remove(evicted[0])
        self._source[item] = source
        self._count[source] = self.count(source) + 1
        return evicted

    def pop_oldest(self) -> T | None:
        """Remove and return the oldest item, if any."""
        oldest = next(iter(self._source), None)
        if oldest is not None:
            self.remove(oldest)
        return oldest

    def remove(self, item: T) -> bool:
        """Remove `item`; False if it was not there (evicted already)."""
        source = self._source.pop(item, None)
        if source is None:
            return False
        left = self._count.pop(source) - 1
        if left:
            self._count[source] = left
        return True


@dataclass(eq=False)
class _Unauthenticated:
    """A connection in `TransferServer`'s handshake table: a duplicate of its socket (the
    serving thread's own socket object is taken over by TLS), kept open until the entry
    leaves the table, so the accept loop can shut the connection down; `evicted` says
    why, once it has."""

    handle: socket.socket
    evicted: str = ""


class TransferServer:
    """Serves pulls from `lookup(key) -> StoredBlock | None` on `host:port`."""

    def __init__(
        self,
        identity: TransferIdentity | None,
        policy: PeerPolicy | None,
        lookup: Callable[[int], StoredBlock | None],
        host: str = "127.0.0.1",
        port: int = 0,
        options: ServerOptions | None = None,
    ) -> None:
        self.options = options or ServerOptions()
        if not self.options.plaintext and (identity is None or policy is None):
            raise ValueError("TLS needs an identity and a peer policy")
        self.identity, self.policy, self.lookup = identity, policy, lookup
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.served: deque[ServedTransfer] = deque(maxlen=self.options.max_records)
        self.stats = ServerStats()
        self._threads: set[threading.Thread] = set()
        self._slots = threading.BoundedSemaphore(self.options.max_connections)
        self._unauthenticated: HandshakeTable[_Unauthenticated] = HandshakeTable(
            self.options.max_handshakes,  # type: ignore[arg-type]
            self.options.max_handshakes_per_source,  # type: ignore[arg-type]
        )
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)

    def start(self) -> TransferServer:
        if not self._accept.is_alive():
            self._accept.start()
        return self

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accept.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> TransferServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            if not self._take_slot():
                # refuse rather than queue: the puller learns at once and can recompute
                self._refuse(
                    conn, peer, f"busy: {self.options.max_connections} connections in service"
                )
                continue
            entry = None
            if not self.options.plaintext:  # bare TCP has no unauthenticated phase
                try:
                    entry = self._admit(conn, peer[0])
                except OSError as exc:  # no descriptor left for the duplicate
                    self._slots.release()
                    self._refuse(conn, peer, f"busy: {exc.strerror or exc}")
                    continue
            t = threading.Thread(target=self._serve_counted, args=(conn, peer, entry), daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _refuse(self, conn: socket.socket, peer: tuple, why: str) -> None:
        with contextlib.suppress(OSError):
            conn.close()
        with self._lock:
            self.stats.busy += 1
            self.served.append(ServedTransfer(f"{peer[0]}:{peer[1]}", error=why))

    def _take_slot(self) -> bool:
        """A slot for a new connection: a free one or, when all are taken, the one of the
        oldest unauthenticated connection, which is evicted for it."""
        if self._slots.acquire(blocking=False):
            return True
        n = self.options.max_connections
        with self._lock:
            oldest = self._unauthenticated.pop_oldest()
            if oldest is None:
                return False
            oldest.evicted = f"the oldest unauthenticated while {n} connections were in service"
        self._shut(oldest)
        return self._slots.acquire(timeout=SLOT_WAIT)

    def _admit(self, conn: socket.socket, host: str) -> _Unauthenticated:
        """Enter a new connection in the handshake table, evicting the oldest one (of its
        source, or of all) if it is over a cap."""
        entry = _Unauthenticated(conn.dup())
        with self._lock:
            out = self._unauthenticated.admit(entry, handshake_source(host))
            if out is not None:
                out[0].evicted = f"the oldest of {out[1]}"
        if out is not None:
            self._shut(out[0])
        return entry

    def _shut(self, evicted: _Unauthenticated) -> None:
        """Close an evicted connection: its thread's next read or write fails at once."""
        with contextlib.suppress(OSError):
            evicted.handle.shutdown(socket.SHUT_RDWR)
        evicted.handle.close()
        with self._lock:
            self.stats.handshakes_evicted += 1

    def _authenticated(self, entry: _Unauthenticated) -> bool:
        """Take `entry` out of the handshake table; False if it was evicted first."""
        with self._lock:
            present = self._unauthenticated.remove(entry)
        if present:
            entry.handle.close()
        return present

    def _serve_counted(
        self, conn: socket.socket, peer: tuple, entry: _Unauthenticated | None
    ) -> None:
        record = ServedTransfer(f"{peer[0]}:{peer[1]}")
        with self._lock:
            self.served.append(record)
            self.stats.connections += 1
        try:
            self._serve(conn, record, entry)
        finally:
            with self._lock:
                if record.error:
                    self.stats.errors += 1
                elif record.cancelled:
                    self.stats.cancelled += 1
                else:
                    self.stats.completed += 1
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _serve(
        self, conn: socket.socket, record: ServedTransfer, entry: _Unauthenticated | None
    ) -> None:
        o = self.options
        deadline = Deadline(o.handshake_timeout, o.timeout)
        offer_deadline = Deadline(o.offer_timeout, o.timeout)  # type: ignore[arg-type]
        handshaking = entry is not None  # in the handshake table since accept
        sock: socket.socket = conn
        try:
            conn.settimeout(o.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if entry is not None:
                assert self.identity is not None and self.policy is not None
                sock, auth = secure(
                    conn,
                    self.identity,
                    self.policy,
                    server_side=True,
                    deadline=deadline,
                    offer_deadline=offer_deadline,
                )
                record.peer_key_id = auth.key_id.hex()
                handshaking = False
                if not self._authenticated(entry):
                    raise PeerAuthError("handshake", "evicted")  # its socket is shut down
            self._stream(sock, record)
        except (TransferError, OSError, ssl.SSLError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            if entry is not None and entry.evicted:
                record.error = f"evicted before authentication: {entry.evicted}"
            elif isinstance(exc, HandshakeDeadlineError):
                with self._lock:
                    self.stats.handshake_timeouts += 1
            elif isinstance(exc, RequestDeadlineError):
                with self._lock:
                    self.stats.request_timeouts += 1
        except Exception as exc:  # a bug must cost one connection, never the server
            record.error = f"internal {type(exc).__name__}: {exc}"
        finally:
            if handshaking:
                assert entry is not None
                self._authenticated(entry)  # leaves the table, whatever ended it
            with contextlib.suppress(OSError):
                sock.close()

    def _stream(self, sock: socket.socket, record: ServedTransfer) -> None:
        o = self.options
        holder = Holder(
            self.lookup, o.epoch, chunk=o.chunk, rate_bps=o.rate_bps, min_rate_bps=o.min_rate_bps
        )
        # one deadline for the whole request, as for the handshake: a trusted peer that
        # trickles its PULL a byte per `timeout` is dropped all the same
        assert o.request_timeout is not None
        deadline = Deadline(o.request_timeout, o.timeout, RequestDeadlineError)
        got = 0
        while holder.pull is None and not holder.finished:
            what = f"PULL ({got} bytes in)"
            deadline.arm(sock, what)
            try:
                data = sock.recv(RECV_SIZE)
            except TimeoutError:
                if deadline.passed():
                    raise deadline.expired(what) from None
                raise
            got += len(data)
            if not data:
                record.error = "connection closed before a PULL"
                return
            holder.receive(data)
        sock.settimeout(o.timeout)  # back from the deadline's time left
        if holder.pull is None:  # cancelled before it asked for anything
            record.cancelled = True
            return
        record.transfer_id = holder.pull.transfer_id
        if holder.refusal is not None:
            record.error = f"refused: {holder.refusal.reason}"
        # the pull's own deadline: `timeout`, plus every byte of the blocks begun so far at
        # the lowest rate served (the floor, or the holder's own rate if lower)
        floor = min((r for r in (o.min_rate_bps, o.rate_bps) if r > 0), default=0)
        started = time.monotonic()

        def time_left() -> float:
            if not floor:
                return math.inf
            return started + o.timeout + holder.payload_bytes_due / floor - time.monotonic()

        clean = True  # end with a TLS close_notify (not after a peer that is gone or stuck)
        # every write may block `timeout` at most, and never past the pull's deadline
        while not holder.finished and not self._closing.is_set():
            now = time.monotonic()
            left = time_left()
            if left <= 0:
                clean = self._too_slow(record, holder, floor)
                break
            if _readable(sock):
                data = sock.recv(RECV_SIZE)
                if not data:
                    clean = False
                    record.error = (
                        f"the puller closed the connection after {holder.blocks_sent} "
                        f"of {len(holder.pull.keys)} blocks"
                    )
                    break
                if any(isinstance(e, PeerCancelled) for e in holder.receive(data)):
                    record.cancelled = True
                    break
            out = holder.send(now, limit=1 << 20)
            if out:
                sock.settimeout(min(o.timeout, left))
                try:
                    sock.sendall(out)
                except TimeoutError:
                    if time_left() > 0:
                        raise
                    clean = self._too_slow(record, holder, floor)
                    break
                continue
            nxt = holder.next_send_at(now)
            if nxt is None:
                break
            if nxt > now:  # wait, but wake for the puller's CANCEL or its going away
                _readable(sock, min(nxt - now, o.timeout, left))
        if self._closing.is_set() and not holder.finished:
            with contextlib.suppress(OSError):
                sock.sendall(holder.cancel("server shutting down"))
        record.blocks_sent = holder.blocks_sent
        record.payload_bytes = holder.payload_bytes_sent
        record.evicted_at = holder.evicted.index if holder.evicted else None
        if isinstance(sock, ssl.SSLSocket) and clean:
            with contextlib.suppress(OSError, ssl.SSLError):
                sock.unwrap()

    def _too_slow(self, record: ServedTransfer, holder: Holder, floor: float) -> bool:
        record.error = (
            f"too slow: {holder.payload_bytes_sent} of {holder.payload_bytes_due} bytes sent "
            f"past the deadline of {self.options.timeout:g} s plus those bytes at "
            f"{floor:.15g} bytes/s"
        )
        with self._lock:
            self.stats.too_slow += 1
        return False  # no clean close: the peer is not reading

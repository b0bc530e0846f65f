"""Block transfer over TLS 1.3 with mutual authentication by trust-store node keys.

Strategy: every node's transfer certificate is a self-signed X.509 certificate whose
key *is* its Ed25519 node key (`transfer_certificate`), so no CA is involved: a peer is
trusted when its certificate's public key has a delegation in the `TrustStore` that is
valid now (and, for a puller, when it is the holder it meant to reach). Python's `ssl`
has no verification callback, so each side first sends a one-line *offer* in the clear,
``"CATSXFR1" | u16 length | certificate DER``; the other side checks that key against
the trust store and then runs a TLS 1.3 handshake whose only trust anchor is exactly
that certificate, with its own certificate as the client/server certificate. The
handshake proves possession of the private key (CertificateVerify), so replaying
somebody else's offer fails there; after it, the certificate seen in TLS must be the
offered one and is checked against the trust store again. The offers show node
identities (key ids) to an on-path observer; the blocks themselves only travel inside
TLS. Frames and state machines are `catsproto.transfer`; this module only moves bytes:
one thread per connection on the holder (`TransferServer`), a blocking `pull` on the
puller, both pacing with `time.monotonic()` as the core's `now`.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from catsproto.security import (
    Authorisation,
    KeyExpiredError,
    SigningKey,
    TrustStore,
    UnknownKeyError,
    key_id,
)
from catsproto.transfer import (
    Completed,
    Holder,
    PeerCancelled,
    Puller,
    PullerEvent,
    ResumeState,
    StoredBlock,
    TransferError,
    TruncatedTransferError,
)
from catsproto.transfer.frames import MAX_BODY

TRANSFER_PORT = 7470
"""Where an instance serves pulls: this TCP port on its advertised Origin address (the
lab's convention; docs/transfer.md, "Finding the holder")."""
OFFER_MAGIC = b"CATSXFR1"
_OFFER_LEN = struct.Struct(">H")
MAX_CERT = 4096
RECV_SIZE = 1 << 20


class PeerAuthError(TransferError):
    """The peer is not who it must be; `reason` is one of the `REASONS`."""

    REASONS = ("bad-certificate", "unknown-key", "key-expired", "wrong-peer", "handshake")

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.code = reason

    def located(self, offset: int | None, tlv_type: int | None) -> PeerAuthError:
        return self


class HandshakeDeadlineError(PeerAuthError):
    """The peer did not finish its offer and the TLS handshake within the time allowed."""

    def __init__(self, seconds: float, what: str) -> None:
        super().__init__("handshake", f"{what} not done within the deadline of {seconds:g} s")


class RequestDeadlineError(TransferError):
    """An authenticated puller did not finish sending its PULL within the time allowed."""

    def __init__(self, seconds: float, what: str) -> None:
        super().__init__(f"request: {what} not done within the deadline of {seconds:g} s")


@dataclass
class Deadline:
    """One absolute limit (on `time.monotonic()`) for one phase (by default the
    unauthenticated one): before each blocking step the socket's timeout is set to the
    time left (at most `per_op`), so a peer trickling a byte just before each timeout
    still runs out of time. At expiry `error(seconds, what)` is raised."""

    seconds: float
    per_op: float
    error: Callable[[float, str], TransferError] = HandshakeDeadlineError
    at: float = field(init=False)

    def __post_init__(self) -> None:
        self.at = time.monotonic() + self.seconds

    def arm(self, sock: socket.socket, what: str) -> None:
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.error(self.seconds, what)
        sock.settimeout(min(left, self.per_op))

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def expired(self, what: str) -> TransferError:
        """The error to raise for `what` once the deadline has passed."""
        return self.error(self.seconds, what)


class ChannelError(TransferError):
    """The connection failed under the protocol (TLS alert or bad record, reset)."""


class ConnectError(ChannelError):
    """The puller could not connect to the holder (refused, unreachable): nothing was
    sent, so nothing of the transfer was lost."""


# ---- certificates ----------------------------------------------------------------------


def transfer_certificate(
    key: SigningKey, not_before: datetime.datetime, not_after: datetime.datetime
) -> bytes:
    """The node's self-signed Ed25519 certificate (DER): subject CN = key id in hex."""
    private = Ed25519PrivateKey.from_private_bytes(key.seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"catsproto {key.key_id.hex()}")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(int.from_bytes(key.key_id, "big") >> 1 or 1)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
    )
    return builder.sign(private, None).public_bytes(serialization.Encoding.DER)


def certificate_key(der: bytes) -> bytes:
    """The raw Ed25519 public key of a self-signed transfer certificate (checked)."""
    try:
        cert = x509.load_der_x509_certificate(der)
        public = cert.public_key()
        if not isinstance(public, Ed25519PublicKey):
            raise PeerAuthError("bad-certificate", "not an Ed25519 key")
        public.verify(cert.signature, cert.tbs_certificate_bytes)
    except PeerAuthError:
        raise
    except Exception as exc:  # any parse or signature failure is one refusal
        raise PeerAuthError("bad-certificate", str(exc) or type(exc).__name__) from None
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class TransferIdentity:
    """A node key with its transfer certificate, both held in memory as PEM. Python's
    `ssl` loads certificate chains from files only, so `load_into` writes them to a
    private directory (0700, key 0600) for the one `load_cert_chain` call and removes it
    at once: no private key file outlives the call, even when the process is killed."""

    def __init__(
        self,
        key: SigningKey,
        *,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self.key = key
        self.certificate = transfer_certificate(
            key,
            not_before or now - datetime.timedelta(hours=1),
            not_after or now + datetime.timedelta(days=1),
        )
        self._cert_pem = ssl.DER_cert_to_PEM_cert(self.certificate).encode()
        self._key_pem = Ed25519PrivateKey.from_private_bytes(key.seed).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def load_into(self, ctx: ssl.SSLContext) -> None:
        """`ctx.load_cert_chain` with this certificate and key."""
        with tempfile.TemporaryDirectory(prefix="catsproto-xfer-") as folder:
            os.chmod(folder, 0o700)
            cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert_file.write_bytes(self._cert_pem)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._key_pem)
            ctx.load_cert_chain(cert_file, key_file)

    @property
    def key_id(self) -> bytes:
        return self.key.key_id

    def close(self) -> None:
        """Nothing is left to remove (kept so callers can close identities alike)."""

    def __enter__(self) -> TransferIdentity:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class PeerPolicy:
    """Which peers to accept: a trust-store delegation valid at `clock_ms()`, and, when
    `expected_key_id` is set, exactly that node."""

    trust: TrustStore
    expected_key_id: bytes | None = None
    clock_ms: Callable[[], int] = wall_clock_ms

    def check(self, certificate: bytes) -> Authorisation:
        raw = certificate_key(certificate)
        kid = key_id(raw)
        if self.expected_key_id is not None and kid != self.expected_key_id:
            raise PeerAuthError(
                "wrong-peer", f"key {kid.hex()}, expected {self.expected_key_id.hex()}"
            )
        auth = self.trust.lookup(kid)
        if auth is None or auth.node.raw != raw:
            raise PeerAuthError("unknown-key", f"no delegation for key {kid.hex()}")
        try:
            auth.check_validity(self.clock_ms())
        except KeyExpiredError as exc:
            raise PeerAuthError("key-expired", str(exc)) from None
        except UnknownKeyError as exc:  # pragma: no cover - lookup already answered
            raise PeerAuthError("unknown-key", str(exc)) from None
        return auth


# ---- the authenticated channel ---------------------------------------------------------


def send_offer(sock: socket.socket, certificate: bytes) -> None:
    sock.sendall(OFFER_MAGIC + _OFFER_LEN.pack(len(certificate)) + certificate)


HOLDER_CLOSED_DURING_OFFER = (
    "the holder closed the connection during the offer: it may not trust this node's key"
)
"""What a puller reports when the holder closes before a byte of its offer: a holder
that refuses the puller's key closes without a word (the protocol has no refusal before
the peer is authenticated), so that is the likely cause."""


def _recv_exact(
    sock: socket.socket, n: int, deadline: Deadline | None = None, closed_at_start: str = ""
) -> bytes:
    """`n` bytes of an offer; `closed_at_start`, if given, is the error detail when the
    peer closes before sending any."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            deadline.arm(sock, f"offer ({len(buf)}/{n} bytes)")
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError:
            if deadline is not None and deadline.passed():
                raise deadline.expired(f"offer ({len(buf)}/{n} bytes)") from None
            raise
        if not part:
            if not buf and closed_at_start:
                raise PeerAuthError("handshake", closed_at_start)
            raise PeerAuthError("handshake", f"connection closed during the offer ({len(buf)}/{n})")
        buf += part
    return bytes(buf)


def read_offer(
    sock: socket.socket, deadline: Deadline | None = None, closed_at_start: str = ""
) -> bytes:
    head = _recv_exact(sock, len(OFFER_MAGIC) + _OFFER_LEN.size, deadline, closed_at_start)
    if head[: len(OFFER_MAGIC)] != OFFER_MAGIC:
        raise PeerAuthError("handshake", "not a catsproto transfer offer")
    (n,) = _OFFER_LEN.unpack_from(head, len(OFFER_MAGIC))
    if not 0 < n <= MAX_CERT:
        raise PeerAuthError("bad-certificate", f"offered certificate of {n} bytes")
    return _recv_exact(sock, n, deadline)


def tls_context(identity: TransferIdentity, anchor: bytes, *, server_side: bool) -> ssl.SSLContext:
    """TLS 1.3 only, our certificate, and the peer's certificate as the only anchor."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=anchor)
    identity.load_into(ctx)
    return ctx


def secure(
    sock: socket.socket,
    identity: TransferIdentity,
    policy: PeerPolicy,
    *,
    server_side: bool,
    deadline: Deadline | None = None,
) -> tuple[ssl.SSLSocket, Authorisation]:
    """Offers, trust-store check, TLS 1.3 handshake, re-check. Raises `PeerAuthError`
    (`HandshakeDeadlineError` when `deadline` passes first). With a deadline, the socket
    is left with its `per_op` timeout."""
    if server_side:
        offered = read_offer(sock, deadline)
        policy.check(offered)
        if deadline is not None:
            deadline.arm(sock, "offer")
        send_offer(sock, identity.certificate)
    else:
        if deadline is not None:
            deadline.arm(sock, "our offer")
        send_offer(sock, identity.certificate)
        offered = read_offer(sock, deadline, HOLDER_CLOSED_DURING_OFFER)
        policy.check(offered)
    ctx = tls_context(identity, offered, server_side=server_side)
    if deadline is not None:
        deadline.arm(sock, "TLS handshake")  # Python's handshake holds to one timeout in all
    try:
        tls = ctx.wrap_socket(sock, server_side=server_side)
        seen = tls.getpeercert(binary_form=True)
    except (ssl.SSLError, OSError) as exc:
        if deadline is not None and isinstance(exc, TimeoutError) and deadline.passed():
            raise deadline.expired("TLS handshake") from None
        raise PeerAuthError("handshake", str(exc)) from None
    if deadline is not None:
        tls.settimeout(deadline.per_op)
    if seen != offered:
        tls.close()
        raise PeerAuthError("bad-certificate", "the TLS certificate is not the offered one")
    return tls, policy.check(seen)


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
    request_timeout: seconds from then (from accept over bare TCP) until the PULL (or a
        CANCEL) has come in whole, in all (default handshake_timeout).
    max_connections: connections served at once; one more is closed at accept, unserved.
    max_handshakes: of those, how many may still be unauthenticated (default half of
        max_connections, at least 1), so peers that never authenticate cannot take every
        slot; max_handshakes_per_source: the same per peer address (default a quarter of
        max_handshakes, at least 1), so one address cannot take all of those.
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
    """Connections closed at once because max_connections were being served."""
    busy_handshakes: int = 0
    """Connections closed at once because max_handshakes (in all, or from that peer
    address) were still unauthenticated."""
    handshake_timeouts: int = 0
    """Connections dropped when handshake_timeout passed before they authenticated
    (also counted in `errors`)."""
    request_timeouts: int = 0
    """Connections dropped when request_timeout passed after authentication before the
    PULL had come in whole (also counted in `errors`)."""
    too_slow: int = 0
    """Pulls dropped when they outlived timeout plus their bytes at min_rate_bps (also
    counted in `errors`)."""


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
        self._handshaking = 0  # connections not yet authenticated, and by peer address
        self._handshaking_from: dict[str, int] = {}
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
            busy = ""
            in_service = not self._slots.acquire(blocking=False)
            if in_service:
                busy = f"busy: {self.options.max_connections} connections in service"
            elif not self.options.plaintext:  # bare TCP has no unauthenticated phase
                busy = self._begin_handshake(peer[0])
                if busy:
                    self._slots.release()
            if busy:
                # refuse rather than queue: the puller learns at once and can recompute
                with contextlib.suppress(OSError):
                    conn.close()
                with self._lock:
                    if in_service:
                        self.stats.busy += 1
                    else:
                        self.stats.busy_handshakes += 1
                    self.served.append(ServedTransfer(f"{peer[0]}:{peer[1]}", error=busy))
                continue
            t = threading.Thread(target=self._serve_counted, args=(conn, peer), daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _begin_handshake(self, host: str) -> str:
        """Counts one more unauthenticated connection from `host`, or says why not."""
        o = self.options
        with self._lock:
            if self._handshaking >= o.max_handshakes:  # type: ignore[operator]
                return f"busy handshakes: {o.max_handshakes} connections not yet authenticated"
            if self._handshaking_from.get(host, 0) >= o.max_handshakes_per_source:  # type: ignore[operator]
                return (
                    f"busy handshakes: {o.max_handshakes_per_source} connections from {host} "
                    "not yet authenticated"
                )
            self._handshaking += 1
            self._handshaking_from[host] = self._handshaking_from.get(host, 0) + 1
        return ""

    def _end_handshake(self, host: str) -> None:
        with self._lock:
            self._handshaking -= 1
            left = self._handshaking_from.pop(host) - 1
            if left:
                self._handshaking_from[host] = left

    def _serve_counted(self, conn: socket.socket, peer: tuple) -> None:
        record = ServedTransfer(f"{peer[0]}:{peer[1]}")
        with self._lock:
            self.served.append(record)
            self.stats.connections += 1
        try:
            self._serve(conn, record, peer[0])
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

    def _serve(self, conn: socket.socket, record: ServedTransfer, host: str) -> None:
        o = self.options
        deadline = Deadline(o.handshake_timeout, o.timeout)
        handshaking = not o.plaintext  # counted by _begin_handshake at accept
        sock: socket.socket = conn
        try:
            conn.settimeout(o.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not o.plaintext:
                assert self.identity is not None and self.policy is not None
                sock, auth = secure(
                    conn, self.identity, self.policy, server_side=True, deadline=deadline
                )
                record.peer_key_id = auth.key_id.hex()
                handshaking = False
                self._end_handshake(host)
            self._stream(sock, record)
        except (TransferError, OSError, ssl.SSLError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, HandshakeDeadlineError):
                with self._lock:
                    self.stats.handshake_timeouts += 1
            elif isinstance(exc, RequestDeadlineError):
                with self._lock:
                    self.stats.request_timeouts += 1
        except Exception as exc:  # a bug must cost one connection, never the server
            record.error = f"internal {type(exc).__name__}: {exc}"
        finally:
            if handshaking:
                self._end_handshake(host)
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


def _readable(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether `sock` has bytes (or an EOF) to read, waiting up to `wait` seconds."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    r, _, _ = select.select([sock], [], [], max(0.0, wait))
    return bool(r)


# ---- the puller ------------------------------------------------------------------------


@dataclass
class PullResult:
    """A pull's end: `completed` (then admit its blocks) or `error` (then admit nothing;
    `resume` holds what was verified, to ask again from there)."""

    completed: Completed | None
    resume: ResumeState
    error: TransferError | None
    seconds: float
    wire_bytes: int
    peer_key_id: str = ""
    events: list[PullerEvent] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        return sum(len(b.payload) for b in self.resume.blocks)


def pull(
    address: tuple[str, int],
    identity: TransferIdentity | None,
    policy: PeerPolicy | None,
    keys: Sequence[int],
    *,
    transfer_id: int = 1,
    resume: ResumeState | None = None,
    rate_bps: int = 0,
    timeout: float = 30.0,
    handshake_timeout: float = 5.0,
    cancel: threading.Event | None = None,
    keep_events: bool = False,
    source_address: str | None = None,
) -> PullResult:
    """Pull the prefix `keys` from the holder at `address` (from `source_address`, e.g.
    the instance's own address, if given). TLS unless both identity and policy are None
    (benchmarks' plaintext baseline).

    `timeout` bounds each read or write; `handshake_timeout` bounds the connect, the
    offers and the TLS handshake together (the connect alone over bare TCP), so a holder
    that trickles its side cannot hold the puller: at expiry the result's error is a
    `HandshakeDeadlineError`. A bad value of either raises ValueError."""
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout {timeout} s is not a positive number")
    if not 0 < handshake_timeout < math.inf:
        raise ValueError(f"handshake_timeout {handshake_timeout} s is not a positive number")
    puller = Puller(transfer_id, keys, resume=resume, rate_bps=rate_bps)
    started = time.perf_counter()
    events: list[PullerEvent] = []
    completed: Completed | None = None
    peer = ""
    deadline = Deadline(handshake_timeout, timeout)
    try:
        bind = (source_address, 0) if source_address else None
        try:
            raw = socket.create_connection(
                address, timeout=min(timeout, handshake_timeout), source_address=bind
            )
        except TimeoutError:
            if deadline.passed():
                raise deadline.expired(f"connect to {address[0]}:{address[1]}") from None
            raise
        except ConnectionRefusedError:
            raise ConnectError(
                f"connection refused by {address[0]}:{address[1]} (no holder listens there)"
            ) from None
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to {address[0]}:{address[1]}: {exc.strerror or exc}"
            ) from None
        raw.settimeout(timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        try:
            if identity is not None or policy is not None:
                assert identity is not None and policy is not None
                sock, auth = secure(raw, identity, policy, server_side=False, deadline=deadline)
                peer = auth.key_id.hex()
            sock.sendall(puller.start())
            while completed is None:
                if cancel is not None and cancel.is_set():
                    sock.sendall(puller.cancel("cancelled by the puller"))
                    break
                try:
                    data = sock.recv(RECV_SIZE)
                except ssl.SSLError as exc:
                    raise ChannelError(f"TLS: {exc.reason or exc}") from None
                if not data:
                    puller.end_of_stream()  # raises TruncatedTransferError
                    break
                for ev in puller.receive(data):
                    if keep_events:
                        events.append(ev)
                    if isinstance(ev, Completed):
                        completed = ev
        finally:
            with contextlib.suppress(OSError):
                sock.close()
    except TransferError as exc:
        return _result(None, puller, exc, started, peer, events)
    except (ConnectionError, TimeoutError, OSError) as exc:
        err = TruncatedTransferError(f"connection lost: {exc}")
        return _result(None, puller, err, started, peer, events)
    return _result(completed, puller, None, started, peer, events)


def _result(
    completed: Completed | None,
    puller: Puller,
    error: TransferError | None,
    started: float,
    peer: str,
    events: list[PullerEvent],
) -> PullResult:
    return PullResult(
        completed,
        puller.resume_state(),
        error,
        time.perf_counter() - started,
        puller.bytes_received,
        peer,
        events,
    )

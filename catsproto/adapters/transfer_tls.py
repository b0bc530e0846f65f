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
puller, both pacing with `time.monotonic()` as the core's `now`. The trust store may be
a `TrustFile`, read again when the file changes, so a revocation holds from the next
connection on; connections not yet authenticated are capped in all and per source, the
oldest evicted for a newcomer (`HandshakeTable`), so idle peers cannot shut pulls out.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import math
import os
import select
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

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
    DEFAULT_MAX_BLOCK,
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
OFFER_TIMEOUT = 2.0
"""Seconds a holder waits by default for a new peer's offer (10 bytes and a certificate
of at most 4 KiB, sent at once after the connect)."""
SLOT_WAIT = 1.0
"""Seconds the accept loop waits for the slot of an unauthenticated connection it has
just evicted to be given back (its thread wakes at once on the shutdown)."""


class PeerAuthError(TransferError):
    """The peer is not who it must be; `reason` is one of the `REASONS`."""

    REASONS = (
        "bad-certificate",
        "unknown-key",
        "key-expired",
        "wrong-peer",
        "handshake",
        "trust-unavailable",
    )

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


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrustFile:
    """A trust file read again whenever it changes, so a holder that runs for days
    refuses a key revoked (or a delegation removed) in the file from the next connection
    on (issue #32, row 3), as the BGP receiver's `TrustFileVerifier` does.

    `current()` compares the file's stat stamp (mtime, size, inode) with the one last
    read and reads the file only when it differs. Fail-closed: until the file has loaded
    once, `current()` is None and every peer is refused (`trust-unavailable`); after
    that, a file that goes missing, cannot be read or does not load leaves the last good
    store in force, and the failure is logged once per state of the file and counted in
    `reload_failures`. Safe to call from every connection's thread. `read` reads the
    file's bytes (a reader that also checks the file's mode plugs in here; an `OSError`
    it raises is a failed load)."""

    def __init__(
        self,
        path: str | Path,
        *,
        log: Callable[[str], None] = _stderr,
        read: Callable[[Path], bytes] = Path.read_bytes,
    ) -> None:
        self.path = Path(path)
        self.log = log
        self.read = read
        self.loads = 0
        self.reload_failures = 0
        self.error = "not read yet"
        self._stamp: tuple[int, ...] | None = None  # the file state last read, or tried
        self._store: TrustStore | None = None  # the last good load
        self._lock = threading.Lock()

    def current(self) -> TrustStore | None:
        """The trust store of the file as it is now, or the last good one; None before
        the first good load."""
        with self._lock:
            try:
                st = self.path.stat()
            except OSError as exc:
                self._failed((-1,), f"cannot read it: {exc.strerror or exc}")
                return self._store
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)  # a chmod too
            if stamp == self._stamp:
                return self._store
            try:
                store = TrustStore.from_json(json.loads(self.read(self.path)))
            except OSError as exc:
                self._failed(stamp, f"cannot read it: {exc.strerror or exc}")
            except (ValueError, RecursionError) as exc:  # JSON, UTF-8, TrustFileError
                self._failed(stamp, f"does not load: {exc}")
            else:
                if self.loads:
                    self.log(f"trust file {self.path}: reloaded")
                self._stamp, self._store, self.error = stamp, store, ""
                self.loads += 1
            return self._store

    def _failed(self, stamp: tuple[int, ...], error: str) -> None:
        """Count and log a failed (re)load once per state of the file."""
        if stamp == self._stamp:
            return
        self._stamp, self.error = stamp, error
        self.reload_failures += 1
        kept = "keeping the last good trust store" if self._store else "refusing every peer"
        self.log(f"trust file {self.path}: {error}; {kept}")


@dataclass
class PeerPolicy:
    """Which peers to accept: a trust-store delegation valid at `clock_ms()`, and, when
    `expected_key_id` is set, exactly that node. `trust` is a store, or a `TrustFile`
    whose current store is looked up at every check."""

    trust: TrustStore | TrustFile
    expected_key_id: bytes | None = None
    clock_ms: Callable[[], int] = wall_clock_ms

    def store(self) -> TrustStore:
        """The trust store in force now; `PeerAuthError` (trust-unavailable) if none."""
        if isinstance(self.trust, TrustStore):
            return self.trust
        store = self.trust.current()
        if store is None:
            raise PeerAuthError(
                "trust-unavailable", f"trust file {self.trust.path}: {self.trust.error}"
            )
        return store

    def check(self, certificate: bytes) -> Authorisation:
        trust = self.store()
        raw = certificate_key(certificate)
        kid = key_id(raw)
        if self.expected_key_id is not None and kid != self.expected_key_id:
            raise PeerAuthError(
                "wrong-peer", f"key {kid.hex()}, expected {self.expected_key_id.hex()}"
            )
        auth = trust.lookup(kid)
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
    offer_deadline: Deadline | None = None,
) -> tuple[ssl.SSLSocket, Authorisation]:
    """Offers, trust-store check, TLS 1.3 handshake, re-check. Raises `PeerAuthError`
    (`HandshakeDeadlineError` when `deadline` passes first, or, on the server side,
    `offer_deadline` before the peer's offer is in whole). With a deadline, the socket
    is left with its `per_op` timeout."""
    if server_side:
        offered = read_offer(sock, offer_deadline or deadline)
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
    max_block_bytes: int = DEFAULT_MAX_BLOCK,
) -> PullResult:
    """Pull the prefix `keys` from the holder at `address` (from `source_address`, e.g.
    the instance's own address, if given). TLS unless both identity and policy are None
    (benchmarks' plaintext baseline).

    `max_block_bytes`: the size the blocks are expected to have (the advertised bytes
    per block, the plan's block size). A holder, even a trusted one, that announces a
    larger block is refused at that block's header, before its payload is read: the
    result's error is a `BlockTooLargeError` naming both sizes. Give it: the default
    (256 MiB) only bounds what no block can exceed.

    `timeout` bounds each read or write; `handshake_timeout` bounds the connect, the
    offers and the TLS handshake together (the connect alone over bare TCP), so a holder
    that trickles its side cannot hold the puller: at expiry the result's error is a
    `HandshakeDeadlineError`. A bad value of either raises ValueError."""
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout {timeout} s is not a positive number")
    if not 0 < handshake_timeout < math.inf:
        raise ValueError(f"handshake_timeout {handshake_timeout} s is not a positive number")
    puller = Puller(
        transfer_id, keys, resume=resume, rate_bps=rate_bps, max_block_bytes=max_block_bytes
    )
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

"""The authenticated channel: constants, errors, the clear-text offer and TLS 1.3.

Strategy: each side first sends a one-line *offer* in the clear, ``"CATSXFR1" | u16
length | certificate DER``; the other checks that key against its `PeerPolicy` and then
runs a TLS 1.3 handshake whose only trust anchor is exactly that certificate (`secure`).
Deadlines bound every step. `catsproto.adapters.transfer_tls` explains the protocol.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from catsproto.adapters.transfer_identity import PeerAuthError, PeerPolicy, TransferIdentity
from catsproto.security import (
    Authorisation,
)
from catsproto.transfer import (
    TransferError,
)

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


def _readable(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether `sock` has bytes (or an EOF) to read, waiting up to `wait` seconds."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    r, _, _ = select.select([sock], [], [], max(0.0, wait))
    return bool(r)

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
import math
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from catsproto.adapters.transfer_channel import (
    HOLDER_CLOSED_DURING_OFFER,
    MAX_CERT,
    OFFER_MAGIC,
    OFFER_TIMEOUT,
    RECV_SIZE,
    SLOT_WAIT,
    TRANSFER_PORT,
    ChannelError,
    ConnectError,
    Deadline,
    HandshakeDeadlineError,
    RequestDeadlineError,
    read_offer,
    secure,
    send_offer,
    tls_context,
)
from catsproto.adapters.transfer_identity import (
    PeerAuthError,
    PeerPolicy,
    TransferIdentity,
    TrustFile,
    certificate_key,
    transfer_certificate,
    wall_clock_ms,
)
from catsproto.adapters.transfer_server import (
    HandshakeTable,
    ServedTransfer,
    ServerOptions,
    ServerStats,
    TransferServer,
    handshake_source,
)
from catsproto.transfer import (
    DEFAULT_MAX_BLOCK,
    Completed,
    Puller,
    PullerEvent,
    ResumeState,
    TransferError,
    TruncatedTransferError,
)

# the transfer's parts live in transfer_channel, transfer_identity and transfer_server;
# their names are importable from here, where the protocol is explained
__all__ = [
    "HOLDER_CLOSED_DURING_OFFER",
    "MAX_CERT",
    "OFFER_MAGIC",
    "OFFER_TIMEOUT",
    "RECV_SIZE",
    "SLOT_WAIT",
    "TRANSFER_PORT",
    "ChannelError",
    "ConnectError",
    "Deadline",
    "HandshakeDeadlineError",
    "HandshakeTable",
    "PeerAuthError",
    "PeerPolicy",
    "PullResult",
    "RequestDeadlineError",
    "ServedTransfer",
    "ServerOptions",
    "ServerStats",
    "TransferIdentity",
    "TransferServer",
    "TrustFile",
    "certificate_key",
    "handshake_source",
    "pull",
    "read_offer",
    "secure",
    "send_offer",
    "tls_context",
    "transfer_certificate",
    "wall_clock_ms",
]

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

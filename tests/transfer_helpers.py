"""Shared parts of the transfer tests over real TLS sockets on loopback: operator and
node keys in one trust store, both identities, a server, and hostile clients' tools
(trickling bytes, telling whether the other side closed)."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator

from catsproto.adapters.transfer_tls import (
    PeerPolicy,
    ServedTransfer,
    ServerOptions,
    TransferIdentity,
    TransferServer,
    wall_clock_ms,
)
from catsproto.security import SigningKey, TrustStore, authorise
from catsproto.transfer import StoredBlock

OPERATOR = SigningKey.from_seed(b"O" * 32)
HOLDER = SigningKey.from_seed(b"H" * 32)
PULLER = SigningKey.from_seed(b"P" * 32)
NOW = wall_clock_ms()
TRUST = TrustStore().with_operator(OPERATOR.public.raw, "operator")
for _k in (HOLDER, PULLER):
    TRUST = TRUST.with_delegation(
        authorise(
            OPERATOR,
            _k.public.raw,
            cs_ids=[1],
            routes=["10.0.0.0/8"],
            addresses=["10.0.0.0/8"],
            not_before_ms=NOW - 60_000,
            not_after_ms=NOW + 3_600_000,
        )
    )


def identities() -> dict[str, TransferIdentity]:
    """The holder's and the puller's TLS identities (close them when done)."""
    return {"holder": TransferIdentity(HOLDER), "puller": TransferIdentity(PULLER)}


@contextlib.contextmanager
def serve(
    identity: TransferIdentity,
    lookup: Callable[[int], StoredBlock | None],
    **options: object,
) -> Iterator[TransferServer]:
    """A running holder of `lookup`'s blocks with `options` (`ServerOptions`)."""
    srv = TransferServer(identity, PeerPolicy(TRUST), lookup, options=ServerOptions(**options))
    with srv:
        yield srv


def holder_policy() -> PeerPolicy:
    return PeerPolicy(TRUST, expected_key_id=HOLDER.key_id)


def wait_ended(srv: TransferServer, limit: float) -> ServedTransfer | None:
    """The first served record once every connection has an outcome, or None."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with srv._lock:
            done = [s for s in srv.served if s.error or s.cancelled or s.blocks_sent]
        if done and srv.stats.connections == srv.stats.completed + srv.stats.errors:
            return done[0]
        time.sleep(0.01)
    return None


def closed_by_peer(sock: socket.socket, wait: float) -> bool:
    """Whether the other side closed (EOF, reset, TLS failure) within `wait` seconds.
    Bytes that are no application data (TLS 1.3 session tickets) do not count."""
    r, _, _ = select.select([sock], [], [], wait)
    if not r:
        return False
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def trickle(sock: socket.socket, data: bytes, every: float, limit: float) -> float | None:
    """Send `data` a byte at a time (over TLS: a record each), one each `every` s;
    seconds until the other side closed, or None if still open after `limit` s."""
    started = time.monotonic()
    for b in data:
        if time.monotonic() - started > limit:
            return None
        try:
            sock.sendall(bytes([b]))
        except OSError:
            return time.monotonic() - started
        if closed_by_peer(sock, every):
            return time.monotonic() - started
    return None

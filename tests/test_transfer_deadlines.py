"""The two deadlines around the request, on loopback over real TLS 1.3 sockets.

The holder: once a puller has authenticated, its PULL must come in whole within
`request_timeout`, however it spaces its bytes. The puller: `pull()` must get through
connect, offers and TLS handshake within `handshake_timeout`, however the holder spaces
its own. Each hostile side sends a byte well inside the per-read timeout, so only an
absolute deadline ends it. Timeouts are short (≤ 1.2 s) so the file runs in seconds.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from catsproto.adapters.transfer_tls import (
    HandshakeDeadlineError,
    RequestDeadlineError,
    ServerOptions,
    TransferIdentity,
    TransferServer,
    pull,
    read_offer,
    secure,
    send_offer,
)
from catsproto.transfer import Puller, StoredBlock, synthetic_keys, synthetic_store
from tests.transfer_helpers import (
    HOLDER,
    PULLER,
    holder_policy,
    serve,
    trickle,
    wait_ended,
)

KEYS = synthetic_keys(9, 4)
STORE = synthetic_store(KEYS, 64 << 10)
PULL = Puller(1, KEYS).start()  # 65 bytes: 6.5 s at the 0.1 s a byte used below


def server(
    identity: TransferIdentity,
    lookup: Callable[[int], StoredBlock | None] = STORE.get,
    **options: object,
) -> contextlib.AbstractContextManager[TransferServer]:
    return serve(identity, lookup, **options)


# ---- the holder: one deadline for the PULL after authentication -------------------------


def test_a_trickled_pull_is_dropped_at_the_request_deadline(ids) -> None:
    # the handshake is done at once and well inside its own deadline; the PULL then
    # comes a byte per 0.1 s, each inside the per-read timeout of 0.5 s
    opts = {"timeout": 0.5, "handshake_timeout": 2.0, "request_timeout": 0.6}
    with server(ids["holder"], **opts) as srv:
        with socket.create_connection(srv.address, timeout=2) as raw:
            tls, auth = secure(raw, ids["puller"], holder_policy(), server_side=False)
            assert auth.key_id == HOLDER.key_id
            took = trickle(tls, PULL, every=0.1, limit=3.0)
            tls.close()
        record = wait_ended(srv, 2.0)
    assert took is not None and took < 0.6 + 0.5
    assert record is not None and record.peer_key_id == PULLER.key_id.hex()
    assert "request: PULL (" in record.error and "within the deadline of 0.6 s" in record.error
    assert record.blocks_sent == 0
    assert srv.stats.request_timeouts == 1 and srv.stats.errors == 1
    assert srv.stats.handshake_timeouts == 0 and srv.stats.completed == 0


def test_the_request_deadline_holds_over_bare_tcp_too(ids) -> None:
    opts = {"plaintext": True, "timeout": 0.5, "request_timeout": 0.4}
    with server(ids["holder"], **opts) as srv:
        with socket.create_connection(srv.address, timeout=2) as s:
            took = trickle(s, PULL, every=0.1, limit=3.0)
        record = wait_ended(srv, 2.0)
    assert took is not None and took < 0.4 + 0.5
    assert record is not None and "within the deadline of 0.4 s" in record.error
    assert srv.stats.request_timeouts == 1


def test_a_prompt_pull_outlasting_the_request_deadline_completes(ids) -> None:
    # 4 × 64 KiB at 200 kB/s in 16 KiB pieces (a burst of two): about 1.1 s of pacing,
    # past a request deadline of 0.3 s that only covers the PULL's arrival
    opts = {"timeout": 1.0, "request_timeout": 0.3, "rate_bps": 200_000, "chunk": 16 << 10}
    with server(ids["holder"], **opts) as srv:
        r = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=1.0)
        record = wait_ended(srv, 2.0)
    assert r.error is None and r.completed is not None, r.error
    assert r.seconds > 0.3 + 0.5
    assert record is not None and record.error == "" and record.blocks_sent == len(KEYS)
    assert srv.stats.request_timeouts == 0 and srv.stats.completed == 1


def test_request_timeout_defaults_to_the_handshake_timeout_and_is_checked() -> None:
    assert ServerOptions(handshake_timeout=0.7).request_timeout == 0.7
    assert ServerOptions(handshake_timeout=0.7, request_timeout=2).request_timeout == 2
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            ServerOptions(request_timeout=bad)


def test_a_request_deadline_error_is_a_transfer_error() -> None:
    err = RequestDeadlineError(0.6, "PULL (3 bytes in)")
    assert str(err) == "request: PULL (3 bytes in) not done within the deadline of 0.6 s"


# ---- the puller: one deadline for connect, offers and TLS handshake ---------------------


@contextlib.contextmanager
def fake_holder(
    act: Callable[[socket.socket, threading.Event], None],
) -> Iterator[tuple[str, int]]:
    """A listener whose one connection is handed to `act` (with a stop event)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(3)
            with contextlib.suppress(OSError):
                act(conn, stop)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        stop.set()
        listener.close()
        t.join(timeout=5)


def drip(conn: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    for b in data:
        if stop.wait(every):
            return
        conn.sendall(bytes([b]))


def test_pull_gives_up_on_a_holder_that_trickles_its_offer(ids) -> None:
    cert = ids["holder"].certificate

    def trickling(conn: socket.socket, stop: threading.Event) -> None:
        read_offer(conn)
        offer = b"CATSXFR1" + len(cert).to_bytes(2, "big") + cert
        drip(conn, offer, 0.1, stop)

    with fake_holder(trickling) as address:
        r = pull(address, ids["puller"], holder_policy(), KEYS, timeout=0.5, handshake_timeout=0.6)
    assert isinstance(r.error, HandshakeDeadlineError), r.error
    assert "offer (" in str(r.error) and "within the deadline of 0.6 s" in str(r.error)
    assert r.completed is None and r.peer_key_id == "" and r.wire_bytes == 0
    assert r.seconds < 0.6 + 0.5


def test_pull_deadline_covers_the_holders_tls_handshake(ids) -> None:
    # the holder's offer is real and comes late; then it trickles a TLS record that
    # announces 16 KiB. Without one deadline the handshake gets a fresh 1.2 s.
    cert = ids["holder"].certificate

    def slow_tls(conn: socket.socket, stop: threading.Event) -> None:
        read_offer(conn)
        if stop.wait(0.6):
            return
        send_offer(conn, cert)
        drip(conn, b"\x16\x03\x03\x40\x00" + b"\x02" * 100, 0.1, stop)

    with fake_holder(slow_tls) as address:
        r = pull(address, ids["puller"], holder_policy(), KEYS, timeout=1.2, handshake_timeout=1.0)
    assert isinstance(r.error, HandshakeDeadlineError), r.error
    assert "TLS handshake not done within the deadline of 1 s" in str(r.error)
    assert 0.9 < r.seconds < 1.0 + 0.4


def test_pull_with_a_deadline_still_completes_against_a_real_holder(ids) -> None:
    with server(ids["holder"], timeout=1.0) as srv:
        r = pull(srv.address, ids["puller"], holder_policy(), KEYS, handshake_timeout=0.5)
    assert r.error is None and r.completed is not None, r.error
    assert r.peer_key_id == HOLDER.key_id.hex()


def test_pull_names_a_bad_deadline() -> None:
    for bad in (0, -0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="handshake_timeout"):
            pull(("127.0.0.1", 9), None, None, KEYS, handshake_timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            pull(("127.0.0.1", 9), None, None, KEYS, timeout=bad)

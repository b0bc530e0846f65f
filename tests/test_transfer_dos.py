"""Peers that try to hold a holder's connections without pulling, on loopback.

Each test drives the real `TransferServer` over real sockets (TLS 1.3 with trust-store
node keys) with a hostile client: one that trickles its offer or its TLS handshake a
byte at a time, floods connections from one address, asks a rate of 1 byte/s, reads
the stream at a crawl or hangs up in a pause; and the puller core fed a late EVICTED.
Timeouts are short (≤ 2 s) so the file runs in seconds.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable

import pytest

from catsproto.adapters.transfer_tls import (
    OFFER_MAGIC,
    Deadline,
    HandshakeDeadlineError,
    PeerPolicy,
    ServerOptions,
    TransferIdentity,
    TransferServer,
    pull,
    read_offer,
    secure,
)
from catsproto.transfer import (
    Holder,
    PeerRefusedError,
    Puller,
    StoredBlock,
    synthetic_keys,
    synthetic_store,
)
from catsproto.transfer.errors import ProtocolViolationError
from catsproto.transfer.frames import (
    Accept,
    Block,
    Code,
    Evicted,
    FrameReader,
    Refuse,
    encode,
    encode_data,
)
from tests.transfer_helpers import (
    HOLDER,
    TRUST,
    holder_policy,
    serve,
    trickle,
    wait_ended,
)

KEYS = synthetic_keys(5, 4)
STORE = synthetic_store(KEYS, 64 << 10)


def server(
    identity: TransferIdentity,
    lookup: Callable[[int], StoredBlock | None] = STORE.get,
    **options: object,
) -> contextlib.AbstractContextManager[TransferServer]:
    return serve(identity, lookup, **options)


# ---- a late EVICTED: a transfer error, not an IndexError -------------------------------


def _evicted_after_last_block() -> bytes:
    block = StoredBlock.of(7, b"payload")
    return (
        encode(Accept(1, 1, 0, 1))
        + encode(Block(0, 7, len(block.payload), block.digest))
        + b"".join(bytes(x) for x in encode_data(block.payload))
        + encode(Evicted(1, 0))
    )


def test_evicted_after_the_last_block_is_a_protocol_violation() -> None:
    p = Puller(1, [7])
    p.start()
    with pytest.raises(ProtocolViolationError, match="after all 1 blocks") as exc:
        p.receive(_evicted_after_last_block())
    assert exc.value.offset is not None and exc.value.frame_type == int(Evicted.TYPE)
    assert p.resume_state().next_index == 1  # the verified block is kept for a resumption


def test_pull_turns_a_late_evicted_into_a_result() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def fake_holder() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(_evicted_after_last_block())
            conn.recv(1)

    t = threading.Thread(target=fake_holder, daemon=True)
    t.start()
    try:
        r = pull(listener.getsockname()[:2], None, None, [7], timeout=2)
    finally:
        t.join(timeout=3)
        listener.close()
    assert isinstance(r.error, ProtocolViolationError) and r.completed is None
    assert r.resume.next_index == 1


# ---- the unauthenticated phase: one deadline, its own caps ------------------------------


def test_trickled_offer_is_dropped_at_the_handshake_deadline(ids) -> None:
    # each byte comes well inside the per-read timeout; only a deadline over the whole
    # offer ends it (the offer is 10 + up to 4096 bytes: hours at this pace without one)
    with server(ids["holder"], timeout=0.5, handshake_timeout=0.6) as srv:
        with socket.create_connection(srv.address) as s:
            took = trickle(s, b"CATSXFR1\x10\x00" + b"\x00" * 4096, every=0.2, limit=3.0)
        record = wait_ended(srv, 2.0)
    assert took is not None and took < 0.6 + 0.5
    assert record is not None and "within the deadline of 0.6 s" in record.error
    assert srv.stats.handshake_timeouts == 1 and srv.stats.errors == 1


def test_the_deadline_covers_the_tls_handshake_too(ids) -> None:
    # a replayed (public) offer of a trusted node passes the clear-text check; its TLS
    # handshake then gets what is left of the deadline, not a fresh per-read timeout
    with server(ids["holder"], timeout=1.2, handshake_timeout=1.0) as srv:
        with socket.create_connection(srv.address) as s:
            s.settimeout(2)
            cert = ids["puller"].certificate
            offer = OFFER_MAGIC + len(cert).to_bytes(2, "big") + cert
            s.sendall(offer[:-1])
            time.sleep(0.6)  # inside the per-read timeout; most of the deadline used
            s.sendall(offer[-1:])
            read_offer(s)
            # a TLS record header announcing 16 KiB, then its body a byte at a time
            took = trickle(s, b"\x16\x03\x01\x40\x00" + b"\x01" * 100, every=0.1, limit=3.0)
        record = wait_ended(srv, 2.0)
    # what was left of the deadline (about 0.4 s), not a new per-read timeout of 1.2 s
    assert took is not None and took < 0.9
    assert record is not None and "TLS handshake not done within the deadline" in record.error
    assert srv.stats.handshake_timeouts == 1


def test_secure_with_a_deadline_leaves_the_per_read_timeout(ids) -> None:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def holder_side() -> None:
        tls, _ = secure(
            b, ids["holder"], PeerPolicy(TRUST), server_side=True, deadline=Deadline(2.0, 0.7)
        )
        out["timeout"] = tls.gettimeout()
        tls.close()

    t = threading.Thread(target=holder_side)
    t.start()
    a.settimeout(2)
    tls, auth = secure(a, ids["puller"], holder_policy(), server_side=False)
    t.join(timeout=3)
    tls.close()
    b.close()
    assert auth.key_id == HOLDER.key_id and out["timeout"] == 0.7


def test_deadline_refuses_once_passed() -> None:
    a, b = socket.socketpair()
    with a, b:
        d = Deadline(0.05, 1.0)
        time.sleep(0.06)
        with pytest.raises(HandshakeDeadlineError, match="offer not done within"):
            d.arm(a, "offer")


def test_unauthenticated_connections_from_one_address_cannot_take_every_slot(ids) -> None:
    # four silent connections from 127.0.0.2 would take all four slots; only one of them
    # may be unauthenticated at once, so a real pull from another address is served
    opts = dict(
        max_connections=4,
        max_handshakes=2,
        max_handshakes_per_source=1,
        timeout=2.0,
        handshake_timeout=2.0,
    )
    with server(ids["holder"], **opts) as srv:
        silent = [
            socket.create_connection(srv.address, source_address=("127.0.0.2", 0)) for _ in range(4)
        ]
        try:
            end = time.monotonic() + 1
            while srv.stats.busy_handshakes < 3 and time.monotonic() < end:
                time.sleep(0.01)
            r = pull(srv.address, ids["puller"], holder_policy(), KEYS, source_address="127.0.0.3")
        finally:
            for s in silent:
                s.close()
    assert r.error is None and r.completed is not None
    assert srv.stats.busy_handshakes == 3 and srv.stats.busy == 0
    refusals = [s.error for s in srv.served if s.error.startswith("busy handshakes")]
    assert refusals == ["busy handshakes: 1 connections from 127.0.0.2 not yet authenticated"] * 3


def test_the_handshake_cap_in_all_refuses_at_accept_and_frees_with_the_deadline(ids) -> None:
    # silent peers from several addresses fill the cap in all: a new pull is refused at
    # once (not queued), the slots left stay free for authenticated pulls, and the cap
    # frees when the deadline drops the silent ones
    opts = dict(max_connections=8, max_handshakes=2, max_handshakes_per_source=2)
    with server(ids["holder"], timeout=1.0, handshake_timeout=0.5, **opts) as srv:
        silent = [
            socket.create_connection(srv.address, source_address=(f"127.0.0.{n}", 0))
            for n in (4, 5)
        ]
        try:
            end = time.monotonic() + 1
            while srv.stats.connections < 2 and time.monotonic() < end:
                time.sleep(0.01)
            refused = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
            time.sleep(0.6)  # past the deadline of the silent two
            ok = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        finally:
            for s in silent:
                s.close()
    assert refused.completed is None and ok.error is None and ok.completed is not None
    assert srv.stats.busy_handshakes == 1 and srv.stats.handshake_timeouts == 2
    assert [s.error for s in srv.served][2] == (
        "busy handshakes: 2 connections not yet authenticated"
    )


# ---- slow pulls: a rate floor, a deadline, and an EOF noticed while pacing ---------------


def test_holder_refuses_a_rate_under_its_floor() -> None:
    for rate, refused in ((1, True), (99_999, True), (100_000, False), (0, False)):
        holder = Holder(STORE.get, 1, min_rate_bps=100_000)
        holder.receive(Puller(1, KEYS, rate_bps=rate).start())
        frames = [f for _, f in FrameReader().feed(holder.send(0.0, limit=1 << 10))]
        assert isinstance(frames[0], Refuse) is refused
        if refused:
            assert frames[0].code == Code.BAD_REQUEST and holder.finished
            assert frames[0].reason == (
                f"rate_bps {rate} is under this holder's floor of 100000 bytes/s (0: unpaced)"
            )
            assert holder.refusal == frames[0]
        else:
            assert isinstance(frames[0], Accept) and holder.refusal is None


def test_a_one_byte_per_second_pull_is_refused_over_tls(ids) -> None:
    with server(ids["holder"], min_rate_bps=50_000, max_connections=2) as srv:
        slow = pull(srv.address, ids["puller"], holder_policy(), KEYS, rate_bps=1, timeout=2)
        assert isinstance(slow.error, PeerRefusedError) and slow.error.code == Code.BAD_REQUEST
        assert "floor of 50000 bytes/s" in str(slow.error)
        wait_ended(srv, 2.0)
        ok = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
    assert ok.error is None and ok.completed is not None
    assert srv.served[0].error.startswith("refused: rate_bps 1 is under")


def test_the_holder_notices_a_puller_that_hangs_up_while_it_paces(ids) -> None:
    # at 2 kB/s the holder owes the next 16 KiB piece only in about 8 s; a puller that
    # leaves in that pause must free the slot at once, not when the pause ends
    with server(ids["holder"], min_rate_bps=2_000, chunk=16 << 10, timeout=2.0) as srv:
        with socket.create_connection(srv.address) as raw:
            raw.settimeout(2)
            tls, _ = secure(raw, ids["puller"], holder_policy(), server_side=False)
            tls.sendall(Puller(1, KEYS, rate_bps=2_000).start())
            got = 0
            # the burst (the first two pieces), until the holder is in its long pause
            while got < 16 << 10 or select.select([tls], [], [], 0.3)[0]:
                got += len(tls.recv(65536))
            left_at = time.monotonic()
            tls.close()
        record = wait_ended(srv, 3.0)
        gone = time.monotonic() - left_at
    assert record is not None and gone < 1.0
    # an EOF, or a reset if our unread bytes were still queued when we closed
    assert record.error.startswith(("the puller closed the connection", "ConnectionResetError"))


def test_a_puller_reading_at_a_crawl_is_dropped_at_the_pull_deadline(ids) -> None:
    # it asked the floor (4 MB/s) but reads 4 KiB every 20 ms (at most 200 kB/s): the
    # holder keeps it `timeout` plus 8 MiB at 4 MB/s (about 3.1 s), not the 40 s and more
    # its reading would take. (Loopback's socket buffers take 3-4 MB of it unread.)
    big = StoredBlock.of(9, bytes(range(256)) * (32 << 10))  # 8 MiB
    opts = dict(min_rate_bps=4_000_000, chunk=16 << 10, timeout=1.0)
    lookup = lambda k: big if k == 9 else None  # noqa: E731
    with server(ids["holder"], lookup, **opts) as srv, socket.create_connection(srv.address) as raw:
        raw.settimeout(2)
        tls, _ = secure(raw, ids["puller"], holder_policy(), server_side=False)
        started = time.monotonic()
        tls.sendall(Puller(1, [9], rate_bps=4_000_000).start())
        with contextlib.suppress(OSError):
            while time.monotonic() - started < 8 and srv.stats.too_slow == 0:
                if not tls.recv(4096):
                    break
                time.sleep(0.02)
        record = wait_ended(srv, 2.0)
        ended = time.monotonic() - started
        tls.close()
    assert record is not None and record.error.startswith("too slow: ")
    assert srv.stats.too_slow == 1 and 0 < record.payload_bytes < len(big.payload)
    assert 3.0 < ended < 3.1 + 1.5


def test_options_name_a_bad_new_value() -> None:
    for kwargs, name in (
        ({"handshake_timeout": 0}, "handshake_timeout 0 s"),
        ({"max_connections": 4, "max_handshakes": 5}, "max_handshakes 5 is not 1..max_conn"),
        ({"max_handshakes": 2, "max_handshakes_per_source": 3}, "max_handshakes_per_source 3"),
        ({"min_rate_bps": float("nan")}, "min_rate_bps nan"),
    ):
        with pytest.raises(ValueError, match=name):
            ServerOptions(**kwargs)  # type: ignore[arg-type]
    o = ServerOptions(max_connections=64)
    assert (o.max_handshakes, o.max_handshakes_per_source) == (32, 8)
    with pytest.raises(ValueError, match="min_rate_bps -1"):
        Holder(STORE.get, 1, min_rate_bps=-1)

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
    HandshakeTable,
    PeerPolicy,
    ServerOptions,
    TransferIdentity,
    TransferServer,
    handshake_source,
    pull,
    read_offer,
    secure,
)
from catsproto.transfer import (
    BlockTooLargeError,
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
    closed_by_peer,
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


# ---- a holder announcing a larger block than expected -----------------------------------


def test_a_block_announced_far_larger_than_expected_is_refused_at_its_header() -> None:
    # issue #32, row 7b: a trusted holder announced 200 MiB for a 4 KiB block and the
    # puller would read (and hash, and keep) it all; with the expected size as its limit,
    # the BLOCK header alone is refused
    listener = socket.create_server(("127.0.0.1", 0))
    key = 7

    def fake_holder() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(encode(Accept(1, 1, 0, 1)) + encode(Block(0, key, 200 << 20, bytes(32))))
            with contextlib.suppress(OSError):
                while conn.recv(65536):  # until the puller hangs up
                    pass

    t = threading.Thread(target=fake_holder, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        r = pull(listener.getsockname()[:2], None, None, [key], timeout=2, max_block_bytes=4096)
        took = time.monotonic() - started
    finally:
        t.join(timeout=3)
        listener.close()
    assert isinstance(r.error, BlockTooLargeError) and r.completed is None
    assert str(r.error) == (
        "block frame at stream offset 29: block 0 (key 0000000000000007) announced as "
        "209715200 bytes, over the limit of 4096 (the size expected): refused before its "
        "payload"
    )
    assert took < 1.0  # not the 2 s read timeout: refused as the header came in


def test_a_trusted_holder_over_tls_is_held_to_the_expected_block_size(ids) -> None:
    big = StoredBlock.of(9, bytes(range(256)) * (4 << 10))  # 1 MiB
    lookup = {9: big}.get
    with server(ids["holder"], lookup) as srv:
        refused = pull(srv.address, ids["puller"], holder_policy(), [9], max_block_bytes=4096)
        exact = pull(srv.address, ids["puller"], holder_policy(), [9], max_block_bytes=1 << 20)
    assert isinstance(refused.error, BlockTooLargeError) and refused.completed is None
    assert "announced as 1048576 bytes, over the limit of 4096" in str(refused.error)
    assert refused.payload_bytes == 0 and refused.wire_bytes < 64 << 10  # of 1 MiB sent
    assert exact.error is None and exact.completed is not None  # the limit is inclusive
    with pytest.raises(ValueError, match="max_block_bytes -1 is not >= 0"):
        pull(srv.address, ids["puller"], holder_policy(), [9], max_block_bytes=-1)


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


def _silent(address: tuple[str, int], source: str) -> socket.socket:
    """A connection from `source` that never sends a byte."""
    return socket.create_connection(address, source_address=(source, 0), timeout=5)


def _until(done: Callable[[], bool], limit: float = 2.0) -> None:
    end = time.monotonic() + limit
    while not done() and time.monotonic() < end:
        time.sleep(0.01)


def test_32_idle_connections_do_not_starve_an_honest_pull(ids) -> None:
    # issue #32, row 6: with the default caps (64 connections, 32 unauthenticated, 8 per
    # source), 32 idle connections from four addresses used to fill the unauthenticated
    # phase, and every pull was refused at accept until their 5 s deadline passed. Now
    # the newcomer takes the place of the oldest idle one and completes at once. (The
    # offer deadline is held at the old 5 s here, so only the eviction is tested.)
    with server(ids["holder"], offer_timeout=5.0) as srv:
        idle = [_silent(srv.address, f"127.0.0.{2 + i // 8}") for i in range(32)]
        try:
            _until(lambda: srv.stats.connections == 32)
            assert srv.stats.connections == 32 and srv.stats.errors == 0
            started = time.monotonic()
            r = pull(srv.address, ids["puller"], holder_policy(), KEYS, source_address="127.0.0.6")
            took = time.monotonic() - started
            still_open = [not closed_by_peer(s, 0) for s in idle]
        finally:
            for s in idle:
                s.close()
    assert r.error is None and r.completed is not None
    assert took < 1.0, took  # not the 5 s until an idle one's deadline frees a place
    assert srv.stats.handshakes_evicted == 1 and srv.stats.busy == 0
    assert still_open == [False] + [True] * 31  # the oldest went, and only it
    evicted = [s for s in srv.served if s.error.startswith("evicted")]
    assert [s.error for s in evicted] == [
        "evicted before authentication: the oldest of 32 not yet authenticated"
    ]
    assert evicted[0].peer.startswith("127.0.0.2:")


def test_a_source_over_its_cap_loses_its_oldest_unauthenticated_connection(ids) -> None:
    # four silent connections from 127.0.0.2, one allowed per source: each newer one
    # pushes the one before out, the newest keeps its place, and a real pull from
    # another address is served without evicting anybody
    opts = dict(
        max_connections=4,
        max_handshakes=2,
        max_handshakes_per_source=1,
        timeout=2.0,
        handshake_timeout=2.0,
    )
    with server(ids["holder"], **opts) as srv:
        silent = []
        for _ in range(4):
            silent.append(_silent(srv.address, "127.0.0.2"))
            _until(lambda: srv.stats.connections == len(silent))
        try:
            _until(lambda: srv.stats.errors == 3)
            r = pull(srv.address, ids["puller"], holder_policy(), KEYS, source_address="127.0.0.3")
            closed = [closed_by_peer(s, 0.5) for s in silent[:3]]
            newest_open = not closed_by_peer(silent[3], 0)
        finally:
            for s in silent:
                s.close()
    assert r.error is None and r.completed is not None
    assert closed == [True] * 3 and newest_open
    assert srv.stats.handshakes_evicted == 3 and srv.stats.busy == 0
    evicted = [s.error for s in srv.served if s.error.startswith("evicted")]
    assert (
        evicted
        == ["evicted before authentication: the oldest of 1 from 127.0.0.2 not yet authenticated"]
        * 3
    )


def test_the_handshake_cap_in_all_evicts_the_oldest_and_the_rest_keep_their_deadline(
    ids,
) -> None:
    # silent peers from two addresses fill the cap in all (2): a pull evicts the oldest
    # and completes at once; the other silent one is still dropped at its deadline
    opts = dict(max_connections=8, max_handshakes=2, max_handshakes_per_source=2)
    with server(ids["holder"], timeout=1.0, handshake_timeout=1.0, **opts) as srv:
        silent = []
        for n in (4, 5):
            silent.append(_silent(srv.address, f"127.0.0.{n}"))
            _until(lambda: srv.stats.connections == len(silent))
        try:
            r = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
            time.sleep(1.1)  # past the deadline of the other silent one
        finally:
            for s in silent:
                s.close()
        wait_ended(srv, 2.0)
    assert r.error is None and r.completed is not None
    assert srv.stats.handshakes_evicted == 1 and srv.stats.handshake_timeouts == 1
    errors = {s.peer.split(":")[0]: s.error for s in srv.served if s.error}
    assert errors["127.0.0.4"] == (
        "evicted before authentication: the oldest of 2 not yet authenticated"
    )
    assert "within the deadline of 1 s" in errors["127.0.0.5"]


def test_when_every_slot_is_taken_the_oldest_unauthenticated_gives_its_own(ids) -> None:
    # 2 slots, both may be unauthenticated: two silent peers hold them; a pull evicts
    # the older and takes its slot instead of being refused as busy
    opts = dict(max_connections=2, max_handshakes=2, max_handshakes_per_source=2)
    with server(ids["holder"], timeout=2.0, handshake_timeout=2.0, **opts) as srv:
        silent = []
        for n in (4, 5):
            silent.append(_silent(srv.address, f"127.0.0.{n}"))
            _until(lambda: srv.stats.connections == len(silent))
        try:
            r = pull(srv.address, ids["puller"], holder_policy(), KEYS, timeout=2)
        finally:
            for s in silent:
                s.close()
    assert r.error is None and r.completed is not None
    assert srv.stats.handshakes_evicted == 1 and srv.stats.busy == 0
    assert srv.served[0].error == (
        "evicted before authentication: the oldest unauthenticated while 2 connections "
        "were in service"
    )


def test_a_silent_peer_is_dropped_at_the_offer_deadline(ids) -> None:
    # the offer (10 bytes and a certificate) comes at once from an honest peer: a peer
    # silent for offer_timeout is dropped then, not at the end of handshake_timeout
    with server(ids["holder"], timeout=2.0, handshake_timeout=2.0, offer_timeout=0.3) as srv:
        with socket.create_connection(srv.address) as s:
            started = time.monotonic()
            closed = closed_by_peer(s, 2.0)
            took = time.monotonic() - started
        record = wait_ended(srv, 2.0)
    assert closed and 0.2 < took < 1.0, took
    assert record is not None and record.error == (
        "HandshakeDeadlineError: handshake: offer (0/10 bytes) not done within the "
        "deadline of 0.3 s"
    )
    assert srv.stats.handshake_timeouts == 1
    assert ServerOptions().offer_timeout == 2.0  # the default, 5 s before
    assert ServerOptions(handshake_timeout=1.0).offer_timeout == 1.0


def test_sources_are_ipv4_addresses_and_ipv6_slash_64s() -> None:
    assert handshake_source("10.0.0.1") == "10.0.0.1"
    assert handshake_source("::ffff:10.0.0.1") == "10.0.0.1"  # a dual-stack listener's view
    assert handshake_source("2001:db8::1") == "2001:db8::/64"
    assert handshake_source("2001:db8::ffff:ffff:ffff:ffff") == "2001:db8::/64"
    assert handshake_source("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert handshake_source("fe80::1%eth0") == "fe80::/64"


def test_addresses_of_one_ipv6_slash_64_share_one_cap() -> None:
    table: HandshakeTable[str] = HandshakeTable(limit=32, per_source=8)
    for i in range(8):
        assert table.admit(f"a{i}", handshake_source(f"2001:db8::{i + 1:x}")) is None
    assert table.admit("v4", handshake_source("10.0.0.1")) is None
    # a ninth address of the same /64: the /64's oldest goes, not the IPv4 peer
    assert table.admit("a8", handshake_source("2001:db8::ff")) == (
        "a0",
        "8 from 2001:db8::/64 not yet authenticated",
    )
    assert table.count("2001:db8::/64") == 8 and len(table) == 9
    # another /64 is another source
    assert table.admit("b0", handshake_source("2001:db8:0:1::1")) is None
    assert table.remove("a1") and not table.remove("a0")
    assert table.pop_oldest() == "a2"
    with pytest.raises(ValueError, match=r"per_source 9 is not 1\.\.limit"):
        HandshakeTable(limit=8, per_source=9)


def test_the_cap_in_all_evicts_the_oldest_of_any_source() -> None:
    table: HandshakeTable[str] = HandshakeTable(limit=3, per_source=2)
    for item, source in (("x", "10.0.0.1"), ("y", "10.0.0.2"), ("z", "10.0.0.3")):
        assert table.admit(item, source) is None
    assert table.admit("w", "10.0.0.4") == ("x", "3 not yet authenticated")
    assert table.count("10.0.0.1") == 0 and len(table) == 3


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
        ({"offer_timeout": 0}, "offer_timeout 0 s is not a positive number up to"),
        ({"handshake_timeout": 1, "offer_timeout": 2}, r"offer_timeout 2 s .* \(1 s\)"),
        ({"offer_timeout": float("nan")}, "offer_timeout nan s"),
    ):
        with pytest.raises(ValueError, match=name):
            ServerOptions(**kwargs)  # type: ignore[arg-type]
    o = ServerOptions(max_connections=64)
    assert (o.max_handshakes, o.max_handshakes_per_source) == (32, 8)
    with pytest.raises(ValueError, match="min_rate_bps -1"):
        Holder(STORE.get, 1, min_rate_bps=-1)

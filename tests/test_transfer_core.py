"""The pure transfer core: frames, the puller and holder state machines, pacing, tiers.

Every test drives `Holder` and `Puller` with bytes only, on a modelled clock.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catsproto.node import TieredCache, TierSpec
from catsproto.transfer import (
    Accept,
    Accepted,
    Block,
    BlockVerified,
    Cancel,
    Cancelled,
    Code,
    Completed,
    Data,
    DigestMismatchError,
    Done,
    Evicted,
    FrameError,
    FrameReader,
    Holder,
    HolderState,
    Outcome,
    PeerCancelled,
    PeerRefusedError,
    ProtocolViolationError,
    Pull,
    Puller,
    PullerState,
    Refuse,
    StaleHitLedger,
    StoredBlock,
    TierStores,
    TokenBucket,
    TransferError,
    TruncatedTransferError,
    block_digest,
    encode,
    synthetic_keys,
    synthetic_payload,
    synthetic_store,
)
from catsproto.transfer.frames import FRAME_TYPES, HEADER_LEN, MAX_REASON, frame_fields
from catsproto.wire import CodecError, Tier

KEYS = synthetic_keys(7, 12)
SIZE = 40_000
STORE = synthetic_store(KEYS, SIZE)


def run(
    holder: Holder, puller: Puller, now: float = 0.0, cut_after: int | None = None
) -> tuple[list, bytes, float]:
    """Run a pull to its end on a modelled clock. Returns (puller events, all bytes the
    holder wrote, end time). With `cut_after`, only that many bytes reach the puller."""
    holder.receive(puller.start())
    events: list = []
    wire = bytearray()
    t = now
    while not holder.finished:
        data = holder.send(t, limit=64 << 10)
        if data:
            wire += data
            if cut_after is not None:
                part = data[: max(0, cut_after - (len(wire) - len(data)))]
                if part:
                    events += puller.receive(part)
                if len(wire) >= cut_after:
                    return events, bytes(wire), t
            else:
                events += puller.receive(data)
            continue
        nxt = holder.next_send_at(t)
        assert nxt is not None and nxt >= t
        t = nxt
    return events, bytes(wire), t


def completed(events: list) -> Completed:
    [done] = [e for e in events if isinstance(e, Completed)]
    return done


# ---- frames ---------------------------------------------------------------------------

FRAMES = [
    Pull(1, 0, 0, 0, tuple(KEYS[:3])),
    Pull((1 << 64) - 1, 9, 3, 125_000_000, tuple(KEYS)),
    Accept(1, 9, 0, 12),
    Block(3, KEYS[3], SIZE, bytes(range(32))),
    Data(b"\x00\x01payload"),
    Evicted(4, KEYS[4]),
    Done(1, 4),
    Cancel(Code.CANCELLED, "user gave up"),
    Refuse(Code.TOO_LARGE, "12 keys, at most 4 — sorry"),
]


def test_frame_vector_by_hand() -> None:
    f = Evicted(4, 0x0102030405060708)
    assert encode(f).hex(" ") == "05 00 00 00 0c 00 00 00 04 01 02 03 04 05 06 07 08"
    p = Pull(2, 0, 1, 0, (0xAA,))
    assert encode(p) == bytes.fromhex(
        "01 000000240000000000000002000000000000000000000001000000000000000000000000000000aa"
    )


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_frame_round_trip_whole_and_byte_by_byte(frame) -> None:
    raw = encode(frame)
    [(at, got)] = FrameReader().feed(raw)
    assert at == 0 and got == frame and encode(got) == raw
    reader = FrameReader()
    out = []
    for i in range(len(raw)):
        out += reader.feed(raw[i : i + 1])
    if isinstance(frame, Data):  # DATA comes out in pieces as it arrives, views of the input
        assert all(at == 0 and isinstance(f, Data) for at, f in out)
        assert b"".join(f.chunk for _, f in out) == frame.chunk and len(out) == len(frame.chunk)
    else:
        assert [f for _, f in out] == [frame]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_frame_fields_add_up_to_the_body_in_wire_order(frame) -> None:
    fields = frame_fields(frame)
    assert b"".join(f.raw for f in fields) == frame.encode_body()
    names = [f.name for f in fields]
    assert len(set(names)) == len(names)
    for f in fields:  # every named value is the frame's own (keys and payload by position)
        if f.name.startswith("keys["):
            assert f.value == frame.keys[int(f.name[5:-1])]
        elif f.name == "payload":
            assert f.value == bytes(frame.chunk)
        else:
            assert f.value == getattr(frame, f.name)


def test_frame_fields_cover_every_frame_type_and_show_the_reason_sent() -> None:
    assert {type(f) for f in FRAMES} == set(FRAME_TYPES.values())
    reason = "x" + "\u00e9" * 600  # 1,201 octets: the cut at 1,024 falls inside a character
    [code, sent] = frame_fields(Refuse(300, reason))
    assert (code.name, code.value, code.raw) == ("code", 300, b"\x01\x2c")
    assert sent.name == "reason" and sent.value == "x" + "\u00e9" * 511 and len(sent.raw) == 1023


def test_data_pieces_carry_their_frame_offset_and_stop_at_the_frame_end() -> None:
    raw = encode(Done(1, 0)) + encode(Data(b"abcdefgh")) + encode(Done(2, 0))
    reader = FrameReader()
    out = reader.feed(raw[:25]) + reader.feed(raw[25:])  # cut inside the DATA body
    first = len(encode(Done(1, 0)))
    assert [(at, type(f).__name__) for at, f in out] == [
        (0, "Done"),
        (first, "Data"),
        (first, "Data"),
        (first + 13, "Done"),
    ]
    assert b"".join(bytes(f.chunk) for _, f in out[1:3]) == b"abcdefgh"
    assert reader.received == len(raw)


FIXED = [f for f in FRAMES if not isinstance(f, Data | Cancel | Refuse)]


@pytest.mark.parametrize("frame", FIXED, ids=lambda f: type(f).__name__)
def test_frame_body_one_byte_short_or_long_is_refused(frame) -> None:
    raw = encode(frame)
    body = raw[HEADER_LEN:]
    prefix = encode(Data(b"x" * 7))
    for bad in (body[:-1], body + b"\x00"):
        forged = raw[:1] + len(bad).to_bytes(4, "big") + bad
        with pytest.raises(FrameError) as exc:
            FrameReader().feed(prefix + forged)
        assert exc.value.offset == len(prefix) and exc.value.frame_type == raw[0]


def test_coded_frames_refuse_a_missing_code_and_bad_utf8() -> None:
    with pytest.raises(FrameError, match="lacks its code"):
        FrameReader().feed(b"\x07\x00\x00\x00\x01\x00")
    with pytest.raises(FrameError, match="not UTF-8"):
        FrameReader().feed(b"\x08\x00\x00\x00\x03\x00\x01\xff")
    with pytest.raises(FrameError, match="empty chunk"):
        FrameReader().feed(b"\x04\x00\x00\x00\x00")


@given(st.text(min_size=0, max_size=1200))
@settings(max_examples=200, deadline=None)
def test_a_long_reason_is_cut_at_a_character_boundary(reason: str) -> None:
    for kind in (Cancel, Refuse):
        frame = kind(Code.VERIFY_FAILED, reason)
        back = kind.decode_body(frame.encode_body())  # the peer can always read it
        assert back.code == Code.VERIFY_FAILED and reason.startswith(back.reason)
        assert len(back.reason.encode("utf-8")) <= MAX_REASON
        if len(reason.encode("utf-8")) <= MAX_REASON:
            assert back.reason == reason


def test_a_reason_cut_inside_a_character_keeps_the_whole_characters() -> None:
    reason = "€" * 400  # 1,200 octets; 1,024 falls inside the 342nd character
    back = Cancel.decode_body(Cancel(Code.CANCELLED, reason).encode_body())
    assert back.reason == "€" * 341


def test_frame_errors_say_where() -> None:
    reader = FrameReader()
    good = encode(Done(1, 0))
    with pytest.raises(FrameError) as exc:
        reader.feed(good + b"\x63\x00\x00\x00\x00")
    assert exc.value.offset == len(good) and "unknown frame type 99" in str(exc.value)
    with pytest.raises(FrameError) as exc:
        FrameReader(max_body=100).feed(b"\x04\x00\x00\x10\x00")
    assert str(exc.value) == "data frame at stream offset 0: length 4096 over the limit of 100"
    assert isinstance(exc.value, CodecError)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_the_transfer_error(data: bytes) -> None:
    """Like h11's rule: any input either parses or raises the one error family."""
    puller = Puller(1, KEYS[:2])
    puller.start()
    try:
        puller.receive(data)
        puller.end_of_stream()
    except TransferError:
        assert puller.state is PullerState.FAILED
    holder = Holder(STORE.get, 1)
    try:
        holder.receive(data)
        holder.send(0.0)
    except TransferError:
        pass


# ---- a whole transfer -----------------------------------------------------------------


def test_pull_delivers_every_block_verified_and_identical() -> None:
    holder, puller = Holder(STORE.get, 5, chunk=8192), Puller(1, KEYS)
    events, wire, _ = run(holder, puller)
    assert events[0] == Accepted(5, 0, False)
    assert [e.index for e in events if isinstance(e, BlockVerified)] == list(range(len(KEYS)))
    done = completed(events)
    assert done.recompute_from is None and done.evicted_at is None
    assert [b.key for b in done.blocks] == KEYS
    assert all(b.payload == synthetic_payload(b.key, SIZE) for b in done.blocks)
    assert all(b.digest == block_digest(b.key, b.payload) for b in done.blocks)
    assert puller.state is PullerState.COMPLETE and holder.state is HolderState.FINISHED
    assert holder.payload_bytes_sent == SIZE * len(KEYS)
    assert len(wire) < SIZE * len(KEYS) * 1.01  # framing overhead under 1 %


def test_digest_binds_the_payload_to_its_key() -> None:
    payload = synthetic_payload(KEYS[0], 100)
    assert block_digest(KEYS[0], payload) != block_digest(KEYS[1], payload)
    assert block_digest(KEYS[0], payload) != block_digest(KEYS[0], payload + b"\x00")


# ---- refusals: nothing unverified is ever handed out ----------------------------------


@pytest.mark.parametrize("victim", [0, 5, 11])
def test_tampered_block_in_flight_is_refused(victim: int) -> None:
    holder, puller = Holder(STORE.get, 1, chunk=16384), Puller(1, KEYS)
    holder.receive(puller.start())
    wire = bytearray()
    while not holder.finished:
        wire += holder.send(0.0)
    # flip one payload byte in the middle of block `victim`
    marker = encode(Block(victim, KEYS[victim], SIZE, STORE[KEYS[victim]].digest))
    at = wire.index(marker) + len(marker) + HEADER_LEN + 1000
    wire[at] ^= 0x40
    events = []
    with pytest.raises(DigestMismatchError) as exc:
        for i in range(0, len(wire), 3000):
            events += puller.receive(bytes(wire[i : i + 3000]))
    assert f"block {victim}" in str(exc.value) and exc.value.offset is not None
    assert not any(isinstance(e, Completed) for e in events)  # nothing admitted
    assert puller.state is PullerState.FAILED
    assert puller.resume_state().next_index == victim  # only the blocks before it
    with pytest.raises(ProtocolViolationError):
        puller.receive(b"")


def test_block_rotten_at_rest_is_refused() -> None:
    store = dict(STORE)
    good = store[KEYS[2]]
    store[KEYS[2]] = dataclasses.replace(good, payload=b"\xff" + good.payload[1:])
    with pytest.raises(DigestMismatchError):
        run(Holder(store.get, 1), Puller(1, KEYS))


def test_block_of_another_key_is_refused() -> None:
    """A store mix-up is caught: by the holder (it will not send another key's block
    under this key: it answers evicted) or by the digest, which covers the key."""
    store = dict(STORE)
    store[KEYS[1]] = STORE[KEYS[2]]
    assert completed(run(Holder(store.get, 1), Puller(1, KEYS))[0]).recompute_from == 1
    forged = {**STORE, KEYS[1]: StoredBlock(KEYS[1], STORE[KEYS[2]].payload, STORE[KEYS[2]].digest)}
    with pytest.raises(DigestMismatchError):  # right key, another block's digest
        run(Holder(forged.get, 1), Puller(1, KEYS))


def test_out_of_order_and_oversized_blocks_are_refused() -> None:
    puller = Puller(1, KEYS)
    puller.start()
    puller.receive(encode(Accept(1, 1, 0, len(KEYS))))
    with pytest.raises(ProtocolViolationError, match="out of prefix order"):
        puller.receive(encode(Block(1, KEYS[1], 10, bytes(32))))
    puller = Puller(1, KEYS, max_block_bytes=1000)
    puller.start()
    puller.receive(encode(Accept(1, 1, 0, len(KEYS))))
    with pytest.raises(ProtocolViolationError, match="over the limit"):
        puller.receive(encode(Block(0, KEYS[0], 1001, bytes(32))))
    puller = Puller(1, KEYS)
    puller.start()
    puller.receive(encode(Accept(1, 1, 0, len(KEYS))) + encode(Block(0, KEYS[0], 4, bytes(32))))
    with pytest.raises(ProtocolViolationError, match="announced 4"):
        puller.receive(encode(Data(b"12345")))


def test_done_without_eviction_before_the_end_is_refused() -> None:
    puller = Puller(1, KEYS)
    puller.start()
    with pytest.raises(ProtocolViolationError, match="without an eviction"):
        puller.receive(encode(Accept(1, 1, 0, len(KEYS))) + encode(Done(1, 0)))


@pytest.mark.parametrize("cut", [0, 5, 30, 80, 100, 40_000, 40_080, 123_457, 300_000])
def test_truncated_stream_is_refused_and_admits_nothing(cut: int) -> None:
    holder, puller = Holder(STORE.get, 1, chunk=8192), Puller(1, KEYS)
    events, _, _ = run(holder, puller, cut_after=cut)
    with pytest.raises(TruncatedTransferError) as exc:
        puller.end_of_stream()
    assert exc.value.offset == cut
    assert not any(isinstance(e, Completed) for e in events)
    assert puller.resume_state().next_index == sum(isinstance(e, BlockVerified) for e in events)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 490_000), min_size=1, max_size=4), st.integers(1, 3))
def test_interrupted_transfer_resumes_to_the_same_result(cuts: list[int], epoch_bump: int) -> None:
    """Cut the stream any number of times, anywhere; resuming each time from the last
    verified block ends with exactly the blocks of an uninterrupted pull."""
    whole = completed(run(Holder(STORE.get, 3), Puller(1, KEYS))[0])
    resume = None
    for cut in cuts:
        puller = Puller(2, KEYS, resume=resume)
        events, _, _ = run(Holder(STORE.get, 3), puller, cut_after=cut)
        if any(isinstance(e, Completed) for e in events):
            break
        with pytest.raises(TruncatedTransferError):
            puller.end_of_stream()
        resume = puller.resume_state()
    puller = Puller(2, KEYS, resume=resume)
    events, wire, _ = run(Holder(STORE.get, 3), puller)
    done = completed(events)
    assert done.blocks == whole.blocks
    start = resume.next_index if resume else 0
    assert events[0] == Accepted(3, start, False)
    assert len(wire) < (len(KEYS) - start) * (SIZE + 200) + 200  # did not resend verified blocks


def test_holder_restart_replaces_staged_blocks() -> None:
    """Resuming against a holder with another epoch starts over: replace, never merge."""
    puller = Puller(1, KEYS)
    run(Holder(STORE.get, 3), puller, cut_after=150_000)
    with pytest.raises(TruncatedTransferError):
        puller.end_of_stream()
    resume = puller.resume_state()
    assert resume.next_index == 3 and resume.holder_epoch == 3
    reborn = {k: StoredBlock.of(k, b"new life " + bytes(100)) for k in KEYS}
    puller = Puller(1, KEYS, resume=resume)
    events, _, _ = run(Holder(reborn.get, 4), puller)
    assert events[0] == Accepted(4, 0, True)
    assert completed(events).blocks == tuple(reborn[k] for k in KEYS)


# ---- eviction, cancellation, refusal ------------------------------------------------------


def test_eviction_midway_answers_evicted_and_recompute_from_there() -> None:
    store = dict(STORE)

    def lookup(key: int) -> StoredBlock | None:
        if key == KEYS[3]:  # while block 3 goes out, the engine evicts block 6
            store.pop(KEYS[6], None)
        return store.get(key)

    holder, puller = Holder(lookup, 1), Puller(1, KEYS)
    events, _, _ = run(holder, puller)
    done = completed(events)
    assert done.evicted_at == 6 and done.recompute_from == 6
    assert [b.key for b in done.blocks] == KEYS[:6]
    assert holder.evicted is not None and holder.evicted.index == 6
    ledger = StaleHitLedger()
    outcome = ledger.record(Outcome.of_transfer(len(KEYS), done), source="10.0.2.10")
    assert outcome.stale and outcome.recompute_from == 6
    assert ledger.to_json()["stale_hits"] == 1 and ledger.recomputed_blocks == 6
    assert ledger.stale_hit_rate == 1.0


def test_first_block_gone_completes_empty() -> None:
    store = {k: v for k, v in STORE.items() if k != KEYS[0]}
    done = completed(run(Holder(store.get, 1), Puller(1, KEYS))[0])
    assert done.blocks == () and done.recompute_from == 0


def test_puller_cancel_stops_the_holder_and_keeps_verified_blocks() -> None:
    holder, puller = Holder(STORE.get, 1, chunk=8192), Puller(1, KEYS)
    holder.receive(puller.start())
    events = []
    while puller.verified < 4:
        events += puller.receive(holder.send(0.0, limit=8192))
    assert holder.receive(puller.cancel("enough")) == [PeerCancelled(Code.CANCELLED, "enough")]
    assert holder.finished and holder.send(0.0) == b""
    assert puller.state is PullerState.CANCELLED
    assert puller.receive(b"late bytes") == []
    assert puller.resume_state().next_index == 4
    assert not any(isinstance(e, Completed) for e in events)


def test_holder_cancel_reaches_the_puller() -> None:
    holder, puller = Holder(STORE.get, 1), Puller(1, KEYS)
    holder.receive(puller.start())
    puller.receive(holder.send(0.0, limit=100_000))
    events = puller.receive(holder.cancel("draining", code=Code.CANCELLED))
    assert events[-1] == Cancelled(Code.CANCELLED, "draining", True)
    holder2, puller2 = Holder(STORE.get, 1), Puller(1, KEYS)
    holder2.receive(puller2.start())
    with pytest.raises(PeerRefusedError) as exc:
        puller2.receive(holder2.send(0.0, limit=1000) + holder2.cancel("shutting down"))
    assert exc.value.code == Code.SHUTTING_DOWN


def test_holder_refuses_too_many_keys() -> None:
    holder, puller = Holder(STORE.get, 1, max_keys=4), Puller(1, KEYS)
    holder.receive(puller.start())
    with pytest.raises(PeerRefusedError, match="at most 4") as exc:
        puller.receive(holder.send(0.0))
    assert exc.value.code == Code.TOO_LARGE and holder.finished


# ---- pacing ---------------------------------------------------------------------------------


def test_token_bucket() -> None:
    b = TokenBucket(1000.0, 500.0)
    assert b.available(10.0) == 500
    b.take(800, 10.0)
    assert b.available(10.0) == -300
    assert b.ready_at(200, 10.0) == pytest.approx(10.5)
    assert b.available(10.5) == pytest.approx(200)
    assert b.available(100.0) == 500  # capped at the burst
    assert TokenBucket(0, 1).available(0) == float("inf")


@pytest.mark.parametrize(
    ("holder_rate", "puller_rate"), [(2e6, 0), (0, 2_000_000), (8e6, 2_000_000)]
)
def test_pacing_follows_the_lower_budget(holder_rate: float, puller_rate: int) -> None:
    keys = synthetic_keys(1, 40)
    store = synthetic_store(keys, 100_000)  # 4 MB at 2 MB/s
    holder = Holder(store.get, 1, chunk=32768, rate_bps=holder_rate)
    events, wire, end = run(holder, Puller(1, keys, rate_bps=puller_rate), now=50.0)
    assert len(completed(events).blocks) == 40
    burst = 2 * (32768 + HEADER_LEN)
    assert (len(wire) - burst) / 2e6 - 0.01 <= end - 50.0 <= len(wire) / 2e6 + 0.01


def test_unpaced_holder_sends_all_at_once() -> None:
    events, _, end = run(Holder(STORE.get, 1), Puller(1, KEYS), now=3.0)
    assert end == 3.0 and len(completed(events).blocks) == len(KEYS)


# ---- tiers: the same block path, modelled bandwidth and latency ------------------------------


def tiered() -> TierStores:
    cache = TieredCache(
        [
            TierSpec(Tier.HBM, 100, 5, 1_600_000),
            TierSpec(Tier.DRAM, 100, 30, 400_000),  # 50 GB/s
            TierSpec(Tier.SSD, 100, 200, 16_000),  # 2 GB/s, 200 µs
        ]
    )
    return TierStores(cache, epoch=1)


def test_promotion_and_demotion_move_blocks_and_cost_the_slower_tier() -> None:
    t = tiered()
    keys = synthetic_keys(3, 8)
    size = 1 << 20
    for k in keys:
        t.put(Tier.SSD, StoredBlock.of(k, synthetic_payload(k, size)))
    t.cache.mark_advertised()
    up = t.move(keys, Tier.SSD, Tier.HBM, now=10.0)
    assert up.moved == tuple(keys) and up.recompute_from is None
    expected = 200e-6 + 8 * size / 2e9
    assert expected * 0.99 <= up.seconds <= expected * 1.01
    assert all(t.cache.tier_of(k) is Tier.HBM for k in keys)
    assert all(t.holding(k) is Tier.HBM and t.get(Tier.SSD, k) is None for k in keys)
    added_hbm, _ = t.cache.changes(Tier.HBM)
    _, removed_ssd = t.cache.changes(Tier.SSD)
    assert added_hbm == removed_ssd == frozenset(keys)  # what the next advertisement carries
    down = t.move(keys[4:], Tier.HBM, Tier.DRAM, now=11.0)
    assert down.moved == tuple(keys[4:])
    assert 30e-6 < down.seconds < up.seconds
    assert [t.cache.tier_of(k) for k in keys] == [Tier.HBM] * 4 + [Tier.DRAM] * 4


def test_rotten_block_is_not_promoted_and_nothing_moves() -> None:
    t = tiered()
    keys = synthetic_keys(4, 4)
    for k in keys:
        t.put(Tier.SSD, StoredBlock.of(k, synthetic_payload(k, 5000)))
    bad = t.blocks[Tier.SSD][keys[2]]
    t.blocks[Tier.SSD][keys[2]] = dataclasses.replace(bad, payload=bytes(5000))
    with pytest.raises(DigestMismatchError):
        t.move(keys, Tier.SSD, Tier.HBM, now=0.0)
    assert all(t.cache.tier_of(k) is Tier.SSD for k in keys)
    assert t.cache.count(Tier.HBM) == 0


def test_promotion_of_a_partly_evicted_prefix_moves_what_is_there() -> None:
    t = tiered()
    keys = synthetic_keys(5, 6)
    for k in keys:
        t.put(Tier.SSD, StoredBlock.of(k, synthetic_payload(k, 1000)))
    t.drop(Tier.SSD, keys[3])
    move = t.move(keys, Tier.SSD, Tier.DRAM, now=0.0)
    assert move.moved == tuple(keys[:3]) and move.recompute_from == 3
    assert t.cache.tier_of(keys[4]) is Tier.SSD  # after the gap: untouched

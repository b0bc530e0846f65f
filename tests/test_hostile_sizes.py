"""Inputs whose size, not their shape, is the attack: a capture of many tiny out-of-order
TCP segments, a vLLM publisher that varies media strings and DP ranks on every event,
and an attribute value longer than any path attribute can carry."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import pytest
import zmq
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.adapters import pcap
from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventSubscriber,
    encode_payload,
    removed_event,
    stored_event,
)
from catsproto.cli import main
from catsproto.examples import examples, large_advertisement
from catsproto.keys import BlockKeyer
from catsproto.node import TieredCache, TierSpec, VllmIngest
from catsproto.node import vllm as node_vllm
from catsproto.wire import Reader, Tier
from catsproto.wire.advertisement import _FALLBACK, MAX_VALUE_LEN, _decode_compiled
from catsproto.wire.bgp import build_update

# ---- TCP reassembly ----------------------------------------------------------------------

FLOW = ("10.0.0.1", 40000, "10.0.0.2", 179)
ISN = 7000


def _update(value: bytes, prefix: str) -> bytes:
    return build_update(
        [ipaddress.ip_network(prefix)],
        ipaddress.ip_address("10.0.0.1"),
        [wire.encode_attribute(value)],
        as_path=(65001,),
    )


def _seg(offset: int, payload: bytes, syn: bool = False) -> pcap.Segment:
    """A segment carrying stream bytes from `offset` on (offset -1 is the SYN)."""
    return pcap.Segment(float(offset), FLOW, (ISN + 1 + offset) % 2**32, syn, False, False,
                        payload)  # fmt: skip


SYN = _seg(-1, b"", syn=True)


def test_a_capture_of_one_byte_segments_sent_last_first_comes_back_whole(tmp_path: Path):
    advs = [ex.advertisement for ex in examples()]
    msgs = [_update(wire.encode(a), f"10.255.0.{i}/32") for i, a in enumerate(advs, 1)]
    stream = b"".join(msgs)
    assert len(stream) > 1500  # so that that many segments wait for the first one
    # every byte its own segment, last first; a few retransmissions of waiting bytes, then
    # the first byte, which releases all of them at once
    order = [*range(len(stream) - 1, 0, -1), len(stream) - 1, 500, 2, 0]
    pkts = [Ether() / IP(src=FLOW[0], dst=FLOW[2]) / TCP(sport=FLOW[1], dport=FLOW[3],
                                                        seq=ISN, flags="S")]  # fmt: skip
    for at in order:
        pkts.append(
            Ether() / IP(src=FLOW[0], dst=FLOW[2])
            / TCP(sport=FLOW[1], dport=FLOW[3], seq=ISN + 1 + at, flags="PA")
            / stream[at : at + 1]
        )  # fmt: skip
    for i, pkt in enumerate(pkts):
        pkt.time = 1_795_000_000 + i / 1e6
    wrpcap(str(tmp_path / "tiny.pcap"), pkts)

    streams = pcap.BGPStreams()
    found = list(pcap.inspect_capture(tmp_path / "tiny.pcap", streams=streams))
    assert not streams.problems
    assert [f.advertisement for f in found] == advs
    assert [str(f.prefix) for f in found] == [f"10.255.0.{i}/32" for i in range(1, len(advs) + 1)]
    assert main(["inspect", str(tmp_path / "tiny.pcap"), "--json"]) == 0


def test_too_many_waiting_segments_break_the_stream_which_then_resynchronises():
    cap = pcap.MAX_PENDING_SEGMENTS
    streams = pcap.BGPStreams()
    streams.feed(SYN)
    for i in range(cap):  # bytes 1..cap wait for byte 0, which never comes
        assert streams.feed(_seg(1 + i, b"\xff")) == []
    assert not streams.problems
    msg = _update(wire.encode(examples()[0].advertisement), "10.255.0.1/32")
    after = cap + 10  # one segment more: the stream is given up and picks up from here
    got = streams.feed(_seg(after, msg))
    assert len(streams.problems) == 1
    assert streams.problems[0].reason == (
        f"gap of {after} bytes never filled ({cap} segments, {cap} bytes waiting)"
    )
    assert [m.data for m in got] == [msg]  # resynchronised on the message's marker
    got = streams.feed(_seg(after + len(msg), msg))  # and the stream continues in order
    assert [m.data for m in got] == [msg] and len(streams.problems) == 1


def test_too_many_waiting_bytes_still_break_the_stream():
    chunk = b"\xff" * (1 << 16)
    streams = pcap.BGPStreams()
    streams.feed(SYN)
    n = pcap.MAX_PENDING_BYTES // len(chunk)
    for i in range(n):
        streams.feed(_seg(1 + i * len(chunk), chunk))
    assert not streams.problems
    streams.feed(_seg(1 + n * len(chunk), b"\xff"))  # one byte over
    assert len(streams.problems) == 1
    assert streams.problems[0].reason.endswith(f"({n} segments, {n << 16} bytes waiting)")


def test_waiting_bytes_are_released_when_their_gap_fills():
    """More than the byte cap passes through the waiting room, never more than two
    segments at a time: nothing is given up (the count of waiting bytes goes down too)."""
    big = _update(wire.encode(large_advertisement(60_000)), "10.255.0.9/32")
    stream = big * (2 * pcap.MAX_PENDING_BYTES // len(big))
    size = 40_000
    segs = [_seg(at, stream[at : at + size]) for at in range(0, len(stream), size)]
    swapped = []
    for i in range(0, len(segs) - 1, 2):  # every pair arrives second first
        swapped += [segs[i + 1], segs[i]]
    swapped += segs[len(swapped) :]
    streams = pcap.BGPStreams()
    out = [m.data for s in [SYN, *swapped] for m in streams.feed(s)]
    assert not streams.problems
    assert out == [big] * (len(stream) // len(big))


# ---- vLLM ingest -------------------------------------------------------------------------

BS = 4
KEYER = BlockKeyer(b"s" * 32, "test/model", BS)


def _publish_and_drain(sub: VllmEventSubscriber, pub: zmq.Socket, payloads: list[bytes],
                       first_seq: int) -> None:  # fmt: skip
    target = sub.ingest.stats.batches + len(payloads)
    for i, p in enumerate(payloads):
        pub.send_multipart([b"kv", (first_seq + i).to_bytes(8, "big"), p])
    deadline = time.monotonic() + 10
    while sub.ingest.stats.batches < target and time.monotonic() < deadline:
        sub.poll(50)
    assert sub.ingest.stats.batches == target, sub.stats


def test_refused_events_from_many_media_and_ranks_leave_no_state_behind():
    """A publisher that names a new medium in every event and a new DP rank in every
    batch: every stored block is refused (unknown medium), so nothing may be kept per
    medium or per rank beyond a small bound. Real msgpack bytes over a real ZMQ socket."""
    ctx = zmq.Context()
    cache = TieredCache([TierSpec(Tier.HBM, 1000, 5, 1), TierSpec(Tier.DRAM, 1000, 20, 1)])
    ingest = VllmIngest(cache, KEYER)
    sub = VllmEventSubscriber(
        ingest, [RankEndpoint(0, "tcp://127.0.0.1:0", None, True)], context=ctx,
        join_replay=False,
    )  # fmt: skip
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(sub.bound_endpoints()[0])
        deadline = time.monotonic() + 10
        while not pub.poll(50) and time.monotonic() < deadline:  # the subscription
            sub.poll(0)
        pub.recv()
        ranks, per_batch = 600, 5
        payloads = []
        for r in range(ranks):
            evs = [
                stored_event([r * 10 + j], None, list(range(BS)), BS, medium=f"X{r}-{j}")
                for j in range(per_batch)
            ]
            evs.append(removed_event([r * 10], medium="GPU"))  # never stored
            payloads.append(encode_payload(0.0, evs, data_parallel_rank=1000 + r))
        for at in range(0, ranks, 200):  # the socket's queue holds 1000 frames
            _publish_and_drain(sub, pub, payloads[at : at + 200], at)
        stats = ingest.stats
        assert stats.unknown_media == ranks * per_batch
        assert stats.unknown_removals == ranks
        assert cache.count(Tier.HBM) == 0 and sub.stats.bad_payloads == 0
        assert len(ingest._tier_of_medium) <= node_vllm.MAX_MEDIA_REMEMBERED
        assert not ingest._copies  # no rank holds a copy, so no rank has a map
        assert len(stats.by_rank) == node_vllm.MAX_RANKS_COUNTED
        assert sum(stats.by_rank.values()) + stats.other_ranks == stats.events
        assert stats.other_ranks == (ranks - node_vllm.MAX_RANKS_COUNTED) * (per_batch + 1)

        # a real block on yet another rank is still stored, counted and removed
        key = KEYER.block_keys(list(range(BS)))[0]
        _publish_and_drain(sub, pub, [
            encode_payload(1.0, [stored_event([5], None, list(range(BS)), BS, medium="cpu")],
                           data_parallel_rank=7),
        ], ranks)  # fmt: skip
        assert set(cache.lru_keys(Tier.DRAM)) == {key}
        assert ingest.copies(7) == {("CPU", None, 5): 1}
        _publish_and_drain(sub, pub, [
            encode_payload(2.0, [removed_event([5], medium="CPU")], data_parallel_rank=7),
        ], ranks + 1)  # fmt: skip
        assert cache.count(Tier.DRAM) == 0
        assert not ingest._copies  # the rank's map went with its last copy
        assert stats.other_ranks == (ranks - node_vllm.MAX_RANKS_COUNTED) * (per_batch + 1) + 2
    finally:
        pub.close()
        sub.close()
        ctx.term()


def test_a_clear_of_a_rank_that_holds_nothing_creates_nothing():
    ingest = VllmIngest(TieredCache([TierSpec(Tier.HBM, 10, 5, 1)]), KEYER)
    for r in range(50):
        ingest.reset_rank(r)
        ingest.clear_rank(r, only_tier=Tier.HBM)
    assert not ingest._copies and ingest.stats.rank_resets == 50


# ---- attribute values longer than an attribute ---------------------------------------------


def _base() -> bytes:
    return wire.encode(examples()[0].advertisement)


def _padded(total: int) -> bytes:
    """The base advertisement and one unknown TLV (type 1000) making `total` bytes."""
    base = _base()
    n = total - len(base) - 4
    return base + (1000).to_bytes(2, "big") + n.to_bytes(2, "big") + bytes(n)


def test_the_longest_value_an_attribute_carries_still_decodes_and_round_trips():
    value = _padded(MAX_VALUE_LEN)
    adv = wire.decode(value)
    assert wire.encode(adv) == value
    assert _decode_compiled(value, 0, len(value), wire.DEFAULT_REGISTRY) == adv


@pytest.mark.parametrize("total", [MAX_VALUE_LEN + 1, 80_059])
def test_a_longer_value_is_refused_by_both_decoders_with_a_length_error(total: int):
    if total == MAX_VALUE_LEN + 1:
        value = _padded(total)
    else:  # two unknown TLVs of 40,000 bytes each, as the codec would never write them
        value = _base() + b"".join(
            t.to_bytes(2, "big") + (40_000).to_bytes(2, "big") + bytes(40_000) for t in (1000, 1001)
        )
    assert len(value) == total
    with pytest.raises(wire.BadLengthError) as raised:
        wire.decode(value)
    err = raised.value
    assert (err.offset, err.tlv_type) == (0, None)
    assert str(err) == f"at offset 0: attribute value of {total} bytes exceeds 65535"
    with pytest.raises(wire.BadLengthError) as ref:
        wire.decode_from(Reader(value))
    assert (ref.value.reason, ref.value.offset) == (err.reason, err.offset)
    with pytest.raises(_FALLBACK):
        _decode_compiled(value, 0, len(value), wire.DEFAULT_REGISTRY)
    # inside a bigger buffer the offset is where the value starts
    with pytest.raises(wire.BadLengthError) as windowed:
        wire.decode_window(b"\x00" * 9 + value, 9, 9 + total)
    assert windowed.value.offset == 9


def test_decode_command_refuses_an_oversize_hex_value_in_one_line(tmp_path: Path, capsys):
    """Hex input may be of any length (unlike a BGP attribute): refused, nothing printed."""
    value = _padded(MAX_VALUE_LEN + 1)
    (tmp_path / "big.hex").write_text(value.hex())
    assert main(["decode", str(tmp_path / "big.hex")]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"catsproto decode: at offset 0: attribute value of {len(value)} bytes exceeds 65535"
    ]

"""Inputs whose size, not their shape, is the attack: a capture of many tiny out-of-order
TCP segments, a vLLM publisher that varies media strings and DP ranks on every event,
and an attribute value longer than any path attribute can carry."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from catsproto import wire
from catsproto.adapters import pcap
from catsproto.cli import main
from catsproto.examples import examples, large_advertisement
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

"""Find cache-state advertisements in packet captures: read, reassemble, frame, decode.

Strategy: three small stages, each testable alone.

1. `segments(source)` reads a pcap/pcapng file, gzip-compressed or not (or a live pcap
   stream from tcpdump), with scapy and yields TCP segments (time, flow, seq, flags,
   payload). scapy only parses Ethernet/IP/TCP here; it never sees BGP, and it reads
   the file through `pcap_file.WholeRecords`, which frames the records first and says
   where a capture is cut short or corrupt (scapy would stop there in silence).
2. `BGPStreams` reassembles each direction of each TCP connection (SYN sets the start;
   retransmissions and overlaps are trimmed; out-of-order segments wait for the gap to
   fill, in a heap by stream offset, so a gap filled by n segments costs O(n log n); at
   most MAX_PENDING_SEGMENTS segments and MAX_PENDING_BYTES bytes wait per direction, past
   which the gap is reported and the stream resynchronised) and cuts the byte stream
   into BGP messages by the 19-byte header, whose length may be anything up to 65535
   (RFC 8654 extended messages). A capture that starts
   mid-connection is synchronised on the first marker; a broken marker is reported and
   resynchronised, never raised.
3. `findings(messages, type_code, verify)` parses each UPDATE with `wire.bgp`, takes
   every path attribute of our type code, checks its header as the codec does (an
   attribute without the Optional or the Transitive bit is malformed; Partial and
   Extended Length are accepted), decodes its value with the codec and, per announced
   prefix, asks `verify` (a callback: signatures are checked against the route) what to
   make of it. A malformed attribute or UPDATE becomes a finding that carries the
   codec's error; nothing here raises for bad bytes.
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import logging
import subprocess
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from catsproto import wire
from catsproto.adapters.pcap_file import Damage, WholeRecords
from catsproto.wire.bgp import HEADER_LEN, MARKER, UPDATE, parse_update

MAX_PENDING_BYTES = 1 << 22  # out-of-order data kept per direction before giving up a gap
MAX_PENDING_SEGMENTS = 1 << 14  # out-of-order segments kept per direction, likewise
SEQ_MOD = 1 << 32
BGP_TYPES = {1: "OPEN", 2: "UPDATE", 3: "NOTIFICATION", 4: "KEEPALIVE", 5: "ROUTE-REFRESH"}

Flow = tuple[str, int, str, int]  # src, sport, dst, dport


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    time: float
    flow: Flow
    seq: int
    syn: bool
    fin: bool
    rst: bool
    payload: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class BGPMessage:
    """One whole BGP message and when its last byte was seen."""

    time: float
    flow: Flow
    data: bytes

    @property
    def kind(self) -> int:
        return self.data[18]

    @property
    def peer(self) -> str:
        src, sport, dst, dport = self.flow
        return f"{_hostport(src, sport)} > {_hostport(dst, dport)}"


@dataclasses.dataclass(frozen=True, slots=True)
class StreamProblem:
    """Bytes that could not be framed as BGP (a broken marker or length)."""

    time: float
    flow: Flow
    reason: str


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- stage 1: segments -----------------------------------------------------------------


class _ReaderWarnings(logging.Filter):
    """Holds back what scapy's capture reader logs ("WARNING: PcapNg: IDB is too small")
    until the next packet comes out of it, then lets it through. If none comes because
    the reader stopped at a block it could not parse, `held` is dropped: our note says
    that instead of the unprefixed line."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.held, self.releasing = logger, [], False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.releasing or not record.getMessage().startswith("Pcap"):
            return True
        self.held.append(record)
        if len(self.held) >= 64:  # not all about one block the reader stopped at
            self.release()
        return False

    def release(self) -> None:
        self.releasing = True
        try:
            for record in self.held:
                self.logger.handle(record)
        finally:
            self.held.clear()
            self.releasing = False


def segments(
    source: str | Path | IO[bytes], notes: list[Damage] | None = None
) -> Iterator[Segment]:
    """TCP segments of a pcap or pcapng capture (gzip-compressed or not), from a file or a
    byte stream (tcpdump -w -).

    A capture that ends early (copied while being written, cut short) or goes wrong
    part way is read up to its last whole record, and `notes` gets one `Damage` saying
    what and where (see `pcap_file`). Raises `CaptureFileError` for input that is no
    capture at all, OSError if the file cannot be opened."""
    from scapy.error import log_runtime
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.utils import PcapReader

    notes = [] if notes is None else notes
    if isinstance(source, str | Path):
        raw: IO[bytes] = open(source, "rb")  # noqa: SIM115 (closed below, with the reader)
        name = str(source)
    else:
        raw, name = source, str(getattr(source, "name", "stream"))
    try:
        records = WholeRecords(raw, name)
    except BaseException:
        raw.close()
        raise
    warnings = _ReaderWarnings(log_runtime)
    log_runtime.addFilter(warnings)
    reader = None
    try:
        if not records.empty:  # else the header itself is cut short: nothing for scapy
            reader = PcapReader(records)
            for pkt in reader:
                warnings.release()
                segment = _segment(pkt, IP, TCP, IPv6)
                if segment is not None:
                    yield segment
        stopped = records.unread()
        if stopped is not None:
            warnings.held.clear()  # what it said about the block it stopped at: ours instead
        damage = stopped or records.damage
        if damage is not None:
            notes.append(damage)
    finally:
        warnings.release()
        log_runtime.removeFilter(warnings)
        if reader is not None:
            reader.close()
        records.close()


def _segment(pkt: Any, ip4: Any, tcp_layer: Any, ip6: Any) -> Segment | None:
    tcp = pkt.getlayer(tcp_layer)
    if tcp is None:
        return None
    ip = pkt.getlayer(ip4) or pkt.getlayer(ip6)
    if ip is None:
        return None
    payload = bytes(tcp.payload)
    if isinstance(ip, ip4):  # drop Ethernet padding past the IP total length
        payload = payload[: max(0, ip.len - ip.ihl * 4 - tcp.dataofs * 4)]
    flags = int(tcp.flags)
    return Segment(
        float(pkt.time),
        (ip.src, tcp.sport, ip.dst, tcp.dport),
        tcp.seq,
        bool(flags & 0x02),
        bool(flags & 0x01),
        bool(flags & 0x04),
        payload,
    )


# ---- stage 2: reassembly and framing ---------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Direction:
    next_seq: int | None = None
    synced: bool = False
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    pos: int = 0
    """Stream offset of next_seq, counted without wrapping (pending is keyed by these)."""
    pending: dict[int, bytes] = dataclasses.field(default_factory=dict)
    pending_bytes: int = 0
    starts: list[int] = dataclasses.field(default_factory=list)
    """A heap of the keys of `pending`: the lowest stream offset waiting comes first."""


class BGPStreams:
    """Reassembles TCP directions and frames BGP messages (see the module docstring)."""

    def __init__(self) -> None:
        self._flows: dict[Flow, _Direction] = {}
        self.problems: list[StreamProblem] = []
        self.capture_notes: list[Damage] = []  # the file itself: cut short or corrupt

    def feed(self, seg: Segment) -> list[BGPMessage]:
        d = self._flows.get(seg.flow)
        if d is None or seg.syn:
            d = self._flows[seg.flow] = _Direction()
        if seg.syn:
            d.next_seq = (seg.seq + 1) % SEQ_MOD
            d.synced = True
            return []
        if seg.rst:
            self._flows.pop(seg.flow, None)
            return []
        if not seg.payload:
            return []
        if d.next_seq is None:  # capture started mid-connection
            d.next_seq = seg.seq
        self._accept(d, seg.seq, seg.payload, seg)
        return self._frame(d, seg)

    def _accept(self, d: _Direction, seq: int, payload: bytes, seg: Segment) -> None:
        assert d.next_seq is not None
        ahead = (seq - d.next_seq) % SEQ_MOD
        if ahead >= SEQ_MOD // 2:  # starts before what we have: retransmission or overlap
            behind = SEQ_MOD - ahead
            if behind >= len(payload):
                return
            payload, seq = payload[behind:], d.next_seq
            ahead = 0
        if ahead:
            at = d.pos + ahead
            held = d.pending.get(at)
            if held is not None and len(held) >= len(payload):
                return  # a retransmission of data already waiting
            n_segs = len(d.pending) + (held is None)
            n_bytes = d.pending_bytes + len(payload) - (0 if held is None else len(held))
            if n_segs > MAX_PENDING_SEGMENTS or n_bytes > MAX_PENDING_BYTES:
                self.problems.append(
                    StreamProblem(
                        seg.time,
                        seg.flow,
                        f"gap of {ahead} bytes never filled ({len(d.pending)} segments, "
                        f"{d.pending_bytes} bytes waiting)",
                    )
                )
                d.pending.clear()
                d.starts.clear()
                d.pending_bytes = 0
                d.buffer.clear()
                d.next_seq, d.synced = seq, False
                ahead = 0
            else:
                if held is None:
                    heapq.heappush(d.starts, at)
                d.pending[at] = payload
                d.pending_bytes = n_bytes
                return
        d.buffer += payload
        d.pos += len(payload)
        d.next_seq = (seq + len(payload)) % SEQ_MOD
        starts = d.starts
        while starts and starts[0] <= d.pos:  # waiting data that now continues the stream
            at = heapq.heappop(starts)
            data = d.pending.pop(at)
            d.pending_bytes -= len(data)
            skip = d.pos - at
            if skip < len(data):
                d.buffer += data[skip:]
                d.pos += len(data) - skip
                d.next_seq = (d.next_seq + len(data) - skip) % SEQ_MOD

    def _frame(self, d: _Direction, seg: Segment) -> list[BGPMessage]:
        out = []
        buf = d.buffer
        while True:
            if not d.synced:
                at = _find_header(buf)
                if at is None:
                    del buf[: max(0, len(buf) - HEADER_LEN)]
                    break
                del buf[:at]
                d.synced = True
            if len(buf) < HEADER_LEN:
                break
            length = int.from_bytes(buf[16:18], "big")
            if buf[:16] != MARKER or length < HEADER_LEN:
                what = "marker is not all ones" if buf[:16] != MARKER else f"length {length}"
                self.problems.append(
                    StreamProblem(seg.time, seg.flow, f"BGP stream out of step: {what}")
                )
                del buf[:1]
                d.synced = False
                continue
            if len(buf) < length:
                break
            out.append(BGPMessage(seg.time, seg.flow, bytes(buf[:length])))
            del buf[:length]
        return out


def _find_header(buf: bytearray) -> int | None:
    """Offset of the first plausible BGP header (marker, length >= 19, type 1..5)."""
    start = 0
    while True:
        at = buf.find(MARKER, start)
        if at < 0 or len(buf) < at + HEADER_LEN:
            return None if at < 0 else at
        length = int.from_bytes(buf[at + 16 : at + 18], "big")
        if length >= HEADER_LEN and buf[at + 18] in BGP_TYPES:
            return at
        start = at + 1


def bgp_messages(
    segs: Iterable[Segment], streams: BGPStreams | None = None
) -> Iterator[BGPMessage]:
    streams = streams or BGPStreams()
    for seg in segs:
        yield from streams.feed(seg)


# ---- stage 3: findings -----------------------------------------------------------------

IPv4Network = ipaddress.IPv4Network


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """What a verifier made of one advertisement on one route."""

    status: str  # "verified", "not-checked", or a refusal reason such as "bad-signature"
    detail: str = ""
    advertisement: wire.Advertisement | None = None  # opened, when a group key did it

    @property
    def verified(self) -> bool:
        return self.status == "verified"


Verify = Callable[[bytes, "IPv4Network | None", float], Check]


def not_checked(value: bytes, prefix: IPv4Network | None, now: float) -> Check:
    return Check("not-checked", "no --trust given")


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One advertisement (or a refusal) seen on one route in one UPDATE."""

    time: float
    peer: str
    prefix: IPv4Network | None
    flags: int | None
    value_len: int | None
    advertisement: wire.Advertisement | None
    error: wire.CodecError | None
    check: Check

    @property
    def status(self) -> str:
        return "malformed" if self.error is not None else self.check.status

    def to_json(self) -> dict[str, Any]:
        adv = self.check.advertisement or self.advertisement
        out: dict[str, Any] = {
            "time": round(self.time, 6),
            "peer": self.peer,
            "prefix": str(self.prefix) if self.prefix is not None else None,
            "flags": f"{self.flags:#04x}" if self.flags is not None else None,
            "partial": bool(self.flags & wire.FLAG_PARTIAL) if self.flags is not None else None,
            "length": self.value_len,
            "status": self.status,
        }
        if self.error is not None:
            out["error"] = {
                "kind": type(self.error).__name__,
                "message": str(self.error),
                "offset": self.error.offset,
                "tlv_type": self.error.tlv_type,
                "action": wire.error_action(self.error).value,
            }
        else:
            out["detail"] = self.check.detail
        if adv is not None:
            out["advertisement"] = adv.to_json()
        return out


def check_attribute_header(data: bytes, attr: wire.PathAttribute) -> None:
    """Refuse `attr` (parsed from the UPDATE `data`) as `wire.decode_attribute` would:
    without the Optional (0x80) or the Transitive (0x40) bit it is malformed (the
    draft's "Format and Flags" section, RFC 7606 treat-as-withdraw); Partial (0x20) and
    Extended Length (0x10) are accepted. The codec judges the attribute's own bytes, so
    the two cannot drift apart. Its error loses the offset: here offsets count from the
    start of the value, and the flags byte precedes it."""
    header = 4 if attr.flags & wire.FLAG_EXTENDED_LENGTH else 3
    end = attr.value_offset + len(attr.value)
    try:
        wire.decode_attribute(data[attr.value_offset - header : end], attr.type_code)
    except wire.CodecError as exc:
        raise type(exc)(exc.reason, None, exc.tlv_type) from None


def findings(
    messages: Iterable[BGPMessage],
    type_code: int = wire.DEFAULT_ATTRIBUTE_TYPE,
    verify: Verify = not_checked,
) -> Iterator[Finding]:
    """Every UPDATE attribute of `type_code`, decoded and checked per announced prefix."""
    for msg in messages:
        if msg.kind != UPDATE:
            continue
        try:
            update = parse_update(msg.data)
        except wire.CodecError as exc:
            yield Finding(msg.time, msg.peer, None, None, None, None, exc, Check("malformed"))
            continue
        for attr in update.attributes:
            if attr.type_code != type_code:
                continue
            try:
                check_attribute_header(msg.data, attr)
                adv: wire.Advertisement | None = wire.decode(attr.value)
                error = None
            except wire.CodecError as exc:
                adv, error = None, exc
            prefixes: list[IPv4Network | None] = list(update.nlri) or [None]
            for prefix in prefixes:
                if error is not None:
                    check = Check("malformed", str(error))
                else:
                    check = verify(attr.value, prefix, msg.time)
                yield Finding(
                    msg.time, msg.peer, prefix, attr.flags, len(attr.value), adv, error, check
                )


def inspect_capture(
    source: str | Path | IO[bytes],
    type_code: int = wire.DEFAULT_ATTRIBUTE_TYPE,
    verify: Verify = not_checked,
    streams: BGPStreams | None = None,
) -> Iterator[Finding]:
    """`findings` of a capture file or stream (problems framing it land in `streams`,
    a truncated or corrupt file in `streams.capture_notes`)."""
    notes = streams.capture_notes if streams is not None else None
    return findings(bgp_messages(segments(source, notes), streams), type_code, verify)


# ---- live ------------------------------------------------------------------------------


def live_capture(interface: str, netns: str | None = None) -> subprocess.Popen[bytes]:
    """tcpdump writing a pcap stream of BGP on `interface` (inside `netns`) to its stdout.

    The caller reads `proc.stdout` (e.g. with `inspect_capture`), drains `proc.stderr`
    (tcpdump's "listening on" line says when the capture is open) and stops the process.
    """
    argv = ["tcpdump", "-i", interface, "--immediate-mode", "-U", "-Z", "root", "-w", "-"]
    argv.append("tcp port 179")
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )

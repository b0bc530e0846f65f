"""Open a capture (pcap or pcapng, plain or gzip-compressed) and hand on only whole records.

Strategy: scapy's readers end quietly wherever a file stops making sense (a pcapng
block cut short, a gzip stream without its end, a block whose two length fields
disagree) and report it as the end of the file, so a damaged capture looked like a
shorter one. `WholeRecords` sits between the file and scapy: a read-only stream that
frames the capture itself (the 24-byte pcap file header and each 16-byte record header
with its data; or each pcapng block: type, total length, body, total length again) and
passes a record on only once all of it is there and its lengths agree. Where the input
ends early or goes wrong, the stream ends cleanly after the last whole record and
`damage` says what happened and where: the byte offset in the capture and the packet
record number. A gzip file is decompressed here (`Gunzip`: our own header parse, raw
deflate, the CRC-32 and size trailer checked by us), so that a stream cut inside its
compressed data, a missing trailer, a wrong CRC and bytes that are not deflate are told
apart instead of all looking like an end of file.

Two outcomes for bad input: `CaptureFileError` when not even the capture's magic number
can be read (not a capture at all, an empty file, gzip data broken before the first
four bytes of the capture), `damage` (a `Damage`, "truncated" or "corrupt") once the
capture has begun. Nothing here imports scapy.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import IO, NoReturn

PCAP_MAGIC = {  # magic number -> byte order (micro- and nanosecond variants)
    b"\xa1\xb2\xc3\xd4": ">",
    b"\xd4\xc3\xb2\xa1": "<",
    b"\xa1\xb2\x3c\x4d": ">",
    b"\x4d\x3c\xb2\xa1": "<",
}
PCAP_HEADER_LEN = 24
PCAP_RECORD_HEADER_LEN = 16
MAX_CAPLEN = 262144  # libpcap's largest snapshot length: a record claiming more is corrupt

SHB_TYPE = 0x0A0D0D0A  # the same bytes in either byte order
SHB_BYTE_ORDER = {b"\x1a\x2b\x3c\x4d": ">", b"\x4d\x3c\x2b\x1a": "<"}
SHB_MIN_LEN = 28
MAX_BLOCK_LEN = 16 * 1024 * 1024  # libpcap's and Wireshark's limit for one pcapng block
PACKET_BLOCKS = {2: "packet block", 3: "simple packet block", 6: "enhanced packet block"}
BLOCK_NAMES = {
    SHB_TYPE: "section header block",
    1: "interface description block",
    5: "interface statistics block",
    **PACKET_BLOCKS,
}

GZIP_MAGIC = b"\x1f\x8b"
GZIP_CHUNK = 16 * 1024  # compressed bytes fed to zlib at a time
GZIP_OUT = 64 * 1024  # decompressed bytes made at a time (scapy reads a record at a time)
GZIP_PIECE = 64  # ...and after an error, to place it (and keep what precedes it)
GZIP_MAX_FIELD = 64 * 1024  # a header's file name or comment longer than this is corrupt


class CaptureFileError(ValueError):
    """The input cannot be read as a capture at all (nothing of it can be shown). The
    message completes "FILE is ...": "an empty file, not a pcap or pcapng capture"."""


@dataclasses.dataclass(frozen=True, slots=True)
class Damage:
    """What is wrong with a capture that was read up to some point, and where."""

    kind: str  # "truncated" (the input ends early) or "corrupt" (its bytes are wrong)
    text: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


# ---- gzip (RFC 1952) -------------------------------------------------------------------


class _GzipStop(Exception):
    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind, self.text = kind, text


class Gunzip:
    """A gzip file decompressed as it is read, members one after another (RFC 1952 2.2).

    `read(n)` gives up to n bytes, fewer only at the end; when the end is not a clean
    one, `damage` says why and `read` then returns b"" for good. Zero bytes after the
    last member are padding (the gzip module accepts them too); anything else is not."""

    def __init__(self, raw: IO[bytes], head: bytes = b"") -> None:
        self._raw = raw
        self._read1 = getattr(raw, "read1", raw.read)  # a pipe: what is there, not a full chunk
        self._in = bytearray(head)  # compressed bytes not yet used
        self._pos = 0  # file offset of self._in[0]
        self._out = bytearray()
        self._inflate: zlib._Decompress | None = None
        self._crc = self._size = 0  # of the current member's data
        self._total = 0  # capture bytes decompressed, over all members
        self._members = 0
        self._done = False
        self.damage: Damage | None = None

    def read(self, n: int) -> bytes:
        while len(self._out) < n and not self._done:
            try:
                self._step(max(n - len(self._out), GZIP_OUT))
            except _GzipStop as stop:
                self._done = True
                if stop.kind:
                    self.damage = Damage(stop.kind, stop.text)
        data = bytes(self._out[:n])
        del self._out[:n]
        return data

    def _pull(self) -> bool:
        chunk = self._read1(GZIP_CHUNK)
        self._in += chunk
        return bool(chunk)

    def _need(self, count: int) -> bool:
        while len(self._in) < count:
            if not self._pull():
                return False
        return True

    def _use(self, count: int) -> None:
        del self._in[:count]
        self._pos += count

    def _step(self, want: int) -> None:
        if self._inflate is None:
            self._start_member()
            return
        if not self._in and not self._pull():
            raise _GzipStop(
                "truncated",
                f"the gzip file ends at byte {self._pos} inside its compressed data, after "
                f"{self._total} bytes of capture",
            )
        data = bytes(self._in)
        saved = self._inflate.copy()
        try:
            out = self._inflate.decompress(data, want)
        except zlib.error:
            self._salvage(saved, data)
        self._crc = zlib.crc32(out, self._crc)
        self._size += len(out)
        self._total += len(out)
        self._out += out
        left = self._inflate.unused_data if self._inflate.eof else self._inflate.unconsumed_tail
        self._use(len(data) - len(left))
        if self._inflate.eof:
            self._inflate = None
            self._end_member()

    def _salvage(self, inflate: zlib._Decompress, data: bytes) -> NoReturn:
        """Deflate data that does not decompress: feed it again in small pieces, keep
        what comes out before the bad piece and say where it is."""
        for at in range(0, len(data), GZIP_PIECE):
            try:
                out = inflate.decompress(data[at : at + GZIP_PIECE])
            except zlib.error as exc:
                why = str(exc).split(": ", 1)[-1]
                start = self._pos + at
                raise _GzipStop(
                    "corrupt",
                    f"the gzip file's compressed data stops being valid deflate within bytes "
                    f"{start}-{start + GZIP_PIECE} ({why}), after {self._total} bytes "
                    "of capture",
                ) from None
            self._crc = zlib.crc32(out, self._crc)
            self._size += len(out)
            self._total += len(out)
            self._out += out
            if inflate.eof:  # cannot be: the same bytes failed whole
                break
        raise _GzipStop("corrupt", f"the gzip data from byte {self._pos} does not decompress")

    def _start_member(self) -> None:
        """Parse a member's header (RFC 1952 2.3.1)."""
        at = self._pos
        what = "the gzip header" if self._members == 0 else "the header of the gzip member"

        def bad(kind: str, why: str) -> _GzipStop:
            return _GzipStop(kind, f"{what} at byte {at}: {why}")

        if not self._need(10):
            raise bad("truncated", f"the file ends inside it ({len(self._in)} of 10 bytes)")
        head = bytes(self._in[:10])
        if head[:2] != GZIP_MAGIC:
            raise bad("corrupt", "no gzip magic number")
        if head[2] != 8:
            raise bad("corrupt", f"compression method {head[2]}, not deflate (8)")
        flags = head[3]
        if flags & 0xE0:
            raise bad("corrupt", f"reserved flag bits set ({flags:#04x})")
        end = 10
        if flags & 0x04:  # FEXTRA: two-byte length, then that many bytes
            if not self._need(end + 2):
                raise bad("truncated", "the file ends inside its extra field")
            end += 2 + int.from_bytes(self._in[end : end + 2], "little")
            if not self._need(end):
                raise bad("truncated", "the file ends inside its extra field")
        for bit, field in ((0x08, "file name"), (0x10, "comment")):
            if flags & bit:  # zero-terminated
                while (zero := self._in.find(0, end, end + GZIP_MAX_FIELD)) < 0:
                    if len(self._in) >= end + GZIP_MAX_FIELD:
                        raise bad("corrupt", f"its {field} has no end in {GZIP_MAX_FIELD} bytes")
                    if not self._pull():
                        raise bad("truncated", f"the file ends inside its {field}")
                end = zero + 1
        if flags & 0x02:  # FHCRC
            end += 2
            if not self._need(end):
                raise bad("truncated", "the file ends inside its header CRC")
        self._use(end)
        self._members += 1
        self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        self._crc = self._size = 0

    def _end_member(self) -> None:
        """Check the trailer (CRC-32 and size of the data, RFC 1952 2.3.1), then what
        follows: another member, zero padding or the end."""
        at = self._pos
        if not self._need(8):
            have = len(self._in)
            raise _GzipStop(
                "truncated",
                f"the gzip file ends at byte {at + have} inside its trailer ({have} of the 8 "
                "bytes of CRC-32 and size there), so the data cannot be checked",
            )
        crc, size = struct.unpack("<II", self._in[:8])
        if crc != self._crc:
            raise _GzipStop(
                "corrupt",
                f"the gzip CRC-32 check fails (the trailer at byte {at} says {crc:#010x}, "
                f"the data gives {self._crc:#010x}), so the capture read may be damaged",
            )
        if size != self._size % (1 << 32):
            raise _GzipStop(
                "corrupt",
                f"the gzip trailer at byte {at} gives the size as {size} bytes, the data "
                f"is {self._size}",
            )
        self._use(8)
        if not self._need(2) and not self._in.strip(b"\0"):
            raise _GzipStop("", "")  # the end, clean
        if self._in[:2] == GZIP_MAGIC:
            return  # another member; its header on the next step
        while not self._in.strip(b"\0"):
            self._use(len(self._in))
            if not self._pull():
                raise _GzipStop("", "")
        junk = self._pos + len(self._in) - len(self._in.lstrip(b"\0"))
        raise _GzipStop(
            "corrupt", f"the bytes from {junk} on, after the end of the gzip data, are not gzip"
        )


# ---- framing ----------------------------------------------------------------------------


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class WholeRecords:
    """A pcap or pcapng capture (from a file or a stream, gzip or not) read as a stream
    of whole records only; see the module docstring. Give it to scapy's reader."""

    def __init__(self, raw: IO[bytes], name: str = "capture") -> None:
        self.name = name
        self._raw = raw
        self._gzip: Gunzip | None = None
        self._ready = bytearray()  # whole records not yet read
        self._ended = False
        self._capture_damage: Damage | None = None
        self.offset = 0  # capture bytes framed so far
        self.packets = 0  # packet records framed so far
        self.blocks = 0  # pcapng blocks framed so far
        self._last = ""  # the last whole record, in words
        self._served = ""  # the record that the last byte read belongs to
        self._bounds: list[tuple[int, str]] = []  # (end in _ready, record) not yet read
        head = raw.read(4)
        if head[:2] == GZIP_MAGIC:
            self._gzip = Gunzip(raw, head)
            head = self._gzip.read(4)
            if len(head) < 4:
                damage = self._gzip.damage
                why = damage.text if damage else "its data holds fewer than 4 bytes"
                raise CaptureFileError(
                    f"a gzip file whose capture cannot be read ({why}; nothing of it can be shown)"
                )
        self._order = PCAP_MAGIC.get(head)
        self._pcapng = head == SHB_TYPE.to_bytes(4, "big")
        if self._order is None and not self._pcapng:
            if not head:
                raise CaptureFileError("an empty file, not a pcap or pcapng capture")
            if self._gzip is not None:
                raise CaptureFileError(
                    f"a gzip file that holds no pcap or pcapng capture (its data starts "
                    f"{head.hex(' ')})"
                )
            raise CaptureFileError(
                f"not a pcap or pcapng capture (it starts {head.hex(' ')}, which is no pcap, "
                "pcapng or gzip magic number)"
            )
        if self._pcapng:
            self._section_header(head, first=True)
        else:
            self._pcap_header(head)

    # -- the stream scapy reads

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self._ready) < n) and not self._ended:
            self._frame_next()
        n = len(self._ready) if n < 0 else min(n, len(self._ready))
        data = bytes(self._ready[:n])
        del self._ready[:n]
        if n:  # which record the last byte read belongs to
            self._served = next(record for end, record in self._bounds if end >= n)
            self._bounds = [(end - n, record) for end, record in self._bounds if end > n]
        return data

    def close(self) -> None:
        self._raw.close()

    @property
    def empty(self) -> bool:
        """Nothing whole to read (the header itself was cut short or wrong)."""
        return self._ended and not self._ready

    # -- what went wrong

    @property
    def damage(self) -> Damage | None:
        gz = self._gzip.damage if self._gzip is not None else None
        cap = self._capture_damage
        if gz is None:
            return cap
        if cap is None:
            shown = f"what was read ({_plural(self.packets, 'whole packet record')}) is shown"
            return Damage(gz.kind, f"{gz.text}; {shown}")
        kind = "corrupt" if "corrupt" in (gz.kind, cap.kind) else "truncated"
        return Damage(kind, f"{gz.text}; {cap.text}")

    def unread(self) -> Damage | None:
        """After the reader stopped: a note if it stopped before the end of the whole
        records (it could not make sense of the one it was reading)."""
        while not self._ready and not self._ended:
            self._frame_next()
        if not self._ready:
            return None
        return Damage(
            "corrupt",
            f"the reader stopped at {self._served or self._last}, whose contents it could "
            "not make sense of; what came before it is shown",
        )

    # -- framing

    def _take(self, n: int) -> bytes:
        if self._gzip is not None:
            return self._gzip.read(n)
        data = self._raw.read(n)
        while 0 < len(data) < n:  # an unbuffered stream may give less than asked
            more = self._raw.read(n - len(data))
            if not more:
                break
            data += more
        return data

    def _emit(self, record: bytes, words: str) -> None:
        self._ready += record
        self._bounds.append((len(self._ready), words))
        self.offset += len(record)
        self._last = words

    def _stop(self, kind: str, text: str) -> None:
        self._ended = True
        if kind:
            self._capture_damage = Damage(kind, text)

    def _shown(self, them: bool = False) -> str:
        if not self.packets:
            return f"no packet record comes before {'them' if them else 'it'}"
        return f"what came before {'them' if them else 'it'} is shown"

    def _frame_next(self) -> None:
        if self._pcapng:
            self._pcapng_block()
        else:
            self._pcap_record()

    def _pcap_header(self, magic: bytes) -> None:
        rest = self._take(PCAP_HEADER_LEN - 4)
        if len(rest) < PCAP_HEADER_LEN - 4:
            self._stop(
                "truncated",
                f"the file ends inside the pcap file header ({4 + len(rest)} of "
                f"{PCAP_HEADER_LEN} bytes there); {self._shown()}",
            )
            return
        self._emit(magic + rest, "the pcap file header")

    def _pcap_record(self) -> None:
        at, number = self.offset, self.packets + 1
        head = self._take(PCAP_RECORD_HEADER_LEN)
        if not head:
            self._stop("", "")
            return
        after = f"packet record {self.packets}" if self.packets else "the pcap file header"
        if len(head) < PCAP_RECORD_HEADER_LEN:
            self._stop(
                "truncated",
                f"the file ends with {len(head)} bytes after {after} that are not a whole "
                f"record (from byte {at}); {self._shown(them=True)}",
            )
            return
        (caplen,) = struct.unpack(self._order + "I", head[8:12])
        if caplen > MAX_CAPLEN:
            self._stop(
                "corrupt",
                f"packet record {number} (at byte {at}) claims {caplen} captured bytes, more "
                f"than the {MAX_CAPLEN} a capture can hold; {self._shown()}",
            )
            return
        data = self._take(caplen)
        if len(data) < caplen:
            have, want = len(head) + len(data), len(head) + caplen
            self._stop(
                "truncated",
                f"packet record {number} (at byte {at}) is cut short (the file ends inside "
                f"it, {have} of {want} bytes there); {self._shown()}",
            )
            return
        self.packets += 1
        self._emit(head + data, f"packet record {number} (at byte {at})")

    def _section_header(self, magic: bytes, first: bool = False) -> None:
        """A section header block (its type already read): the byte order comes from it."""
        at = self.offset
        where = f"the section header block (pcapng block {self.blocks + 1}, at byte {at})"
        head = magic + self._take(8)
        if len(head) < 12:
            self._stop(
                "truncated",
                f"{where} is cut short (the file ends inside it, {len(head)} of at least "
                f"{SHB_MIN_LEN} bytes there); {self._shown()}",
            )
            return
        order = SHB_BYTE_ORDER.get(head[8:12])
        if order is None:
            if first:
                raise CaptureFileError(
                    f"not a pcap or pcapng capture (no byte-order magic in {where})"
                )
            self._stop("corrupt", f"{where} has no byte-order magic; {self._shown()}")
            return
        (length,) = struct.unpack(order + "I", head[4:8])
        if self._bad_length(length, where, SHB_MIN_LEN):
            return
        body = self._whole_block(head, length, where)
        if body is None:
            return
        (major,) = struct.unpack(order + "H", body[12:14])
        if major != 1:
            if first:
                raise CaptureFileError(
                    f"a pcapng capture of version {major}, which is not read (only version 1)"
                )
            self._stop("corrupt", f"{where} is of pcapng version {major}; {self._shown()}")
            return
        self._order = order
        self.blocks += 1
        self._emit(body, f"pcapng block {self.blocks} (section header block, at byte {at})")

    def _pcapng_block(self) -> None:
        at = self.offset
        head = self._take(4)
        if head == SHB_TYPE.to_bytes(4, "big"):
            self._section_header(head)
            return
        if len(head) == 4:
            head += self._take(4)
        if not head:
            self._stop("", "")
            return
        if len(head) < 8:
            self._stop(
                "truncated",
                f"the file ends with {len(head)} bytes after {self._last} that are not a whole "
                f"block header (from byte {at}); {self._shown(them=True)}",
            )
            return
        assert self._order is not None
        kind, length = struct.unpack(self._order + "II", head)
        number = self.blocks + 1
        name = BLOCK_NAMES.get(kind, f"type {kind:#x}")
        if kind in PACKET_BLOCKS:
            where = (
                f"packet record {self.packets + 1} (pcapng block {number}, {name}, at byte {at})"
            )
        else:
            where = f"pcapng block {number} ({name}, at byte {at})"
        if self._bad_length(length, where, 12):
            return
        block = self._whole_block(head, length, where)
        if block is None:
            return
        if kind in (2, 6):  # captured length inside the block (RFC 9707 draft 4.3, 4.5)
            (caplen,) = struct.unpack(self._order + "I", block[20:24]) if length >= 32 else (-1,)
            if not 0 <= caplen <= length - 32:
                self._stop(
                    "corrupt",
                    f"{where} is too short for the captured length it gives "
                    f"({'none' if caplen < 0 else caplen} bytes in a block of {length}); "
                    f"{self._shown()}",
                )
                return
        self.blocks += 1
        self.packets += kind in PACKET_BLOCKS
        self._emit(block, where)

    def _bad_length(self, length: int, where: str, least: int) -> bool:
        if length % 4 == 0 and least <= length <= MAX_BLOCK_LEN:
            return False
        self._stop(
            "corrupt",
            f"{where} gives its length as {length} bytes (a block is a multiple of 4 bytes, "
            f"{least} to {MAX_BLOCK_LEN}); {self._shown()}",
        )
        return True

    def _whole_block(self, head: bytes, length: int, where: str) -> bytes | None:
        """The rest of a block whose first bytes are `head`: the whole block, or None
        (the input ends inside it, or its closing length is not its opening one)."""
        rest = self._take(length - len(head))
        if len(head) + len(rest) < length:
            self._stop(
                "truncated",
                f"{where} is cut short (the file ends inside it, {len(head) + len(rest)} of "
                f"{length} bytes there); {self._shown()}",
            )
            return None
        block = head + rest
        closing = int.from_bytes(block[-4:], "big" if self._order_of(block) == ">" else "little")
        if closing != length:
            self._stop(
                "corrupt",
                f"{where}: its two length fields disagree ({length} at the start, {closing} "
                f"at the end); {self._shown()}",
            )
            return None
        return block

    def _order_of(self, block: bytes) -> str:
        if block[:4] == SHB_TYPE.to_bytes(4, "big"):
            return SHB_BYTE_ORDER[block[8:12]]
        assert self._order is not None
        return self._order

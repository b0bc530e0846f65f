"""Frames of the block-transfer protocol, and an incremental frame reader.

Every frame is::

    0                   1                   2                   3
    0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
   +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
   |  frame type   |                 body length (u32) ...
   +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
   ...             |  body (length bytes) ...
   +-+-+-+-+-+-+-+-+

all integers big-endian. Bodies (docs/transfer.md has the full table):

    PULL     1  transfer_id u64 | holder_epoch u64 | start u32 | rate_bps u64 | key u64 ...
    ACCEPT   2  transfer_id u64 | holder_epoch u64 | start u32 | count u32
    BLOCK    3  index u32 | key u64 | size u32 | digest (32)
    DATA     4  payload bytes of the current block (a chunk)
    EVICTED  5  index u32 | key u64
    DONE     6  transfer_id u64 | end u32
    CANCEL   7  code u16 | reason (UTF-8)
    REFUSE   8  code u16 | reason (UTF-8)

Each frame type is one immutable dataclass with `encode_body` and `decode_body`; the
registry `FRAME_TYPES` maps codes to classes (registering a code twice raises). Decoding
a body must consume it whole. `FrameReader` takes bytes in any split and returns whole
frames; anything malformed raises `FrameError` with the stream offset of the frame.
`frame_fields` lists a body's fields with their octets, for printing (the test vectors
in tests/vectors/transfer.json and the draft's appendix).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from catsproto.transfer.codes import FrameType, frame_name
from catsproto.transfer.errors import FrameError

HEADER = struct.Struct(">BI")
HEADER_LEN = HEADER.size
DIGEST_LEN = 32
MAX_BODY = 1 << 20  # 1 MiB: DATA chunks are at most this; PULL carries at most ~131k keys
MAX_KEYS = (MAX_BODY - 28) // 8
MAX_REASON = 1024  # reason octets a CANCEL or REFUSE of ours carries; we read any length


class Code(enum.IntEnum):
    """Why a transfer was cancelled or refused."""

    CANCELLED = 1  # the puller (or holder) gave up; nothing wrong with the stream
    BAD_REQUEST = 2
    TOO_LARGE = 3
    SHUTTING_DOWN = 4
    VERIFY_FAILED = 5  # the puller refused a block (digest, order, size)
    NOT_AUTHORISED = 6


class Frame(Protocol):
    TYPE: ClassVar[FrameType]

    def encode_body(self) -> bytes: ...


_PULL = struct.Struct(">QQIQ")
_ACCEPT = struct.Struct(">QQII")
_BLOCK = struct.Struct(">IQI32s")
_EVICTED = struct.Struct(">IQ")
_DONE = struct.Struct(">QI")
_CODE = struct.Struct(">H")
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def _fixed(s: struct.Struct, body: bytes, name: str) -> tuple:
    if len(body) != s.size:
        raise FrameError(f"{name} body is {len(body)} bytes, not {s.size}")
    return s.unpack(body)


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask for blocks `keys[start:]` of the prefix `keys` (prefix order)."""

    TYPE: ClassVar[FrameType] = FrameType.PULL
    transfer_id: int
    holder_epoch: int  # the epoch the puller's staged blocks came from; 0: none
    start: int  # index of the first block wanted (resumption point)
    rate_bps: int  # the puller's bandwidth budget in bytes/s; 0: the holder's own
    keys: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise FrameError("pull: at least one key")
        if len(self.keys) > MAX_KEYS:
            raise FrameError(f"pull: {len(self.keys)} keys, at most {MAX_KEYS}")
        if not 0 <= self.start <= len(self.keys):
            raise FrameError(f"pull: start {self.start} outside 0..{len(self.keys)}")
        for name in ("transfer_id", "holder_epoch", "rate_bps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= _U64:
                raise FrameError(f"pull: {name} outside u64")

    def encode_body(self) -> bytes:
        head = _PULL.pack(self.transfer_id, self.holder_epoch, self.start, self.rate_bps)
        return head + struct.pack(f">{len(self.keys)}Q", *self.keys)

    @classmethod
    def decode_body(cls, body: bytes) -> Pull:
        if len(body) < _PULL.size or (len(body) - _PULL.size) % 8:
            raise FrameError(f"pull body of {len(body)} bytes is not 28 + 8 × keys")
        tid, epoch, start, rate = _PULL.unpack_from(body)
        n = (len(body) - _PULL.size) // 8
        keys = struct.unpack_from(f">{n}Q", body, _PULL.size)
        return cls(tid, epoch, start, rate, keys)


@dataclass(frozen=True, slots=True)
class Accept:
    """The holder takes the pull: its epoch, and where it really starts (0 after a restart)."""

    TYPE: ClassVar[FrameType] = FrameType.ACCEPT
    transfer_id: int
    holder_epoch: int
    start: int
    count: int  # how many keys the pull named

    def encode_body(self) -> bytes:
        return _ACCEPT.pack(self.transfer_id, self.holder_epoch, self.start, self.count)

    @classmethod
    def decode_body(cls, body: bytes) -> Accept:
        return cls(*_fixed(_ACCEPT, body, "accept"))


@dataclass(frozen=True, slots=True)
class Block:
    """Header of block `index`: its key, payload size and SHA-256 content digest."""

    TYPE: ClassVar[FrameType] = FrameType.BLOCK
    index: int
    key: int
    size: int
    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_LEN:
            raise FrameError(f"block digest is {len(self.digest)} bytes, not {DIGEST_LEN}")

    def encode_body(self) -> bytes:
        return _BLOCK.pack(self.index, self.key, self.size, self.digest)

    @classmethod
    def decode_body(cls, body: bytes) -> Block:
        return cls(*_fixed(_BLOCK, body, "block"))


@dataclass(frozen=True, slots=True)
class Data:
    """A chunk of the current block's payload."""

    TYPE: ClassVar[FrameType] = FrameType.DATA
    chunk: bytes | memoryview

    def __post_init__(self) -> None:
        if not len(self.chunk):
            raise FrameError("data: empty chunk")

    def encode_body(self) -> bytes:
        return bytes(self.chunk)

    @classmethod
    def decode_body(cls, body: bytes) -> Data:
        return cls(body)


@dataclass(frozen=True, slots=True)
class Evicted:
    """The holder no longer has block `index`: it and everything after are not sent."""

    TYPE: ClassVar[FrameType] = FrameType.EVICTED
    index: int
    key: int

    def encode_body(self) -> bytes:
        return _EVICTED.pack(self.index, self.key)

    @classmethod
    def decode_body(cls, body: bytes) -> Evicted:
        return cls(*_fixed(_EVICTED, body, "evicted"))


@dataclass(frozen=True, slots=True)
class Done:
    """The holder sent everything it will send; `end` is one past the last block sent."""

    TYPE: ClassVar[FrameType] = FrameType.DONE
    transfer_id: int
    end: int

    def encode_body(self) -> bytes:
        return _DONE.pack(self.transfer_id, self.end)

    @classmethod
    def decode_body(cls, body: bytes) -> Done:
        return cls(*_fixed(_DONE, body, "done"))


def reason_octets(reason: str) -> bytes:
    """A reason's UTF-8, cut to at most MAX_REASON octets at a character boundary (a cut
    inside a character would make the peer refuse the whole frame as not UTF-8)."""
    raw = reason.encode("utf-8")
    if len(raw) <= MAX_REASON:
        return raw
    return raw[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")


@dataclass(frozen=True, slots=True)
class _Coded:
    code: int
    reason: str = ""

    def encode_body(self) -> bytes:
        return _CODE.pack(self.code) + reason_octets(self.reason)

    @classmethod
    def _decode(cls, body: bytes, name: str) -> tuple[int, str]:
        if len(body) < _CODE.size:
            raise FrameError(f"{name} body of {len(body)} bytes lacks its code")
        (code,) = _CODE.unpack_from(body)
        try:
            return code, body[_CODE.size :].decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError(f"{name} reason is not UTF-8") from None


@dataclass(frozen=True, slots=True)
class Cancel(_Coded):
    TYPE: ClassVar[FrameType] = FrameType.CANCEL

    @classmethod
    def decode_body(cls, body: bytes) -> Cancel:
        return cls(*cls._decode(body, "cancel"))


@dataclass(frozen=True, slots=True)
class Refuse(_Coded):
    TYPE: ClassVar[FrameType] = FrameType.REFUSE

    @classmethod
    def decode_body(cls, body: bytes) -> Refuse:
        return cls(*cls._decode(body, "refuse"))


AnyFrame = Pull | Accept | Block | Data | Evicted | Done | Cancel | Refuse

FRAME_TYPES: dict[int, type] = {}


def register(cls: type) -> type:
    code = int(cls.TYPE)  # type: ignore[attr-defined]
    if code in FRAME_TYPES:
        raise ValueError(f"frame type {code} registered twice")
    FRAME_TYPES[code] = cls
    return cls


for _cls in (Pull, Accept, Block, Data, Evicted, Done, Cancel, Refuse):
    register(_cls)


class FrameField(NamedTuple):
    """One field of a frame body: its name, its value and its octets on the wire."""

    name: str
    value: int | str | bytes
    raw: bytes


# The fixed part of each body, in wire order: (field, struct format). What follows it is
# the keys of a PULL, the payload of a DATA, the reason of a CANCEL or REFUSE.
_FIELD_LAYOUT: dict[type, tuple[tuple[str, str], ...]] = {
    Pull: (("transfer_id", "Q"), ("holder_epoch", "Q"), ("start", "I"), ("rate_bps", "Q")),
    Accept: (("transfer_id", "Q"), ("holder_epoch", "Q"), ("start", "I"), ("count", "I")),
    Block: (("index", "I"), ("key", "Q"), ("size", "I"), ("digest", "32s")),
    Data: (),
    Evicted: (("index", "I"), ("key", "Q")),
    Done: (("transfer_id", "Q"), ("end", "I")),
    Cancel: (("code", "H"),),
    Refuse: (("code", "H"),),
}


def frame_fields(frame: AnyFrame) -> list[FrameField]:
    """The fields of `frame`'s body in wire order, each with its value and octets; the
    octets add up to `encode_body()`. PULL keys are `keys[0]`, `keys[1]`, ...; a reason
    is the one sent (cut by `reason_octets`), not necessarily the one given."""
    fields = []
    for name, fmt in _FIELD_LAYOUT[type(frame)]:
        value = getattr(frame, name)
        fields.append(FrameField(name, value, struct.pack(">" + fmt, value)))
    if isinstance(frame, Pull):
        fields += [
            FrameField(f"keys[{i}]", k, struct.pack(">Q", k)) for i, k in enumerate(frame.keys)
        ]
    elif isinstance(frame, Data):
        chunk = bytes(frame.chunk)
        fields.append(FrameField("payload", chunk, chunk))
    elif isinstance(frame, Cancel | Refuse):
        raw = reason_octets(frame.reason)
        fields.append(FrameField("reason", raw.decode("utf-8"), raw))
    return fields


def encode(frame: AnyFrame) -> bytes:
    """One frame on the wire: type, length, body."""
    body = frame.encode_body()
    if len(body) > MAX_BODY:
        raise FrameError(f"{frame_name(frame.TYPE)} body of {len(body)} bytes over {MAX_BODY}")
    return HEADER.pack(frame.TYPE, len(body)) + body


def encode_data(chunk: bytes | memoryview) -> list[bytes | memoryview]:
    """A DATA frame as (header, chunk), so a sender can write the chunk without a copy."""
    if not 0 < len(chunk) <= MAX_BODY:
        raise FrameError(f"data chunk of {len(chunk)} bytes outside 1..{MAX_BODY}")
    return [HEADER.pack(FrameType.DATA, len(chunk)), chunk]


class FrameReader:
    """Bytes in (any split), whole frames out, except DATA, which comes out in *pieces*.

    A DATA body is handed on as it arrives, as `Data` frames whose chunks are zero-copy
    views of the bytes fed in (so a 256 KiB chunk split over sixteen TLS records costs
    no reassembly copy); the pieces of one DATA frame add up to its length exactly.
    Every other frame is returned whole. Offsets in errors count from the first byte
    ever fed.
    """

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self._pending = bytearray()  # a partial header or non-DATA frame
        self._data_left = 0  # body bytes of the current DATA frame still to come
        self._frame_at = 0  # stream offset of the frame being read
        self.received = 0  # bytes fed so far
        self.max_body = max_body

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, AnyFrame]]:
        """Feed `data`; return every frame (or DATA piece) now complete, each with the
        stream offset of its frame. Views into `data` are returned, so a caller that
        reuses its buffer must pass a copy (bytes are kept as they are)."""
        if not isinstance(data, bytes):
            data = bytes(data)
        mv = memoryview(data)
        out: list[tuple[int, AnyFrame]] = []
        pos, end, pending = 0, len(data), self._pending
        while pos < end:
            if self._data_left:
                n = min(self._data_left, end - pos)
                out.append((self._frame_at, Data(mv[pos : pos + n])))
                pos += n
                self._data_left -= n
                continue
            if len(pending) < HEADER_LEN:
                take = min(HEADER_LEN - len(pending), end - pos)
                pending += mv[pos : pos + take]
                pos += take
                if len(pending) < HEADER_LEN:
                    break
                self._frame_at = self.received + pos - HEADER_LEN
                code, length = HEADER.unpack_from(pending)
                if code not in FRAME_TYPES:
                    raise FrameError(f"unknown frame type {code}", self._frame_at)
                if length > self.max_body:
                    raise FrameError(
                        f"length {length} over the limit of {self.max_body}", self._frame_at, code
                    )
                if code == FrameType.DATA:
                    if length == 0:
                        raise FrameError("data: empty chunk", self._frame_at, code)
                    pending.clear()
                    self._data_left = length
                    continue
            code, length = HEADER.unpack_from(pending)
            take = min(length - (len(pending) - HEADER_LEN), end - pos)
            pending += mv[pos : pos + take]
            pos += take
            if len(pending) - HEADER_LEN == length:
                body = bytes(pending[HEADER_LEN:])
                pending.clear()
                try:
                    frame = FRAME_TYPES[code].decode_body(body)
                except FrameError as exc:
                    raise exc.located(self._frame_at, code) from None
                out.append((self._frame_at, frame))
        self.received += end
        return out

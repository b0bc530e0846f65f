"""The holder's side of a block transfer: a sans-IO state machine.

Strategy: the holder answers one PULL per stream. `receive(bytes)` parses what the
puller sent (the PULL, later perhaps a CANCEL); `send(now)` returns the next bytes to
write, as many as the bandwidth budget allows at `now` (a `TokenBucket` at the lower of
the holder's rate and the puller's `rate_bps`), and `next_send_at(now)` says when to
call again. Blocks are looked up only when their turn comes, through `lookup(key)`, so
an eviction that happens while earlier blocks are in flight is answered honestly with
EVICTED for that block (and nothing after it: a KV prefix is useless past a gap). A
block once started is sent whole from the snapshot taken at lookup: the puller never
sees half of an old block and half of a new one. A resumption from another epoch of
this holder (the puller names the epoch its staged blocks came from) starts over at 0.
A PULL asking a rate under the holder's floor (`min_rate_bps`) is refused with
BAD_REQUEST: a puller must not hold the holder's connection for days at 1 byte/s.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from catsproto.transfer.content import StoredBlock
from catsproto.transfer.errors import ProtocolViolationError, TransferError
from catsproto.transfer.frames import (
    HEADER_LEN,
    MAX_BODY,
    Accept,
    Block,
    Cancel,
    Code,
    Done,
    Evicted,
    FrameReader,
    Pull,
    Refuse,
    encode,
    encode_data,
)
from catsproto.transfer.pacing import TokenBucket

DEFAULT_CHUNK = 256 << 10
MIN_PIECE = 16 << 10  # under this much credit, wait rather than send a tiny frame

Lookup = Callable[[int], StoredBlock | None]


class HolderState(enum.Enum):
    AWAIT_PULL = "await-pull"
    STREAMING = "streaming"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class PullReceived:
    pull: Pull
    start: int  # where the holder starts (the pull's start, or 0 after an epoch change)


@dataclass(frozen=True, slots=True)
class PeerCancelled:
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class SentEvicted:
    index: int
    key: int


HolderEvent = PullReceived | PeerCancelled


class Holder:
    """Serves one pull from `lookup`; see the module docstring."""

    def __init__(
        self,
        lookup: Lookup,
        epoch: int,
        *,
        chunk: int = DEFAULT_CHUNK,
        rate_bps: float = 0,
        burst_bytes: float | None = None,
        max_keys: int | None = None,
        min_rate_bps: float = 0,
    ) -> None:
        """burst_bytes: the bucket's depth (default two chunks or 2 ms at the rate);
        a modelled link uses one chunk, so the model is not faster than its bandwidth.
        min_rate_bps: the lowest rate a PULL may ask (0: any); 0 in a PULL means unpaced
        and is always allowed."""
        if not 0 < chunk <= MAX_BODY:
            raise ValueError(f"chunk must be 1..{MAX_BODY} bytes")
        if epoch <= 0:
            raise ValueError("holder epoch must be > 0 (0 means 'none' on the wire)")
        if not 0 <= min_rate_bps < 2**64:  # also refuses NaN
            raise ValueError(f"min_rate_bps {min_rate_bps} is not 0 (none)..2^64-1 bytes/s")
        self.lookup = lookup
        self.epoch = epoch
        self.chunk = chunk
        self.rate_bps = rate_bps
        self.max_keys = max_keys
        self.min_rate_bps = min_rate_bps
        self.burst_bytes = burst_bytes
        self.state = HolderState.AWAIT_PULL
        self.pull: Pull | None = None
        self.evicted: SentEvicted | None = None
        self.refusal: Refuse | None = None  # the REFUSE answered to the PULL, if any
        self.payload_bytes_due = 0  # payload of every block begun (looked up) so far
        self.blocks_sent = 0
        self.payload_bytes_sent = 0
        self._reader = FrameReader()
        self._out: list[bytes | memoryview] = []  # control frames waiting to go
        self._bucket: TokenBucket | None = None
        self._index = 0
        self._current: StoredBlock | None = None
        self._offset = 0

    # ---- incoming ----------------------------------------------------------------------

    def receive(self, data: bytes | memoryview) -> list[HolderEvent]:
        events: list[HolderEvent] = []
        for offset, frame in self._reader.feed(data):
            try:
                if isinstance(frame, Cancel):
                    self._current = None
                    self._out.clear()
                    self.state = HolderState.CANCELLED
                    events.append(PeerCancelled(frame.code, frame.reason))
                elif isinstance(frame, Pull) and self.state is HolderState.AWAIT_PULL:
                    events.append(self._on_pull(frame))
                elif self.state is HolderState.CANCELLED:
                    continue
                else:
                    raise ProtocolViolationError(
                        f"{frame.TYPE.name.lower()} frame in holder state {self.state.value}"
                    )
            except TransferError as exc:
                raise exc.located(offset, int(frame.TYPE)) from None
        return events

    def _on_pull(self, p: Pull) -> PullReceived:
        self.pull = p
        if self.max_keys is not None and len(p.keys) > self.max_keys:
            return self._refuse(p, Code.TOO_LARGE, f"{len(p.keys)} keys, at most {self.max_keys}")
        if 0 < p.rate_bps < self.min_rate_bps:
            return self._refuse(
                p,
                Code.BAD_REQUEST,
                f"rate_bps {p.rate_bps} is under this holder's floor of "
                f"{self.min_rate_bps:.15g} bytes/s (0: unpaced)",
            )
        start = p.start
        if p.start and p.holder_epoch != self.epoch:
            start = 0  # the staged blocks came from another life of this holder
        rates = [r for r in (self.rate_bps, p.rate_bps) if r > 0]
        if rates:
            frame = self.chunk + HEADER_LEN
            if self.burst_bytes is None:
                self._bucket = TokenBucket.for_rate(min(rates), frame)
            else:
                self._bucket = TokenBucket(min(rates), max(self.burst_bytes, frame))
        self._index = start
        self._out.append(encode(Accept(p.transfer_id, self.epoch, start, len(p.keys))))
        self.state = HolderState.STREAMING
        return PullReceived(p, start)

    def _refuse(self, p: Pull, code: Code, reason: str) -> PullReceived:
        self.refusal = Refuse(code, reason)
        self._out.append(encode(self.refusal))
        self.state = HolderState.FINISHED
        return PullReceived(p, 0)

    # ---- outgoing ----------------------------------------------------------------------

    def cancel(self, reason: str = "", code: int = Code.SHUTTING_DOWN) -> bytes:
        """Stop serving: the CANCEL frame to write (the puller keeps what it verified)."""
        self._current = None
        self._out.clear()
        self.state = HolderState.CANCELLED
        return encode(Cancel(code, reason))

    @property
    def finished(self) -> bool:
        """Nothing more will be sent (after the bytes of the last `send`)."""
        return self.state in (HolderState.FINISHED, HolderState.CANCELLED) and not self._out

    def send(self, now: float, limit: int | None = None) -> bytes:
        """Bytes to write at `now`: pending control frames plus as much block data as
        the budget allows (and at most about `limit` bytes). b"" means wait until
        `next_send_at(now)` (or for a PULL)."""
        out = self._out
        self._out = []
        size = sum(len(b) for b in out)
        while self.state is HolderState.STREAMING and (limit is None or size < limit):
            if self._current is None:
                frame = self._next_block()
                out.append(frame)
                size += len(frame)
                self._charge(len(frame), now)
                continue
            remaining = len(self._current.payload) - self._offset
            n = min(self.chunk, remaining)
            if limit is not None:
                n = min(n, max(limit - size, MIN_PIECE))
            if self._bucket is not None:
                credit = self._bucket.available(now) - HEADER_LEN
                if credit < min(n, MIN_PIECE) - 0.5:  # half a byte: float residue
                    break
                n = min(n, max(1, int(credit + 0.5)))
            view = memoryview(self._current.payload)[self._offset : self._offset + n]
            out.extend(encode_data(view))
            size += HEADER_LEN + n
            self._charge(HEADER_LEN + n, now)
            self._offset += n
            self.payload_bytes_sent += n
            if self._offset == len(self._current.payload):
                self._current = None
                self._index += 1
                self.blocks_sent += 1
        return b"".join(out)

    def next_send_at(self, now: float) -> float | None:
        """When `send` will have something again; None: only after new input, or never."""
        if self._out:
            return now
        if self.state is not HolderState.STREAMING:
            return None
        if self._bucket is None or self._current is None:
            return now
        remaining = len(self._current.payload) - self._offset
        return self._bucket.ready_at(HEADER_LEN + min(self.chunk, remaining, MIN_PIECE), now)

    def _charge(self, n: int, now: float) -> None:
        if self._bucket is not None:
            self._bucket.take(n, now)

    def _next_block(self) -> bytes:
        p = self.pull
        assert p is not None
        i = self._index
        if i == len(p.keys):
            self.state = HolderState.FINISHED
            return encode(Done(p.transfer_id, i))
        key = p.keys[i]
        block = self.lookup(key)
        if block is None or block.key != key:
            self.evicted = SentEvicted(i, key)
            self.state = HolderState.FINISHED
            return encode(Evicted(i, key)) + encode(Done(p.transfer_id, i))
        self._current = block
        self._offset = 0
        self.payload_bytes_due += len(block.payload)
        header = encode(Block(i, key, len(block.payload), block.digest))
        if not block.payload:
            self._current = None
            self._index += 1
            self.blocks_sent += 1
        return header

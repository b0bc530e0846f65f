"""The puller's side of a block transfer: a sans-IO state machine.

Strategy: the puller names a prefix (a run of block keys) and the holder streams the
blocks in prefix order, each as a BLOCK header (index, key, size, digest) followed by
DATA chunks. The puller checks every block as its last chunk arrives — right index,
the key it asked for at that index, exactly `size` bytes, and the digest that binds
payload to key — and only then *stages* it. Staged blocks are never handed out one by
one: the `Completed` event carries the whole verified run, so an adapter that admits
on `Completed` can never admit a half-written or unverified block. Anything wrong
raises a `TransferError` and the puller is `FAILED`; a cut stream is found by
`end_of_stream()`. In both cases `resume_state()` keeps what was verified, and a new
puller built from it asks again from the first block it does not have.

An EVICTED answer ends the transfer early but cleanly: `Completed.recompute_from` is
the first block the caller must compute itself. A holder that restarted (another
epoch) answers a resumption with `start = 0`: its blocks replace the staged ones, they
are never merged with them.

    puller = Puller(transfer_id, keys)
    send(puller.start())
    for data in stream: events += puller.receive(data)
    puller.end_of_stream()            # raises if the holder stopped too early
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from catsproto.transfer.content import StoredBlock, digester
from catsproto.transfer.errors import (
    BlockTooLargeError,
    DigestMismatchError,
    PeerRefusedError,
    ProtocolViolationError,
    TransferError,
    TruncatedTransferError,
)
from catsproto.transfer.frames import (
    Accept,
    AnyFrame,
    Block,
    Cancel,
    Code,
    Data,
    Done,
    Evicted,
    FrameReader,
    FrameType,
    Pull,
    Refuse,
    encode,
)

DEFAULT_MAX_BLOCK = 256 << 20


class PullerState(enum.Enum):
    IDLE = "idle"
    AWAIT_ACCEPT = "await-accept"
    STREAMING = "streaming"  # between blocks
    IN_BLOCK = "in-block"  # DATA of the current block expected
    EVICTED = "evicted"  # after an EVICTED frame: DONE expected
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What a failed or cancelled transfer verified: enough to ask again from there."""

    keys: tuple[int, ...]
    holder_epoch: int
    blocks: tuple[StoredBlock, ...]

    @property
    def next_index(self) -> int:
        return len(self.blocks)


# ---- events --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accepted:
    holder_epoch: int
    start: int
    restarted: bool  # the holder's epoch changed: staged blocks were dropped


@dataclass(frozen=True, slots=True)
class BlockVerified:
    """Progress only: block `index` passed every check and is staged (not admitted)."""

    index: int
    key: int
    size: int


@dataclass(frozen=True, slots=True)
class Completed:
    """The transfer ended cleanly. `blocks` is the verified prefix, ready to admit."""

    blocks: tuple[StoredBlock, ...]
    requested: int
    evicted_at: int | None  # index the holder said it no longer has, if any

    @property
    def recompute_from(self) -> int | None:
        """First block the caller must compute itself, or None if all arrived."""
        return None if len(self.blocks) == self.requested else len(self.blocks)


@dataclass(frozen=True, slots=True)
class Cancelled:
    code: int
    reason: str
    by_peer: bool


PullerEvent = Accepted | BlockVerified | Completed | Cancelled


@dataclass(slots=True)
class _Current:
    header: Block
    received: int = 0
    parts: list[bytes | memoryview] = field(default_factory=list)
    hasher: object = None


class Puller:
    """Pulls `keys` (a prefix, in order) from one holder; see the module docstring."""

    def __init__(
        self,
        transfer_id: int,
        keys: Sequence[int],
        *,
        resume: ResumeState | None = None,
        rate_bps: int = 0,
        max_block_bytes: int = DEFAULT_MAX_BLOCK,
    ) -> None:
        self.transfer_id = transfer_id
        self.keys = tuple(int(k) for k in keys)
        if not self.keys:
            raise ValueError("a pull needs at least one key")
        if resume is not None and resume.keys != self.keys:
            raise ValueError("resume state is for another prefix")
        if max_block_bytes < 0:
            raise ValueError(f"max_block_bytes {max_block_bytes} is not >= 0")
        self.rate_bps = rate_bps
        self.max_block_bytes = max_block_bytes
        self.state = PullerState.IDLE
        self._epoch = resume.holder_epoch if resume else 0
        self._blocks: list[StoredBlock] = list(resume.blocks) if resume else []
        self._reader = FrameReader()
        self._current: _Current | None = None
        self._evicted_at: int | None = None
        self.bytes_received = 0

    # ---- outgoing ----------------------------------------------------------------------

    def start(self) -> bytes:
        """The PULL frame, from the first block not yet verified."""
        if self.state is not PullerState.IDLE:
            raise ProtocolViolationError(f"start() in state {self.state.value}")
        self.state = PullerState.AWAIT_ACCEPT
        return encode(
            Pull(self.transfer_id, self._epoch, len(self._blocks), self.rate_bps, self.keys)
        )

    def cancel(self, reason: str = "", code: int = Code.CANCELLED) -> bytes:
        """Stop: the CANCEL frame to send. Verified blocks stay for `resume_state()`."""
        self._current = None
        if self.state not in (PullerState.COMPLETE, PullerState.FAILED):
            self.state = PullerState.CANCELLED
        return encode(Cancel(code, reason))

    # ---- incoming ----------------------------------------------------------------------

    def receive(self, data: bytes | memoryview) -> list[PullerEvent]:
        """Feed bytes from the holder; returns what happened. Raises `TransferError`."""
        if self.state in (PullerState.CANCELLED, PullerState.COMPLETE):
            return []  # frames in flight after the end are dropped
        if self.state is PullerState.FAILED:
            raise ProtocolViolationError("receive() after the transfer failed")
        if self.state is PullerState.IDLE:
            raise ProtocolViolationError("receive() before start()")
        self.bytes_received += len(data)
        events: list[PullerEvent] = []
        try:
            for offset, frame in self._reader.feed(data):
                try:
                    self._handle(frame, events)
                except TransferError as exc:
                    raise exc.located(offset, int(frame.TYPE)) from None
                if self.state in (PullerState.COMPLETE, PullerState.CANCELLED):
                    break
        except TransferError:
            self._fail()
            raise
        return events

    def end_of_stream(self) -> None:
        """The holder closed the stream. Raises `TruncatedTransferError` unless it ended."""
        if self.state in (PullerState.COMPLETE, PullerState.CANCELLED, PullerState.FAILED):
            return
        at = self._reader.received
        where = ""
        if self._current is not None:
            h = self._current.header
            where = f" inside block {h.index} ({self._current.received} of {h.size} bytes)"
        self._fail()
        raise TruncatedTransferError(
            f"stream ended{where} after {len(self._blocks)} of {len(self.keys)} blocks verified",
            at,
        )

    # ---- results -----------------------------------------------------------------------

    @property
    def verified(self) -> int:
        return len(self._blocks)

    def resume_state(self) -> ResumeState:
        return ResumeState(self.keys, self._epoch, tuple(self._blocks))

    # ---- frame handling -----------------------------------------------------------------

    def _fail(self) -> None:
        self._current = None
        self.state = PullerState.FAILED

    def _handle(self, frame: AnyFrame, events: list[PullerEvent]) -> None:
        if isinstance(frame, Cancel | Refuse):
            kind = "cancelled" if isinstance(frame, Cancel) else "refused"
            if isinstance(frame, Cancel) and frame.code == Code.CANCELLED:
                self._current = None
                self.state = PullerState.CANCELLED
                events.append(Cancelled(frame.code, frame.reason, True))
                return
            raise PeerRefusedError(
                f"holder {kind} the transfer (code {frame.code}): {frame.reason}", code=frame.code
            )
        st = self.state
        if st is PullerState.AWAIT_ACCEPT:
            self._on_accept(self._expect(frame, Accept), events)
        elif st is PullerState.IN_BLOCK:
            self._on_data(self._expect(frame, Data), events)
        elif st is PullerState.STREAMING:
            if isinstance(frame, Block):
                self._on_block(frame, events)
            elif isinstance(frame, Evicted):
                self._on_evicted(frame)
            elif isinstance(frame, Done):
                self._on_done(frame, events)
            else:
                raise ProtocolViolationError(
                    f"{frame.TYPE.name.lower()} frame between blocks (block, evicted or done)"
                )
        elif st is PullerState.EVICTED:
            self._on_done(self._expect(frame, Done), events)

    def _expect(self, frame: AnyFrame, cls: type) -> AnyFrame:
        if not isinstance(frame, cls):
            want = FrameType(cls.TYPE).name.lower()  # type: ignore[attr-defined]
            raise ProtocolViolationError(
                f"{frame.TYPE.name.lower()} frame in state {self.state.value}, expected {want}"
            )
        return frame

    def _on_accept(self, a: Accept, events: list[PullerEvent]) -> None:  # type: ignore[override]
        asked = len(self._blocks)
        if a.transfer_id != self.transfer_id or a.count != len(self.keys):
            raise ProtocolViolationError(
                f"accept for transfer {a.transfer_id} of {a.count} keys, "
                f"asked transfer {self.transfer_id} of {len(self.keys)}"
            )
        restarted = False
        if a.start != asked:
            if a.start != 0:
                raise ProtocolViolationError(f"accept starts at {a.start}, asked {asked} or 0")
            restarted = True  # another holder epoch: its blocks replace ours
            self._blocks.clear()
        self._epoch = a.holder_epoch
        self.state = PullerState.STREAMING
        events.append(Accepted(a.holder_epoch, a.start, restarted))

    def _on_block(self, b: Block, events: list[PullerEvent]) -> None:
        index = len(self._blocks)
        if b.index != index:
            raise ProtocolViolationError(f"block {b.index} out of prefix order, expected {index}")
        if index >= len(self.keys):
            raise ProtocolViolationError(f"block {b.index} beyond the {len(self.keys)} asked")
        if b.key != self.keys[index]:
            raise ProtocolViolationError(
                f"block {index} has key {b.key:016x}, asked {self.keys[index]:016x}"
            )
        if b.size > self.max_block_bytes:
            raise BlockTooLargeError(
                f"block {index} (key {b.key:016x}) announced as {b.size} bytes, over the "
                f"limit of {self.max_block_bytes} (the size expected): refused before its payload"
            )
        self._current = _Current(b, hasher=digester(b.key, b.size))
        self.state = PullerState.IN_BLOCK
        if b.size == 0:
            self._finish_block(events)

    def _on_data(self, d: Data, events: list[PullerEvent]) -> None:  # type: ignore[override]
        cur = self._current
        assert cur is not None
        n = len(d.chunk)
        if cur.received + n > cur.header.size:
            raise ProtocolViolationError(
                f"block {cur.header.index}: {cur.received + n} bytes, announced {cur.header.size}"
            )
        cur.parts.append(d.chunk)  # a view of the bytes fed in: joined once, at the end
        cur.hasher.update(d.chunk)  # type: ignore[attr-defined]
        cur.received += n
        if cur.received == cur.header.size:
            self._finish_block(events)

    def _finish_block(self, events: list[PullerEvent]) -> None:
        cur = self._current
        assert cur is not None
        h = cur.header
        if cur.hasher.digest() != h.digest:  # type: ignore[attr-defined]
            raise DigestMismatchError(
                f"block {h.index} (key {h.key:016x}): digest does not match its payload"
            )
        payload = b"".join(cur.parts)
        self._blocks.append(StoredBlock(h.key, payload, h.digest))
        self._current = None
        self.state = PullerState.STREAMING
        events.append(BlockVerified(h.index, h.key, h.size))

    def _on_evicted(self, e: Evicted) -> None:
        index = len(self._blocks)
        if index >= len(self.keys):  # every block asked is verified: nothing left to evict
            raise ProtocolViolationError(
                f"evicted block {e.index} (key {e.key:016x}) after all {len(self.keys)} "
                "blocks asked were verified"
            )
        if e.index != index or e.key != self.keys[index]:
            raise ProtocolViolationError(
                f"evicted block {e.index} (key {e.key:016x}), expected block {index}"
            )
        self._evicted_at = index
        self.state = PullerState.EVICTED

    def _on_done(self, d: Done, events: list[PullerEvent]) -> None:  # type: ignore[override]
        have = len(self._blocks)
        if d.transfer_id != self.transfer_id or d.end != have:
            raise ProtocolViolationError(
                f"done at block {d.end} of transfer {d.transfer_id}; "
                f"{have} blocks verified in transfer {self.transfer_id}"
            )
        if self._evicted_at is None and have != len(self.keys):
            raise ProtocolViolationError(
                f"done after {have} of {len(self.keys)} blocks without an eviction"
            )
        self.state = PullerState.COMPLETE
        events.append(Completed(tuple(self._blocks), len(self.keys), self._evicted_at))

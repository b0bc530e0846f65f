"""The modelled inference engine: vLLM's KV events from a queue and a tiered cache.

Strategy: `ModelledEngine` stands in for a vLLM engine (FCFS queue, `TieredCache`,
prefill on a scaled clock, every cache change published as vLLM KV events on ZMQ, replay
included), keeps synthetic KV payloads per block, and pulls a prompt's blocks from
another instance before it queues (`KvPuller`, over the authenticated transfer
channel). `catsproto.adapters.instance` explains it with the HTTP face that serves it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import math
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from catsproto.adapters.event_endpoints import (
    PRIVATE_ENDPOINT,
    check_event_endpoint,
    private_event_folder,
)
from catsproto.adapters.metrics import (
    HitCounter,
)
from catsproto.adapters.vllm_events import (
    VllmEventPublisher,
    removed_event,
    stored_event,
)
from catsproto.keys import BlockKeyer
from catsproto.node import (
    BlockEvent,
    BlockEventKind,
    ComputeState,
    TieredCache,
    TierSpec,
)
from catsproto.security import KeyExpiredError, TrustStore
from catsproto.transfer import Outcome, StaleHitLedger, StoredBlock, synthetic_payload
from catsproto.wire import Tier

if TYPE_CHECKING:
    from catsproto.adapters.transfer_tls import PullResult, TransferIdentity


MEDIUM_OF_TIER = {Tier.HBM: "GPU", Tier.DRAM: "CPU", Tier.SSD: "DISK", Tier.REMOTE: "REMOTE"}
_NONE_HASH = bytes(8)
_TOKEN_SPACE = 1 << 31
_EVICTED_MEMORY = 1 << 17  # evicted block hashes remembered, to tell stale from never held
# a million-token context, past any model the lab serves: 131 s of prefill at 8,000 tokens
# per second, where a prompt of unbounded length held the FCFS worker for hours
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20


class PromptError(ValueError):
    """A request body the engine cannot serve."""


class EngineError(RuntimeError):
    """The worker failed on a request (counted; the worker goes on with the next one)."""


def vllm_block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A vLLM-like block hash: the low 64 bits of SHA-256(parent hash ‖ token ids)."""
    h = hashlib.sha256(parent.to_bytes(8, "big") if parent is not None else _NONE_HASH)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest()[-8:], "big")


def mooncake_tokens(hash_id: int, block_size: int) -> list[int]:
    """Synthetic token ids for a Mooncake block (the trace publishes none)."""
    base = hash_id * block_size
    return [(base + j) % _TOKEN_SPACE for j in range(block_size)]


def mooncake_block_keys(keyer: BlockKeyer, hash_ids: Sequence[int]) -> np.ndarray:
    """The block keys of a Mooncake prompt: ``keyer.block_keys`` of the concatenated
    `mooncake_tokens` of its hash ids, chained one block at a time, so memory stays one
    block however many ids a request names (the token list would be ids x block size)."""
    bs = keyer.block_size
    offsets = np.arange(bs, dtype=np.int64)
    keys = np.empty(len(hash_ids), dtype=np.uint64)
    previous = 0
    for i, h in enumerate(hash_ids):
        # (h*bs + j) mod M == ((h*bs mod M) + j) mod M, and both terms stay in int64
        previous = keyer.chain(previous, (offsets + (h * bs) % _TOKEN_SPACE) % _TOKEN_SPACE)
        keys[i] = previous
    return keys


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    prefill_rate_tps: float = 8_000.0
    time_scale: float = 1.0
    """Model seconds per wall second (10 = ten times faster than real)."""
    tiers: tuple[TierSpec, ...] = (
        TierSpec(Tier.HBM, 2_048, 5, 1_600_000),
        TierSpec(Tier.DRAM, 16_384, 30, 400_000),
    )
    pub_endpoint: str = PRIVATE_ENDPOINT
    """Where KV events go; "private": ipc in a folder of mode 0700 made for this engine
    (removed when it closes), where no other user can connect (`event_endpoints`)."""
    replay_endpoint: str | None = PRIVATE_ENDPOINT
    """The replay service (None: none); "private" as `pub_endpoint`."""
    accept_open_events: bool = False
    """Publish KV events (prompt token ids) on endpoints others can reach: a non-loopback
    tcp address, an ipc folder not private to us (`event_endpoints`)."""
    payload_bytes: int = 0
    """Synthetic KV bytes stored per cached block (0: none); needs a keyer."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """The longest prompt served (vLLM's max_model_len); a longer one is refused (400)."""


@dataclass(frozen=True)
class KvSource:
    """The steering API's instruction: pull the prompt's prefix from this holder."""

    host: str
    port: int
    key_id: bytes
    expected_blocks: int = 0

    @classmethod
    def from_json(cls, obj: Any) -> KvSource:
        if not isinstance(obj, dict):
            raise PromptError("kv_source must be an object")
        try:
            host = str(ipaddress.ip_address(obj["address"]))
            port, expected = obj.get("port"), obj.get("expected_blocks", 0)
            key_id = bytes.fromhex(obj["key_id"])
        except (KeyError, TypeError, ValueError):
            raise PromptError("kv_source needs address (IP), port and key_id (hex)") from None
        if not isinstance(port, int) or not 0 < port < 65536:
            raise PromptError("kv_source.port must be 1..65535")
        if not key_id or not isinstance(expected, int) or expected < 0:
            raise PromptError("kv_source needs a key_id and expected_blocks >= 0")
        return cls(host, port, key_id, expected)

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.host,
            "port": self.port,
            "key_id": self.key_id.hex(),
            "expected_blocks": self.expected_blocks,
        }


@dataclass
class KvPuller:
    """Pulls prefixes for the engine: the node's transfer identity, the trust store that
    says which holders are real, and the address to pull from (the instance's own).

    It dials only holders the trust store knows: the source's key must be authorised
    (and valid now) for the source's address as an instance address, and the port must
    be `holder_port` when one is set (`refusal`). A /generate body names the source, so
    without this anyone who may call /generate could make the instance open connections
    to any host and port."""

    identity: TransferIdentity
    trust: TrustStore
    source_address: str | None = None
    rate_bps: int = 0
    timeout: float = 30.0
    attempts: int = 2  # the first pull, then one resumption from the last verified block
    holder_port: int | None = None  # the holders' transfer port (None: any)
    # the bytes a block is expected to have: a holder, even a trusted one, that announces
    # more is refused at the block's header. None: the size the pulling engine stores
    # itself (`ModelledEngine` passes its payload per block: the advertisement it pulls
    # for is of the same model and shape), not the 256 MiB no block can exceed
    max_block_bytes: int | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def refusal(self, source: KvSource, now_ms: int) -> str:
        """Why `source` is not dialled, or "" when it may be."""
        key = source.key_id.hex()
        auth = self.trust.lookup(source.key_id)
        if auth is None:
            return f"key {key} is not a holder this instance's trust store authorises"
        try:
            auth.check_validity(now_ms)
        except KeyExpiredError as exc:
            return str(exc)
        address = ipaddress.ip_address(source.host)
        if not any(address in net for net in auth.addresses):
            allowed = ", ".join(str(n) for n in auth.addresses)
            return f"{source.host} is not an instance address of key {key} ({allowed})"
        if self.holder_port is not None and source.port != self.holder_port:
            return f"port {source.port} is not the holders' transfer port {self.holder_port}"
        return ""

    def pull(
        self, source: KvSource, keys: Sequence[int], block_bytes: int | None = None
    ) -> tuple[PullResult, int]:
        """(the last attempt's result, attempts made). Admit only `result.completed`.
        `block_bytes`: the size the caller stores per block, the limit unless
        `max_block_bytes` is set."""
        from catsproto.adapters.transfer_tls import PeerPolicy, pull

        policy = PeerPolicy(self.trust, expected_key_id=source.key_id)
        expected = self.max_block_bytes if self.max_block_bytes is not None else block_bytes
        limit = {"max_block_bytes": expected} if expected else {}
        resume = None
        for attempt in range(1, self.attempts + 1):
            result = pull(
                (source.host, source.port),
                self.identity,
                policy,
                keys,
                transfer_id=next(self._ids),
                resume=resume,
                rate_bps=self.rate_bps,
                timeout=self.timeout,
                source_address=self.source_address,
                **limit,
            )
            if result.completed is not None or getattr(result.error, "code", None):
                return result, attempt  # done, or refused (a refusal is not retried)
            resume = result.resume
        return result, self.attempts


@dataclass
class _Job:
    blocks: list[tuple[int, int | None, list[int] | None]]
    input_length: int
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] = field(default_factory=dict)
    keys: list[int] | None = None  # advertised block keys, when the engine has a keyer
    pulled: tuple[StoredBlock, ...] = ()
    transfer: dict[str, Any] | None = None
    expected: int | None = None  # blocks the selector claimed were cached (or at the source)
    source: str = "local"
    found: int = 0  # leading blocks here (or pulled) when the request arrived
    outcome: dict[str, Any] = field(default_factory=dict)
    outstanding: int = 0  # of its tokens, those still counted in the engine's backlog
    error: str = ""  # why the worker could not serve it


class ModelledEngine:
    """FCFS prefill over a tiered cache; publishes vLLM KV events. One worker thread."""

    def __init__(
        self,
        config: EngineConfig,
        context: zmq.Context | None = None,
        *,
        keyer: BlockKeyer | None = None,
        puller: KvPuller | None = None,
    ) -> None:
        if config.payload_bytes and keyer is None:
            raise ValueError("payloads are stored by block key: give the engine a keyer")
        self.config = config
        self.keyer = keyer
        self.puller = puller
        self.cache = TieredCache(config.tiers)
        self.hits = HitCounter()
        self.payloads: dict[int, StoredBlock] = {}
        """block key -> payload, for every cached block (when payload_bytes > 0)."""
        self._key_of: dict[int, int] = {}  # engine hash -> block key, cached blocks only
        self._evicted: OrderedDict[int, float] = OrderedDict()  # hash -> when it left
        self._evicted_keys: OrderedDict[int, None] = OrderedDict()  # the same, by block key
        self.ledger = StaleHitLedger()
        self.transfers = {
            "pulls": 0,
            "failed": 0,
            "refused": 0,  # not dialled: a source the puller's trust store does not name
            "blocks": 0,
            "bytes": 0,
            "resumed": 0,
        }
        # pulls served from here that stopped at a block this cache had evicted, or had
        # never held (the puller's summary view had a false positive)
        self.served_missing = {"evicted": 0, "not-held": 0}
        self.last_advertised = float("-inf")
        """time.monotonic() of the C-SMA's latest advertisement (set by whoever sends it)."""
        pub, replay = config.pub_endpoint, config.replay_endpoint
        self.event_folder: Path | None = None
        """The private folder made for the "private" endpoints (removed at close)."""
        if PRIVATE_ENDPOINT in (pub, replay):
            self.event_folder, private_pub, private_replay = private_event_folder()
            pub = private_pub if pub == PRIVATE_ENDPOINT else pub
            replay = private_replay if replay == PRIVATE_ENDPOINT else replay
        try:
            for endpoint in (pub, replay):
                if endpoint is not None:  # the events carry prompt token ids: keep them ours
                    check_event_endpoint(endpoint, accept_open=config.accept_open_events)
            self.publisher = VllmEventPublisher(pub, replay, context=context)
        except BaseException:
            self._remove_event_folder()
            raise
        self._blocks: dict[int, tuple[int | None, list[int] | None]] = {}
        """hash -> (parent hash, token ids or None for Mooncake ids), for every block the
        cache holds, to publish a block again when it moves. Worker thread only."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.outstanding_tokens = 0
        self.busy_s = 0.0
        self.worker_errors = 0
        self.worker_error = ""
        """The worker's latest failure on a request (``worker_errors`` counts them)."""
        self.started = time.monotonic()
        self._worker = threading.Thread(target=self._run, daemon=True, name="engine")
        self._worker.start()

    # ---- requests ----------------------------------------------------------------------

    def prompt_blocks(
        self, body: dict[str, Any]
    ) -> tuple[list[tuple[int, int | None, list[int] | None]], int]:
        """(hash, parent, tokens) of every full block of a request body, and its length.
        A Mooncake prompt's input_length must fit its blocks (ids × block size), and no
        prompt may be longer than ``max_prompt_tokens``: the FCFS worker prefills it."""
        bs, limit = self.config.block_size, self.config.max_prompt_tokens
        if "prompt_token_ids" in body:
            tokens = body["prompt_token_ids"]
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens
            ):
                raise PromptError("prompt_token_ids must be a list of u32 token ids")
            if len(tokens) > limit:
                raise PromptError(
                    f"prompt_token_ids: {len(tokens)} tokens, over this instance's limit "
                    f"of {limit} (max_prompt_tokens)"
                )
            blocks: list[tuple[int, int | None, list[int] | None]] = []
            parent = None
            for start in range(0, len(tokens) - len(tokens) % bs, bs):
                block = tokens[start : start + bs]
                h = vllm_block_hash(parent, block)
                blocks.append((h, parent, block))
                parent = h
            return blocks, len(tokens)
        if "hash_ids" in body:
            ids, length = body["hash_ids"], body.get("input_length")
            if not isinstance(ids, list) or not all(
                type(i) is int and 0 <= i < 1 << 64 for i in ids
            ):
                raise PromptError("hash_ids must be a list of integers 0..2^64-1")
            if type(length) is not int or length < 0:
                shown = repr(length) if len(repr(length)) <= 40 else repr(length)[:37] + "..."
                raise PromptError(f"input_length must be a non-negative integer, not {shown}")
            if length > len(ids) * bs:
                raise PromptError(
                    f"input_length {length} exceeds what the prompt's {len(ids)} blocks of "
                    f"{bs} tokens hold ({len(ids) * bs}): a Mooncake hash id names one block"
                )
            if length > limit or len(ids) > -(-limit // bs):
                raise PromptError(
                    f"hash_ids: {len(ids)} blocks, input_length {length}: over this "
                    f"instance's limit of {limit} tokens (max_prompt_tokens)"
                )
            return [(h, p, None) for h, p in zip(ids, [None, *ids], strict=False)], length
        raise PromptError("give prompt_token_ids, or hash_ids and input_length")

    def block_keys(self, blocks: Sequence[tuple[int, int | None, list[int] | None]]) -> list[int]:
        """The advertised keys of a prompt's blocks (what its C-SMA derives, TOKENS mode)."""
        assert self.keyer is not None
        keys, previous = [], 0
        bs = self.config.block_size
        for h, _, tokens in blocks:
            previous = self.keyer.chain(previous, tokens or mooncake_tokens(h, bs))
            keys.append(previous)
        return keys

    def lookup_payload(self, key: int) -> StoredBlock | None:
        """The payload of a cached block by its advertised key (the transfer holder's view);
        a miss is counted as evicted or never held."""
        block = self.payloads.get(key)
        if block is None:
            with self._lock:
                self.served_missing["evicted" if key in self._evicted_keys else "not-held"] += 1
        return block

    def submit(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Queue a request (after pulling its prefix, if told to) and wait for its prefill."""
        blocks, length = self.prompt_blocks(body)
        expected = body.get("expected_cached_blocks")
        if expected is not None and (not isinstance(expected, int) or expected < 0):
            raise PromptError("expected_cached_blocks must be a non-negative integer")
        source = KvSource.from_json(body["kv_source"]) if "kv_source" in body else None
        if source is not None and (self.puller is None or self.keyer is None):
            raise PromptError("this instance has no transfer credentials: it cannot pull")
        job = _Job(blocks, length, time.monotonic(), expected=expected)
        if self.keyer is not None:
            job.keys = self.block_keys(blocks)
        if source is not None and job.keys:
            job.source = f"{source.host}:{source.port}"
            # the run the source claims (what the selector priced), else the whole prompt
            want = job.keys[: source.expected_blocks] if source.expected_blocks else job.keys
            job.pulled, job.transfer = self._pull(source, want)
            if expected is None:
                job.expected = source.expected_blocks
        with self._lock:
            job.arrived = time.monotonic()
            # judged on arrival, like the selector's claim: blocks that leave while the
            # request waits in the queue are the queue's doing, counted apart
            job.found = max(len(job.pulled), self.cache.lookup([b[0] for b in blocks]).depth)
            job.outcome = self._outcome(job, job.found)
            self.waiting += 1
            self.outstanding_tokens += length
            job.outstanding = length
        self._queue.put(job)
        if not job.done.wait(timeout):
            raise TimeoutError("request not served in time")
        if job.error:
            raise EngineError(f"the engine failed on this request: {job.error}")
        return job.result

    def _pull(
        self, source: KvSource, keys: list[int]
    ) -> tuple[tuple[StoredBlock, ...], dict[str, Any]]:
        """Pull `keys` from `source`; the verified run (empty unless the pull completed)."""
        assert self.puller is not None
        refused = self.puller.refusal(source, int(time.time() * 1000))
        if refused:
            with self._lock:
                self.transfers["pulls"] += 1
                self.transfers["failed"] += 1
                self.transfers["refused"] += 1
            return (), {
                "from": source.to_json(),
                "ok": False,
                "blocks": 0,
                "requested": len(keys),
                "recompute_from": 0,
                "payload_bytes": 0,
                "wire_bytes": 0,
                "seconds": 0.0,
                "attempts": 0,
                "holder_key_id": "",
                "error": f"not dialled: {refused}",
            }
        result, attempts = self.puller.pull(source, keys, self.config.payload_bytes or None)
        done = result.completed
        blocks = done.blocks if done is not None else ()
        with self._lock:
            self.transfers["pulls"] += 1
            self.transfers["failed"] += done is None
            self.transfers["resumed"] += attempts - 1
            self.transfers["blocks"] += len(blocks)
            self.transfers["bytes"] += sum(len(b.payload) for b in blocks)
        return blocks, {
            "from": source.to_json(),
            "ok": done is not None,
            "blocks": len(blocks),
            "requested": len(keys),
            "recompute_from": done.recompute_from if done is not None else 0,
            "payload_bytes": sum(len(b.payload) for b in blocks),
            "wire_bytes": result.wire_bytes,
            "seconds": round(result.seconds, 6),
            "attempts": attempts,
            "holder_key_id": result.peer_key_id,
            "error": f"{type(result.error).__name__}: {result.error}" if result.error else "",
        }

    def _track_payloads(self, events: list[BlockEvent], job: _Job) -> None:
        """Keep payloads, hash -> key and the evicted memory in step with the cache (lock
        held): a payload exists exactly while its block is cached."""
        size = self.config.payload_bytes
        pulled = {b.key: b for b in job.pulled}
        for ev in events:
            if ev.kind is BlockEventKind.STORED and size:
                for h in ev.keys:
                    key = self._key_of.get(h)
                    if key is not None and key not in self.payloads:
                        block = pulled.get(key)
                        self.payloads[key] = block or StoredBlock.of(
                            key, synthetic_payload(key, size)
                        )
            elif ev.kind is BlockEventKind.REMOVED:
                now = time.monotonic()
                for h in ev.keys:
                    if h in self.cache:
                        continue
                    key = self._key_of.pop(h, None)
                    if key is not None:
                        self.payloads.pop(key, None)
                        self._evicted_keys[key] = None
                        self._evicted_keys.move_to_end(key)
                    self._evicted[h] = now
                    self._evicted.move_to_end(h)
                for memory in (self._evicted, self._evicted_keys):
                    while len(memory) > _EVICTED_MEMORY:
                        memory.popitem(last=False)

    def _outcome(self, job: _Job, found: int) -> dict[str, Any]:
        """The stale-hit bookkeeping of one request (lock held)."""
        if job.expected is None:
            return {}
        expected = min(job.expected, len(job.blocks))
        outcome = self.ledger.record(
            Outcome(expected, min(found, expected), len(job.blocks)), job.source
        )
        cause = None
        gone_ms = None
        if outcome.stale:
            if job.transfer is not None:
                cause = "holder"
            else:
                h = job.blocks[found][0]
                when = self._evicted.get(h)
                if when is None:
                    cause = "not-held"
                elif when > self.last_advertised:
                    cause = "evicted"  # after the latest advertisement: nobody knew yet
                else:  # advertised since: the news was on its way, or a false positive
                    cause = "evicted-advertised"
                gone_ms = None if when is None else round(1000 * (time.monotonic() - when), 3)
        return {
            "expected_blocks": expected,
            "stale": outcome.stale,
            "stale_cause": cause,
            "evicted_ms_ago": gone_ms,
        }

    def count_failure(self, error: str) -> None:
        """Count a request that was not served (``worker_errors``, the latest kept)."""
        with self._lock:
            self.worker_errors += 1
            self.worker_error = error

    def _run(self) -> None:
        """Serve the queue FCFS. A request the worker fails on is answered with the error
        and counted (``worker_errors``); the worker goes on with the next one."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running += 1
            try:
                self._prefill(job)
            except Exception as exc:  # one request's fault must not end the queue
                job.error = f"{type(exc).__name__}: {exc}"
                self.count_failure(job.error)
            finally:
                with self._lock:
                    self.running -= 1
                    self.outstanding_tokens -= job.outstanding
                    job.outstanding = 0
            job.done.set()

    def _prefill(self, job: _Job) -> None:
        """Admit a request's blocks, publish the events, sleep for the prefill of what
        was not cached, and fill in its result (worker thread)."""
        bs = self.config.block_size
        with self._lock:
            for i, (h, parent, tokens) in enumerate(job.blocks):
                if h not in self._blocks:
                    self._blocks[h] = (parent, tokens)
                if job.keys is not None:
                    self._key_of[h] = job.keys[i]
            hashes = [b[0] for b in job.blocks]
            events: list[BlockEvent] = []
            if job.pulled:  # the verified run first, as if computed here earlier
                _, events = self.cache.admit(hashes[: len(job.pulled)])
                self._track_payloads(events, job)
            hit, more = self.cache.admit(hashes)
            self._track_payloads(more, job)
            events += more
            cached = min(job.input_length, hit.depth * bs)
            computed = job.input_length - cached
            self.outstanding_tokens -= cached
            job.outstanding -= cached
            self.hits.lookup_blocks += len(job.blocks)
            self.hits.hit_blocks += hit.depth
        self._publish(events)
        prefill_s = computed / self.config.prefill_rate_tps
        start = time.monotonic()
        time.sleep(prefill_s / self.config.time_scale)
        with self._lock:
            self.busy_s += time.monotonic() - start
        job.result = {
            "blocks": len(job.blocks),
            "cached_blocks": hit.depth,
            "cached_blocks_by_tier": {
                t.name.lower(): hit.blocks_in(t) for t in self.cache.order if hit.blocks_in(t)
            },
            "cached_tokens": cached,
            "prefill_tokens": computed,
            "model_prefill_ms": round(1000 * prefill_s, 3),
            "queue_wall_ms": round(1000 * (start - job.arrived), 3),
            **job.outcome,
        }
        if job.found > hit.depth:
            job.result["lost_while_queued"] = job.found - hit.depth
        if job.transfer is not None:
            job.result["transfer"] = job.transfer

    def _stored(self, medium: str, hashes: Sequence[int]) -> list[Any]:
        """BlockStored events for `hashes`, one per run that chains parent to child."""
        out: list[Any] = []
        run: list[int] = []
        for h in [*hashes, None]:
            if run and (h is None or self._blocks[h][0] != run[-1]):
                parent = self._blocks[run[0]][0]
                tokens = [t for r in run for t in self._tokens(r)]
                out.append(stored_event(run, parent, tokens, self.config.block_size, medium=medium))
                run = []
            if h is not None:
                run.append(h)
        return out

    def _tokens(self, h: int) -> list[int]:
        tokens = self._blocks[h][1]
        return tokens if tokens is not None else mooncake_tokens(h, self.config.block_size)

    def _publish(self, events: list[BlockEvent]) -> None:
        out: list[Any] = []
        for ev in events:
            medium = MEDIUM_OF_TIER[ev.tier]
            if ev.kind is BlockEventKind.STORED:
                out += self._stored(medium, ev.keys)
            elif ev.kind is BlockEventKind.REMOVED:
                out.append(removed_event(list(ev.keys), medium=medium))
                for h in ev.keys:
                    if h not in self.cache:
                        self._blocks.pop(h, None)
            elif ev.kind is BlockEventKind.MOVED:
                assert ev.to_tier is not None
                out.append(removed_event(list(ev.keys), medium=medium))
                out += self._stored(MEDIUM_OF_TIER[ev.to_tier], ev.keys)
        if out:
            self.publisher.publish(time.time(), out)

    def compute_state(self) -> ComputeState:
        with self._lock:
            top = self.cache.order[0]
            capacity = max(1, self.cache.specs[top].capacity_blocks)
            return ComputeState(
                waiting=self.waiting,
                running=self.running,
                outstanding_prefill_tokens=max(0, self.outstanding_tokens),
                prefill_rate_tps=self.config.prefill_rate_tps,
                utilisation=1.0 if self.running else 0.0,
                kv_utilisation=self.cache.count(top) / capacity,
            )

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "waiting": self.waiting,
                "running": self.running,
                "outstanding_prefill_tokens": self.outstanding_tokens,
                "blocks": {t.name.lower(): self.cache.count(t) for t in self.cache.order},
                "hit_ratio": round(self.hits.ratio, 6),
                "events_published_bytes": self.publisher.bytes_published,
                "payload_blocks": len(self.payloads),
                "stale_hits": self.ledger.to_json(),
                "transfers": dict(self.transfers),
                "served_missing": dict(self.served_missing),
                "worker_errors": self.worker_errors,
                "worker_error": self.worker_error,
                # null until the C-SMA has advertised once (strict JSON has no Infinity)
                "last_advertised_s_ago": (
                    round(time.monotonic() - self.last_advertised, 3)
                    if math.isfinite(self.last_advertised)
                    else None
                ),
            }

    def _remove_event_folder(self) -> None:
        if self.event_folder is not None:
            shutil.rmtree(self.event_folder, ignore_errors=True)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)
        self.publisher.close()
        self._remove_event_folder()

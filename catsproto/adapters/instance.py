"""A modelled inference instance that speaks vLLM's KV-event protocol, and its C-SMA.

Strategy. `ModelledEngine` stands in for a vLLM engine: it takes a prompt (token ids, or
Mooncake ``hash_ids`` plus a length), queues it FCFS, looks up its own tiered cache
(`catsproto.node.TieredCache`, exclusive LRU with demotion), sleeps for the prefill of
the uncached tokens (÷ prefill rate, on a clock scaled by ``time_scale`` so demos run
fast) and publishes every cache change as vLLM KV events on a real ZMQ PUB socket
(`VllmEventPublisher`, replay included). Block hashes are vLLM-like: the last 8 bytes of
SHA-256 over the parent hash and the block's tokens; for Mooncake prompts the trace's
hash_ids are the hashes and the token ids are synthetic.

`NodeAgent` is the C-SMA, and it knows the engine only through those events: a
`VllmEventSubscriber` feeds a mirror `TieredCache`, an `AdvertisementBuilder` turns it
into dampened advertisements (handed to ``on_routes``), and a Prometheus collector
exposes its counters. Compute metrics come from a callable (here the engine's queue).

`InstanceServer` is the HTTP face (stdlib ``http.server``, one thread per request):

    POST /generate   {"prompt_token_ids": [...]} or {"hash_ids": [...], "input_length": n}
                     -> answered when prefill ends (the first token): the client measures
                        time to first token; the body tells cached and computed tokens
                        (n at most ids × block size, every prompt at most
                        ``max_prompt_tokens``: else 400; a request the worker fails on
                        is a 500, counted in /state, and the worker serves the next)
    GET  /state      the engine's queue and cache, the node's counters, stale hits
    GET  /advertisements   the latest advertisement per route (hex and JSON)
    GET  /metrics    Prometheus text
    GET  /health     {"ok": true, "unauthorised": N}: open, counts nothing of any cache

Who may ask. A /generate reply says how much of the prompt was cached, so anyone who can
guess a prompt learns whether somebody else sent it; /state, /advertisements and
/metrics show the cache itself. With an API token (``api_token``; `instance serve
--api-token-file`) those four take only callers that send ``Authorization: Bearer
TOKEN`` (others get 401, their body unread, counted in ``unauthorised``). Without one,
/generate still serves everybody but answers with the block count alone
(`public_reply`: a cached and a cold prompt get the same body; only the time the
answer takes still differs, as it does on any engine that reuses a cache), and the
three views are refused (403). The KV events carry the prompts' token ids, and ZMQ asks
no credential, so the engine publishes them only where others cannot connect (inproc,
loopback tcp, ipc in a folder of mode 0700 of ours) unless ``accept_open_events`` says
otherwise (`catsproto.adapters.event_endpoints`).

KV payloads and pulls. With ``payload_bytes`` > 0 (and a `BlockKeyer`) the engine keeps a
synthetic payload per cached block under its advertised block key (`StoredBlock`, digest
taken at admission), dropped when the block leaves the cache: `lookup_payload` is what
its `TransferServer` serves. A /generate body may carry the steering API's instruction
``"kv_source": {"address", "port", "key_id", "expected_blocks"}``: before the request
queues, the engine pulls the prompt's block keys from that holder over mutually
authenticated TLS (`KvPuller`; the holder must be exactly ``key_id``, and a source whose key
the trust store does not authorise for that address is never dialled), admits the verified
run into its cache (so the C-SMA advertises it next) and prefills only the rest. A pull cut
off midway is resumed once from the last verified block; one that fails admits nothing.
``"expected_cached_blocks"`` is what the selector claimed; an instance that finds fewer
when the request arrives (blocks evicted while it waits in the queue are reported apart,
``lost_while_queued``) counts a *stale hit* (`transfer.StaleHitLedger`) and says whether
the first missing block was evicted after its latest advertisement (``stale_cause:
evicted``), evicted before it (``evicted-advertised``: the news was on its way, or a
false positive on a block once held), never held here (``not-held``: a summary's false
positive), or was missing at the holder (``holder``). A pull asks for the run the source
claims (``expected_blocks``), or for the whole prompt when no claim is given.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from catsproto import wire
from catsproto.adapters.event_endpoints import check_event_endpoint
from catsproto.adapters.http import (
    READ_TIMEOUT_S,
    UNAUTHORISED_ERROR,
    BackgroundHTTPServer,
    BodyError,
    JsonHandler,
    bearer_authorised,
    bearer_challenge,
    read_json_body,
    withheld,
)
from catsproto.adapters.metrics import (
    CONTENT_TYPE,
    HitCounter,
    NodeCollector,
    node_registry,
    render,
)
from catsproto.adapters.vllm_events import (
    RankEndpoint,
    VllmEventPublisher,
    VllmEventSubscriber,
    removed_event,
    stored_event,
)
from catsproto.keys import BlockKeyer
from catsproto.node import (
    AdvertisementBuilder,
    BlockEvent,
    BlockEventKind,
    BuilderConfig,
    ComputeState,
    KeyMode,
    RouteAdvertisement,
    TieredCache,
    TierSpec,
    VllmIngest,
)
from catsproto.security import KeyExpiredError, TrustStore
from catsproto.transfer import Outcome, StaleHitLedger, StoredBlock, synthetic_payload
from catsproto.wire import Tier

if TYPE_CHECKING:
    from catsproto.adapters.transfer_tls import PullResult, TransferIdentity

__all__ = [
    "MEDIUM_OF_TIER",
    "EngineConfig",
    "EngineError",
    "InstanceServer",
    "KvPuller",
    "KvSource",
    "ModelledEngine",
    "NodeAgent",
    "PromptError",
    "public_reply",
    "vllm_block_hash",
]

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
    pub_endpoint: str = "tcp://127.0.0.1:*"
    replay_endpoint: str | None = "tcp://127.0.0.1:*"
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
    # the bytes a block is expected to have (the engine's payload per block): a holder,
    # even a trusted one, that announces more is refused at the block's header
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

    def pull(self, source: KvSource, keys: Sequence[int]) -> tuple[PullResult, int]:
        """(the last attempt's result, attempts made). Admit only `result.completed`."""
        from catsproto.adapters.transfer_tls import PeerPolicy, pull

        policy = PeerPolicy(self.trust, expected_key_id=source.key_id)
        limit = {} if self.max_block_bytes is None else {"max_block_bytes": self.max_block_bytes}
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
        for endpoint in (config.pub_endpoint, config.replay_endpoint):
            if endpoint is not None:  # the events carry prompt token ids: keep them ours
                check_event_endpoint(endpoint, accept_open=config.accept_open_events)
        self.publisher = VllmEventPublisher(
            config.pub_endpoint, config.replay_endpoint, context=context
        )
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
        result, attempts = self.puller.pull(source, keys)
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
                with self._lock:
                    self.worker_errors += 1
                    self.worker_error = job.error
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

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)
        self.publisher.close()


class NodeAgent:
    """The C-SMA: vLLM events in, advertisements out, on its own thread.

    on_routes receives every non-empty list of `RouteAdvertisement`s (unsigned). The
    epoch defaults to the wall-clock second of the start (new on every restart).
    """

    def __init__(
        self,
        builder_config: BuilderConfig,
        tiers: Sequence[TierSpec],
        keyer: BlockKeyer,
        endpoints: Sequence[RankEndpoint],
        compute_state: Callable[[], ComputeState],
        *,
        key_mode: KeyMode = KeyMode.TOKENS,
        engine: str = "vllm",
        on_routes: Callable[[list[RouteAdvertisement]], None] | None = None,
        epoch: int | None = None,
        poll_ms: int = 20,
        hits: HitCounter | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.cache = TieredCache(tiers)
        self.ingest = VllmIngest(self.cache, keyer, key_mode=key_mode, engine=engine)
        self.subscriber = VllmEventSubscriber(self.ingest, endpoints, context=context)
        self.builder = AdvertisementBuilder(
            builder_config, self.cache, int(time.time()) if epoch is None else epoch
        )
        self.compute_state = compute_state
        self.on_routes = on_routes
        self.poll_ms = poll_ms
        self.latest: dict[str, RouteAdvertisement] = {}
        self.error: str = ""
        self.ingest_errors = 0
        """Subscriber polls that raised (the subscriber itself counts refused batches)."""
        self.registry = node_registry(
            NodeCollector(
                self.cache,
                lambda: self.builder.stats,
                lambda: self.ingest.stats,
                lambda: self.subscriber.stats,
                hits,
                builder_config.address,
            )
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="c-sma")

    def start(self) -> NodeAgent:
        self._thread.start()
        return self

    def step(self, timeout_ms: int = 0) -> list[RouteAdvertisement]:
        """One round: take in events, then ask the builder (exposed for tests)."""
        with self._lock:
            try:
                self.subscriber.poll(timeout_ms)
            except Exception as exc:  # the builder still runs: its refreshes are due anyway
                self.ingest_errors += 1
                self.error = f"event ingest: {type(exc).__name__}: {exc}"
            routes = self.builder.poll(int(time.time() * 1000), self.compute_state())
            for r in routes:
                self.latest[str(r.prefix)] = r
        if routes and self.on_routes is not None:
            self.on_routes(routes)
        return routes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(self.poll_ms)
            except Exception as exc:  # keep serving; the error shows in /state
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(1.0)

    def advertisements(self) -> list[dict[str, Any]]:
        with self._lock:
            routes = list(self.latest.values())
        return [route_json(r) for r in routes]

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "blocks": {t.name.lower(): self.cache.count(t) for t in self.cache.order},
                "ingest": {
                    **{
                        k: getattr(self.ingest.stats, k)
                        for k in (
                            "batches",
                            "events",
                            "blocks_stored",
                            "blocks_removed",
                            "orphans",
                            "block_size_mismatch",
                        )
                    },
                    # engine block size -> blocks refused (the node keys another size)
                    "mismatched_block_sizes": {
                        str(size): n for size, n in self.ingest.stats.mismatched_block_sizes.items()
                    },
                },
                "subscriber": {
                    **{
                        k: getattr(self.subscriber.stats, k)
                        for k in (
                            "frames",
                            "bytes",
                            "gaps",
                            "resyncs",
                            "restarts",
                            "bad_payloads",
                            "bad_replay_frames",
                            "failed_recoveries",
                            "last_error",
                        )
                    },
                    "failed_by_reason": dict(self.subscriber.stats.failed_by_reason),
                },
                "ingest_errors": self.ingest_errors,
                "builder": {
                    "advertisements": self.builder.stats.advertisements,
                    "suppressed": self.builder.stats.suppressed,
                    "bytes": self.builder.stats.bytes,
                    "epoch": self.builder.epoch,
                    "sequence": self.builder.sequence,
                },
                "error": self.error,
            }

    def metrics(self) -> bytes:
        with self._lock:
            return render(self.registry)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.subscriber.close()


def route_json(route: RouteAdvertisement) -> dict[str, Any]:
    """A route advertisement as one JSON object (what `--adverts-out` writes per line)."""
    value = wire.encode(route.advertisement)
    return {
        "prefix": str(route.prefix),
        "tier": route.tier.name.lower() if route.tier is not None else None,
        "shard": route.shard,
        "epoch": route.epoch,
        "sequence": route.sequence,
        "reason": route.reason.value,
        "value": value.hex(),
        "advertisement": route.advertisement.to_json(),
    }


# what a caller without the API token is told of a /generate reply (here, and by the
# steering daemon of the chosen instance's reply): an allow-list, so a field added to the
# reply later is withheld until someone decides it is safe. `blocks` is the prompt's count
# of full blocks, which the caller can work out from its own prompt. The modelled instance
# generates no output (it answers when prefill ends, the first token); an engine that
# returns output names its field here. Everything else the reply carries says how much of
# the prompt was cached: cached_blocks(_by_tier), cached_tokens, prefill_tokens,
# model_prefill_ms, expected_blocks, stale, stale_cause, evicted_ms_ago,
# lost_while_queued, transfer, and queue_wall_ms (the queue's wait is the prefill of the
# requests ahead, so it tells of other callers' cache hits).
PUBLIC_REPLY_FIELDS = ("blocks",)
REPLY_WITHHELD_NOTE = (
    "no API token configured: cached-block and cached-token counts, stale-hit verdict, "
    "transfer and prefill/queue timings are withheld (start the instance with "
    "--api-token-file to serve them to token holders)"
)
# the GET views that show the cache; an instance without a token refuses them (403)
TOKEN_VIEWS = ("/state", "/advertisements", "/metrics")


def public_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """A /generate reply as a caller gets it from an instance without an API token."""
    return withheld(reply, PUBLIC_REPLY_FIELDS, REPLY_WITHHELD_NOTE)


def refused_without_token(path: str) -> str:
    """The error an instance without an API token answers a GET of `path` with (403)."""
    return (
        f"GET {path} is served only to API token holders and no API token is configured: "
        "start the instance with --api-token-file (it shows the cache, which would tell "
        "anyone whether a prompt of theirs was sent before)"
    )


class InstanceServer(BackgroundHTTPServer):
    """HTTP front of an engine and (optionally) its node agent. With an `api_token`,
    POST /generate and GET /state, /advertisements, /metrics take only callers that send
    it as a bearer token (others get 401); without one, /generate answers everyone with
    `public_reply` and the views are refused (403). GET /health is open."""

    def __init__(
        self,
        engine: ModelledEngine,
        node: NodeAgent | None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        request_deadline: float = READ_TIMEOUT_S,
        api_token: bytes | None = None,
    ) -> None:
        self.engine = engine
        self.node = node
        self.api_token = api_token
        self.unauthorised = 0  # answered 401: a missing or wrong API token
        self._count_lock = threading.Lock()
        super().__init__(_handler(self), host, port, request_deadline=request_deadline)
        self.httpd.socket.listen(256)  # bursts from a steering proxy; the stdlib's is 5

    def count_unauthorised(self) -> None:
        with self._count_lock:
            self.unauthorised += 1

    def health(self) -> dict[str, Any]:
        return {"ok": True, "unauthorised": self.unauthorised}

    def close(self) -> None:
        super().close()
        if self.node is not None:
            self.node.close()
        self.engine.close()


def _handler(server: InstanceServer) -> type[BaseHTTPRequestHandler]:
    token = server.api_token

    class Handler(JsonHandler):
        def _refused(self) -> bool:
            """With a token configured, answer 401 to a caller without it (counted; any
            body is left unread and the connection closed) and return True."""
            if token is None or bearer_authorised(self.headers, token):
                return False
            server.count_unauthorised()
            self.close_connection = True
            self._json(401, {"error": UNAUTHORISED_ERROR}, bearer_challenge("instance"))
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, server.health())
                return
            known = self.path == "/state" or (self.path in TOKEN_VIEWS and server.node is not None)
            if not known:
                self._json(404, {"error": f"no {self.path}"})
            elif self._refused():
                return
            elif token is None:
                self._json(403, {"error": refused_without_token(self.path)})
            elif self.path == "/state":
                node = server.node.state() if server.node is not None else None
                self._json(200, {"engine": server.engine.state(), "node": node})
            elif self.path == "/advertisements" and server.node is not None:
                self._json(200, server.node.advertisements())
            elif server.node is not None:
                self._send(200, server.node.metrics(), CONTENT_TYPE)

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._json(404, {"error": f"no {self.path}"})
                return
            if self._refused():
                return
            try:
                body = read_json_body(self)
                if not isinstance(body, dict):
                    raise PromptError("the body must be a JSON object")
                result = server.engine.submit(body, timeout=600)
            except BodyError as exc:
                self.close_connection = True  # what follows on the stream is unknown
                self._json(exc.status, {"error": str(exc)})
                return
            except (PromptError, ValueError) as exc:
                self._json(400, {"error": str(exc)})
                return
            except EngineError as exc:
                self._json(500, {"error": str(exc)})
                return
            self._json(200, result if token is not None else public_reply(result))

    return Handler

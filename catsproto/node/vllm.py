"""vLLM KV-cache events, parsed and applied to the cache model; sequence and gap logic.

Strategy. vLLM publishes batches ``[ts, [event, ...], data_parallel_rank]`` (msgpack; the
adapter `catsproto.adapters.vllm_events` unpacks the bytes and calls `parse_batch`).
Events are maps with a ``"type"`` key since vLLM 0.24 and tagged arrays
``["BlockStored", field, ...]`` before; both are accepted, and fields left out because
they equal their default take that default. A batch may also arrive as a map
(``{"ts", "events", "data_parallel_rank"}``), which is how msgspec writes it when the
struct is not array-like.

`VllmIngest` turns events into `TieredCache` changes:

* a vLLM block hash is a 64-bit tail of a SHA-256 chained over the *full* parent hash,
  so nobody can derive it from a published parent; we re-key each block from its
  ``token_ids`` with `BlockKeyer.chain` (or, for engines whose ids are already chained
  and shared with the selector — the Mooncake trace — with `BlockKeyer.engine_key`),
  and remember hash → key so a child chains from its parent's key;
* vLLM does not de-duplicate identical GPU blocks, so GPU copies are counted per
  (rank, medium, group, hash); a block joins a tier on its first copy and leaves it with
  its last. Every other medium (a CPU or DISK offload store) is a set keyed by hash: a
  second store of a hash it holds is a no-op and one removal removes it (counting those
  kept a twice-stored, once-removed CPU block advertised after the store dropped it);
* ``medium`` (GPU, CPU, DISK ...) maps to a tier; ``None`` means GPU; AllBlocksCleared
  clears the GPU medium of its rank only;
* blocks hashed with LoRA names or extra keys (multimodal inputs, cache salts) name more
  than their tokens, so a token-only key would claim hits it cannot serve: they and
  their descendants are skipped (counted);
* a block whose parent hash is unknown (we joined late) cannot be keyed: counted as an
  orphan and skipped;
* a BlockStored whose ``block_size`` differs from the keyer's cannot be keyed the way
  the selector keys prompts (other token spans, other chains): its blocks are refused,
  never keyed, counted in ``block_size_mismatch``, and each distinct size leaves one
  `IngestNotice` for the adapter to log (this module does not log).

`parse_batch` checks every field of every event against vLLM's types before it returns,
so a batch either parses whole or raises one `VllmEventError` and `apply_batch` never
sees a half-valid batch.

`SequenceTracker` classifies each batch's 8-byte sequence: next in line, a gap (recover
through the replay socket), a duplicate of a replayed batch, or a restart (the engine
counts from 0 again). Pure: no sockets, no clocks.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from catsproto.keys import BlockKeyer
from catsproto.node.cache import TieredCache
from catsproto.wire import Tier

__all__ = [
    "DEFAULT_MEDIA",
    "END_SEQ",
    "BlockSizeMismatch",
    "IngestStats",
    "KeyMode",
    "SeqAction",
    "SequenceTracker",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "VllmEventBatch",
    "VllmEventError",
    "VllmIngest",
    "parse_batch",
    "parse_event",
]

MEDIUM_GPU = "GPU"
DEFAULT_MEDIA: Mapping[str, Tier] = {
    "GPU": Tier.HBM,
    "CPU": Tier.DRAM,
    "DISK": Tier.SSD,
    "SSD": Tier.SSD,
    "LOCAL_DISK": Tier.SSD,
    "STORAGE": Tier.SSD,
    "REMOTE": Tier.REMOTE,
}
"""vLLM ``medium`` strings (upper-cased before lookup) to tiers."""

END_SEQ = b"\xff" * 8
"""The sequence frame that ends a replay (vLLM sends -1 as 8 big-endian bytes)."""


class VllmEventError(ValueError):
    """A payload that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    block_hashes: Sequence[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    block_hashes: Sequence[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@dataclass(frozen=True, slots=True)
class VllmEventBatch:
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None = None


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_CLASSES: dict[str, tuple[type, tuple[str, ...]]] = {
    "BlockStored": (VllmBlockStored, _STORED_FIELDS),
    "BlockRemoved": (VllmBlockRemoved, _REMOVED_FIELDS),
    "AllBlocksCleared": (VllmAllBlocksCleared, ()),
}


# Field checks follow vLLM's event structs (vllm/distributed/kv_events.py): a hash is an
# int (64 bits, signed or unsigned: older engines used Python's hash()) or bytes; token
# ids are u32; every optional field is its type or None. Each check raises one
# VllmEventError naming the event, the field and the value, so a batch either parses
# whole or changes nothing.

_I64_MIN = -(1 << 63)
_U64 = 1 << 64
_U32 = 1 << 32
_U32_CODE = next(code for code in "IL" if array(code).itemsize == 4)


def _int_in(value: object, lo: int, hi: int) -> bool:
    """An int (a bool is not one here) with lo <= value < hi."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def _bad(tag: str, name: str, value: object, want: str) -> VllmEventError:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return VllmEventError(f"{tag}.{name} {shown} is not {want}")


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) or _int_in(value, _I64_MIN, _U64)


def _check_hashes(tag: str, name: str, value: object) -> None:
    if not isinstance(value, list | tuple):
        raise _bad(tag, name, value, "an array")
    for h in value:
        if not (type(h) is bytes or (type(h) is int and _I64_MIN <= h < _U64)):
            raise _bad(tag, name, h, "a block hash (64-bit int or bytes)")


def _check_parent(tag: str, name: str, value: object) -> None:
    if value is not None and not _is_hash(value):
        raise _bad(tag, name, value, "a block hash (64-bit int or bytes) or nil")


def _check_tokens(tag: str, name: str, value: object) -> None:
    if not isinstance(value, list | tuple):
        raise _bad(tag, name, value, "an array")
    # the ingest hot path (16+ tokens a block): an unsigned 32-bit array takes only ints in
    # range, in C; a bool passes as 0 or 1, which keys like those tokens and breaks nothing
    try:
        array(_U32_CODE, value)
    except (TypeError, OverflowError):
        wrong = next(t for t in value if not _int_in(t, 0, _U32))
        raise _bad(tag, name, wrong, "a token id (0..2^32-1)") from None


def _check_block_size(tag: str, name: str, value: object) -> None:
    if not _int_in(value, 1, _U32):
        raise _bad(tag, name, value, "a block size (1..2^32-1)")


def _check_opt_int(tag: str, name: str, value: object) -> None:
    if value is not None and not _int_in(value, _I64_MIN, _U64):
        raise _bad(tag, name, value, "a 64-bit integer or nil")


def _check_opt_str(tag: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise _bad(tag, name, value, "a string or nil")


def _check_opt_array(tag: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, list | tuple):
        raise _bad(tag, name, value, "an array or nil")


_FIELD_CHECKS = {
    "block_hashes": _check_hashes,
    "parent_block_hash": _check_parent,
    "token_ids": _check_tokens,
    "block_size": _check_block_size,
    "lora_id": _check_opt_int,
    "medium": _check_opt_str,
    "lora_name": _check_opt_str,
    "extra_keys": _check_opt_array,
    "group_idx": _check_opt_int,
    "kv_cache_spec_kind": _check_opt_str,
    "kv_cache_spec_sliding_window": _check_opt_int,
}
assert set(_FIELD_CHECKS) == set(_STORED_FIELDS) | set(_REMOVED_FIELDS)


def _tag(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def parse_event(obj: object) -> VllmEvent:
    """One event, map form (vLLM >= 0.24) or tagged-array form (<= 0.23)."""
    if isinstance(obj, Mapping):
        tag = _tag(obj.get("type"))
        entry = _CLASSES.get(tag)
        if entry is None:
            raise VllmEventError(f"unknown event type {tag!r}")
        cls, names = entry
        known = {n: obj[n] for n in names if n in obj}
        missing = [n for n in names[: _REQUIRED[tag]] if n not in known]
    elif isinstance(obj, list | tuple) and obj:
        tag = _tag(obj[0])
        entry = _CLASSES.get(tag)
        if entry is None:
            raise VllmEventError(f"unknown event type {tag!r}")
        cls, names = entry
        if len(obj) - 1 > len(names):
            raise VllmEventError(f"{tag} has {len(obj) - 1} fields, at most {len(names)} known")
        known = dict(zip(names, obj[1:], strict=False))
        missing = list(names[len(obj) - 1 : _REQUIRED[tag]])
    else:
        raise VllmEventError(f"an event is a map or a tagged array, not {type(obj).__name__}")
    if missing:
        raise VllmEventError(f"{tag} lacks {', '.join(missing)}")
    for name, value in known.items():
        _FIELD_CHECKS[name](tag, name, value)
    return cls(**known)


def parse_batch(obj: object) -> VllmEventBatch:
    """A whole payload: ``[ts, [events], dp_rank]`` (dp_rank may be absent) or a map."""
    if isinstance(obj, Mapping):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and 2 <= len(obj) <= 3:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    else:
        raise VllmEventError("a batch is [ts, events, data_parallel_rank]")
    if (
        isinstance(ts, bool)
        or not isinstance(ts, int | float)
        or not isinstance(events, list | tuple)
    ):
        raise VllmEventError("a batch needs a numeric ts and an events array")
    if rank is not None and not _int_in(rank, 0, _U32):
        raise VllmEventError(f"data_parallel_rank {rank!r} is not an integer 0..2^32-1")
    return VllmEventBatch(float(ts), tuple(parse_event(e) for e in events), rank)


# ---- sequence numbers -------------------------------------------------------------------


class SeqAction(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@dataclass(slots=True)
class SequenceTracker:
    """Where one publisher's sequence stands.

    next_seq: the sequence expected next (None before the first batch).
    """

    next_seq: int | None = None
    _dup_lo: int = 0
    _dup_hi: int = -1

    def classify(self, seq: int) -> SeqAction:
        if self.next_seq is None:
            return SeqAction.APPLY if seq == 0 else SeqAction.GAP
        if seq == self.next_seq:
            return SeqAction.APPLY
        if seq > self.next_seq:
            return SeqAction.GAP
        if self._dup_lo <= seq <= self._dup_hi:
            return SeqAction.DUPLICATE
        return SeqAction.RESTART

    @property
    def gap_start(self) -> int:
        """The first sequence missing (replay from here)."""
        return 0 if self.next_seq is None else self.next_seq

    def applied(self, seq: int) -> None:
        self.next_seq = seq + 1

    def replayed(self, first: int, last: int) -> None:
        """Batches first..last came through the replay socket: drop them if PUB repeats."""
        self._dup_lo, self._dup_hi = first, last

    def restarted(self) -> None:
        self.next_seq = None
        self._dup_lo, self._dup_hi = 0, -1


# ---- ingestion --------------------------------------------------------------------------


class KeyMode(enum.Enum):
    TOKENS = "tokens"
    """Re-key blocks from token ids (real vLLM; what a selector computes from a prompt)."""
    ENGINE_IDS = "engine-ids"
    """Key the engine's own chained ids (the Mooncake trace's hash_ids)."""


@dataclass(slots=True)
class IngestStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    orphans: int = 0
    """Stored blocks whose parent hash was unknown: not keyable, skipped."""
    skipped_extra: int = 0
    """Blocks hashed with LoRA or extra keys (and their descendants): skipped."""
    unknown_media: int = 0
    unknown_removals: int = 0
    """Removals of blocks never seen stored (after a resync, or joined late)."""
    block_size_mismatch: int = 0
    """Stored blocks refused because the event's block_size is not the keyer's."""
    mismatched_block_sizes: dict[int, int] = field(default_factory=dict)
    """Engine block size -> blocks refused, for the first MAX_SIZES_NAMED sizes seen."""
    short_token_ids: int = 0
    """Stored blocks refused because the event has fewer token ids than blocks × size."""
    rank_resets: int = 0
    by_rank: dict[int, int] = field(default_factory=dict)
    """Events per DP rank, for the first MAX_RANKS_COUNTED ranks seen."""
    other_ranks: int = 0
    """Events of ranks seen after by_rank was full (one bucket: ranks come from the wire)."""

    @property
    def block_events(self) -> int:
        return self.blocks_stored + self.blocks_removed


_SKIP = -1  # known hash whose key is deliberately unknown (LoRA/extra keys/orphan chain)
MAX_RANKS_COUNTED = 256  # by_rank entries; vLLM runs a handful of DP ranks per instance
MAX_MEDIA_REMEMBERED = 64  # medium strings whose tier is memoised (known media only)
MAX_SIZES_NAMED = 16  # distinct mismatched block sizes named (and noticed) one by one


@dataclass(frozen=True, slots=True)
class BlockSizeMismatch:
    """The engine stores blocks of another size than the node keys: a configuration error
    the operator must hear about (the adapter logs it once per distinct size)."""

    rank: int
    engine_block_size: int
    node_block_size: int

    @property
    def message(self) -> str:
        return (
            f"vLLM rank {self.rank} stores blocks of {self.engine_block_size} tokens but the "
            f"node keys blocks of {self.node_block_size} tokens: its blocks are refused, "
            f"not advertised (run both with the same block size)"
        )


class VllmIngest:
    """Applies vLLM KV events of one instance (any number of DP ranks) to a TieredCache."""

    def __init__(
        self,
        cache: TieredCache,
        keyer: BlockKeyer,
        *,
        key_mode: KeyMode = KeyMode.TOKENS,
        engine: str = "vllm",
        media: Mapping[str, Tier] = DEFAULT_MEDIA,
        max_known_hashes: int = 1 << 20,
    ) -> None:
        self.cache = cache
        self.keyer = keyer
        self.key_mode = key_mode
        self.engine = engine
        self.media = {m.upper(): t for m, t in media.items()}
        self.max_known_hashes = max_known_hashes
        self.stats = IngestStats()
        self._known: dict[int | bytes, int] = {}
        """Engine hash -> our key (or _SKIP), oldest first, trimmed to max_known_hashes."""
        self._copies: dict[int, dict[tuple[str, int | None, int | bytes], list[int]]] = {}
        """rank -> (medium, group, hash) -> [copies (1 unless GPU), key]."""
        self._presence: dict[tuple[Tier, int], int] = {}
        self._tier_of_medium: dict[str | None, Tier | None] = {}
        self._notices: list[BlockSizeMismatch] = []

    def take_notices(self) -> list[BlockSizeMismatch]:
        """What happened once that an operator must hear about, since the last call."""
        notices, self._notices = self._notices, []
        return notices

    def _tier(self, medium: str | None) -> Tier | None:
        try:
            return self._tier_of_medium[medium]
        except KeyError:
            name = (medium or MEDIUM_GPU).upper()
            tier = self.media.get(name)
            if tier is not None and tier not in self.cache.specs:
                tier = None
            # only media we store in are memoised, and only so many spellings of them: the
            # strings come from the publisher, and an unknown one is refused every time
            if tier is not None and len(self._tier_of_medium) < MAX_MEDIA_REMEMBERED:
                self._tier_of_medium[medium] = tier
            return tier

    def apply_batch(self, batch: VllmEventBatch, rank: int = 0) -> None:
        """Apply one batch; its own data_parallel_rank wins over `rank` when present."""
        if batch.data_parallel_rank is not None:
            rank = batch.data_parallel_rank
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        by_rank = self.stats.by_rank
        if rank in by_rank or len(by_rank) < MAX_RANKS_COUNTED:
            by_rank[rank] = by_rank.get(rank, 0) + len(batch.events)
        else:
            self.stats.other_ranks += len(batch.events)
        for ev in batch.events:
            if type(ev) is VllmBlockStored:
                self._stored(rank, ev)
            elif type(ev) is VllmBlockRemoved:
                self._removed(rank, ev)
            else:
                self.clear_rank(rank, only_tier=Tier.HBM)
                self.stats.cleared += 1

    def _stored(self, rank: int, ev: VllmBlockStored) -> None:
        stats = self.stats
        n = len(ev.block_hashes)
        stats.blocks_stored += n
        bs = ev.block_size
        if bs != self.keyer.block_size:
            # in either key mode: a block is what the selector cuts a prompt into
            self._mismatch(rank, bs, n)
            return
        tier = self._tier(ev.medium)
        if tier is None:
            stats.unknown_media += n
            return
        known = self._known
        cache = self.cache
        tokens_mode = self.key_mode is KeyMode.TOKENS
        if tokens_mode and len(ev.token_ids) < n * bs:
            stats.short_token_ids += n
            return
        parent = ev.parent_block_hash
        prev = 0 if parent is None else known.get(parent)
        depth = 0 if not prev or prev == _SKIP else cache.depth.get(prev, 0)
        if ev.lora_name is not None or ev.lora_id is not None or _has_extra(ev.extra_keys):
            prev = _SKIP
        copies = self._copies.get(rank)
        if copies is None:  # a rank's map exists only while it holds a copy
            copies = {}
        medium = (ev.medium or MEDIUM_GPU).upper()
        group = ev.group_idx
        presence = self._presence
        for i, h in enumerate(ev.block_hashes):
            if prev is None or prev == _SKIP:
                if prev is None:
                    stats.orphans += 1
                else:
                    stats.skipped_extra += 1
                known[h] = _SKIP
                prev = _SKIP
                continue
            if tokens_mode:
                key = self.keyer.chain(prev, ev.token_ids[i * bs : (i + 1) * bs])
            else:
                key = self.keyer.engine_key(self.engine, _engine_id(h))
            depth += 1
            if h in known:
                del known[h]  # re-insert as newest
            known[h] = key
            prev = key
            ck = (medium, group, h)
            entry = copies.get(ck)
            if entry is not None:
                if medium == MEDIUM_GPU:  # another GPU copy; an offload store is a set
                    entry[0] += 1
                continue
            if not copies:
                self._copies[rank] = copies  # (again, when it is already there: harmless)
            copies[ck] = [1, key]
            pk = (tier, key)
            c = presence.get(pk, 0)
            presence[pk] = c + 1
            if c == 0:
                cache.store(tier, key, depth)
        if len(known) > self.max_known_hashes:
            self._trim_known()

    def _mismatch(self, rank: int, block_size: int, blocks: int) -> None:
        stats = self.stats
        stats.block_size_mismatch += blocks
        sizes = stats.mismatched_block_sizes
        if block_size in sizes:
            sizes[block_size] += blocks
        elif len(sizes) < MAX_SIZES_NAMED:  # sizes come from the wire: name a few
            sizes[block_size] = blocks
            self._notices.append(BlockSizeMismatch(rank, block_size, self.keyer.block_size))

    def _trim_known(self) -> None:
        excess = len(self._known) - self.max_known_hashes
        for h in list(self._known)[:excess]:
            del self._known[h]

    def _removed(self, rank: int, ev: VllmBlockRemoved) -> None:
        self.stats.blocks_removed += len(ev.block_hashes)
        tier = self._tier(ev.medium)
        if tier is None:
            self.stats.unknown_media += len(ev.block_hashes)
            return
        copies = self._copies.get(rank)
        if copies is None:
            self.stats.unknown_removals += len(ev.block_hashes)
            return
        medium = (ev.medium or MEDIUM_GPU).upper()
        for h in ev.block_hashes:
            ck = (medium, ev.group_idx, h)
            entry = copies.get(ck)
            if entry is None:
                self.stats.unknown_removals += 1
                continue
            entry[0] -= 1
            if entry[0] == 0:
                del copies[ck]
                self._unpresent(tier, entry[1])
        if not copies:
            del self._copies[rank]

    def _unpresent(self, tier: Tier, key: int) -> None:
        pk = (tier, key)
        c = self._presence[pk] - 1
        if c:
            self._presence[pk] = c
        else:
            del self._presence[pk]
            self.cache.remove(tier, key)

    def clear_rank(self, rank: int, only_tier: Tier | None = None) -> None:
        """Forget every block of `rank` (in `only_tier`'s media, when given)."""
        copies = self._copies.get(rank, {})
        for ck in list(copies):
            tier = self._tier(ck[0])
            if tier is None or (only_tier is not None and tier != only_tier):
                continue
            _, key = copies.pop(ck)
            self._unpresent(tier, key)
        if not copies:
            self._copies.pop(rank, None)

    def reset_rank(self, rank: int) -> None:
        """The engine restarted, or its history is lost: forget all of `rank`'s blocks."""
        self.clear_rank(rank)
        self.stats.rank_resets += 1

    def copies(self, rank: int) -> dict[tuple[str, int | None, int | bytes], int]:
        """(medium, group, hash) -> copies held by `rank` (for tests and inspection; 1
        for every block of a medium other than GPU)."""
        return {ck: e[0] for ck, e in self._copies.get(rank, {}).items()}


def _has_extra(extra: Sequence[Any] | None) -> bool:
    return bool(extra) and any(e is not None for e in extra)  # type: ignore[union-attr]


def _engine_id(h: int | bytes) -> int:
    """An engine hash as an int: bytes hashes by their last 8 bytes, as vLLM itself does
    when it is asked for int hashes."""
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h

"""Sharding: split a summary by key range so each shard fits one BGP UPDATE, one route each.

Strategy. Block keys are keyed hashes, so they spread uniformly over 0..2^64-1; shard i
of 2^j covers the keys whose top j bits equal i, and every shard holds about n / 2^j
keys. ``build_shards`` picks the smallest j for which every shard's cache-summaries TLV
fits ``budget_bytes``, building and checking each shard (sizes are checked here, before
anything is announced: ExaBGP silently drops an UPDATE that is too large). Boundaries
are aligned, so while j stays put a change touches only the shards whose keys changed;
`ShardedSender` keeps j and a `SummarySender` per shard, raising j only when a shard no
longer fits. Each shard rides its own route, a host prefix inside a range the instance
owns (`shard_prefix`), because a transit passes on only its best path per prefix.

Budget arithmetic (RFC 4271 §4.3, RFC 8654): an UPDATE is 19 header + 2 + 2 length
bytes, the mandatory ORIGIN, AS_PATH and NEXT_HOP (or MP_REACH_NLRI for IPv6) and the
NLRI; our attribute's header takes 4 bytes with Extended Length. For one IPv4 /32 over
eBGP with a one-AS path that leaves 4044 bytes of attribute value in 4096 bytes, 65483
in 65535. Every transit AS prepends 4 bytes of AS_PATH, so pass the longest path the
UPDATE will carry (``as_path_hops``) — the lab measured about 65478 through one FRR
transit. The caller subtracts the rest of its advertisement (other TLVs, signature) as
``other_bytes``; what remains is the budget for the one-entry cache-summaries TLV.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from catsproto.summary.base import Summary, unique_keys
from catsproto.summary.versioning import SummarySender, SummaryUpdate

BGP_MAX_MESSAGE = 4096
BGP_EXTENDED_MAX_MESSAGE = 65535
ENTRY_OVERHEAD = 49
"""Bytes of a cache-summaries TLV with one entry, besides params and body: TLV type and
length (4), the entry's u16 length (2), its fixed fields (42) and the params length (1)."""
MAX_SHARD_BITS = 16


def attribute_value_budget(
    max_message_bytes: int = BGP_MAX_MESSAGE,
    *,
    ipv6: bool = False,
    prefix_len: int | None = None,
    as_path_hops: int = 1,
    extra_attribute_bytes: int = 0,
) -> int:
    """Largest value of our path attribute in one UPDATE announcing one prefix.

    extra_attribute_bytes: other attributes on the route (LOCAL_PREF over iBGP is 7,
    MED 7, communities ...). The result is capped at 65535 (the Extended Length field).
    """
    if prefix_len is None:
        prefix_len = 128 if ipv6 else 32
    nlri = 1 + (prefix_len + 7) // 8
    fixed = 19 + 2 + 2  # BGP header, withdrawn-routes length, path-attributes length
    fixed += 4  # ORIGIN
    fixed += 3 + (2 + 4 * as_path_hops if as_path_hops else 0)  # AS_PATH, one AS_SEQUENCE
    if ipv6:
        fixed += 3 + 2 + 1 + 1 + 16 + 1 + nlri  # MP_REACH_NLRI: AFI SAFI NH-len NH rsvd NLRI
    else:
        fixed += 7 + nlri  # NEXT_HOP, NLRI
    fixed += 4 + extra_attribute_bytes  # our attribute's header (Extended Length)
    return min(65535, max_message_bytes - fixed)


def entry_budget(max_message_bytes: int, other_bytes: int, **route: int | bool) -> int:
    """Budget for the cache-summaries TLV once the rest of the advertisement is counted."""
    budget = attribute_value_budget(max_message_bytes, **route) - other_bytes  # type: ignore[arg-type]
    if budget <= ENTRY_OVERHEAD:
        raise ValueError(f"no room for a summary: {budget} bytes left after {other_bytes}")
    return budget


def shard_range(index: int, shard_bits: int) -> tuple[int, int]:
    """Inclusive key range (key_lo, key_hi) of shard ``index`` of 2^shard_bits."""
    if not 0 <= shard_bits <= MAX_SHARD_BITS or not 0 <= index < 1 << shard_bits:
        raise ValueError(f"no shard {index} of 2^{shard_bits}")
    width = 1 << (64 - shard_bits)
    return index * width, (index + 1) * width - 1


def shard_of(keys: np.ndarray, shard_bits: int) -> np.ndarray:
    """Shard index of every key."""
    keys = np.asarray(keys, dtype=np.uint64)
    if shard_bits == 0:
        return np.zeros(keys.shape, dtype=np.intp)
    return (keys >> np.uint64(64 - shard_bits)).astype(np.intp)


def split_keys(keys: np.ndarray, shard_bits: int) -> list[np.ndarray]:
    """Sorted unique keys cut into their 2^shard_bits shards (keys must be sorted)."""
    if not 0 <= shard_bits <= MAX_SHARD_BITS:
        raise ValueError(f"shard_bits {shard_bits} outside 0..{MAX_SHARD_BITS}")
    lows = np.arange(1, 1 << shard_bits, dtype=np.uint64) << np.uint64(64 - shard_bits)
    bounds = [0, *np.searchsorted(keys, lows).tolist(), int(keys.size)]
    return [keys[a:b] for a, b in itertools.pairwise(bounds)]  # np.split's views, cheaper


def shard_prefix(
    instance_range: str | ipaddress.IPv4Network | ipaddress.IPv6Network, index: int
) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """The host route (/32 or /128) of shard ``index`` inside the instance's own range."""
    net = ipaddress.ip_network(instance_range)
    if not 0 <= index < net.num_addresses:
        raise ValueError(f"shard {index} does not fit in {net} ({net.num_addresses} addresses)")
    return ipaddress.ip_network((int(net.network_address) + index, net.max_prefixlen))


@dataclass(frozen=True)
class Shard:
    """One key range's summary, as it goes into one route's cache-summaries entry."""

    index: int
    shard_bits: int
    key_lo: int
    key_hi: int
    entry_count: int
    summary: Summary

    @property
    def tlv_bytes(self) -> int:
        """Bytes of a cache-summaries TLV carrying just this shard."""
        return ENTRY_OVERHEAD + self.summary.size()


class NoRoomError(ValueError):
    """The message size leaves a summary entry no room at all (a configuration that
    cannot work, whatever the cache holds)."""


def _check_budget(budget_bytes: int) -> None:
    if budget_bytes <= ENTRY_OVERHEAD:
        raise NoRoomError(
            f"budget of {budget_bytes} bytes leaves no room for a summary "
            f"(an entry's own fields take {ENTRY_OVERHEAD})"
        )


def _estimated_shard_bits(keys: np.ndarray, budget: int, target_fpr: float) -> int:
    _check_budget(budget)
    room = budget - ENTRY_OVERHEAD
    total = min(Summary.estimates(keys, target_fpr).values())
    if total <= room:
        return 0
    return min(MAX_SHARD_BITS, math.ceil(math.log2(total * 1.05 / room)))


def build_shards(
    keys: object,
    budget_bytes: int,
    target_fpr: float,
    *,
    kind: int | None = None,
    seed: int = 0,
    min_shard_bits: int = 0,
) -> list[Shard]:
    """Split ``keys`` into the fewest aligned shards whose TLVs each fit ``budget_bytes``."""
    ukeys = unique_keys(keys)
    _check_budget(budget_bytes)
    bits = max(min_shard_bits, _estimated_shard_bits(ukeys, budget_bytes, target_fpr))
    while bits <= MAX_SHARD_BITS:
        shards = []
        for i, part in enumerate(split_keys(ukeys, bits)):
            summary = Summary.build(part, target_fpr, kind=kind, seed=seed)
            lo, hi = shard_range(i, bits)
            shards.append(Shard(i, bits, lo, hi, int(part.size), summary))
            if shards[-1].tlv_bytes > budget_bytes:
                break
        else:
            return shards
        bits += 1
    raise ValueError(f"keys do not fit {1 << MAX_SHARD_BITS} shards of {budget_bytes} bytes")


@dataclass(frozen=True)
class ShardUpdate:
    """An announcement for one shard's route."""

    index: int
    shard_bits: int
    key_lo: int
    key_hi: int
    update: SummaryUpdate

    @property
    def tlv_bytes(self) -> int:
        return ENTRY_OVERHEAD + self.update.summary.size()


class ShardedSender:
    """Per-shard snapshots and deltas under a byte budget; only changed shards announce.

    When a shard's snapshot outgrows the budget the shard count doubles and every shard
    starts again with a snapshot; versions keep rising across the change so that a
    route's version never goes back.
    """

    def __init__(
        self,
        budget_bytes: int,
        target_fpr: float,
        *,
        kind: int | None = None,
        seed: int = 0,
        snapshot_every: int = 8,
        min_shard_bits: int = 0,
    ) -> None:
        _check_budget(budget_bytes)
        self.budget_bytes = budget_bytes
        self.target_fpr = target_fpr
        self.kind = kind
        self.seed = seed
        self.snapshot_every = snapshot_every
        self.shard_bits = min_shard_bits
        self._senders: list[SummarySender] = []
        self._next_version = 1

    def _reset(self, shard_bits: int) -> None:
        self.shard_bits = shard_bits
        first = max([s.version for s in self._senders] + [self._next_version - 1]) + 1
        self._next_version = first
        self._senders = [
            SummarySender(
                self.target_fpr,
                kind=self.kind,
                seed=self.seed,
                snapshot_every=self.snapshot_every,
                first_version=first,
            )
            for _ in range(1 << shard_bits)
        ]

    def update(self, keys: object, *, snapshot: Collection[int] = ()) -> list[ShardUpdate]:
        """Announcements for the new key set: every shard that changed, each within budget.

        The shards named in `snapshot` announce a snapshot (a new version) even when their
        keys did not change: the way in for a receiver that missed their last snapshot.
        """
        ukeys = unique_keys(keys)
        if not self._senders:
            bits = max(
                self.shard_bits, _estimated_shard_bits(ukeys, self.budget_bytes, self.target_fpr)
            )
            self._reset(bits)
        while True:
            out = self._try(ukeys, frozenset(snapshot))
            if out is not None:
                return out
            if self.shard_bits >= MAX_SHARD_BITS:
                raise ValueError("keys do not fit the maximum number of shards")
            self._reset(self.shard_bits + 1)

    def _try(self, ukeys: np.ndarray, snapshot: frozenset[int]) -> list[ShardUpdate] | None:
        trial = [copy.copy(s) for s in self._senders]
        out: list[ShardUpdate] = []
        for i, (sender, part) in enumerate(
            zip(trial, split_keys(ukeys, self.shard_bits), strict=True)
        ):
            update = sender.update(part, force_snapshot=i in snapshot)
            if update is None:
                continue
            if ENTRY_OVERHEAD + update.summary.size() > self.budget_bytes and update.is_delta:
                trial[i] = sender = copy.copy(self._senders[i])
                update = sender.update(part, force_snapshot=True)
                assert update is not None
            if ENTRY_OVERHEAD + update.summary.size() > self.budget_bytes:
                return None
            lo, hi = shard_range(i, self.shard_bits)
            out.append(ShardUpdate(i, self.shard_bits, lo, hi, update))
        self._senders = trial
        return out

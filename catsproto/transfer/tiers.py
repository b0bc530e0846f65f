"""Promotion and demotion between tiers over the same block path as a network pull.

Strategy: a move from one tier to another is a pull whose holder reads the source
tier's store and whose puller admits into the destination's: the same frames, the same
digest check per block, the same "admit only a completed run" rule — so a block that
rotted on SSD is refused on its way up exactly as a tampered block from the network
would be. What differs is the clock: the holder is paced at the tier link's bandwidth
and starts after its latency, on a *modelled* clock (`now` in seconds, advanced to each
`next_send_at`), so a move returns how long it would take. A tier link between two tiers
costs what the slower of them (the later in `TieredCache.order`) advertises:
`fetch_latency_us` once, then `fetch_bandwidth_mbps`. Every move is applied to the
`TieredCache` too (mirror mode: `remove` from one tier, `store` in the other), so the
node's next advertisement lists the block in the tier where it now lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from catsproto.node.cache import TieredCache
from catsproto.transfer.content import StoredBlock
from catsproto.transfer.holder import Holder
from catsproto.transfer.puller import Completed, Puller
from catsproto.wire import Tier


@dataclass(frozen=True, slots=True)
class TierLink:
    latency_s: float
    bytes_per_s: float  # 0: unlimited

    @classmethod
    def between(cls, cache: TieredCache, a: Tier, b: Tier) -> TierLink:
        slower = cache.specs[max(a, b, key=cache.order.index)]
        return cls(slower.fetch_latency_us / 1e6, slower.fetch_bandwidth_mbps * 1e6 / 8)

    def seconds(self, nbytes: int) -> float:
        """The model's time for `nbytes` (no burst): latency + bytes ÷ bandwidth."""
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)


@dataclass(frozen=True, slots=True)
class TierMove:
    source: Tier
    destination: Tier
    moved: tuple[int, ...]  # keys now in the destination, prefix order
    recompute_from: int | None  # first key the source no longer had
    payload_bytes: int
    seconds: float  # modelled duration of the move


class TierStores:
    """Block payloads per tier, kept in step with a `TieredCache` (mirror mode)."""

    def __init__(self, cache: TieredCache, epoch: int = 1) -> None:
        self.cache = cache
        self.epoch = epoch
        self.blocks: dict[Tier, dict[int, StoredBlock]] = {t: {} for t in cache.order}
        self._transfers = 0

    def put(self, tier: Tier, block: StoredBlock) -> None:
        self.blocks[tier][block.key] = block
        self.cache.store(tier, block.key)

    def get(self, tier: Tier, key: int) -> StoredBlock | None:
        return self.blocks[tier].get(key)

    def drop(self, tier: Tier, key: int) -> None:
        """Evict: the payload and the cache model's entry go together."""
        self.blocks[tier].pop(key, None)
        self.cache.remove(tier, key)

    def holding(self, key: int) -> Tier | None:
        for t in self.cache.order:
            if key in self.blocks[t]:
                return t
        return None

    def admit(self, tier: Tier, completed: Completed) -> tuple[int, ...]:
        """Admit a completed pull's verified run into `tier`; returns the keys admitted."""
        for b in completed.blocks:
            self.put(tier, b)
        return tuple(b.key for b in completed.blocks)

    def move(self, keys: Sequence[int], source: Tier, destination: Tier, now: float) -> TierMove:
        """Move the prefix `keys` from `source` to `destination` through the block path."""
        if source == destination:
            raise ValueError("a move needs two different tiers")
        link = TierLink.between(self.cache, source, destination)
        self._transfers += 1
        src = self.blocks[source]
        holder = Holder(
            src.get, self.epoch, chunk=64 << 10, rate_bps=link.bytes_per_s, burst_bytes=0
        )
        puller = Puller(self._transfers, keys)
        holder.receive(puller.start())
        t = now + link.latency_s
        completed: Completed | None = None
        while completed is None:
            data = holder.send(t)
            if data:
                for ev in puller.receive(data):
                    if isinstance(ev, Completed):
                        completed = ev
                continue
            nxt = holder.next_send_at(t)
            if nxt is None:
                puller.end_of_stream()  # raises: the holder stopped without finishing
                break
            t = max(t, nxt)
        assert completed is not None
        moved = self.admit(destination, completed)
        for k in moved:
            src.pop(k, None)
            self.cache.remove(source, k)
        return TierMove(
            source,
            destination,
            moved,
            completed.recompute_from,
            sum(len(b.payload) for b in completed.blocks),
            t - now,
        )

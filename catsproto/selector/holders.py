"""Pricing the holders of a prompt's leading run for a remote pull: what only their
summaries decide, kept per table generation, and the ranking with each candidate's
terms. Pure; used by `catsproto.selector.selector.PathSelector`."""

from __future__ import annotations

import math

import numpy as np

from catsproto.selector.decision import Estimate, SelectorConfig
from catsproto.selector.rib import Instance, ServiceTable
from catsproto.wire import Tier


def _transfer_ms(nbytes: float, mbps: float) -> float:
    return 0.0 if mbps == math.inf or nbytes == 0 else nbytes * 8 / (mbps * 1000)


def _tier_fetch_ms(inst: Instance, tiers: np.ndarray) -> float:
    if len(inst.tiers) == 1 and Tier.HBM in inst.tiers:
        return 0.0
    total = 0.0
    for code in np.unique(tiers).tolist():
        if code in (0, Tier.HBM):
            continue
        t = inst.tiers[Tier(code)]
        blocks = int(np.count_nonzero(tiers == code))
        total += t.fetch_latency_us / 1000 + _transfer_ms(
            blocks * t.bytes_per_block, t.fetch_bandwidth_mbps
        )
    return total


def _new_estimate(**terms: object) -> Estimate:
    """An Estimate built without the frozen dataclass's generated __init__ (one
    object.__setattr__ per field: 2 µs of a decision that takes 30)."""
    est = object.__new__(Estimate)
    est.__dict__.update(terms)
    return est


class _Holders:
    """The instances holding a leading run of one prompt, and what each run is worth:
    everything of the holders' pricing that only their summaries decide (so it holds
    for one table generation). `src` is the position of the best KV source (most
    expected blocks, then lowest slot), -1 when nobody holds anything."""

    __slots__ = (
        "_at",
        "deep",
        "ends",
        "expected",
        "generation",
        "held",
        "hs",
        "idx",
        "ks",
        "loose",
        "loose_left",
        "pull",
        "recalled",
        "src",
        "src_cached_tokens",
        "src_slot",
        "uncached",
    )

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.src = -1
        self.pull: tuple | None = None  # the source's pull terms, see _pull_terms
        self._at: dict[int, int] | None = None
        self.loose_left = False  # some run in `ks` is only an upper bound (`loose`)
        self.recalled = False  # handed out again from the plans remembered
        # positions of keys that exact runs missed short of their bounds (ascending),
        # each asked of every holder still loose when it was found (`_verified`)
        self.ends: list[int] = []

    @classmethod
    def price(
        cls,
        table: ServiceTable,
        cfg: SelectorConfig,
        hs: np.ndarray,
        ks: np.ndarray,
        tokens: int,
        slots: np.ndarray,
        pick: slice | np.ndarray,
        loose: np.ndarray,
        held: np.ndarray,
    ) -> _Holders:
        """`ks` are the runs (upper bounds where `loose`), `held` how many leading keys
        each holder is known to hold (its run where exact)."""
        plan = cls(table.generation)
        if not len(hs):
            return plan
        plan.hs, plan.ks, plan.loose, plan.held = hs, ks, loose, held
        plan.loose_left = bool(loose.any())
        plan.idx = hs if isinstance(pick, slice) else np.searchsorted(slots, hs)
        exp_blocks = np.maximum(0.0, ks - table.fp_discount[hs])
        stale = table.stale[hs]
        if stale.any():
            exp_blocks[stale] *= cfg.stale_confidence
        block = table.block_size[hs]
        if not block.all():
            block = np.where(block > 0, block, cfg.default_block_size)
        cached_tokens = np.minimum(tokens, exp_blocks * block)
        plan.expected, plan.uncached = exp_blocks, tokens - cached_tokens
        # holders with tiers beyond HBM: their fetch cost is worked out per decision
        plan.deep = np.flatnonzero(~table.hbm_only[hs]).tolist()
        most = exp_blocks == exp_blocks.max()
        j = int(np.flatnonzero(most)[np.argmin(hs[most])])
        plan.src, plan.src_slot, plan.src_cached_tokens = j, int(hs[j]), float(cached_tokens[j])
        return plan

    def at(self, i: int) -> int | None:
        """The holder position of candidate `i`, if it is a holder."""
        if self._at is None:
            self._at = {c: j for j, c in enumerate(self.idx.tolist())}
        return self._at.get(i)


class _Priced:
    """One decision's estimate vectors (indexed by candidate), the holders' terms and
    the remote-KV option where it won: enough to write out any candidate's terms."""

    __slots__ = (
        "evict",
        "evicted",
        "fetch_h",
        "plan",
        "prefill_full",
        "prefill_h",
        "queue",
        "remote",
        "rtt",
        "total",
        "upload",
    )

    def __init__(
        self,
        rtt: np.ndarray,
        upload: np.ndarray,
        queue: np.ndarray,
        total: np.ndarray,
        prefill_full: np.ndarray,
    ) -> None:
        self.rtt, self.upload, self.queue, self.total = rtt, upload, queue, total
        self.prefill_full = prefill_full
        self.plan: _Holders | None = None
        self.fetch_h: np.ndarray | None = None  # None: every holder fetches from HBM (0)
        self.prefill_h: np.ndarray | None = None
        # (candidates better off pulling, pull ms, prefill ms, source slot)
        self.remote: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
        # blocks each candidate's placement evicts and their ms (part of `total`);
        # None: evictions not priced
        self.evicted: np.ndarray | None = None
        self.evict: np.ndarray | None = None

    def price_holders(
        self,
        plan: _Holders,
        table: ServiceTable,
        keys: np.ndarray,
        base: np.ndarray,
        ms_per_token: np.ndarray,
    ) -> None:
        """Write the holders' estimates into `total`: base + KV fetch + the prefill of
        what their run leaves uncached."""
        self.plan = plan
        idx = plan.idx
        self.prefill_h = prefill_h = plan.uncached * ms_per_token[idx]
        held = base[idx]
        if plan.deep:
            self.fetch_h = fetch_h = np.zeros(len(idx))
            for j in plan.deep:
                inst = table.instances[int(plan.hs[j])]
                assert inst is not None
                fetch_h[j] = _tier_fetch_ms(inst, inst.prefix_tiers(keys[: plan.ks[j]]))
            held += fetch_h
        held += prefill_h
        self.total[idx] = held

    def ranking(self, weight: float) -> np.ndarray:
        """What the candidates are ranked by: `total` itself (the same array) when
        `weight` is 0, else total + weight x each candidate's prefill ms. A holder priced
        at the bound of its run has its least prefill there, so its rank is a lower
        bound too."""
        if not weight:
            return self.total
        prefill = self.prefill_full.copy()
        if self.plan is not None and self.prefill_h is not None:
            prefill[self.plan.idx] = self.prefill_h
        if self.remote is not None:
            took = self.remote[0]
            prefill[took] = self.remote[2][took]
        prefill *= weight
        prefill += self.total
        return prefill

    def eviction(self, i: int) -> tuple[float, float]:
        """Candidate `i`'s evicted blocks and their ms."""
        if self.evict is None or self.evicted is None:
            return 0.0, 0.0
        return float(self.evicted[i]), float(self.evict[i])

    def terms(self, i: int) -> tuple[int, float, float, float]:
        """Candidate `i`'s cached blocks, expected cached blocks, fetch ms, prefill ms."""
        plan = self.plan
        j = plan.at(i) if plan is not None else None
        if j is None:
            cached, expected, fetch, prefill = 0, 0.0, 0.0, float(self.prefill_full[i])
        else:
            assert plan is not None and self.prefill_h is not None
            cached, expected = int(plan.ks[j]), float(plan.expected[j])
            fetch = float(self.fetch_h[j]) if self.fetch_h is not None else 0.0
            prefill = float(self.prefill_h[j])
        remote = self.remote
        if remote is not None and remote[0][i]:
            fetch, prefill = float(remote[1][i]), float(remote[2][i])
        return cached, expected, fetch, prefill

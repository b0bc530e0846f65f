"""What a path selector is asked and what it answers: requests, estimates, decisions,
its configuration. Pure data (the selector's work is `catsproto.selector.selector`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from catsproto.selector.pending import PENDING_MODES
from catsproto.selector.rib import IPAddress


@dataclass(frozen=True)
class CarriedPull:
    """A pull of the request's prefix from a source this selector need not hold in its
    RIB (another site's instance, say), priced by the C-PS that planned it: the ingress's
    winner pulled from there, and the request carries the plan to the site's C-PS. The
    pull costs the same to every instance of one site (same link, same source tiers), so
    it is offered to each candidate as priced: fetch_ms for the pull, prefill_ms for what
    the source's prefix leaves to compute."""

    source: IPAddress
    fetch_ms: float
    prefill_ms: float

    def __post_init__(self) -> None:
        for name in ("fetch_ms", "prefill_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"carried pull {name} must be a finite number >= 0, not {value!r}")


@dataclass(frozen=True)
class Request:
    cs_id: int
    block_keys: np.ndarray  # uint64, prompt order
    prompt_tokens: int
    ingress: str
    # a pull planned elsewhere, offered to every candidate besides its own options
    carried_pull: CarriedPull | None = None
    # the (model id, key scheme, secret id) the block keys were computed in: only
    # instances advertising that key space are asked for them (a secret rotation, another
    # model). None: every instance (a caller whose fleet shares one key space)
    key_space: tuple[str, int, int] | None = None

    def __post_init__(self) -> None:
        keys = np.asarray(self.block_keys, dtype=np.uint64).reshape(-1)
        object.__setattr__(self, "block_keys", keys)
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")


@dataclass(frozen=True)
class Estimate:
    """Every term of one candidate's time-to-first-token estimate (ms unless noted)."""

    address: IPAddress
    site_id: int
    path: tuple[str, ...]
    rtt_ms: float
    upload_ms: float
    queue_ms: float
    cached_blocks: int  # leading request blocks found in the summaries used
    expected_cached_blocks: float  # after pricing false positives and staleness
    fpr: float
    stale: bool
    kv_source: IPAddress | None  # another instance the prefix is pulled from, if any
    fetch_ms: float
    prefill_ms: float
    total_ms: float
    # what storing the prompt's new blocks there evicts that others would reuse
    # (`catsproto.selector.occupancy`): blocks, and their worth in ms; part of total_ms
    evicted_blocks: float = 0.0
    evict_ms: float = 0.0

    def terms(self) -> dict[str, object]:
        return {
            "instance": str(self.address),
            "site": self.site_id,
            "path": list(self.path),
            "rtt_ms": round(self.rtt_ms, 3),
            "upload_ms": round(self.upload_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "cached_blocks": self.cached_blocks,
            "expected_cached_blocks": round(self.expected_cached_blocks, 3),
            "fpr": self.fpr,
            "stale": self.stale,
            "kv_source": str(self.kv_source) if self.kv_source else None,
            "fetch_ms": round(self.fetch_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "evicted_blocks": round(self.evicted_blocks, 3),
            "evict_ms": round(self.evict_ms, 3),
            "ttft_ms": round(self.total_ms, 3),
        }


class Decision:
    """The chosen candidate's estimate, the runner-up's (worked out when first asked
    for: most callers only route), and how many candidates there were. `carried` is the
    request's carried pull at its best candidate, whether it won or not (None: the
    request carried none, or one from a source the RIB holds, which the selector prices
    itself)."""

    __slots__ = ("_runner", "_runner_of", "candidates", "carried", "chosen")

    def __init__(
        self,
        chosen: Estimate,
        runner_up: Estimate | Callable[[], Estimate | None] | None,
        candidates: int,
        carried: Estimate | None = None,
    ) -> None:
        self.chosen = chosen
        self.candidates = candidates
        self.carried = carried
        self._runner_of = runner_up if callable(runner_up) else None
        self._runner = None if callable(runner_up) else runner_up

    @property
    def runner_up(self) -> Estimate | None:
        if self._runner_of is not None:
            self._runner, self._runner_of = self._runner_of(), None
        return self._runner

    def __repr__(self) -> str:
        return f"Decision(chosen={self.chosen!r}, runner_up={self.runner_up!r})"

    def explain(self) -> str:
        lines = []
        for label, est in (("chosen", self.chosen), ("runner-up", self.runner_up)):
            if est is None:
                continue
            source = f", KV from {est.kv_source}" if est.kv_source else ""
            lines.append(
                f"{label}: {est.address} (site {est.site_id}) ttft {est.total_ms:.1f} ms = "
                f"rtt {est.rtt_ms:.1f} + upload {est.upload_ms:.1f} + queue {est.queue_ms:.1f}"
                f" + fetch {est.fetch_ms:.1f} + prefill {est.prefill_ms:.1f}"
                f" + evict {est.evict_ms:.1f} ({est.evicted_blocks:g} blocks); "
                f"cached {est.cached_blocks} blocks (expected {est.expected_cached_blocks:.2f}, "
                f"fpr {est.fpr:.3g}{', stale' if est.stale else ''}{source}); "
                f"path {' > '.join(est.path)}"
            )
        return "\n".join(lines)


@dataclass
class SelectorConfig:
    site_nodes: Mapping[int, str] = field(default_factory=dict)  # site id → graph node
    request_bytes_per_token: float = 4.0
    stale_confidence: float = 0.5
    allow_remote_kv: bool = True
    default_block_size: int = 512
    spread_ms: float = 0.0  # near-equal margin for the power-of-two choice; 0: exact argmin
    # Selectors steering onto the same instances (one per ingress, say). Each assumes the
    # others sent as much work as it did since an instance's last advertisement.
    peer_selectors: int = 1
    seed: int = 0  # distinct per selector, so selectors spread differently
    # Rank candidates by ttft + work_weight x prefill ms (the instance time the choice
    # uses up) instead of by ttft alone; the estimates keep the real terms. 0: ttft only.
    work_weight: float = 0.0
    # How the work this selector sent since an instance's advertisement enters its queue
    # term (catsproto.selector.pending): "count" in full until an advertisement counts
    # it (times peer_selectors), "drain" replayed as an FCFS queue at the advertised rate.
    pending: str = "count"
    # Price what a placement evicts (`catsproto.selector.occupancy`): storing a prompt's
    # new blocks at an instance without free KV blocks costs the evicted blocks' prefill
    # times the chance they are wanted again within `reuse_horizon_ms`.
    price_evictions: bool = True
    reuse_horizon_ms: float = 120_000.0

    def __post_init__(self) -> None:
        if not (self.reuse_horizon_ms > 0 and math.isfinite(self.reuse_horizon_ms)):
            raise ValueError(
                f"reuse_horizon_ms must be a finite number > 0, not {self.reuse_horizon_ms}"
            )
        if not (self.work_weight >= 0 and math.isfinite(self.work_weight)):
            raise ValueError(f"work_weight must be a finite number >= 0, not {self.work_weight}")
        if self.pending not in PENDING_MODES:
            raise ValueError(
                f"pending must be one of {', '.join(PENDING_MODES)}, not {self.pending!r}"
            )
        if self.pending == "drain" and self.peer_selectors != 1:
            raise ValueError("peer_selectors applies to counted pending work (pending='count')")

    def node_of(self, site_id: int) -> str:
        return self.site_nodes.get(site_id, f"site{site_id}")


class NoInstanceError(LookupError):
    """No live, reachable instance serves the requested CS-ID."""

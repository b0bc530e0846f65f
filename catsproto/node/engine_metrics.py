"""A vLLM engine's own metrics, and the `ComputeState` the node derives from them.

Strategy. The adapter (`catsproto.adapters.vllm_metrics`) scrapes the engine's
Prometheus text into an `EngineMetrics` snapshot: the engine's cache configuration
(block size, KV blocks) and its gauges and counters as vLLM exports them, each summed
over the engines of a data-parallel server. Everything after that is here and pure: the
time of a scrape is a field of the snapshot, the caller's clock, not ours.

`update_prefill_rate` measures the engine's prefill rate from two counters vLLM keeps
per finished request: ``vllm:request_prefill_kv_computed_tokens`` (prompt tokens it
computed, cache hits excluded) and ``vllm:request_prefill_time_seconds`` (time in the
prefill phase). Their ratio over a window is tokens per second of prefill. A window
closes when the engine has computed at least ``min_tokens`` tokens in it, so a
handful of tiny prompts, whose time is mostly fixed per-request overhead, cannot swing
the rate; until the first window closes the node advertises its configured rate
(`--prefill-rate`). The first window starts at the engine's own start (counters at 0),
so a node that joins a busy engine measures at once. If the counters go backwards
(the engine restarted) the window starts again from 0 and the last rate stands.
`restarted` tells a new engine process from the old one by the process start time
the server exports.

The rate is per request: requests prefilled in one batch each count their full prefill
time, so under batching the sum of times exceeds the wall time and the rate is lower
than the engine's aggregate throughput. The node then over-estimates queue waits, the
safe side (a selector sends less to it, not more).

`engine_compute_state` fills the `ComputeState`:

* waiting, running: ``vllm:num_requests_waiting`` / ``_running`` as scraped;
* kv_utilisation: ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full, despite the name):
  the blocks that running requests hold; cached blocks no request uses count as free,
  so an idle engine with a full prefix cache reports 0;
* outstanding_prefill_tokens: (waiting requests + half the running ones) × the mean
  computed (uncached) prompt tokens per request of the last window (of the engine's
  life before the first window closes; 0 before any request finished). vLLM does not
  export the tokens of the requests it holds, so this is an estimate: a waiting
  request's cache hits are assumed to be those of an average request, and a running
  one, of which vLLM does not say how far along it is, to have half its prefill left
  (its expected remainder when it is seen at a random moment of it). Counting running
  requests as done under-estimated every wait by up to one prefill, because a selector
  drops its own record of the work it sent once an advertisement built after it
  arrives (`selector.pending`): measured with the lab's engines, catsproto's estimated
  TTFT fell 120-180 ms short of the real one on busy engines (decision record 0003);
* utilisation: 1 while a request is running (as the modelled instance reports it);
  otherwise the in-engine time of the requests that finished since the previous scrape
  (``vllm:request_inference_time_seconds``) over the wall time between the two, capped
  at 1, so short requests that came and went between scrapes still count; 0 without a
  previous scrape or that counter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from catsproto.node.metrics import ComputeState

__all__ = [
    "MIN_MEASURED_TOKENS",
    "EngineMetrics",
    "EngineMetricsError",
    "PrefillRate",
    "engine_compute_state",
    "restarted",
    "update_prefill_rate",
]

MIN_MEASURED_TOKENS = 2048
"""Computed prompt tokens a measuring window needs before its rate is used."""


class EngineMetricsError(ValueError):
    """An engine's metrics text that does not say what the node needs. ``missing`` names
    the vLLM metrics that were absent (empty when something else was wrong)."""

    def __init__(self, reason: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of a vLLM engine's /metrics. Counters are totals since the engine
    started; a counter the engine does not export is None. Summed over engines (the
    data-parallel ranks a server reports, label ``engine``); the KV usage is their mean."""

    at_s: float
    """When the scrape was taken (the caller's monotonic clock, seconds)."""
    block_size: int
    num_gpu_blocks: int
    engines: int
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage_perc: float
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    prompt_tokens_cached_total: float | None = None
    time_to_first_token_seconds_sum: float | None = None
    time_to_first_token_seconds_count: float | None = None
    request_prefill_time_seconds_sum: float | None = None
    request_prefill_kv_computed_tokens_sum: float | None = None
    request_prefill_kv_computed_tokens_count: float | None = None
    request_inference_time_seconds_sum: float | None = None
    process_start_time_seconds: float | None = None
    """When the engine's server process started (Unix seconds, Prometheus' process
    collector): a new value means a new process, one that holds none of the old
    one's blocks, whatever its event sequence says."""

    @property
    def prefix_hit_ratio(self) -> float | None:
        """Prefix-cache hits ÷ queries, in tokens, over the engine's life."""
        q, h = self.prefix_cache_queries_total, self.prefix_cache_hits_total
        return h / q if q and h is not None else None

    @property
    def mean_ttft_s(self) -> float | None:
        s, n = self.time_to_first_token_seconds_sum, self.time_to_first_token_seconds_count
        return s / n if n and s is not None else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["at_s"]
        out["prefix_hit_ratio"] = self.prefix_hit_ratio
        out["mean_ttft_s"] = self.mean_ttft_s
        return out


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """The prefill rate the node advertises and the window it is being measured over.

    ``base_*`` are the engine's counters where the open window starts;
    ``tokens_per_request`` is the mean computed prompt tokens per request of the last
    closed window (None until one closed)."""

    tps: float
    measured: bool = False
    base_tokens: float = 0.0
    base_seconds: float = 0.0
    base_requests: float = 0.0
    tokens_per_request: float | None = None
    windows: int = 0
    """Windows closed so far (each one a measurement)."""

    def __post_init__(self) -> None:
        if not 0 < self.tps < math.inf:
            raise ValueError(f"prefill rate {self.tps} is not a positive number")

    @property
    def source(self) -> str:
        return "measured" if self.measured else "configured"


def update_prefill_rate(
    rate: PrefillRate, current: EngineMetrics, min_tokens: int = MIN_MEASURED_TOKENS
) -> PrefillRate:
    """`rate` after the snapshot `current`: a new measurement if the open window now
    holds at least `min_tokens` computed tokens, else `rate` unchanged (or restarted
    from 0 if the engine's counters went backwards)."""
    tokens = current.request_prefill_kv_computed_tokens_sum
    seconds = current.request_prefill_time_seconds_sum
    requests = current.request_prefill_kv_computed_tokens_count
    if tokens is None or seconds is None or requests is None:
        return rate  # this engine does not export them: the configured rate stands
    if tokens < rate.base_tokens or seconds < rate.base_seconds or requests < rate.base_requests:
        return replace(rate, base_tokens=0.0, base_seconds=0.0, base_requests=0.0)
    d_tokens = tokens - rate.base_tokens
    d_seconds = seconds - rate.base_seconds
    d_requests = requests - rate.base_requests
    if d_tokens < max(1, min_tokens) or d_seconds <= 0 or d_requests <= 0:
        return rate
    return PrefillRate(
        tps=d_tokens / d_seconds,
        measured=True,
        base_tokens=tokens,
        base_seconds=seconds,
        base_requests=requests,
        tokens_per_request=d_tokens / d_requests,
        windows=rate.windows + 1,
    )


def _tokens_per_request(rate: PrefillRate, current: EngineMetrics) -> float:
    if rate.tokens_per_request is not None:
        return rate.tokens_per_request
    tokens = current.request_prefill_kv_computed_tokens_sum
    requests = current.request_prefill_kv_computed_tokens_count
    if tokens is None or not requests:
        return 0.0
    return tokens / requests


def _utilisation(previous: EngineMetrics | None, current: EngineMetrics) -> float:
    if current.num_requests_running:
        return 1.0
    busy = current.request_inference_time_seconds_sum
    if previous is not None and busy is not None:
        before = previous.request_inference_time_seconds_sum
        elapsed = current.at_s - previous.at_s
        if before is not None and busy >= before and elapsed > 0:
            return min(1.0, (busy - before) / elapsed)
    return 0.0


def engine_compute_state(
    previous: EngineMetrics | None, current: EngineMetrics, rate: PrefillRate
) -> ComputeState:
    """The node's `ComputeState` from the latest snapshot (and the one before it, for
    the utilisation), with `rate` already updated by `current` (module docstring)."""
    queued = current.num_requests_waiting + current.num_requests_running / 2
    outstanding = queued * _tokens_per_request(rate, current)
    return ComputeState(
        waiting=current.num_requests_waiting,
        running=current.num_requests_running,
        outstanding_prefill_tokens=round(outstanding),
        prefill_rate_tps=rate.tps,
        utilisation=_utilisation(previous, current),
        kv_utilisation=max(0.0, min(1.0, current.kv_cache_usage_perc)),
    )


def restarted(before: EngineMetrics, after: EngineMetrics) -> bool:
    """Whether `after` was scraped from another engine process than `before`: both
    carry a process start time and they differ. Unknown (an engine that does not export
    it) is never taken for a restart."""
    a, b = before.process_start_time_seconds, after.process_start_time_seconds
    return a is not None and b is not None and a != b

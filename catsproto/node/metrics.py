"""CATS compute metrics of one instance: raw L0 values and normalised L1/L2 scores.

Strategy. The instance reports a `ComputeState` (queue, outstanding prefill tokens,
prefill rate, utilisation); everything else is derived here, deterministically, so a
receiver could recompute the scores from the L0 values and the Metrics Basis TLV that
names the function and its reference delay. The estimated queueing delay (outstanding
prefill tokens ÷ prefill rate) is the figure that matters for time to first token, so it
appears as an L0 `queue-delay` value (type 7, source: estimated; -00 called the type
`ttft`) and drives the service score. Scores follow the CATS metric framework: 0 worst,
10 best; 0-3 low, 4-7 medium, 8-10 high (the WG's score semantics).

L1 scores (normalisation function 1, queue-reference):
  computing = 10 × (1 − utilisation)                          (utilisation in 0..1)
  service   = 10 × ref / (ref + wait_ms)                      (ref: `wait_ref_ms`)
L2 score = the smaller of the two (an instance is as good as its weaker side).
All are rounded half up and clamped to 0..10. No communication score: the origin does
not know the path to a selector; the selector adds the network itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from catsproto.wire import (
    L0Metric,
    L1Score,
    MetricCategory,
    MetricsBasis,
    MetricsL0,
    MetricsL1,
    MetricsL2,
    NormalisationFunction,
    Source,
    Statistic,
    Unit,
)

__all__ = [
    "DEFAULT_BASIS",
    "METRIC_GPU_UTILIZATION",
    "METRIC_KV_CACHE_UTILIZATION",
    "METRIC_OUTSTANDING_PREFILL_TOKENS",
    "METRIC_PREFILL_THROUGHPUT",
    "METRIC_QUEUE_DELAY",
    "METRIC_RUNNING_REQUESTS",
    "METRIC_TTFT",
    "METRIC_WAITING_REQUESTS",
    "CatsMetrics",
    "ComputeState",
    "ScoreScale",
    "cats_metrics",
]

# L0 metric type codes (catsproto.wire.L0_METRIC_NAMES; 11 is not named there yet).
METRIC_GPU_UTILIZATION = 1
METRIC_RUNNING_REQUESTS = 2
METRIC_WAITING_REQUESTS = 3
METRIC_PREFILL_THROUGHPUT = 4
METRIC_KV_CACHE_UTILIZATION = 6
METRIC_QUEUE_DELAY = 7  # the estimated queueing delay; -00 named type 7 "ttft"
METRIC_TTFT = METRIC_QUEUE_DELAY  # the -00 name, for callers
METRIC_OUTSTANDING_PREFILL_TOKENS = 11


@dataclass(frozen=True, slots=True)
class ComputeState:
    """What the instance knows about its own load right now.

    waiting: requests queued, not started. running: requests in prefill or decode.
    outstanding_prefill_tokens: prompt tokens still to prefill (queued and running,
    cache hits excluded). prefill_rate_tps: tokens per second the instance prefills.
    utilisation: busy fraction of the accelerator, 0..1. kv_utilisation: used fraction
    of the fastest tier, 0..1.
    """

    waiting: int = 0
    running: int = 0
    outstanding_prefill_tokens: int = 0
    prefill_rate_tps: float = 1.0
    utilisation: float = 0.0
    kv_utilisation: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_rate_tps <= 0 or not math.isfinite(self.prefill_rate_tps):
            raise ValueError(f"prefill_rate_tps must be > 0, got {self.prefill_rate_tps}")
        if self.waiting < 0 or self.running < 0 or self.outstanding_prefill_tokens < 0:
            raise ValueError("counts must be >= 0")

    @property
    def wait_ms(self) -> float:
        """Estimated time before a new request's prefill starts."""
        return 1000.0 * self.outstanding_prefill_tokens / self.prefill_rate_tps


@dataclass(frozen=True, slots=True)
class ScoreScale:
    """Parameters of the normalisation, advertised in the Metrics Basis TLV.

    wait_ref_ms: the queueing delay that scores 5 on service (R; whole milliseconds, at
    least 1, as the TLV carries it). window_ms: the Measurement Window advertised; the
    WG's default, 10 s. This origin sends only statistic `current`, so nothing it sends
    is averaged over the window.
    """

    wait_ref_ms: float = 1000.0
    window_ms: int = 10_000

    def __post_init__(self) -> None:
        ref = self.wait_ref_ms
        if not math.isfinite(ref) or ref < 1 or ref != int(ref) or ref > 0xFFFFFFFF:
            raise ValueError(f"wait_ref_ms must be whole milliseconds 1..2^32-1, got {ref}")
        if not 1 <= self.window_ms <= 0xFFFFFFFFFFFFFFFF:
            raise ValueError(f"window_ms must be 1..2^64-1, got {self.window_ms}")

    def basis(self) -> MetricsBasis:
        """The Metrics Basis TLV that states these parameters."""
        return MetricsBasis(
            self.window_ms, NormalisationFunction.QUEUE_REFERENCE, int(self.wait_ref_ms)
        )


DEFAULT_BASIS = ScoreScale().basis()


@dataclass(frozen=True, slots=True)
class CatsMetrics:
    l0: MetricsL0
    l1: MetricsL1
    l2: MetricsL2
    basis: MetricsBasis = DEFAULT_BASIS

    @property
    def score(self) -> int:
        return self.l2.score


def _score(x: float) -> int:
    return max(0, min(10, math.floor(x + 0.5)))


def _clamp01(x: float) -> float:
    return max(0.0, min(1.0, x))


def cats_metrics(state: ComputeState, scale: ScoreScale | None = None) -> CatsMetrics:
    """L0 values, L1 scores (compute, service) and the L2 score for `state`."""
    scale = scale or ScoreScale()
    cur, meas, est = Statistic.CURRENT, Source.MEASURED, Source.ESTIMATED
    util = _clamp01(state.utilisation)
    wait = state.wait_ms
    l0 = MetricsL0(
        (
            L0Metric(METRIC_GPU_UTILIZATION, Unit.PERCENT, cur, meas, 100.0 * util),
            L0Metric(METRIC_RUNNING_REQUESTS, Unit.COUNT, cur, meas, float(state.running)),
            L0Metric(METRIC_WAITING_REQUESTS, Unit.COUNT, cur, meas, float(state.waiting)),
            L0Metric(
                METRIC_PREFILL_THROUGHPUT,
                Unit.TOKENS_PER_SECOND,
                cur,
                Source.NOMINAL,
                float(state.prefill_rate_tps),
            ),
            L0Metric(
                METRIC_KV_CACHE_UTILIZATION,
                Unit.PERCENT,
                cur,
                meas,
                100.0 * _clamp01(state.kv_utilisation),
            ),
            L0Metric(METRIC_QUEUE_DELAY, Unit.MILLISECONDS, cur, est, wait),
            L0Metric(
                METRIC_OUTSTANDING_PREFILL_TOKENS,
                Unit.COUNT,
                cur,
                meas,
                float(state.outstanding_prefill_tokens),
            ),
        )
    )
    computing = _score(10.0 * (1.0 - util))
    service = _score(10.0 * scale.wait_ref_ms / (scale.wait_ref_ms + wait))
    l1 = MetricsL1(
        (L1Score(MetricCategory.COMPUTING, computing), L1Score(MetricCategory.SERVICE, service))
    )
    return CatsMetrics(l0, l1, MetricsL2(min(computing, service)), scale.basis())

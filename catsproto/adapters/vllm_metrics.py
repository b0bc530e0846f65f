"""A vLLM engine's Prometheus /metrics: scraped, parsed, and turned into the node's load.

Strategy. `parse_metrics` reads the text with prometheus_client's parser into an
`EngineMetrics` (`catsproto.node.engine_metrics`): ``vllm:cache_config_info``'s labels
give the block size and the KV blocks (``num_gpu_blocks``), the queue gauges and the KV
usage are required, every counter the node uses beyond them is optional (None when the
engine does not export it). Series of one metric are summed over the ``engine`` label
(the data-parallel ranks behind one server); the KV usage is their mean. Anything the
node cannot use raises `EngineMetricsError` naming what is missing or wrong, never
another exception. `scrape` fetches ``URL/metrics`` with urllib (a timeout, a size
bound) and raises `ScrapeError` (an `EngineMetricsError`) when the engine cannot be
reached. `wait_for_engine` polls until the engine answers with usable metrics.

`EngineScraper` is what `catsproto instance node --engine-url` runs: a thread that
scrapes every ``interval_s``, derives the node's `ComputeState` with the pure
`update_prefill_rate` / `engine_compute_state`, and keeps the last good state when a
scrape fails (counted, with the last error, in `state()` and its Prometheus metrics).
A scrape whose process start time differs from the last one seen is a new engine
process: the scraper counts it and calls `on_restart`, and the node forgets the old
process' blocks then rather than at the new one's first event batch.
The node agent reads `compute_state()` on every step, so that is a lock and a field.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from catsproto.adapters.metrics import HitCounter, render
from catsproto.node.engine_metrics import (
    MIN_MEASURED_TOKENS,
    EngineMetrics,
    EngineMetricsError,
    PrefillRate,
    engine_compute_state,
    restarted,
    update_prefill_rate,
)
from catsproto.node.metrics import ComputeState

__all__ = [
    "MAX_METRICS_BYTES",
    "EngineMetricsError",
    "EngineScraper",
    "ScrapeError",
    "metrics_url",
    "parse_metrics",
    "scrape",
    "wait_for_engine",
]

MAX_METRICS_BYTES = 8 << 20  # a vLLM server's /metrics is about 60 kB
SCRAPE_TIMEOUT_S = 2.0

CACHE_CONFIG = "vllm:cache_config_info"
REQUIRED_GAUGES = {
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_requests_running": "vllm:num_requests_running",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
}
# EngineMetrics field -> the sample name in the exposition (counters carry _total,
# histograms _sum and _count)
OPTIONAL_SAMPLES = {
    "prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "prompt_tokens_cached_total": "vllm:prompt_tokens_cached_total",
    "time_to_first_token_seconds_sum": "vllm:time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
    "request_prefill_time_seconds_sum": "vllm:request_prefill_time_seconds_sum",
    "request_prefill_kv_computed_tokens_sum": "vllm:request_prefill_kv_computed_tokens_sum",
    "request_prefill_kv_computed_tokens_count": "vllm:request_prefill_kv_computed_tokens_count",
    "request_inference_time_seconds_sum": "vllm:request_inference_time_seconds_sum",
}
# the server process' start (prometheus_client's process collector): not vLLM's own
START_TIME = "process_start_time_seconds"


class ScrapeError(EngineMetricsError):
    """The engine's /metrics could not be fetched (refused, timed out, not HTTP 200)."""


def metrics_url(engine_url: str) -> str:
    """``http://HOST:PORT`` (the engine's OpenAI server) -> its ``/metrics`` URL."""
    return engine_url.rstrip("/") + "/metrics"


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, float(s.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, KeyError, ...
        raise EngineMetricsError(
            f"not Prometheus text: {type(exc).__name__}: {str(exc)[:120]}"
        ) from None
    return out


def _label_int(labels: dict[str, str], name: str) -> int:
    raw = labels.get(name)
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        value = 0
    if value < 1:
        engine = labels.get("engine", "?")
        raise EngineMetricsError(
            f'{CACHE_CONFIG}{{engine="{engine}"}} label {name} is {raw!r}, not a positive integer'
        )
    return value


def _total(samples: list[tuple[dict[str, str], float]], name: str) -> float:
    values = [v for _, v in samples]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise EngineMetricsError(f"{name} {values} is not a finite number >= 0")
    return sum(values)


def parse_metrics(text: str, at_s: float = 0.0) -> EngineMetrics:
    """A vLLM /metrics text -> `EngineMetrics` taken at `at_s`; `EngineMetricsError`
    naming every required metric that is absent, or the value that is wrong."""
    samples = _samples(text)
    missing = tuple(
        name for name in (CACHE_CONFIG, *REQUIRED_GAUGES.values()) if not samples.get(name)
    )
    if missing:
        raise EngineMetricsError(
            f"missing {', '.join(missing)} (is this a vLLM server's /metrics?)", missing
        )
    configs = [labels for labels, _ in samples[CACHE_CONFIG]]
    sizes = {_label_int(labels, "block_size") for labels in configs}
    if len(sizes) != 1:
        raise EngineMetricsError(f"{CACHE_CONFIG}: engines differ in block_size {sorted(sizes)}")
    blocks = sum(_label_int(labels, "num_gpu_blocks") for labels in configs)
    gauges = {field: _total(samples[name], name) for field, name in REQUIRED_GAUGES.items()}
    usage = samples["vllm:kv_cache_usage_perc"]
    optional = {
        field: _total(samples[name], name) if samples.get(name) else None
        for field, name in OPTIONAL_SAMPLES.items()
    }
    started = samples.get(START_TIME)
    if started:
        values = [v for _, v in started]
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise EngineMetricsError(f"{START_TIME} {values} is not a finite number > 0")
        optional[START_TIME] = max(values)  # several processes: the newest
    return EngineMetrics(
        at_s=at_s,
        block_size=sizes.pop(),
        num_gpu_blocks=blocks,
        engines=len(configs),
        num_requests_waiting=round(gauges["num_requests_waiting"]),
        num_requests_running=round(gauges["num_requests_running"]),
        kv_cache_usage_perc=gauges["kv_cache_usage_perc"] / len(usage),
        **optional,
    )


def scrape(
    engine_url: str, timeout_s: float = SCRAPE_TIMEOUT_S, *, at_s: float | None = None
) -> EngineMetrics:
    """GET ``engine_url/metrics`` and parse it (`parse_metrics`); `ScrapeError` when it
    cannot be fetched, `EngineMetricsError` when it says too little."""
    url = metrics_url(engine_url)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(MAX_METRICS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"{url}: HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:  # URLError, timeouts, resets; a malformed URL
        reason = getattr(exc, "reason", None) or exc
        raise ScrapeError(f"{url}: {reason}") from None
    if len(body) > MAX_METRICS_BYTES:
        raise EngineMetricsError(f"{url}: more than {MAX_METRICS_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineMetricsError(f"{url}: not UTF-8 (byte {exc.start})") from None
    try:
        return parse_metrics(text, time.monotonic() if at_s is None else at_s)
    except EngineMetricsError as exc:
        raise type(exc)(f"{url}: {exc}", exc.missing) from None


def wait_for_engine(
    engine_url: str,
    timeout_s: float,
    *,
    poll_s: float = 0.5,
    should_stop: Callable[[], bool] = lambda: False,
) -> EngineMetrics | None:
    """Poll until the engine's /metrics parse; `ScrapeError` naming the URL and the last
    error after `timeout_s`, None if `should_stop()` turned true first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return scrape(engine_url, min(SCRAPE_TIMEOUT_S, max(0.1, timeout_s)))
        except EngineMetricsError as exc:
            last = exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScrapeError(
                f"the engine at {engine_url} did not serve usable metrics within "
                f"{timeout_s:g} s (last: {last})",
                last.missing,
            )
        stop_at = time.monotonic() + min(poll_s, left)
        while time.monotonic() < stop_at:
            if should_stop():
                return None
            time.sleep(min(0.05, max(0.0, stop_at - time.monotonic())))


class EngineScraper:
    """Scrapes one engine every `interval_s` on a thread and keeps the node's
    `ComputeState`: the last good one when a scrape fails."""

    def __init__(
        self,
        engine_url: str,
        first: EngineMetrics,
        fallback_rate_tps: float,
        *,
        interval_s: float = 1.0,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        min_tokens: int = MIN_MEASURED_TOKENS,
        hits: HitCounter | None = None,
        fetch: Callable[[], EngineMetrics] | None = None,
        on_restart: Callable[[EngineMetrics], None] | None = None,
    ) -> None:
        if not 0 < interval_s < math.inf:
            raise ValueError(f"scrape interval {interval_s} is not a positive number")
        self.engine_url = engine_url
        self.interval_s = interval_s
        self.min_tokens = min_tokens
        self.hits = hits if hits is not None else HitCounter()
        self._fetch = fetch or (lambda: scrape(engine_url, min(timeout_s, interval_s * 2)))
        self.scrapes = 0
        self.failures = 0
        self.last_error = ""
        self.restarts = 0  # new engine processes seen (process start time moved)
        self.on_restart = on_restart
        self._seen = first  # the last scrape that parsed, used or not
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-scrape")
        self._previous: EngineMetrics | None = None
        self.latest = first
        self.rate = update_prefill_rate(PrefillRate(fallback_rate_tps), first, min_tokens)
        self._state = engine_compute_state(None, first, self.rate)
        self._count_hits(first)
        self.scrapes = 1

    def _count_hits(self, m: EngineMetrics) -> None:
        q, h = m.prefix_cache_queries_total, m.prefix_cache_hits_total
        if q is not None and h is not None:  # tokens -> blocks, as the node counts
            self.hits.lookup_blocks = int(q) // m.block_size
            self.hits.hit_blocks = int(h) // m.block_size

    def compute_state(self) -> ComputeState:
        with self._lock:
            return self._state

    def scrape_once(self) -> bool:
        """One scrape; True if it gave a new state. A failure keeps the last state. A
        new engine process (`restarted`) is counted and handed to `on_restart` (on the
        calling thread, after the state is taken), whether or not its metrics are used."""
        try:
            m = self._fetch()
        except EngineMetricsError as exc:
            with self._lock:
                self.failures += 1
                self.last_error = str(exc)
            return False
        with self._lock:
            new_process = restarted(self._seen, m)
            self._seen = m
        try:
            return self._take(m)
        finally:
            if new_process:
                # counted once the node has forgotten the old process's blocks: a state
                # read between the two never shows the restart with those blocks
                if self.on_restart is not None:
                    self.on_restart(m)
                with self._lock:
                    self.restarts += 1

    def _take(self, m: EngineMetrics) -> bool:
        with self._lock:
            if m.block_size != self.latest.block_size:
                self.failures += 1
                self.last_error = (
                    f"the engine's block size changed from {self.latest.block_size} to "
                    f"{m.block_size} (restarted with another --block-size?): metrics ignored; "
                    "restart the node"
                )
                return False
            rate = update_prefill_rate(self.rate, m, self.min_tokens)
            self._state = engine_compute_state(self.latest, m, rate)
            self.rate, self._previous, self.latest = rate, self.latest, m
            self.scrapes += 1
            self._count_hits(m)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.scrape_once()
            except Exception as exc:  # never end the thread: the node keeps its last state
                with self._lock:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"

    def start(self) -> EngineScraper:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def state(self) -> dict[str, Any]:
        """What /state shows of the engine."""
        with self._lock:
            s, rate, latest = self._state, self.rate, self.latest
            return {
                "url": self.engine_url,
                "scrapes": self.scrapes,
                "scrape_failures": self.failures,
                "last_error": self.last_error,
                "last_scrape_s_ago": round(time.monotonic() - latest.at_s, 3),
                "restarts": self.restarts,
                "metrics": latest.to_json(),
                "prefill_rate": {
                    "tps": rate.tps,
                    "source": rate.source,
                    "windows": rate.windows,
                    "window_tokens": self.min_tokens,
                    "tokens_per_request": rate.tokens_per_request,
                },
                "compute_state": {
                    "waiting": s.waiting,
                    "running": s.running,
                    "outstanding_prefill_tokens": s.outstanding_prefill_tokens,
                    "prefill_rate_tps": s.prefill_rate_tps,
                    "utilisation": s.utilisation,
                    "kv_utilisation": s.kv_utilisation,
                    "wait_ms": s.wait_ms,
                },
            }

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_ScrapeCollector(self))
        return registry

    def metrics(self) -> bytes:
        return render(self.registry())


class _ScrapeCollector(Collector):
    def __init__(self, scraper: EngineScraper) -> None:
        self.scraper = scraper

    def collect(self) -> Iterator[Metric]:
        sc = self.scraper
        with sc._lock:
            ok, failed, restarts = sc.scrapes, sc.failures, sc.restarts
            age = time.monotonic() - sc.latest.at_s
            rate, state = sc.rate, sc._state
        scrapes = CounterMetricFamily(
            "catsproto_node_engine_scrapes",
            "scrapes of the engine's /metrics, by outcome",
            labels=["outcome"],
        )
        scrapes.add_metric(["ok"], ok)
        scrapes.add_metric(["failed"], failed)
        yield scrapes
        yield CounterMetricFamily(
            "catsproto_node_engine_restarts",
            "new engine processes seen (the process start time in its /metrics moved)",
            value=restarts,
        )
        yield GaugeMetricFamily(
            "catsproto_node_engine_last_scrape_age_seconds",
            "seconds since the last good scrape of the engine's /metrics",
            value=age,
        )
        g = GaugeMetricFamily(
            "catsproto_node_prefill_rate_tps",
            "prefill rate the node advertises (tokens/s), measured or configured",
            labels=["source"],
        )
        g.add_metric([rate.source], rate.tps)
        yield g
        yield GaugeMetricFamily(
            "catsproto_node_outstanding_prefill_tokens",
            "estimated prompt tokens the engine still has to prefill (waiting requests)",
            value=state.outstanding_prefill_tokens,
        )

"""Whether a real engine still answers, and the C-SMA's gate on it.

A C-SMA speaks for its engine: while the engine does not answer, what it advertised
(its cache, its load) steers requests to a process that cannot serve them. `HealthGate`
asks the engine's ``GET /health`` every `interval_s`; after `down_after` failed probes in
a row it calls `on_down` (the C-SMA withdraws its routes and stops publishing), and on
the first answer after that `on_up` (it publishes everything afresh). One probe that
fails is not enough: a busy engine may miss a two-second deadline once.

`healthy` is the probe: vLLM's OpenAI server answers ``/health`` with 200 and an empty
body while its engine core runs, and 503 (or nothing) when it does not.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from catsproto.adapters.metrics import render

DOWN_AFTER = 3  # failed probes in a row before the engine counts as down
PROBE_S = 1.0


def healthy(url: str, timeout: float = 2.0) -> bool:
    """True when the engine at base URL `url` answers ``GET /health`` with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as reply:
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


class HealthGate:
    """Probes an engine's /health on its own thread; `up` says whether to speak for it.

    Starts up (the caller starts it once the engine has answered). `on_down` and `on_up`
    run on the gate's thread, once per change, after `up` has changed."""

    def __init__(
        self,
        url: str,
        on_down: Callable[[], None],
        on_up: Callable[[], None],
        *,
        interval_s: float = PROBE_S,
        down_after: int = DOWN_AFTER,
        probe: Callable[[str], bool] = healthy,
    ) -> None:
        if down_after < 1:
            raise ValueError(f"down_after {down_after} is not >= 1")
        if not interval_s > 0:
            raise ValueError(f"interval_s {interval_s} is not > 0")
        self.url = url
        self.on_down, self.on_up = on_down, on_up
        self.interval_s, self.down_after = interval_s, down_after
        self.probe = probe
        self.up = True
        self.probes = 0
        self.failures = 0  # failed probes, all told
        self.in_a_row = 0
        self.downs = 0  # times the engine was declared down
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-health")

    def check(self) -> bool:
        """One probe, and the change it makes (if any); returns `up` after it."""
        ok = self.probe(self.url)
        self.probes += 1
        if ok:
            self.in_a_row = 0
            if not self.up:
                self.up = True
                self.on_up()
        else:
            self.failures += 1
            self.in_a_row += 1
            if self.up and self.in_a_row >= self.down_after:
                self.up = False
                self.downs += 1
                self.on_down()
        return self.up

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def start(self) -> HealthGate:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 3)

    def state(self) -> dict[str, Any]:
        """What /state shows: up or not, and the probes behind it."""
        return {
            "url": self.url,
            "up": self.up,
            "probes": self.probes,
            "failed_probes": self.failures,
            "failed_in_a_row": self.in_a_row,
            "down_after": self.down_after,
            "times_down": self.downs,
        }

    def metrics(self) -> bytes:
        """Prometheus text: whether the engine counts as up, and the probes by outcome."""
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_GateCollector(self))
        return render(registry)


class _GateCollector(Collector):
    def __init__(self, gate: HealthGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self.gate
        yield GaugeMetricFamily(
            "catsproto_node_engine_up",
            "1 while the engine's /health answers (the node speaks for it), else 0",
            value=1 if gate.up else 0,
        )
        probes = CounterMetricFamily(
            "catsproto_node_engine_health_probes",
            "probes of the engine's /health, by outcome",
            labels=["outcome"],
        )
        probes.add_metric(["ok"], gate.probes - gate.failures)
        probes.add_metric(["failed"], gate.failures)
        yield probes

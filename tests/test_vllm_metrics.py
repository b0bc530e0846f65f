"""A vLLM engine's /metrics: parsed from text captured on a real engine
(tests/data/vllm_metrics, see its README), turned into the node's ComputeState, refused
with one error when it says too little, and scraped over real HTTP."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catsproto.adapters.metrics import HitCounter
from catsproto.adapters.vllm_metrics import (
    EngineMetricsError,
    EngineScraper,
    ScrapeError,
    parse_metrics,
    scrape,
    wait_for_engine,
)
from catsproto.node.engine_metrics import (
    EngineMetrics,
    PrefillRate,
    engine_compute_state,
    update_prefill_rate,
)

DATA = Path(__file__).parent / "data" / "vllm_metrics"
IDLE = (DATA / "idle.txt").read_text()
BUSY = (DATA / "busy.txt").read_text()
AFTER = (DATA / "after.txt").read_text()


def without(text: str, *names: str) -> str:
    """`text` without the sample lines of the metrics `names` (HELP/TYPE lines kept)."""
    pattern = re.compile(rf"^({'|'.join(re.escape(n) for n in names)})[{{ ]")
    return "\n".join(line for line in text.splitlines() if not pattern.match(line)) + "\n"


def replaced(text: str, name: str, value: str) -> str:
    """`text` with the value of metric `name`'s (single) sample set to `value`."""
    out, n = re.subn(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\1 {value}", text, flags=re.M)
    assert n == 1, name
    return out


# ---- parsing the captured texts -------------------------------------------------------


def test_the_idle_capture_parses_to_the_engines_own_figures() -> None:
    m = parse_metrics(IDLE, at_s=10.0)
    assert m == EngineMetrics(
        at_s=10.0,
        block_size=32,
        num_gpu_blocks=512,
        engines=1,
        num_requests_waiting=0,
        num_requests_running=0,
        kv_cache_usage_perc=0.0,
        prefix_cache_queries_total=34851.0,
        prefix_cache_hits_total=1472.0,
        prompt_tokens_total=34851.0,
        prompt_tokens_cached_total=1472.0,
        time_to_first_token_seconds_sum=7.73560357093811,
        time_to_first_token_seconds_count=16.0,
        request_prefill_time_seconds_sum=2.087079989999552,
        request_prefill_kv_computed_tokens_sum=33379.0,
        request_prefill_kv_computed_tokens_count=16.0,
        request_inference_time_seconds_sum=6.169481991999646,
        process_start_time_seconds=1.79636070774e09,
    )
    assert m.prefix_hit_ratio == pytest.approx(1472 / 34851)
    assert m.mean_ttft_s == pytest.approx(7.73560357093811 / 16)
    assert m.to_json()["num_gpu_blocks"] == 512 and "at_s" not in m.to_json()


def test_the_busy_capture_shows_the_queue() -> None:
    m = parse_metrics(BUSY)
    assert (m.num_requests_waiting, m.num_requests_running) == (6, 2)
    assert m.kv_cache_usage_perc == 0.37769080234833663


def test_idle_busy_after_give_the_node_its_compute_state() -> None:
    """The rate is measured over the engine's life at the first scrape (33,379 computed
    tokens in 2.087 s), the busy scrape's 6 waiting requests are priced at that life's
    mean uncached prompt (33,379 / 16), and the load's own 32,000 tokens in 1.977 s close
    the next window."""
    idle, busy, after = (parse_metrics(t, at_s=s) for t, s in ((IDLE, 0), (BUSY, 1), (AFTER, 3)))
    rate = update_prefill_rate(PrefillRate(8000.0), idle, min_tokens=2048)
    assert rate.measured and rate.windows == 1
    assert rate.tps == pytest.approx(33379 / 2.087079989999552)
    assert rate.tokens_per_request == pytest.approx(33379 / 16)
    state = engine_compute_state(None, idle, rate)
    assert (state.waiting, state.running, state.outstanding_prefill_tokens) == (0, 0, 0)
    assert state.utilisation == 0.0

    rate = update_prefill_rate(rate, busy, min_tokens=2048)
    assert rate.windows == 1  # no request finished between the two scrapes
    state = engine_compute_state(idle, busy, rate)
    assert (state.waiting, state.running) == (6, 2)
    # six waiting, and two running with half their prefill left
    assert state.outstanding_prefill_tokens == round((6 + 2 / 2) * 33379 / 16) == 14603
    assert state.kv_utilisation == 0.37769080234833663
    assert state.utilisation == 1.0  # nothing finished, but two requests run
    assert state.wait_ms == pytest.approx(1000 * 14603 / rate.tps)

    rate = update_prefill_rate(rate, after, min_tokens=2048)
    assert rate.windows == 2
    assert rate.tps == pytest.approx(32000 / (4.063695918999315 - 2.087079989999552))
    assert rate.tokens_per_request == pytest.approx(4000)
    state = engine_compute_state(busy, after, rate)
    assert state.outstanding_prefill_tokens == 0 and state.kv_utilisation == 0.0
    # 5.98 s of requests in the engine over 2 s of wall time: busy all along
    assert state.utilisation == 1.0


def test_a_request_in_its_prefill_counts_as_half_a_request_still_to_prefill() -> None:
    """One request running and none waiting is an engine busy for about half a prefill
    more: the selector, which forgets the work it sent once a later advertisement comes,
    must see it (it once saw an idle engine)."""
    import dataclasses

    idle = parse_metrics(IDLE)
    rate = update_prefill_rate(PrefillRate(8000.0), idle, min_tokens=2048)
    one = dataclasses.replace(idle, num_requests_running=1)
    state = engine_compute_state(idle, one, rate)
    assert state.outstanding_prefill_tokens == round(33379 / 16 / 2) == 1043
    assert state.wait_ms > 0


def test_a_window_too_small_keeps_the_configured_rate() -> None:
    idle = parse_metrics(IDLE)
    rate = update_prefill_rate(PrefillRate(8000.0), idle, min_tokens=40_000)
    assert not rate.measured and rate.tps == 8000.0 and rate.source == "configured"
    # a waiting request is priced at the engine's lifetime mean until a window closes
    busy = parse_metrics(BUSY)
    state = engine_compute_state(idle, busy, rate)
    assert state.outstanding_prefill_tokens == 14603 and state.prefill_rate_tps == 8000.0


def test_the_utilisation_is_the_busy_time_between_two_scrapes() -> None:
    """Nothing runs at the later scrape: the requests that finished since the earlier
    one were in the engine 5.98 s of the 20 s between them."""
    busy, after = parse_metrics(BUSY, at_s=0.0), parse_metrics(AFTER, at_s=20.0)
    rate = PrefillRate(8000.0)
    busy_s = 12.153882477999446 - 6.169481991999646
    assert engine_compute_state(busy, after, rate).utilisation == pytest.approx(busy_s / 20)
    assert engine_compute_state(None, after, rate).utilisation == 0.0


def test_a_restarted_engine_starts_the_window_again() -> None:
    """Counters below the window's base: the engine restarted; the rate measured
    before stands and the next window counts from 0."""
    after, idle = parse_metrics(AFTER), parse_metrics(IDLE)
    rate = update_prefill_rate(PrefillRate(8000.0), after, min_tokens=2048)
    restarted = update_prefill_rate(rate, idle, min_tokens=2048)
    assert restarted.tps == rate.tps and restarted.measured
    assert (restarted.base_tokens, restarted.base_seconds, restarted.base_requests) == (0, 0, 0)
    again = update_prefill_rate(restarted, idle, min_tokens=2048)
    assert again.windows == rate.windows + 1
    assert again.tps == pytest.approx(33379 / 2.087079989999552)


def test_an_engine_without_the_prefill_counters_keeps_the_configured_rate() -> None:
    text = without(
        IDLE, "vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_sum"
    )
    m = parse_metrics(text)
    assert m.request_prefill_kv_computed_tokens_sum is None
    assert m.request_prefill_time_seconds_sum is None
    assert m.request_prefill_kv_computed_tokens_count == 16.0
    rate = update_prefill_rate(PrefillRate(8000.0), m, min_tokens=1)
    assert rate == PrefillRate(8000.0)
    assert engine_compute_state(None, m, rate).outstanding_prefill_tokens == 0


def test_data_parallel_engines_are_summed() -> None:
    """A second engine (rank 1) with its own series: blocks and counts add up, the KV
    usage is the mean."""
    rank1 = [
        line.replace('engine="0"', 'engine="1"')
        for line in BUSY.splitlines()
        if line.startswith(("vllm:cache_config_info", "vllm:num_requests_", "vllm:kv_cache_usage"))
    ]
    rank1 = [
        re.sub(r" \S+$", " 0.0", line) if line.startswith("vllm:kv_cache") else line
        for line in rank1
    ]
    text = BUSY.replace(
        "# HELP vllm:cache_config_info", "\n".join(rank1) + "\n# HELP vllm:cache_config_info"
    )
    m = parse_metrics(text)
    assert (m.engines, m.num_gpu_blocks, m.block_size) == (2, 1024, 32)
    assert (m.num_requests_waiting, m.num_requests_running) == (12, 4)
    assert m.kv_cache_usage_perc == pytest.approx(0.37769080234833663 / 2)


# ---- what is refused, and how it says so ----------------------------------------------


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["vllm:cache_config_info"], "missing vllm:cache_config_info"),
        (
            ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"],
            "missing vllm:num_requests_waiting, vllm:kv_cache_usage_perc",
        ),
    ],
)
def test_a_missing_required_metric_is_named(names: list[str], says: str) -> None:
    with pytest.raises(EngineMetricsError, match=re.escape(says)) as err:
        parse_metrics(without(IDLE, *names))
    assert err.value.missing == tuple(names)


def test_text_that_is_not_vllms_names_everything_missing() -> None:
    with pytest.raises(EngineMetricsError) as err:
        parse_metrics('# a node exporter\nnode_load1 0.5\nup{job="x"} 1\n')
    assert err.value.missing == (
        "vllm:cache_config_info",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    )
    assert "is this a vLLM server's /metrics?" in str(err.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (IDLE.replace('block_size="32"', 'block_size="None"'), "label block_size is 'None'"),
        (IDLE.replace('num_gpu_blocks="512"', 'num_gpu_blocks="0"'), "num_gpu_blocks is '0'"),
        (IDLE.replace(',num_gpu_blocks="512"', ""), "num_gpu_blocks is None"),
        (replaced(IDLE, "vllm:num_requests_waiting", "NaN"), "vllm:num_requests_waiting [nan]"),
        (replaced(IDLE, "vllm:kv_cache_usage_perc", "-1"), "vllm:kv_cache_usage_perc [-1.0]"),
        (
            replaced(IDLE, "vllm:request_prefill_time_seconds_sum", "+Inf"),
            "vllm:request_prefill_time_seconds_sum [inf]",
        ),
        (
            IDLE.replace(
                "process_start_time_seconds 1.79636070774e+09", "process_start_time_seconds 0"
            ),
            "process_start_time_seconds [0.0] is not a finite number > 0",
        ),
        ("vllm:num_requests_waiting{engine=0} 1\n", "not Prometheus text"),
        ("this is not metrics\n", "not Prometheus text"),
    ],
)
def test_bad_values_are_refused_naming_them(text: str, says: str) -> None:
    with pytest.raises(EngineMetricsError, match=re.escape(says)):
        parse_metrics(text)


def test_engines_that_disagree_on_the_block_size_are_refused() -> None:
    line = next(x for x in IDLE.splitlines() if x.startswith("vllm:cache_config_info"))
    other = line.replace('engine="0"', 'engine="1"').replace('block_size="32"', 'block_size="16"')
    with pytest.raises(EngineMetricsError, match=r"engines differ in block_size \[16, 32\]"):
        parse_metrics(IDLE + other + "\n")


def test_every_truncation_of_a_real_text_parses_or_raises_the_one_error() -> None:
    """Cut anywhere (a scrape cut short): a whole snapshot or EngineMetricsError."""
    parsed = 0
    for cut in range(0, len(BUSY), 211):
        try:
            m = parse_metrics(BUSY[:cut])
        except EngineMetricsError:
            continue
        parsed += 1
        assert m.block_size == 32 and m.num_gpu_blocks == 512
    assert parsed > 0  # the tail of the text is optional metrics: late cuts still parse


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=400).map(lambda b: b.decode("latin-1")))
def test_random_text_only_ever_raises_the_one_error(text: str) -> None:
    with contextlib.suppress(EngineMetricsError):
        parse_metrics(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(IDLE) - 1), st.text(min_size=1, max_size=8))
def test_a_real_text_with_a_splice_parses_or_raises_the_one_error(at: int, junk: str) -> None:
    with contextlib.suppress(EngineMetricsError):
        parse_metrics(IDLE[:at] + junk + IDLE[at:])


# ---- over HTTP -------------------------------------------------------------------------


class TextServer:
    """A real HTTP server whose GET /metrics answers `body` (changeable) with `status`."""

    def __init__(self) -> None:
        self.body = IDLE.encode()
        self.status = 200
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                body = owner.body if self.path == "/metrics" else b"no"
                status = owner.status if self.path == "/metrics" else 404
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served() -> Iterator[TextServer]:
    s = TextServer()
    yield s
    s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_scrape_reads_a_served_text(served: TextServer) -> None:
    m = scrape(served.url + "/", at_s=5.0)
    assert m == parse_metrics(IDLE, at_s=5.0)


def test_scrape_errors_name_the_url(served: TextServer) -> None:
    served.status = 500
    with pytest.raises(ScrapeError, match=re.escape(f"{served.url}/metrics: HTTP 500")):
        scrape(served.url)
    served.status, served.body = 200, b"\xff\xfe metrics"
    with pytest.raises(EngineMetricsError, match="not UTF-8 \\(byte 0\\)"):
        scrape(served.url)
    served.body = without(IDLE, "vllm:num_requests_running").encode()
    with pytest.raises(EngineMetricsError, match="/metrics: missing vllm:num_requests_running"):
        scrape(served.url)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ScrapeError, match=re.escape(f"{url}/metrics: ")):
        scrape(url, timeout_s=1)


def test_waiting_for_an_engine_that_never_comes_names_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ScrapeError, match=re.escape(f"the engine at {url} did not serve")):
        wait_for_engine(url, 0.6, poll_s=0.1)
    assert 0.5 < time.monotonic() - t0 < 5


def test_waiting_ends_when_the_engine_answers_or_when_told_to_stop(served: TextServer) -> None:
    served.body = b"starting\n"  # not metrics yet
    threading.Timer(0.3, lambda: setattr(served, "body", BUSY.encode())).start()
    m = wait_for_engine(served.url, 10, poll_s=0.05)
    assert m is not None and m.num_requests_waiting == 6
    served.body = b"starting\n"
    t0 = time.monotonic()
    assert wait_for_engine(served.url, 30, poll_s=0.05, should_stop=lambda: True) is None
    assert time.monotonic() - t0 < 2


def test_the_scraper_keeps_its_last_good_state_and_counts_failures(served: TextServer) -> None:
    hits = HitCounter()
    scraper = EngineScraper(served.url, scrape(served.url), 8000.0, min_tokens=2048, hits=hits)
    assert scraper.rate.measured and scraper.scrapes == 1
    assert (hits.lookup_blocks, hits.hit_blocks) == (34851 // 32, 1472 // 32)
    served.body = BUSY.encode()
    assert scraper.scrape_once()
    busy = scraper.compute_state()
    assert (busy.waiting, busy.running, busy.outstanding_prefill_tokens) == (6, 2, 14603)
    for body in (b"garbage", without(BUSY, "vllm:cache_config_info").encode()):
        served.body = body
        assert not scraper.scrape_once()
        assert scraper.compute_state() == busy
    state = scraper.state()
    assert (state["scrapes"], state["scrape_failures"]) == (2, 2)
    assert "missing vllm:cache_config_info" in state["last_error"]
    assert state["metrics"]["num_requests_waiting"] == 6
    assert state["compute_state"]["outstanding_prefill_tokens"] == 14603
    served.body = IDLE.replace('block_size="32"', 'block_size="64"').encode()
    assert not scraper.scrape_once()
    assert "block size changed from 32 to 64" in scraper.last_error
    text = scraper.metrics().decode()
    assert 'catsproto_node_engine_scrapes_total{outcome="failed"} 3.0' in text
    assert 'catsproto_node_engine_scrapes_total{outcome="ok"} 2.0' in text
    assert 'catsproto_node_prefill_rate_tps{source="measured"}' in text
    assert "catsproto_node_outstanding_prefill_tokens 14603.0" in text


def test_the_scraper_thread_scrapes_every_interval(served: TextServer) -> None:
    scraper = EngineScraper(served.url, scrape(served.url), 8000.0, interval_s=0.05).start()
    try:
        served.body = BUSY.encode()
        deadline = time.monotonic() + 5
        while scraper.compute_state().waiting != 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scraper.compute_state().waiting == 6 and scraper.scrapes >= 2
    finally:
        scraper.close()


def started(text: str, at: str) -> str:
    """`text` as a server process started at `at` (Unix seconds) would export it."""
    line = "process_start_time_seconds 1.79636070774e+09"
    assert line in text
    return text.replace(line, f"process_start_time_seconds {at}")


def test_a_new_engine_process_is_told_by_its_start_time(served: TextServer) -> None:
    """The same process scraped again is no restart, however its counters move; another
    start time is one, counted once and handed to on_restart, even when its block size
    makes its metrics unusable; a text without the start time never counts as one."""
    seen: list[float | None] = []
    scraper = EngineScraper(
        served.url,
        scrape(served.url),
        8000.0,
        on_restart=lambda m: seen.append(m.process_start_time_seconds),
    )
    served.body = BUSY.encode()  # same process, busier
    assert scraper.scrape_once() and seen == [] and scraper.restarts == 0
    served.body = started(IDLE, "1.7963608e+09").encode()  # counters back at idle's
    assert scraper.scrape_once()
    assert seen == [1.7963608e09] and scraper.restarts == 1
    assert scraper.scrape_once() and seen == [1.7963608e09]  # the new process again
    served.body = without(IDLE, "process_start_time_seconds").encode()
    assert scraper.scrape_once() and seen == [1.7963608e09]  # unknown: no restart
    served.body = started(IDLE, "1.7963609e+09").encode()
    assert scraper.scrape_once() and seen == [1.7963608e09]  # unknown before: none either
    served.body = started(IDLE, "1.796361e+09").replace('block_size="32"', 'block_size="64"')
    served.body = served.body.encode()
    assert not scraper.scrape_once()  # its metrics refused, its restart still told
    assert seen == [1.7963608e09, 1.796361e09] and scraper.restarts == 2
    assert "block size changed from 32 to 64" in scraper.last_error
    assert scraper.state()["restarts"] == 2
    assert "catsproto_node_engine_restarts_total 2.0" in scraper.metrics().decode()

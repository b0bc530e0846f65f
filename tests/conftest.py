"""Fixtures shared by the vLLM event tests (test_vllm_events.py, test_robust_ingest.py),
and the environment every test runs in: where the Mooncake trace is, and no downloads."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import zmq

if TYPE_CHECKING:
    from tests.test_vllm_events import RawEngine

# The team's machines keep the trace in a shared folder: beside the checkout, or at the
# machine's fixed place when CI clones somewhere else. Product code does not know that
# (catsproto/adapters/trace.py); the tests say it through the environment, set here at
# import so the test modules' find_trace() calls and every subprocess see it. A
# CATSPROTO_TRACES already set wins. The tests never download the trace
# (tests/test_trace_download.py lifts this for itself, against a local server).
SHARED_TRACES = (
    Path(__file__).resolve().parents[2] / "shared" / "traces",
    Path("/work/shared/traces"),
)
if not os.environ.get("CATSPROTO_TRACES"):
    for folder in SHARED_TRACES:
        if folder.is_dir():
            os.environ["CATSPROTO_TRACES"] = str(folder)
            break
os.environ.setdefault("CATSPROTO_NO_DOWNLOAD", "1")


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def engine(ctx: zmq.Context) -> Iterator[RawEngine]:
    """A raw ZMQ publisher speaking vLLM's KV-event wire format (no engine runs here)."""
    from tests.test_vllm_events import RawEngine

    e = RawEngine(ctx)
    yield e
    e.close()


@pytest.fixture(scope="module")
def ids():
    """The transfer tests' holder and puller TLS identities (`tests/transfer_helpers`)."""
    from tests.transfer_helpers import identities

    made = identities()
    yield made
    for i in made.values():
        i.close()


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """One real vLLM engine for the whole test session (`catsproto.lab.engine`): the tiny
    model on 127.0.0.1 at a free port, its KV events on Unix sockets in a private folder,
    512 KV blocks of 32 tokens. Started on first use (about 30-60 s), ended by its PID
    group when the session ends. Without the engine venv it skips, and under CI=true
    fails (`tests/engine_helpers.require_engine_python`)."""
    from catsproto.lab.engine import EngineSpec, LocalEngine
    from tests.engine_helpers import EngineHandle, free_port, require_engine_python

    python = require_engine_python()
    d = tmp_path_factory.mktemp("vllm")
    spec = EngineSpec(host="127.0.0.1", port=free_port(), ipc_dir=d)
    engine = LocalEngine(spec, d / "engine.log", python=python)
    try:
        engine.wait_ready()
        yield EngineHandle.of(spec)
    finally:
        engine.close()


# ---- the three kinds of test, as markers ---------------------------------------------
#
# lab:  needs root or real daemons, namespaces, captures or a real engine; these modules
#       (and every test using `vllm_engine`). They run one at a time (`scripts/test`).
# slow: a test that took SLOW_S or more when durations were last recorded
#       (tests/durations.json): subprocess CLIs, whole-trace simulations, long properties.
# core: everything else, the pure core in process: `pytest -m core -n 2`, under a minute.
#
# Record the durations again after adding slow tests (the recording merges; xdist works):
#     .venv/bin/python -m pytest -m "not lab" -n 2 --record-durations tests/durations.json
LAB_MODULES = frozenset(
    {
        "test_demo",
        "test_demo_capture",
        "test_dissector",
        "test_attack_spool_root",
        "test_dissector_expert",
        "test_engine_events",
        "test_engine_lab",
        "test_faults",
        "test_ingress",
        "test_ingress_cli",
        "test_inspect",
        "test_instance_node",
        "test_interop",
        "test_lab",
        "test_lab_cli",
        "test_lab_container",
        "test_lab_rr",
        "test_lab_sealed",
        "test_lab_topology",
        "test_lab_transfer_stale",
        "test_lab_transfer_steering",
        "test_rx_type_code",
        "test_steering_lab",
        "test_stop_signal",
        "test_tokenizer",
        "test_transfer_lab",
        "test_vllm_events",
    }
)
SLOW_S = 0.5
KEEP_S = 0.2  # durations.json keeps the tests at least this slow (the others are core)
DURATIONS = Path(__file__).parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="FILE",
        help="write each test's time (setup + call + teardown) into FILE (JSON), merged "
        "with what FILE holds; the `slow` marker reads tests/durations.json",
    )


def _is_lab(item) -> bool:
    module = item.module.__name__.rpartition(".")[2]
    return module in LAB_MODULES or "vllm_engine" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """Mark each test lab, slow or core (above). Then the tests that run real engines go
    last: the session's engine (`vllm_engine`), then the lab's engines
    (test_engine_lab.py). A running engine takes CPU even idle, so everything else runs
    before the first one starts."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for item in items:
        if _is_lab(item):
            item.add_marker(pytest.mark.lab)
        elif recorded.get(item.nodeid, 0.0) >= SLOW_S:
            item.add_marker(pytest.mark.slow)
        else:
            item.add_marker(pytest.mark.core)

    def rank(item) -> int:
        if item.module.__name__.endswith("test_engine_lab"):
            return 2
        return 1 if "vllm_engine" in getattr(item, "fixturenames", ()) else 0

    items.sort(key=rank)  # stable: each group keeps its order


_TIMES: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call", "teardown"):
        _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = session.config.getoption("--record-durations", None)
    if not out or hasattr(session.config, "workerinput"):  # the xdist controller writes
        return
    path = Path(out)
    times = json.loads(path.read_text()) if path.exists() else {}
    times.update({k: round(v, 3) for k, v in _TIMES.items()})
    kept = {k: v for k, v in sorted(times.items()) if v >= KEEP_S}  # the rest are core
    path.write_text(json.dumps(kept, indent=0) + "\n")

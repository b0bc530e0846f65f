"""Fixtures shared by the vLLM event tests (test_vllm_events.py, test_robust_ingest.py),
and the environment every test runs in: where the Mooncake trace is, and no downloads."""

from __future__ import annotations

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


def pytest_collection_modifyitems(config, items):
    """The tests that run real engines go last: the session's engine (`vllm_engine`),
    then the lab's engines (test_engine_lab.py). A running engine takes CPU even idle,
    so everything else runs before the first one starts."""

    def rank(item) -> int:
        if item.module.__name__.endswith("test_engine_lab"):
            return 2
        return 1 if "vllm_engine" in getattr(item, "fixturenames", ()) else 0

    items.sort(key=rank)  # stable: each group keeps its order

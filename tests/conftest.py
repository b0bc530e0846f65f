"""Fixtures shared by the vLLM event tests (test_vllm_events.py, test_robust_ingest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import zmq

if TYPE_CHECKING:
    from tests.test_vllm_events import RawEngine


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

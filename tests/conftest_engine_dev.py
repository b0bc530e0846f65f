"""A provisional `vllm_engine` fixture: the dev engine the lead started by hand
(/tmp/deveng/run.sh). To be replaced by a session fixture that starts a real engine per
test session; the tests ask only for the attributes below."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class EngineHandle:
    url: str  # the OpenAI server, http://host:port
    events: str  # its KV-event PUB endpoint
    replay: str  # its replay ROUTER endpoint
    block_size: int
    model_dir: Path
    served_model_name: str

    @property
    def host(self) -> str:
        return self.url.split("//", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


DEV_ENGINE = EngineHandle(
    url="http://127.0.0.1:18000",
    events="ipc:///tmp/deveng/kv.sock",
    replay="ipc:///tmp/deveng/replay.sock",
    block_size=32,
    model_dir=ROOT / "lab" / "engine" / "tiny-llama",
    served_model_name="catsproto-tiny",
)


@pytest.fixture(scope="session")
def vllm_engine() -> EngineHandle:
    """The running dev engine; a test that needs it fails (never skips) without it."""
    try:
        with urllib.request.urlopen(DEV_ENGINE.url + "/v1/models", timeout=5) as r:
            served = [m["id"] for m in json.loads(r.read())["data"]]
    except OSError as exc:
        pytest.fail(f"no vLLM engine at {DEV_ENGINE.url} ({exc}): start /tmp/deveng/run.sh")
    assert DEV_ENGINE.served_model_name in served, served
    return DEV_ENGINE

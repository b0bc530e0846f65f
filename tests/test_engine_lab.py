"""Real vLLM engines in the 4-site lab, behind the OpenAI-compatible ingress (root; under
CI=true it always runs).

`lab up cats4 --engine vllm`: a real `vllm serve` (tiny model, dummy weights, prefix
caching, KV events on ZMQ) serves the first instance of sites 2 and 3; each engine's
C-SMA advertises what the engine's own KV events say it holds, signed, over ExaBGP and
the FRR/BIRD transit to e1, where the ingress decides with the path selector and proxies
the request over the installed path. The client is the official `openai` package, run in
the client host's namespace, pointed at the ingress and nothing else changed. One lab
(two engines) serves the whole module: the engines start once.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catsproto.adapters.steering import RibFeed
from catsproto.adapters.tokenizer import PromptTokenizer
from catsproto.keys import BlockKeyer
from catsproto.lab import flows, runner
from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, MODEL_DIR, SERVED_MODEL
from catsproto.lab.engine_site import ENGINE_CS_ID
from catsproto.lab.instances import DEMO_SECRET
from tests.engine_helpers import require_engine_python
from tests.lab_helpers import cats4_lab

NEAR = "10.102.0.11"  # site 2's engine: the nearer one from e1 (e1 > c1 > c2 > e2)
FAR = "10.103.0.11"  # site 3's engine
ENGINE_NODE = {NEAR: "e2", FAR: "e3"}

if os.geteuid() != 0 and os.environ.get("CI") != "true":
    pytestmark = pytest.mark.skip(reason="the engine lab test needs root (namespaces, FRR)")

TOKENIZER = PromptTokenizer(MODEL_DIR)
KEYER = BlockKeyer(DEMO_SECRET, SERVED_MODEL, ENGINE_BLOCK_TOKENS)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_engine_python()
    with cats4_lab(
        tmp_path_factory.mktemp("engines"),
        f"v{os.getpid()}",
        feed_interval=1.0,
        engine="vllm",
    ) as lab:
        yield lab


def conversation(tag: str, turns: int = 1) -> str:
    """A prompt unlikely to be cached anywhere yet: ~1,200 tokens of text, then turns."""
    body = " ".join(
        f"{tag} line {i}: the cache sits where the prefix was computed." for i in range(90)
    )
    return body + "".join(f" Turn {t}: and then?" for t in range(turns))


def run_in(lab: runner.Lab, node: str, argv: list[str], timeout: float = 120.0) -> Any:
    """`python -m ARGV` in `node`'s namespace; its JSON output."""
    out = subprocess.run(
        ["ip", "netns", "exec", lab.handle.ns(node), sys.executable, "-m", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def ask_ingress(lab: runner.Lab, tmp: Path, prompts: list[Any], **extra: str) -> list[dict]:
    """The prompts through the ingress, from the client host, with the `openai` client."""
    host, _, _ = flows.client_link(lab.topology, flows.ingress_node(lab.topology))
    path = tmp / f"prompts-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(prompts))
    argv = ["catsproto.lab.engine_client", "ask", "--url", flows.ingress_url(lab)]
    argv += ["--token-file", str(flows.ingress_token_file(lab)), "--prompt-json", str(path)]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", v]
    result: list[dict] = run_in(lab, host, argv)
    return result


def ask_engine(lab: runner.Lab, tmp: Path, address: str, prompts: list[Any]) -> list[dict]:
    """The prompts straight to one engine, from its own egress (no ingress, no token)."""
    token = tmp / "no.token"
    token.write_text("none\n")
    token.chmod(0o600)  # a token file others may read is refused
    path = tmp / f"prompts-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(prompts))
    argv = ["catsproto.lab.engine_client", "ask", "--url", f"http://{address}:8000"]
    argv += ["--token-file", str(token), "--prompt-json", str(path)]
    result: list[dict] = run_in(lab, ENGINE_NODE[address], argv)
    return result


def summary_holds(lab: runner.Lab, address: str, text: str) -> np.ndarray:
    """Per block of `text`, whether e1's RIB (what BGP delivered, verified) says the
    engine at `address` holds it (none if the engine has no route)."""
    feed = RibFeed(lab.rib_file("e1"))
    feed.refresh(int(time.time() * 1000))
    table = feed.rib.services.get(ENGINE_CS_ID)
    inst = table.by_address.get(ipaddress.ip_address(address)) if table else None
    keys = np.array(KEYER.block_keys(TOKENIZER.completion_ids(text)), dtype=np.uint64)
    if inst is None:
        return np.zeros(len(keys), dtype=bool)
    held: np.ndarray = inst.lookup(keys) != 0
    return held


def claimed_blocks(lab: runner.Lab, address: str, text: str) -> int:
    """Leading blocks of `text` that e1's RIB says the engine at `address` holds."""
    held = summary_holds(lab, address, text)
    return int(np.argmin(held)) if not held.all() else len(held)


# A summary is a filter (1 % false positives): after an eviction it may still pass a
# few of a prompt's ~37 blocks by chance (4 or more: under 1e-3). More is no eviction.
FALSE_POSITIVES_ALLOWED = 3


def wait_until(check: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """Poll `check` until true; past the deadline fail saying `what` (called then, if it
    is a function, so that it can tell what was seen)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(0.25)


def full_blocks(text: str) -> int:
    return len(TOKENIZER.completion_ids(text)) // ENGINE_BLOCK_TOKENS


def test_the_second_request_goes_where_the_first_left_its_cache(lab, tmp_path):
    prompt = conversation(f"first-{os.getpid()}")
    (first,) = ask_ingress(lab, tmp_path, [prompt])
    holder = first["decision"]["x-catsproto-instance"]
    assert first["cached_tokens"] == 0
    blocks = full_blocks(prompt)
    # the holder's C-SMA saw the engine's BlockStored events and BGP carried them to e1
    wait_until(lambda: claimed_blocks(lab, holder, prompt) == blocks, 20, "holder advertised")
    (second,) = ask_ingress(lab, tmp_path, [prompt])
    assert second["decision"]["x-catsproto-instance"] == holder
    assert int(second["decision"]["x-catsproto-expected-cached-blocks"]) == blocks
    # vLLM's own count: every full block but the one holding the last prompt token
    n = second["prompt_tokens"]
    assert second["cached_tokens"] == min(blocks, (n - 1) // ENGINE_BLOCK_TOKENS) * 32
    assert second["ttft_ms"] > 0


def test_a_conversation_cached_at_the_far_engine_is_steered_there(lab, tmp_path):
    """Not the nearest engine: the one whose cache holds the conversation."""
    prompt = conversation(f"far-{os.getpid()}")
    (warm,) = ask_engine(lab, tmp_path, FAR, [prompt])
    assert warm["cached_tokens"] == 0
    blocks = full_blocks(prompt)
    wait_until(lambda: claimed_blocks(lab, FAR, prompt) == blocks, 20, "far engine advertised")
    follow_up = prompt + " And one more question about it?"
    (steered,) = ask_ingress(lab, tmp_path, [follow_up])
    assert steered["decision"]["x-catsproto-instance"] == FAR
    assert steered["decision"]["x-catsproto-site"] == "3"
    assert steered["cached_tokens"] == blocks * ENGINE_BLOCK_TOKENS
    # network-only CATS would have sent it to the nearer engine, which holds nothing of it
    (nearest,) = ask_ingress(lab, tmp_path, [follow_up + " Again?"], policy="nearest")
    assert nearest["decision"]["x-catsproto-instance"] == NEAR
    assert nearest["cached_tokens"] == 0


def engine_capacity(lab: runner.Lab, address: str) -> tuple[float, float]:
    """(free, total) KV blocks of the engine at `address` in e1's RIB (its Capacity TLV
    as BGP delivered it); (0, 0) while nothing is known."""
    feed = RibFeed(lab.rib_file("e1"))
    feed.refresh(int(time.time() * 1000))
    table = feed.rib.services.get(ENGINE_CS_ID)
    inst = table.by_address.get(ipaddress.ip_address(address)) if table else None
    if inst is None:
        return 0.0, 0.0
    return float(table.kv_free[inst.slot]), float(table.kv_total[inst.slot])


def test_the_engines_kv_capacity_reaches_the_selector(lab, tmp_path):
    """The Capacity TLV the eviction term reads: the engine's own num_gpu_blocks (from its
    /metrics) as the total, less the blocks its KV events say it stored, as the free."""
    engine = next(e for e in lab.handle.state.info["engines"] if e["host"] == FAR)
    wait_until(lambda: engine_capacity(lab, FAR)[1] > 0, 20, "capacity advertised")
    free, total = engine_capacity(lab, FAR)
    assert total == engine["num_gpu_blocks"]
    prompt = conversation(f"capacity-{os.getpid()}")
    blocks = full_blocks(prompt)
    assert free >= blocks, f"the far engine has only {free} free blocks"
    ask_engine(lab, tmp_path, FAR, [prompt])
    seen: list[tuple[float, float]] = []

    def advertised() -> bool:
        seen.append(engine_capacity(lab, FAR))
        return seen[-1] == (free - blocks, total)

    wait_until(advertised, 20, lambda: f"{free} - {blocks} free advertised; seen {seen[-3:]}")


def test_an_eviction_reaches_the_selector_through_bgp(lab, tmp_path):
    prompt = conversation(f"evict-{os.getpid()}")
    ask_engine(lab, tmp_path, NEAR, [prompt])
    blocks = full_blocks(prompt)
    wait_until(lambda: claimed_blocks(lab, NEAR, prompt) == blocks, 20, "advertised")
    # fill the engine's 512 blocks with other prompts until vLLM evicts the first
    fillers = [conversation(f"fill-{os.getpid()}-{i}", turns=i) for i in range(16)]
    ask_engine(lab, tmp_path, NEAR, fillers)
    wait_until(
        lambda: summary_holds(lab, NEAR, prompt).sum() <= FALSE_POSITIVES_ALLOWED,
        30,
        "eviction advertised",
    )
    # and it was a real eviction: vLLM itself no longer has the prefix
    (again,) = ask_engine(lab, tmp_path, NEAR, [prompt])
    assert again["cached_tokens"] == 0


def test_a_dead_engine_leaves_the_selection_when_its_routes_go(lab, tmp_path):
    proc = next(p for p in lab.handle.state.processes if p.name == "engine-i31")
    os.killpg(proc.pid, signal.SIGKILL)
    # its C-SMA stops answering for it: every route withdrawn, BGP carries that to e1
    wait_until(lambda: _origin_gone(lab, FAR), 30, "the dead engine's routes withdrawn")
    prompt = conversation(f"after-{os.getpid()}")
    (answer,) = ask_ingress(lab, tmp_path, [prompt])
    assert answer["decision"]["x-catsproto-instance"] == NEAR


def _origin_gone(lab: runner.Lab, address: str) -> bool:
    feed = RibFeed(lab.rib_file("e1"))
    feed.refresh(int(time.time() * 1000))
    table = feed.rib.services.get(ENGINE_CS_ID)
    return table is None or ipaddress.ip_address(address) not in table.by_address

"""The demo's real-engine step: a conversation through the OpenAI-compatible ingress.

Strategy. With `lab demo --engine vllm` two real vLLM engines serve sites 2 and 3, and
the demo plays a user of the official `openai` client behind the ingress (in the client
host's namespace, `catsproto.lab.engine_client`):

1. turn 1 of a conversation through the ingress: nothing is cached anywhere, the selector
   takes the engine it expects to answer first (the nearest, when both are idle); vLLM
   reports 0 cached prompt tokens;
2. turn 2 of it, once the engine's C-SMA advertised its KV events over BGP: steered to the
   engine that holds turn 1, and vLLM reports the cached tokens;
3. a conversation whose turn 1 was served at the farthest engine (sent there directly, as
   another ingress would have): its turn 2 through the ingress goes there, and the same
   turn with network-only CATS (``x-catsproto-policy: nearest``) goes to the nearest
   engine, which holds nothing of it and prefills everything;
4. new conversations, one after another, until one goes to the other engine: the nearest
   takes them while its KV cache has free blocks; once storing another would evict blocks
   it took lately, the selector prices that (the eviction term) and the next new
   conversation goes where blocks are free.

Each line shows where the request went, what the selector expected, vLLM's own count
of cached tokens, and the time to the first token the client saw.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from catsproto.adapters.file_modes import write_secret_file
from catsproto.lab import flows
from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, ENGINE_PORT, MODEL_DIR, SERVED_MODEL
from catsproto.lab.engine_site import ENGINE_CS_ID
from catsproto.lab.errors import LabError
from catsproto.lab.instances import DEMO_SECRET

TURN_TOKENS = 2_400  # a first turn this long: prefill counts, and a second turn still fits
# step 4 sends at most this many new conversations: enough to fill the lab engines' 512
# blocks (16,384 tokens) about twice over
NEW_CONVERSATIONS = 14


def conversation(topic: str, tokenizer: Any, tokens: int = TURN_TOKENS) -> str:
    """Turn 1 of a made-up conversation about `topic`: notes added until the text is at
    least `tokens` tokens long (the model takes 4,096 in all)."""
    lines = [f"The notes on {topic}: where is the cache, and what does it cost?"]
    while len(tokenizer.completion_ids("\n".join(lines))) < tokens:
        n = len(lines)
        lines += [
            f"Note {n + i} on {topic}: the prefix was computed at one site." for i in range(9)
        ]
    return "\n".join(lines)


class EngineDemo:
    """The steps above against a running lab with engines (namespaces, root)."""

    def __init__(self, lab: Any) -> None:
        from catsproto.adapters.tokenizer import PromptTokenizer
        from catsproto.keys import BlockKeyer

        self.lab = lab
        self.tokenizer = PromptTokenizer(MODEL_DIR)
        self.keyer = BlockKeyer(DEMO_SECRET, SERVED_MODEL, ENGINE_BLOCK_TOKENS)
        self.tmp = Path(tempfile.mkdtemp(prefix="catsproto-engine-demo-"))
        engines = lab.handle.state.info.get("engines", [])
        if len(engines) < 2:
            raise LabError("the engine demo needs two engines (lab up --engine vllm)")
        self.engines = {e["host"]: e for e in engines}

    def _run(self, node: str, argv: list[str]) -> Any:
        out = subprocess.run(
            ["ip", "netns", "exec", self.lab.handle.ns(node), sys.executable, "-m", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if out.returncode != 0:
            raise LabError(f"{argv[0]} in {node} failed: {out.stderr[-1500:]}")
        return json.loads(out.stdout)

    def _prompt_file(self, text: str) -> str:
        path = self.tmp / f"p{time.monotonic_ns()}.json"
        path.write_text(json.dumps([text]))
        return str(path)

    def via_ingress(self, text: str, policy: str | None = None) -> dict[str, Any]:
        host, _, _ = flows.client_link(self.lab.topology, flows.ingress_node(self.lab.topology))
        argv = ["catsproto.lab.engine_client", "ask", "--url", flows.ingress_url(self.lab)]
        argv += ["--token-file", str(flows.ingress_token_file(self.lab))]
        argv += ["--prompt-json", self._prompt_file(text)]
        if policy:
            argv += ["--policy", policy]
        answer: dict[str, Any] = self._run(host, argv)[0]
        return answer

    def direct(self, address: str, text: str) -> dict[str, Any]:
        """Straight to one engine from its own egress, as another ingress would send it."""
        node = self._egress_of(address)
        token = self.tmp / "none.token"
        write_secret_file(token, b"none\n")  # a token file the client reads: 0600
        argv = ["catsproto.lab.engine_client", "ask", "--url", f"http://{address}:{ENGINE_PORT}"]
        argv += ["--token-file", str(token), "--prompt-json", self._prompt_file(text)]
        answer: dict[str, Any] = self._run(node, argv)[0]
        return answer

    def _egress_of(self, address: str) -> str:
        for name, node in self.lab.topology.nodes.items():
            if any(str(i.address) == address for i in node.instances):
                return str(name)
        raise LabError(f"no egress serves {address}")

    def claimed(self, address: str, text: str) -> int:
        """Leading blocks of `text` the ingress's RIB says `address` holds."""
        from catsproto.adapters.steering import RibFeed

        feed = RibFeed(self.lab.rib_file(flows.ingress_node(self.lab.topology)))
        feed.refresh(int(time.time() * 1000))
        table = feed.rib.services.get(ENGINE_CS_ID)
        inst = table.by_address.get(ipaddress.ip_address(address)) if table else None
        if inst is None:
            return 0
        keys = np.array(self.keyer.block_keys(self.tokenizer.completion_ids(text)), np.uint64)
        held = inst.lookup(keys) != 0
        return int(np.argmin(held)) if not held.all() else len(held)

    def wait_advertised(self, address: str, text: str, timeout: float = 30.0) -> float:
        blocks = len(self.tokenizer.completion_ids(text)) // ENGINE_BLOCK_TOKENS
        started = time.monotonic()
        while self.claimed(address, text) < blocks:
            if time.monotonic() - started > timeout:
                raise LabError(f"{address} did not advertise the conversation in {timeout} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def by_distance(self) -> list[str]:
        """The engines' addresses, nearest to the ingress first (the topology's delays)."""
        from catsproto.lab.steering import network_from_topology

        network, sites = network_from_topology(self.lab.topology)
        ingress = flows.ingress_node(self.lab.topology)
        site_of = {
            str(i.address): i.site_id for n in self.lab.topology.nodes.values() for i in n.instances
        }

        def delay(address: str) -> float:
            path = network.path(ingress, sites[site_of[address]])
            return path.delay_ms if path is not None else float("inf")

        return sorted(self.engines, key=lambda a: (delay(a), a))

    def run(self) -> list[list[str]]:
        """The three steps; one table row per request."""
        rows = []
        tag = os.urandom(3).hex()
        first = conversation(f"topic {tag}-a", self.tokenizer)
        a1 = self.via_ingress(first)
        holder = a1["decision"]["x-catsproto-instance"]
        rows.append(_row("turn 1, catsproto", a1))
        waited = self.wait_advertised(holder, first)
        a2 = self.via_ingress(first + "\nAnd the second question?")
        rows.append(_row(f"turn 2, catsproto ({waited:.1f} s later)", a2))
        far = self.by_distance()[-1]
        other = conversation(f"topic {tag}-b", self.tokenizer)
        b1 = self.direct(far, other)
        rows.append(_row(f"turn 1 sent to {far} directly", b1, where=far))
        self.wait_advertised(far, other)
        follow = other + "\nAnd the second question?"
        rows.append(_row("turn 2, catsproto", self.via_ingress(follow)))
        rows.append(_row("turn 2, network-only CATS", self.via_ingress(follow, "nearest")))
        rows += self.spread(tag)
        return rows

    def spread(self, tag: str, most: int = NEW_CONVERSATIONS) -> list[list[str]]:
        """Step 4: new conversations until one goes to another engine than the first; a
        row for the first and for each from the one before the move on."""
        went: list[tuple[int, dict[str, Any]]] = []
        for k in range(1, most + 1):
            answer = self.via_ingress(conversation(f"topic {tag}-n{k}", self.tokenizer))
            went.append((k, answer))
            first = went[0][1]["decision"].get("x-catsproto-instance")
            if answer["decision"].get("x-catsproto-instance") != first:
                break
        shown = went[:1] + went[max(1, len(went) - 2) :]
        return [_row(f"new conversation {k}", a) for k, a in shown]


HEADER = ["request", "engine", "site", "expected", "evict ms", "vLLM cached", "TTFT ms"]


def _row(label: str, answer: dict[str, Any], where: str | None = None) -> list[str]:
    d = answer.get("decision", {})
    expected = d.get("x-catsproto-expected-cached-blocks")
    evict = d.get("x-catsproto-evict-ms")
    return [
        label,
        d.get("x-catsproto-instance", where or "?"),
        d.get("x-catsproto-site", "-"),
        f"{int(expected) * ENGINE_BLOCK_TOKENS} tok" if expected is not None else "-",
        f"{float(evict):.1f}" if evict is not None else "-",
        f"{answer.get('cached_tokens')}/{answer.get('prompt_tokens')} tok",
        f"{answer['ttft_ms']:.1f}",
    ]

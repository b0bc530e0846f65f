"""The real-engine benchmark's workload as text whose tokens are exactly the trace's blocks.

Strategy. smg takes no token-id prompts, so every router in the benchmark (catsproto's
ingress too) gets the same text prompts. They are built from the lab tokenizer's
*single-token words*: ids whose text starts with a space, is alphabetic, and encodes
back to that one id. The tokenizer splits on the leading space before it merges, so any
concatenation of such words encodes to exactly the ids they were made from: a trace
block (512 tokens, named by its hash id) becomes `tokens_per_block` words drawn from a
generator seeded by the hash id, and turns that share hash ids share a token prefix
exactly as the trace's turns do. `check_exact` proves it for a whole workload with the
same encoding the ingress applies (`catsproto.adapters.tokenizer`); the benchmark also
asks an engine's own ``POST /tokenize`` before it runs.

The conversations: every turn of the trace's first `conversations` multi-turn
conversations (requests sharing their second block), in trace order, one request every
1/rate seconds (the trace's own times, hours of them, would leave two cores idle).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, MODEL_DIR


class WorkloadError(ValueError):
    """A workload whose text does not re-tokenize to its ids (the message says where)."""


@lru_cache(maxsize=4)
def single_token_words(model_dir: str = str(MODEL_DIR)) -> tuple[tuple[int, str], ...]:
    """(id, text) of every id whose text is a space and letters and encodes back to it alone."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=False)):
        text = tok.decode([i])
        if (
            len(text) > 1
            and text[0] == " "
            and text[1:].isalpha()
            and tok.encode(text, add_special_tokens=False).ids == [i]
        ):
            out.append((i, text))
    return tuple(out)


def block_ids(hash_id: int, n: int, words: tuple[tuple[int, str], ...]) -> list[int]:
    """The `n` token ids standing for one trace block: words drawn by the hash id's seed."""
    rng = np.random.default_rng(hash_id)
    return [words[int(k)][0] for k in rng.integers(0, len(words), n)]


def conversation_turns(trace: Path, conversations: int) -> list[tuple[int, dict[str, Any]]]:
    """(conversation number, trace row) of every turn of the first `conversations`
    multi-turn conversations, in trace order."""
    with trace.open() as f:
        rows = [json.loads(line) for line in f]
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if len(row["hash_ids"]) > 1:
            by_conv.setdefault(row["hash_ids"][1], []).append(row)
    multi = [turns for turns in by_conv.values() if len(turns) >= 2][:conversations]
    picked = [(c, r) for c, turns in enumerate(multi) for r in turns]
    return sorted(picked, key=lambda cr: cr[1]["timestamp"])


def workload(
    trace: Path,
    conversations: int,
    rate: float,
    tokens_per_block: int,
    max_prompt: int,
    model_dir: str = str(MODEL_DIR),
) -> list[dict[str, Any]]:
    """The items ``{"t_s", "conversation", "ids", "prompt", "max_tokens"}``: `ids` the
    token ids, `prompt` their text (the words joined), cut at `max_prompt` tokens."""
    words = single_token_words(model_dir)
    text_of = dict(words)
    items = []
    for i, (conv, row) in enumerate(conversation_turns(trace, conversations)):
        ids: list[int] = []
        for h in row["hash_ids"]:
            ids += block_ids(h, tokens_per_block, words)
        ids = ids[:max_prompt]
        items.append(
            {
                "t_s": i / rate,
                "conversation": conv,
                "ids": ids,
                "prompt": "".join(text_of[t] for t in ids),
                "max_tokens": 1,
            }
        )
    return items


def check_exact(items: list[dict[str, Any]], model_dir: str = str(MODEL_DIR)) -> int:
    """Every item's text encodes, the way the ingress and vLLM encode a completion's
    prompt, to exactly its ids; returns the tokens checked, or raises WorkloadError
    naming the first item that does not."""
    from catsproto.adapters.tokenizer import PromptTokenizer

    tok = PromptTokenizer(model_dir)
    total = 0
    for n, item in enumerate(items):
        got = tok.completion_ids(item["prompt"])
        if got != item["ids"]:
            at = next(
                (k for k, (a, b) in enumerate(zip(got, item["ids"], strict=False)) if a != b), None
            )
            raise WorkloadError(
                f"workload item {n}: its text encodes to {len(got)} tokens, not its "
                f"{len(item['ids'])} ids (first difference at token "
                f"{at if at is not None else min(len(got), len(item['ids']))})"
            )
        total += len(got)
    return total


def reuse_ceiling(items: list[dict[str, Any]], block: int = ENGINE_BLOCK_TOKENS) -> float:
    """Fraction of the workload's full engine blocks an infinite cache would serve."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for item in items:
        p = item["ids"]
        blocks = [tuple(p[i : i + block]) for i in range(0, len(p) - block + 1, block)]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hit, total = hit + k, total + len(blocks)
        seen.update(blocks)
    return hit / total if total else 0.0

"""What a prefix-cache hit saves on the lab's engine: cold against cached prefill, as JSON.

One real vLLM engine (the lab's model, `lab/engine/tiny-llama`, random weights, on one
core as in the lab) on loopback; for each prompt length, `--repeat` prompts of random
token ids, each asked twice with `max_tokens` 1: the first time it is prefilled whole
(cold), the second time vLLM serves all but its last partial block from its prefix cache
(cached). The figure is the request's time, client side, which with one output token is
the time to first token. `cached_over_cold` is the ratio of the medians.

This is what sizes the model (docs/decisions/0003): its prefill on one core should cost
what a served model's does on its accelerator, so that the network's RTTs and the
cache's savings stand in the proportion they have in production.

    .venv/bin/python benchmarks/engine_prefill.py [--lengths 500 1700 3500] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from catsproto.lab.engine import MODEL_DIR, SERVED_MODEL, EngineSpec, LocalEngine  # noqa: E402

VOCAB = 1024


def ask(url: str, ids: list[int]) -> tuple[float, int]:
    """(milliseconds, cached prompt tokens) of one completion of one token."""
    body = json.dumps({"model": SERVED_MODEL, "prompt": ids, "max_tokens": 1}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", body, {"content-type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        usage = json.load(reply)["usage"]
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[500, 1700, 3500])
    p.add_argument("--repeat", type=int, default=3, help="prompts per length")
    p.add_argument("--port", type=int, default=18431, help="the engine's loopback port")
    p.add_argument("--cpu", default="1", help="the core the engine runs on (taskset)")
    args = p.parse_args()
    if max(args.lengths) > 4000:
        p.error("the model takes 4,096 positions: lengths up to 4,000")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    rng = random.Random(20261204)
    rows = []
    with tempfile.TemporaryDirectory(prefix="catsproto-prefill-") as tmp:
        spec = EngineSpec(
            host="127.0.0.1",
            port=args.port,
            num_gpu_blocks=1024,
            cpu=args.cpu,
            ipc_dir=Path(tmp),
        )
        with LocalEngine(spec, Path(tmp) / "engine.log") as engine:
            print("starting the engine (about 30 s)", file=sys.stderr)
            engine.wait_ready()
            ask(spec.url, [rng.randrange(3, VOCAB) for _ in range(64)])  # first-call costs
            for n in args.lengths:
                cold, cached, hit = [], [], []
                for _ in range(args.repeat):
                    ids = [rng.randrange(3, VOCAB) for _ in range(n)]
                    cold.append(ask(spec.url, ids)[0])
                    ms, tokens = ask(spec.url, ids)
                    cached.append(ms)
                    hit.append(tokens)
                rows.append(
                    {
                        "prompt_tokens": n,
                        "cold_ms": round(statistics.median(cold), 1),
                        "cached_ms": round(statistics.median(cached), 1),
                        "cached_tokens": min(hit),
                        "cached_over_cold": round(
                            statistics.median(cached) / statistics.median(cold), 3
                        ),
                        "cold_tokens_per_s": round(n / statistics.median(cold) * 1000),
                    }
                )
                print(f"{n} tokens: {rows[-1]}", file=sys.stderr)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    out = {
        "benchmark": "engine_prefill",
        "model": {k: config[k] for k in keys},
        "cores": 1,
        "repeat": args.repeat,
        "lengths": rows,
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real engines, real TTFT: catsproto against network-only CATS on a multi-turn workload.

The 4-site lab with real vLLM engines at sites 2 and 3 (`lab up cats4 --engine vllm`,
root; each engine on a core of its own, `--engine-blocks` KV blocks of 32 tokens), and the
multi-turn conversations of the Mooncake conversation trace replayed through the lab's
OpenAI-compatible ingress by the official `openai` client in the client host's namespace,
on the same lab and engines, by each policy in turn: catsproto (the path selector with
the engines' advertised caches and load) and network-only CATS (the nearest engine,
``x-catsproto-policy: nearest``). Both engines' prefix caches are cleared before every
run (vLLM's ``POST /reset_prefix_cache``, which their C-SMAs advertise).

The workload: every turn of the trace's first `--conversations` multi-turn conversations
(requests sharing their second block), in trace order, one request every 1/rate seconds,
for each of `--rates`. Each 512-token trace block becomes `--tokens-per-block` token ids
drawn from a generator seeded by its hash id, so turns that share hash ids share a token
prefix exactly as the trace's do; prompts are cut at `--max-prompt` tokens (the tiny
model takes 4,096). `reuse_ceiling` is the fraction of blocks an infinite cache would
serve. Output: one token (`max_tokens` 1: time to first token is the figure).

Prints JSON: per rate and policy the real TTFT (first streamed token, client side) mean,
p50 and p99, the engines' own cached prompt tokens, where requests went, and the
ingress's ground truth (blocks the selector expected cached against vLLM's report:
agreement, stale, false positive); `ttft_mean_ratio` = catsproto / nearest, and
`ttft_mean_ratio_vs_compute-aware` = catsproto / network and compute CATS; the bytes of
the engines' signed advertisements e1 accepted.

    sudo .venv/bin/python benchmarks/engine_e2e.py [--rates 2 3] [--tag RUNNING_LAB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from catsproto.adapters.steering import RibFeed  # noqa: E402
from catsproto.adapters.trace_download import find_or_download_trace  # noqa: E402
from catsproto.keys import BlockKeyer  # noqa: E402
from catsproto.lab import flows, runner  # noqa: E402
from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, SERVED_MODEL  # noqa: E402
from catsproto.lab.engine_site import ENGINE_CS_ID  # noqa: E402
from catsproto.lab.instances import DEMO_SECRET  # noqa: E402

CATS4 = REPO / "lab" / "cats4.clab.yml"
VOCAB = 1024
KEYER = BlockKeyer(DEMO_SECRET, SERVED_MODEL, ENGINE_BLOCK_TOKENS)


def block_tokens(hash_id: int, n: int) -> list[int]:
    """The `n` token ids standing for one trace block (ids 7.. keep clear of the specials)."""
    rng = np.random.default_rng(hash_id)
    return [int(t) for t in rng.integers(7, VOCAB, n)]


def workload(
    trace: Path, conversations: int, rate: float, tokens_per_block: int, max_prompt: int
) -> list[dict]:
    """Every turn of the trace's first `conversations` multi-turn conversations (requests
    sharing their second block; a conversation's next turn repeats most of the last one),
    in trace order, as token-id prompts sent one every 1/`rate` seconds (the trace's own
    times, hours of them, would leave two cores idle or, compressed, start with the
    burst of its first second). Each 512-token trace block becomes `tokens_per_block`
    tokens (a whole number of the engines' 32-token blocks)."""
    with trace.open() as f:
        rows = [json.loads(line) for line in f]
    by_conv: dict[int, list[dict]] = {}
    for row in rows:
        if len(row["hash_ids"]) > 1:
            by_conv.setdefault(row["hash_ids"][1], []).append(row)
    multi = [turns for turns in by_conv.values() if len(turns) >= 2][:conversations]
    picked = sorted((r for turns in multi for r in turns), key=lambda r: r["timestamp"])
    items = []
    for i, row in enumerate(picked):
        tokens: list[int] = []
        for h in row["hash_ids"]:
            tokens += block_tokens(h, tokens_per_block)
        items.append(
            {
                "t_s": i / rate,
                "prompt": tokens[:max_prompt],
                "max_tokens": 1,
            }
        )
    return items


def reuse(items: list[dict]) -> float:
    """Fraction of the workload's full blocks an infinite cache would serve (its ceiling)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for item in items:
        p = item["prompt"]
        blocks = [tuple(p[i : i + ENGINE_BLOCK_TOKENS]) for i in range(0, len(p) - 31, 32)]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hit, total = hit + k, total + len(blocks)
        seen.update(blocks)
    return hit / total if total else 0.0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def in_ns(lab: runner.Lab, node: str, argv: list[str], timeout: float = 1800) -> Any:
    out = subprocess.run(
        ["ip", "netns", "exec", lab.handle.ns(node), sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{argv[:3]} in {node} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout) if out.stdout.strip() else None


# vLLM publishes the AllBlocksCleared of a reset with its next engine step: a request of
# less than a block (nothing cached) makes that step
RESET = (
    "import json, sys, urllib.request\n"
    "r = urllib.request.Request(sys.argv[1] + '/reset_prefix_cache', method='POST')\n"
    "urllib.request.urlopen(r, timeout=30).read()\n"
    "body = json.dumps({'model': 'catsproto-tiny', 'prompt': [7, 8, 9], 'max_tokens': 1})\n"
    "r = urllib.request.Request(sys.argv[1] + '/v1/completions', body.encode(),\n"
    "    {'Content-Type': 'application/json'})\n"
    "print(urllib.request.urlopen(r, timeout=30).status)\n"
)


def engines(lab: runner.Lab) -> list[dict[str, Any]]:
    return list(lab.handle.state.info.get("engines", []))


def reset_caches(lab: runner.Lab, probes: list[list[int]]) -> None:
    """Clear every engine's prefix cache, then wait until e1's RIB (what BGP delivered)
    claims none of the `probes` prompts' first block at any engine."""
    for e in engines(lab):
        node = next(
            n
            for n, nd in lab.topology.nodes.items()
            for i in nd.instances
            if i.name == e["instance"]
        )
        in_ns(lab, node, ["-c", RESET, f"http://{e['host']}:{e['port']}"], timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if claimed(lab, probes) == 0:
            return
        time.sleep(0.5)
    raise SystemExit("the engines' cleared caches were not advertised within 30 s")


def claimed(lab: runner.Lab, prompts: list[list[int]]) -> int:
    """How many of `prompts` e1's RIB says some engine holds the first block of."""
    feed = RibFeed(lab.rib_file("e1"))
    feed.refresh(int(time.time() * 1000))
    table = feed.rib.services.get(ENGINE_CS_ID)
    if table is None:
        return 0
    keys = np.array([KEYER.block_keys(p[:ENGINE_BLOCK_TOKENS])[0] for p in prompts], np.uint64)
    return sum(int((inst.lookup(keys) != 0).sum()) for inst in table.by_address.values())


def ingress_get(lab: runner.Lab, path: str) -> Any:
    host, _, _ = flows.client_link(lab.topology, flows.ingress_node(lab.topology))
    script = (
        "import sys, urllib.request\n"
        "r = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + "
        "open(sys.argv[2]).read().strip()})\n"
        "print(urllib.request.urlopen(r, timeout=30).read().decode())\n"
    )
    url = flows.ingress_url(lab) + path
    out = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            lab.handle.ns(host),
            sys.executable,
            "-c",
            script,
            url,
            str(flows.ingress_token_file(lab)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout


def summarise(results: list[dict]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_ms"] for r in ok]
    went: dict[str, int] = {}
    for r in ok:
        inst = r.get("decision", {}).get("x-catsproto-instance", "?")
        went[inst] = went.get(inst, 0) + 1
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_ms": {
            "mean": round(statistics.fmean(ttft), 2) if ttft else None,
            "p50": round(pct(ttft, 50), 2),
            "p99": round(pct(ttft, 99), 2),
        },
        "prompt_tokens": prompt,
        "engine_cached_tokens": cached,
        "engine_cached_fraction": round(cached / prompt, 4) if prompt else None,
        "instances": went,
    }


def replay(lab: runner.Lab, items: list[dict], policy: str | None) -> list[dict]:
    host, _, _ = flows.client_link(lab.topology, flows.ingress_node(lab.topology))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(items, f)
    argv = ["-m", "catsproto.lab.engine_client", "replay", "--url", flows.ingress_url(lab)]
    argv += ["--token-file", str(flows.ingress_token_file(lab)), "--workload", f.name]
    if policy:
        argv += ["--policy", policy]
    try:
        result: list[dict] = in_ns(lab, host, argv)
    finally:
        os.unlink(f.name)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="the Mooncake conversation trace (default: looked for)")
    p.add_argument("--conversations", type=int, default=100, help="multi-turn conversations")
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[2.0, 3.0],
        help="requests per second, one run of every policy at each",
    )
    p.add_argument(
        "--tokens-per-block", type=int, default=64, help="tokens per 512-token trace block"
    )
    p.add_argument("--max-prompt", type=int, default=3500, help="tokens per prompt at most")
    p.add_argument("--tag", help="use this running lab (lab up cats4 --engine vllm)")
    p.add_argument(
        "--engine-blocks",
        type=int,
        default=2048,
        help="each engine's KV blocks (default 2,048 = 65,536 tokens, about a quarter of "
        "the default workload's distinct prompt tokens)",
    )
    p.add_argument("--results", help="write every request's result here (JSON)")
    p.add_argument(
        "--policies",
        nargs="+",
        default=["nearest", "compute-aware", "catsproto"],
        choices=["nearest", "compute-aware", "catsproto"],
        help="policies to run at each rate, in this order",
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("engine_e2e needs root (the namespaced lab)")
    trace = Path(args.trace) if args.trace else find_or_download_trace()
    own = args.tag is None
    run_dir = Path(tempfile.mkdtemp(prefix="catsproto-e2e-"))
    lab = (
        runner.up(
            CATS4,
            run_dir,
            tag=f"x{os.getpid()}",
            feed=True,
            engine="vllm",
            feed_interval=1.0,
            engine_blocks=args.engine_blocks,
        )
        if own
        else runner.attach(runner.DEFAULT_ROOT / args.tag)
    )
    try:
        base = workload(trace, args.conversations, 1.0, args.tokens_per_block, args.max_prompt)
        replay(lab, base[:4], None)  # warm the engines' code paths (caches reset below)
        sweep: list[dict[str, Any]] = []
        every: dict[str, list[dict]] = {}
        for rate in args.rates:
            items = [{**it, "t_s": it["t_s"] / rate} for it in base]
            runs: dict[str, Any] = {}
            for policy in args.policies:
                reset_caches(lab, [it["prompt"] for it in items[:20]])
                print(f"rate {rate}/s, {policy}: {len(items)} requests", file=sys.stderr)
                before = _ground_truth(ingress_get(lab, "/metrics"))
                started = time.monotonic()
                results = replay(lab, items, None if policy == "catsproto" else policy)
                every[f"{rate}/{policy}"] = results
                after = _ground_truth(ingress_get(lab, "/metrics"))
                runs[policy] = {
                    **summarise(results),
                    "wall_s": round(time.monotonic() - started, 1),
                    # the machine's 1-minute load at the end: another job on its two
                    # cores slows the engines and shows here
                    "load_1min": round(os.getloadavg()[0], 2),
                    "ground_truth": _delta(before, after),
                }
            row: dict[str, Any] = {"rate_per_s": rate, "runs": runs}
            for other in ("nearest", "compute-aware"):
                if "catsproto" in runs and other in runs:
                    key = "ttft_mean_ratio" + ("" if other == "nearest" else f"_vs_{other}")
                    row[key] = round(
                        runs["catsproto"]["ttft_ms"]["mean"] / runs[other]["ttft_ms"]["mean"], 3
                    )
            sweep.append(row)
        if args.results:
            Path(args.results).write_text(json.dumps(every))
        out = {
            "benchmark": "engine_e2e",
            "trace": trace.name,
            "conversations": args.conversations,
            "requests": len(base),
            "prompt_tokens_mean": round(statistics.fmean(len(i["prompt"]) for i in base), 1),
            "reuse_ceiling": round(reuse(base), 4),
            "engines": [f"{e['host']} ({e['instance']})" for e in engines(lab)],
            "engine_kv_blocks": [e["num_gpu_blocks"] for e in engines(lab)],
            "model": _model_shape(),
            "cores": os.cpu_count(),
            "sweep": sweep,
            "advertisement_bytes": advert_bytes(lab),
        }
        json.dump(out, sys.stdout, indent=1)
        print()
    finally:
        if own:
            lab.down()
    return 0


def _model_shape() -> dict[str, int]:
    """The engines' model, as its config says (random weights: its size sets the prefill cost)."""
    from catsproto.lab.engine import MODEL_DIR

    config = json.loads((MODEL_DIR / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    return {k: int(config[k]) for k in keys}


def _ground_truth(metrics_text: str) -> dict[str, float]:
    """The ingress's ground-truth block counters, all origins together."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("catsproto_ingress_groundtruth_blocks_total{"):
            continue
        name, _, value = line.rpartition(" ")
        if 'origin="total"' in name:
            outcome = name.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One run's ground truth: blocks the selector expected cached and the engines
    confirmed (agreement), and the misses by kind."""
    d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    confirmable = d.get("confirmable", 0)
    d["agreement"] = round(d.get("confirmed", 0) / confirmable, 4) if confirmable else None
    return d


def advert_bytes(lab: runner.Lab) -> dict[str, int]:
    """Bytes of the engines' signed advertisements e1 accepted (cs 200), per origin."""
    out: dict[str, int] = {}
    for line in (lab.rib_file("e1").parent / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        entry = ev.get("entry") or {}
        if ev.get("kind") == "accept" and entry.get("cs_id") == 200:
            out[entry["origin"]] = out.get(entry["origin"], 0) + int(entry.get("bytes", 0))
    return out


if __name__ == "__main__":
    sys.exit(main())

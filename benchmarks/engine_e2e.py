"""Real engines, real TTFT: catsproto against network-only CATS and the routers a vLLM
user would pick instead, on the same lab and the same engines, in one run.

The 4-site lab with real vLLM engines at sites 2 and 3 (`lab up cats4 --engine vllm`,
root; each engine on a core of its own, `--engine-blocks` KV blocks of 32 tokens), with
site 4's egress (e4) made a second ingress with a client host of its own (`client4`,
`flows.with_second_ingress`; the single-site runs do not use it). The multi-turn
conversations of the Mooncake conversation trace are replayed by the official `openai`
client in a client host's namespace, steered in turn by:

* our policies, through our ingress at e1: catsproto (the path selector with the
  engines' advertised caches and load), network-only CATS (``nearest``) and network and
  compute CATS (``compute-aware``: caches ignored), chosen per request with the
  ``x-catsproto-policy`` header;
* the peers (`catsproto.lab.peers`, `--peers`): smg, sglang-router and vllm-router with
  ``--policy cache_aware``, each installed into a venv of its own (pinned, cached under
  the user's cache folder), started in e1's namespace on its client-facing address in
  front of both engines, polled through ``/workers`` until ready, ended by PID after
  its run (so each run starts with an empty tree, as the engines start with empty
  caches).

Every run gets the same text prompts (`catsproto.lab.text_workload`: words that are
single tokens of the lab tokenizer, so a prompt's tokens are exactly its trace blocks;
checked before the sweep with our tokenizer and with an engine's own ``/tokenize``).
Both engines' prefix caches are cleared before every run (vLLM's
``POST /reset_prefix_cache``, which their C-SMAs advertise).

Multi-site (`--multi-site-rates`, default 2/s): conversations arrive at two ingresses,
e1 (client) and e4 (client4): `--site-split conversation` gives each conversation a home
site (even numbers e1, odd e4), `turn` alternates a conversation's turns between the
sites. catsproto runs as CATS is deployed, a path selector at each ingress fed by BGP;
each peer runs twice, as users would deploy it: ``per-site`` (one router at each
ingress, each knowing only what it routed) and ``global`` (one router at e1, site 4's
clients sent to it across the network). The lab's link delays are not applied on this
kernel (no netem), so crossing the network costs no time here: the selector's RTT is
only modelled.

Loads: the machine's 1-minute load is recorded at the start and end of every run; a run
with either above the core count is flagged ``"loaded": true`` and left out of every
ratio. Ratios per rate: catsproto / the best unloaded peer for mean and p50 TTFT (the
best peer for each figure) and for the fraction of prompt tokens vLLM served from cache.
Agreement with vLLM's cached-token report: the ingress's ground truth for our policies
(blocks the selector expected cached that vLLM confirmed), and for every run the
client's summed ``cached_tokens`` against the engines' own ``/metrics`` counters.

    sudo .venv/bin/python benchmarks/engine_e2e.py --out docs/eval/engine/e2e-peers.json
    sudo .venv/bin/python benchmarks/engine_e2e.py --conversations 15 --rates 2 \\
        --policies catsproto --peers smg --multi-site-rates       # a smoke run
    .venv/bin/python benchmarks/engine_e2e.py --render docs/eval/engine/e2e-peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from catsproto.lab import flows, peers, runner, text_workload  # noqa: E402
from catsproto.lab.engine import ENGINE_BLOCK_TOKENS, SERVED_MODEL  # noqa: E402

CATS4 = REPO / "lab" / "cats4.clab.yml"
SECOND_INGRESS = ("e4", "client4", "10.100.4.0/30")
PEER_PORT = 8100  # a peer's API on the ingress's client-facing address (ours is 8000)
OUR_POLICIES = ("nearest", "compute-aware", "catsproto")
HEADLINE = "catsproto"


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

# the engine's own counters: requests finished, prompt tokens, cached prompt tokens
METRICS = (
    "import json, sys, urllib.request\n"
    "text = urllib.request.urlopen(sys.argv[1] + '/metrics', timeout=30).read().decode()\n"
    "out = {'requests': 0.0, 'prompt_tokens': 0.0, 'cached_tokens': 0.0}\n"
    "names = {'vllm:request_success_total': 'requests',\n"
    "         'vllm:prompt_tokens_total': 'prompt_tokens',\n"
    "         'vllm:prompt_tokens_cached_total': 'cached_tokens'}\n"
    "for line in text.splitlines():\n"
    "    name = line.split('{', 1)[0].split(' ', 1)[0]\n"
    "    if name in names:\n"
    "        out[names[name]] += float(line.rsplit(' ', 1)[1])\n"
    "print(json.dumps(out))\n"
)

# the engine's own tokenizer on every prompt of the workload: its ids must be ours
TOKENIZE = (
    "import json, sys, urllib.request\n"
    "items = json.load(open(sys.argv[2]))\n"
    "bad = []\n"
    "for n, item in enumerate(items):\n"
    "    body = json.dumps({'model': 'catsproto-tiny', 'prompt': item['prompt']}).encode()\n"
    "    r = urllib.request.Request(sys.argv[1] + '/tokenize', body,\n"
    "        {'Content-Type': 'application/json'})\n"
    "    got = json.loads(urllib.request.urlopen(r, timeout=60).read())['tokens']\n"
    "    if got != item['ids']:\n"
    "        bad.append(n)\n"
    "print(json.dumps({'checked': len(items), 'different': bad}))\n"
)


def engines(lab: runner.Lab) -> list[dict[str, Any]]:
    return list(lab.handle.state.info.get("engines", []))


def engine_node(lab: runner.Lab, instance: str) -> str:
    return next(
        n for n, nd in lab.topology.nodes.items() for i in nd.instances if i.name == instance
    )


def engine_url(e: dict[str, Any]) -> str:
    return f"http://{e['host']}:{e['port']}"


def engine_counters(lab: runner.Lab) -> dict[str, dict[str, float]]:
    return {
        e["instance"]: in_ns(
            lab, engine_node(lab, e["instance"]), ["-c", METRICS, engine_url(e)], timeout=60
        )
        for e in engines(lab)
    }


def check_engine_tokenizer(lab: runner.Lab, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Every prompt through the first engine's ``POST /tokenize``: its ids must be ours."""
    e = engines(lab)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt": it["prompt"], "ids": it["ids"]} for it in items], f)
    try:
        got = in_ns(lab, engine_node(lab, e["instance"]), ["-c", TOKENIZE, engine_url(e), f.name])
    finally:
        os.unlink(f.name)
    if got["different"]:
        raise SystemExit(
            f"the engine tokenizes {len(got['different'])} of {got['checked']} prompts "
            f"differently from the workload's ids (first: item {got['different'][0]})"
        )
    return {"engine": e["instance"], "prompts": got["checked"], "exact": True}


def reset_caches(lab: runner.Lab, probes: list[list[int]], ingresses: list[str]) -> None:
    """Clear every engine's prefix cache, then wait until each ingress's RIB (what BGP
    delivered) claims none of the `probes` prompts' first block at any engine."""
    for e in engines(lab):
        in_ns(lab, engine_node(lab, e["instance"]), ["-c", RESET, engine_url(e)], timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(claimed(lab, probes, node) == 0 for node in ingresses):
            return
        time.sleep(0.5)
    raise SystemExit("the engines' cleared caches were not advertised within 30 s")


def claimed(lab: runner.Lab, prompts: list[list[int]], node: str) -> int:
    """How many of `prompts` `node`'s RIB says some engine holds the first block of."""
    from catsproto.adapters.steering import RibFeed
    from catsproto.keys import BlockKeyer
    from catsproto.lab.engine_site import ENGINE_CS_ID
    from catsproto.lab.instances import DEMO_SECRET

    keyer = BlockKeyer(DEMO_SECRET, SERVED_MODEL, ENGINE_BLOCK_TOKENS)
    feed = RibFeed(lab.rib_file(node))
    feed.refresh(int(time.time() * 1000))
    table = feed.rib.services.get(ENGINE_CS_ID)
    if table is None:
        return 0
    keys = np.array([keyer.block_keys(p[:ENGINE_BLOCK_TOKENS])[0] for p in prompts], np.uint64)
    return sum(int((inst.lookup(keys) != 0).sum()) for inst in table.by_address.values())


def ingress_get(lab: runner.Lab, path: str, node: str) -> str:
    host, _, _ = flows.client_link(lab.topology, node)
    script = (
        "import sys, urllib.request\n"
        "r = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + "
        "open(sys.argv[2]).read().strip()})\n"
        "print(urllib.request.urlopen(r, timeout=30).read().decode())\n"
    )
    out = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            lab.handle.ns(host),
            sys.executable,
            "-c",
            script,
            flows.ingress_url(lab, node) + path,
            str(flows.ingress_token_file(lab, node)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout


# ---- one run ----------------------------------------------------------------------------


class Target:
    """Where one site's client sends its requests: a URL, a token (or none), a policy."""

    def __init__(self, host: str, url: str, token_file: Path | None, policy: str | None) -> None:
        self.host, self.url, self.token_file, self.policy = host, url, token_file, policy

    def argv(self, workload: str) -> list[str]:
        argv = ["-m", "catsproto.lab.engine_client", "replay", "--url", self.url]
        argv += ["--workload", workload]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        if self.policy:
            argv += ["--policy", self.policy]
        return argv


def replay(lab: runner.Lab, parts: list[tuple[Target, list[dict]]]) -> list[list[dict]]:
    """Each target's items replayed from its client host, all targets at once."""
    files, procs = [], []
    try:
        for target, items in parts:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump([{k: it[k] for k in ("t_s", "prompt", "max_tokens")} for it in items], f)
            files.append(f.name)
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        lab.handle.ns(target.host),
                        sys.executable,
                        *target.argv(f.name),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                )
            )
        out = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"the client failed: {stderr[-2000:]}")
            out.append(json.loads(stdout))
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for name in files:
            os.unlink(name)


def summarise(results: list[dict]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_ms"] for r in ok]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "ttft_ms": {
            "mean": round(statistics.fmean(ttft), 2) if ttft else None,
            "p50": round(pct(ttft, 50), 2),
            "p99": round(pct(ttft, 99), 2),
        },
        "prompt_tokens": prompt,
        "engine_cached_tokens": cached,
        "engine_cached_fraction": round(cached / prompt, 4) if prompt else None,
    }


def engines_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, int]]:
    return {
        inst: {k: int(after[inst][k] - before[inst].get(k, 0.0)) for k in after[inst]}
        for inst in after
    }


def report_agreement(summary: dict[str, Any], by_engine: dict[str, dict[str, int]]) -> float | None:
    """The client's cached tokens (vLLM's answers) against the engines' /metrics counters:
    the smaller over the larger (1.0: they agree exactly)."""
    client = summary["engine_cached_tokens"]
    engine = sum(e["cached_tokens"] for e in by_engine.values())
    if client == engine:
        return 1.0
    return round(min(client, engine) / max(client, engine), 4)


def load_now() -> float:
    return round(os.getloadavg()[0], 2)


SETTLE = {"s": 30.0}  # --settle: the longest wait for a quiet machine before a run


def settle() -> float:
    """Wait (at most `--settle` seconds) until the 1-minute load is at most the core
    count, so one run's work does not slow the next; the seconds waited."""
    started = time.monotonic()
    while load_now() > (os.cpu_count() or 1) and time.monotonic() - started < SETTLE["s"]:
        time.sleep(2)
    return round(time.monotonic() - started, 1)


def run_once(
    lab: runner.Lab,
    label: str,
    parts: list[tuple[Target, list[dict]]],
    ingresses: list[str],
    ours: list[str],
    probes: list[list[int]],
    every: dict[str, list[dict]],
) -> dict[str, Any]:
    """Reset the caches, replay, measure: one run's summary. `ours`: the ingress nodes
    whose ground truth counts (our policies); peers have none."""
    reset_caches(lab, probes, ingresses)
    requests = sum(len(items) for _, items in parts)
    waited = settle()
    load_start = load_now()
    print(f"{label}: {requests} requests, load {load_start}", file=sys.stderr, flush=True)
    before_gt = {n: _ground_truth(ingress_get(lab, "/metrics", n)) for n in ours}
    before = engine_counters(lab)
    started = time.monotonic()
    results = [r for out in replay(lab, parts) for r in out]
    wall = round(time.monotonic() - started, 1)
    by_engine = engines_delta(before, engine_counters(lab))
    load_end = load_now()
    every[label] = results
    summary = summarise(results)
    run: dict[str, Any] = {
        **summary,
        "engines": by_engine,
        "wall_s": wall,
        # another job on the two cores slows the engines and shows here
        "load_1min": {"start": load_start, "end": load_end},
        "settle_s": waited,
        "loaded": max(load_start, load_end) > (os.cpu_count() or 1),
        "cached_report_agreement": report_agreement(summary, by_engine),
    }
    if ours:
        gts = [_delta(before_gt[n], _ground_truth(ingress_get(lab, "/metrics", n))) for n in ours]
        run["ground_truth"] = _merge_ground_truth(gts)
    t = run["ttft_ms"]
    print(
        f"{label}: mean {t['mean']} ms, p50 {t['p50']} ms, p99 {t['p99']} ms, "
        f"cached {run['engine_cached_fraction']}, errors {run['errors']}, "
        f"load {load_start}->{load_end}{' (loaded)' if run['loaded'] else ''}",
        file=sys.stderr,
        flush=True,
    )
    return run


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


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}


def _merge_ground_truth(deltas: list[dict[str, int]]) -> dict[str, Any]:
    """One run's ground truth over its ingresses: blocks the selector expected cached and
    the engines confirmed (agreement), and the misses by kind."""
    d: dict[str, Any] = {}
    for one in deltas:
        for k, v in one.items():
            d[k] = d.get(k, 0) + v
    confirmable = d.get("confirmable", 0)
    d["agreement"] = round(d.get("confirmed", 0) / confirmable, 4) if confirmable else None
    return d


# ---- peers ------------------------------------------------------------------------------


def gateway(lab: runner.Lab, node: str) -> str:
    """The address of `node`'s first BGP neighbour: its first hop towards the sites."""
    nb = lab.topology.neighbors(node)
    if not nb or nb[0].remote.address is None:
        raise SystemExit(f"{node} has no neighbour to route a peer's traffic through")
    return str(nb[0].remote.address.ip)


def start_peer(lab: runner.Lab, name: str, node: str) -> peers.RunningPeer:
    _, _, address = flows.client_link(lab.topology, node)
    workers = [(e["host"], int(e["port"])) for e in engines(lab)]
    return peers.start_in_lab(
        lab,
        peers.PEERS[name],
        node,
        address,
        gateway(lab, node),
        workers,
        port=PEER_PORT,
        metrics_port=PEER_PORT + 1,
    )


LOGS: dict[str, Path] = {}  # --peer-logs: where each peer's log is kept


def stop_peer(lab: runner.Lab, running: peers.RunningPeer) -> None:
    """End the peer (`peers.stop_in_lab`), keeping its log first if `--peer-logs` asks."""
    if "dir" in LOGS:
        n = len(list(LOGS["dir"].glob(f"{running.peer.name}-*.log")))
        dest = LOGS["dir"] / f"{running.peer.name}-{n + 1}-{running.node}.log"
        dest.write_bytes(Path(running.proc.log).read_bytes())
    peers.stop_in_lab(lab, running)


def cross_site_routes(lab: runner.Lab, action: str) -> None:
    """Routes between the second site's client subnet and the first ingress's (neither
    ingress has a default route): the global deployment's site-4 clients reach e1."""
    first, second = flows.ingress_node(lab.topology), SECOND_INGRESS[0]
    for here, there in ((first, second), (second, first)):
        _, _, src = flows.client_link(lab.topology, here)
        host, _, _ = flows.client_link(lab.topology, there)
        subnet = next(
            str(end.address.network)
            for link in lab.topology.links
            for end in (link.a, link.b)
            if end.node == host and end.address is not None
        )
        lab.handle.run(
            here,
            [
                "ip",
                "route",
                action,
                subnet,
                "via",
                gateway(lab, here),
                "src",
                src,
                "metric",
                "1000",
            ],
        )


# ---- the sweep --------------------------------------------------------------------------


def best(runs: dict[str, dict[str, Any]], names: list[str], value: Any, low: bool) -> Any:
    """(name, figure) of the best unloaded run among `names` by `value(run)`."""
    scored = [
        (value(runs[n]), n)
        for n in names
        if n in runs and not runs[n]["loaded"] and value(runs[n]) is not None
    ]
    if not scored:
        return None
    figure, name = min(scored) if low else max(scored)
    return name, figure


def ratios(runs: dict[str, dict[str, Any]], peer_names: list[str]) -> dict[str, Any]:
    """catsproto / the best unloaded peer, per figure; none when catsproto's run was loaded."""
    ours = runs.get(HEADLINE)
    if ours is None or ours["loaded"]:
        return {}
    out: dict[str, Any] = {}
    figures = {
        "ttft_mean": (lambda r: r["ttft_ms"]["mean"], True),
        "ttft_p50": (lambda r: r["ttft_ms"]["p50"], True),
        "cached_fraction": (lambda r: r["engine_cached_fraction"], False),
    }
    for key, (value, low) in figures.items():
        top = best(runs, peer_names, value, low)
        if top is not None and value(ours) is not None and top[1]:
            out[key] = {"best_peer": top[0], "ratio": round(value(ours) / top[1], 3)}
    for other in ("nearest", "compute-aware"):
        if other in runs and not runs[other]["loaded"]:
            out[f"ttft_mean_vs_{other}"] = round(
                ours["ttft_ms"]["mean"] / runs[other]["ttft_ms"]["mean"], 3
            )
    return out


def split_sites(items: list[dict], how: str) -> tuple[list[dict], list[dict]]:
    """The items arriving at the first and at the second ingress (`--site-split`)."""
    first, second = [], []
    turn: dict[int, int] = {}
    for it in items:
        c = it["conversation"]
        k = turn.get(c, 0)
        turn[c] = k + 1
        at_first = c % 2 == 0 if how == "conversation" else (c + k) % 2 == 0
        (first if at_first else second).append(it)
    return first, second


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="the Mooncake conversation trace (default: looked for)")
    p.add_argument("--conversations", type=int, default=100, help="multi-turn conversations")
    p.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[1.0, 2.0, 3.0],
        help="requests per second: one single-site run of every policy and peer at each",
    )
    p.add_argument(
        "--multi-site-rates",
        type=float,
        nargs="*",
        default=[2.0],
        help="requests per second (both sites together) of the multi-site runs; none: skip",
    )
    p.add_argument(
        "--multi-site-peers",
        nargs="*",
        choices=list(peers.PEERS),
        help="peers of the multi-site runs (default: those of --peers)",
    )
    p.add_argument("--site-split", choices=["conversation", "turn"], default="conversation")
    p.add_argument(
        "--tokens-per-block", type=int, default=64, help="tokens per 512-token trace block"
    )
    p.add_argument("--max-prompt", type=int, default=3500, help="tokens per prompt at most")
    p.add_argument(
        "--engine-blocks",
        type=int,
        default=2048,
        help="each engine's KV blocks (default 2,048 = 65,536 tokens, about a quarter of "
        "the default workload's distinct prompt tokens)",
    )
    p.add_argument(
        "--policies",
        nargs="*",
        default=list(OUR_POLICIES),
        choices=list(OUR_POLICIES),
        help="our policies to run at each rate, in this order",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=list(peers.PEERS),
        choices=list(peers.PEERS),
        help="peer routers to run at each rate (cache_aware), after our policies",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="before each run wait up to this many seconds for the 1-minute load to fall "
        "to the core count",
    )
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    p.add_argument("--results", help="write every request's result here (JSON)")
    p.add_argument("--peer-logs", help="keep every peer run's log in this folder")
    p.add_argument("--render", metavar="JSON", help="print the docs' tables of a result file")
    args = p.parse_args()
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        runs = [r for s in doc.get("sweep", []) for r in s.get("runs", {}).values()]
        if "multi_site" not in doc or any("loaded" not in r for r in runs):
            raise SystemExit(
                f"{args.render}: not a result of this benchmark with peers (no multi_site, "
                "or runs without their load flag): an older run's file cannot be rendered"
            )
        print(render(doc))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("engine_e2e needs root (the namespaced lab)")
    SETTLE["s"] = args.settle
    if args.peer_logs:
        LOGS["dir"] = Path(args.peer_logs)
        LOGS["dir"].mkdir(parents=True, exist_ok=True)
    from catsproto.adapters.trace_download import find_or_download_trace

    trace = Path(args.trace) if args.trace else find_or_download_trace()
    base = text_workload.workload(
        trace, args.conversations, 1.0, args.tokens_per_block, args.max_prompt
    )
    tokens_checked = text_workload.check_exact(base)
    print(
        f"workload: {len(base)} requests, {tokens_checked} tokens re-tokenize exactly",
        file=sys.stderr,
        flush=True,
    )
    wanted = dict.fromkeys([*args.peers, *(args.multi_site_peers or [])])
    venvs = {name: peers.peer_venv(peers.PEERS[name]) for name in wanted}  # before the lab
    run_dir = Path(tempfile.mkdtemp(prefix="catsproto-e2e-"))
    import yaml

    doc = flows.with_second_ingress(yaml.safe_load(CATS4.read_text()), *SECOND_INGRESS)
    topology = run_dir / "cats4-two-ingress.clab.yml"
    topology.write_text(yaml.safe_dump(doc))
    print("lab: coming up (about a minute)", file=sys.stderr, flush=True)
    lab = runner.up(
        topology,
        run_dir,
        tag=f"x{os.getpid()}",
        feed=True,
        engine="vllm",
        feed_interval=1.0,
        engine_blocks=args.engine_blocks,
    )
    first = flows.ingress_node(lab.topology)
    try:
        tokenizer_check = check_engine_tokenizer(lab, base)
        tokenizer_check["tokens"] = tokens_checked
        client1, _, _ = flows.client_link(lab.topology, first)
        ours1 = Target(
            client1, flows.ingress_url(lab, first), flows.ingress_token_file(lab, first), None
        )
        replay(lab, [(ours1, base[:4])])  # warm the engines' code paths (caches reset below)
        probes = [it["ids"] for it in base[:20]]
        every: dict[str, list[dict]] = {}
        sweep: list[dict[str, Any]] = []
        for rate in args.rates:
            items = [{**it, "t_s": it["t_s"] / rate} for it in base]
            runs: dict[str, Any] = {}
            for policy in args.policies:
                target = Target(
                    client1,
                    flows.ingress_url(lab, first),
                    flows.ingress_token_file(lab, first),
                    None if policy == HEADLINE else policy,
                )
                runs[policy] = run_once(
                    lab,
                    f"rate {rate:g}/s {policy}",
                    [(target, items)],
                    [first],
                    [first],
                    probes,
                    every,
                )
            for name in args.peers:
                running = start_peer(lab, name, first)
                try:
                    target = Target(client1, running.url, None, None)
                    runs[name] = run_once(
                        lab,
                        f"rate {rate:g}/s {name}",
                        [(target, items)],
                        [first],
                        [],
                        probes,
                        every,
                    )
                    runs[name]["peer"] = running.to_json()
                finally:
                    stop_peer(lab, running)
            sweep.append({"rate_per_s": rate, "runs": runs, "ratios": ratios(runs, args.peers)})
        multi: list[dict[str, Any]] = []
        if args.multi_site_rates:
            multi = multi_site(lab, base, args, probes, every)
        if args.results:
            Path(args.results).write_text(json.dumps(every))
        out = {
            "benchmark": "engine_e2e",
            "trace": trace.name,
            "conversations": args.conversations,
            "requests": len(base),
            "prompt_tokens_mean": round(statistics.fmean(len(i["ids"]) for i in base), 1),
            "reuse_ceiling": round(text_workload.reuse_ceiling(base), 4),
            "prompts": {
                "form": "text of single-token words (catsproto.lab.text_workload)",
                "words": len(text_workload.single_token_words()),
                "retokenized_exactly": tokenizer_check,
            },
            "engines": [f"{e['host']} ({e['instance']})" for e in engines(lab)],
            "engine_kv_blocks": [e["num_gpu_blocks"] for e in engines(lab)],
            "model": _model_shape(),
            "cores": os.cpu_count(),
            "peers": {
                n: {
                    "package": peers.PEERS[n].requirement,
                    "policy": peers.PEERS[n].policy,
                    "venv": _home(venvs[n]),
                    "installed": peers.installed_version(venvs[n], peers.PEERS[n].package),
                    "note": peers.PEERS[n].note,
                }
                for n in wanted
            },
            "sweep": sweep,
            "multi_site": multi,
            "advertisement_bytes": advert_bytes(lab, first),
        }
        text = json.dumps(out, indent=1)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
    finally:
        lab.down()
        shutil.rmtree(run_dir, ignore_errors=True)  # the lab's logs (--peer-logs keeps the peers')
    return 0


def multi_site(
    lab: runner.Lab,
    base: list[dict],
    args: argparse.Namespace,
    probes: list[list[int]],
    every: dict[str, list[dict]],
) -> list[dict[str, Any]]:
    """The runs with requests arriving at both ingresses (see the module's docstring)."""
    first, second = flows.ingress_node(lab.topology), SECOND_INGRESS[0]
    client1, _, _ = flows.client_link(lab.topology, first)
    client2, _, _ = flows.client_link(lab.topology, second)
    print(f"multi-site: starting the ingress at {second}", file=sys.stderr, flush=True)
    ingress2 = flows.start_ingress(lab, node=second)
    cross_site_routes(lab, "replace")
    out: list[dict[str, Any]] = []
    try:
        for rate in args.multi_site_rates:
            items = [{**it, "t_s": it["t_s"] / rate} for it in base]
            at1, at2 = split_sites(items, args.site_split)
            runs: dict[str, Any] = {}
            if HEADLINE in args.policies:
                parts = [
                    (
                        Target(
                            client1,
                            flows.ingress_url(lab, first),
                            flows.ingress_token_file(lab, first),
                            None,
                        ),
                        at1,
                    ),
                    (
                        Target(
                            client2,
                            flows.ingress_url(lab, second),
                            flows.ingress_token_file(lab, second),
                            None,
                        ),
                        at2,
                    ),
                ]
                runs[HEADLINE] = run_once(
                    lab,
                    f"multi-site {rate:g}/s catsproto",
                    parts,
                    [first, second],
                    [first, second],
                    probes,
                    every,
                )
                runs[HEADLINE]["deployment"] = (
                    "per-site: a path selector at each ingress, fed by BGP"
                )
            chosen = args.peers if args.multi_site_peers is None else args.multi_site_peers
            for name in chosen:
                a = start_peer(lab, name, first)
                b = None
                try:
                    b = start_peer(lab, name, second)
                    parts = [
                        (Target(client1, a.url, None, None), at1),
                        (Target(client2, b.url, None, None), at2),
                    ]
                    key = f"{name} per-site"
                    runs[key] = run_once(
                        lab,
                        f"multi-site {rate:g}/s {key}",
                        parts,
                        [first, second],
                        [],
                        probes,
                        every,
                    )
                    runs[key]["deployment"] = "per-site: one router at each ingress"
                    runs[key]["peer"] = [a.to_json(), b.to_json()]
                    stop_peer(lab, b)
                    b = None
                    stop_peer(lab, a)
                    a = start_peer(lab, name, first)
                    parts = [
                        (Target(client1, a.url, None, None), at1),
                        (Target(client2, a.url, None, None), at2),
                    ]
                    key = f"{name} global"
                    runs[key] = run_once(
                        lab,
                        f"multi-site {rate:g}/s {key}",
                        parts,
                        [first, second],
                        [],
                        probes,
                        every,
                    )
                    runs[key]["deployment"] = (
                        f"global: one router at {first}; {second}'s clients cross the network to it"
                    )
                    runs[key]["peer"] = [a.to_json()]
                finally:
                    for r in (a, b):
                        if r is not None and r.routes:
                            stop_peer(lab, r)
            peer_keys = [k for k in runs if k != HEADLINE]
            out.append(
                {
                    "rate_per_s": rate,
                    "site_split": args.site_split,
                    "requests_per_site": {first: len(at1), second: len(at2)},
                    "runs": runs,
                    "ratios": ratios(runs, peer_keys),
                }
            )
    finally:
        cross_site_routes(lab, "del")
        lab.handle.stop(ingress2)
    return out


def _home(path: Path) -> str:
    """`path` with the user's home folder written ~ (the JSON is published)."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _model_shape() -> dict[str, int]:
    """The engines' model, as its config says (random weights: its size sets the prefill cost)."""
    from catsproto.lab.engine import MODEL_DIR

    config = json.loads((MODEL_DIR / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    return {k: int(config[k]) for k in keys}


def advert_bytes(lab: runner.Lab, node: str) -> dict[str, int]:
    """Bytes of the engines' signed advertisements `node` accepted (cs 200), per origin."""
    out: dict[str, int] = {}
    for line in (lab.rib_file(node).parent / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        entry = ev.get("entry") or {}
        if ev.get("kind") == "accept" and entry.get("cs_id") == 200:
            out[entry["origin"]] = out.get(entry["origin"], 0) + int(entry.get("bytes", 0))
    return out


# ---- the docs' tables -------------------------------------------------------------------


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    return f"{x:,.{digits}f}"


def _row(rate: Any, name: str, run: dict[str, Any]) -> str:
    t = run["ttft_ms"]
    where = " / ".join(str(e.get("requests", 0)) for _, e in sorted(run["engines"].items()))
    gt = (run.get("ground_truth") or {}).get("agreement")
    load = run["load_1min"]
    cached = run["engine_cached_fraction"]
    return (
        f"| {rate:g} | {name} | {_fmt(t['mean'])} | {_fmt(t['p50'])} | {_fmt(t['p99'])} | "
        f"{_fmt(100 * cached if cached is not None else None)} % | {where} | "
        f"{_fmt(100 * gt, 2) + ' %' if gt is not None else '–'} | "
        f"{_fmt(100 * run['cached_report_agreement'], 2)} % | "
        f"{load['start']:.1f}–{load['end']:.1f}{' **loaded**' if run['loaded'] else ''} |"
    )


HEAD = (
    "| rate /s | router | TTFT mean ms | p50 | p99 | vLLM cached | requests per engine "
    "({engines}) | selector agreement | cached report | load |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def render(doc: dict[str, Any]) -> str:
    """The results tables of docs/engine.md from a result file of this benchmark."""
    names = sorted(
        {
            e
            for s in doc["sweep"] + doc["multi_site"]
            for r in s["runs"].values()
            for e in r["engines"]
        }
    )
    head = HEAD.format(engines=" / ".join(names))
    lines = [
        f"{doc['requests']} requests of {doc['conversations']} conversations, prompts of "
        f"{doc['prompt_tokens_mean']:,.0f} tokens on average, ceiling "
        f"{100 * doc['reuse_ceiling']:.1f} % from cache; {doc['cores']} cores.",
        "",
        head,
    ]
    ratio_lines = []
    for part, title in ((doc["sweep"], "single site"), (doc["multi_site"], "multi-site")):
        if not part:
            continue
        if title == "multi-site":
            lines += ["", f"Multi-site ({part[0]['site_split']} split):", "", head]
        for s in part:
            for name, run in s["runs"].items():
                lines.append(_row(s["rate_per_s"], name, run))
            r = s.get("ratios") or {}
            bits = [
                f"{k.replace('_', ' ')} {v['ratio']:.3f}× {v['best_peer']}"
                for k, v in r.items()
                if isinstance(v, dict)
            ]
            if bits:
                ratio_lines.append(
                    f"- {title}, {s['rate_per_s']:g}/s: catsproto / best peer: " + "; ".join(bits)
                )
            elif s["runs"]:
                ratio_lines.append(
                    f"- {title}, {s['rate_per_s']:g}/s: no ratio (a run was loaded, or no peer ran)"
                )
    return "\n".join([*lines, "", *ratio_lines])


if __name__ == "__main__":
    sys.exit(main())

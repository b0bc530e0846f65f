"""Stale hits in the 4-site lab under the Mooncake trace's churn, per update interval.

For each update interval (in trace seconds; default 0.5, 1 and 5) the script brings up
`lab/cats4.clab.yml` with real daemons (ExaBGP -> FRR/BIRD -> ExaBGP, signed and verified)
and real modelled instances, then replays the start of the Mooncake conversation trace
through the steering API at the ingress (proxy mode: decide, install, forward), from the
client host's namespace, on a compressed clock: trace time runs `--compression` times
faster than the wall clock, the instances' clocks run as fast (``--time-scale``), and the
instances advertise at most once per ``interval / compression`` wall seconds, on any
change (``--change-threshold 0``). Every request carries what the selector claimed
(the cached prefix at the chosen instance, or at the KV source of a
"compute here, pull from there" decision); the instance answers whether it found it.
A *stale hit* is a claim the instance could not honour; the instance says why: the first
missing block was evicted after its latest advertisement (``evicted``: nobody could know
yet), evicted before it (``evicted-advertised``: the news was still on its way through
BGP, or a false positive on a block once held), never held there (``not-held``: a
summary's false positive), or the holder of a pull no longer had it (``holder``; the
holders count which of evicted / never held, ``holders_stopped_at``).

Caches are sized so that they turn over about as fast as the trace comes back to a
prefix (default 32 HBM + 736 DRAM blocks per instance: eight instances hold 6,144
blocks, the trace brings about 60 new blocks per trace second, so a block lives about
100 trace seconds, and half of the trace's reuses come within 96 s). The lab's BGP
pipeline has a capacity of its own (every accepted update rewrites the receiver's
rib.json): each row reports how late
advertisements reached the ingress (`advert_delay_wall_ms_p50_p90_p99`), and
`pipeline_kept_up` says whether the 90th percentile stayed within one second plus two
update intervals; a row where it did not measures that queue, not the interval. Needs
root. Prints one JSON object per interval, then a summary line; ``--keep`` keeps every
request's record.

    sudo .venv/bin/python benchmarks/stale_hits.py [--intervals 0.5,1,5] [--seconds 90]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from catsproto.adapters.steering import post_json  # noqa: E402
from catsproto.adapters.trace import read_trace  # noqa: E402
from catsproto.adapters.trace_download import find_or_download_trace  # noqa: E402

# every instance's GET /state: argv[1] = the instances' token file, then their URLs
STATE_SCRIPT = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from catsproto.adapters.steering import get_json\n"
    "token = Path(sys.argv[1]).read_text().strip()\n"
    "out = []\n"
    "for url in sys.argv[2:]:\n"
    "    status, body = get_json(url + '/state', 10, token)\n"
    "    assert status == 200, (url, status, body)\n"
    "    out.append(body)\n"
    "print(json.dumps(out))\n"
)


# ---- the client (runs in the client host's namespace) ---------------------------------


def replay(args: argparse.Namespace) -> int:
    horizon_ms = args.seconds * args.compression * 1000
    requests = [r for r in read_trace(args.trace) if r.timestamp_ms < horizon_ms]
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    token = Path(args.api_token_file).read_text().strip() if args.api_token_file else None

    def one(i: int, due: float) -> None:
        req = requests[i]
        body = {"cs_id": 100, "hash_ids": list(req.hash_ids), "input_length": req.input_length}
        sent = time.monotonic()
        rec: dict[str, Any] = {"i": i, "late_ms": round(1000 * (sent - due), 3)}
        try:
            status, answer = post_json(args.api + "/generate", body, timeout=120, token=token)
        except OSError as exc:
            status, answer = 0, f"{type(exc).__name__}: {exc}"
        rec["ms"] = round(1000 * (time.monotonic() - sent), 3)
        rec["status"] = status
        if status == 200:
            steering, reply = answer["steering"], answer["reply"]
            transfer = reply.get("transfer")
            rec.update(
                instance=steering["instance"],
                site=steering["site"],
                kv_source=steering["kv_source"],
                expected=reply.get("expected_blocks", 0),
                blocks=reply["blocks"],
                cached=reply["cached_blocks"],
                stale=reply.get("stale", False),
                cause=reply.get("stale_cause"),
                evicted_ms_ago=reply.get("evicted_ms_ago"),
                pulled=transfer["blocks"] if transfer else None,
                pull_ok=transfer["ok"] if transfer else None,
            )
        else:
            rec["error"] = str(answer)[:300]
        with lock:
            records.append(rec)

    start = time.monotonic() + 0.5
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        for i, req in enumerate(requests):
            due = start + req.timestamp_ms / 1000 / args.compression
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, due)
    records.sort(key=lambda r: r["i"])
    Path(args.out).write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return 0


# ---- the lab side ---------------------------------------------------------------------


def summarise(records: list[dict[str, Any]], first: int = 0) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200 and r["i"] >= first]
    claims = [r for r in ok if r["expected"] > 0]
    stale = [r for r in ok if r["stale"]]
    causes: dict[str, int] = {}
    for r in stale:
        causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    ages = [r["evicted_ms_ago"] for r in stale if str(r["cause"]).startswith("evicted")]
    pulls = [r for r in ok if r["kv_source"]]
    long_claims = [r for r in ok if r["expected"] > 2]  # past the prefix every prompt shares
    return {
        "decisions": len(ok),
        "claimed_a_hit": len(claims),
        "stale_hits": len(stale),
        "stale_per_decision": round(len(stale) / len(ok), 5) if ok else None,
        "stale_per_claimed_hit": round(len(stale) / len(claims), 5) if claims else None,
        "by_cause": dict(sorted(causes.items())),
        "evicted_stale_per_decision": (
            round(causes.get("evicted", 0) / len(ok), 5) if ok else None
        ),
        "claims_over_2_blocks": len(long_claims),
        "stale_among_them": sum(1 for r in long_claims if r["stale"]),
        "claimed_blocks": sum(r["expected"] for r in ok),
        "stale_blocks": sum(r["expected"] - min(r["expected"], r["cached"]) for r in ok),
        "block_hit_ratio": (
            round(sum(r["cached"] for r in ok) / max(1, sum(r["blocks"] for r in ok)), 4)
        ),
        "evicted_wall_ms_before_use_median": round(statistics.median(ages), 1) if ages else None,
        "pulls": len(pulls),
        "pulls_ok": sum(1 for r in pulls if r["pull_ok"]),
        "pulled_blocks": sum(r["pulled"] or 0 for r in pulls),
    }


def lab_run(interval: float, args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    from catsproto.lab import flows, runner

    wall_interval = interval / args.compression
    lab = runner.up(
        ROOT / "lab" / "cats4.clab.yml",
        Path(tempfile.mkdtemp(prefix="stale-")),
        tag=f"h{os.getpid() % 10000}{int(interval * 10)}",
        feed=True,
        feed_interval=wall_interval,
        instance_args=(
            "--time-scale",
            str(args.compression),
            "--background-blocks",
            "0",
            "--no-warm",
            "--tiers",
            args.tiers,
            "--payload-bytes",
            str(args.payload_bytes),
            "--change-threshold",
            "0",
        ),
    )
    try:
        lab.wait_for(
            lambda: len({r["origin"] for r in lab.routes("e1") if r.get("verified")}) >= 8,
            60,
            "every instance's routes at e1",
        )
        host, _, _ = flows.client_link(lab.topology, flows.ingress_node(lab.topology))
        out = lab.run_dir / "replay.jsonl"
        started = time.monotonic()
        t0_ms = time.time() * 1000
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                lab.handle.ns(host),
                sys.executable,
                __file__,
                "replay",
                "--api",
                flows.api_url(lab),
                "--api-token-file",
                str(flows.api_token_file(lab)),
                "--trace",
                str(trace),
                "--seconds",
                str(args.seconds),
                "--compression",
                str(args.compression),
                "--workers",
                str(args.workers),
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=args.seconds * 3 + 120,
            check=False,
        )
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"replay failed: {proc.stderr[-2000:]}")
        records = [json.loads(line) for line in out.read_text().splitlines() if line]
        states = []
        for name, node in lab.topology.nodes.items():
            if node.instances:
                urls = [f"http://{s.address}:8100" for s in node.instances]
                token = str(flows.instances_token_file(lab))
                argv = [sys.executable, "-c", STATE_SCRIPT, token, *urls]
                text = lab.handle.run(name, argv, 30)
                states += json.loads(text)
        delays = sorted(
            e["time"] * 1000 - e["entry"]["timestamp_ms"]
            for e in lab.events("e1")
            if e.get("kind") == "accept" and "entry" in e and e["time"] * 1000 >= t0_ms
        )
        if args.keep:
            Path(args.keep).with_suffix(f".{interval:g}.jsonl").write_text(out.read_text())
    finally:
        lab.down()
    adverts = sum(s["node"]["builder"]["advertisements"] for s in states)
    late = sorted(r["late_ms"] for r in records)
    return {
        "interval_s": interval,
        "wall_interval_s": round(wall_interval, 4),
        "compression": args.compression,
        "trace_seconds": args.seconds * args.compression,
        "requests": len(records),
        "errors": sum(1 for r in records if r["status"] != 200),
        "replay_wall_s": round(wall, 1),
        "send_late_ms_p50_p99": [late[len(late) // 2], late[int(len(late) * 0.99)]]
        if late
        else None,
        "all": summarise(records),
        "second_half": summarise(records, len(records) // 2),
        "route_updates_per_instance_per_trace_s": round(
            adverts / len(states) / (args.seconds * args.compression), 3
        ),
        "updates_accepted_at_ingress": len(delays),
        "advert_delay_wall_ms_p50_p90_p99": [
            round(delays[int(q * (len(delays) - 1))], 1) for q in (0.5, 0.9, 0.99)
        ]
        if delays
        else None,
        "pipeline_kept_up": bool(delays)
        and delays[int(0.9 * (len(delays) - 1))] <= 1000 + 2000 * wall_interval,
        "load_average_1m": round(os.getloadavg()[0], 1),
        "instances_stale_hits": sum(s["engine"]["stale_hits"]["stale_hits"] for s in states),
        "holders_stopped_at": {
            cause: sum(s["engine"]["served_missing"][cause] for s in states)
            for cause in ("evicted", "not-held")
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals", default="0.5,1,5", help="update intervals, trace seconds")
    p.add_argument("--seconds", type=float, default=90.0, help="wall seconds of replay each")
    p.add_argument("--compression", type=float, default=3.0, help="trace s per wall s")
    p.add_argument("--tiers", default="hbm:32,dram:736", help="cache per instance")
    p.add_argument("--payload-bytes", type=int, default=16 << 10)
    p.add_argument("--workers", type=int, default=256, help="client threads")
    p.add_argument("--keep", help="write every request's record to KEEP.<interval>.jsonl")
    if argv and argv[0] == "replay":
        r = argparse.ArgumentParser(prog="stale_hits.py replay")
        r.add_argument("--api", required=True)
        r.add_argument("--api-token-file", help="the API's bearer token (whole decisions)")
        r.add_argument("--trace", required=True)
        r.add_argument("--seconds", type=float, required=True)
        r.add_argument("--compression", type=float, required=True)
        r.add_argument("--workers", type=int, default=256)
        r.add_argument("--out", required=True)
        return replay(r.parse_args(argv[1:]))
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("stale_hits.py needs root (network namespaces, FRR)", file=sys.stderr)
        return 2
    trace = find_or_download_trace()
    rows = []
    for interval in [float(x) for x in args.intervals.split(",")]:
        row = lab_run(interval, args, trace)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "summary": [
                    {
                        "interval_s": r["interval_s"],
                        "decisions": r["all"]["decisions"],
                        "stale_hits": r["all"]["stale_hits"],
                        "stale_per_decision": r["all"]["stale_per_decision"],
                        "stale_per_claimed_hit": r["all"]["stale_per_claimed_hit"],
                        "by_cause": r["all"]["by_cause"],
                        "pipeline_kept_up": r["pipeline_kept_up"],
                    }
                    for r in rows
                ]
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

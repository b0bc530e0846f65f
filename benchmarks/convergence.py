"""Convergence: from a cache change at an instance to its state in the remote selector's RIB.

Brings up the 4-site lab (network namespaces with FRR and BIRD transit as root; the
loopback mode otherwise), and for each trial, at a random moment inside an update
interval, changes the cache of one instance at each remote site (e2, e3, e4). The
instance publishes on its next update tick (every `--interval` seconds, the configured
update interval); ExaBGP announces it; the transit routers pass it on; the receiver at
e1 accepts it. Measured per site: propagation (publish -> accepted at e1) and the whole
delay (change -> accepted), against the target interval + 100 ms per BGP hop.
Prints one JSON object.

    sudo .venv/bin/python benchmarks/convergence.py [--trials 10] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from catsproto import wire
from catsproto.lab import embedded, runner

LAB = Path(__file__).resolve().parent.parent / "lab"
SITES = ("e2", "e3", "e4")
PER_HOP_MS = 100.0


def advertisement(address: str, site: int, seq: int, now_ms: int) -> bytes:
    return wire.encode(
        wire.Advertisement.build(
            wire.Version(1),
            wire.Origin(100, site, ipaddress.ip_address(address)),
            wire.Sequence(epoch=1, sequence=seq),
            wire.Timestamp(now_ms),
            wire.MetricsL2(seq % 11),
            wire.Capacity(free_blocks=1000 + seq, total_blocks=65536),
        )
    )


def accepted_at(lab: runner.Lab, receiver: str) -> dict[tuple[str, int], float]:
    """(prefix, sequence) -> receive time, for every accepted advertisement."""
    out = {}
    for e in lab.events(receiver):
        if e["kind"] == "accept":
            out[(e["prefix"], e["entry"]["sequence"])] = e["entry"]["received_at"]
    return out


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "p50": round(statistics.median(ms), 1),
        "p95": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1),
        "max": round(ms[-1], 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default=str(LAB / "cats4.clab.yml"))
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.5, help="instance update interval (s)")
    p.add_argument("--embedded", action="store_true", help="loopback mode even as root")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    netns_mode = os.geteuid() == 0 and not args.embedded
    root = Path(tempfile.mkdtemp(prefix="catsproto-conv-"))
    started = time.monotonic()
    lab = runner.up(args.topology, root) if netns_mode else embedded.up(args.topology, root)
    up_s = time.monotonic() - started
    receiver = "e1"
    try:
        instances = {s: lab.topology.nodes[s].instances[0] for s in SITES}
        seq = 1
        for site, spec in instances.items():  # warm up: every route known at e1
            lab.spool(site).publish(
                spec.csci,
                advertisement(str(spec.address), spec.site_id, seq, int(time.time() * 1000)),
            )
        lab.wait_for(lambda: len(lab.routes(receiver)) >= len(SITES), 60, "warm-up routes")
        hops = {
            s: len(
                next(r for r in lab.routes(receiver) if r["prefix"] == str(spec.csci))["as_path"]
            )
            for s, spec in instances.items()
        }
        propagation: dict[str, list[float]] = {s: [] for s in SITES}
        change_to_use: dict[str, list[float]] = {s: [] for s in SITES}
        tick = time.time() + args.interval
        for _ in range(args.trials):
            seq += 1
            changed_at = tick - rng.uniform(0, args.interval)  # the cache changes ...
            time.sleep(max(0.0, changed_at - time.time()))
            changed_at = time.time()
            time.sleep(max(0.0, tick - time.time()))  # ... and is published on the next tick
            published = {}
            for site, spec in instances.items():
                published[site] = time.time()
                lab.spool(site).publish(
                    spec.csci,
                    advertisement(str(spec.address), spec.site_id, seq, int(time.time() * 1000)),
                )
            want = {(str(spec.csci), seq): site for site, spec in instances.items()}
            got = lab.wait_for(
                lambda want=want: (
                    (a := accepted_at(lab, receiver)) and all(k in a for k in want) and a
                ),
                10,
                f"sequence {seq} at {receiver}",
            )
            for key, site in want.items():
                propagation[site].append(got[key] - published[site])
                change_to_use[site].append(got[key] - changed_at)
            tick += args.interval
            while tick < time.time():
                tick += args.interval
    finally:
        t = time.monotonic()
        lab.down()
        down_s = time.monotonic() - t
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "convergence",
        "topology": lab.topology.name,
        "mode": "netns (FRR, BIRD transit)" if netns_mode else "embedded (loopback, 1 hop)",
        "link_shaping": sorted(set(lab.handle.state.info.get("shaping", {}).values())),
        "interval_s": args.interval,
        "trials": args.trials,
        "lab_up_s": round(up_s, 2),
        "lab_down_s": round(down_s, 2),
        "sites": {},
    }
    ok = True
    for site in SITES:
        target = args.interval * 1000 + PER_HOP_MS * hops[site]
        worst = max(change_to_use[site]) * 1000
        ok &= worst <= target
        result["sites"][site] = {
            "bgp_hops": hops[site],
            "propagation_ms": summary_ms(propagation[site]),
            "change_to_rib_ms": summary_ms(change_to_use[site]),
            "target_ms": target,
            "within_target": worst <= target,
        }
    result["within_target"] = ok
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The largest route-reflector lab these cores run with real daemons.

For each size N (sites), writes a topology with `catsproto.lab.reflectors` — N site
egresses, each one ExaBGP process speaking for `--instances` modelled instances (a
CSCI-ID route and one summary shard route each), all iBGP clients of rr1 (FRR) and rr2
(BIRD); only site s1 receives (its selector's RIB, verifying every signature) — brings
it up in network namespaces, and measures:

* setup: `runner.up` (namespaces, links, daemons started), then until every session is
  Established at both reflectors and up at the receiver;
* convergence: all sites publish their signed routes at once; time until the FRR and the
  BIRD reflector hold every route, until the receiving ExaBGP has decoded the last one
  (its JSON `time`), and until the receiver's RIB holds every other site's route from
  both reflectors, verified;
* a second round (`--rounds 2`): every instance re-announces a new sequence (churn);
* CPU seconds used during convergence and idle CPU (cores) afterwards, and RSS, of the
  site ExaBGPs (with their announce processes), the receiver, FRR and BIRD;
* healthy: converged before `--timeout`, every session still up at the end, no session
  went down at the receiver, and the idle lab uses less than `--idle-cores-max`.

Sizes grow until one is unhealthy (or `--keep-going`). Needs root. Prints one JSON object.

    sudo .venv/bin/python benchmarks/lab_scale.py --sites 4 16 64 --instances 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from catsproto.lab import reflectors, runner
from catsproto.lab.instances import instance_routes, lab_key, write_lab_trust

RECEIVER = "s1"
TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def process_table() -> dict[int, tuple[int, int, int]]:
    """{pid: (parent pid, cpu ticks incl. reaped children, rss KiB)} of every process."""
    out: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        out[int(entry)] = (int(fields[1]), ticks, int(fields[21]) * PAGE_KB)
    return out


def descendants(table: dict[int, tuple[int, int, int]], pid: int) -> list[int]:
    """`pid` and every process below it (ExaBGP starts its API processes in sessions
    of their own, so process groups would miss them)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in table:
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def group_of(lab: runner.Lab, node: str) -> str:
    role = lab.topology.nodes[node].role
    if role == "exabgp":
        return "receiver" if node == RECEIVER else "sites"
    return role


def usage(lab: runner.Lab) -> dict[str, dict[str, float]]:
    """CPU seconds, RSS (MiB: total and largest process) and process count per group."""
    table = process_table()
    out: dict[str, dict[str, float]] = {}
    for proc in lab.handle.state.processes:
        g = out.setdefault(
            group_of(lab, proc.node), {"cpu_s": 0.0, "rss_mib": 0.0, "max_rss_mib": 0.0, "n": 0}
        )
        for pid in descendants(table, proc.pid):
            _, ticks, rss = table[pid]
            g["cpu_s"] += ticks / TICKS
            g["rss_mib"] += rss / 1024
            g["max_rss_mib"] = max(g["max_rss_mib"], rss / 1024)
            g["n"] += 1
    return out


def cpu_delta(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, float]:
    return {k: round(b[k]["cpu_s"] - a.get(k, {}).get("cpu_s", 0.0), 2) for k in b}


def frr_state(lab: runner.Lab) -> tuple[int, int]:
    """(Established peers, prefixes received) at rr1."""
    try:
        peers = json.loads(lab.vtysh("rr1", "show bgp ipv4 unicast summary json")).get("peers", {})
    except (ValueError, subprocess.TimeoutExpired):
        return 0, 0
    up = [p for p in peers.values() if p.get("state") == "Established"]
    return len(up), sum(int(p.get("pfxRcd", 0)) for p in up)


def bird_state(lab: runner.Lab) -> tuple[int, int]:
    """(Established peers, routes imported) at rr2."""
    try:
        text = lab.birdc("rr2", "show protocols all")
    except subprocess.TimeoutExpired:
        return 0, 0
    up = routes = 0
    for block in text.split("\n\n"):
        if "BGP state:" in block and "Established" in block.split("BGP state:", 1)[1][:40]:
            up += 1
        for line in block.splitlines():
            parts = line.split()
            if line.strip().startswith("Routes:") and len(parts) > 1 and parts[1].isdigit():
                routes += int(parts[1])
    return up, routes


def receiver_count(lab: runner.Lab, want: dict[tuple[str, str], str]) -> int:
    """How many of the wanted (peer, prefix) carry the wanted value, verified."""
    n = 0
    for r in lab.routes(RECEIVER):
        if want.get((r["peer"], r["prefix"])) == r["value"] and r["verified"]:
            n += 1
    return n


def exabgp_last_time(lab: runner.Lab, want: dict[tuple[str, str], str], since: float) -> float:
    """ExaBGP's own `time` of the last wanted route it decoded at the receiver."""
    path = lab.node_dir(RECEIVER) / "rib" / "raw.jsonl"
    got: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("type") != "update" or float(obj.get("time", 0)) < since:
            continue
        peer = obj["neighbor"]["address"]["peer"]
        for by_nh in (obj["neighbor"]["message"].get("update", {}).get("announce") or {}).values():
            for routes in by_nh.values():
                for r in routes:
                    if (peer, r["nlri"]) in want:
                        got[(peer, r["nlri"])] = float(obj["time"])
    return max(got.values()) if len(got) == len(want) else float("nan")


def prepare(lab: runner.Lab, sequence: int, keys: int) -> dict[str, dict[str, bytes]]:
    """Every instance's signed routes: {node: {prefix: value}}."""
    now = int(time.time() * 1000)
    out: dict[str, dict[str, bytes]] = {}
    for name, node in lab.topology.nodes.items():
        for spec in node.instances:
            rng = np.random.default_rng(spec.site_id * 100_003 + sequence)
            routes = instance_routes(
                spec,
                rng.integers(0, 2**63, keys, dtype=np.uint64),
                sequence=sequence,
                now_ms=now,
                max_message=65535,
                signer=lab_key(lab.topology, spec.name),
            )
            out.setdefault(name, {}).update({str(p): v for p, v in routes.items()})
    return out


def wanted(lab: runner.Lab, routes: dict[str, dict[str, bytes]]) -> dict[tuple[str, str], str]:
    peers = [str(nb.remote.address.ip) for nb in lab.topology.neighbors(RECEIVER)]  # type: ignore[union-attr]
    return {
        (peer, prefix): value.hex()
        for node, by_prefix in routes.items()
        if node != RECEIVER
        for prefix, value in by_prefix.items()
        for peer in peers
    }


def converge(
    lab: runner.Lab,
    routes: dict[str, dict[str, bytes]],
    total: int,
    timeout: float,
    at_reflectors: bool = True,
) -> dict[str, Any]:
    """Publish every route; time until each reflector (new routes only: their counts do
    not move on a re-announcement) and the receiver have all of them."""
    want = wanted(lab, routes)
    wall0, t0 = time.time(), time.monotonic()
    for node, by_prefix in routes.items():
        spool = lab.spool(node)
        for prefix, value in by_prefix.items():
            spool.publish(prefix, value)
    publish_s = time.monotonic() - t0
    done: dict[str, float] = {} if at_reflectors else {"frr": float("nan"), "bird": float("nan")}
    last: dict[str, int] = {}
    while time.monotonic() - t0 < timeout and len(done) < 3:
        if "frr" not in done:
            last["frr"] = frr_state(lab)[1]
            if last["frr"] >= total:
                done["frr"] = time.monotonic() - t0
        if "bird" not in done:
            last["bird"] = bird_state(lab)[1]
            if last["bird"] >= total:
                done["bird"] = time.monotonic() - t0
        if "receiver_rib" not in done:
            last["receiver_rib"] = receiver_count(lab, want)
            if last["receiver_rib"] >= len(want):
                done["receiver_rib"] = time.monotonic() - t0
        time.sleep(0.25)
    exa = exabgp_last_time(lab, want, wall0) if "receiver_rib" in done else float("nan")
    return {
        "routes_published": sum(len(v) for v in routes.values()),
        "publish_s": round(publish_s, 3),
        "rr_frr_s": round(done["frr"], 2) if done.get("frr", 0) == done.get("frr") else None,
        "rr_bird_s": round(done["bird"], 2) if done.get("bird", 0) == done.get("bird") else None,
        "receiver_exabgp_s": None if exa != exa else round(exa - wall0, 2),
        "receiver_rib_s": round(done["receiver_rib"], 2) if "receiver_rib" in done else None,
        "receiver_routes_wanted": len(want),
        "reached": last,
        "converged": len(done) == 3,
    }


def receiver_profile(sites: list[int], instances: int, keys: int) -> list[dict[str, Any]]:
    """The receive process alone, fed offline what s1 hears at each size (every other
    site's routes from two reflectors, as ExaBGP's JSON): CPU ms a route to decode and
    verify, then with `rib.json` rewritten after every change, then coalesced."""
    from catsproto.adapters import exabgp_receive as rx
    from catsproto.lab import topology

    out = []
    for n in sites:
        t = topology.from_dict(reflectors.reflector_topology(n, instances, receivers=1))
        now = int(time.time() * 1000)
        lines = []
        for name, node in t.nodes.items():
            for spec in node.instances if name != RECEIVER else ():
                rng = np.random.default_rng(spec.site_id)
                routes = instance_routes(
                    spec,
                    rng.integers(0, 2**63, keys, dtype=np.uint64),
                    sequence=1,
                    now_ms=now,
                    max_message=65535,
                    signer=lab_key(t, spec.name),
                )
                for prefix, value in routes.items():
                    for peer in ("10.1.0.6", "10.2.0.6"):
                        update = {
                            "attribute": {"attribute-0xFF-0xE0": "0x" + value.hex()},
                            "announce": {"ipv4 unicast": {"10.1.0.9": [{"nlri": str(prefix)}]}},
                        }
                        msg = {"address": {"peer": peer}, "message": {"update": update}}
                        lines.append(json.dumps({"type": "update", "neighbor": msg}))
        row: dict[str, Any] = {"sites": n, "routes": len(lines)}
        with tempfile.TemporaryDirectory() as d:
            write_lab_trust(t, f"{d}/trust.json", now)
            for mode in ("verify", "snapshot_every_change", "coalesced"):
                rib = rx.CacheRib(verifier=rx.TrustFileVerifier(f"{d}/trust.json"))
                sink: Any = (
                    (lambda change: None)
                    if mode == "verify"
                    else rx.FileSink(f"{d}/{mode}", rib, coalesce=mode == "coalesced")
                )
                t0 = time.process_time()
                rx.run(lines, rib, sink)
                if mode == "coalesced":
                    sink.flush()
                row[f"{mode}_ms_per_route"] = round(
                    1000 * (time.process_time() - t0) / len(lines), 3
                )
        out.append(row)
    return out


def run_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    doc = reflectors.reflector_topology(
        n,
        args.instances,
        name=f"rrscale{n}",
        receivers=1,
        reflect_to=args.reflect_to,
        spool_poll=args.spool_poll,
    )
    path = root / f"rrscale{n}.clab.yml"
    path.write_text(reflectors.render(doc))
    result: dict[str, Any] = {"sites": n, "instances": n * args.instances}
    result["load_before"] = round(os.getloadavg()[0], 2)  # the 2 cores are shared
    t0 = time.monotonic()
    lab = runner.up(path, root, tag=f"z{n}p{os.getpid() % 100}")
    try:
        result["up_s"] = round(time.monotonic() - t0, 2)
        result["namespaces"] = len(lab.handle.state.namespaces)
        result["processes"] = len(lab.handle.state.processes)
        try:
            lab.wait_for(
                lambda: (
                    frr_state(lab)[0] == n
                    and bird_state(lab)[0] == n
                    and list(lab.rib(RECEIVER)["sessions"].values()) == ["up", "up"]
                ),
                args.timeout,
                f"{n} sessions at each reflector",
            )
            result["setup_s"] = round(time.monotonic() - t0, 2)
        except runner.LabError as exc:
            result.update(setup_s=None, healthy=False, why=str(exc))
            return result
        write_lab_trust(
            lab.topology, str(lab.node_dir(RECEIVER) / "trust.json"), int(time.time() * 1000)
        )
        rounds = []
        for seq in range(1, args.rounds + 1):
            routes = prepare(lab, seq, args.keys)
            total = sum(len(v) for v in routes.values())
            before = usage(lab)
            r = converge(lab, routes, total, args.timeout, at_reflectors=seq == 1)
            r["cpu_s"] = cpu_delta(before, usage(lab))
            rounds.append(r)
            if not r["converged"]:
                break
        result["rounds"] = rounds
        idle0 = usage(lab)
        time.sleep(args.idle)
        idle1 = usage(lab)
        result["idle_cores"] = {
            k: round(v / args.idle, 3) for k, v in cpu_delta(idle0, idle1).items()
        }
        result["idle_cores_total"] = round(sum(result["idle_cores"].values()), 3)
        result["rss_mib"] = {k: round(v["rss_mib"], 1) for k, v in idle1.items()}
        result["max_process_rss_mib"] = {k: round(v["max_rss_mib"], 1) for k, v in idle1.items()}
        result["rss_mib_total"] = round(sum(result["rss_mib"].values()), 1)
        result["daemon_processes"] = {k: int(v["n"]) for k, v in idle1.items()}
        frr_up, _ = frr_state(lab)
        bird_up, _ = bird_state(lab)
        downs = sum(
            e["kind"] == "session" and e.get("reason") == "down" for e in lab.events(RECEIVER)
        )
        result["sessions_up_at_end"] = {"frr": frr_up, "bird": bird_up}
        result["receiver_session_downs"] = downs
        why = []
        if not all(r["converged"] for r in rounds) or len(rounds) < args.rounds:
            why.append(f"did not converge within {args.timeout:g}s")
        if frr_up != n or bird_up != n:
            why.append(f"sessions up at the end: frr {frr_up}/{n}, bird {bird_up}/{n}")
        if downs:
            why.append(f"{downs} session(s) went down at the receiver")
        if result["idle_cores_total"] > args.idle_cores_max:
            why.append(f"idle lab uses {result['idle_cores_total']} cores")
        result["load_after"] = round(os.getloadavg()[0], 2)
        result["healthy"] = not why
        if why:
            result["why"] = "; ".join(why)
    finally:
        t1 = time.monotonic()
        lab.down()
        result["down_s"] = round(time.monotonic() - t1, 2)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--instances", type=int, default=10, help="instances per site (one ExaBGP)")
    p.add_argument("--keys", type=int, default=200, help="cached blocks per instance")
    p.add_argument("--rounds", type=int, default=2, help="1: initial; 2: also one full churn")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured")
    p.add_argument("--idle-cores-max", type=float, default=1.0)
    p.add_argument("--keep-going", action="store_true", help="go on after an unhealthy size")
    p.add_argument(
        "--spool-poll",
        type=float,
        help="seconds between the announce processes' spool scans (default theirs, 0.02)",
    )
    p.add_argument(
        "--reflect-to",
        choices=["all", "receivers"],
        default="all",
        help="all: every site hears every route (as if each had a selector); receivers: "
        "the reflectors send nothing to the sites that only announce",
    )
    p.add_argument(
        "--receiver-profile",
        action="store_true",
        help="only feed the receive process offline at each size (no lab, no root)",
    )
    args = p.parse_args()
    if args.receiver_profile:
        profile = receiver_profile(args.sites, args.instances, args.keys)
        print(json.dumps({"benchmark": "lab_scale receiver", "sizes": profile}, indent=1))
        return 0
    if os.geteuid() != 0:
        print("lab_scale needs root (network namespaces, FRR, BIRD)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="catsproto-lab-scale-"))
    sizes = []
    started = time.monotonic()
    try:
        for n in args.sites:
            r = run_size(n, args, root)
            sizes.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if not r.get("healthy") and not args.keep_going:
                break
    finally:
        shutil.rmtree(root, ignore_errors=True)
    healthy = [r["sites"] for r in sizes if r.get("healthy")]
    unhealthy = [r["sites"] for r in sizes if not r.get("healthy")]
    out = {
        "benchmark": "lab_scale",
        "cores": os.cpu_count(),
        "instances_per_site": args.instances,
        "keys_per_instance": args.keys,
        "rounds": args.rounds,
        "reflect_to": args.reflect_to,
        "spool_poll": args.spool_poll,
        "sizes": sizes,
        "largest_healthy_sites": max(healthy) if healthy else None,
        "first_unhealthy_sites": unhealthy[0] if unhealthy else None,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`catsproto eval`: steering policies on a trace and scenario; table, JSON, plots.

    catsproto eval --trace ../shared/traces/mooncake-conversation.jsonl --scenario s1 \\
        --speedup 1 4 --report docs/eval

prints one row per (policy, speedup): block hit rate, TTFT mean/p50/p99 and the mean
split into round trip / wait / prefill (/ fetch), advertisement bytes per second and
their share of the raw vLLM event stream, stale and false-positive hits. With
`--report DIR` it also writes results.json, summary.md, a TTFT CDF per speedup and the
catsproto sweeps (hit rate and advertisement bytes against update interval and target
FPR, on the first `--sweep-limit` requests). A progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from catsproto.adapters.report import format_table, summary_rows, write_report
from catsproto.adapters.trace import TraceFormatError, find_trace, load_scenario, read_trace
from catsproto.commands import UsageError
from catsproto.keys import BlockKeyer
from catsproto.sim import (
    POLICIES,
    PreparedTrace,
    Scenario,
    ScenarioError,
    apply_overrides,
    run_policy,
)

SWEEP_INTERVALS = (250, 1000, 4000, 16000)
SWEEP_FPRS = (0.001, 0.01, 0.05, 0.2)


class _Bar:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled, self.shown = label, max(1, total), enabled, -1

    def __call__(self, done: int) -> None:
        pct = 100 * done // self.total
        if self.enabled and pct != self.shown:
            self.shown = pct
            bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
            sys.stderr.write(f"\r{self.label:<26} [{bar}] {pct:3d}%")
            if done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate steering policies on a trace")
    p.add_argument(
        "--trace",
        help="JSONL trace (Mooncake fields); default: the shared Mooncake conversation trace",
    )
    p.add_argument("--scenario", default="s1", help="scenario file, or s1 / llama70b")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="POLICY")
    p.add_argument("--speedup", nargs="+", type=float, default=[1.0, 4.0])
    p.add_argument("--report", help="folder for results.json, summary.md and plots")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    p.add_argument("--limit", type=int, help="use only the first N requests")
    p.add_argument("--seed", type=int, default=1, help="seed of the random policy")
    p.add_argument(
        "--sweep-limit", type=int, default=3000, help="requests per sweep run (0: no sweeps)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _scenario(path: str, overrides: list[str], speedup: float | None = None) -> Scenario:
    raw = load_scenario(path)
    extra = [f"speedup={speedup}"] if speedup is not None else []
    return Scenario.from_mapping(apply_overrides(raw, [*overrides, *extra]))


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    if any(s <= 0 for s in args.speedup):
        raise UsageError("--speedup values must be > 0")
    try:
        base = _scenario(args.scenario, args.overrides)
        if args.trace is None:
            args.trace = str(find_trace())
        requests = read_trace(args.trace, args.limit)
    except (ScenarioError, TraceFormatError) as exc:
        raise UsageError(str(exc)) from None
    if not requests:
        raise UsageError(f"trace {args.trace} has no requests")
    keyer = BlockKeyer(base.secret, base.model_id, base.block_tokens)
    memo: dict[int, int] = {}
    results = []
    for speedup in args.speedup:
        sc = _scenario(args.scenario, args.overrides, speedup)
        trace = PreparedTrace.build(
            requests, keyer, len(sc.sites), sc.speedup, sc.ingress_index, memo
        )
        for name in args.policies:
            bar = _Bar(f"{name} x{speedup:g}", len(trace), not args.quiet)
            results.append(run_policy(name, trace, sc, seed=args.seed, progress=bar))
    rows = summary_rows(results, base.block_tokens)
    sweeps: dict[str, list[dict[str, object]]] = {}
    if args.report and args.sweep_limit > 0 and "catsproto" in args.policies:
        sub = requests[: args.sweep_limit]
        for key, values in (("update_interval_ms", SWEEP_INTERVALS), ("target_fpr", SWEEP_FPRS)):
            sweeps[key] = []
            for v in values:
                extra = [f"{key}={v}"]
                if key == "update_interval_ms" and v > base.refresh_interval_ms:
                    extra.append(f"refresh_interval_ms={v}")
                sc = _scenario(args.scenario, [*args.overrides, *extra], 1.0)
                trace = PreparedTrace.build(sub, keyer, len(sc.sites), 1.0, sc.ingress_index, memo)
                bar = _Bar(f"sweep {key}={v}", len(trace), not args.quiet)
                (row,) = summary_rows(
                    [run_policy("catsproto", trace, sc, progress=bar)], base.block_tokens
                )
                sweeps[key].append(
                    {
                        key: v,
                        **{
                            k: row[k]
                            for k in (
                                "hit_rate",
                                "ttft_mean_ms",
                                "adv_bytes_per_s",
                                "adv_share_of_raw",
                            )
                        },
                    }
                )
    if args.json:
        import json

        print(json.dumps(rows, indent=2, default=float))
    else:
        print(format_table(rows))
    wall = time.perf_counter() - started
    if args.report:
        meta = {
            "trace": args.trace,
            "requests": len(requests),
            "command": "catsproto eval " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "wall_s": wall,
            "sweep_requests": min(args.sweep_limit, len(requests)),
        }
        files = write_report(Path(args.report), rows, results, base.to_json(), sweeps, meta)
        print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    print(f"wall time {wall:.1f} s", file=sys.stderr)
    return 0

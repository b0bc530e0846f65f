"""`catsproto eval`: steering policies on a trace and scenario; table, JSON, plots.

Every policy named by --policies replays the trace's requests in the scenario (S1: four
sites of four instances) at each --speedup; catsproto's advertisements are built,
signed, encoded, delayed and verified on the way, as in the lab. It prints one row per
(policy, speedup): block hit rate, TTFT mean/p50/p99 and the mean split into round trip
/ wait / prefill (/ fetch), advertisement bytes per second and their share of the raw
vLLM event stream, stale and false-positive hits. A progress bar goes to stderr. With
--report DIR it also writes results.json, summary.md, a TTFT CDF per speedup
(ttft_cdf_x{speedup}.png) and the catsproto sweeps (hit rate and advertisement bytes
against update interval and target FPR, on the first --sweep-limit requests;
sweep_update_interval_ms.png, sweep_target_fpr.png). Files of those names already in
DIR that this run does not write again (a plot of another speedup, the sweeps of an
earlier run) are removed once the new report is written; nothing else in DIR is
touched. Rates (adv B/s) are over the trace's span after the speedup and read n/a when
that is under 10 s. The runs go to --jobs worker processes (default: one per usable
core; catsproto's long runs first), with the same rows and report as in one process.
The main table of docs/evaluation.md and docs/eval:

    catsproto eval --report docs/eval --sweep-limit 2000

With --seeds it is the seed study instead: every policy at every speedup once per
scenario seed (no sweeps), in --jobs worker processes as well. It prints one row per
(policy, speedup): seeds, the mean of the per-seed mean TTFT with its standard
deviation, min and max, the mean hit rate and (for each other policy, when the oracle
ran) the mean per-seed paired difference to the oracle, its standard error and the
seeds at or below it. With
--report DIR: seeds.json (every per-seed row and the aggregate), seeds.md and a plot
per speedup, seeds_x{speedup}.png (an earlier seed study's files of those names that
are not written again are removed, as above). The twenty-seed study of
docs/evaluation.md:

    catsproto eval --policies catsproto oracle --speedup 1 4 --seeds 1-20 --jobs 2 \\
        --report docs/eval/seeds

Three seeds, not to be confused: --seed seeds the random policy and nothing else;
--set seed=N is the scenario's seed (summary filters, signing keys, the selectors'
tie-breaks) for every run; --seeds repeats the whole comparison once per scenario seed,
each run with its own --set seed=N, and so cannot be combined with it.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from catsproto.adapters.report import (
    discard_report_dirs,
    format_seed_table,
    format_table,
    headline,
    prepare_report_dir,
    seed_aggregate,
    summary_rows,
    write_report,
    write_seed_report,
)
from catsproto.adapters.trace import (
    MOONCAKE,
    SEARCH_ORDER,
    TraceFormatError,
    load_scenario,
    read_trace,
)
from catsproto.adapters.trace_download import MOONCAKE_URL, NO_DOWNLOAD_ENV, find_or_download_trace
from catsproto.commands import UsageError
from catsproto.keys import BlockKeyer
from catsproto.sim import (
    POLICIES,
    PreparedTrace,
    RunResult,
    Scenario,
    ScenarioError,
    TraceRequest,
    apply_overrides,
    run_policy,
)
from catsproto.sim.scenario import SEED_MAX
from catsproto.sim.trace import MAX_ARRIVAL_MS

SWEEP_INTERVALS = (250, 1000, 4000, 16000)
SWEEP_FPRS = (0.001, 0.01, 0.05, 0.2)


class _Bar:
    """A run's progress on stderr: a bar redrawn in place on a terminal; into a file or
    a pipe (a CI log), one line when the run is done instead of a hundred redraws."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled, self.shown = label, max(1, total), enabled, -1
        self.tty = _is_tty()

    def __call__(self, done: int) -> None:
        pct = 100 * done // self.total
        if self.enabled and not self.tty:
            if done >= self.total and self.shown < 100:
                self.shown = 100
                sys.stderr.write(f"{self.label:<26} done\n")
                sys.stderr.flush()
            return
        if self.enabled and pct != self.shown:
            self.shown = pct
            bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
            sys.stderr.write(f"\r{self.label:<26} [{bar}] {pct:3d}%")
            if done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate steering policies on a trace", description=__doc__
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help=f"JSONL trace (Mooncake fields: timestamp, input_length, output_length, hash_ids); "
        f"default: {MOONCAKE} looked for in {SEARCH_ORDER}; when it is in none of them, "
        f"downloaded (sha256-checked) from {MOONCAKE_URL} into the cache folder",
    )
    p.add_argument(
        "--no-download",
        action="store_true",
        help=f"never download the trace; fail if it is not found (also: {NO_DOWNLOAD_ENV}=1)",
    )
    p.add_argument(
        "--scenario",
        default="s1",
        help="scenario file (TOML or JSON), or the name of a shipped one in "
        "catsproto/sim/scenarios: s1, llama70b",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        metavar="POLICY",
        help=f"policies to compare, in this order; choices: {', '.join(POLICIES)}",
    )
    p.add_argument(
        "--speedup",
        nargs="+",
        type=float,
        default=[1.0, 4.0],
        help="trace time divided by each of these (one run per speedup; > 0); it replaces "
        "a scenario file's speedup, and --set speedup=... is refused",
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        help="folder for results.json, summary.md and plots "
        "(with --seeds: seeds.json, seeds.md, seeds_x{speedup}.png)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override one scenario key, repeatable, e.g. --set seed=3 --set "
        "physical_arrival=true (dotted keys reach tables: --set rtt_ms.A-D=30); every key, "
        "its values and its default: docs/scenarios.md; a bad value stops the run naming "
        "the key; seed=N is the scenario's seed (filters, signing keys, selectors), not "
        "--seed",
    )
    p.add_argument("--limit", type=int, metavar="N", help="use only the first N requests (N >= 1)")
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the random policy only; the scenario's seed is --set seed=N, "
        "a study over scenario seeds is --seeds",
    )
    p.add_argument(
        "--sweep-limit",
        type=int,
        default=2000,
        metavar="N",
        help="with --report: requests per catsproto sweep run (0: no sweeps)",
    )
    p.add_argument(
        "--seeds",
        metavar="SPEC",
        help="the seed study: run every policy and speedup once per scenario seed "
        "(each run as with --set seed=N), e.g. 1-20, 1,3,5 or 1-5,9, and print mean, "
        "std, min, max over seeds and the paired difference to the oracle (no sweeps; "
        "not with --set seed=...; --seed still seeds the random policy)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the runs (default: the cores this process may use, "
        f"here {usable_cores()}; 1: every run in this process); the rows and the report "
        "do not depend on it",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_seeds(spec: str) -> list[int]:
    """`1-20`, `1,3,5`, `1-5,9` -> the seeds in the order given; a usage error for
    anything else, and for an empty, reversed or negative range or a repeated seed."""
    seeds: list[int] = []
    for part in spec.split(","):
        item = part.strip()
        lo_text, dash, hi_text = item.partition("-")
        texts = [lo_text.strip(), hi_text.strip()] if dash else [item]
        if not all(t.isascii() and t.isdigit() for t in texts):
            raise UsageError(
                f"--seeds {spec!r}: {item!r} is not a seed or a range of seeds "
                "(non-negative integers, like 1-20, 1,3,5 or 1-5,9)"
            )
        lo, hi = int(texts[0]), int(texts[-1])
        if hi > SEED_MAX:
            raise UsageError(f"--seeds {spec!r}: seed {hi} outside 0..{SEED_MAX}")
        if hi < lo:
            raise UsageError(f"--seeds {spec!r}: the range {item!r} is empty")
        for seed in range(lo, hi + 1):
            if seed in seeds:
                raise UsageError(f"--seeds {spec!r}: seed {seed} is given twice")
            seeds.append(seed)
    return seeds


def _scenario(path: str, overrides: list[str], speedup: float | None = None) -> Scenario:
    raw = load_scenario(path)
    extra = [f"speedup={speedup}"] if speedup is not None else []
    return Scenario.from_mapping(apply_overrides(raw, [*overrides, *extra]))


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    for s in args.speedup:
        if not (math.isfinite(s) and s > 0):
            raise UsageError(f"--speedup {s}: values must be finite and > 0")
    if not 0 <= args.seed <= SEED_MAX:
        raise UsageError(f"--seed {args.seed} outside 0..{SEED_MAX} (it seeds numpy's generator)")
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    if seeds is not None and any(o.partition("=")[0].strip() == "seed" for o in args.overrides):
        raise UsageError("--seeds sets the scenario seed of every run: leave out --set seed=...")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: the number of requests must be at least 1")
    if args.sweep_limit < 0:
        raise UsageError(f"--sweep-limit {args.sweep_limit}: must be >= 0 (0: no sweeps)")
    for item in args.overrides:
        if item.partition("=")[0].strip() == "speedup":
            raise UsageError(
                f"--set {item}: the speedup is set by --speedup (one run per value), not by --set"
            )
    if args.jobs is None:
        args.jobs = usable_cores()
    elif args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: must be at least 1")
    try:
        base = _scenario(args.scenario, args.overrides)
        if args.trace is None:
            quiet = (lambda done, total: None) if args.quiet else None
            download = False if args.no_download else None  # None: as the environment says
            args.trace = str(find_or_download_trace(download=download, progress=quiet))
        requests = read_trace(args.trace, args.limit)
    except (ScenarioError, TraceFormatError) as exc:
        raise UsageError(str(exc)) from None
    if not requests:
        raise UsageError(f"trace {args.trace} has no requests")
    latest = max(r.timestamp_ms for r in requests)
    for s in args.speedup:
        if latest / s > MAX_ARRIVAL_MS:
            raise UsageError(
                f"--speedup {s:g}: the trace's last timestamp {latest:g} ms / {s:g} does not "
                "fit the simulator's clock (int64 ms)"
            )
    made: list[Path] = []
    if args.report:
        try:
            made = prepare_report_dir(Path(args.report))
        except OSError as exc:
            raise UsageError(f"--report {args.report}: {exc.strerror or exc}") from None
    try:
        return _run(args, seeds, requests, base, started)
    except ScenarioError as exc:  # found by a run: an advertisement its messages cannot hold
        discard_report_dirs(made)
        raise UsageError(str(exc)) from None
    except BaseException:  # interrupted or failed: no empty report folder of ours stays
        discard_report_dirs(made)
        raise


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _run(
    args: argparse.Namespace,
    seeds: list[int] | None,
    requests: list[TraceRequest],
    base: Scenario,
    started: float,
) -> int:
    """The runs, the table and the report of `run`, after its checks."""
    if seeds is not None:
        return _run_seeds(args, seeds, requests, base, started)
    jobs = [Run(0, name, speedup, args.seed) for speedup in args.speedup for name in args.policies]
    sweep_jobs: list[tuple[str, object, Run]] = []
    if args.report and args.sweep_limit > 0 and "catsproto" in args.policies:
        for key, values in (("update_interval_ms", SWEEP_INTERVALS), ("target_fpr", SWEEP_FPRS)):
            for v in values:
                extra = [f"{key}={v}"]
                if key == "update_interval_ms" and v > base.refresh_interval_ms:
                    extra.append(f"refresh_interval_ms={v}")
                job = Run(0, "catsproto", 1.0, 0, extra=tuple(extra), limit=args.sweep_limit)
                sweep_jobs.append((key, v, job))
    everything = [*jobs, *(job for _, _, job in sweep_jobs)]
    everything = [replace(job, index=i) for i, job in enumerate(everything)]
    results = _run_jobs(everything, args, requests)
    rows = summary_rows(results[: len(jobs)], base.block_tokens)
    sweeps: dict[str, list[dict[str, object]]] = {}
    for (key, v, _), result in zip(sweep_jobs, results[len(jobs) :], strict=True):
        (row,) = summary_rows([result], base.block_tokens)
        picked = ("hit_rate", "ttft_mean_ms", "adv_bytes_per_s", "adv_share_of_raw")
        sweeps.setdefault(key, []).append({key: v, **{k: row[k] for k in picked}})
    if args.json:
        import json

        print(json.dumps(rows, indent=2, default=float))
    else:
        print(format_table(rows))
        for line in headline(rows):
            print(line)
    wall = time.perf_counter() - started
    if args.report:
        meta = {
            "trace": Path(args.trace).name,  # not the folder: reports are shared
            "requests": len(requests),
            "command": "catsproto eval " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "wall_s": wall,
            "jobs": min(args.jobs, len(everything)),
            "sweep_requests": min(args.sweep_limit, len(requests)),
        }
        try:
            files = write_report(
                Path(args.report), rows, results[: len(jobs)], base.to_json(), sweeps, meta
            )
        except OSError as exc:
            raise UsageError(f"--report {args.report}: {exc.strerror or exc}") from None
        print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    print(f"wall time {wall:.1f} s", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class Run:
    """One run: its place in the output, policy, speedup, the random policy's seed, and
    what it changes of the scenario and trace: a scenario seed (the seed study), extra
    `--set` overrides and a request limit (a sweep point)."""

    index: int
    policy: str
    speedup: float
    random_seed: int
    scenario_seed: int | None = None
    extra: tuple[str, ...] = ()
    limit: int | None = None

    @property
    def label(self) -> str:
        text = f"{self.policy} x{self.speedup:g}"
        if self.scenario_seed is not None:
            text += f" seed {self.scenario_seed}"
        return text + "".join(f" {e}" for e in self.extra)


class Runner:
    """Runs `Run`s exactly as `catsproto eval` with their options would (same scenario,
    keys and prepared trace), in this process or in a worker; keeps the prepared traces
    and block keys it has built for the runs that follow."""

    def __init__(
        self, scenario: str, overrides: Sequence[str], requests: Sequence[TraceRequest]
    ) -> None:
        self.scenario, self.overrides, self.requests = scenario, list(overrides), requests
        self._memos: dict[tuple[bytes, str, int], dict[int, int]] = {}
        self._traces: dict[tuple[object, ...], PreparedTrace] = {}

    def result(self, job: Run, progress: Callable[[int], None] | None = None) -> RunResult:
        overrides = [*self.overrides, *job.extra]
        if job.scenario_seed is not None:
            overrides.append(f"seed={job.scenario_seed}")
        base = _scenario(self.scenario, overrides)
        sc = _scenario(self.scenario, overrides, job.speedup)
        keyed = (base.secret, base.model_id, base.block_tokens)
        memo = self._memos.setdefault(keyed, {})
        requests = self.requests[: job.limit] if job.limit is not None else self.requests
        where = (keyed, len(sc.sites), sc.speedup, sc.ingress_index, sc.arrival_spread, job.limit)
        trace = self._traces.get(where)
        if trace is None:
            keyer = BlockKeyer(base.secret, base.model_id, base.block_tokens)
            trace = self._traces[where] = PreparedTrace.build(
                requests,
                keyer,
                len(sc.sites),
                sc.speedup,
                sc.ingress_index,
                memo,
                sc.arrival_spread,
            )
        return run_policy(job.policy, trace, sc, seed=job.random_seed, progress=progress)

    def row(self, job: Run, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """The `summary_rows` row of one seed-study run, with its `seed` in front."""
        result = self.result(job, progress)
        base = _scenario(self.scenario, [*self.overrides, *job.extra])
        (row,) = summary_rows([result], base.block_tokens)
        return {"seed": job.scenario_seed, **row}


def _run_jobs(
    jobs: Sequence[Run], args: argparse.Namespace, requests: Sequence[TraceRequest]
) -> list[RunResult]:
    """Every run's result in job order: in this process with --jobs 1 (a bar per run),
    else in worker processes (one progress line)."""
    n_workers = min(args.jobs, len(jobs))
    if n_workers > 1:
        return _run_parallel(jobs, n_workers, args, requests, rows=False)
    runner = Runner(args.scenario, args.overrides, requests)
    results = []
    for job in jobs:
        total = len(requests) if job.limit is None else min(job.limit, len(requests))
        bar = _Bar(job.label if not job.extra else f"sweep {job.extra[0]}", total, not args.quiet)
        results.append(runner.result(job, bar))
    return results


class _SeedProgress:
    """One line on stderr: runs done of all, and each current run with its percentage,
    redrawn in place on a terminal; into a file or a pipe, a line per finished run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.current: dict[int, tuple[str, int]] = {}
        self.width = 0
        self.tty = _is_tty()

    def start(self, index: int, label: str) -> None:
        self.current[index] = (label, 0)
        self._show()

    def percent(self, index: int, pct: int) -> None:
        if index in self.current and self.current[index][1] != pct:
            self.current[index] = (self.current[index][0], pct)
            self._show()

    def finish(self, index: int) -> None:
        label, _ = self.current.pop(index, ("", 0))
        self.done += 1
        if self.enabled and not self.tty:
            sys.stderr.write(f"runs done {self.done}/{self.total}: {label}\n")
            sys.stderr.flush()
            return
        self._show()
        if self.enabled and self.done == self.total:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _show(self) -> None:
        if not self.enabled or not self.tty:
            return
        running = " | ".join(f"{lab} {pct:3d}%" for _, (lab, pct) in sorted(self.current.items()))
        line = f"runs done {self.done}/{self.total}" + (f" | {running}" if running else "")
        sys.stderr.write("\r" + line.ljust(self.width))
        self.width = len(line)
        sys.stderr.flush()


def _is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _percent_reporter(total: int, report: Callable[[int], None]) -> Callable[[int], None]:
    """A `run_policy` progress callback that passes on whole percentages, each once."""
    shown = [-1]
    total = max(1, total)

    def progress(done: int) -> None:
        pct = 100 * done // total
        if pct != shown[0]:
            shown[0] = pct
            report(pct)

    return progress


_WORKER: Runner | None = None  # a worker process's runner, set by _worker_init
_EVENTS: Any = None  # the queue a worker reports progress on


def _worker_init(
    scenario: str, overrides: list[str], requests: Sequence[TraceRequest], events: Any
) -> None:
    global _WORKER, _EVENTS
    _WORKER = Runner(scenario, overrides, requests)
    _EVENTS = events


def _worker_run(job: Run, rows: bool) -> RunResult | dict[str, Any]:
    assert _WORKER is not None, "worker not initialised"
    _EVENTS.put(("start", job.index))
    total = len(_WORKER.requests) if job.limit is None else min(job.limit, len(_WORKER.requests))
    progress = _percent_reporter(total, lambda pct: _EVENTS.put(("percent", job.index, pct)))
    return _WORKER.row(job, progress) if rows else _WORKER.result(job, progress)


def _cost_order(job: Run) -> tuple[int, int]:
    """Longest first, so that no long run starts last: catsproto's whole-trace runs
    (ten times any other policy's), then its sweep points, then the rest."""
    if job.policy == "catsproto":
        return (0 if job.limit is None else 1, job.index)
    return (2, job.index)


def _run_parallel(
    jobs: Sequence[Run],
    n_workers: int,
    args: argparse.Namespace,
    requests: Sequence[TraceRequest],
    rows: bool,
) -> list[Any]:
    """Every job in `n_workers` processes (its row if `rows`, else its `RunResult`), in
    job order whatever the finishing order."""
    ctx = multiprocessing.get_context()
    events = ctx.Queue()
    display = _SeedProgress(len(jobs), not args.quiet)
    out: list[Any] = [None] * len(jobs)
    finished = [False] * len(jobs)
    pool = ProcessPoolExecutor(
        n_workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(args.scenario, list(args.overrides), requests, events),
    )

    def drain() -> None:
        while True:
            try:
                event = events.get_nowait()
            except queue.Empty:
                return
            if finished[event[1]]:
                continue  # its result came in first
            if event[0] == "start":
                display.start(event[1], jobs[event[1]].label)
            else:
                display.percent(event[1], event[2])

    try:
        futures: dict[Future[Any], Run] = {
            pool.submit(_worker_run, job, rows): job for job in sorted(jobs, key=_cost_order)
        }
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            drain()
            for fut in sorted(done, key=lambda f: futures[f].index):
                job = futures[fut]
                out[job.index] = fut.result()
                finished[job.index] = True
                display.finish(job.index)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        events.close()
        events.join_thread()
    return out


def _run_seeds(
    args: argparse.Namespace,
    seeds: list[int],
    requests: Sequence[TraceRequest],
    base: Scenario,
    started: float,
) -> int:
    """The seed study: every (speedup, policy, seed), aggregated over seeds."""
    for option, values in (("--policies", args.policies), ("--speedup", args.speedup)):
        for i, value in enumerate(values):
            if value in values[:i]:
                shown = f"{value:g}" if isinstance(value, float) else value
                raise UsageError(f"{option}: {shown} is given twice")
    try:
        for seed in seeds:
            _scenario(args.scenario, [*args.overrides, f"seed={seed}"])
    except ScenarioError as exc:
        raise UsageError(str(exc)) from None
    jobs = [
        Run(i, name, speedup, args.seed, scenario_seed=seed)
        for i, (speedup, name, seed) in enumerate(
            (speedup, name, seed)
            for speedup in args.speedup
            for name in args.policies
            for seed in seeds
        )
    ]
    n_workers = min(args.jobs, len(jobs))
    if n_workers > 1:
        rows = _run_parallel(jobs, n_workers, args, requests, rows=True)
    else:
        runner = Runner(args.scenario, args.overrides, requests)
        display = _SeedProgress(len(jobs), not args.quiet)
        rows = []
        for job in jobs:
            display.start(job.index, job.label)
            progress = _percent_reporter(
                len(requests), lambda pct, i=job.index: display.percent(i, pct)
            )
            rows.append(runner.row(job, progress))
            display.finish(job.index)
    aggregate = seed_aggregate(rows)
    if args.json:
        import json

        doc = {"seeds": seeds, "aggregate": aggregate, "runs": rows}
        print(json.dumps(doc, indent=2, default=float))
    else:
        print(format_seed_table(aggregate))
    wall = time.perf_counter() - started
    if args.report:
        scenario = base.to_json()
        scenario.pop("seed", None)  # each run has its own: meta.seeds
        meta = {
            "trace": Path(args.trace).name,  # not the folder: reports are shared
            "requests": len(requests),
            "command": "catsproto eval " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "wall_s": wall,
            "jobs": n_workers,
            "seeds_spec": args.seeds,
            "seeds": seeds,
        }
        try:
            files = write_seed_report(Path(args.report), rows, aggregate, scenario, meta)
        except OSError as exc:
            raise UsageError(f"--report {args.report}: {exc.strerror or exc}") from None
        print(f"report: {', '.join(str(f) for f in files)}", file=sys.stderr)
    print(f"wall time {wall:.1f} s", file=sys.stderr)
    return 0

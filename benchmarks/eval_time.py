"""How long `catsproto eval` (S1: all seven policies at speedups 1 and 4) takes, against a
baseline revision of this repository measured in the same run, as JSON.

The baseline is a git revision (default: `d7f9f18`, the code before the eval ran in
worker processes and before the cache model's LRU change). It is checked out into a
temporary worktree and run with this checkout's virtualenv; then this checkout runs,
with `--jobs 1` (every run in one process: what the code itself costs) and with the
default `--jobs` (one worker per usable core). Each is run `--rounds` times, interleaved
(baseline, one process, workers, baseline, ...), and the best wall time of each is kept,
so that a change of load during the benchmark hits all three alike. The rows printed by
`--json` must be the same, byte for byte, in every run: the benchmark fails otherwise.

`ratio_*` are wall times over the baseline's; the target of the workers' run is at most
0.5. `cpu_s` is the CPU time of the run and its children.

    sudo .venv/bin/python benchmarks/eval_time.py [--baseline REV] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from catsproto.adapters.trace_download import find_or_download_trace  # noqa: E402
from catsproto.commands.eval import usable_cores  # noqa: E402

BASELINE = "d7f9f18"


def timed(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its stdout) of one run of `cmd`; fails loudly."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} in {cwd} failed:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved")
    parser.add_argument("--scenario", default="s1")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    trace = str(find_or_download_trace())
    python = sys.executable
    common = ["-m", "catsproto", "eval", "--trace", trace, "--scenario", args.scenario]
    common += ["--json", "--quiet"]
    with tempfile.TemporaryDirectory(prefix="catsproto-eval-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            runs = {
                "baseline": ([python, *common], tree),
                "one_process": ([python, *common, "--jobs", "1"], REPO),
                "workers": ([python, *common], REPO),
            }
            best: dict[str, tuple[float, float]] = {}
            outputs: dict[str, str] = {}
            for r in range(args.rounds):
                for name, (cmd, cwd) in runs.items():
                    wall, cpu, out = timed(cmd, cwd)
                    print(f"round {r + 1}: {name} {wall:.1f} s", file=sys.stderr, flush=True)
                    if name in best and best[name][0] <= wall:
                        pass
                    else:
                        best[name] = (wall, cpu)
                    if outputs.setdefault("rows", out) != out:
                        raise SystemExit(f"{name}: the rows differ from the first run's")
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )
    base_wall = best["baseline"][0]
    result = {
        "benchmark": "eval_time",
        "scenario": args.scenario,
        "baseline_revision": args.baseline,
        "usable_cores": usable_cores(),
        "rounds": args.rounds,
        "rows": len(json.loads(outputs["rows"])),
        "rows_identical": True,
        **{
            name: {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
            for name, (wall, cpu) in best.items()
        },
        "ratio_one_process": round(best["one_process"][0] / base_wall, 3),
        "ratio_workers": round(best["workers"][0] / base_wall, 3),
        "target_ratio_workers": 0.5,
        "load_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

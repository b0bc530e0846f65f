"""Run the scenarios in order and print the chaos table.

Each scenario gets a run directory of its own under `root` and always tears its lab down;
an exception inside one becomes a failed row with the error, and the campaign goes on.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from catsproto.lab.faults import crash, hostile, link, load, selector_restart, storm, transit
from catsproto.lab.faults.harness import Result

__all__ = ["SCENARIOS", "Result", "run_all", "run_one", "table"]

Scenario = Callable[..., Result]

SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "crash": ("1", crash.run),
    "link": ("2", link.run),
    "transit": ("3", transit.run),
    "selector": ("4", selector_restart.run),
    "storm": ("5", storm.run),
    "hostile": ("6", hostile.run),
    "load": ("7", load.run),
}


def run_one(name: str, root: Path, *, full: bool = False) -> Result:
    started = time.monotonic()
    run = SCENARIOS[name][1]
    try:
        result = run(root / name, full=full)
    except Exception as exc:  # a failed row, not a failed campaign
        result = Result(name, name, error=f"{type(exc).__name__}: {exc}")
        result.notes.append(traceback.format_exc(limit=3))
    result.seconds = round(time.monotonic() - started, 1)
    return result


def run_all(
    root: Path,
    names: Sequence[str] | None = None,
    *,
    full: bool = False,
    progress: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    results = []
    for name in names or list(SCENARIOS):
        result = run_one(name, root, full=full)
        progress(result)
        results.append(result)
    return results


def _time(r: Result) -> str:
    if r.time_s is None:
        return "-"
    if r.time_label.startswith("p99"):
        return f"p99 {1000 * r.time_s:.1f} ms"
    return f"{r.time_label} {r.time_s:.2f} s"


def _rejected(r: Result) -> str:
    return ", ".join(f"{k} {v}" for k, v in r.rejected.items()) or "-"


def table(results: Sequence[Result]) -> str:
    """The chaos table as Markdown."""
    rows = [
        "| # | scenario | result | detection / convergence | misrouted | rejected by reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        number = SCENARIOS.get(r.scenario, ("?",))[0]
        verdict = "pass" if r.passed else "FAIL"
        if not r.passed:
            verdict += f" ({r.error or '; '.join(r.failed_checks())})"
        misrouted = "-" if r.misrouted is None else str(r.misrouted)
        rows.append(
            f"| {number} | {r.title} | {verdict} | {_time(r)} | {misrouted} | {_rejected(r)} |"
        )
    return "\n".join(rows)

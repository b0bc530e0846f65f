"""The evaluation report: a table, JSON, matplotlib plots and a short markdown summary.

Also prices the raw vLLM KV-event stream the same cache changes would have produced,
with the real encoder (`catsproto.adapters.vllm_events`): a BlockStored event carries
each block's hash and its 512 token ids, so that stream is what an advertisement
replaces. Token ids are taken as 3-byte msgpack integers (ids 256..65535).
"""

from __future__ import annotations

import errno
import json
import math
import re
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from catsproto.sim import RunResult
from catsproto.sim.engine import RATE_MIN_SPAN_S

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "cdf_figure",
    "format_seed_table",
    "format_table",
    "headline",
    "raw_event_bytes",
    "seed_aggregate",
    "seed_figure",
    "summary_rows",
    "sweep_figure",
    "write_report",
    "write_seed_report",
]

_TOKEN = 20_000  # a typical token id: msgpack uint16 (3 bytes)
_HASH = (1 << 63) + 12345  # a 64-bit block hash: msgpack uint64 (9 bytes)


def _sizes(block_tokens: int) -> tuple[int, int, int, int, int]:
    from catsproto.adapters.vllm_events import encode_payload, removed_event, stored_event

    def stored(k: int) -> int:
        return len(
            encode_payload(
                0.0, [stored_event([_HASH] * k, _HASH, [_TOKEN] * (block_tokens * k), block_tokens)]
            )
        )

    def removed(k: int) -> int:
        return len(encode_payload(0.0, [removed_event([_HASH] * k)]))

    empty = len(encode_payload(0.0, []))
    s_block = stored(2) - stored(1)
    r_block = removed(2) - removed(1)
    return empty, stored(1) - s_block - empty, s_block, removed(1) - r_block - empty, r_block


def raw_event_bytes(events: Mapping[str, int], block_tokens: int) -> int:
    """msgpack bytes of vLLM's KV events for the counted cache changes: one batch per
    request, a BlockStored (hash + token ids per block) or BlockRemoved per change, a
    demotion as both."""
    batch, s_fixed, s_block, r_fixed, r_block = _sizes(block_tokens)
    moved = events.get("moved_blocks", 0)
    return (
        events.get("batches", 0) * batch
        + events.get("events", 0) * max(s_fixed, r_fixed)
        + (events.get("stored_blocks", 0) + moved) * s_block
        + (events.get("removed_blocks", 0) + moved) * r_block
    )


COLUMNS = [
    ("policy", "policy", "{}"),
    ("speedup", "x", "{:g}"),
    ("hit_rate", "hit %", "{:.1%}"),
    ("ttft_mean_ms", "mean ms", "{:.0f}"),
    ("ttft_p50_ms", "p50", "{:.0f}"),
    ("ttft_p99_ms", "p99", "{:.0f}"),
    ("rtt_mean_ms", "rtt", "{:.1f}"),
    ("wait_mean_ms", "wait", "{:.0f}"),
    ("prefill_mean_ms", "prefill", "{:.0f}"),
    ("fetch_mean_ms", "fetch", "{:.1f}"),
    ("adv_bytes_per_s", "adv B/s", "{:.0f}"),
    ("adv_share_of_raw", "adv/raw", "{:.2%}"),
    ("stale_hits", "stale", "{}"),
    ("false_positive_hits", "FP", "{}"),
]


_RATES = ("adv_bytes_per_s", "raw_event_bytes_per_s")


def format_table(rows: Sequence[Mapping[str, Any]], markdown: bool = False) -> str:
    """The main table; a rate of a run with advertisements but too short a span for a
    rate (`RATE_MIN_SPAN_S`) reads "n/a", a column that does not apply "–"."""
    header = [c[1] for c in COLUMNS]
    body = [
        [
            "n/a" if k in _RATES and "adv_bytes" in r and r.get(k) is None else _cell(r, k, f)
            for k, _, f in COLUMNS
        ]
        for r in rows
    ]
    return _grid(header, body, markdown)


def headline(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per speedup at which catsproto ran with nearest (network-only CATS)
    and/or the oracle: its hit rate and mean TTFT against theirs."""
    lines = []
    for speedup in sorted({r["speedup"] for r in rows}):
        at = {r["policy"]: r for r in rows if r["speedup"] == speedup}
        cats = at.get("catsproto")
        if cats is None or not ({"nearest", "oracle"} & at.keys()):
            continue
        hit, mean = cats["hit_rate"], cats["ttft_mean_ms"]
        parts = [f"x{speedup:g}: catsproto hit {hit:.1%}, mean TTFT {mean:.1f} ms"]
        near = at.get("nearest")
        if near is not None:
            parts.append(
                f"against nearest {_hit_ratio(hit, near['hit_rate'])} and "
                f"{_ttft_change(mean, near['ttft_mean_ms'])}"
            )
        oracle = at.get("oracle")
        if oracle is not None:
            gap = mean - oracle["ttft_mean_ms"]
            where = (
                f"{abs(gap):.1f} ms {'above' if gap > 0 else 'below'} the oracle"
                if gap
                else "level with the oracle"
            )
            parts.append(f"{where} ({oracle['ttft_mean_ms']:.1f} ms, hit {oracle['hit_rate']:.1%})")
        lines.append("; ".join(parts))
    return lines


def _hit_ratio(hit: float, other: float) -> str:
    """catsproto's hit rate against another policy's: a ratio, or both when that has none."""
    if other:
        return f"{hit / other:.1f}x the hit rate ({other:.1%})"
    if hit:
        return f"a hit rate of {hit:.1%} where it has none"
    return f"the same hit rate ({other:.1%})"


def _ttft_change(mean: float, other: float) -> str:
    """catsproto's mean TTFT against another policy's: "x% less" or "x% more" (never a
    negative "less")."""
    if not other:
        return f"a mean TTFT of {mean:.1f} ms against {other:.1f} ms"
    change = 1 - mean / other
    word = "less" if change >= 0 else "more"
    return f"{abs(change):.1%} {word} TTFT ({other:.1f} ms)"


def summary_rows(results: Sequence[RunResult], block_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        s = r.summary()
        if r.control:
            raw = raw_event_bytes(r.engine_events, block_tokens)
            s["raw_event_bytes"] = raw
            s["raw_event_bytes_per_s"] = r.per_second(raw)
            s["adv_share_of_raw"] = s["adv_bytes"] / raw if raw else None
        rows.append(s)
    return rows


def _figure(width: float, height: float) -> Figure:
    """A figure drawn by Agg, outside pyplot (no global state; nothing to close)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


# Seven policies on one CDF: a colour and a line pattern each (catsproto solid and
# heavy, the oracle dashed over it), so that curves lying on each other stay apart.
_POLICY_LINES: dict[str, tuple[Any, float]] = {
    "random": (":", 1.4),
    "round-robin": ("-.", 1.3),
    "least-loaded": ((0, (6, 2, 1, 2, 1, 2)), 1.3),
    "nearest": ((0, (3, 1)), 1.3),
    "compute-aware": ((0, (8, 3)), 1.3),
    "catsproto": ("-", 2.4),
    "oracle": ("--", 1.6),
}
_OTHER_LINES = ("-", "--", "-.", ":", (0, (1, 1)))
_ZOOM = (0.5, 0.95)  # the CDF's second panel: the fractions where the policies part


def _seconds_axis(ax: Any, subs: tuple[float, ...]) -> None:
    """A log time axis labelled 0.01, 0.1, 1 (with `subs` (1, 2, 5): 0.2, 0.5, 1, 2, ...)
    rather than 10⁻² and unlabelled or crowded minor ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("time to first token (s)")
    ax.grid(alpha=0.3)


def cdf_figure(results: Sequence[RunResult], title: str) -> Figure:
    """TTFT CDF of every policy, log time axis: the whole distribution on the left and,
    on the right, the same curves between the 50th and 95th percentiles over the times
    where the better half of the policies reach them (the worst leave it to the right)."""
    fig = _figure(10.0, 4.2)
    ax, zoom = fig.subplots(1, 2)
    lo_q, hi_q = [], []
    for i, r in enumerate(results):
        x = np.sort(r.ttft_ms) / 1000
        y = np.arange(1, len(x) + 1) / len(x)
        ls, lw = _POLICY_LINES.get(r.policy, (_OTHER_LINES[i % len(_OTHER_LINES)], 1.3))
        style = {"color": f"C{i % 10}", "ls": ls, "lw": lw}
        ax.plot(x, y, label=r.policy, **style)
        zoom.plot(x, y, **style)
        if len(x):
            lo_q.append(float(np.quantile(x, _ZOOM[0])))
            hi_q.append(float(np.quantile(x, _ZOOM[1])))
    _seconds_axis(ax, (1.0,))
    _seconds_axis(zoom, (1.0, 2.0, 5.0))
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    right = float(np.median(hi_q)) if hi_q else 0.0
    if lo_q and min(lo_q) > 0 and right > min(lo_q):
        zoom.set_xlim(min(lo_q) / 1.05, right * 1.05)
        zoom.set_ylim(*_ZOOM)
    zoom.set_title(f"zoom: {_ZOOM[0]:.0%} to {_ZOOM[1]:.0%} of requests")
    ax.legend(fontsize=8, loc="upper left", handlelength=3.5)
    fig.tight_layout()
    return fig


def sweep_figure(sweep: Sequence[Mapping[str, Any]], key: str, label: str, title: str) -> Figure:
    """catsproto's hit rate and advertisement bytes/s against one swept setting, both
    axes from zero (the hit rate moves by tenths of a point: noise on this slice). A
    point whose rate is n/a (too short a span) is left out of the bytes line."""
    pts = sorted((p[key], p["hit_rate"], p["adv_bytes_per_s"]) for p in sweep)
    fig = _figure(6.4, 3.8)
    ax = fig.subplots()
    xs = [p[0] for p in pts]
    hits = [100 * p[1] for p in pts]
    ax.plot(xs, hits, "o-", color="C0")
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("catsproto hit rate (%)", color="C0")
    ax.set_ylim(0, max([*hits, 1.0]) * 1.15)
    ax2 = ax.twinx()
    rated = [(x, b) for x, _, b in pts if b is not None]
    ax2.plot([x for x, _ in rated], [b for _, b in rated], "s--", color="C3")
    ax2.set_ylabel("advertisement bytes/s", color="C3")
    ax2.set_ylim(0, max([b for _, b in rated] or [1.0]) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _legend_clear_of_data(ax: Any, data_lo: float, data_hi: float, **kwargs: Any) -> None:
    """A legend in the upper left of `ax` with the y-axis raised so that nothing drawn
    between `data_lo` and `data_hi` goes under it (the figure's layout already set)."""
    legend = ax.legend(fontsize=8, loc="upper left", **kwargs)
    renderer = ax.figure.canvas.get_renderer()
    box = legend.get_window_extent(renderer).transformed(ax.transAxes.inverted())
    free = max(box.y0 - 0.03, 0.2)  # the axes' fraction below the legend
    span = (data_hi - data_lo) or 1.0
    lo = data_lo - 0.05 * span
    ax.set_ylim(lo, lo + (data_hi - lo) / free)


def prepare_report_dir(out: Path) -> list[Path]:
    """Make `out` (and its parents) and check a file can be written in it, so that a
    bad --report fails before the runs rather than after them. Returns the folders it
    made, deepest first (for `discard_report_dirs` if the run does not finish). Raises
    OSError."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(out))
    made = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out):
        pass
    return made


def discard_report_dirs(made: Sequence[Path]) -> None:
    """Remove the folders `prepare_report_dir` made, deepest first, each only while it
    is still empty (a run that did not finish leaves no empty report folder behind)."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def write_report(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    results: Sequence[RunResult],
    scenario: Mapping[str, Any],
    sweeps: Mapping[str, Sequence[Mapping[str, Any]]],
    meta: Mapping[str, Any],
) -> list[Path]:
    """results.json, summary.md and PNGs in `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    doc = {"meta": dict(meta), "scenario": dict(scenario), "results": list(rows), "sweeps": sweeps}
    p = out / "results.json"
    p.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    written.append(p)
    for speedup in sorted({r.speedup for r in results}):
        group = [r for r in results if r.speedup == speedup]
        p = out / f"ttft_cdf_x{speedup:g}.png"
        cdf_figure(group, f"{scenario.get('name')}: TTFT CDF, speedup {speedup:g}").savefig(p)
        written.append(p)
    labels = {
        "update_interval_ms": "update interval (ms)",
        "target_fpr": "target false-positive rate",
    }
    sweep_requests = meta.get("sweep_requests")
    for key, pts in sweeps.items():
        if pts:
            p = out / f"sweep_{key}.png"
            title = (
                f"{scenario.get('name')}: catsproto on the first {sweep_requests:,} "
                f"requests, speedup 1, one run per point"
                if isinstance(sweep_requests, int)
                else f"{scenario.get('name')}: catsproto, one run per point"
            )
            sweep_figure(pts, key, labels.get(key, key), title).savefig(p)
            written.append(p)
    md = [
        f"# catsproto evaluation: {scenario.get('name')}",
        "",
        f"Trace: `{meta.get('trace')}` ({meta.get('requests')} requests). "
        f"Command: `{meta.get('command')}`. Wall time {meta.get('wall_s', 0):.1f} s.",
        "",
        format_table(rows, markdown=True),
        "",
    ]
    for s in rows:
        if "adv_bytes" in s:
            rate = s["adv_bytes_per_s"]
            per_s = (
                f"{rate:.0f} B/s"
                if rate is not None
                else f"rate n/a: a span of {s['duration_s']:g} s, under {RATE_MIN_SPAN_S:g} s"
            )
            share = s["adv_share_of_raw"]
            md.append(
                f"- catsproto x{s['speedup']:g}: {s['advertisements']} advertisements, "
                f"{s['adv_bytes']} bytes ({per_s}) against "
                f"{s['raw_event_bytes']} bytes of raw vLLM events "
                f"({'–' if share is None else f'{share:.2%}'}); stale hits {s['stale_hits']}, "
                f"false-positive hits {s['false_positive_hits']}, fallbacks {s['fallbacks']}."
            )
    if any("adv_bytes" in s for s in rows):
        md += ["", _FALLBACKS]
    md += ["", *[f"![{p.stem}]({p.name})" for p in written if p.suffix == ".png"], ""]
    p = out / "summary.md"
    p.write_text("\n".join(md))
    written.append(p)
    _remove_stale(out, _REPORT_FILES, written)
    return written


_FALLBACKS = (
    "Fallbacks: catsproto decisions made before the deciding C-PS had heard any "
    "advertisement (the first requests of a run); each went to the least-loaded instance "
    "of that C-PS's site. Rates are over the trace's span after the speedup (first to "
    f"last arrival), n/a under {RATE_MIN_SPAN_S:g} s."
)

# What `write_report` / `write_seed_report` name their files, and nothing else: an
# earlier report's files of the same kind that a new one does not write are removed.
_REPORT_FILES = re.compile(
    r"results\.json|summary\.md|ttft_cdf_x[0-9][0-9.e+-]*\.png"
    r"|sweep_(update_interval_ms|target_fpr)\.png"
)
_SEED_REPORT_FILES = re.compile(r"seeds\.json|seeds\.md|seeds_x[0-9][0-9.e+-]*\.png")


def _remove_stale(out: Path, names: re.Pattern[str], written: Sequence[Path]) -> None:
    """Remove the regular files in `out` whose names `names` matches and that this run
    did not write (a plot of a speedup or sweep not run this time); nothing else."""
    keep = {p.name for p in written}
    for entry in out.iterdir():
        if (
            names.fullmatch(entry.name)
            and entry.name not in keep
            and entry.is_file()
            and not entry.is_symlink()
        ):
            entry.unlink()


def seed_aggregate(
    runs: Sequence[Mapping[str, Any]], reference: str = "oracle"
) -> list[dict[str, Any]]:
    """One row per (policy, speedup) over the per-seed rows in `runs` (each a
    `summary_rows` row with a `seed` field): how many seeds, the mean, sample standard
    deviation, min and max of the per-seed mean TTFT, the mean hit rate; and for every
    policy other than `reference`, when `reference` ran at the same speedup, the paired
    per-seed difference (policy minus reference, same seed): its mean, the standard error
    of that mean, and on how many seeds the policy was at or below the reference.

    Pure: rows in, rows out, in the order the (policy, speedup) pairs first appear.
    Means are correctly rounded sums (`statistics.fmean`); with one seed the standard
    deviation and the standard error are None."""
    groups: dict[tuple[str, float], dict[int, Mapping[str, Any]]] = {}
    for row in runs:
        key = (str(row["policy"]), float(row["speedup"]))
        seed = int(row["seed"])
        per_seed = groups.setdefault(key, {})
        if seed in per_seed:
            raise ValueError(f"two rows for {key[0]} x{key[1]:g} seed {seed}")
        per_seed[seed] = row
    out = []
    for (policy, speedup), per_seed in groups.items():
        seeds = sorted(per_seed)
        ttft = [float(per_seed[s]["ttft_mean_ms"]) for s in seeds]
        hits = [float(per_seed[s]["hit_rate"]) for s in seeds]
        agg: dict[str, Any] = {
            "policy": policy,
            "speedup": speedup,
            "seeds": len(seeds),
            "seed_list": seeds,
            "ttft_mean_ms": statistics.fmean(ttft),
            "ttft_std_ms": statistics.stdev(ttft) if len(ttft) > 1 else None,
            "ttft_min_ms": min(ttft),
            "ttft_max_ms": max(ttft),
            "hit_rate": statistics.fmean(hits),
            "reference": None,
            "paired_seeds": 0,
            "diff_mean_ms": None,
            "diff_se_ms": None,
            "at_or_below": None,
        }
        ref = groups.get((reference, speedup))
        if policy != reference and ref is not None:
            common = [s for s in seeds if s in ref]
            diffs = [
                float(per_seed[s]["ttft_mean_ms"]) - float(ref[s]["ttft_mean_ms"]) for s in common
            ]
            if diffs:
                agg.update(
                    reference=reference,
                    paired_seeds=len(diffs),
                    diff_mean_ms=statistics.fmean(diffs),
                    diff_se_ms=(
                        statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
                    ),
                    at_or_below=sum(1 for d in diffs if d <= 0),
                )
        out.append(agg)
    return out


SEED_COLUMNS = [
    ("policy", "policy", "{}"),
    ("speedup", "x", "{:g}"),
    ("seeds", "seeds", "{}"),
    ("ttft_mean_ms", "mean ms", "{:.2f}"),
    ("ttft_std_ms", "std", "{:.2f}"),
    ("ttft_min_ms", "min", "{:.2f}"),
    ("ttft_max_ms", "max", "{:.2f}"),
    ("hit_rate", "hit %", "{:.2%}"),
    ("diff_mean_ms", "− ref ms", "{:+.2f}"),
    ("diff_se_ms", "± se", "{:.2f}"),
]


def format_seed_table(aggregate: Sequence[Mapping[str, Any]], markdown: bool = False) -> str:
    """The seed study's table; the paired columns compare with the reference policy
    (`ref`, the oracle), and `≤ ref` counts the seeds at or below it."""
    rows = []
    for a in aggregate:
        row = dict(a)
        if a.get("at_or_below") is not None:
            row["le_ref"] = f"{a['at_or_below']} of {a['paired_seeds']}"
        rows.append(row)
    columns = [*SEED_COLUMNS, ("le_ref", "≤ ref", "{}")]
    ref = next((a["reference"] for a in aggregate if a.get("reference")), None)
    header = [c[1].replace("ref", ref) if ref else c[1] for c in columns]
    return _grid(header, [[_cell(r, k, f) for k, _, f in columns] for r in rows], markdown)


def _cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    v = row.get(key)
    return "–" if v is None else fmt.format(v)


def _grid(header: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)
    ]
    fmt_line = "  ".join("{:>" + str(w) + "}" for w in widths)
    return "\n".join([fmt_line.format(*header)] + [fmt_line.format(*r) for r in body])


def seed_figure(
    runs: Sequence[Mapping[str, Any]],
    aggregate: Sequence[Mapping[str, Any]],
    speedup: float,
    title: str,
) -> Figure:
    """Per-seed mean TTFT of each policy that moves with the seed as points (its mean
    dashed) and the reference (the oracle) as a horizontal line; below, the per-seed
    difference to the reference as bars, with its mean and standard error. Other
    policies that are the same on every seed are only named in a note (they would
    squash the scale)."""
    group = [a for a in aggregate if a["speedup"] == speedup]
    moving = [a for a in group if a["ttft_min_ms"] != a["ttft_max_ms"]]
    refs = {a["reference"] for a in moving if a["reference"]}
    drawn = [a for a in group if a in moving or a["policy"] in refs] or group
    left_out = [a for a in group if a not in drawn]
    paired = [a for a in moving if a["diff_mean_ms"] is not None and a["paired_seeds"] > 1]
    by_policy: dict[str, dict[int, float]] = {}
    for r in runs:
        if float(r["speedup"]) == speedup:
            by_policy.setdefault(str(r["policy"]), {})[int(r["seed"])] = float(r["ttft_mean_ms"])
    ax2 = None
    if paired:
        fig = _figure(7.0, 5.8)
        ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    else:
        fig = _figure(7.0, 4.0)
        ax = fig.subplots()
    all_seeds = sorted({s for v in by_policy.values() for s in v})
    lo, hi = (min(all_seeds), max(all_seeds)) if all_seeds else (0, 1)
    colors = {a["policy"]: f"C{i}" for i, a in enumerate(drawn)}
    for a in drawn:
        pts, color = by_policy[a["policy"]], colors[a["policy"]]
        if a in moving:
            xs = sorted(pts)
            ax.plot(
                xs,
                [pts[s] for s in xs],
                "o",
                color=color,
                ms=5,
                label=f"{a['policy']}, each seed (mean {a['ttft_mean_ms']:.2f} ms)",
            )
            ax.hlines(a["ttft_mean_ms"], lo - 0.5, hi + 0.5, colors=color, lw=1, ls="--")
        else:
            ax.hlines(
                a["ttft_mean_ms"],
                lo - 0.5,
                hi + 0.5,
                colors=color,
                lw=1.6,
                label=f"{a['policy']} {a['ttft_mean_ms']:.2f} ms (the same on every seed)",
            )
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if left_out:
        note = ", ".join(f"{a['policy']} {a['ttft_mean_ms']:.1f} ms" for a in left_out)
        ax.plot([], [], " ", label=f"not drawn (the same on every seed): {note}")
    top = [v for a in drawn for v in by_policy[a["policy"]].values()]
    top += [a["ttft_mean_ms"] for a in drawn]
    bottom = [0.0]
    if ax2 is not None:
        width = 0.8 / len(paired)
        for j, a in enumerate(paired):
            pts, ref = by_policy[a["policy"]], by_policy[a["reference"]]
            xs = [s for s in sorted(pts) if s in ref]
            ds = [pts[s] - ref[s] for s in xs]
            color = colors[a["policy"]]
            offset = (j - (len(paired) - 1) / 2) * width
            m, se = a["diff_mean_ms"], a["diff_se_ms"]
            ax2.bar(
                [x + offset for x in xs],
                ds,
                width=width,
                color=color,
                alpha=0.75,
                label=f"{a['policy']} − {a['reference']}: mean {m:+.2f} ± {se:.2f} ms (se); "
                f"at or below on {a['at_or_below']} of {a['paired_seeds']} seeds",
            )
            ax2.axhspan(m - se, m + se, color=color, alpha=0.15)
            ax2.axhline(m, color=color, lw=1, ls="--")
            bottom += [*ds, m - se, m + se]
        ax2.axhline(0, color="black", lw=0.8)
        ax2.set_ylabel("difference, same seed (ms)")
        ax2.grid(alpha=0.3)
    (ax2 or ax).set_xlabel("scenario seed")
    if all_seeds and len(all_seeds) <= 30:
        (ax2 or ax).set_xticks(all_seeds)
    fig.tight_layout()
    # the legends in room of their own above the points and bars (measured once laid out)
    _legend_clear_of_data(ax, min(top), max(top))
    if ax2 is not None:
        _legend_clear_of_data(ax2, min(bottom), max(bottom))
    return fig


def write_seed_report(
    out: Path,
    runs: Sequence[Mapping[str, Any]],
    aggregate: Sequence[Mapping[str, Any]],
    scenario: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> list[Path]:
    """seeds.json (every per-seed row and the aggregate), seeds.md and one
    seeds_x{speedup}.png per speedup in `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    doc = {
        "meta": dict(meta),
        "scenario": dict(scenario),
        "runs": list(runs),
        "aggregate": list(aggregate),
    }
    p = out / "seeds.json"
    p.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    written.append(p)
    name = scenario.get("name")
    for speedup in sorted({float(a["speedup"]) for a in aggregate}):
        p = out / f"seeds_x{speedup:g}.png"
        title = f"{name}, speedup {speedup:g}: mean TTFT by seed"
        seed_figure(runs, aggregate, speedup, title).savefig(p)
        written.append(p)
    seeds = sorted({int(r["seed"]) for r in runs})
    md = [
        f"# catsproto evaluation over scenario seeds: {name}",
        "",
        f"Trace: `{meta.get('trace')}` ({meta.get('requests')} requests), "
        f"{len(seeds)} scenario seeds ({meta.get('seeds_spec')}). "
        f"Command: `{meta.get('command')}`. Wall time {meta.get('wall_s', 0):.1f} s "
        f"with {meta.get('jobs')} job(s).",
        "",
        "Per (policy, speedup): the mean over seeds of each seed's mean TTFT, the sample",
        "standard deviation, min and max across seeds, the mean hit rate; then the mean of",
        "the per-seed difference to the reference (same seed), the standard error of that",
        "mean, and on how many seeds the policy was at or below the reference.",
        "",
        format_seed_table(aggregate, markdown=True),
        "",
        *[f"![{p.stem}]({p.name})" for p in written if p.suffix == ".png"],
        "",
    ]
    p = out / "seeds.md"
    p.write_text("\n".join(md))
    written.append(p)
    _remove_stale(out, _SEED_REPORT_FILES, written)
    return written


def _json_default(obj: object) -> object:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")

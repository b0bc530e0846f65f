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
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from catsproto.sim import RunResult

__all__ = [
    "format_seed_table",
    "format_table",
    "headline",
    "raw_event_bytes",
    "seed_aggregate",
    "summary_rows",
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


def format_table(rows: Sequence[Mapping[str, Any]], markdown: bool = False) -> str:
    header = [c[1] for c in COLUMNS]
    return _grid(header, [[_cell(r, k, f) for k, _, f in COLUMNS] for r in rows], markdown)


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
            times = f"{hit / near['hit_rate']:.1f}x" if near["hit_rate"] else "n/a"
            less = 1 - mean / near["ttft_mean_ms"] if near["ttft_mean_ms"] else 0.0
            parts.append(
                f"against nearest {times} the hit rate ({near['hit_rate']:.1%}) and "
                f"{less:.1%} less TTFT ({near['ttft_mean_ms']:.1f} ms)"
            )
        oracle = at.get("oracle")
        if oracle is not None:
            gap = mean - oracle["ttft_mean_ms"]
            word = "above" if gap > 0 else "below"
            parts.append(
                f"{abs(gap):.1f} ms {word} the oracle ({oracle['ttft_mean_ms']:.1f} ms, "
                f"hit {oracle['hit_rate']:.1%})"
            )
        lines.append("; ".join(parts))
    return lines


def summary_rows(results: Sequence[RunResult], block_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        s = r.summary()
        if r.control:
            raw = raw_event_bytes(r.engine_events, block_tokens)
            s["raw_event_bytes"] = raw
            s["raw_event_bytes_per_s"] = raw / r.duration_s
            s["adv_share_of_raw"] = s["adv_bytes"] / raw if raw else None
        rows.append(s)
    return rows


def _cdf_plot(results: Sequence[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for r in results:
        x = np.sort(r.ttft_ms) / 1000
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=r.policy, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _sweep_plot(sweep: Sequence[Mapping[str, Any]], key: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((p[key], p["hit_rate"], p["adv_bytes_per_s"]) for p in sweep)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    xs = [p[0] for p in pts]
    ax.plot(xs, [100 * p[1] for p in pts], "o-", color="C0")
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("catsproto hit rate (%)", color="C0")
    ax2 = ax.twinx()
    ax2.plot(xs, [p[2] for p in pts], "s--", color="C3")
    ax2.set_ylabel("advertisement bytes/s", color="C3")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def prepare_report_dir(out: Path) -> None:
    """Make `out` (and its parents) and check a file can be written in it, so that a
    bad --report fails before the runs rather than after them. Raises OSError."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(out))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out):
        pass


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
        _cdf_plot(group, p, f"{scenario.get('name')}: TTFT CDF, speedup {speedup:g}")
        written.append(p)
    labels = {
        "update_interval_ms": "update interval (ms)",
        "target_fpr": "target false-positive rate",
    }
    for key, pts in sweeps.items():
        if pts:
            p = out / f"sweep_{key}.png"
            _sweep_plot(pts, key, labels.get(key, key), p)
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
            md.append(
                f"- catsproto x{s['speedup']:g}: {s['advertisements']} advertisements, "
                f"{s['adv_bytes']} bytes ({s['adv_bytes_per_s']:.0f} B/s) against "
                f"{s['raw_event_bytes']} bytes of raw vLLM events "
                f"({s['adv_share_of_raw']:.2%}); stale hits {s['stale_hits']}, "
                f"false-positive hits {s['false_positive_hits']}, fallbacks {s['fallbacks']}."
            )
    md += ["", *[f"![{p.stem}]({p.name})" for p in written if p.suffix == ".png"], ""]
    p = out / "summary.md"
    p.write_text("\n".join(md))
    written.append(p)
    return written


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


def _seed_plot(
    runs: Sequence[Mapping[str, Any]],
    aggregate: Sequence[Mapping[str, Any]],
    speedup: float,
    path: Path,
    title: str,
) -> None:
    """Per-seed mean TTFT of each policy that moves with the seed as points (its mean
    dashed) and the reference (the oracle) as a horizontal line; below, the per-seed
    difference to the reference as bars, with its mean and standard error. Other
    policies that are the same on every seed are only named in a note (they would
    squash the scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        fig, (ax, ax2) = plt.subplots(
            2, 1, figsize=(7.0, 5.8), dpi=90, sharex=True, height_ratios=[3, 2]
        )
    else:
        fig, ax = plt.subplots(figsize=(7.0, 4.0), dpi=90)
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
    ax.legend(fontsize=8)
    if left_out:
        note = ", ".join(f"{a['policy']} {a['ttft_mean_ms']:.1f} ms" for a in left_out)
        ax.text(
            0.01,
            0.02,
            f"not drawn (the same on every seed): {note}",
            transform=ax.transAxes,
            fontsize=7,
            color="0.35",
        )
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
        ax2.axhline(0, color="black", lw=0.8)
        ax2.set_ylabel("difference, same seed (ms)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    (ax2 or ax).set_xlabel("scenario seed")
    if all_seeds and len(all_seeds) <= 30:
        (ax2 or ax).set_xticks(all_seeds)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
        _seed_plot(runs, aggregate, speedup, p, f"{name}, speedup {speedup:g}: mean TTFT by seed")
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
    return written


def _json_default(obj: object) -> object:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")

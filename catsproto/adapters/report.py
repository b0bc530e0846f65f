"""The evaluation report: a table, JSON, matplotlib plots and a short markdown summary.

Also prices the raw vLLM KV-event stream the same cache changes would have produced,
with the real encoder (`catsproto.adapters.vllm_events`): a BlockStored event carries
each block's hash and its 512 token ids, so that stream is what an advertisement
replaces. Token ids are taken as 3-byte msgpack integers (ids 256..65535).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from catsproto.sim import RunResult

__all__ = [
    "format_table",
    "raw_event_bytes",
    "write_report",
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
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            cells.append("–" if v is None else fmt.format(v))
        body.append(cells)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)
    ]
    fmt_line = "  ".join("{:>" + str(w) + "}" for w in widths)
    return "\n".join([fmt_line.format(*header)] + [fmt_line.format(*r) for r in body])


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


def _json_default(obj: object) -> object:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")

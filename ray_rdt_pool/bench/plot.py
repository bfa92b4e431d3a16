"""The benchmark's chart: GB/s per workload and variant, and our speedups vs Ray's.

Drawn from the summaries of :mod:`ray_rdt_pool.bench.report`; needs matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_OUR_COLORS = {"nixl_pool": "#d62728", "nixl_pool_target": "#ff7f0e"}
_RAY_COLORS = {"objstore": "#9e9e9e", "objstore_zc": "#616161", "nixl": "#1f77b4",
               "nixl_pool_ray": "#17becf", "nixl_target": "#2ca02c",
               "transferqueue": "#9467bd"}  # not Ray's, but drawn with them


def write_plot(path: str, summary: dict[str, Any], order: Sequence[str],
               unavailable: dict[str, str], title: str) -> None:
    """Two panels: GB/s per workload and variant; our speedup vs Ray per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary)
    # Wide enough that the "best Ray" tick labels of eight workloads do not overlap.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(13.0, 2.1 * len(workloads)), 9),
                                   height_ratios=[3, 2])
    variants = [v for v in order if any(v in summary[w]["variants"] for w in workloads)]
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            r = summary[w]["variants"].get(v)
            if r and r["gbps"] and r["checksums_ok"]:
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                ys.append(r["gbps"])
        color = _OUR_COLORS.get(v) or _RAY_COLORS.get(v)
        bars = ax1.bar(xs, ys, width, label=v, color=color,
                       edgecolor="black" if v in _OUR_COLORS else None)
        for b, y in zip(bars, ys):
            ax1.annotate(f"{y:.2g}", (b.get_x() + b.get_width() / 2, y), ha="center",
                         va="bottom", fontsize=7, rotation=90, xytext=(0, 2),
                         textcoords="offset points")
    ax1.set_xticks(range(len(workloads)), workloads)
    ax1.set_yscale("log")
    top = max((r["gbps"] for w in workloads for r in summary[w]["variants"].values()
               if r["gbps"]), default=1.0)
    ax1.set_ylim(top=top * 5)
    ax1.set_ylabel("effective GB/s (payload / median e2e), log")
    ax1.set_title("Throughput per workload (higher is better; missing bar: skipped, "
                  "unavailable or failed)")
    ax1.legend(fontsize=8, ncol=len(variants), loc="upper center", bbox_to_anchor=(0.5, -0.07))
    ax1.grid(axis="y", which="both", alpha=0.3)

    pairs = [(ours, kind) for ours in ("nixl_pool", "nixl_pool_target")
             for kind in ("vs_best_ray", "vs_ray_pool")]
    pw = 0.8 / len(pairs)
    any_bar = False
    for i, (ours, kind) in enumerate(pairs):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            sp = summary[w]["ratios"]["speedup"].get(ours, {}).get(kind)
            if sp:
                xs.append(j + (i - (len(pairs) - 1) / 2) * pw)
                ys.append(sp)
        if not ys:
            continue
        any_bar = True
        label = f"{ours} {'vs best Ray' if kind == 'vs_best_ray' else 'vs Ray pool'}"
        bars = ax2.bar(xs, ys, pw, label=label, color=_OUR_COLORS[ours],
                       alpha=1.0 if kind == "vs_best_ray" else 0.55, edgecolor="black")
        for b, y in zip(bars, ys):
            ax2.annotate(f"x{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center",
                         va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax2.axhline(1.0, color="black", lw=1)
    ax2.set_xticks(range(len(workloads)),
                   [f"{w}\n(best Ray: {summary[w]['ratios']['best_ray'] or 'n/a'}"
                    + ("; incomplete" if summary[w]["ratios"].get("best_ray_incomplete")
                       else "") + ")"
                    for w in workloads])
    ax2.set_ylabel("speedup = ray e2e / our e2e")
    ax2.set_title("Our transport vs Ray (above 1: ours faster)")
    if any_bar:
        ax2.set_yscale("log")
        lo, hi = ax2.get_ylim()
        ax2.set_ylim(min(lo, 0.5), hi * 2)
        ax2.legend(fontsize=8, ncol=4, loc="upper left")
    else:
        reason = unavailable.get("nixl_pool") or "no measurements"
        ax2.text(0.5, 0.5, f"nixl_pool not available:\n{reason}", ha="center", va="center",
                 transform=ax2.transAxes, fontsize=11)
    ax2.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

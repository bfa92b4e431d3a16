"""Summaries, text tables and the chart of the side-by-side benchmark.

Input is the list of per-transfer samples the runner records (one dict per repetition,
see :mod:`microbenchmarks.bench`). Everything here is pure: no Ray, no actors.

Ratio convention: ``speedup = ray_time / our_time`` on the median end-to-end time, so a
value above 1 means our transport is faster.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

#: Phases summarised in the tables, in column order (keys of a sample, in seconds).
PHASES: tuple[str, ...] = ("put_s", "fetch_s", "e2e_s", "release_s")
#: Extra phases kept in the JSON summary (not in the main table).
EXTRA_PHASES: tuple[str, ...] = ("dispatch_s", "handoff_s", "sender_update_s",
                                 "sender_checksum_s", "receiver_checksum_s")
_MEASURED = ("measured", "warm")
_FIRST = ("warmup", "cold")


def _stat(values: Iterable[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "n": len(vals)}


def summarize(samples: Sequence[dict[str, Any]], payloads: dict[str, int],
              ray_variants: Sequence[str], our_variants: Sequence[str],
              workload_order: Sequence[str], ray_pool: str = "nixl_pool_ray") -> dict[str, Any]:
    """Per workload (in ``workload_order``): per-variant phase medians/minima, our speedups."""
    out: dict[str, Any] = {}
    present = {s["workload"] for s in samples}
    for workload in [w for w in workload_order if w in present]:
        rows: dict[str, Any] = {}
        for variant in dict.fromkeys(s["variant"] for s in samples if s["workload"] == workload):
            mine = [s for s in samples if s["workload"] == workload and s["variant"] == variant]
            measured = [s for s in mine if s.get("kind") in _MEASURED and not s.get("error")]
            first = [s for s in mine if s.get("kind") in _FIRST and s.get("rep") == 0]
            phases = {p: _stat(s.get(p) for s in measured) for p in PHASES + EXTRA_PHASES}
            e2e = phases["e2e_s"]
            metas = [s["meta_bytes"] for s in measured if s.get("meta_bytes") is not None]
            rows[variant] = {
                "n_measured": len(measured),
                "phases": phases,
                "first_e2e_s": first[0].get("e2e_s") if first and not first[0].get("error")
                else None,
                "gbps": payloads[workload] / e2e["median"] / 1e9 if e2e else None,
                "meta_bytes": int(statistics.median(metas)) if metas else None,
                "checksums_ok": all(s.get("checksum_ok") for s in mine if not s.get("error"))
                and any(s.get("checksum_ok") for s in mine),
                "errors": [s["error"] for s in mine if s.get("error")],
                "into_targets": _all_or_none(s.get("into_targets") for s in mine),
            }
        out[workload] = {"variants": rows,
                         "ratios": _ratios(rows, ray_variants, our_variants, ray_pool)}
    return out


def _all_or_none(values: Iterable[bool | None]) -> bool | None:
    vals = [v for v in values if v is not None]
    return all(vals) if vals else None


def _median_e2e(row: dict[str, Any] | None) -> float | None:
    if not row or row["errors"] or not row["checksums_ok"]:
        return None
    e2e = row["phases"]["e2e_s"]
    return e2e["median"] if e2e else None


def _ratios(rows: dict[str, Any], ray_variants: Sequence[str], our_variants: Sequence[str],
            ray_pool: str) -> dict[str, Any]:
    ray_times = {v: t for v in ray_variants if (t := _median_e2e(rows.get(v))) is not None}
    best = min(ray_times, key=ray_times.__getitem__) if ray_times else None
    res: dict[str, Any] = {
        "convention": "speedup = ray_e2e_median / our_e2e_median (>1: ours faster)",
        "best_ray": best,
        "best_ray_e2e_s": ray_times.get(best) if best else None,
        "ray_pool_e2e_s": ray_times.get(ray_pool),
        "speedup": {},
    }
    for ours in our_variants:
        t = _median_e2e(rows.get(ours))
        if t is None:
            continue
        res["speedup"][ours] = {
            "vs_best_ray": ray_times[best] / t if best else None,
            "vs_ray_pool": ray_times[ray_pool] / t if ray_pool in ray_times else None,
        }
    return res


# ----------------------------------------------------------------------------- text


def _ms(stat: dict[str, float] | None) -> str:
    if not stat:
        return "n/a"
    return f"{stat['median'] * 1e3:.1f}/{stat['min'] * 1e3:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_workload(workload: str, description: str, summary: dict[str, Any],
                    unavailable: dict[str, str], skipped: dict[str, str],
                    order: Sequence[str], is_sync: bool, fetch_path: str) -> str:
    """One workload's table: variant x phase (median/min ms), GB/s, metadata, ratios."""
    rows = summary["variants"]
    first = "cold e2e" if is_sync else "first e2e"
    head = (f"{'variant':<17}{'put':>15}{'fetch':>15}{'e2e':>15}{'release':>15}"
            f"{first:>11}{'GB/s':>7}{'meta B':>9}  ok")
    sub = (f"{'':<17}{'med/min ms':>15}{'med/min ms':>15}{'med/min ms':>15}{'med/min ms':>15}"
           f"{'ms':>11}{'(e2e)':>7}{'':>9}")
    reps = "warm iterations" if is_sync else "repetitions"
    lines = [f"== {workload}: {description}  [fetch path: {fetch_path}; medians/minima over "
             f"measured {reps}] ==", head, sub]
    for v in order:
        if v in unavailable:
            lines.append(f"{v:<17}not available: {unavailable[v]}")
            continue
        if v in skipped:
            lines.append(f"{v:<17}skipped: {skipped[v]}")
            continue
        r = rows.get(v)
        if r is None:
            continue
        if r["errors"] and not r["n_measured"]:
            lines.append(f"{v:<17}ERROR: {r['errors'][0].splitlines()[0][:100]}")
            continue
        p = r["phases"]
        ok = "yes" if r["checksums_ok"] else "NO"
        if r["into_targets"] is False:
            ok += " (not into targets)"
        first_ms = r["first_e2e_s"] * 1e3 if r["first_e2e_s"] is not None else None
        lines.append(f"{v:<17}{_ms(p['put_s']):>15}{_ms(p['fetch_s']):>15}{_ms(p['e2e_s']):>15}"
                     f"{_ms(p['release_s']):>15}{_num(first_ms, '.1f'):>11}"
                     f"{_num(r['gbps'], '.2f'):>7}{_num(r['meta_bytes'], ','):>9}  {ok}")
    lines.append(format_ratios(summary["ratios"], unavailable))
    return "\n".join(lines)


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"x{ratio:.2f}"


def format_ratios(ratios: dict[str, Any], unavailable: dict[str, str]) -> str:
    best = ratios["best_ray"]
    lines = [f"  speedup = ray e2e median / our e2e median (>1 means ours is faster); "
             f"best Ray variant: {best or 'n/a'}"
             + (f" ({ratios['best_ray_e2e_s'] * 1e3:.1f} ms)" if best else "")]
    for ours, unavailable_reason in (("nixl_pool", unavailable.get("nixl_pool")),
                                     ("nixl_pool_target", unavailable.get("nixl_pool_target"))):
        sp = ratios["speedup"].get(ours)
        if sp is None:
            why = f"not available: {unavailable_reason}" if unavailable_reason else "no data"
            lines.append(f"  {ours:<17}n/a ({why})")
            continue
        lines.append(f"  {ours:<17}{_x(sp['vs_best_ray'])} vs best Ray ({best}), "
                     f"{_x(sp['vs_ray_pool'])} vs Ray's pool (nixl_pool_ray)")
    return "\n".join(lines)


def format_idle(idle: dict[str, dict[str, Any]], window_s: float) -> str:
    lines = [f"== idle CPU of each actor over {window_s:.1f} s after its transfers "
             "(cores; 1.0 = one core busy) ==",
             f"{'variant':<17}{'sender':>8}{'receiver':>10}{'threads S/R':>13}"]
    for v, d in idle.items():
        s, r = d.get("sender"), d.get("receiver")
        lines.append(f"{v:<17}{_num(s and s['cores'], '.2f'):>8}{_num(r and r['cores'], '.2f'):>10}"
                     f"{(s or {}).get('threads', '?')!s:>8}/{(r or {}).get('threads', '?')!s}")
    return "\n".join(lines)


def format_env(env: dict[str, Any]) -> str:
    v = env["versions"]
    ucx = env.get("ucx", {})
    nixl = v.get("nixl") or v.get("nixl-cu13") or v.get("nixl-cu12")
    tls = (env.get("ucx_env") or {}).get("UCX_TLS", "(unset)")
    lines = [
        f"machine: {env['cpu_model']}, {env['cores']} cores ({env['cores_usable']} usable), "
        f"{env['mem_total_gib']} GiB RAM, Linux {env['kernel']}",
        f"software: python {env['python']}, ray {v.get('ray')}, torch {v.get('torch')}, "
        f"nixl {nixl}, numpy {v.get('numpy')}",
        f"UCX {ucx.get('ucx_version', '?')}: UCX_TLS={tls}"
        f"; NIXL READ uses {'; '.join(ucx.get('read_protocols') or []) or 'n/a'}"
        f"; control messages over {', '.join(ucx.get('am_transports') or []) or 'n/a'}",
        f"load average at start {env['loadavg_start']}, at end {env.get('loadavg_end')}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- chart

_OUR_COLORS = {"nixl_pool": "#d62728", "nixl_pool_target": "#ff7f0e"}
_RAY_COLORS = {"objstore": "#9e9e9e", "objstore_zc": "#616161", "nixl": "#1f77b4",
               "nixl_pool_ray": "#17becf", "nixl_target": "#2ca02c"}


def write_plot(path: str, summary: dict[str, Any], order: Sequence[str],
               unavailable: dict[str, str], title: str) -> None:
    """Two panels: GB/s per workload and variant; our speedup vs Ray per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 9), height_ratios=[3, 2])
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
                   [f"{w}\n(best Ray: {summary[w]['ratios']['best_ray'] or 'n/a'})"
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

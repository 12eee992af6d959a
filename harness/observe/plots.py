"""The run's figures (plots/*.png, drawn by harness/observe/summary.py's `harness summary`): loss, learning rate,
throughput and MFU, utilisation, retrieval, plan against actual.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional


# ----------------------------------------------------------------------------------------------- plots


def series(records: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    """(xs, ys) of the records that have a value for `key` (and for `x`)."""
    pts = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _median(values: list) -> Optional[float]:
    return statistics.median(values) if values else None


def _figure(title: str, xlabel: str, ylabel: str, size=(7.5, 4.2)):
    """A figure on the Agg canvas (no pyplot, no display needed) with one titled, labelled, gridded axis."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=110, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_loss(run: dict, path: Path) -> bool:
    rec = run["records"]
    xs, ys = series(rec, "loss")
    if not xs:
        return False
    fig, ax = _figure(f"Loss — {run['name']}", "optimizer step", "loss (per token / per query)")
    ax.plot(xs, ys, color="C0", lw=2, label="train loss")
    for key, color in (("loss_gen", "C2"), ("loss_emb", "C3")):
        kx, ky = series(rec, key)
        if kx:
            ax.plot(kx, ky, color=color, lw=1.2, ls="--", label=key)
    ex, ey = series(rec, "eval_loss")
    if ex:
        ax.plot(ex, ey, "o", color="C1", ms=7, label="eval loss")
        ax.annotate(f"{ey[-1]:.3f}", (ex[-1], ey[-1]), textcoords="offset points", xytext=(-10, 8), color="C1")
    ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-10, -14), color="C0")
    ax.legend()
    fig.savefig(path)
    return True


def plot_lr(run: dict, path: Path) -> bool:
    xs, ys = series(run["records"], "lr")
    if not xs:
        return False
    fig, ax = _figure(f"Learning rate — {run['name']}", "optimizer step", "learning rate")
    ax.plot(xs, ys, color="C4", lw=2)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.savefig(path)
    return True


def plot_throughput(run: dict, path: Path) -> bool:
    rec = run["records"]
    xs, ys = series(rec, "tokens_per_s")
    if not xs:
        return False
    fig, ax = _figure(f"Throughput — {run['name']}", "optimizer step", "tokens/s (non-padding, all processes)")
    ax.plot(xs, ys, "-o", color="C0", ms=3, label="tokens/s")
    med = _median(ys[1:] or ys)
    ax.axhline(med, color="C0", ls=":", lw=1, label=f"median {med:,.0f}")
    ax.set_ylim(bottom=0)
    mx, my = series(rec, "mfu")
    handles, labels = ax.get_legend_handles_labels()
    if mx:
        ax2 = ax.twinx()
        ax2.plot(mx, [100 * v for v in my], "-s", color="C3", ms=3, label="MFU")
        ax2.set_ylabel("MFU (%)", color="C3")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    else:
        ax.text(0.99, 0.03, "MFU: n/a (peak FLOP/s unknown, e.g. CPU)", transform=ax.transAxes, ha="right",
                fontsize=8, color="gray")
    ax.legend(handles, labels, loc="lower left")
    fig.savefig(path)
    return True


def plot_utilisation(run: dict, path: Path) -> bool:
    rec = run["records"]
    have = {k: series(rec, k) for k in ("gpu_util", "cpu_util", "gpu_mem_gb", "rss_gb")}
    if not any(v[0] for v in have.values()):
        return False
    fig, ax = _figure(f"Utilisation — {run['name']}", "optimizer step", "utilisation (%)")
    for key, color, label in (("gpu_util", "C2", "GPU util (mean over GPUs)"), ("cpu_util", "C7", "CPU util (machine)")):
        if have[key][0]:
            ax.plot(*have[key], "-o", color=color, ms=3, label=label)
    ax.set_ylim(0, 105)
    ax2 = ax.twinx()
    for key, color, label in (("gpu_mem_gb", "C3", "GPU memory used (fullest GPU)"), ("rss_gb", "C1", "process RSS")):
        if have[key][0]:
            ax2.plot(*have[key], "--", color=color, label=f"{label}, GB")
    ax2.set_ylabel("memory (GB)")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower left", fontsize=8)
    fig.savefig(path)
    return True


def plot_retrieval(run: dict, path: Path) -> bool:
    rec = run["records"]
    rx, ry = series(rec, "eval_recall_at_1")
    mx, my = series(rec, "eval_mrr")
    if not rx and not mx:
        return False
    fig, ax = _figure(f"Held-out retrieval — {run['name']}", "optimizer step", "score (0-1)")
    if rx:
        ax.plot(rx, ry, "-o", color="C0", label="recall@1")
    if mx:
        ax.plot(mx, my, "-s", color="C1", label="MRR")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.savefig(path)
    return True


def plan_figures(report: Optional[dict]) -> Optional[dict]:
    """Planned and actual training time from report["plan"] (or "estimate"; written by the planner: estimated_s at
    least), or
    None without a usable plan: {"estimated_s", "actual_s", "planned_steps", "steps", "error_pct"}."""
    plan = (report or {}).get("plan") or (report or {}).get("estimate")
    if not isinstance(plan, dict):
        return None
    est = next((plan[k] for k in ("estimated_s", "estimate_s", "estimated_train_s") if plan.get(k) is not None), None)
    if est is None:
        return None
    actual = plan.get("actual_s", report.get("train_time_s"))
    return {"estimated_s": float(est), "actual_s": actual,
            "planned_steps": plan.get("planned_steps", report.get("planned_steps")), "steps": report.get("steps"),
            "error_pct": 100 * (actual - est) / est if actual is not None and est else None}


def plot_plan(run: dict, path: Path) -> bool:
    pf = plan_figures(run["report"])
    if pf is None:
        return False
    xs, ys = series(run["records"], "elapsed_s")
    fig, ax = _figure(f"Plan vs actual — {run['name']}", "optimizer step", "training time (minutes)")
    steps = pf["planned_steps"] or (xs[-1] if xs else 1)
    ax.plot([0, steps], [0, pf["estimated_s"] / 60], "--", color="C7", lw=2,
            label=f"plan: {pf['estimated_s'] / 60:.1f} min for {steps} steps")
    if xs:
        ax.plot([0] + xs, [0] + [y / 60 for y in ys], "-o", color="C0", ms=3, label="actual (logged steps)")
    proj = [(r["step"], (r["elapsed_s"] + r["eta_s"]) / 60) for r in run["records"]
            if r.get("elapsed_s") is not None and r.get("eta_s") is not None]
    if proj:
        ax.plot(*zip(*proj), ":", color="C1", lw=1.5, label="projected total at that step (elapsed + ETA)")
    if pf["actual_s"] is not None:
        err = f" ({pf['error_pct']:+.0f}% vs plan)" if pf["error_pct"] is not None else ""
        ax.plot([pf["steps"] or steps], [pf["actual_s"] / 60], "*", color="C3", ms=14,
                label=f"actual: {pf['actual_s'] / 60:.1f} min{err}")
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path)
    return True


PLOTS = {"loss.png": plot_loss, "lr.png": plot_lr, "throughput.png": plot_throughput,
         "utilisation.png": plot_utilisation, "retrieval.png": plot_retrieval, "plan.png": plot_plan}

"""Run summaries and comparisons, from a run folder's metrics.jsonl and report.json (nothing else is needed).

At the end of every run the main process prints a short table and writes <output_dir>/summary.md with PNG plots in
<output_dir>/plots/ (only those the run has data for):
  loss.png          training loss per step (loss_gen / loss_emb in unified mode) and the evaluation loss points
  lr.png            learning rate per step
  throughput.png    tokens/s per logged interval, and MFU (%) where the GPU's peak is known
  utilisation.png   GPU / CPU utilisation (%) and memory (GB) per logged interval
  retrieval.png     held-out recall@1 and MRR where evaluated
  plan.png          planned against actual training time, when report.json has a "plan" section

    harness summary RUN_DIR                       # (re)write RUN_DIR/summary.md and RUN_DIR/plots/
    harness compare RUN_DIR RUN_DIR [...] [--out compare.png]
        side-by-side table of the runs' key figures (throughput, MFU, memory, losses, cost, wall time, steps,
        profile, ZeRO stage, world size) and their losses overlaid per step and per hour of training, written to
        --out (default: compare.png in the runs' common parent folder); --md PATH also writes the table as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from harness.errors import HarnessError, one_line
from harness.files import disk_full
from harness.observe.plots import PLOTS, _median, plan_figures, series
from harness.observe.monitor import describe
from harness.observe.cost import format_cost


# ----------------------------------------------------------------------------------------------- reading a run


def load_run(run_dir: str | Path) -> dict:
    """{"dir", "name", "records", "report"}: the metrics.jsonl records (in order) and report.json (None when the
    run has not finished). HarnessError when the folder has neither."""
    d = Path(run_dir)
    mpath, rpath = d / "metrics.jsonl", d / "report.json"
    if not mpath.is_file() and not rpath.is_file():
        raise HarnessError(f"{d}: not a run folder (no metrics.jsonl or report.json)")
    records = []
    lines = mpath.read_text(encoding="utf-8").splitlines() if mpath.is_file() else []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n < len(lines):  # a cut last line is a run still writing; anything else is damage
                    raise HarnessError(f"{mpath}:{n}: invalid JSON ({e.msg})") from None
    report = json.loads(rpath.read_text(encoding="utf-8")) if rpath.is_file() else None
    return {"dir": d, "name": d.resolve().name, "records": records, "report": report}


def key_figures(run: dict) -> dict:
    """The figures a person compares runs by, label -> value (None where the run has no such figure). Throughput
    and MFU are medians over the logged intervals after the first one (it holds compilation and warm-up)."""
    rec, rep = run["records"], run["report"] or {}
    train = [r for r in rec if "loss" in r]
    steady = train[1:] or train
    util = (rep.get("utilisation") or {}).get("metrics") or {}
    cost = rep.get("cost") or {}
    evals = rep.get("eval") or {}
    last_eval = next((r for r in reversed(rec) if r.get("eval_loss") is not None), {})
    last = train[-1] if train else {}
    mfu = _median([r["mfu"] for r in steady if r.get("mfu") is not None])
    return {
        "profile": rep.get("profile"),
        "zero_stage": rep.get("zero_stage"),
        "world_size": rep.get("world_size"),
        "precision": rep.get("precision"),
        "steps": f"{rep.get('steps', last.get('step'))}/{rep.get('planned_steps', '?')}" if rep
        else last.get("step"),
        "wall_time_s": rep.get("wall_time_s"),
        "train_time_s": rep.get("train_time_s", last.get("elapsed_s")),
        "tokens_per_s": _median([r["tokens_per_s"] for r in steady if r.get("tokens_per_s") is not None]),
        "tokens_per_s_overall": rep.get("tokens_per_s"),
        "mfu_pct": 100 * mfu if mfu is not None else None,
        "peak_mem_gb": max((r["mem_gb"] for r in rec if r.get("mem_gb") is not None), default=None),
        "first_loss": rep.get("first_loss", train[0]["loss"] if train else None),
        "final_loss": rep.get("final_loss", last.get("loss")),
        "final_loss_gen": rep.get("final_loss_gen", last.get("loss_gen")),
        "final_loss_emb": rep.get("final_loss_emb", last.get("loss_emb")),
        "eval_loss": evals.get("eval_loss", last_eval.get("eval_loss")),
        "eval_recall_at_1": evals.get("eval_recall_at_1"),
        "eval_reward_accuracy": last_eval.get("eval_rewards/accuracies"),  # loss.mode=preference
        "eval_reward_margin": last_eval.get("eval_rewards/margins"),
        "gpu_util_mean_pct": (util.get("gpu_util") or {}).get("mean"),
        "gpu_util_p10_pct": (util.get("gpu_util") or {}).get("p10"),
        "cpu_util_mean_pct": (util.get("cpu_util") or {}).get("mean"),
        "cost": cost.get("so_far", last.get("cost")),
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.4f}" if abs(v) < 1 else f"{v:.3f}"


LABELS = {
    "profile": "profile", "zero_stage": "ZeRO stage", "world_size": "processes", "precision": "precision",
    "steps": "steps (done/planned)", "wall_time_s": "wall time (s)", "train_time_s": "training time (s)",
    "tokens_per_s": "tokens/s (median)", "tokens_per_s_overall": "tokens/s (whole run)", "mfu_pct": "MFU (%)",
    "peak_mem_gb": "peak memory (GB)", "first_loss": "first loss", "final_loss": "final loss",
    "final_loss_gen": "final loss_gen", "final_loss_emb": "final loss_emb", "eval_loss": "eval loss",
    "eval_recall_at_1": "eval recall@1", "eval_reward_accuracy": "eval reward accuracy",
    "eval_reward_margin": "eval reward margin", "gpu_util_mean_pct": "GPU util mean (%)",
    "gpu_util_p10_pct": "GPU util p10 (%)", "cpu_util_mean_pct": "CPU util mean (%)", "cost": "cost",
}


ALWAYS = ("profile", "zero_stage", "world_size")  # rows kept even when empty: '-' is an answer there


def table(columns: dict[str, dict], drop_empty: bool = True) -> str:
    """A markdown table: one row per figure, one column per run (columns: run name -> key_figures)."""
    names = list(columns)
    rows = []
    for key, label in LABELS.items():
        vals = [columns[n].get(key) for n in names]
        if drop_empty and all(v is None for v in vals) and key not in ALWAYS:
            continue
        rows.append([label] + [_fmt(v) for v in vals])
    head = ["figure"] + names
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


# ----------------------------------------------------------------------------------------------- summary, compare


def write_summary(run_dir: str | Path) -> tuple[str, list[Path]]:
    """Writes run_dir/summary.md and run_dir/plots/*.png; returns (the figures table, the plots written)."""
    run = load_run(run_dir)
    plots_dir = run["dir"] / "plots"
    plots_dir.mkdir(exist_ok=True)
    written = [plots_dir / name for name, fn in PLOTS.items() if _whole(plots_dir / name, lambda tmp: fn(run, tmp))]
    figs = key_figures(run)
    tab = table({run["name"]: figs})
    rep = run["report"] or {}
    lines = [f"# Run summary: {run['name']}", ""]
    if not rep:
        lines += ["No report.json: the run has not finished (figures from metrics.jsonl so far).", ""]
    else:
        dist = {"NO": "single process"}.get(rep.get("distributed_type"), rep.get("distributed_type"))
        sp = rep.get("sequence_parallel") or 1
        ranks = f" ({rep.get('data_parallel_size')} data-parallel x sequence parallel {sp})" if sp > 1 else ""
        lines += [f"{rep.get('world_size')} process(es){ranks}, {dist}, ZeRO stage "
                  f"{rep.get('zero_stage')}, precision {rep.get('precision')}, loss mode {rep.get('loss_mode')}, "
                  f"{_fmt(rep.get('parameters'))} parameters; stopped by: {rep.get('stopped_by') or 'end of plan'}.",
                  ""]
    lines += [tab, ""]
    util = rep.get("utilisation")
    if util and util.get("metrics"):
        lines += [f"Utilisation ({util['samples']} samples every {util['interval_s']} s"
                  + (f", GPUs: {', '.join(util['gpus'])}" if util.get("gpus") else ", CPU") + f"): {describe(util)}.",
                  ""]
    cost = rep.get("cost")
    if cost:
        lines += [f"Cost: {format_cost(cost['so_far'])} at {format_cost(cost['rate_per_hour'])} per hour "
                  f"({cost['price_per_hour']} per {cost['price_unit']}).", ""]
    pf = plan_figures(rep)
    if pf is not None:
        err = f" ({pf['error_pct']:+.1f}%)" if pf["error_pct"] is not None else ""
        act = f"{pf['actual_s']:.0f} s" if pf["actual_s"] is not None else "-"
        lines += [f"Plan: estimated {pf['estimated_s']:.0f} s of training, actual {act}{err}.", ""]
    lines += [f"![{p.stem}](plots/{p.name})" for p in written]
    _whole(run["dir"] / "summary.md", lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return tab, written


def _whole(path: Path, write) -> bool:
    """`write(tmp)` to a temporary file renamed to `path` (when it returns true): `path` is whole or untouched. A
    failed write raises an OSError that names `path` (and removes the temporary file)."""
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")  # the same suffix: matplotlib's format
    try:
        done = write(tmp)
        if done:
            os.replace(tmp, path)
        return bool(done)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        tmp.unlink(missing_ok=True)


def finish_run(run_dir: str | Path, say=print, intact: str = "") -> None:
    """End of a training run (main process): print the figures and write summary.md and the plots. A failure here
    is reported as a warning (the model and report are already saved), but for a full disk: a one-line HarnessError
    naming the file, that says what is intact (`intact`: "final model ..., report ...")."""
    try:
        tab, written = write_summary(run_dir)
    except Exception as e:  # noqa: BLE001 - the summary must not turn a finished run into a failed one
        if isinstance(e, OSError) and disk_full(e, Path(run_dir)):
            raise HarnessError(f"disk full while writing {e.filename or Path(run_dir) / 'summary.md'} "
                               f"({one_line(e.__cause__ or e)}): the run is complete and nothing is lost ({intact}); "
                               f"free some space, then write the summary with: harness summary {run_dir}") from e
        say(f"[harness] warning: run summary not written ({type(e).__name__}: {e}); retry with harness summary "
            f"{run_dir}")
        return
    say(f"[harness] summary ({Path(run_dir) / 'summary.md'}, {len(written)} plots in {Path(run_dir) / 'plots'}):\n"
        + tab)


def default_compare_path(run_dirs: list[str | Path]) -> Path:
    """compare.png in the folder that holds the runs (their common parent), not wherever the user stands."""
    parents = [Path(d).resolve().parent for d in run_dirs]
    return Path(os.path.commonpath([str(p) for p in parents])) / "compare.png"


def compare(run_dirs: list[str | Path], out: str | Path = "compare.png") -> str:
    """The side-by-side table of the runs' key figures (returned), and their losses overlaid (per step, and per
    minute of training time) written to `out`."""
    runs = [load_run(d) for d in run_dirs]
    names = [r["name"] for r in runs]
    if len(set(names)) < len(names):  # same folder names in different places: use the paths
        names = [str(r["dir"]) for r in runs]
    tab = table({n: key_figures(r) for n, r in zip(names, runs)})

    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.6), dpi=110, layout="constrained")
    ax_step, ax_time = fig.subplots(1, 2, sharey=True)
    fig.suptitle("Loss of " + ", ".join(names))
    for i, (name, run) in enumerate(zip(names, runs)):
        rec, color = run["records"], f"C{i % 10}"
        xs, ys = series(rec, "loss")
        ax_step.plot(xs, ys, color=color, lw=1.8, label=name)
        tx, ty = series(rec, "loss", x="elapsed_s")
        ax_time.plot([t / 60 for t in tx], ty, color=color, lw=1.8, label=name)
        ex, ey = series(rec, "eval_loss")
        if ex:
            ax_step.plot(ex, ey, "o", color=color, ms=6, mfc="white", label=f"{name} eval")
    ax_step.set(title="per optimizer step", xlabel="optimizer step", ylabel="training loss")
    ax_time.set(title="per minute of training time", xlabel="training time (minutes)")
    for ax in (ax_step, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return tab


def main(argv: list[str] | None = None) -> int:
    """`harness summary RUN_DIR` / `harness compare RUN_DIR RUN_DIR ... [--out PNG] [--md PATH]`."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="(re)write RUN_DIR/summary.md and RUN_DIR/plots/")
    s.add_argument("run_dir")
    c = sub.add_parser("compare", help="side-by-side table of runs and their losses overlaid")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--out", default=None, help="overlaid loss plot (PNG); default: compare.png in the runs' common "
                   "parent folder (e.g. runs/compare.png)")
    c.add_argument("--md", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    try:
        if args.command == "summary":
            tab, written = write_summary(args.run_dir)
            print(tab)
            print(f"written {Path(args.run_dir) / 'summary.md'} and {len(written)} plots in "
                  f"{Path(args.run_dir) / 'plots'}")
        else:
            if len(args.run_dirs) < 2:
                raise HarnessError("compare needs at least two run folders")
            out = args.out or default_compare_path(args.run_dirs)
            tab = compare(args.run_dirs, out)
            print(tab)
            if args.md:
                Path(args.md).write_text(tab + f"\n\n![loss]({Path(out).resolve()})\n", encoding="utf-8")
            print(f"written {out}")
    except HarnessError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0

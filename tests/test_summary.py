"""Run summaries and comparisons (harness/observe/summary.py): key figures on fixed run folders, summary.md, the plots,
`harness summary` / `harness compare`, and one real run that writes its own summary.

    .venv/bin/python -m pytest tests/test_summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import cli
from harness.observe import summary
from harness_launch import FAST, run_train

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, name: str, loss_scale: float = 1.0, plan: bool = True, unified: bool = True) -> Path:
    """A finished run folder with fixed metrics: step-0 eval, 5 logged steps, retrieval, utilisation, cost."""
    d = root / name
    d.mkdir(parents=True)
    recs = [{"step": 0, "eval_loss": 7.5, "eval_recall_at_1": 0.1, "eval_mrr": 0.2}]
    for i, step in enumerate((10, 20, 30, 40, 50)):
        r = {"step": step, "loss": loss_scale * (5.0 - i), "lr": 1e-3 * (1 - i / 5), "tokens_per_s": [50, 100, 110,
             120, 130][i], "mfu": [0.1, 0.3, 0.35, 0.4, 0.45][i], "mem_gb": [10, 12, 12.5, 12, 11][i],
             "elapsed_s": 60.0 * (i + 1), "eta_s": 70.0 * (4 - i), "gpu_util": 80.0 + i, "gpu_mem_gb": 40.0, "cpu_util": 12.0, "rss_gb": 3.0,
             "cost": 0.1 * (i + 1)}
        if unified:
            r.update(loss_gen=loss_scale * (4.0 - i * 0.5), loss_emb=loss_scale * (1.0 - i * 0.1))
        recs.append(r)
    recs.append({"step": 50, "eval_loss": 1.25, "eval_recall_at_1": 0.8, "eval_mrr": 0.85})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    report = {"world_size": 8, "distributed_type": "DEEPSPEED", "zero_stage": 2, "precision": "bf16",
              "loss_mode": "unified", "parameters": 1_000_000, "profile": "balanced", "steps": 50,
              "planned_steps": 50, "stopped_by": None, "train_time_s": 300.0, "wall_time_s": 330.0,
              "tokens_per_s": 100.0, "first_loss": 5.0 * loss_scale, "final_loss": 1.0 * loss_scale,
              "final_loss_gen": 2.0 * loss_scale, "final_loss_emb": 0.6 * loss_scale,
              "eval": {"eval_loss": 1.25, "eval_recall_at_1": 0.8, "eval_mrr": 0.85},
              "utilisation": {"interval_s": 2.0, "samples": 150, "gpus": ["NVIDIA H100"] * 8, "source": "nvml+cpu",
                              "note": None, "metrics": {"gpu_util": {"mean": 82.0, "p10": 61.0, "max": 99.0, "n": 150},
                                                        "cpu_util": {"mean": 12.0, "p10": 8.0, "max": 20.0, "n": 150}}},
              "cost": {"so_far": 0.55, "projected": 0.55, "rate_per_hour": 6.0, "price_per_hour": 6.0,
                       "price_unit": "machine", "gpus": 8, "machines": 1}}
    if plan:
        report["plan"] = {"estimated_s": 240.0}
    (d / "report.json").write_text(json.dumps(report))
    return d


def test_key_figures_on_a_fixed_run(tmp_path):
    figs = summary.key_figures(summary.load_run(make_run(tmp_path, "a")))
    assert figs["tokens_per_s"] == 115.0  # median of the intervals after the first (100, 110, 120, 130)
    assert figs["mfu_pct"] == pytest.approx(37.5)  # median of 0.3, 0.35, 0.4, 0.45
    assert figs["peak_mem_gb"] == 12.5
    assert (figs["final_loss"], figs["final_loss_gen"], figs["final_loss_emb"]) == (1.0, 2.0, 0.6)
    assert figs["eval_loss"] == 1.25 and figs["eval_recall_at_1"] == 0.8
    assert figs["gpu_util_mean_pct"] == 82.0 and figs["gpu_util_p10_pct"] == 61.0 and figs["cost"] == 0.55
    assert figs["steps"] == "50/50" and figs["zero_stage"] == 2 and figs["world_size"] == 8
    pf = summary.plan_figures(summary.load_run(tmp_path / "a")["report"])
    assert pf["estimated_s"] == 240.0 and pf["actual_s"] == 300.0 and pf["error_pct"] == pytest.approx(25.0)


def test_summary_md_and_every_plot_are_written(tmp_path):
    run = make_run(tmp_path, "a")
    tab, written = summary.write_summary(run)
    assert sorted(p.name for p in written) == sorted(summary.PLOTS)  # all six: the run has data for each
    for p in written:
        data = p.read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, p  # a real, non-trivial image
    md = (run / "summary.md").read_text()
    assert "| final loss_emb " in md and "| 0.6000 " in md and "| MFU (%) " in md and "| 37.5 " in md
    assert "gpu_util mean 82% (p10 61%)" in md and "Cost: 0.5500 at 6.00 per hour" in md
    assert "Plan: estimated 240 s of training, actual 300 s (+25.0%)" in md
    assert "![loss](plots/loss.png)" in md and tab in md


def test_summary_without_plan_report_or_extras(tmp_path):
    run = make_run(tmp_path, "a", plan=False, unified=False)
    _, written = summary.write_summary(run)
    assert "plan.png" not in {p.name for p in written} and "Plan:" not in (run / "summary.md").read_text()
    (run / "report.json").unlink()  # a run still going: figures from metrics.jsonl
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 60, "lo')  # the line being written
    _, written = summary.write_summary(run)
    md = (run / "summary.md").read_text()
    assert "has not finished" in md and "| final loss " in md and "loss.png" in {p.name for p in written}
    assert cli.main(["summary", str(tmp_path / "nothing")]) == 1


def test_compare_table_and_overlay_through_the_cli(tmp_path, capsys):
    a, b = make_run(tmp_path, "zero2"), make_run(tmp_path, "zero3", loss_scale=1.5)
    out = tmp_path / "plots" / "cmp.png"
    assert cli.main(["compare", str(a), str(b), "--out", str(out), "--md", str(tmp_path / "cmp.md")]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("| figure"))
    assert "zero2" in header and "zero3" in header
    final = next(line for line in text.splitlines() if line.startswith("| final loss "))
    assert "| 1.000 " in final and "| 1.500 " in final  # side by side
    assert out.read_bytes()[:8] == PNG and "| tokens/s (median)" in (tmp_path / "cmp.md").read_text()
    assert cli.main(["compare", str(a)]) == 1  # one run: nothing to compare


@pytest.mark.slow
def test_real_run_writes_utilisation_cost_and_its_summary(tmp_path):
    out = tmp_path / "run"
    run_train([*FAST, f"train.output_dir={out}", "train.max_steps=4", "train.log_every=2",
               "train.micro_batch_size=2", "train.save_final=false",
               "train.monitor_interval_s=0.1", "train.price_per_hour=3.6", "train.price_unit=gpu", "train.summary=true"])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["cpu_util"] <= 100 and r["rss_gb"] > 0 for r in recs[1:])  # the first may precede a sample
    assert all(r["cost"] > 0 and r["cost_projected"] >= r["cost"] for r in recs)
    rep = json.loads((out / "report.json").read_text())
    assert rep["utilisation"]["samples"] >= 2 and rep["utilisation"]["metrics"]["cpu_util"]["n"] >= 2
    assert rep["cost"]["rate_per_hour"] == 3.6 and rep["cost"]["so_far"] == pytest.approx(
        3.6 * rep["wall_time_s"] / 3600, rel=0.05)
    assert (out / "summary.md").is_file()
    assert {"loss.png", "lr.png", "throughput.png", "utilisation.png"} <= {p.name for p in (out / "plots").iterdir()}


def test_compare_without_out_writes_beside_the_runs_not_into_the_current_folder(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    a, b = make_run(runs, "a"), make_run(runs, "b")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["compare", str(a), str(b)]) == 0
    assert (runs / "compare.png").read_bytes()[:8] == PNG
    assert list(elsewhere.iterdir()) == []
    assert f"written {runs / 'compare.png'}" in capsys.readouterr().out

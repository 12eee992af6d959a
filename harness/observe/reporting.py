"""What a run tells: the log line every `train.log_every` steps (`StepLog`) and report.json (`final_report`).

A log line turns the step sums of every process since the previous line (harness/state.py) into the loss (or both
losses in unified mode), throughput (evaluation and checkpoint time left out), MFU, padding, data wait, memory,
the time window and the cost, and sends it to metrics.jsonl, the trackers, the progress bar and the console.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from harness.errors import HarnessError, one_line
from harness.files import write_json
from harness.observe import cost, metrics, monitor, timing
from harness.state import LoopState, UnloggedSums
from harness.stopping import TIME_BUDGET
from harness.checkpoint.store import list_checkpoints
from harness.observe import modelcard, summary


class StepLog:
    """The periodic log line: `due(step)`, then `write(...)`; evaluation results of a step that is no log step are
    written on their own (`write_eval`)."""

    def __init__(self, job, logger: metrics.MetricsLogger, bar, budget: Optional[timing.BudgetTracker],
                 start_step: int):
        self.job, self.cfg, self.logger, self.bar, self.budget = job, job.cfg, logger, bar, budget
        self.start_step = start_step
        self.meter: Optional[metrics.Throughput] = None  # set when the loop's clock starts
        # the latest record written (the report's final losses): on resume, the last one kept from before
        self.last: dict = dict(logger.last_logged) if logger is not None else {}

    def due(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.job.total_steps

    def write_eval(self, step: int, results: dict) -> None:
        self.logger.log({"step": step, **results})

    def write(self, state: LoopState, unlogged: UnloggedSums, grad_norm, evaluation: dict) -> dict:
        job, meter = self.job, self.meter
        sums = unlogged.total(job.accelerator, reset=True)
        interval_s = meter.interval()
        tok_s = sums.tokens / interval_s
        # the mode's figures: its losses (rl: each reward function's figures and sampled completions too)
        record = {"step": state.step, "epoch": epoch_of(job, state), **job.objective.figures(sums)}
        state.first_loss = record["loss"] if state.first_loss is None else state.first_loss
        state.tokens += int(sums.tokens)
        done, total = state.step - self.start_step, job.total_steps
        record.update({
            "lr": job.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tok_s,
            "samples_per_s": sums.samples / interval_s,
            "mfu": metrics.mfu(sums.flops / interval_s, 1.0, job.record.peak_flops),
            "padding_share": 1 - sums.tokens / max(sums.positions, 1),
            "data_wait_share": sums.wait_s / interval_s,
            "mem_gb": metrics.memory_gb(),
            "tokens": state.tokens,
            "elapsed_s": state.elapsed_s + meter.elapsed(),
            "eta_s": metrics.eta_seconds(meter.elapsed(), done, total - self.start_step),
        })
        if self.budget is not None:  # the window: elapsed, remaining, ETA, on track
            record.update(self.budget.status(done, total - state.step, meter.elapsed()))
        facts = job.record
        record.update(facts.sampler.drain() if facts.sampler else {})  # utilisation since the previous log line
        record.update(job.compile.logged() if job.compile is not None else {})  # graphs and compile seconds so far
        run_cost = cost.of_run(self.cfg.train, job.world, state.elapsed_s + time.time() - facts.t_start,
                               record.get("eta_s"))
        record.update(cost.fields(run_cost), **evaluation)
        self.logger.log(record)
        self.last.update(record)
        self._show(record, tok_s, run_cost)
        return record

    def _show(self, record: dict, tok_s: float, run_cost) -> None:
        budget, bar = self.budget, self.bar
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tok_s:,.0f}",
                        **({"window": budget.short(record)} if budget else {}))
        parts = "".join(f" {k} {record[k]:.4f}" for k in ("loss_gen", "loss_emb", "reward", "reward_std",
                                                            "flat_group_share", "clip_fraction", "kl",
                                                            "completion_length", "gen_s_per_step",
                                                            "train_s_per_step") if k in record)
        line = (f"[harness] step {record['step']}/{self.job.total_steps} loss {record['loss']:.4f}{parts}"
                f" lr {record['lr']:.2e} grad_norm {record['grad_norm'] or 0:.3f} tokens/s {tok_s:,.0f}")
        line += monitor.progress_text(record) + cost.progress_text(run_cost)
        line += f" | {budget.describe(record)}" if budget else ""
        bar.write(line) if not bar.disable else self.job.say(line)


def epoch_of(job, state: LoopState) -> float:
    """Epochs of the primary stream done, fractional."""
    pos = state.streams[job.primary]
    return round(pos["epoch"] + pos["batches"] / job.schedule["micro_per_epoch"], 4)


def final_report(job, state: LoopState, log: StepLog, stopped_by: Optional[str], train_time_s: float,
                 sections: dict) -> dict:
    """report.json, section by section: the run's set-up, its progress, losses and evaluations, the batch, where the
    time went, utilisation and cost. `sections`: compile, eval, eval_at_start, final_dir, micro_batch_auto, best
    (train.early_stopping / keep_best: the best evaluation, best/)."""
    cfg, timings, last = job.cfg, job.timings, log.last
    setup = {"world_size": job.world, "sequence_parallel": cfg.train.sequence_parallel,
             "data_parallel_size": job.dp_world, "distributed_type": job.accelerator.distributed_type.value, **job.zero,
             "loss_mode": cfg.loss.mode, "parameters": job.record.parameters,
             "parameters_per_rank": list(job.record.held),
             "precision": job.precision, "weights": job.weights, "tf32": job.record.tf32,
             "profile": cfg.train.profile,
             "attention": getattr(job.accelerator.unwrap_model(job.model, keep_torch_compile=False).config,
                                  "_attn_implementation", None),  # the kernel in use (auto resolved)
             "compile": sections["compile"]}
    trained_s = state.elapsed_s + train_time_s
    progress = {"steps": state.step, "planned_steps": job.total_steps, "stopped_by": stopped_by,
                "resumed_from": str(job.resume_from) if job.resume_from else None,
                "resumed_layout": job.record.resize.as_dict() if job.record.resize else None,
                "resumed_changes": job.record.resume_changes or None,
                "epochs": epoch_of(job, state),
                "tokens": state.tokens, "train_time_s": trained_s, "wall_time_s": time.time() - job.record.t_start,
                "tokens_per_s": state.tokens / max(trained_s, 1e-9)}
    results = {"first_loss": state.first_loss, "final_loss": last.get("loss"), "final_loss_gen": last.get("loss_gen"),
               "final_loss_emb": last.get("loss_emb"), "eval_at_start": sections["eval_at_start"],
               "eval": sections["eval"], "best": sections.get("best"), "data": job.data.stats,
               "final_dir": sections["final_dir"],
               "hardware": job.record.env}
    batch = {"flop_dims": list(job.objective.flop_dims), "micro_batch_size": cfg.train.micro_batch_size,
             "grad_accum": job.accum, "global_batch_size": cfg.train.micro_batch_size * job.accum * job.dp_world, "micro_batch_auto": sections["micro_batch_auto"]}
    time_used = {"timings": timings.as_dict(),
                 "time_budget": log.budget.summary(timings.process_wall_s, stopped_by == TIME_BUDGET)
                 if log.budget else None,
                 "plan": timing.plan_vs_actual(job.out / "plan.json", timing.config_fingerprint(cfg),
                                               timings.process_wall_s),
                 "utilisation": job.record.sampler.stop() if job.record.sampler else None,
                 "cost": cost.of_run(cfg.train, job.world, state.elapsed_s + time.time() - job.record.t_start, 0.0)}
    return {**setup, **progress, **results, **batch, **time_used}


def write_run_end(job, report: dict, final_dir: Optional[Path], failed: Optional[str]) -> None:
    """The run's last files (main process): report.json, written atomically (it marks the run finished), the model
    card (final/README.md; a failure is a warning line) and summary.md with the plots (train.summary). A record the
    disk kept out at the end (`failed`: the final evaluation's, in metrics.jsonl or a tracker's file) or a report.json
    that cannot be written is a one-line HarnessError naming the file and what is intact: the run is not finished,
    and the same command resumes from its last checkpoint and writes the rest. A full disk at summary.md: one line
    too (the run is finished then)."""
    out = job.out
    saved, _ = list_checkpoints(out)
    intact = ([f"the final model {final_dir}"] if final_dir else []) + ([f"the checkpoint {saved[-1][1]}"] if saved
                                                                         else [])

    def not_finished(why: str) -> HarnessError:
        return HarnessError(f"{why}: nothing is lost: {' and '.join(intact) or 'nothing was written'} "
                            f"{'are' if len(intact) > 1 else 'is'} intact; free some space, then run the same command "
                            f"again to write the rest")

    if failed:
        raise not_finished(failed)
    try:
        write_json(out / "report.json", report)
    except OSError as e:
        raise not_finished(f"could not write {out / 'report.json'} ({one_line(e)})") from e
    if final_dir:
        modelcard.try_write_model_card(out, job.say, final_dir=final_dir)
    if job.cfg.train.summary:  # the figures table, summary.md, plots/*.png
        summary.finish_run(out, job.say, intact=", ".join(
            ([f"final model {final_dir}"] if final_dir else []) + [f"report {out / 'report.json'}"]
            + ([f"checkpoint {saved[-1][1]}"] if saved else [])))


def plan_line(plan: dict) -> str:
    """The plan against the run (report.json's plan): which way the estimate was off, in words."""
    err = plan["error_pct"]
    off = f"the estimate {abs(err):.1f}% {'over' if err > 0 else 'under'}" if round(err, 1) else "as estimated"
    return f"plan: estimated {plan['estimated_s']:.1f}s of training, actual {plan['actual_s']:.1f}s ({off})"


def loss_change(first: Optional[float], last: Optional[float]) -> str:
    """`loss A -> B` from the first logged training loss to the last; one figure when only one was logged (a run
    shorter than train.log_every logs its last step alone)."""
    nan = float("nan")
    if first is None or last is None or first == last:
        return f"loss {last if last is not None else first if first is not None else nan:.4f}"
    return f"loss {first:.4f} -> {last:.4f}"


def read_report(output_dir: str | Path) -> dict:
    """A run folder's report.json ({} where the run wrote none: an attempt that stopped early to continue later)."""
    path = Path(output_dir, "report.json")
    return json.loads(path.read_text()) if path.is_file() else {}

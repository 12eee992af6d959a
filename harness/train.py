"""The training entry point: config -> data -> model -> the loop -> final export and report.

Run it any of these ways; all run the same `main()`:

    python -m harness.train --config configs/default.yaml train.max_steps=20
    harness train configs/default.yaml train.max_steps=20
    accelerate launch --num_processes 8 harness/train.py --config configs/default.yaml
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 harness/train.py --config configs/default.yaml

Overrides are `section.key=value` (see harness/config/__init__.py for every key and the precedence).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # `accelerate launch harness/train.py` runs this file as a script: import the package, not its siblings.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # the launch, the config and its data entries before the heavy imports (config/preflight.py)
    from harness.config.preflight import early_check
    from harness.data.checks import check_data
    from harness.rundir.finished import finished_nothing_asked

    early_check(sys.argv[1:], (lambda cfg: check_data(cfg.data, cfg.rl.prompts, cfg.distill.prompts),),
                done=lambda cfg: finished_nothing_asked(cfg.to_dict()))

import argparse
import contextlib
import time
import warnings
from pathlib import Path
from typing import Optional

from harness import faults
from harness.auto_batch import memory_trial, run_auto_batch
from harness.build import Job, build_run, check_machine
from harness.checkpoint.export import export_final
from harness.checkpoint.store import Checkpointer
from harness.config import Config, describe, load_config, preflight, recipe_args
from harness.config.objects import agent_overrides, reward_overrides
from harness.data import loaders, streaming
from harness.distributed import collectives
from harness.encode import embedding_settings
from harness.errors import HarnessError, RunFailed
from harness.evaluation import Evaluator
from harness.observe import metrics, monitor, reporting
from harness.observe.profiling import StepProfiler
from harness.observe.timing import SETTLE_STEPS, BudgetTracker
from harness.rundir import finished
from harness.speed.buckets import warm_run
from harness.state import LoopState, UnloggedSums
from harness.config.best import DIRECTIONS, early_stopping_config
from harness.stopping import (EARLY_STOPPING, EARLY_WITHOUT_EXPORT, NONFINITE, TIME_BUDGET, WRITE_FAILED, BestMetric,
                              NonfiniteGuard, StopDecision, StoppedOutsideTheLoop, exit_now, finite, stop_handlers,
                              stop_outside_the_loop, watch_launcher)

# DeepSpeed still calls collectives that torch deprecated; the warning repeats every step and says nothing to users.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)


# ----------------------------------------------------------------------------------------------- the run


def run(cfg: Config, auto_batch: Optional[dict] = None) -> dict:
    """Train according to `cfg`. Returns the report (also written to <output_dir>/report.json), or
    {"steps", "stopped_early"} when this attempt stopped early with a checkpoint for a later one to continue.
    auto_batch: set by run_auto_batch (train.micro_batch_size=auto): a trial step on the longest batch comes first."""
    with contextlib.ExitStack() as opened:  # the one exit path: all the run opened is closed, however it ends
        # accelerator, data, model, optimizer, schedule, objective; and the loop state: a checkpoint's (its weights,
        # optimizer and RNG restored after prepare(): checkpoint/resume.py), or step 0's
        job, state = build_run(cfg, opened)
        side = SideWork(job, state, opened)  # log, evaluation, checkpoints, the stop decision
        if auto_batch is not None and not job.is_deepspeed:  # DeepSpeed: its first step is the trial
            memory_trial(job)
        warm_run(job, job.say)  # compiled embedding width buckets: every shape once, nothing kept
        side.start(fresh=job.resume_from is None)  # the step-0 evaluation; the training clock starts
        stopped_by = train_loop(job, state, side)
        return finish(job, state, side, stopped_by, auto_batch)


def train_loop(job: Job, state: LoopState, side: SideWork) -> Optional[str]:
    """Optimizer steps up to the last planned one; returns why the attempt stopped before it (None: it did not)."""
    streams = {n: loaders.micro_batches(job.accelerator, job.loaders[n], state.streams[n]) for n in job.streams}
    while state.step < side.stop.stop_at and not side.stop.patience_spent():  # (spent: a resume, lower patience)
        # ---- one optimizer step: the mode's micro-batches (`grad_accum` of each stream; rl: answers sampled to its
        # questions), whose trained-token count is needed before the first backward pass; then train_step
        faults.pause(state.step + 1)  # test hook: a kill -9 between two steps
        t_step = time.perf_counter()
        gen, emb = job.objective.step_batches(streams, state.step + 1, side.unlogged)
        faults.trace_rows(state.step + 1, job.accelerator.process_index, {"gen": gen, "emb": emb})  # test hook
        if faults.dropped(state.step + 1):  # test hook: the reference run that never trains on these batches
            state.step += 1
            continue
        grad_norm, skipped = train_step(job, state.step + 1, gen, emb, side.unlogged)
        state.step += 1
        nonfinite = side.nonfinite.must_stop(state.step, grad_norm, skipped, job.objective.check.stranded)
        side.step_done(state.step)

        # ---- evaluate every train.eval_every steps (the last step's evaluation is the final one, after the loop)
        evaluation = side.evaluator.run(state.step) if side.evaluator.due(state.step) else {}

        # ---- log every train.log_every steps and at the last (with this step's evaluation)
        if side.log.due(state.step):
            side.log.write(state, side.unlogged, grad_norm, evaluation)
        elif evaluation:
            side.log.write_eval(state.step, evaluation)

        # ---- stop? checkpoint? every process takes the same decisions (one all-reduce of the facts per step)
        flags = side.stop.agree(side.checkpointer.minutes_due(), time.perf_counter() - t_step,
                                side.checkpointer.cost_s, side.log.logger.failed is not None)
        stopped_by = side.stop.reason(flags, state.step, nonfinite)
        if stopped_by == NONFINITE:
            return stopped_by  # this state is not saved: finish() saves the last good one
        if side.checkpointer.due(state.step, forced=flags.save_due or stopped_by is not None):
            side.checkpointer.save(side.state_to_save(state))
        if stopped_by:
            return stopped_by
    return EARLY_STOPPING if side.stop.patience_spent() else None  # resumed from the early stop's checkpoint


def train_step(job: Job, step: int, gen_batches: list, emb_batches: list, unlogged: UnloggedSums):
    """Optimizer step `step`, the only code that changes gradients and weights: each micro-step's forward and
    backward passes under `accumulate` (accelerate defers the gradient reduction to the last), clipping (DeepSpeed
    clips inside its engine and reports the norm), the update and the schedule. A step whose gradient is not finite
    is not applied; under DeepSpeed the engine steps inside the last backward pass, so the objective's LossCheck
    catches a non-finite loss before it and runs no backward pass (or no last one) instead. Returns (gradient norm,
    whether the update was skipped)."""
    accelerator, objective, model, optimizer = job.accelerator, job.objective, job.model, job.optimizer
    objective.check.new_step(step)
    gen_batches = objective.shard(gen_batches)  # train.sequence_parallel: this process's positions of each row
    gen_scale = objective.gen_scale(gen_batches) if gen_batches[0] is not None else 0.0
    for micro, (gen, emb) in enumerate(zip(gen_batches, emb_batches)):
        objective.check.micro = micro
        with accelerator.accumulate(model):
            unlogged.add(objective.micro_step(gen, emb, gen_scale))
    t_opt = time.perf_counter()
    if objective.check.skipped:  # DeepSpeed, a non-finite loss: the engine did not step, nothing more to do
        job.timings.optimizer_s += time.perf_counter() - t_opt
        return float("nan"), True
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), job.cfg.optim.max_grad_norm or float("inf"))
    skipped = not finite(grad_norm) and not job.is_deepspeed  # DeepSpeed has applied it, or skipped it itself
    if not skipped:
        optimizer.step()
        skipped = accelerator.optimizer_step_was_skipped
        if not skipped:
            job.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    job.timings.optimizer_s += time.perf_counter() - t_opt
    return grad_norm, skipped


def finish(job: Job, state: LoopState, side: SideWork, stopped_by: Optional[str], auto_batch: Optional[dict]) -> dict:
    """After the loop: an early stop's message, or the last step's checkpoint, the final evaluation, the export and
    report.json."""
    side.close()
    train_time, timings = side.meter.elapsed(), job.timings
    timings.loop(side.meter.trained(), state.step - side.start_step)
    if stopped_by == NONFINITE:
        raise nonfinite_error(job, state, side)
    if stopped_by == WRITE_FAILED:  # the checkpoint of this step is written (a full disk: its save said so)
        why = collectives.on_main(job.accelerator, lambda: side.log.logger.failed)
        raise HarnessError(f"{why}: stopped at step {state.step} with checkpoint "
                           f"{side.checkpointer.folder(state.step)}; free some space, then "
                           f"continue with train.resume=auto")
    if stopped_by in EARLY_WITHOUT_EXPORT:  # this attempt ends early: the state is saved, nothing exported
        job.say(f"[harness] stopped ({stopped_by}) at step {state.step}/{job.total_steps} with checkpoint "
                f"{side.checkpointer.folder(state.step)}; continue with train.resume=auto")
        return {"steps": state.step, "stopped_early": stopped_by}
    if stopped_by == TIME_BUDGET:
        job.say(f"[harness] time budget of {job.cfg.train.time_budget_hours} h nearly used: stopping at step "
                f"{state.step}/{job.total_steps} with a checkpoint and the final export")
    if stopped_by == EARLY_STOPPING:
        job.say(f"[harness] early stopping at step {state.step}/{job.total_steps}: {side.best.describe()}")
    final_checkpoint(job, state, side)
    t_loop_end, eval_before_final = time.time(), timings.eval_s
    compiled = job.compile.report(train_time, state.step - side.start_step, job.say,
                                  job.objective.generation_graphs()) if job.compile else None
    final_eval, new = side.evaluator.final(state.step)  # the loop's evaluation of this step (an early stop), or new
    if final_eval and new:
        side.log.write_eval(state.step, final_eval)
    best_is_final = new and side.best is not None and side.best.step == state.step
    final_dir = export_model(job, "final") if job.cfg.train.save_final else None
    if final_dir:
        job.say(f"[harness] final model: {final_dir}")
    if best_is_final and job.cfg.train.keep_best:  # the time budget's stop step: its checkpoint is written
        job.say(f"[harness] best {side.best.metric} {side.best.value:.4f} at the last step: {export_model(job, 'best')}")
    side.log.logger.close()
    timings.export_s = time.time() - t_loop_end - (timings.eval_s - eval_before_final)
    timings.process_wall_s = time.time() - job.t_process
    report = reporting.final_report(job, state, side.log, stopped_by, train_time, {
        "compile": compiled, "eval": final_eval, "eval_at_start": side.eval_at_start,
        "final_dir": str(final_dir) if final_dir else None, "micro_batch_auto": auto_batch,
        "best": side.best.report(job.out / "best" if job.cfg.train.keep_best else None) if side.best else None})
    # report.json (the run is finished), the model card, summary.md; a full disk: one line saying what is intact
    failed = side.log.logger.failed
    collectives.on_main(job.accelerator, lambda: reporting.write_run_end(job, report, final_dir, failed))
    if report["plan"]:
        job.say(f"[harness] {reporting.plan_line(report['plan'])}")
    job.say(f"[harness] done: step {state.step}, {train_time:.1f}s this attempt, "
            f"{reporting.loss_change(state.first_loss, side.log.last.get('loss'))}; report {job.out / 'report.json'}")
    return report


def export_model(job: Job, name: str) -> Path:
    """<output_dir>/<name>/ (final/, best/): the model as it is now in HF format (LoRA: the adapter and merged/;
    embedding modes: a sentence-transformers model), harness.json, the tokenizer (a vision-language model: its
    processor) (collective)."""
    settings = embedding_settings(job.cfg.loss.mode, job.cfg.model, job.cfg.data,
                                  job.data.stats.get("embedding", {}).get("instructions"))
    return export_final(job.accelerator, job.model, job.tokenizer, job.out / name, extra={"harness.json": settings},
                        random_base=job.cfg.model.name_or_path is None or job.cfg.model.random_init,
                        processor=job.data.processor)


def final_checkpoint(job: Job, state: LoopState, side: SideWork) -> None:
    """The run's end is checkpointed (weights, optimizer, schedule, data position) unless this attempt just saved
    that step or resumed at it, so that a rerun with a larger train.max_steps continues from exactly where this run
    ended (train.save_final_checkpoint=false: not at all). A save that fails (a full disk) is a warning: the export
    goes on, and a longer rerun would continue from the last checkpoint before this step."""
    if not job.cfg.train.save_final_checkpoint or side.checkpointer.last_step == state.step or \
            state.step == side.start_step:
        return
    try:
        side.checkpointer.save(side.state_to_save(state))
    except HarnessError as e:
        job.say(f"[harness] warning: no checkpoint of the final step {state.step} ({e}); the export goes on")


def nonfinite_error(job: Job, state: LoopState, side: SideWork) -> HarnessError:
    """Too many non-finite steps. When their updates were skipped the weights are the last good ones and are
    checkpointed; a non-finite update DeepSpeed applied is not saved, and the message names the last checkpoint
    (if this run has one)."""
    guard = side.nonfinite
    if guard.applied:
        newest = side.checkpointer.newest()
        where = (f"resume from the last checkpoint ({newest}) with a lower optim.lr or check the data"
                 if newest else "no checkpoint was saved: start again with a lower optim.lr or check the data")
        return HarnessError(f"non-finite gradient at step {state.step} under DeepSpeed (already applied): {where}")
    path = side.checkpointer.write(side.state_to_save(state))
    if guard.stranded:
        return HarnessError(f"non-finite loss at step {state.step} after its first micro-step (DeepSpeed with "
                            f"train.grad_accum={job.accum}): stopped without applying it; the last good weights are in "
                            f"{path}; continue with train.resume=auto (this step's batches are skipped)")
    other = {"fp16": "train.precision=bf16 (or fp32)", "bf16": "train.precision=fp32",
             "fp8": "train.precision=bf16"}.get(job.precision)
    return HarnessError(f"non-finite gradients in {guard.in_a_row} steps in a row (train.max_nonfinite_skips="
                        f"{job.cfg.train.max_nonfinite_skips}): stopped; the last good weights are in {path}. Lower "
                        + (f"optim.lr, check the data, or use {other}" if other else "optim.lr or check the data"))


# ----------------------------------------------------------------------------------------------- the loop's helpers


class SideWork:
    """The loop's once-in-a-while work, each part deciding for itself when it is due: the log line (`log`), the
    evaluation (`evaluator`), checkpoints (`checkpointer`), the stop decision (`stop`, `nonfinite`), the best
    evaluation (`best`: train.early_stopping's patience, train.keep_best's checkpoint and best/); and the training
    clock (`meter`), which leaves the time of evaluations and checkpoints out of each log interval."""

    def __init__(self, job: Job, state: LoopState, opened: contextlib.ExitStack):
        accelerator, t = job.accelerator, job.cfg.train
        self.job, self.start_step = job, state.step
        if t.report_to:
            monitor.init_trackers(accelerator, job.cfg, job.resume_from)
        logger = metrics.MetricsLogger(accelerator, job.out, resume_step=state.step if job.resume_from else None,
                                       unwritten=state.unwritten)
        state.unwritten = []
        opened.callback(logger.close)
        self.bar = metrics.progress_bar(job.total_steps, state.step, t.progress_bar and accelerator.is_main_process)
        opened.callback(self.bar.close)
        budget = BudgetTracker(job.t_process, t.time_budget_hours) if t.time_budget_hours else None
        self.log = reporting.StepLog(job, logger, self.bar, budget, state.step)
        stop_at = t.stop_at_step if 0 < t.stop_at_step < job.total_steps else job.total_steps
        es = early_stopping_config(job.cfg)
        self.best = BestMetric(es.metric, DIRECTIONS[es.metric], es.patience, es.min_delta, state.best) \
            if t.early_stopping or t.keep_best else None
        self.stop = StopDecision(accelerator, stop_at, job.total_steps, budget.deadline if budget else None, self.best)
        opened.callback(self.stop.close)
        self.nonfinite = NonfiniteGuard(t.max_nonfinite_skips, job.is_deepspeed, job.say)
        self.evaluator = Evaluator(job, self._evaluated, logger.log_samples, self.best)
        self.checkpointer = Checkpointer(accelerator, job.out, t.save_every_steps, t.save_every_minutes,
                                         t.save_total_limit, job.say, self._saved, job.epoch_rows, self.best,
                                         (lambda: export_model(job, "best")) if t.keep_best else None, state.step)
        # this process's sums since the last log line; rank 0 carries what the resumed checkpoint had not logged
        self.profiler = StepProfiler(t.profile_steps, job.out, state.step, accelerator.is_main_process, job.say)
        opened.callback(self.profiler.close)
        self.unlogged = UnloggedSums(accelerator.device, state.unlogged if accelerator.is_main_process else None)
        self.eval_at_start: Optional[dict] = None

    @property
    def meter(self) -> Optional[metrics.Throughput]:
        """The training clock (the log line's): None until `start`."""
        return self.log.meter

    def start(self, fresh: bool) -> None:
        """A fresh run's step-0 evaluation (the baseline), then the training clock starts."""
        if fresh and self.job.cfg.train.eval_at_start and self.stop.signals.received is None:
            # a stop during it ends the run at once (train.main: StoppedOutsideTheLoop): nothing is trained to save
            self.stop.signals.restore()
            try:
                self.eval_at_start = self.evaluator.run(0) or None
            finally:
                self.stop.signals.install()
            if self.eval_at_start:
                self.log.write_eval(0, self.eval_at_start)
        self.log.meter = metrics.Throughput()
        self.job.timings.loop_started(self.job.t_process)
        if self.job.compile is not None:
            self.job.compile.loop_starts()

    def step_done(self, step: int) -> None:
        self.bar.update(1)
        done = step - self.start_step
        if done == 1 and self.job.compile is not None:
            self.job.compile.first_step_done(self.meter.elapsed(), self.job.objective.generation_graphs())
        if done == SETTLE_STEPS:
            self.job.timings.warmup_done_s = self.meter.trained()
        self.profiler.step_done(step)

    def state_to_save(self, state: LoopState) -> dict:
        """The loop state for a checkpoint, with every process's unlogged sums folded in (collective)."""
        state.unwritten = list(self.log.logger.unwritten)  # (the main process's; a full disk kept them out)
        state.best = self.best.state() if self.best is not None else {}
        state.data_files = streaming.mark_read(state.data_files, self.job.loaders)  # what a resume depends on
        return state.to_save(self.meter.elapsed(), self.unlogged.total(self.job.accelerator, reset=False))

    def _evaluated(self, seconds: float) -> None:
        self.job.timings.add("eval", seconds)
        if self.meter is not None:
            self.meter.exclude(seconds)

    def _saved(self, seconds: float) -> None:
        self.job.timings.add("save", seconds)
        self.meter.exclude(seconds)

    def close(self) -> None:
        self.bar.close()
        self.stop.close()


# ----------------------------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = recipe_args.train_parser()
    return recipe_args.resolve(p.parse_args(argv), p, required=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch_launcher()  # under a launcher: its death is a stop signal (checkpoint, exit), never an unsupervised run
    if args.help_config:
        print(describe())
        return 0
    try:
        with stop_handlers(stop_outside_the_loop):  # the loop's StopSignals take over while it runs
            return _main(args)
    except StoppedOutsideTheLoop as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"[harness] stopped by signal {e.signum} outside the training loop (set-up, export or a step's data "
                  f"still being read): nothing saved since the last checkpoint; run the same command to continue",
                  file=sys.stderr, flush=True)
        return 128 + e.signum


def _main(args: argparse.Namespace) -> int:
    try:
        preflight.refuse_fsdp()
        cfg = load_config(args.config, args.overrides)
        check_machine(cfg)  # all of the config is checked before the run folder is looked at
        if finished.nothing_to_do(cfg.train):  # a finished run stays finished, unless more steps are asked of it
            return 0
        run_auto_batch(cfg, run) if cfg.train.micro_batch_size == "auto" else run(cfg)
    except HarnessError as e:
        # every process stops with the same error (those of one process are agreed before they are raised): the
        # main process alone prints it, the others wait for the launcher to end them (config/preflight.py)
        return preflight.report(e)
    return 0


class _TrainModule(type(sys)):
    def __call__(self, config, overrides=(), *, reward_funcs=None, reward_weights=None, tools=None,
                 environment=None) -> dict:
        """The Python API, `import harness; harness.train(config, overrides, reward_funcs=[fn], environment=Class)`:
        the run `harness train` makes (main), with the functions and classes given in this process
        (config/objects.py); returns report.json."""
        overrides = [*map(str, overrides), *reward_overrides(reward_funcs, reward_weights),
                     *agent_overrides(tools, environment)]
        status = main(["--config", str(config), *overrides])
        if status:
            raise RunFailed(status)
        return reporting.read_report(load_config(config, overrides).train.output_dir)


sys.modules[__name__].__class__ = _TrainModule

if __name__ == "__main__":
    exit_now(main())  # without the interpreter's slow teardown: the launcher sees the exit at once

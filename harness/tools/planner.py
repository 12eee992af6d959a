"""Wall-clock planner: will a run fit its window, and if not, what to change so that it does.

    harness plan configs/default.yaml --hours 12                      # analyse, calibrate here, plan
    harness plan configs/default.yaml train.epochs=3 --hours 0.5 --margin-minutes 5
    harness plan RECIPE --hours 12 --from-report runs/earlier/report.json   # reuse a measured run, no calibration
    harness plan RECIPE --hours 12 --launcher "accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 8"

The plan is printed as numbered derivations and written to plan.json (default `<train.output_dir>/plan.json`, where
the training run finds it and records estimate against actual in report.json):

 1. data: samples and token lengths after data.max_len (truncation), rows after packing;
 2. schedule: micro-batches per epoch per process and optimizer steps, with the loop's own arithmetic
    (`schedule_steps` in harness/data/loaders.py, which the run uses);
 3. throughput: a calibration run of W + N optimizer steps of this very config through the real entry point (its
    own subprocess, on the hardware at hand), or a previous run's report.json: steady seconds per step, the extra
    time of the first W steps (compilation, warm caches), start-up, one evaluation, one checkpoint, the export
    (loss.mode=rl: 1 + 2 generation batches, the seconds generating and training apart, harness/tools/rl_plan.py);
 4. estimate = start-up + warm-up extra + steps x s/step + evaluations + checkpoints + export;
 5. window = hours - safety margin (default 30 minutes): fits or not;
 6. when it does not fit, adjustments, each re-estimated with the same arithmetic and with its reason: fewer
    epochs (or steps), a shorter data.max_len (truncating what the data says), packing (profile `balanced`),
    more gradient accumulation (fewer optimizer steps; the per-step optimizer cost was measured).

Changing data.max_len or packing changes the work, not the speed: the time per unit of model FLOPs (6N + attention,
harness.observe.metrics.flops_per_token) measured in the calibration is assumed to stay the same.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from harness.config import Config, load_config, recipe_args
from harness.errors import ConfigError, HarnessError
from harness.data.loaders import epoch_steps, schedule_steps
from harness.observe.timing import SETTLE_STEPS, config_fingerprint, fmt_s
from harness.tools.plan_arithmetic import (Calibration, count_evals, epoch_work, estimate, fits, largest_fitting,
                                           steady_rate)
from harness.tools.plan_data import analyse_data
from harness.tools.rl_plan import rl_rates
from harness.observe.cost import format_cost, plan_cost
from harness.files import write_json
from harness.rundir.finished import finished_run
from harness.data.samples import auto_max_len

MEASURE_STEPS = 50  # calibration steps that are timed (fewer: run-to-run noise of ±10% seen on a shared CPU)
SAFETY_MARGIN_MIN = 30.0


# ----------------------------------------------------------------------------------------------- measurement


def calibration_from_report(path: str | Path, iterations: int = 1) -> tuple[Calibration, dict]:
    """Costs from a finished run's report.json (its `timings` and metrics.jsonl beside it; loss.mode=rl: generation
    and training seconds from metrics.jsonl, generation batches every `iterations` (rl.iterations) steps)."""
    p = Path(path)
    try:
        rep = json.loads(p.read_text())
    except FileNotFoundError:
        raise HarnessError(f"--from-report: no such file: {p}") from None
    except json.JSONDecodeError as e:
        raise HarnessError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None
    t = rep.get("timings")
    if not isinstance(t, dict) or not rep.get("steps"):
        raise HarnessError(f"{p}: not a harness report with timings (field 'timings' missing): use a report.json "
                           f"written by this version of harness train")
    steady = t.get("steady_s_per_step") or rep["train_time_s"] / rep["steps"]
    cal = Calibration(
        s_per_step=steady,
        warmup_extra_s=t.get("warmup_extra_s", 0.0),
        startup_s=t["startup_s"],
        eval_s=t["eval_s"] / t["evals"] if t.get("evals") else 0.0,
        save_s=t["save_s"] / t["saves"] if t.get("saves") else 0.0,
        export_s=t.get("export_s", 0.0),
        optimizer_s_per_step=t.get("optimizer_s", 0.0) / max(1, rep["steps"]),
        world_size=rep.get("world_size", 1),
        source=str(p),
    )
    metrics = p.parent / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    logged = [r["step"] for r in records if "gen_s_per_step" in r]
    if logged:  # loss.mode=rl: after the warm-up steps (a logged step at a generation batch's end), else all
        settle = max((s for s in logged if s <= SETTLE_STEPS and s % iterations == 0 and s < max(logged)), default=0)
        cal.gen_s_per_batch, cal.rl_train_s_per_step, _ = rl_rates(records, settle, iterations)
        cal.steps_per_generation = iterations
    return cal, rep


def calibrate(config_path: Optional[str], overrides: list[str], cfg: Config, settle: int, steps: int,
              launcher: Optional[str], say: Callable[[str], None]) -> tuple[Calibration, dict]:
    """Run W + N steps of the config for real (the harness's own entry point, in a subprocess) with one
    checkpoint, the configured evaluations and the export, in a temporary folder; read back the costs."""
    with tempfile.TemporaryDirectory(prefix="harness-plan-") as tmp:
        total = settle + steps
        forced = [f"train.output_dir={tmp}/run", "train.resume=null", f"train.max_steps={total}",
                  f"train.log_every={math.gcd(settle, steps)}", "train.progress_bar=false", "train.report_to=[]",
                  f"train.save_every_steps={total}", "train.save_total_limit=1", "train.time_budget_hours=0",
                  "train.stop_at_step=0", "train.save_every_minutes=0",
                  f"train.eval_every={total if cfg.train.eval_every else 0}"]
        entry = shlex.split(launcher) + [str(Path(__file__).resolve().parents[1] / "train.py")] if launcher else \
            [sys.executable, "-m", "harness.train"]
        cmd = entry + (["--config", config_path] if config_path else []) + list(overrides) + forced
        say(f"calibration: {settle} + {steps} steps of this config: {' '.join(shlex.quote(c) for c in cmd)}")
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise HarnessError(f"calibration run failed (exit {proc.returncode}):\n{tail}")
        run = Path(tmp, "run")
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        cal, rep = calibration_from_report(run / "report.json")
        cal.s_per_step, cal.warmup_extra_s = steady_rate(records, settle)
        if cfg.loss.mode == "rl":  # generation and training seconds of the same steady steps
            cal.gen_s_per_batch, cal.rl_train_s_per_step, _ = rl_rates(records, settle, cfg.rl.iterations)
            cal.steps_per_generation = cfg.rl.iterations
        if launcher:  # the launcher's own start-up comes before the training process starts
            cal.startup_s += max(0.0, wall - rep["timings"]["process_wall_s"])
        cal.source = f"calibration run of {total} steps ({wall:.1f} s wall)"
        return cal, rep


# ----------------------------------------------------------------------------------------------- the plan


def make_plan(cfg: Config, data: dict, cal: Calibration, hours: float, margin_min: float,
              flop_dims: Optional[tuple[int, int, int]]) -> dict:
    """The estimate for `cfg`, whether it fits `hours` minus the margin, and adjustments when it does not.
    Pure given its inputs (tested on fixed ones)."""
    t = cfg.train
    world = max(1, cal.world_size // t.sequence_parallel)  # data-parallel ranks: what the schedule divides by
    primary = data[data["primary"]]
    mb = t.emb_micro_batch_size if data["primary"] == "embedding" else t.micro_batch_size  # pairs: micro_batch_size
    if data["primary"] == "rl":  # a micro-batch of questions (harness.rl.rollout.question_loader)
        mb = max(1, cfg.rl.questions_per_step // (world * t.grad_accum))
    sched = schedule_steps(primary["items"], mb, world, t.grad_accum, t.max_steps, t.epochs)
    has_eval = bool(cfg.data.eval_files or cfg.data.emb_eval_files) or cfg.loss.mode == "rl"  # rl: `rft test`
    window = hours * 3600 - margin_min * 60

    def run_estimate(steps: int, work_ratio: float = 1.0, opt_ratio: float = 1.0) -> dict:
        return estimate(steps, cal, count_evals(steps, t.eval_every, t.eval_at_start, has_eval), t.save_every_steps,
                        t.save_every_minutes, work_ratio, opt_ratio)

    base = run_estimate(sched["total_steps"])
    lines = []
    gen = data.get("generative")
    if gen:
        lines.append(f"data: {gen['samples']} generative samples, {gen['tokens']} tokens after data.max_len="
                     f"{gen['max_len']} (p50 {gen['p50_len']}, p95 {gen['p95_len']}, longest {gen['longest']}; "
                     f"{gen['truncated_samples']} samples truncated, {gen['truncated_tokens']} tokens cut)"
                     + (f"; packed into {gen['items']} rows of {gen['max_len']}" if gen["packing"] else ""))
    if "embedding" in data:
        lines.append(f"data: {data['embedding']['samples']} embedding queries (primary stream: it defines epochs)")
    if "rl" in data:
        r = cfg.rl
        lines.append(f"data: {data['rl']['questions']} train questions of rft.task={cfg.rft.task}; a generation batch "
                     f"every rl.iterations={r.iterations} step(s): rl.questions_per_step {r.questions_per_step} x "
                     f"rl.num_generations {r.num_generations} = {r.questions_per_step * r.num_generations} answers of "
                     f"up to rft.max_new_tokens {cfg.rft.max_new_tokens} tokens")
    if "distill" in data:
        lines.append(f"data: {data['distill']['prompts']} prompts of distill.prompts, answered during the run (up to "
                     f"distill.max_new_tokens {cfg.distill.max_new_tokens} tokens each)")
    pref = data.get("preference")
    if pref:
        lines.append(f"data: {pref['pairs']} preference pairs = {pref['sequences']} sequences (chosen and rejected "
                     f"in one forward pass), {pref['tokens']} tokens of both sides (mean pair length "
                     f"{pref['mean_pair_len']:.1f}, longest {pref['longest']}, {pref['truncated_pairs']} pairs "
                     f"truncated); micro-batch {t.micro_batch_size} pairs = {2 * t.micro_batch_size} rows")
    ranks = (f"{world} data-parallel process(es): {cal.world_size} / train.sequence_parallel "
             f"{t.sequence_parallel}" if t.sequence_parallel > 1 else f"{world} process(es)")
    lines.append(f"schedule: ceil(ceil({primary['items']} / micro-batch {mb}) / {ranks}) = "
                 f"{sched['micro_per_epoch']} micro-batches per epoch per process; / accumulation {t.grad_accum} = "
                 f"{sched['steps_per_epoch']} steps per epoch; "
                 + (f"train.max_steps = {t.max_steps} steps" if t.max_steps > 0 else
                    f"{t.epochs:g} epoch(s) -> {sched['total_steps']} optimizer steps"))
    lines.append(f"throughput ({cal.source}): {cal.s_per_step:.4f} s per step steady ({cal.optimizer_s_per_step:.4f} s "
                 f"of it in the optimizer), first {cal.steps_per_generation if cal.gen_s_per_batch else SETTLE_STEPS} "
                 f"steps +{cal.warmup_extra_s:.1f} s, start-up "
                 f"{cal.startup_s:.1f} s, evaluation {cal.eval_s:.1f} s, checkpoint {cal.save_s:.1f} s, export "
                 f"{cal.export_s:.1f} s")
    gen_part = ""
    if cal.gen_s_per_batch:  # loss.mode=rl: the step split into generation and training
        rest = cal.s_per_step - cal.gen_s_per_batch / cal.steps_per_generation - cal.rl_train_s_per_step
        lines.append(f"rl step: generation {cal.gen_s_per_batch:.4f} s per generation batch (every "
                     f"{cal.steps_per_generation} step(s)) + training passes {cal.rl_train_s_per_step:.4f} s + the "
                     f"rest (optimizer, logging) {rest:.4f} s per step")
        gen_part = f" + {base['generations']} generation batches x {cal.gen_s_per_batch:.4f} s"
    lines.append(f"estimate: start-up {base['startup_s']:.1f} + warm-up {base['warmup_extra_s']:.1f} + "
                 f"{base['steps']} steps x {base['s_per_step']:.4f} s{gen_part} = {base['train_s']:.1f} + {base['evals']} "
                 f"evaluations {base['eval_s']:.1f} + {base['checkpoints']} checkpoints {base['checkpoint_s']:.1f} + "
                 f"export {base['export_s']:.1f} = {base['total_s']:.1f} s ({fmt_s(base['total_s'])})")
    ok = fits(base["total_s"], window)
    lines.append(f"window: {hours:g} h - {margin_min:g} min margin = {window:.0f} s ({fmt_s(window)}): "
                 + (f"fits, {fmt_s(window - base['total_s'])} to spare" if ok else
                    f"does NOT fit: {fmt_s(base['total_s'] - window)} too long"))

    price = lambda est: plan_cost(est["total_s"] / 3600, cfg.train, n_gpus=cal.world_size)  # noqa: E731 - None without a price
    base["cost"] = price(base)
    if base["cost"] is not None:
        lines.append(f"cost: {base['total_s'] / 3600:.3f} h x {cfg.train.price_per_hour:g} per {cfg.train.price_unit} per "
                     f"hour" + (f" x {cal.world_size} GPUs" if cfg.train.price_unit == "gpu" else "")
                     + f" = {format_cost(base['cost'])}")
    adjustments = [] if ok else propose(cfg, data, sched, run_estimate, window, flop_dims, world)
    for i, a in enumerate(adjustments, 1):
        a["estimate"]["cost"] = price(a["estimate"])
        paid = f", cost {format_cost(a['estimate']['cost'])}" if a["estimate"]["cost"] is not None else ""
        lines.append(f"adjustment {chr(96 + i)}: {' '.join(f'{k}={v}' for k, v in a['overrides'].items())} -> "
                     f"{fmt_s(a['estimate']['total_s'])}{paid} ({'fits' if a['fits'] else 'still too long'}): "
                     f"{a['reason']}")
    return {"hours": hours, "margin_minutes": margin_min, "window_s": window, "world_size": cal.world_size,
            "schedule": sched, "calibration": asdict(cal), "estimate": base, "estimated_s": base["total_s"],
            "fits": ok, "adjustments": adjustments, "derivations": lines,
            "data": {k: {kk: vv for kk, vv in v.items() if kk != "full_lengths"} if isinstance(v, dict) else v
                     for k, v in data.items()}}


def propose(cfg: Config, data: dict, sched: dict, run_estimate, window: float,
            flop_dims: Optional[tuple[int, int, int]], world: int) -> list[dict]:
    """Adjustments that bring the run into the window, each re-estimated with `run_estimate` (the planned run's
    estimate is run_estimate of the schedule's steps), with its reason."""
    t, out = cfg.train, []
    base = run_estimate(sched["total_steps"])
    fixed = base["total_s"] - base["train_s"]

    def add(overrides: dict, est: dict, reason: str) -> None:
        out.append({"overrides": overrides, "estimate": est, "fits": fits(est["total_s"], window), "reason": reason})

    # a. fewer epochs (or steps): the same work per step, fewer steps
    if t.max_steps > 0:
        steps = largest_fitting(1, base["steps"], lambda s: run_estimate(s)["total_s"], window)
        if steps is not None:
            add({"train.max_steps": int(steps)}, run_estimate(int(steps)),
                f"at {base['s_per_step']:.4f} s per step the window holds {int(steps)} of {base['steps']} steps "
                f"after {fmt_s(fixed)} of start-up, evaluation, checkpoints and export")
    else:
        steps_of = lambda e: epoch_steps(sched["micro_per_epoch"], t.grad_accum, e)  # noqa: E731
        hundredths = largest_fitting(1, math.floor(100 * t.epochs), lambda h: run_estimate(steps_of(h / 100))["total_s"],
                                     window)  # epochs in hundredths
        if hundredths is not None:
            epochs = int(hundredths) / 100
            add({"train.epochs": epochs}, run_estimate(steps_of(epochs)),
                f"at {base['s_per_step']:.4f} s per step the window holds {epochs:g} of {t.epochs:g} epochs "
                f"({steps_of(epochs)} steps) after {fmt_s(fixed)} of start-up, evaluation, checkpoints and export")

    gen = data.get("generative")
    if gen and flop_dims and data["primary"] == "generative":
        mb = t.micro_batch_size
        now = epoch_work(gen["full_lengths"], gen["max_len"], gen["packing"], mb, t.seed, flop_dims)

        def variant(max_len: int, packing: bool) -> tuple[dict, dict]:
            """Estimate with other data settings: steps from the new item count, work per step from FLOPs."""
            w = epoch_work(gen["full_lengths"], max_len, packing, mb, t.seed, flop_dims)
            s = schedule_steps(w["items"], mb, world, t.grad_accum, t.max_steps, t.epochs)["total_steps"]
            per_item_now, per_item = now["flops"] / now["items"], w["flops"] / w["items"]
            return run_estimate(s, work_ratio=per_item / per_item_now), w

        # b. a shorter max_len: the longest samples are truncated

        total = sum(gen["full_lengths"])
        for pct in (95, 90, 75, 50):
            cand = auto_max_len(gen["full_lengths"], pct)
            if cand >= gen["max_len"]:
                continue
            est, w = variant(cand, gen["packing"])
            if fits(est["total_s"], window) or pct == 50:
                add({"data.max_len": cand}, est,
                    f"p{pct} of the sample lengths is {cand} tokens: {100 * (total - w['tokens']) / total:.1f}% of the "
                    f"training tokens would be cut; the work per epoch falls to {100 * w['flops'] / now['flops']:.0f}%")
                break
        # c. packing (what profile `balanced` turns on): no padding
        if not gen["packing"]:
            est, w = variant(gen["max_len"], True)
            add({"train.profile": "balanced", "data.packing": True}, est,
                f"padding is {100 * (1 - now['tokens'] / now['positions']):.0f}% of the processed positions; packing "
                f"(profile balanced) removes it: work per epoch {100 * w['flops'] / now['flops']:.0f}% of now (the "
                f"profile's compile and worker settings are not in this estimate: harness bench --profiles measures them)")

    # d. more accumulation: the same samples in fewer optimizer steps (the global batch doubles)
    if t.max_steps <= 0 and base["steps"] >= 2:
        accum = 2 * t.grad_accum
        steps = epoch_steps(sched["micro_per_epoch"], accum, t.epochs)
        est = run_estimate(steps, work_ratio=base["steps"] / steps)
        saved = base["total_s"] - est["total_s"]
        if saved > 0.02 * base["total_s"]:
            add({"train.grad_accum": accum}, est,
                f"each optimizer step costs {base['optimizer_s_per_step']:.4f} s (clip, update, zero_grad); "
                f"{steps} instead of {base['steps']} steps save {fmt_s(saved)} (the global batch doubles: "
                f"revisit optim.lr)")
    return out


# ----------------------------------------------------------------------------------------------- entry point


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="harness plan", description="Fit a run into a wall-clock window from measured "
                                "throughput; prints numbered derivations and writes plan.json.")
    recipe_args.add(p)
    p.add_argument("--hours", type=float, required=True, help="the window (e.g. the rental's remaining hours)")
    p.add_argument("--margin-minutes", type=float, default=SAFETY_MARGIN_MIN,
                   help=f"safety margin kept free at the end of the window (default {SAFETY_MARGIN_MIN:g})")
    p.add_argument("--from-report", help="take the throughput from this earlier run's report.json (no calibration)")
    p.add_argument("--launcher", help="launch the calibration like the real run, e.g. \"accelerate launch "
                                      "--config_file accelerate_configs/zero2.yaml --num_processes 8\"")
    p.add_argument("--settle-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=f"timed calibration steps (default {MEASURE_STEPS}; "
                   "loss.mode=rl: 2 x rl.iterations, two generation batches, after one)")
    p.add_argument("--out", help="plan.json path (default <train.output_dir>/plan.json)")
    return recipe_args.resolve(p.parse_intermixed_args(argv), p)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    rl = cfg.loss.mode == "rl"  # a step generates (every rl.iterations steps): a short calibration, in whole batches
    args.settle_steps = args.settle_steps or (cfg.rl.iterations if rl else SETTLE_STEPS)
    args.steps = args.steps if args.steps is not None else 2 * cfg.rl.iterations if rl else MEASURE_STEPS
    if args.hours <= 0 or args.margin_minutes < 0 or args.steps < 1:
        raise ConfigError("harness plan: --hours must be > 0, --margin-minutes >= 0 and --steps >= 1")
    say = lambda m: print(f"[plan] {m}", flush=True)  # noqa: E731
    if args.from_report:
        cal, rep = calibration_from_report(args.from_report, cfg.rl.iterations if rl else 1)
    else:  # first, while this process is idle and light (threads left by tokenization here slowed the child ~10%)
        if args.steps % args.settle_steps and args.settle_steps % args.steps:
            args.steps = -(-args.steps // args.settle_steps) * args.settle_steps  # both logged: multiples of the log interval
        cal, rep = calibrate(args.config, args.overrides, cfg, args.settle_steps, args.steps, args.launcher, say)
    data = analyse_data(cfg)
    dims = tuple(rep["flop_dims"]) if rep.get("flop_dims") else None
    if dims and rep.get("parameters"):  # both counts: memory holds them all, a token's compute the active ones (MoE)
        say(f"model: {rep['parameters']:,} parameters in all, {dims[0]:,} matmul weights active per token (FLOPs)")
    if cfg.train.micro_batch_size == "auto":  # what the measured run found
        from dataclasses import replace

        cfg = replace(cfg, train=replace(cfg.train, micro_batch_size=rep["micro_batch_size"], grad_accum=rep["grad_accum"]))
        say(f"micro_batch_size=auto: the calibration chose {rep['micro_batch_size']} x accumulation {rep['grad_accum']}")
    plan = make_plan(cfg, data, cal, args.hours, args.margin_minutes, dims)
    for i, line in enumerate(plan["derivations"], 1):
        print(f"{i:>2}. {line}")
    plan.update(config=args.config, overrides=args.overrides, fingerprint=config_fingerprint(cfg),
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    for a in plan["adjustments"]:  # a run with an adjustment applied is compared with that adjustment's estimate
        a["fingerprint"] = config_fingerprint(load_config(args.config, [*args.overrides, *(
            f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in a["overrides"].items())]))
    dest = Path(args.out) if args.out else Path(cfg.train.output_dir) / "plan.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not args.out and finished_run(cfg.train.output_dir) is not None:  # (a train there would have nothing to do)
        say(f"{cfg.train.output_dir} holds a finished run: plan.json is written beside its report")
    write_json(dest, plan)
    verdict = "fits" if plan["fits"] else "does not fit"
    fitting = [a for a in plan["adjustments"] if a["fits"]]
    print(f"[plan] {verdict} the window; plan written to {dest}"
          + (f"; e.g. harness train {args.config} {' '.join(args.overrides)} "
             + " ".join(f"{k}={v}" for k, v in fitting[0]["overrides"].items()) if fitting else ""))
    return 0

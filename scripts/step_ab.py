"""The harness's step against a raw PyTorch step in ONE process, interleaved step by step (issue 56).

    python scripts/step_ab.py [--threads 2] [--steps 60] [--config configs/default.yaml]

`harness bench` compares whole runs in separate processes, whose tokens/s move by +-8% between rounds on this 2-core
VM (docs/bench/step-56-cpu.txt). Here one process builds the run as `harness train` does (build.build_run, SideWork),
deep-copies its model into a raw loop (its own AdamW from harness.optim, the same schedule, clipping and token loss),
and alternates: one harness step (train_step and the loop's side work: step_done, the log line when due, the stop
decision's all-reduce), then one raw step on the SAME micro-batch. Both see the same load and the same batch shapes,
so the ratio of their median step times is the harness's own cost per step. The first 10 steps are left out.
Not a test: the figures go to docs/bench/ with the date, the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time

import torch


def main() -> None:
    from harness.build import build_run
    from harness.config import load_config
    from harness.data import loaders
    from harness.losses import token_loss_sum
    from harness.optim import build_optimizer, lr_lambda
    from harness.train import SideWork, train_step

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="step-ab-")
    total = a.steps + 10
    over = [f"train.output_dir={tmp}/run", f"train.max_steps={total}", "train.log_every=10", "train.grad_accum=1",
            "train.save_final=false", "train.save_every_steps=0", "data.eval_files=[]", "train.eval_at_start=false",
            "train.eval_every=0", "train.progress_bar=false", "train.report_to=[]", "data.packing=false",
            "train.compile=none"]
    cfg = load_config(a.config, over)
    with contextlib.ExitStack() as opened:
        job, state = build_run(cfg, opened)
        side = SideWork(job, state, opened)
        side.start(fresh=True)
        raw = copy.deepcopy(job.accelerator.unwrap_model(job.model))
        opt = build_optimizer(raw, cfg.optim)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.optim, total))
        clip = cfg.optim.max_grad_norm
        stream = loaders.micro_batches(job.accelerator, job.loaders["gen"], state.streams["gen"])
        ours, theirs = [], []
        for i in range(total):
            b = next(stream)
            t0 = time.perf_counter()
            grad_norm, _ = train_step(job, state.step + 1, [b], [None], side.unlogged)
            state.step += 1
            side.step_done(state.step)
            if side.log.due(state.step):
                side.log.write(state, side.unlogged, grad_norm, {})
            side.stop.agree(side.checkpointer.minutes_due(), time.perf_counter() - t0, side.checkpointer.cost_s, False)
            t1 = time.perf_counter()
            logits = raw(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            loss_sum, count = token_loss_sum(logits, b["labels"])
            (loss_sum / count.clamp(min=1)).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(raw.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i >= 10:
                ours.append(t1 - t0)
                theirs.append(t2 - t1)
        h, r = statistics.median(ours), statistics.median(theirs)
        print(f"[step_ab] {a.config}, {a.threads} threads, {len(ours)} steps, load {os.getloadavg()[0]:.1f}: "
              f"harness step {1000 * h:.1f} ms, raw {1000 * r:.1f} ms (medians): harness / raw {h / r:.3f}", flush=True)
    os._exit(0)  # the run's teardown (trackers, the lock) is not what is measured


if __name__ == "__main__":
    main()

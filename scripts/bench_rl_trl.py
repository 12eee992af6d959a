"""GRPO seconds per step, this project against TRL's GRPOTrainer, on the same model, task, prompts and verifier.

    python scripts/bench_rl_trl.py --json docs/bench/rl-vs-trl-cpu.json            # about 15 minutes on 2 cores
    python scripts/bench_rl_trl.py --skip-paged --rounds 1 --long 15 --short 5     # a quick look

The model is the RFT demo's warm-up model (make it first, docs/rft.md):

    harness rft sft-data configs/rft-tiny.yaml --out runs/rft-tiny/sft.jsonl
    harness train configs/rft-tiny-warmup.yaml

Both sides: the arithmetic task of configs/grpo-tiny.yaml (its train split, in the model's chat template), reward 1
for an answer the task's verifier accepts and 0 otherwise, 4 questions x 16 answers a step (one generation batch a
step, one micro-batch), 40 new tokens, temperature 1, loss `dapo`, beta 0, epsilon 0.2 / 0.28, lr 1e-4 with 2 warm-up
steps, fp32 on the CPU, OMP_NUM_THREADS=1 (`--threads`), no checkpoints. Seconds per step = (whole wall time of a `--long`-step run - whole wall time
of a `--short`-step run) / (long - short), each run its own process, so the start-up (imports, model load, our final
evaluation) cancels; beside it, `loop_s_per_step` from the long run alone: from the end of step `short` to the end
of the last step (ours: metrics.jsonl's elapsed_s; TRL: a callback's clock at each step's end), which a load on the
machine during the start-up does not move. Sides alternate within a round (a load on the machine hits both); the faster round of each
side is reported. TRL runs with transformers' generate and, once (about 5 s a step here: one round;
`--skip-paged` leaves it out), with its continuous-batching generation (`use_transformers_continuous_batching`, the
new name of `use_transformers_paged`). Each side's mean reward over its long run is printed beside its time.
`--compiled` adds our side with `rft.compile=true` (the engine's decode step compiled: off by default on a CPU, on
by default on CUDA) and with `rft.compile=true train.compile=regional` (the training pass's blocks compiled too: our
defaults on CUDA). A compiled side's round starts with an unmeasured `--short`-step run that fills a fresh inductor
cache, which its two measured runs then share: both start warm, so their start-ups cancel (compiling cold took 30-80 s
here and moved by 5-25 s from run to run: seen 0.15 s/step from the difference against 0.27 in the loop).
Not a test: the figures go to docs/rl.md with the date, the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/grpo-tiny.yaml"
QUESTIONS, GROUP, NEW_TOKENS, LR = 4, 16, 40, 1e-4


def ours(model: str, steps: int, out: Path, extra: tuple = (), cache: str | None = None) -> tuple[list, dict]:
    """harness train configs/grpo-tiny.yaml for `steps` steps: (the per-step rewards of metrics.jsonl, the seconds
    since the training started at each step's end: metrics' elapsed_s)."""
    cmd = [sys.executable, "-m", "harness.cli", "train", str(CONFIG), f"model.name_or_path={model}",
           f"train.output_dir={out}", f"train.max_steps={steps}", "train.eval_at_start=false", "train.log_every=1",
           "train.save_final=false", "train.save_final_checkpoint=false", "train.save_every_minutes=0",
           "train.save_every_steps=0", "train.progress_bar=false", "train.summary=false", "train.report_to=[]",
           f"rl.questions_per_step={QUESTIONS}", f"rl.num_generations={GROUP}", "rl.loss_type=dapo", "rl.beta=0",
           f"rft.max_new_tokens={NEW_TOKENS}", "rft.temperature=1.0", f"optim.lr={LR}", *extra]
    run(cmd, cache)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward" in r]
    return [r["reward"] for r in rows], {r["step"]: r["elapsed_s"] for r in rows}


def trl(model: str, steps: int, out: Path, paged: bool) -> tuple[list, dict]:
    cmd = [sys.executable, __file__, "--trl-worker", str(steps), "--model", model, "--worker-out", str(out)]
    run(cmd + (["--paged"] if paged else []))
    got = json.loads((out / "rewards.json").read_text())
    return got["rewards"], {int(k): v for k, v in got["elapsed"].items()}


THREADS: dict = {}  # OMP_NUM_THREADS for both sides (--threads)


def run(cmd: list, cache: str | None = None) -> None:
    """cmd in ROOT with the benchmark's environment; inductor's on-disk cache in `cache` (a compiled side's, filled
    by its warm-up run) or a fresh one (never the user's: a run must not find graphs an earlier run left)."""
    env = {**os.environ, **THREADS, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
           "ACCELERATE_USE_CPU": "1", "WANDB_DISABLED": "true"}
    with tempfile.TemporaryDirectory(prefix="bench-rl-inductor-") as fresh:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache or fresh
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")


def trl_worker(model: str, steps: int, out: Path, paged: bool) -> None:
    """TRL 1.16's GRPOTrainer on the task's train split (conversational prompts, the same chat template)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from harness.config import load_config
    from harness.rft.sampling import load_for_generation
    from harness.rft.tasks import build_task

    cfg = load_config(str(CONFIG), [])
    task = build_task(cfg.rft)
    questions = task.split("train")
    policy, tok = load_for_generation(model, __import__("torch").device("cpu"))
    data = Dataset.from_dict({"prompt": [task.messages(q) for q in questions],
                              "answer": [q.answer for q in questions], "qid": [q.qid for q in questions]})
    by_id = {q.qid: q for q in questions}

    def verifier(completions, qid, **_):
        return [1.0 if task.verify(c[0]["content"], by_id[i]) else 0.0 for c, i in zip(completions, qid)]

    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=QUESTIONS * GROUP,
                      num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=1.0, loss_type="dapo",
                      beta=0.0, epsilon=0.2, epsilon_high=0.28, scale_rewards="group", learning_rate=LR,
                      weight_decay=0.0, warmup_steps=2, lr_scheduler_type="constant_with_warmup", max_steps=steps,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
                      gradient_accumulation_steps=1, use_transformers_continuous_batching=paged,
                      disable_tqdm=True)
    elapsed = {}

    class Clock(TrainerCallback):  # the seconds since the training started at each step's end (as ours logs them)
        def on_train_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, *__, **___):
            elapsed[state.global_step] = time.perf_counter() - self.t0

    trainer = GRPOTrainer(model=policy.train(), reward_funcs=verifier, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    (out / "rewards.json").write_text(json.dumps({"rewards": rewards, "elapsed": elapsed}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/rft-tiny/warmup/final")
    p.add_argument("--long", type=int, default=45)
    p.add_argument("--short", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-paged", action="store_true", help="leave out TRL with continuous batching (~5 s/step)")
    p.add_argument("--compiled", action="store_true",
                   help="also our side with rft.compile=true, and with train.compile=regional too (our CUDA defaults)")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of both sides (0: torch default, one a core); 1 as docs/rl.md measured")
    p.add_argument("--json", default=None, help="write the rows and the summary here")
    p.add_argument("--trl-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--paged", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker is not None:
        return trl_worker(a.model, a.trl_worker, Path(a.worker_out), a.paged)
    if not (ROOT / a.model / "config.json").is_file() and not Path(a.model, "config.json").is_file():
        raise SystemExit(f"no model at {a.model}: make the warm-up model first (this script's docstring)")
    if a.threads:
        THREADS["OMP_NUM_THREADS"] = str(a.threads)
    sides = {"harness": lambda n, d, c: ours(a.model, n, d), "trl_generate": lambda n, d, c: trl(a.model, n, d, False)}
    if a.compiled:
        sides["harness_compiled"] = lambda n, d, c: ours(a.model, n, d, ("rft.compile=true",), c)
        sides["harness_compiled_train"] = lambda n, d, c: ours(a.model, n, d, ("rft.compile=true",
                                                                               "train.compile=regional"), c)
    paged = {"trl_paged": lambda n, d, c: trl(a.model, n, d, True)}
    rows, load_start = [], [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            todo = dict(sides, **(paged if rnd == 0 and not a.skip_paged else {}))
            for name, fn in todo.items():
                row, cache = {"side": name, "round": rnd}, None
                if name.startswith("harness_compiled"):  # the warm-up run: both measured runs start warm
                    cache = str(Path(tmp, f"{name}-{rnd}-inductor"))
                    t0 = time.perf_counter()
                    fn(a.short, Path(tempfile.mkdtemp(dir=tmp)), cache)
                    row["warmup_wall_s"] = round(time.perf_counter() - t0, 3)
                for n in (a.short, a.long):
                    d = Path(tmp, f"{name}-{rnd}-{n}")
                    d.mkdir()
                    t0 = time.perf_counter()
                    rewards, elapsed = fn(n, d, cache)
                    row[f"wall_s_{n}"] = round(time.perf_counter() - t0, 3)
                    if n == a.long:
                        row["mean_reward"] = round(sum(rewards) / max(1, len(rewards)), 4)
                        row["steps_logged"] = len(rewards)
                        # within the long run, step `short`'s end to the last step's (no start-up, no evaluation)
                        row["loop_s_per_step"] = round((elapsed[a.long] - elapsed[a.short]) / (a.long - a.short), 4)
                row["s_per_step"] = round((row[f"wall_s_{a.long}"] - row[f"wall_s_{a.short}"]) / (a.long - a.short), 4)
                rows.append(row)
                print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        if r["side"] not in best or r["s_per_step"] < best[r["side"]]["s_per_step"]:
            best[r["side"]] = r
    ref = best["harness"]["s_per_step"]
    summary = {s: {"s_per_step": r["s_per_step"], "loop_s_per_step": r["loop_s_per_step"],
                   "mean_reward": r["mean_reward"],
                   "x_slower_than_harness": round(r["s_per_step"] / ref, 2)} for s, r in best.items()}
    print(f"{'side':<14} {'s/step':>8} {'x ours':>7} {'in-loop s/step':>15} {'mean reward':>12}")
    for s, v in summary.items():
        print(f"{s:<14} {v['s_per_step']:>8.3f} {v['x_slower_than_harness']:>7.2f} {v['loop_s_per_step']:>15.3f} "
              f"{v['mean_reward']:>12.3f}")
    if a.json:
        import torch
        import transformers
        import trl as trl_mod
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
                platform.machine(), "cores": os.cpu_count(), "load_avg_1_5_15_start": load_start,
                "load_avg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
                "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_mod.__version__,
                "command": " ".join(sys.argv), "questions": QUESTIONS, "answers_per_question": GROUP,
                "max_new_tokens": NEW_TOKENS, "long": a.long, "short": a.short, "threads": a.threads}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

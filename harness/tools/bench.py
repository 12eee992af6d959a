"""Throughput benchmark: the harness against a minimal PyTorch loop and the Hugging Face Trainer.

    harness bench configs/default.yaml [section.key=value ...] [--steps 40] [--warmup 10] [--rounds 2]
                  [--contenders harness,raw,trainer,trainer_grouped] [--harness-packing] [--out PATH]
    harness bench configs/default.yaml --profiles conservative,balanced      # the harness once per train.profile

Every contender trains the same model (harness.model, built after `set_seed(train.seed)`) on the same tokenized
generative data (harness.data.samples, `data.train_files`, `data.max_len`) with the same right-padding collator, micro-batch
size, AdamW settings and param groups, learning-rate schedule, gradient clipping, precision and data order, for
`warmup + steps` optimizer steps with `grad_accum` 1, one process, the same torch thread count:

    harness   the real entry point, `python -m harness.train --config CONFIG ...`, timed from its metrics.jsonl
              (tokens and elapsed_s of the records at steps W and W+N);
    raw       a minimal loop: forward, token-mean loss, backward, clip, step, schedule, zero_grad;
    trainer   transformers.Trainer with the harness's collator and optimizer/schedule, timed by a callback;
    trainer_grouped   the same with train_sampling_strategy="group_by_length" (the former group_by_length=True:
              batches of similar lengths, less padding; another data order). Not run unless named in --contenders.

--harness-packing lets the harness keep the recipe's data.packing (raw and the Trainers cannot pack: they pad each
micro-batch to its longest sample). The batches then differ, so compare useful (non-padding) tokens/s, not losses.

Each run is its own subprocess (accelerate keeps process-wide state), and the contenders alternate within each
round (harness, raw, trainer, harness, raw, trainer, ...) so that slow drifts of the machine hit them alike. The
measurement covers steps W+1..W+N: tokens/s = non-padding input tokens / seconds, step time = seconds / N; the
medians over rounds are reported, with ratios and each contender's peak memory (the largest over rounds of
`peak_mem_gb`: torch.cuda.max_memory_allocated on a GPU, the process's peak RSS on CPU), on stdout and in a JSON
file (default
`<train.output_dir>/bench/bench.json`).

Every run skips evaluation, checkpoints, export, trackers and the progress bar. To compare like with like, the
contenders also run without packing (unless --harness-packing) and without torch.compile (with --profiles, the
profile decides those). The harness logs every gcd(W, N) steps (it needs records at W and W+N); the Trainer logs at
the same interval; the raw loop never logs. All contenders see the same batches (checked: the same token count; the
losses agree), except trainer_grouped and a packed harness. With loss.chunked_ce on (auto: from 256 MiB of fp32
logits per micro-batch) the harness never builds the [batch, seq, vocab] logits while raw and the Trainers do: the
summary prints each one's peak memory and final loss against the harness's.

Noise: every run records the 1-minute load average before it starts. On a machine shared with other work, OpenMP
threads that lose their core stall each other, and step times can swing several-fold between rounds; the fastest
round of each contender ("best rounds" line) is then the better comparison, and `--threads 1` is far steadier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from harness.config import SECTIONS, load_config, recipe_args
from harness.errors import ConfigError, HarnessError
from harness.tools.bench_loops import peak_memory_gb, result, run_raw, run_trainer
from harness.tools.bench_report import TRAINERS, format_table, headline_ratios, ratio_lines, summarise

CONTENDERS = ("harness", "raw", "trainer", "trainer_grouped")
DEFAULT_CONTENDERS = ("harness", "raw", "trainer")
PROFILE_KEY = "train.profile"  # the override that selects a speed profile (--profiles)
RESULT_TAG = "BENCH_RESULT "  # a worker's result line on stdout
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------- settings


def _has_key(key: str) -> bool:
    section, _, name = key.partition(".")
    return section in SECTIONS and name in {f.name for f in dataclasses.fields(SECTIONS[section])}


def log_interval(warmup: int, steps: int) -> int:
    """The harness's train.log_every: records must exist at step W and at step W+N."""
    return math.gcd(warmup, warmup + steps)


def forced_overrides(warmup: int, steps: int, plain: bool, keep_packing: bool = False) -> list[str]:
    """Overrides appended to the user's for every run (the harness and, for the same config, raw and trainer).
    `plain` (contender mode) also turns off what the raw loop does not do (packing unless `keep_packing`,
    torch.compile)."""
    out = [f"train.max_steps={warmup + steps}", f"train.log_every={log_interval(warmup, steps)}",
           "train.grad_accum=1", "train.save_final=false", "train.save_every_steps=0", "train.stop_at_step=0",
           "train.resume=null", "data.eval_files=[]", "data.emb_eval_files=[]", "train.eval_at_start=false",
           "train.eval_every=0", "train.progress_bar=false", "train.report_to=[]"]
    if plain:
        off = ("train.compile=none",) if keep_packing else ("data.packing=false", "train.compile=none")
        out += [kv for kv in off if _has_key(kv.split("=")[0])]
    return out


def plan(args: argparse.Namespace) -> list[dict]:
    """The runs of one round, in order: {name, kind, overrides} (overrides: the user's + the run's own)."""
    if args.profiles:
        return [{"name": p, "kind": "harness", "overrides": [*args.overrides, f"{PROFILE_KEY}={p}"]}
                for p in args.profiles]
    return [{"name": k, "kind": k, "overrides": list(args.overrides)} for k in args.contenders]


# ----------------------------------------------------------------------------------------------- device


def describe_device(threads: int) -> dict:
    """CPU model and cores, GPUs, versions: what the numbers were measured on."""
    import torch

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    from importlib import metadata

    def version(p):
        try:
            return metadata.version(p)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu, "cpu_cores": os.cpu_count(), "cpu_cores_usable": usable, "torch_threads": threads,
            "gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "accelerate": version("accelerate"),
            "python": platform.python_version(), "platform": platform.platform()}


def device_line(dev: dict) -> str:
    gpu = ", ".join(dev["gpus"]) if dev["gpus"] else "no GPU"
    return (f"{dev['cpu']} ({dev['cpu_cores_usable']}/{dev['cpu_cores']} cores usable, {dev['torch_threads']} torch "
            f"threads), {gpu}, torch {dev['torch']}")


def read_harness_metrics(run_dir: str | Path, warmup: int, steps: int) -> dict:
    """tokens/s over steps W+1..W+N from the harness's metrics.jsonl (records at W and W+N)."""
    records = {}
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if "tokens" in r and "elapsed_s" in r:
            records[r["step"]] = r
    a, b = records.get(warmup), records.get(warmup + steps)
    if a is None or b is None:
        raise HarnessError(f"{run_dir}/metrics.jsonl has no record at step {warmup} or {warmup + steps} "
                           f"(steps logged: {sorted(records)})")
    peaks = [r["mem_gb"] for r in records.values() if r.get("mem_gb") is not None]
    return result("harness", steps, b["tokens"] - a["tokens"], b["elapsed_s"] - a["elapsed_s"], b.get("loss"),
                   peak_mem_gb=max(peaks) if peaks else None)


# ----------------------------------------------------------------------------------------------- the parent


def _child_env(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def _fail(cmd: list[str], proc: subprocess.CompletedProcess, what: str) -> HarnessError:
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
    return HarnessError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")


def run_one(run: dict, args: argparse.Namespace) -> dict:
    """One contender (or profile) in its own subprocess; returns its result dict."""
    w, n = args.warmup, args.steps
    extra = forced_overrides(w, n, plain=not args.profiles,
                             keep_packing=args.harness_packing and run["kind"] == "harness")
    env = _child_env(args.threads)
    load = _loadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench-{run['kind']}-") as tmp:
        if run["kind"] == "harness":
            cmd = [sys.executable, "-m", "harness.train", "--config", args.config, *run["overrides"], *extra,
                   f"train.output_dir={tmp}"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                raise _fail(cmd, proc, f"harness run '{run['name']}'")
            res = read_harness_metrics(tmp, w, n)
            res["threads"] = args.threads
        else:
            cmd = [sys.executable, "-m", "harness.tools.bench", "--worker", run["kind"], args.config, *run["overrides"],
                   *extra, "--steps", str(n), "--warmup", str(w), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
            if proc.returncode != 0 or not lines:
                raise _fail(cmd, proc, f"{run['kind']} worker")
            res = json.loads(lines[-1][len(RESULT_TAG):])
    res.update(name=run["name"], wall_s=time.perf_counter() - start, load_before=load, load_after=_loadavg())
    return res


def _loadavg() -> Optional[float]:
    """1-minute load average (None where unknown): other work on the machine skews every contender."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_bench(args: argparse.Namespace, argv: list[str]) -> dict:
    cfg = load_config(args.config, args.overrides)  # a bad key or value stops here, with its one line
    runs = plan(args)
    for run in runs:  # each run's full config must load too (e.g. an unknown profile)
        load_config(args.config, [*run["overrides"], *forced_overrides(args.warmup, args.steps, not args.profiles,
                                                                       args.harness_packing)])
    if not args.profiles and cfg.loss.mode != "generative":
        raise ConfigError(f"harness bench compares generative training; got loss.mode={cfg.loss.mode} "
                          f"(--profiles runs the harness alone in any mode)")
    out = Path(args.out) if args.out else Path(cfg.train.output_dir) / "bench" / "bench.json"
    dev = describe_device(args.threads)
    w, n = args.warmup, args.steps
    print(f"[bench] {device_line(dev)}")
    print(f"[bench] {args.config} {' '.join(args.overrides)}: micro-batch {cfg.train.micro_batch_size}, "
          f"max_len {cfg.data.max_len}, {w} warm-up + {n} measured steps, {args.rounds} round(s) of "
          f"{', '.join(r['name'] for r in runs)}", flush=True)
    busy = 0.5 * dev["cpu_cores_usable"]  # more than this much other work makes the numbers noisy
    load = _loadavg()
    if load is not None and load > busy:
        print(f"[bench] warning: load average {load:.1f} on {dev['cpu_cores_usable']} usable cores: other processes "
              f"are running, the numbers will be noisy", flush=True)
    rounds: list[list[dict]] = []
    own = 0.0  # the previous run's share of the 1-minute load average (at most its thread count)
    for i in range(args.rounds):
        done = []
        for run in runs:
            res = run_one(run, args)
            if res["load_before"] is not None:
                res["load_other"] = max(0.0, res["load_before"] - own)  # others' load, roughly
            own = float(args.threads)
            done.append(res)
            print(f"[bench] round {i + 1}/{args.rounds} {run['name']}: {res['tokens_per_s']:,.0f} tokens/s, "
                  f"{res['step_time_s'] * 1e3:.1f} ms/step, {res['tokens']} tokens in {res['seconds']:.2f} s "
                  f"(run {res['wall_s']:.1f} s, load average {res['load_before'] or 0:.1f})", flush=True)
        rounds.append(done)
    names = [r["name"] for r in runs]
    baseline = (names[0] if args.profiles else ("raw" if "raw" in names else None))
    summary = summarise(rounds, names, baseline)
    ratios = headline_ratios(summary) if not args.profiles else {}
    print()
    print(format_table(summary, baseline, "profile" if args.profiles else "contender"))
    for line in ratio_lines(ratios, args.rounds):
        print(line)
    others = [r["load_other"] for rnd in rounds for r in rnd if r.get("load_other") is not None]
    if others and max(others) > busy:
        print(f"[bench] warning: other processes kept up to {max(others):.1f} of {dev['cpu_cores_usable']} usable "
              f"cores busy during the runs: compare the best rounds, or rerun on an idle machine")
    same = {r["name"]: r["tokens"] for r in rounds[0]}
    if len(set(same.values())) > 1 and not args.profiles and not args.harness_packing \
            and "trainer_grouped" not in same:
        print(f"[bench] note: the contenders measured different token counts {same} (different batches)")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": dev,
        "command": "harness bench " + shlex.join(argv),
        "argv": list(argv),
        "settings": {
            "config": args.config, "overrides": list(args.overrides), "mode": "profiles" if args.profiles else "contenders",
            "runs": names, "steps": n, "warmup": w, "rounds": args.rounds, "threads": args.threads,
            "forced_overrides": forced_overrides(w, n, not args.profiles), "harness_log_every": log_interval(w, n),
            "harness_packing": bool(args.harness_packing),
            "micro_batch_size": cfg.train.micro_batch_size, "grad_accum": 1, "max_len": cfg.data.max_len,
            "seed": cfg.train.seed, "precision": cfg.train.precision, "train_files": cfg.data.train_files,
            "model": cfg.model.name_or_path or cfg.model.config,
            "measured": f"optimizer steps {w + 1}..{w + n}; tokens = non-padding input tokens",
        },
        "rounds": rounds,
        "summary": summary,
        "ratios": ratios,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    print(f"[bench] wrote {out}")
    return result


# ----------------------------------------------------------------------------------------------- entry point


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(
        prog="harness bench",
        description="Tokens/s and step time of the harness, a minimal PyTorch loop and transformers.Trainer on "
                    "the same model, data and settings (interleaved rounds, one subprocess each).")
    recipe_args.add(p)
    p.add_argument("--steps", type=int, default=40, help="measured optimizer steps (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="optimizer steps before the clock starts (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all contenders (default 2)")
    p.add_argument("--contenders", type=_csv, default=list(DEFAULT_CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)} (default: {','.join(DEFAULT_CONTENDERS)})")
    p.add_argument("--harness-packing", action="store_true",
                   help="the harness keeps the recipe's data.packing (the others pad): compare useful tokens/s")
    p.add_argument("--profiles", type=_csv, default=None,
                   help=f"instead of the contenders: the harness once per profile ({PROFILE_KEY}=NAME)")
    p.add_argument("--out", default=None, help="JSON output (default <train.output_dir>/bench/bench.json)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads in every run (default: this process's, %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per run (default: none)")
    p.add_argument("--worker", choices=["raw", *TRAINERS], help=argparse.SUPPRESS)
    args = recipe_args.resolve(p.parse_intermixed_args(argv), p)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or args.threads < 1:
        p.error("--steps, --warmup, --rounds and --threads must be >= 1")
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad or not args.contenders:
        p.error(f"--contenders: choose from {','.join(CONTENDERS)}, got {','.join(args.contenders)}")
    if args.profiles is not None and not args.profiles:
        p.error("--profiles: give at least one name")
    return args


def _worker(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # the parent appended the forced overrides
    fn = {"raw": run_raw, "trainer": run_trainer,
          "trainer_grouped": lambda *a: run_trainer(*a, grouped=True)}[args.worker]
    res = fn(cfg, args.warmup, args.steps, args.threads, cfg.train.log_every)
    res["peak_mem_gb"] = peak_memory_gb()
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        if args.worker:
            return _worker(args)
        run_bench(args, argv)
    except HarnessError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return e.exit_code
    except subprocess.TimeoutExpired as e:
        print(f"harness: error: bench run timed out after {e.timeout} s: {shlex.join(map(str, e.cmd))}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

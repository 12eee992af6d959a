"""Record or compare the loop's goldens: what a refactor of the loop must not change.

    python scripts/goldens.py record docs/bench/goldens.json     # before moving code
    python scripts/goldens.py compare docs/bench/goldens.json    # after: exit 1 on any difference
    python scripts/goldens.py engine record docs/bench/goldens-engine.json   # the generation engines' (`engine_all`)
    python scripts/goldens.py engine compare docs/bench/goldens-engine.json

Nine runs through the real entry point (one process, fp32 CPU): the default job (40 steps), the unified GritLM
recipe (40 steps), the default job stopped at step 20 and resumed, LoRA on the default job (8 steps; its adapter
tensors are kept too), DPO on configs/dpo-tiny.yaml (8 steps; its reference log-probs are kept too), the GritLM recipe's embedding
mode alone (20 steps), GRPO from a random tiny model (4 steps, rl.beta 0.1, two steps a generation batch), on-policy
distillation on configs/distill-tiny.yaml (6 steps, distill.lmbda 0.5, from a teacher trained 10 steps on its recipe
first), and the default job under DeepSpeed ZeRO-2 (one
process through `accelerate launch` with accelerate_configs/zero2.yaml; launched without ACCELERATE_USE_CPU, which
would quietly turn DeepSpeed off; report.json's zero_stage is kept and must be 2). What is kept of each:
metrics.jsonl without its timing and system fields (loss, lr, grad norm, tokens, epoch, padding, evaluations), the key set of its records, and
report.json's key set (nested keys as dotted paths). Values are compared to a relative 1e-6 (the runs are
deterministic on one machine; the tolerance only absorbs the JSON round trip). A run whose config this checkout
lacks (distill before its mode existed) is skipped with one line, and compare reports a run the golden lacks apart,
not as a difference: an older checkout's recording compares with a newer one's.

The code run is this checkout's (the folder above scripts/): the runs' subprocesses and the engine goldens import it,
not an installed harness; a copy of this script placed in an older checkout's scripts/ records that checkout.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's harness and tests/ (the engine goldens), not an installed harness
DETERMINISTIC = {"step", "epoch", "loss", "loss_gen", "loss_emb", "lr", "grad_norm", "padding_share", "tokens",
                 "reward", "reward_std", "kl", "clip_fraction", "completion_length", "flat_group_share",
                 "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",  # preference
                 "reverse_kl", "top1_agreement", "on_policy_share"}  # distill
COMMON = ["train.progress_bar=false", "train.report_to=[]", "train.summary=false", "train.precision=fp32",
          "train.compile=none"]
RUNS = {
    "default": ("configs/default.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=10",
                                         "train.save_every_steps=20"]),
    "unified": ("configs/gritlm-tiny.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=20"]),
    "resume": ("configs/default.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=10"]),
    "zero2": ("configs/default.yaml", ["train.max_steps=20", "train.log_every=5", "train.eval_every=10",
                                       "train.save_every_steps=10"]),
    "lora": ("configs/default.yaml", ["train.max_steps=8", "train.log_every=2", "train.eval_every=4",
                                      "model.lora.enabled=true"]),
    "dpo": ("configs/dpo-tiny.yaml", ["train.max_steps=8", "train.log_every=2", "train.eval_every=4"]),
    "embedding": ("configs/gritlm-tiny.yaml", ["loss.mode=embedding", "train.max_steps=20", "train.log_every=5",
                                               "train.eval_every=10"]),
    # GRPO from a random tiny model (tests/rl_rewards.py's digits reward): the KL term's reference (rl.beta > 0), two
    # steps on each generation batch, the rft-test evaluation
    "rl": ("configs/grpo-tiny.yaml", [
        "model.name_or_path=null", "model.tokenizer=bundled",
        "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}",
        "rl.reward=rl_rewards:digits", "rl.beta=0.1", "train.max_steps=4", "rl.questions_per_step=4",
        "rl.num_generations=4", "rl.iterations=2", "rft.max_new_tokens=8", "rft.num_test_questions=6",
        "train.eval_every=2", "train.eval_at_start=false", "optim.lr=3e-3", "optim.warmup_steps=0",
        "train.log_every=1"]),
    # on-policy distillation (half the micro-batches the student's own seeded samples) from PREPARED's teacher
    "distill": ("configs/distill-tiny.yaml", ["distill.lmbda=0.5", "distill.max_new_tokens=8", "train.max_steps=6",
                                              "train.micro_batch_size=8", "train.log_every=1", "train.eval_every=3"]),
}
# distill's teacher: its recipe trained 10 steps first, into the run's folder's sibling
TEACHER = ("configs/distill-tiny-teacher.yaml", ["train.max_steps=10", "train.log_every=5"])
LAUNCHED = {"zero2": "zero2"}  # run name -> accelerate_configs/<name>.yaml, one process through accelerate launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(config: str, overrides: list[str], accel: str | None = None) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}  # tests/rl_rewards.py for the rl run
    env.pop("ACCELERATE_USE_CPU", None)  # DeepSpeed on CPU runs only without it (docs: cpu-distributed notes)
    cmd = [sys.executable, "-m", "harness.train"]
    if accel:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / f"{accel}.yaml"), "--num_processes", "1",
               "--main_process_port", str(free_port()), str(ROOT / "harness" / "train.py")]
    cmd += ["--config", str(ROOT / config), *COMMON, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict) and k not in ("data", "hardware", "utilisation", "cost"):
            out += keys(v, f"{prefix}{k}.")
    return sorted(out)


def kept(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [{k: v for k, v in r.items() if k in DETERMINISTIC or k.startswith("eval")} for r in records]
    report = json.loads((run_dir / "report.json").read_text())
    return {"records": values, "record_keys": sorted({k for r in records for k in r}),
            "report_keys": keys(report), "zero_stage": report.get("zero_stage")}


def tensors(run_dir: Path) -> dict:
    """A LoRA run's adapter tensors (final/adapter_model.safetensors) and a DPO run's reference log-probs
    (reference_logps.pt), as lists of floats."""
    import torch
    from safetensors.torch import load_file
    out = {}
    adapter = run_dir / "final" / "adapter_model.safetensors"
    if adapter.is_file():
        out["adapter"] = {k: v.float().flatten().tolist() for k, v in sorted(load_file(adapter).items())}
    reference = run_dir / "reference_logps.pt"
    if reference.is_file():
        held = torch.load(reference, weights_only=True)
        out["reference_logps"] = {k: v["logps"].float().flatten().tolist() for k, v in sorted(held.items())}
    return out


def prepared(name: str, config: str, overrides: list[str], run_dir: Path) -> list[str]:
    """The first run a run needs, and the overrides that then read it: resume stopped at step 20 and resumed;
    distill's teacher trained first."""
    if name == "resume":
        train(config, overrides + [f"train.output_dir={run_dir}", "train.stop_at_step=20"])
        return overrides + ["train.resume=auto"]
    if name == "distill":
        teacher = run_dir.with_name(f"{name}-teacher")
        train(TEACHER[0], TEACHER[1] + [f"train.output_dir={teacher}"])
        return overrides + [f"distill.teacher={teacher / 'final'}"]
    return overrides


def record_all() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, overrides) in RUNS.items():
            if not (ROOT / config).is_file():
                print(f"[goldens] {name}: skipped, {config} is not in this checkout", flush=True)
                continue
            run_dir = Path(tmp, name)
            overrides = prepared(name, config, overrides, run_dir)
            train(config, overrides + [f"train.output_dir={run_dir}"], LAUNCHED.get(name))
            out[name] = {**kept(run_dir), **tensors(run_dir)}
            if name == "zero2" and out[name]["zero_stage"] != 2:
                sys.exit(f"[goldens] zero2 ran without DeepSpeed ZeRO-2 (zero_stage {out[name]['zero_stage']!r})")
            print(f"[goldens] {name}: {len(out[name]['records'])} records", flush=True)
    return out


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in {'golden' if k in a else 'new'}" for k in sorted(set(a) ^ set(b))]
        return out + [d for k in sorted(set(a) & set(b)) for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) and not all(isinstance(x, str) for x in a + b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        if all(isinstance(x, str) for x in a + b):
            return [f"{where}: golden only {sorted(set(a) - set(b))}, new only {sorted(set(b) - set(a))}"] \
                if set(a) != set(b) else []
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) else [f"{where}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


# ----------------------------------------------------------------------------------------------- the engine's goldens
ENGINE_NEW = 30  # new tokens at most (tests/test_rft_engine.py's NEW)


def engine_all() -> dict:
    """The generation engines' answers bit for bit, in one process on the CPU, on tests/test_rft_engine.py's tiny
    random model (its TINY config, seed 0) and 12 arithmetic prompts: the continuous engine at 64, 7 and 3 slots,
    greedy and sampled (4 answers a prompt, temperature 0.9, top-p 0.9, top-k 20, seeds 11), its token ids and text;
    the static engine's and the transformers engine's greedy text and seeded samples (text)."""
    # lazy: the training goldens run in subprocesses; this process loads torch and the engines only for these
    import torch
    from accelerate.utils import set_seed

    from harness.config import ModelConfig
    from harness.model import build_model, load_tokenizer
    from harness.rft.contract import GREEDY, Sampling
    from harness.rft.engine import ContinuousEngine
    from harness.rft.hf_engine import TransformersEngine
    from harness.rft.sampling import StaticEngine, prompt_text
    from harness.rft.tasks import ArithmeticTask
    from tests.test_rft_engine import TINY

    torch.set_num_threads(1)
    cfg = ModelConfig(config=dict(TINY))
    tok = load_tokenizer(cfg)
    tok.padding_side = "left"
    set_seed(0)
    model = build_model(cfg, tok).eval()
    t = ArithmeticTask(n_train=12, n_test=0, n_sft=0, max_operand=12)
    prompts = [prompt_text(t, q, tok) for q in t.split("train")]
    sampled = Sampling(temperature=0.9, top_p=0.9, seed=11)
    out = {}
    for slots in (64, 7, 3):
        for form, kw in (("greedy", GREEDY), ("sampled", sampled)):
            e = ContinuousEngine(model, tok, ENGINE_NEW, max_slots=slots, top_k=20 if form == "sampled" else 0)
            n = 1 if form == "greedy" else 4
            texts, ids = engine_answers(e, tok, prompts, n, kw)
            out[f"continuous-{slots}-{form}"] = {"text": texts, "ids": ids}
    for name, e in (("static", StaticEngine(model, tok, ENGINE_NEW, micro=64, per_call=4, top_k=20)),
                    ("transformers", TransformersEngine(model, tok, ENGINE_NEW, top_k=20))):
        out[f"{name}-greedy"] = {"text": engine_answers(e, tok, prompts, 1, GREEDY)[0]}
        out[f"{name}-sampled"] = {"text": engine_answers(e, tok, prompts[:6], 4, sampled)[0]}
    return out


def engine_answers(engine, tok, prompts: list[str], n: int, sampling) -> tuple[list, list]:
    """(the answers' text per prompt, the continuous engine's token ids per prompt, else [])."""
    from harness.rft.contract import encode, texts  # lazy: as engine_all's

    got = engine.generate(encode(tok, prompts), n, sampling)
    ids = [[list(c.ids) for c in group] for group in got] if engine.name == "continuous" else []
    return texts(tok, got, engine.eos), ids


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "engine":  # the engine's goldens: record / compare
        sys.argv, record = [sys.argv[0], sys.argv[2], sys.argv[3]], engine_all
    else:
        record = record_all
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        print(__doc__)
        return 2
    verb, path = sys.argv[1], Path(sys.argv[2])
    now = record()
    if verb == "record":
        path.write_text(json.dumps(now, indent=1) + "\n")
        print(f"[goldens] written to {path}")
        return 0
    golden = json.loads(path.read_text())
    for name in sorted(set(now) - set(golden)):
        print(f"[goldens] {name}: not in {path}, recorded only now (not compared)")
        del now[name]
    diffs = differences(golden, now)
    print("\n".join(diffs) or "[goldens] identical")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check: the ~1B recipe on one CUDA GPU: eager vs regional compile, ZeRO-2 vs ZeRO-3; tokens/s, MFU, memory.

    python scripts/gpu_check.py                      # eager, regional, zero2, zero3: ~5 minutes on one H100
    python scripts/gpu_check.py --variants mb4,sdpa,flex,ce_full,v128k,v128k_full,lora,qlora,gritlm,profile
    python scripts/gpu_check.py --variants eager,regional --steps 20
    python scripts/gpu_check.py --cpu-smoke          # the script itself, end to end on a CPU (tiny recipe, 2 variants)

Runs `accelerate launch harness/train.py --config configs/gpu-1b.yaml` once per variant (random init, bf16, packed
2048-token rows, no download; the LoRA variants first save a random bf16 copy of the model to load as the base, which
bitsandbytes quantizes for qlora), reads each run's report.json and metrics.jsonl, prints a table and writes
runs/gpu-check/gpu_check.json. Steady-state figures are medians over the logged intervals after the first (which
holds compilation), GPU utilisation included (NVML's busy share per log interval, "GPU util steady"). It is also
recorded for the whole run (report.json["utilisation"], start-up included) and by this script around the whole launch,
as mean and p10. Not a test: it needs a GPU; the figures go to docs/benchmarks.md with the date and device.
`--cpu-smoke` runs the same code path on a CPU with the default tiny recipe (CPU utilisation in place of NVML), so
that the script is known to work before a rented GPU's time is spent on it (tests/test_monitor.py runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.observe.monitor import UtilisationSampler, describe  # noqa: E402
REGIONAL = ["train.compile=regional"]
GRITLM = ["loss.mode=unified", "data.emb_train_files=[data/sample/emb.jsonl]", "data.emb_eval_files=[]",
          "model.pooling=mean", "model.embed_attention=bidirectional", "train.emb_micro_batch_size=64",
          "data.train_group_size=2", "data.query_max_len=256", "data.passage_max_len=512"]
LORA = ["model.name_or_path={base}", "model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32"]
VARIANTS = {  # name: (accelerate config, overrides); {base}: a saved random-init copy of the recipe's model
    "eager": ("single_gpu", ["train.compile=none"]),
    "sdpa": ("single_gpu", [*REGIONAL, "model.attn_implementation=sdpa"]),
    "profile": ("single_gpu", [*REGIONAL, "train.profile_steps=3"]),
    "regional": ("single_gpu", REGIONAL),
    "zero2": ("zero2", REGIONAL),
    "zero3": ("zero3", ["train.compile=none"]),
    "zero3_regional": ("zero3", REGIONAL),  # block forwards compiled, ZeRO-3 hooks eager (harness.compiling)
    "flex": ("single_gpu", [*REGIONAL, "model.attn_implementation=flex_attention"]),
    "mb4": ("single_gpu", [*REGIONAL, "train.micro_batch_size=4"]),
    "ce_full": ("single_gpu", [*REGIONAL, "loss.chunked_ce=false"]),
    "v128k": ("single_gpu", [*REGIONAL, "model.config.vocab_size=128256", "loss.chunked_ce=true"]),
    "v128k_full": ("single_gpu", [*REGIONAL, "model.config.vocab_size=128256", "loss.chunked_ce=false"]),
    "gritlm": ("single_gpu", [*REGIONAL, *GRITLM]),
    "lora": ("single_gpu", [*REGIONAL, *LORA]),
    "qlora": ("single_gpu", [*REGIONAL, *LORA, "model.quantization=4bit"]),
}
DEFAULT = "eager,regional,zero2,zero3"


def make_base(out_root: Path) -> Path:
    """The recipe's model, randomly initialised in bf16 and saved, for the variants that load a pretrained base
    (LoRA, QLoRA: bitsandbytes quantizes while loading)."""
    base = out_root / "base-1b"
    if (base / "config.json").exists():
        return base
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.config import load_config

    conf = dict(load_config(ROOT / "configs" / "gpu-1b.yaml").model.config)
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    return base


def run_variant(name: str, steps: int, out_root: Path, extra: list[str], cpu: bool = False,
                timeout_s: float = 900) -> dict:
    accel, overrides = VARIANTS[name]
    if any("{base}" in o for o in overrides):
        base = make_base(out_root)
        overrides = [o.replace("{base}", str(base)) for o in overrides]
    if cpu:
        accel, recipe = "cpu", "default.yaml"
        extra = ["data.eval_files=[]", "train.log_every=1", *extra]
    else:
        recipe = "gpu-1b.yaml"
    out = out_root / name
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / f"{accel}.yaml"), "--num_processes", "1",
           str(ROOT / "harness" / "train.py"), "--config", str(ROOT / "configs" / recipe),
           f"train.output_dir={out}", f"train.max_steps={steps}", "train.resume=null", "train.monitor_interval_s=1",
           *overrides, *extra]
    print("$", " ".join(cmd), flush=True)
    sampler = UtilisationSampler(interval_s=1.0, gpus=not cpu).start()  # the whole launch, start-up included
    try:
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        sampler.stop()
        out_text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        (out_root / f"{name}.log").write_text(out_text)
        return {"variant": name, "error": f"timed out after {timeout_s:.0f} s"}
    whole = sampler.stop()
    print(f"  utilisation, whole launch: {describe(whole)}" + (f" ({whole['note']})" if whole["note"] else ""))
    (out_root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"variant": name, "error": (proc.stderr or proc.stdout)[-2000:]}
    rep = json.loads((out / "report.json").read_text())
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r][1:]  # drop the first interval (compilation, warm-up)
    util = (rep.get("utilisation") or {}).get("metrics", {})
    print(f"  utilisation, training: {describe(rep.get('utilisation'))}")
    def med(key: str):  # None where no interval has it (MFU on a device with no known peak, memory on a CPU)
        vals = [r[key] for r in recs if r.get(key) is not None]
        return statistics.median(vals) if vals else None
    return {"variant": name, "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"), "mem_gb": med("mem_gb"),
            "padding_share": med("padding_share"), "zero_stage": rep.get("zero_stage"), "compile": rep.get("compile"),
            "final_loss": rep.get("final_loss"), "gpu": (rep["hardware"].get("gpus") or [{}])[0],
            "gpu_util_steady": med("gpu_util"),  # the log intervals' own NVML means, after the first
            "gpu_util_mean": util.get("gpu_util", {}).get("mean"), "gpu_util_p10": util.get("gpu_util", {}).get("p10"),
            "cpu_util_mean": util.get("cpu_util", {}).get("mean"),
            "gpu_mem_used_max_gb": util.get("gpu_mem_gb", {}).get("max"),
            "utilisation": rep.get("utilisation"), "utilisation_whole_launch": whole}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=DEFAULT, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per variant before it is stopped")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check the script on a CPU: default tiny recipe, variants eager,regional unless given")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for every variant")
    args = ap.parse_args()
    import torch

    if args.cpu_smoke:
        if args.variants == DEFAULT:
            args.variants = "eager,regional"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run it on a GPU machine (or --cpu-smoke to check the script)",
              file=sys.stderr)
        return 2
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        print(f"gpu_check: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    zero = [v for v in args.variants.split(",") if VARIANTS[v][0].startswith("zero")]
    if args.cpu_smoke and zero:
        print(f"gpu_check: --cpu-smoke runs the variants without DeepSpeed, not {', '.join(zero)} (tests/test_zero.py "
              f"covers ZeRO on the CPU)", file=sys.stderr)
        return 2
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    rows = [run_variant(v, args.steps, out_root, args.overrides, cpu=args.cpu_smoke, timeout_s=args.timeout)
            for v in args.variants.split(",")]
    print(f"\n{'variant':<11}{'tokens/s':>11}{'MFU':>8}{'mem GB':>9}{'cold compile s':>16}{'GPU util steady':>17}"
          f"{'loss':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<11} failed: {r['error'][-300:]}")
            continue
        cc = (r["compile"] or {}).get("cold_compile_s")
        print(f"{r['variant']:<11}{r['tokens_per_s'] or 0:>11,.0f}{(r['mfu'] or 0) * 100:>7.1f}%"
              f"{r['mem_gb'] or 0:>9.1f}{cc if cc is not None else float('nan'):>16.1f}"
              f"{r['gpu_util_steady'] if r['gpu_util_steady'] is not None else float('nan'):>16.0f}%"
              f"{r['final_loss'] or float('nan'):>8.3f}")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
              "steps": args.steps, "rows": rows}
    (out_root / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(f"\nwritten {out_root / 'gpu_check.json'}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check: the ~1B recipe on one CUDA GPU, one row per variant: tokens/s, MFU, memory, GPU busy share, losses.

The next GPU visit (issue 57; docs/benchmarks.md "The next GPU visit"), one command of at most 9 minutes, its
variants in the issue's order (the engine on the mixed workload, ours then transformers'; GRPO on gpu-1b; GritLM
compiled and eager; ZeRO-3 compiled; fp8), each under its own cap (PRESET_CAPS), each row appended as its variant ends:

    bash scripts/gpu_wheels.sh --install && timeout -s INT 540 python3 scripts/gpu_check.py --preset visit \
      --budget-min 8.8 --out /tmp/gc --bench-out "$OUT/gpu-$(date -u +%F).json"

The visit before (issue 45; 15 minutes of device time, its start included), one command of at most 9 minutes, its
variants in the issue's order, each with its own time cap (rows appended to docs/bench/gpu-<UTC date>.json as each
variant ends):

    bash scripts/gpu_wheels.sh --install && timeout -s INT 525 python3 scripts/gpu_check.py --preset issue45 \
      --budget-min 8.6 --out /tmp/gc --bench-out "$OUT/gpu-$(date -u +%F).json"
    # device carry [".whl/main"]; the install 8-24 s; the script stops its own launches at 8.6 min (the timeout is
    # a backstop); estimated 8.55 min: gritlm:100 (GritLM unified, regional, static embedding
    # buckets; cap 240 s) ~3.2 min, gritlm_eager:100 (cap 210 s) ~2.8 min, zero3:20 (ZeRO-3 regional: its step 1
    # and 20 steps; cap 194 s) ~1.5 min, fp8:20 (cap 157 s) ~1.1 min; what the call's 8.6 min leave stops the last

The next GPU session (issue 25), one command per point, each under 10 minutes on one H100 (the script prints its
estimate before it starts and refuses a call estimated over --budget-min; rows are appended as each variant ends, so
a call cut off by the device's limit keeps the rows it finished):

    python scripts/gpu_check.py --preset curve          # 1: plain, ZeRO-1/2/3, regional, 100 steps       ~8.4 min
    python scripts/gpu_check.py --preset curve_eager    # 1: the same four eager (same kernels)           ~7.8 min
    python scripts/gpu_check.py --preset bisect         # 1: train.weights=bf16 (old ZeRO) per stage       ~8.4 min
    python scripts/gpu_check.py --preset bisect_ds      # 1: DeepSpeed knobs on zero2_bf16w, 100 steps     ~8.3 min
    python scripts/gpu_check.py --preset gritlm         # 2: GritLM unified 1B, regional vs eager          ~3.5 min
    python scripts/gpu_check.py --preset zero3_compile  # 3: ZeRO-3 regional vs eager, 100 steps           ~5.2 min
    python scripts/gpu_check.py --preset bf16w          # 4: bf16 weights vs autocast, 100 steps           ~4.8 min
    python scripts/gpu_check.py --preset rft_plan       # 5: rft generate, random ~1B; plan vs 300 steps   ~8.5 min
    python scripts/gpu_check.py --preset qlora          # 6: QLoRA: regional, eager, micro-batch 16, profile ~7.8 min
    python scripts/gpu_check.py --preset rft_engine     # issue 46: rft bench, our engine vs transformers'  ~8.0 min
    python scripts/gpu_check.py --preset long_context   # issue 40: longest max_len on one GPU, SP off     ~6 min
    python scripts/gpu_check.py --preset long_sp2       # issue 40: SP 2 tokens/s per GPU (2 GPUs needed)   ~3 min

    python scripts/gpu_check.py --list                   # presets and variants, with estimates
    python scripts/gpu_check.py --variants zero2_bf16w --ds-patch '{"zero_optimization": {"reduce_scatter": false}}'
    python scripts/gpu_check.py --variants plain,zero2 --steps 40 train.weights=bf16   # ad-hoc bisection steps
    python scripts/gpu_check.py --cpu-smoke --variants plain,zero2_nooverlap --steps 3  # the script on a CPU
    python scripts/gpu_check.py --cpu-smoke --preset rft_plan                           # point 5 on a CPU, tiny model

A training variant is `accelerate launch --config_file <accelerate yaml> --num_processes 1 harness/train.py --config
configs/gpu-1b.yaml <overrides>` (random init, bf16 autocast, packed 2048-token rows, micro-batch 8, no download). A
DeepSpeed variant may carry a patch merged into the shipped ds_configs/zeroN.json (`--ds-patch` adds one to every
DeepSpeed variant of the call): the patched JSON and an accelerate yaml naming it are written to <out>/_configs/ and
the launch uses them. Each run's report.json and metrics.jsonl give the row: variant, steps, precision, weights,
zero_stage, compile (mode, cold compile s, compile s in all, recompiles after step 1, recompile-limit hits, the
embedding shapes warmed before step 1), attention, tokens_per_s, mfu, mem_gb, gpu_util (medians over the log
intervals after the first), compile told from steady state (last_compile_step: the last log interval that still
compiled, from metrics.jsonl's compile_graphs / compile_s; last_recompile_step; steady_tokens_per_s and steady_mfu
over the intervals after it), recompile_log (dynamo's reasons, TORCH_LOGS=recompiles, also in the variant's log
<out>/<variant>.log), cap_s (the variant's own time cap: its `cap_s`, else 1.5x its estimate + 60 s, or --cap-s; a
variant past it is stopped and its row says so, with the step it reached and its log), final_loss, loss_at
(the logged interval means at steps 20, 40, 100), the loss curve, gpu, the command, the accelerate yaml and the
DeepSpeed JSON; beside a reference row (the plain path of the same compile setting, or for speed the variant named
as such) the loss gap in % and the tokens/s ratio. Rows go to <out>/gpu_check.json (this call) and are APPENDED to
docs/bench/gpu-<UTC date>.json (`--bench-out`; {"device", "rows", "calls"}: a second call the same day adds rows and
a call record, never overwrites).

Point 5 (`rft_plan`): `rft_generate` saves a random-init copy of the recipe's model (bf16, the bundled tokenizer,
vocabulary cut to the tokenizer's so every sampled token decodes) and runs `harness rft generate configs/rft-tiny.yaml`
on it (stats.json: sequences/s; the batch: rft.questions_per_batch x rft.oversample, at most
rft.micro_batch_sequences per generate() call, halvings read from its log; GPU busy share sampled around it);
`plan_300` runs `harness plan` for 300 steps of the recipe (calibrating under the same launcher) and then the run,
whose report.json `plan` holds estimate, actual and error; `rft_bench` runs `harness rft bench` (new tokens/s).

Issue 46 (`rft_engine`): `harness rft bench` on the same random ~1B model, 64 questions x 16 samples, 256
sequences in flight, max_new_tokens 40, best of 3 runs (the first holds compilation and CUDA-graph capture), each
engine beside static under its own cap (RFT_ENGINE_CAP_S): `rft_engine_ours` (rft.engine=continuous, its step compiled
with CUDA graphs: rft.compile null) and `rft_engine_transformers` (rft.engine=transformers); `--variants
rft_engine_eager` (rft.compile=false) in a second call when compilation's worth is in question; per engine new tokens/s,
sequences/s, GPU busy share (NVML), host ms per step, graphs and recompiles, greedy identity with static. Goal: GPU
busy >= 90% and >= 18,700 new tokens/s (3x the 6,220 of 2026-11-26).

Issue 39 (`rft_engine39`, the `rft_engine` preset before issue 46): `harness rft generate` on the same random ~1B
model with rft.engine=continuous
(`rft_generate`) and static (`rft_generate_static`): tokens/s, sequences/s, the GPU busy share over the seconds
inside generation, the sequences in flight; `rft_bench_mixed`: `harness rft bench --engines static,continuous` on 32
questions x 16 samples, max_new_tokens 200 (tokens/s, sequences/s, the padding share and the GPU busy share of each
engine, NVML every 0.5 s, and whether their greedy text is the same). Each row carries the seed's figures for
comparison (`seed`: A100, generation 6-10x faster than one-by-one, GPU 90-95% busy, 256-sequence batches); the goal
is a GPU >= 90% busy.

Estimates use the H100 figures of docs/benchmarks.md (plain regional ~60k tokens/s at micro-batch 8 x 2048, eager
~32k, ZeRO-1/2 ~30k, eager ZeRO-3 ~17k) and 40-70 s of start-up and compilation per variant. Not a test: it needs a
GPU. `--cpu-smoke` runs the same code path on a CPU with the tiny default recipe (DeepSpeed variants with DeepSpeed's
CPU accelerator, one process; CPU utilisation in place of NVML), so that the script is known to work before a rented
GPU's time is spent on it (tests/test_monitor.py runs it).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.observe.monitor import UtilisationSampler, describe  # noqa: E402

REGIONAL = ("train.compile=regional",)
EAGER = ("train.compile=none",)
BF16W = ("train.weights=bf16",)  # bf16 parameters, fp32 master copies in the optimizer (DeepSpeed's bf16 mode)
GRITLM = ("loss.mode=unified", "data.emb_train_files=[data/sample/emb.jsonl]", "data.emb_eval_files=[]",
          "model.pooling=mean", "model.embed_attention=bidirectional", "train.emb_micro_batch_size=64",
          "data.train_group_size=2", "data.query_max_len=256", "data.passage_max_len=512")
LORA = ("model.name_or_path={base}", "model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32")
QLORA = (*LORA, "model.quantization=4bit")
# issue 38: preference training (DPO's reference log-probs computed before the first step) on the shipped pairs,
# unpacked rows of up to 256 tokens, 16 pairs (32 sequences) per micro-batch; tokens/s counts both sequences of a pair
PREF = ("loss.mode=preference", "data.train_files=[data/sample/pref.jsonl]", "data.eval_files=[]", "data.packing=false",
        "data.max_len=256", "train.micro_batch_size=16")
FP8 = ("train.precision=fp8",)  # the blocks' Linear layers in float8 through torchao (harness/speed/float8.py)
# the largest model that fits one 80 GB H100 with LoRA: an 8B Llama 3 shape on gpu-1b's data, random init (no
# download), activation checkpointing
LORA_8B = ("model.config.hidden_size=4096", "model.config.intermediate_size=14336", "model.config.num_hidden_layers=32",
           "model.config.num_attention_heads=32", "model.config.num_key_value_heads=8", "model.lora.enabled=true",
           "model.lora.r=16", "model.lora.alpha=32", "model.gradient_checkpointing=true",
           "train.micro_batch_size=4")
LOSS_STEPS = (20, 40, 100)  # loss_at: the logged interval means at these steps
TOKENS_PER_ROW = 2048  # configs/gpu-1b.yaml data.max_len (packed rows)
# DeepSpeed knobs for the bisection of the ZeRO loss gap: each a patch of the shipped ds_configs/zero2.json
LONG_LENGTHS = (8192, 16384, 32768, 65536)
# issue 57: GRPO on the random ~1B (the arithmetic task's prompts; a random model's answers run to max_new_tokens)
# rft.num_test_questions=0: no greedy evaluation at the end (a graph of its own to compile and 100 answers of up to
# 256 tokens, inside the variant's cap; the visit measures the steps)
RL_1B = ("loss.mode=rl", "rl.questions_per_step=8", "rl.num_generations=16", "rl.loss_type=dapo", "rl.beta=0.0",
         "rft.max_new_tokens=256", "train.log_every=1", "data.packing=false",
         "rft.num_test_questions=0")
# issue 57 / 52: the engine's mixed-length workload (answers from 1 to max_new_tokens: `harness rft bench --mixed`)
MIXED_WORKLOAD = ("rft.max_new_tokens=512", "rft.stop_strings=[Question,'###']")
BENCH_MIXED: tuple = ()  # harness rft bench's flag for that workload (issue 52's bench)


def long_rows(n: int) -> tuple:
    return (f"data.max_len={n}", "train.micro_batch_size=1", f"model.config.max_position_embeddings={n}",
            "model.attn_implementation=sdpa")


DS_KNOBS = {
    "nooverlap": {"zero_optimization": {"overlap_comm": False}},
    "nocontig": {"zero_optimization": {"contiguous_gradients": False}},
    "fp32accum": {"data_types": {"grad_accum_dtype": "fp32"}},
    "fp32comm": {"communication_data_type": "fp32"},
}


@dataclass(frozen=True)
class Variant:
    accel: str  # accelerate_configs/<accel>.yaml (zeroN: DeepSpeed with ds_configs/zeroN.json); rft / plan: point 5
    overrides: tuple = ()
    ds_patch: Optional[dict] = None  # merged into the DeepSpeed JSON
    tok_s: float = 60000  # H100 tokens/s estimate (docs/benchmarks.md), for the wall-time estimate
    startup_s: float = 60  # start-up + cold compile estimate
    loss_ref: Optional[str] = None  # the loss gap at step 100 is against this variant's row
    speed_ref: Optional[str] = None  # tokens/s ratio against this variant's row
    note: str = ""
    processes: int = 1  # GPUs (accelerate --num_processes): 2 for the sequence-parallel variants
    tokens_per_row: int = 2048  # data.max_len of the variant (packed rows), for the estimate
    cap_s: Optional[float] = None  # its own time cap (start-up included); None: `cap_s` from the estimate
    cpu_overrides: tuple = ()  # --cpu-smoke: after the others (a workload sized for a GPU, cut to a CPU's)


def _train(accel: str, overrides: tuple, **kw) -> Variant:
    compiled = "train.compile=regional" in overrides
    deepspeed = accel.startswith("zero")
    kw.setdefault("startup_s", (40 if not compiled else 60) + (10 if deepspeed else 0))
    return Variant(accel, overrides, **kw)


VARIANTS: dict[str, Variant] = {
    # point 1: one loss curve on every stage, the same compile setting on each
    "plain": _train("single_gpu", REGIONAL, note="no DeepSpeed, regional compile (the recipe's default)"),
    "zero1": _train("zero1", REGIONAL, tok_s=30000, loss_ref="plain", speed_ref="plain"),
    "zero2": _train("zero2", REGIONAL, tok_s=30000, loss_ref="plain", speed_ref="plain"),
    "zero3": _train("zero3", REGIONAL, tok_s=17000, loss_ref="plain", speed_ref="zero3_eager",
                    note="block forwards compiled, ZeRO-3 hooks eager (harness.speed.compiling)"),
    "plain_eager": _train("single_gpu", EAGER, tok_s=31700),
    "zero1_eager": _train("zero1", EAGER, tok_s=25000, loss_ref="plain_eager", speed_ref="plain_eager"),
    "zero2_eager": _train("zero2", EAGER, tok_s=25000, loss_ref="plain_eager", speed_ref="plain_eager"),
    "zero3_eager": _train("zero3", EAGER, tok_s=17000, loss_ref="plain_eager", speed_ref="plain_eager"),
    # point 1, bisection: bf16 weights (ZeRO's behaviour before train.weights) per stage, and DeepSpeed knobs
    "plain_bf16w": _train("single_gpu", REGIONAL + BF16W, loss_ref="plain", speed_ref="plain",
                          note="bf16 weights without a launcher's DeepSpeed (train.deepspeed=zero0)"),
    "zero1_bf16w": _train("zero1", REGIONAL + BF16W, tok_s=30000, loss_ref="plain"),
    "zero2_bf16w": _train("zero2", REGIONAL + BF16W, tok_s=30000, loss_ref="plain",
                          note="the old ZeRO behaviour: expected to reproduce the 13% loss gap"),
    "zero3_bf16w": _train("zero3", REGIONAL + BF16W, tok_s=17000, loss_ref="plain"),
    **{f"zero2_{k}": _train("zero2", REGIONAL, ds_patch=p, tok_s=30000, loss_ref="plain") for k, p in DS_KNOBS.items()},
    **{f"zero2_bf16w_{k}": _train("zero2", REGIONAL + BF16W, ds_patch=p, tok_s=30000, loss_ref="plain")
       for k, p in DS_KNOBS.items()},
    # point 2: GritLM unified (64 queries x 2 passages + 8 packed rows a step: ~1.3 s a step eager; tok_s counts
    # the packed rows only, for the estimate)
    "gritlm": _train("single_gpu", REGIONAL + GRITLM, tok_s=15000, startup_s=80, speed_ref="gritlm_eager",
                     cap_s=240, note="embedding passes in data.embed_length_buckets widths, static shapes, warmed "
                                     "before step 1"),
    "gritlm_eager": _train("single_gpu", EAGER + GRITLM, tok_s=12600, cap_s=210),
    # point 4: bf16 weights
    "plain_bf16w_mb16": _train("single_gpu", REGIONAL + BF16W + ("train.micro_batch_size=16",), tok_s=65000,
                               loss_ref="plain", speed_ref="plain"),
    # point 6: QLoRA ({base}: a saved random-init bf16 copy of the recipe's model, quantized while loading)
    "qlora": _train("single_gpu", REGIONAL + QLORA, tok_s=39000, startup_s=120, speed_ref="lora",
                    note="the first LoRA variant of a call also saves the random bf16 base (~30 s)"),
    "qlora_eager": _train("single_gpu", EAGER + QLORA, tok_s=30000, startup_s=70, speed_ref="qlora"),
    "qlora_mb16": _train("single_gpu", REGIONAL + QLORA + ("train.micro_batch_size=16",), tok_s=45000,
                         startup_s=90, speed_ref="qlora"),
    "qlora_profile": _train("single_gpu", REGIONAL + QLORA + ("train.profile_steps=3",), tok_s=35000, startup_s=100,
                            note="torch.profiler over 3 settled steps: <out>/qlora_profile/profile/"),
    "lora": _train("single_gpu", REGIONAL + LORA, tok_s=54000, startup_s=80),
    # speed figures of docs/benchmarks.md (2026-11-23)
    "profile": _train("single_gpu", REGIONAL + ("train.profile_steps=3",), tok_s=50000),
    "sdpa": _train("single_gpu", REGIONAL + ("model.attn_implementation=sdpa",), tok_s=50000),
    "flex": _train("single_gpu", REGIONAL + ("model.attn_implementation=flex_attention",)),
    "mb4": _train("single_gpu", REGIONAL + ("train.micro_batch_size=4",), tok_s=54000),
    "ce_full": _train("single_gpu", REGIONAL + ("loss.chunked_ce=false",), tok_s=54000),
    "v128k": _train("single_gpu", REGIONAL + ("model.config.vocab_size=128256", "loss.chunked_ce=true"), tok_s=41000),
    "v128k_full": _train("single_gpu", REGIONAL + ("model.config.vocab_size=128256", "loss.chunked_ce=false"),
                         tok_s=43000),
    # point 4: fp8 against bf16 on gpu-1b (the same compile setting) and on an 8B with LoRA
    "fp8": _train("single_gpu", REGIONAL + FP8, tok_s=70000, loss_ref="plain", speed_ref="plain",
                  note="train.precision=fp8: torchao Float8Linear, tensorwise scaling, regional compile"),
    "fp8_eager": _train("single_gpu", EAGER + FP8, tok_s=30000, loss_ref="plain_eager", speed_ref="plain_eager"),
    "lora8b": _train("single_gpu", REGIONAL + LORA_8B, tok_s=9000, startup_s=150,
                     note="8B Llama shape, random init, LoRA r16, checkpointing"),
    "lora8b_fp8": _train("single_gpu", REGIONAL + LORA_8B + FP8, tok_s=11000, startup_s=150, loss_ref="lora8b",
                         speed_ref="lora8b"),
    # issue 40: long rows (micro-batch 1, ZeRO-3, eager: one compile per length is not the question). SP off on one
    # GPU: the longest data.max_len that trains (a variant that runs out of memory is a row with its error); SP on:
    # tokens/s per GPU (report.json tokens_per_s / processes) against the same length with SP off
    **{f"long_{n // 1024}k": _train("zero3", EAGER + long_rows(n), tok_s=20000, tokens_per_row=n,
                                   note=f"packed {n}-token rows, SP off, one GPU") for n in LONG_LENGTHS},
    **{f"long_{n // 1024}k_sp2": _train("zero3", EAGER + long_rows(n) + ("train.sequence_parallel=2",), tok_s=15000,
                                       tokens_per_row=n, processes=2, speed_ref=f"long_{n // 1024}k",
                                       note=f"packed {n}-token rows, sequence parallel 2 on 2 GPUs")
       for n in (16384, 32768)},
    "dpo": _train("single_gpu", REGIONAL + PREF, tok_s=40000, tokens_per_row=200,
                  note="loss.mode=preference, DPO: tokens/s of chosen + rejected, regional compile"),
    "dpo_eager": _train("single_gpu", EAGER + PREF, tok_s=30000, tokens_per_row=200, speed_ref="dpo"),
    "simpo": _train("single_gpu", REGIONAL + PREF + ("loss.preference=simpo",), tok_s=40000, tokens_per_row=200,
                    speed_ref="dpo", note="SimPO: no reference pass"),
    # point 5 (not training variants: see run_rft_generate, run_rft_bench, run_plan)
    "rft_generate": Variant("rft", startup_s=100, note="harness rft generate on a random-init ~1B model "
                                                     "(rft.engine=continuous, the default)"),
    "rft_generate_static": Variant("rft", ("rft.engine=static",), startup_s=150,
                                   note="harness rft generate, rft.engine=static (model.generate over batches)"),
    "rft_bench": Variant("rft", startup_s=110, note="harness rft bench --questions 2: one sequence per call, static, "
                                                    "continuous (new tokens/s, GPU busy share, greedy identity)"),
    "rft_bench_mixed": Variant("rft", ("rft.max_new_tokens=200",), startup_s=240,
                               note="harness rft bench --questions 32 x 16 samples, max_new_tokens 200: static vs "
                                    "continuous"),
    "plan_300": Variant("plan", startup_s=300, note="harness plan for the steps, then the run"),
    # issue 46: harness rft bench, 64 questions x 16 samples, 256 sequences in flight, max_new_tokens 40, best of 3;
    # each engine beside static (greedy identity) under its own cap (RFT_ENGINE_CAP_S)
    "rft_engine_ours": Variant("rft", ("rft.max_new_tokens=40",), startup_s=270,
                               note="harness rft bench --engines static,continuous (fixed-shape step; rft.compile "
                                    "null: compiled, CUDA graphs per bucket)"),
    "rft_engine_transformers": Variant("rft", ("rft.max_new_tokens=40",), startup_s=210,
                                       note="harness rft bench --engines static,transformers (transformers' "
                                            "continuous batching, generate_batch's manager)"),
    "rft_engine_eager": Variant("rft", ("rft.max_new_tokens=40", "rft.compile=false"), startup_s=150,
                                note="harness rft bench --engines static,continuous with rft.compile=false (the "
                                     "eager step: is compilation worth it on CUDA?); not in the preset"),
}
# issue 57 (`visit`): GRPO on gpu-1b, 8 questions x 16 answers a step, generation and training seconds apart
# (metrics.jsonl's gen_s_per_step / train_s_per_step); the engine compiled (rft.compile null), the training pass eager
# (compile with loss.mode=rl is not what this row measures)
VARIANTS["grpo_1b"] = _train("single_gpu", EAGER + RL_1B, tok_s=4000, tokens_per_row=512, cap_s=75, startup_s=45,
                             cpu_overrides=("rl.questions_per_step=2", "rl.num_generations=4", "rft.max_new_tokens=16"),
                             note="loss.mode=rl (GRPO, dapo, beta 0) on the random ~1B: 8 questions x 16 answers, "
                                  "up to 256 new tokens; gen and train seconds per step")
# issue 57: the engine issue's mixed-length workload on gpu-1b (answers up to 512 tokens, two stop strings, 256 in
# flight), the continuous engine compiled (CUDA graphs), then transformers' continuous batching, each under its cap
for _name, _engine, _note in (("visit_engine", "continuous", "rft.engine=continuous, compiled step with CUDA graphs"),
                              ("visit_engine_tf", "transformers", "rft.engine=transformers (continuous batching)")):
    VARIANTS[_name] = Variant("rft", (f"rft.engine={_engine}", *MIXED_WORKLOAD), startup_s=100 if _engine ==
                              "continuous" else 75, note=_note + "; mixed answer lengths up to 512, two stop strings")
RFT_ENGINE_CAP_S = {"rft_engine_ours": 300, "rft_engine_transformers": 240, "rft_engine_eager": 200,
                    "visit_engine": 100, "visit_engine_tf": 75}  # s, at most
ALIASES = {"regional": "plain", "eager": "plain_eager", "zero3_regional": "zero3"}  # names of the 2026-11-23 rows
PRESETS = {  # name: (variants, steps)
    "curve": (["plain", "zero1", "zero2", "zero3"], 100),
    "curve_eager": (["plain_eager", "zero1_eager", "zero2_eager", "zero3_eager"], 100),
    "bisect": (["plain_bf16w", "zero2_bf16w", "zero1_bf16w", "zero3_bf16w"], 100),
    "bisect_ds": (["zero2_bf16w_fp32accum", "zero2_bf16w_fp32comm", "zero2_bf16w_nooverlap",
                   "zero2_bf16w_nocontig"], 100),
    "gritlm": (["gritlm", "gritlm_eager"], 40),
    # issue 45, one visit in the issue's order: GritLM compiled vs eager over 100 steps, ZeRO-3 regional's start-up
    # and first 20 steps, fp8's first 20 steps (each variant with its own cap; `name:N` runs N steps)
    "issue45": (["gritlm:100", "gritlm_eager:100", "zero3:20", "fp8:20"], 100),
    "zero3_compile": (["zero3", "zero3_eager"], 100),
    "bf16w": (["plain", "plain_bf16w", "plain_bf16w_mb16"], 100),
    "rft_plan": (["rft_generate", "plan_300", "rft_bench"], 300),
    "rft_engine": (["rft_engine_ours", "rft_engine_transformers"], 0),  # issue 46
    # issue 57: one visit of at most 9 minutes, in the issue's order, each variant under its own cap (the caps add up
    # to 525 s): the engine on the mixed workload (ours compiled, transformers'), GRPO's generation and training
    # seconds, GritLM compiled and eager, ZeRO-3 compiled's step 1, fp8's loss at step 20
    "visit": (["visit_engine", "visit_engine_tf", "grpo_1b:3", "gritlm:100", "gritlm_eager:30", "zero3:20", "fp8:20"],
              100),
}
PRESET_CAPS = {  # a preset's own caps (s), where its call must fit a window: they win over the variants' cap_s
    "visit": {"visit_engine": 100, "visit_engine_tf": 75, "grpo_1b": 75, "gritlm": 130, "gritlm_eager": 60,
              "zero3": 45, "fp8": 40},
    "rft_engine39": (["rft_generate", "rft_generate_static", "rft_bench_mixed"], 0),
    "qlora": (["qlora", "qlora_eager", "qlora_mb16", "qlora_profile"], 40),
    "fp8": (["plain", "fp8", "plain_eager", "fp8_eager"], 100),
    "fp8_large": (["lora8b", "lora8b_fp8"], 40),
    "preference": (["dpo", "dpo_eager", "simpo"], 100),
    "long_context": ([f"long_{n // 1024}k" for n in LONG_LENGTHS], 10),
    "long_sp2": (["long_16k_sp2", "long_32k_sp2"], 10),
}
DEFAULT = "plain,plain_eager,zero2,zero3"
SMOKE_DEFAULT = "plain,zero2_nooverlap"


# ----------------------------------------------------------------------------------------------- estimates


def micro_batch(overrides) -> int:
    for o in overrides:
        if o.startswith("train.micro_batch_size="):
            return int(o.split("=", 1)[1])
    return 8


def estimate_s(name: str, steps: int) -> float:
    """Wall seconds of one variant on one H100: start-up and compilation + steps x tokens per step / tokens/s."""
    v = VARIANTS[name]
    if v.accel == "rft" or v.accel == "plan":
        return v.startup_s  # their own fixed work (plan_300: calibration 55 steps + 300 steps, each with start-up)
    return v.startup_s + steps * micro_batch(v.overrides) * v.tokens_per_row / v.tok_s


def cap_s(name: str, steps: int) -> float:
    """A variant's own time cap (start-up included): its `cap_s`, else 1.5x its estimate + 60 s. A variant past it is
    stopped (its row says so, with the step it reached and its log), so one slow variant cannot spend the GPU time
    of the variants after it."""
    v = VARIANTS[name]
    return v.cap_s if v.cap_s is not None else 1.5 * estimate_s(name, steps) + 60


def own_cap(preset: Optional[str], name: str, steps: int) -> float:
    """The cap a variant runs under in this call: its preset's (PRESET_CAPS), else its own (cap_s)."""
    return PRESET_CAPS.get(preset or "", {}).get(name) or cap_s(name, steps)


def parse_names(text: str, steps: int) -> list[tuple[str, int]]:
    """"a,b:20" -> [(a, steps), (b, 20)]: a variant's own step count after a colon (a preset of variants that need
    different step counts)."""
    out = []
    for part in text.split(","):
        name, _, own = part.partition(":")
        out.append((ALIASES.get(name, name), int(own) if own.isdigit() else steps))
    return out


def fmt_min(s: float) -> str:
    return f"{s / 60:.1f} min"


# ----------------------------------------------------------------------------------------------- configs


def deep_merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def launch_configs(name: str, accel: str, patch: Optional[dict], out_root: Path, cpu: bool) -> tuple[Path, dict]:
    """The accelerate yaml to launch with, and the DeepSpeed JSON it names ({} without DeepSpeed). With a patch, both
    are written to <out>/_configs/<variant>.{json,yaml}."""
    import yaml

    if not accel.startswith("zero"):
        return ROOT / "accelerate_configs" / ("cpu.yaml" if cpu else f"{accel}.yaml"), {}
    shipped_yaml = ROOT / "accelerate_configs" / f"{accel}.yaml"
    conf = yaml.safe_load(shipped_yaml.read_text())
    ds_path = ROOT / conf["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_path.read_text())
    if not patch:
        return shipped_yaml, ds
    ds = deep_merge(ds, patch)
    folder = out_root / "_configs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(ds, indent=2) + "\n")
    conf["deepspeed_config"]["deepspeed_config_file"] = str(folder / f"{name}.json")
    (folder / f"{name}.yaml").write_text(f"# {accel}.yaml with ds_configs/{accel}.json patched by {json.dumps(patch)}\n"
                                         + yaml.safe_dump(conf, sort_keys=False))
    return folder / f"{name}.yaml", ds


def launch_env(deepspeed: bool, cpu: bool = False) -> dict:
    env = dict(os.environ)
    if cpu:  # --cpu-smoke: train.precision=fp8 through torchao's emulation (a CPU has no float8 matmul)
        env.setdefault("HARNESS_FP8_EMULATE", "1")
    if deepspeed:  # DeepSpeed on a CPU runs only without it (docs: cpu-distributed traps; a DDP run otherwise)
        env.pop("ACCELERATE_USE_CPU", None)
    # dynamo says why each recompile happened (the guard that failed) in the variant's log; unbuffered, so that those
    # lines and the harness's step lines come in the order they happened
    env.setdefault("TORCH_LOGS", "recompiles")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_base(out_root: Path, recipe: str, tokenizer_vocab: bool = False) -> Path:
    """The recipe's model, randomly initialised in bf16 and saved with the recipe's tokenizer, for the variants that
    load a pretrained base (LoRA, QLoRA: bitsandbytes quantizes while loading) and for rft. tokenizer_vocab: the
    vocabulary cut to the tokenizer's, so that every token a random model samples decodes (rft)."""
    base = out_root / (f"base-{Path(recipe).stem}" + ("-tokvocab" if tokenizer_vocab else ""))
    if (base / "config.json").exists():
        return base
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.config import load_config
    from harness.model import load_tokenizer

    cfg = load_config(ROOT / "configs" / recipe)
    tok = load_tokenizer(cfg.model, cfg.data.chat_template)
    conf = dict(cfg.model.config)
    if tokenizer_vocab:
        conf["vocab_size"] = len(tok)
    config = AutoConfig.for_model(conf.pop("model_type"), **conf, pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    tmp = base.with_name(base.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(base)
    return base


# ----------------------------------------------------------------------------------------------- one launch


def launch(cmd: list[str], log: Path, cpu: bool, timeout_s: float, env: Optional[dict] = None,
           limit: str = "the call's --budget-min") -> dict:
    """Run one command with utilisation sampled around it; {"rc", "output", "whole", "seconds", "error"?}. Stopped
    after timeout_s (`limit` names which limit that was, for the row)."""
    print("$", shlex.join(cmd), flush=True)
    sampler = UtilisationSampler(interval_s=1.0, gpus=not cpu).start()  # the whole launch, start-up included
    t0 = time.time()
    # its own process group: at the time limit the launcher AND its training process are stopped (a training
    # process left behind would hold the GPU for the next variant)
    # the output goes to the log as it comes: a call cut off from outside (the device's limit, a timeout around the
    # script) still leaves what the launch printed, the step it reached and its compile lines
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(timeout=max(timeout_s, 1))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    seconds = time.time() - t0
    whole = sampler.stop()
    whole_samples = list(sampler.samples)
    out = log.read_text(errors="replace")
    res = {"rc": rc, "output": out, "whole": whole, "samples": whole_samples, "seconds": seconds}
    if rc is None:
        res["error"] = f"timed out after {timeout_s:.0f} s ({limit}); log {log}"
    elif rc != 0:
        said = [x for x in out.splitlines() if x.startswith("harness: error:") or "Error:" in x]
        res["error"] = f"exit {rc}: {said[-1] if said else ''} (log {log}) {out[-1500:]}"
    print(f"  {seconds:.0f} s; utilisation, whole launch: {describe(whole)}"
          + (f" ({whole['note']})" if whole.get("note") else ""), flush=True)
    return res


def metric_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def steady_state(recs: list[dict], recompiles: Optional[int]) -> dict:
    """Compile told from steady state, from metrics.jsonl (the compile fields each log line carries under torch.compile:
    compile_graphs, compile_s; harness.speed.compiling.CompileWatch.logged). `last_compile_step`: the last log line
    whose interval still compiled (compile seconds grew: a backward graph compiles at its first backward pass, with no
    new graph); `last_recompile_step`: the first log line by which the graph count had its final value, None when
    report.json counts no recompile after step 1 (`recompiles`); resolution: train.log_every. Steady tokens/s and MFU:
    over the intervals after the last one that compiled (eager: after the first, which holds the warm-up); None when no
    interval is left."""
    logged = [r for r in recs if "loss" in r and r.get("elapsed_s") is not None]
    out = {"last_compile_step": None, "last_recompile_step": None, "steady_from_step": None, "steady_steps": 0,
           "steady_tokens_per_s": None, "steady_mfu": None}
    if not logged:
        return out
    last = 0  # index of the last interval that compiled (eager: the first)
    if "compile_s" in logged[0]:
        seconds = [0.0] + [r["compile_s"] for r in logged]
        last = max(i for i in range(len(logged)) if seconds[i + 1] > seconds[i] or i == 0)
        out["last_compile_step"] = logged[last]["step"]
        if recompiles:
            final = logged[-1]["compile_graphs"]
            out["last_recompile_step"] = next(r["step"] for r in logged if r["compile_graphs"] == final)
    steady = logged[last + 1:]
    if not steady:
        return out
    start, end = logged[last], logged[-1]
    seconds = end["elapsed_s"] - start["elapsed_s"]
    spans = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(logged[last:], steady)]
    mfus = [r.get("mfu") for r in steady]
    out.update(steady_from_step=start["step"] + 1, steady_steps=end["step"] - start["step"],
               steady_tokens_per_s=(end["tokens"] - start["tokens"]) / seconds if seconds > 0 else None,
               steady_mfu=(sum(m * t for m, t in zip(mfus, spans)) / sum(spans)
                           if None not in mfus and sum(spans) > 0 else None))
    return out


RECOMPILE_LINE = re.compile(r"\[__recompiles(?:_verbose)?\]\s?(.*)")


def recompile_reasons(log_text: str) -> dict:
    """dynamo's recompile messages in a launch's output (TORCH_LOGS=recompiles: "Recompiling function ... triggered by
    the following guard failure(s): ..."), each as one line, and how many came after the first "[harness] step" line
    (the first log interval's end; under static shapes the first step's own new shapes are recompiles too)."""
    reasons, after, seen_step = [], 0, False
    for line in log_text.splitlines():
        if "[harness] step " in line:  # (after a progress bar's carriage returns, where there is one)
            seen_step = True
        m = RECOMPILE_LINE.search(line)
        if not m:
            continue
        text = m.group(1).strip()
        if text.startswith("Recompiling function"):
            reasons.append(text)
            after += seen_step
        elif reasons and text and not text.startswith("triggered by"):
            reasons[-1] += " | " + text
    return {"count": len(reasons), "after_first_log_line": after, "reasons": reasons[:30]}


def reached_step(log_text: str) -> Optional[int]:
    """The last "[harness] step N/M" a launch printed (a variant stopped at its cap: how far it got)."""
    steps = re.findall(r"\[harness\] step (\d+)/", log_text)
    return int(steps[-1]) if steps else None


def training_row(name: str, run: Path, rep: dict, recs: list[dict]) -> dict:
    """The row of one finished training run, from its report.json and metrics.jsonl."""
    logged = [r for r in recs if "loss" in r]
    steady = logged[1:]  # the first interval holds compilation and warm-up

    def med(key: str):  # None where no interval has it (MFU on a device with no known peak, memory on a CPU)
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    comp = rep.get("compile")
    util = (rep.get("utilisation") or {}).get("metrics", {})
    return {
        "variant": name, "steps": rep.get("steps"), "precision": rep.get("precision"),
        "weights": rep.get("weights"), "zero_stage": rep.get("zero_stage"),
        "compile": {"mode": "none" if rep else None} if not comp else {
            "mode": comp.get("mode"), "cold_compile_s": comp.get("cold_compile_s"),
            "recompiles": comp.get("recompiles_after_first_step"),
            "recompile_limit_hits": len(comp.get("recompile_limit_hit") or []),
            "recompile_limit_functions": comp.get("recompile_limit_hit") or [], "graphs": comp.get("graphs"),
            "ran_compiled": comp.get("ran_compiled"), "block_calls_eager": comp.get("block_calls_eager"),
            "compile_s_total": comp.get("compile_time_total_s"), "first_step_s": comp.get("first_step_s"),
            "warmed_embedding_shapes": comp.get("warmed_embedding_shapes")},
        **steady_state(recs, comp.get("recompiles_after_first_step") if comp else None),
        "attention": rep.get("attention"),
        "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"), "mem_gb": med("mem_gb"),
        "gpu_util": med("gpu_util"),  # NVML's busy share, the log intervals' own means after the first
        "final_loss": rep.get("final_loss"),
        "loss_at": {str(r["step"]): r["loss"] for r in logged if r["step"] in LOSS_STEPS},
        "loss_curve": {str(r["step"]): r["loss"] for r in logged},
        "gpu": (rep.get("hardware", {}).get("gpus") or [{}])[0],
        "padding_share": med("padding_share"), "micro_batch_size": rep.get("micro_batch_size"),
        "tokens_per_s_run": rep.get("tokens_per_s"), "wall_time_s": rep.get("wall_time_s"),
        "gpu_util_mean": util.get("gpu_util", {}).get("mean"), "gpu_util_p10": util.get("gpu_util", {}).get("p10"),
        "cpu_util_mean": util.get("cpu_util", {}).get("mean"),
        "gpu_mem_used_max_gb": util.get("gpu_mem_gb", {}).get("max"),
        "compile_report": comp, "utilisation": rep.get("utilisation"), **rl_figures(run, steady),
    }


def rl_figures(run: Path, steady: list[dict]) -> dict:
    """loss.mode=rl (grpo_1b): generation and training seconds per step apart, and the generation's new tokens/s
    (the step's answers x their mean length / generation seconds), medians over the log intervals after the first."""
    if not steady or "gen_s_per_step" not in steady[-1]:
        return {}
    import yaml

    rl = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("rl") or {}
    answers = rl.get("questions_per_step", 0) * rl.get("num_generations", 0)

    def med(key: str):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    gen_s, length = med("gen_s_per_step"), med("completion_length")
    return {"rl": {"gen_s_per_step": gen_s, "train_s_per_step": med("train_s_per_step"), "completion_length": length,
                   "answers_per_step": answers, "reward": med("reward"),
                   "gen_tokens_per_s": answers * length / gen_s if gen_s and length else None}}


def train_command(name: str, v: Variant, steps: int, out_root: Path, extra: list[str], cpu: bool,
                  ds_patch: Optional[dict]) -> tuple[list[str], Path, dict, list[str]]:
    overrides = list(v.overrides)
    if any("{base}" in o for o in overrides):
        base = make_base(out_root, "default.yaml" if cpu else "gpu-1b.yaml")
        overrides = [o.replace("{base}", str(base)) for o in overrides]
    recipe = "default.yaml" if cpu else "gpu-1b.yaml"
    if cpu:
        extra = ["data.eval_files=[]", "train.log_every=1", *extra]
    patch = deep_merge(v.ds_patch or {}, ds_patch or {}) if v.accel.startswith("zero") else None
    accel_yaml, ds = launch_configs(name, v.accel, patch, out_root, cpu)
    # no final checkpoint: the check reads metrics.jsonl and report.json, and the ~1B model's weights and AdamW state
    # (~13 GB) took seconds to a minute of each variant's cap
    args = [f"train.output_dir={out_root / name}", f"train.max_steps={steps}", "train.resume=null",
            "train.monitor_interval_s=1", "train.save_final_checkpoint=false", *overrides,
            *(v.cpu_overrides if cpu else ()), *extra]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel_yaml), "--num_processes",
           str(v.processes), str(ROOT / "harness" / "train.py"), "--config", str(ROOT / "configs" / recipe), *args]
    return cmd, accel_yaml, {"json": ds, "patch": patch} if ds else None, args


def check_overrides(recipe: str, args: list[str]) -> Optional[str]:
    """The config loader's verdict on the overrides (a key it does not know yet, such as train.weights before it
    lands), in this process and in a second, before any launch time is spent."""
    from harness.config import load_config
    from harness.errors import HarnessError

    try:
        load_config(ROOT / "configs" / recipe, args)
    except HarnessError as e:
        return f"config rejected: {e}"
    return None


def run_variant(name: str, steps: int, out_root: Path, extra: list[str], cpu: bool, timeout_s: float,
                ds_patch: Optional[dict] = None, limit: str = "the call's --budget-min") -> dict:
    v = VARIANTS[name]
    if v.accel == "rft":
        return run_rft_bench(name, out_root, extra, cpu, timeout_s) if name.startswith("rft_bench") or \
            name in RFT_ENGINE_CAP_S else \
            run_rft_generate(name, out_root, extra, cpu, timeout_s)
    if v.accel == "plan":
        return run_plan(name, steps, out_root, extra, cpu, timeout_s)
    cmd, accel_yaml, ds, args = train_command(name, v, steps, out_root, extra, cpu, ds_patch)
    head = {"variant": name, "command": shlex.join(cmd), "accelerate_config": {
        "path": str(accel_yaml), "text": accel_yaml.read_text()}, "deepspeed_config": ds, "note": v.note}
    bad = check_overrides("default.yaml" if cpu else "gpu-1b.yaml", args)
    if bad:
        print(f"  {name}: {bad}", flush=True)
        return {**head, "error": bad}
    run = out_root / name
    shutil.rmtree(run, ignore_errors=True)  # a fresh run: a finished one in the folder would not run again
    log = out_root / f"{name}.log"
    res = launch(cmd, log, cpu, timeout_s, launch_env(v.accel.startswith("zero"), cpu), limit)
    seen = {"log": str(log), "recompile_log": recompile_reasons(res["output"])}
    if "error" in res:  # stopped at its cap, or failed: how far it got and what recompiled, beside its log
        recs, partial = metric_rows(run), {}
        if res["rc"] is None and recs:  # at its cap: what the log intervals it finished measured (steady figures)
            rep = json.loads((run / "report.json").read_text()) if (run / "report.json").is_file() else {}
            partial = training_row(name, run, rep, recs)
        return {**partial, **head, **seen, "error": res["error"], "capped": res["rc"] is None, "cap_s": timeout_s,
                "reached_step": reached_step(res["output"]), "launch_s": res["seconds"]}
    rep = json.loads((run / "report.json").read_text())
    row = training_row(name, run, rep, metric_rows(run))
    print(f"  utilisation, training: {describe(rep.get('utilisation'))}; steady from step "
          f"{row['steady_from_step']}: {row['steady_tokens_per_s'] or 0:,.0f} tokens/s; recompiles after step 1: "
          f"{row['compile'].get('recompiles', '-')} (last at step {row['last_recompile_step']})", flush=True)
    return {**row, **head, **seen, "cap_s": timeout_s, "launch_s": res["seconds"],
            "utilisation_whole_launch": res["whole"]}


# ----------------------------------------------------------------------------------------------- point 5


SEED_FIGURES = {"device": "A100", "generation_vs_one_by_one": "6-10x faster", "gpu_busy_percent": "90-95",
                "batch_sequences": 256, "source": "the seed harness's figures quoted in issue 39"}


def point5_row(name: str, head: dict) -> dict:
    """The required keys of a row that is not a training run (None where they do not apply)."""
    keys = ("steps", "precision", "weights", "zero_stage", "compile", "attention", "tokens_per_s", "mfu", "mem_gb",
            "gpu_util", "final_loss", "loss_at", "gpu")
    return {"variant": name, **{k: None for k in keys}, **head}


def rft_overrides(out_root: Path, name: str, cpu: bool) -> tuple[list[str], Path]:
    base = make_base(out_root, "default.yaml" if cpu else "gpu-1b.yaml", tokenizer_vocab=True)
    gen = out_root / name / "generate"
    over = [f"model.name_or_path={base}", f"rft.output_dir={gen}", "data.train_files=[data/sample/gen.jsonl]"]
    if cpu:  # a few seconds on two cores
        over += ["rft.num_train_questions=32", "rft.oversample=4", "rft.max_new_tokens=16"]
    return over, gen


def gpu_name() -> Optional[dict]:
    from harness.hardware import environment_report

    return (environment_report().get("gpus") or [None])[0]


def run_rft_generate(name: str, out_root: Path, extra: list[str], cpu: bool, timeout_s: float) -> dict:
    """`harness rft generate configs/rft-tiny.yaml` on a random-init copy of the recipe's model: its stats.json
    (sequences/s), the batch (settings, and the OOM halvings its log reports), the GPU busy share around it."""
    from harness.config import load_config

    over, gen = rft_overrides(out_root, name, cpu)
    over += [*VARIANTS[name].overrides, *extra]
    shutil.rmtree(out_root / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "harness.cli", "rft", "generate", str(ROOT / "configs" / "rft-tiny.yaml"), *over]
    head = {"command": shlex.join(cmd), "note": VARIANTS[name].note, "gpu": gpu_name()}
    res = launch(cmd, out_root / f"{name}.log", cpu, timeout_s)
    if "error" in res:
        return point5_row(name, {**head, "error": res["error"]})
    stats = json.loads((gen / "stats.json").read_text())
    r = load_config(ROOT / "configs" / "rft-tiny.yaml", over).rft
    halved = [int(x) for x in re.findall(r"micro-batch halved to (\d+) sequences", res["output"])]
    gen_s = stats["sequences_this_run"] / max(stats["sequences_per_s"], 1e-9)  # seconds inside generate()
    busy = [s["gpu_util"] for s in res["samples"] if s.get("gpu_util") is not None]
    dtype = re.search(r"device \S+, (torch\.\w+)\)", res["output"])
    flight = re.search(r"(\d+) sequences in flight at most", res["output"])
    return point5_row(name, {
        **head, "precision": dtype.group(1).removeprefix("torch.") if dtype else None,
        "sequences_per_s": stats["sequences_per_s"],
        "tokens_per_s": stats.get("new_tokens_per_s"), "engine": stats.get("engine"),
        "slot_waste": stats.get("slot_waste"), "seed": SEED_FIGURES,
        "tokens_per_s_bound": stats["sequences_per_s"] * r.max_new_tokens,  # every sequence at max_new_tokens
        "generate_s": gen_s, "launch_s": res["seconds"],
        "gpu_util": 100 * min(1.0, sum(busy) / 100 * 1.0 / gen_s) if busy and gen_s > 0 else None,
        "gpu_util_note": "NVML busy samples (1 s) around the whole command / seconds inside generate()",
        "batch": {"questions_per_batch": r.questions_per_batch, "oversample": r.oversample,
                  "sequences_per_batch": r.questions_per_batch * r.oversample,
                  "micro_batch_sequences": r.micro_batch_sequences, "oom_halvings": halved,
                  "micro_batch_sequences_final": halved[-1] if halved else r.micro_batch_sequences,
                  "max_new_tokens": r.max_new_tokens, "sequences_in_flight": int(flight.group(1)) if flight else None},
        "model": over[0].split("=", 1)[1], "stats": stats, "utilisation_whole_launch": res["whole"]})


def run_rft_bench(name: str, out_root: Path, extra: list[str], cpu: bool, timeout_s: float) -> dict:
    """`harness rft bench` (rft_bench: --questions 2, engines one, static, continuous; rft_bench_mixed: 32 questions
    x 16 samples, max_new_tokens 200, static and continuous): its JSON (per engine tokens/s, sequences/s, padding
    share, GPU busy share; the greedy identity)."""
    over, _ = rft_overrides(out_root, name, cpu)
    over += [*VARIANTS[name].overrides, *extra]
    mixed = name == "rft_bench_mixed"
    if mixed and not cpu:
        over += ["rft.oversample=16"]
    result = out_root / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "harness.cli", "rft", "bench", str(ROOT / "configs" / "rft-tiny.yaml"),
           "--questions", "32" if mixed and not cpu else "2", "--engines",
           "static,continuous" if mixed else "one,static,continuous", "--json", str(result), *over]
    if name in RFT_ENGINE_CAP_S:  # issue 46: one engine beside static, 256 in flight, under its own cap
        timeout_s = timeout_s if cpu else min(timeout_s, RFT_ENGINE_CAP_S[name])
        cmd[cmd.index("--questions") + 1] = "8" if cpu else "64"
        cmd[cmd.index("--engines") + 1] = "static," + ("transformers" if name in ("rft_engine_transformers", "visit_engine_tf") else
                                                         "continuous")
        cmd += ["--repeats", "3", "rft.micro_batch_sequences=256", "rft.questions_per_batch=16",
                *([] if cpu else ["rft.oversample=16"])]
        if name.startswith("visit_engine"):  # issue 57: the engine alone (no static beside it) on the mixed workload
            cmd[cmd.index("--engines") + 1] = cmd[cmd.index("--engines") + 1].removeprefix("static,")
            cmd += [*BENCH_MIXED, *(["rft.max_new_tokens=16"] if cpu else [])]
            if cpu:  # the code path, not the figures: one small round
                cmd[cmd.index("--questions") + 1], cmd[cmd.index("--repeats") + 1] = "2", "1"
    head = {"command": shlex.join(cmd), "note": VARIANTS[name].note, "gpu": gpu_name(), "seed": SEED_FIGURES}
    res = launch(cmd, out_root / f"{name}.log", cpu, timeout_s)
    if "error" in res:
        return point5_row(name, {**head, "error": res["error"]})
    bench = json.loads(result.read_text())
    ways = bench["rows"]
    best = ways[-1] if ways else {}
    return point5_row(name, {**head, "ways": ways, "sequences_per_s": best.get("sequences_per_s"),
                             "tokens_per_s": best.get("new_tokens_per_s"), "gpu_util": best.get("gpu_busy"),
                             "greedy": bench.get("greedy"), "settings": bench["settings"], "launch_s": res["seconds"],
                             "utilisation_whole_launch": res["whole"]})


def run_plan(name: str, steps: int, out_root: Path, extra: list[str], cpu: bool, timeout_s: float) -> dict:
    """`harness plan` for `steps` steps of the recipe (calibrated under the run's own launcher), then the run: its
    report.json `plan` (estimate, actual, error)."""
    recipe = ROOT / "configs" / ("default.yaml" if cpu else "gpu-1b.yaml")
    accel_yaml = ROOT / "accelerate_configs" / ("cpu.yaml" if cpu else "single_gpu.yaml")
    run = out_root / name
    shutil.rmtree(run, ignore_errors=True)
    args = [f"train.output_dir={run}", f"train.max_steps={steps}", "train.resume=null", "train.monitor_interval_s=1",
            *(["data.eval_files=[]", "train.log_every=5"] if cpu else []), *extra]
    launcher = shlex.join([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel_yaml),
                           "--num_processes", "1"])
    plan_cmd = [sys.executable, "-m", "harness.cli", "plan", str(recipe), *args, "--hours", "1", "--margin-minutes",
                "0", "--launcher", launcher, *(["--steps", "5"] if cpu else [])]
    train_cmd = [*shlex.split(launcher), str(ROOT / "harness" / "train.py"), "--config", str(recipe), *args]
    head = {"command": shlex.join(plan_cmd) + " && " + shlex.join(train_cmd), "note": VARIANTS[name].note,
            "accelerate_config": {"path": str(accel_yaml), "text": accel_yaml.read_text()}, "deepspeed_config": None}
    t0 = time.time()
    res = launch(plan_cmd, out_root / f"{name}.plan.log", cpu, timeout_s)
    if "error" in res:
        return point5_row(name, {**head, "error": "harness plan: " + res["error"]})
    plan_s = res["seconds"]
    res = launch(train_cmd, out_root / f"{name}.log", cpu, timeout_s - (time.time() - t0))
    if "error" in res:
        return point5_row(name, {**head, "error": res["error"]})
    rep = json.loads((run / "report.json").read_text())
    row = training_row(name, run, rep, metric_rows(run))
    plan = rep.get("plan") or {}
    planned = json.loads((run / "plan.json").read_text())
    est, act = plan.get("estimated_s"), plan.get("actual_s")
    return {**row, **head, "plan": {  # actual_s: the training process (report.json); launch_wall_s: with the launcher
        "estimated_s": est, "actual_s": act, "error_pct": plan.get("error_pct"), "launch_wall_s": res["seconds"],
        "error_pct_vs_launch_wall": 100 * (est - res["seconds"]) / res["seconds"] if est else None,
        "ratio_actual_to_estimate": act / est if est and act else None, "within_5pct": (
            abs(plan["error_pct"]) <= 5 if plan.get("error_pct") is not None else None),
        "same_config": plan.get("same_config"), "phases": plan.get("phases"),
        "derivations": planned.get("derivations"), "plan_command_s": plan_s}, "launch_s": res["seconds"],
        "utilisation_whole_launch": res["whole"]}


# ----------------------------------------------------------------------------------------------- the bench file


def compare(rows: list[dict], earlier: list[dict]) -> None:
    """Loss gap (% at the last common loss_at step, 100 where reached) and tokens/s ratio against the reference
    variants, from this call's rows or the latest earlier row of the same steps in the bench file."""
    def ref_row(name: Optional[str], steps) -> Optional[dict]:
        for r in reversed(rows + earlier):
            if r.get("variant") == name and "error" not in r and r.get("steps") == steps:
                return r
        return None

    for r in rows:
        v = VARIANTS.get(r["variant"])
        if v is None or "error" in r:
            continue
        ref = ref_row(v.loss_ref, r.get("steps"))
        if ref:
            common = sorted(set(r.get("loss_at") or {}) & set(ref.get("loss_at") or {}), key=int)
            at = common[-1] if common else None
            if at is not None:
                r["loss_vs_ref"] = {"ref": v.loss_ref, "step": int(at), "loss": r["loss_at"][at],
                                    "ref_loss": ref["loss_at"][at],
                                    "gap_pct": 100 * (r["loss_at"][at] - ref["loss_at"][at]) / ref["loss_at"][at]}
        sref = ref_row(v.speed_ref, r.get("steps"))
        if sref and r.get("tokens_per_s") and sref.get("tokens_per_s"):
            r["speed_vs_ref"] = {"ref": v.speed_ref, "ratio": r["tokens_per_s"] / sref["tokens_per_s"]}


def read_bench(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"device": None, "rows": [], "calls": []}


def append_rows(path: Path, call: dict, rows: list[dict], device: str) -> None:
    """Add rows (and, once, the call's record) to the day's file; written atomically, never overwriting rows."""
    data = read_bench(path)
    data["device"] = data.get("device") or device
    calls = data.setdefault("calls", [])
    if not any(c.get("id") == call["id"] for c in calls):
        calls.append(call)
    else:
        calls[[c.get("id") for c in calls].index(call["id"])] = call
    data.setdefault("rows", []).extend({**r, "call": call["id"]} for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"\n{'variant':<24}{'tokens/s':>10}{'MFU':>7}{'mem GB':>8}{'util':>6}{'compile':>9}{'cold s':>7}"
          f"{'recomp':>7}{'loss@100':>9}{'final':>8}{'vs ref':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<24} failed: {r['error'][:300]}")
            continue
        c = r.get("compile") or {}
        gap = (r.get("loss_vs_ref") or {}).get("gap_pct")
        print(f"{r['variant']:<24}{r.get('tokens_per_s') or 0:>10,.0f}{(r.get('mfu') or 0) * 100:>6.1f}%"
              f"{r.get('mem_gb') or nan:>8.1f}{r.get('gpu_util') if r.get('gpu_util') is not None else nan:>5.0f}%"
              f"{c.get('mode') or '-':>9}{c.get('cold_compile_s') if c.get('cold_compile_s') is not None else nan:>7.1f}"
              f"{c.get('recompiles') if c.get('recompiles') is not None else '-':>7}"
              f"{(r.get('loss_at') or {}).get('100', nan):>9.4f}{r.get('final_loss') or nan:>8.4f}"
              f"{f'{gap:+.2f}%' if gap is not None else '-':>9}")
        if r.get("plan"):
            p = r["plan"]
            print(f"  plan: estimated {p['estimated_s'] or nan:.1f} s, actual {p['actual_s'] or nan:.1f} s "
                  f"({p['error_pct'] or nan:+.1f}%)")
        if r.get("rl"):
            g = r["rl"]
            print(f"  rl: generation {g['gen_s_per_step'] or nan:.2f} s/step ({g['gen_tokens_per_s'] or nan:,.0f} "
                  f"new tokens/s), training {g['train_s_per_step'] or nan:.2f} s/step")
        if r.get("sequences_per_s") is not None:
            print(f"  rft: {r['sequences_per_s']:.1f} sequences/s, tokens/s {r.get('tokens_per_s')}, "
                  f"batch {json.dumps(r.get('batch'))}")


# ----------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="one issue-25 point's variants and steps")
    ap.add_argument("--variants", help=f"comma-separated (default {DEFAULT}); --list shows them")
    ap.add_argument("--steps", type=int, help="optimizer steps per variant (default: the preset's, else 30)")
    ap.add_argument("--ds-patch", help="JSON merged into every DeepSpeed variant's config (after its own patch)")
    ap.add_argument("--budget-min", type=float, default=9.5,
                    help="the call's wall-time limit in minutes: refused when the estimate is above it, and a "
                         "variant still running at the limit is stopped (0: no limit)")
    ap.add_argument("--cap-s", type=float, help="every variant's own time cap in seconds (default: each variant's "
                                                 "cap_s, else 1.5x its estimate + 60 s; --cpu-smoke: 600)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="run folders and gpu_check.json")
    ap.add_argument("--bench-out", help="rows are appended here (default docs/bench/gpu-<UTC date>.json; "
                                        "with --cpu-smoke <out>/gpu-<UTC date>.json)")
    ap.add_argument("--list", action="store_true", help="print the presets and variants with estimates and exit")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help=f"check the script on a CPU: tiny default recipe, variants {SMOKE_DEFAULT} unless given")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for every variant")
    args = ap.parse_args()
    if args.list:
        for p, (vs, st) in PRESETS.items():
            est = sum(min(estimate_s(n, own), own_cap(p, n, own)) for n, own in parse_names(",".join(vs), st))
            print(f"--preset {p:<14} {st:>4} steps  ~{fmt_min(est):>8}  {','.join(vs)}")
        for name, v in VARIANTS.items():
            patch = f" ds_patch {json.dumps(v.ds_patch)}" if v.ds_patch else ""
            print(f"  {name:<22} {v.accel:<11} {' '.join(v.overrides):<60}{patch} {v.note}")
        print(f"  aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())}")
        return 0
    text = (args.variants or (",".join(PRESETS[args.preset][0]) if args.preset else
                              SMOKE_DEFAULT if args.cpu_smoke else DEFAULT))
    steps = args.steps or (10 if args.cpu_smoke else PRESETS[args.preset][1] if args.preset else 30)
    plan = parse_names(text, steps)  # [(variant, its steps)]: a "name:N" entry runs N steps
    if args.steps:  # --steps applies to every variant
        plan = [(n, args.steps) for n, _ in plan]
    names = [n for n, _ in plan]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"gpu_check: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)} "
              f"(or aliases {', '.join(ALIASES)})", file=sys.stderr)
        return 2
    try:
        ds_patch = json.loads(args.ds_patch) if args.ds_patch else None
    except json.JSONDecodeError as e:
        print(f"gpu_check: --ds-patch is not JSON ({e})", file=sys.stderr)
        return 2
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run it on a GPU machine (or --cpu-smoke to check the script)",
              file=sys.stderr)
        return 2
    # a variant runs at most its cap: a preset sized by caps (visit) is estimated by them
    est = sum(min(estimate_s(n, st), own_cap(args.preset, n, st)) for n, st in plan)
    each = ", ".join(f"{n} x {st} steps {estimate_s(n, st):.0f} s (cap {own_cap(args.preset, n, st):.0f} s)"
                     for n, st in plan)
    print(f"gpu_check: {len(names)} variant(s); estimated on one H100: {fmt_min(est)}: {each}", flush=True)
    if args.budget_min and not args.cpu_smoke and est > 60 * args.budget_min:
        print(f"gpu_check: estimated {fmt_min(est)} > --budget-min {args.budget_min:g}: split the variants over two "
              f"calls (or --budget-min 0 to run anyway)", file=sys.stderr)
        return 2
    out_root = Path(args.out).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    device = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    bench = Path(args.bench_out) if args.bench_out else (
        (out_root if args.cpu_smoke else ROOT / "docs" / "bench") / f"gpu-{now:%Y-%m-%d}.json")
    earlier = read_bench(bench)["rows"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    import accelerate
    import transformers

    try:
        import deepspeed  # noqa: F401 - its version for the record
        ds_version = deepspeed.__version__
    except Exception:  # noqa: BLE001 - not installed, or it fails to import without a toolchain
        ds_version = None
    call = {"id": f"{now:%H%M%S}-{os.getpid()}", "started": now.isoformat(timespec="seconds"), "device": device,
            "argv": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "preset": args.preset, "variants": names,
            "steps": steps, "plan": [[n, st, own_cap(args.preset, n, st)] for n, st in plan], "estimate_s": est, "commit": commit,
            "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__, "deepspeed": ds_version,
            "overrides": args.overrides, "ds_patch": ds_patch}
    print(f"gpu_check: rows -> {bench} (appended), {out_root / 'gpu_check.json'}", flush=True)
    t0, rows = time.time(), []
    for i, (name, own_steps) in enumerate(plan):
        left = 60 * args.budget_min - (time.time() - t0) if args.budget_min else 3600.0
        if args.cpu_smoke:  # a CPU is far slower than the H100 the estimates and caps are sized for
            left = max(left, 600.0)
        own = args.cap_s or (600.0 if args.cpu_smoke else own_cap(args.preset, name, own_steps))
        cap, limit = (own, f"the variant's cap of {own:.0f} s") if own < left else (left, "the call's --budget-min")
        if left < 30:
            row = {"variant": name, "error": f"skipped: {args.budget_min:g} min of the call spent"}
        else:
            row = run_variant(name, own_steps, out_root, args.overrides, args.cpu_smoke, cap, ds_patch, limit)
        rows.append(row)
        compare(rows, earlier)
        call.update(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    wall_s=time.time() - t0)
        append_rows(bench, call, [row], device)  # now: a call cut off later keeps this row
    # the comparisons may have gained references from later rows of the call: rewrite this call's rows
    data = read_bench(bench)
    mine = iter(rows)
    data["rows"] = [{**next(mine), "call": call["id"]} if r.get("call") == call["id"] else r for r in data["rows"]]
    tmp = bench.with_name(bench.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, bench)
    print_table(rows)
    result = {**call, "date": call["started"], "rows": rows}
    (out_root / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(f"\nwritten {out_root / 'gpu_check.json'} and {bench} ({len(data['rows'])} rows)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

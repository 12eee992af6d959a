"""GPU memory per process for each ZeRO stage, and the lowest stage that fits (`launch/train.sh --zero auto`).

    harness zero-plan configs/llama-7b.yaml --gpus 8 --gpu-mem-gb 80
    harness zero-plan configs/llama-70b.yaml --gpus 8 --nodes 2 --gpu-mem-gb 80 data.max_len=2048

The arithmetic, printed line by line (GiB = 2**30 bytes):

* Parameters P are counted by arithmetic on the model's config (harness/tools/config_shape.py, no torch), else on
  the `meta` device as harness.model.build_model builds it (tokenizer-sized embeddings included either way).
* Model states take 16 bytes per parameter. With fp32 weights (train.weights=fp32, the default: autocast over fp32
  weights on every path, DeepSpeed's torch_autocast under ZeRO): fp32 weights 4 + fp32 gradients 4 + Adam m 4 +
  Adam v 4; partitioned over the N data-parallel processes: stage 1 the optimizer states (8), stage 2 also the
  gradients (4), stage 3 also the weights (4). With 16-bit weights (train.weights=bf16, or DeepSpeed's fp16 mode):
  16-bit weights 2 + 16-bit gradients 2 + fp32 master weights 4 + Adam 8; stage 1 partitions the master and Adam
  (12). Stage 0 is plain DDP with fp32 weights 4 + fp32 gradients 4 + Adam 8, none partitioned, plus DDP's gradient
  buckets (another 4 bytes) when N > 1; with train.weights=bf16 it is DeepSpeed without ZeRO (2 + 2 + 12, buckets 2).
* ZeRO-3 gathers the weights of the layer it computes and prefetches the next: 2 x the largest layer (or embedding)
  x the weights' bytes. `3-offload` (accelerate_configs/zero3_offload.yaml) keeps weights and optimizer states in
  host memory: the GPU holds that working set, host memory holds 4 + 4 (fp32 gradients) + 8 = 16 bytes per
  parameter (2 + 4 master + 4 + 8 = 18 with 16-bit weights), spread over the nodes.
* Activations for one micro-batch of T = micro_batch_size x max_len tokens (embedding passes: queries and
  passages of one micro-batch, divided by loss.grad_cache_chunks; unified mode back-propagates one pass at a time,
  so the larger counts). What autograd keeps per layer and token in a Llama-style block with b-byte activations:
  the 2 RMSNorm inputs upcast to fp32 (2 x 4h) + b x [q/k/v input h + q, k, v (h + 2 h_kv) + rotated q, k
  (h + h_kv) + attention output h + MLP input h + gate, up, act(gate), act(gate)*up 4i] = 8h + b(5h + 3h_kv + 4i)
  bytes (checked against the tensors torch saves, tests/test_memory.py); eager attention adds the score matrix
  (a x seq values in 16 bits + fp32 softmax: 6 bytes). With gradient checkpointing only each layer's input (b x h)
  is kept, plus one layer's full set during its recomputation. Logits: T x vocab x 10 bytes (bf16 logits 2 + fp32
  log-softmax 4 kept, + the fp32 gradient 4 when backward starts); with the chunked loss (loss.chunked_ce, on under
  auto once the fp32 logits would pass 256 MiB) one chunk of loss.chunked_ce_size positions at a time instead.
* A fixed overhead per GPU for the CUDA context, NCCL and library workspaces (--overhead-gb, default 2 GiB), and
  a margin for the allocator's fragmentation (--margin, default 10% of the GPU).

LoRA / QLoRA (model.lora.enabled, model.quantization): the T trainable parameters (adapters r x (in + out) per
targeted Linear, counted on the meta model, plus added token rows) take the 16 bytes above, partitioned the same
way; the frozen base F takes only its storage: the weights' bytes (4, or 2 with 16-bit weights under DeepSpeed),
and with model.quantization its Linear weights (output head excepted) at 0.5 + 1/64 + 4/16384 = 0.516 B/param (4bit: nf4
with double quantisation) or 1 B/param (8bit), the rest (embeddings, head, norms) at the stage's weight bytes. The
frozen base is partitioned only under ZeRO-3, which refuses quantized weights (the rows say "not supported").
A recipe with a hub model.name_or_path and the architecture in model.config (with model_type) is sized offline from
model.config; without it from the config.json of the folder, or of the hub id in the local hub cache.

loss.mode=rl (GRPO): the training pass is a micro-batch of sampled answers (rows of longest prompt +
rft.max_new_tokens positions), and the generation engine's KV cache sits beside the training state, kept through the
training pass (column gen); under ZeRO-3 the generation gathers the full weights. The arithmetic: harness/tools/rl_plan.py.

loss.mode=distill: the frozen teacher's weights (column teacher: no gradients, no optimizer states; partitioned
under ZeRO-3, in host memory under 3-offload), its hidden states and its working set, and the KV cache of the
engines that sample completions (column gen). The arithmetic: harness/tools/distill_plan.py.

It prints the table and ends with one line `choice: zero0|zero1|zero2|zero3|zero3_offload|none`; exit status 0
when a stage fits, 3 when none does (the table says how many GPUs would be needed).

Proposals. When the recipe needs CPU offload (or fits nowhere) but overrides make stage 0-3 fit, a line with the
arithmetic and `proposed: zeroN <overrides> -> accelerate_configs/...` before the choice say so (exit 0);
launch/train.sh --zero auto adds the overrides. Cheapest first: where one row of data.max_len tokens does not fit
even one to a micro-batch, train.sequence_parallel=N, the smallest N that fits (activations per GPU / N, stages 1-3;
no recomputation, an all-to-all inside the node); model.gradient_checkpointing=true (the forward computed twice);
both. Where one row fits (the micro-batch is too large), checkpointing only. None for a key the recipe sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple, Optional

from harness.config import Config, load_config, lora_config, recipe_args
from harness.errors import HarnessError
from harness.tools.sizing import GIB, ModelShape, activation_terms, model_shape, moe_line, sp_sizes, with_overrides
from harness.tools.state_bytes import QUANT_BYTES, frozen_bytes, host_bytes, state_lines, weight_bytes  # noqa: F401
from harness.config.derived import planned_weights
from harness.config.modes import facts
from harness.tools import rl_plan
from harness.tools.distill_plan import TeacherPlan
OPTIONS = ["0", "1", "2", "3", "3-offload"]
ACCELERATE_CONFIG = {"0": "multi_gpu", "1": "zero1", "2": "zero2", "3": "zero3", "3-offload": "zero3_offload"}


@dataclass
class Hardware:
    gpus_per_node: int
    gpu_mem_gb: float
    nodes: int = 1
    host_mem_gb: Optional[float] = None  # per node; None: not checked

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Row:
    option: str
    weights: float
    grads: float
    optim: float
    extra: float
    activations: float
    overhead: float
    host: float = 0.0
    supported: bool = True  # False: QLoRA under ZeRO-3 (bitsandbytes' weights cannot be partitioned)
    generation: float = 0.0  # loss.mode=rl: the engine's KV cache, kept through the training pass (+ reference copy)
    gen_peak: float = 0.0  # loss.mode=rl, while generating in place of extra + activations (harness/tools/rl_plan.py)
    teacher: float = 0.0  # loss.mode=distill: the frozen teacher's weights (harness/tools/distill_plan.py)

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optim + self.overhead + self.generation + self.teacher
                + max(self.extra + self.activations, self.gen_peak))


def state_row(option: str, shape: ModelShape, hw: Hardware, activations: float, overhead: float,
              quantization: str = "none", weights: str = "fp32") -> Row:
    """Model-state bytes per GPU for one option (see the module docstring for the byte counts). `weights`: the
    parameters' dtype under DeepSpeed (fp32, bf16, fp16: harness.config.derived.planned_weights)."""
    if shape.trainable is not None:
        return lora_row(option, shape, hw, activations, overhead, quantization, weights)
    P, N = shape.params, hw.world
    w, g, o = weight_bytes(option, weights)
    if option == "0":
        return Row(option, w * P, g * P, o * P, g * P if N > 1 else 0, activations, overhead)
    working = 2 * max(shape.layer_params, shape.embed_params) * w
    if option == "3-offload":
        host = host_bytes(w) * P * hw.gpus_per_node / N
        return Row(option, 0, 0, 0, working, activations, overhead, host=host)
    stage = int(option)
    return Row(option, w * P / (N if stage >= 3 else 1), g * P / (N if stage >= 2 else 1), o * P / N,
               working if stage == 3 else 0, activations, overhead)


def lora_row(option: str, shape: ModelShape, hw: Hardware, activations: float, overhead: float,
             quantization: str, weights: str = "fp32") -> Row:
    """LoRA/QLoRA: optimizer states and gradients for the T trainable parameters only (16 B/param, partitioned like a
    full fine-tune); the frozen base at its storage bytes (the weights' bytes: fp32 4, 16-bit 2 under DeepSpeed's
    bf16 / fp16 modes; quantized Linears at QUANT_BYTES), partitioned only under ZeRO-3. QLoRA under ZeRO-3: not
    supported."""
    T, N = shape.trainable, hw.world
    w, g, o = weight_bytes(option, weights)
    if option == "0":
        return Row(option, frozen_bytes(shape, quantization, w) + w * T, g * T, o * T, g * T if N > 1 else 0,
                   activations, overhead)
    if quantization != "none" and option in ("3", "3-offload"):
        return Row(option, 0, 0, 0, 0, activations, overhead, supported=False)
    working = 2 * max(shape.layer_params, shape.embed_params) * w
    base = frozen_bytes(shape, quantization, w)
    if option == "3-offload":
        host = (base + host_bytes(w) * T) * hw.gpus_per_node / N
        return Row(option, 0, 0, 0, working, activations, overhead, host=host)
    stage = int(option)
    return Row(option, (base + w * T) / (N if stage >= 3 else 1), g * T / (N if stage >= 2 else 1), o * T / N,
               working if stage == 3 else 0, activations, overhead)


class Budget(NamedTuple):
    """What each option is sized against: hardware, bytes an activation, usable and overhead GiB a GPU, weights."""
    hw: Hardware
    w: int
    usable: float
    overhead_gb: float
    weights: str = "fp32"


def _table(cfg: Config, shape: ModelShape, budget: Budget, gen=None,
           teacher=None) -> tuple[list[str], list[Row], Optional[str]]:
    """Activation lines (budget.w: bytes per activation value), the table rows and the lowest option that fits;
    `gen`: loss.mode=rl's GenerationPlan, `teacher`: loss.mode=distill's TeacherPlan (what each adds to a row)."""
    hw, w, usable, overhead_gb, weights = budget
    out = [f"activations ({'16-bit' if w == 2 else 'fp32'}, micro-batch {cfg.train.micro_batch_size}, "
           f"max_len {cfg.data.max_len}, gradient checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}):"]
    act_lines, act = activation_terms(cfg, shape, w)
    out += [f"  {x}" for x in act_lines]
    out.append(f"fixed overhead per GPU (CUDA context, NCCL, workspaces): {overhead_gb:g} GiB; extra = DDP gradient "
               "buckets (stage 0) or the ZeRO-3 working set")
    rows = [state_row(o, shape, hw, act, overhead_gb * GIB, cfg.model.quantization, weights) for o in OPTIONS]
    for r in rows:  # loss.mode=rl: the generation's cache beside the training state; distill: the teacher too
        for part in (p for p in (gen, teacher) if p is not None):
            part.apply(r, weight_bytes(r.option.split("-")[0], weights)[0])
    out += ["", f"{'stage':<10}{'weights':>9}{'grads':>9}{'optim':>9}{'extra':>9}{'activ':>9}"
            + (f"{'gen':>9}" if gen or teacher else "") + (f"{'teacher':>9}" if teacher else "")
            + f"{'overhead':>9}{'total':>9}  GiB per GPU"]
    choice = None
    for r in rows:
        if not r.supported:
            out.append(f"{r.option:<10}{'':>54}  not supported (model.quantization={cfg.model.quantization}: "
                       "bitsandbytes' weights cannot be partitioned)")
            continue
        fits = r.total / GIB <= usable
        note = "fits" if fits else "too big"
        if r.option == "3-offload":
            host_ok = hw.host_mem_gb is None or r.host / GIB <= 0.9 * hw.host_mem_gb
            have = "not checked" if hw.host_mem_gb is None else f"of {hw.host_mem_gb:.0f} GiB"
            note += f"; host memory {r.host / GIB:.1f} GiB per node ({have})"
            fits = fits and host_ok
            if not host_ok:
                note += " too big"
        out.append(f"{r.option:<10}" + "".join(f"{x / GIB:>9.1f}" for x in (
            r.weights, r.grads, r.optim, r.extra, r.activations, *((r.generation,) if gen or teacher else ()),
            *((r.teacher,) if teacher else ()), r.overhead, r.total))
            + f"  {note}")
        if fits and choice is None and not (r.option == "0" and cfg.train.sequence_parallel > 1):
            choice = r.option  # (sequence parallelism runs under ZeRO 1-3)
    return out, rows, choice


@dataclass
class Plan:
    text: str
    choice: Optional[str]  # an OPTIONS entry, or None when nothing fits
    rows: list[Row]
    shape: ModelShape
    usable_gb: float
    # a stage 0-3 that fits with the overrides `proposal_args` (train.sequence_parallel=N and/or
    # model.gradient_checkpointing=true) when the recipe as given needs CPU offload or fits nowhere (printed as
    # `proposed: zeroN <overrides> -> ...`)
    proposal: Optional[str] = None
    proposal_args: tuple = ()


CHECKPOINTING = "model.gradient_checkpointing=true"


def plan(cfg: Config, hw: Hardware, margin: float = 0.10, overhead_gb: float = 2.0, source: str = "",
         shape: Optional[ModelShape] = None) -> Plan:
    shape = shape or model_shape(cfg)
    # auto: a GPU's bf16; fp8: bf16 bytes (torchao's Float8Linear keeps its inputs in bf16 for the backward and
    # casts to float8 per matmul; the weights, gradients and optimizer states are the bf16 run's)
    compute = cfg.train.precision if cfg.train.precision not in ("auto", "fp8") else "bf16"
    w = 4 if compute == "fp32" else 2  # bytes per activation value
    # the parameters' dtype under DeepSpeed: train.weights in bf16 runs (fp32 by default: torch_autocast), fp16 mode
    weights = planned_weights(compute, cfg.train.weights, True)
    usable = hw.gpu_mem_gb * (1 - margin)
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    out = [
        f"zero-plan: {source or 'recipe'} on {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of {hw.gpu_mem_gb:g} GiB "
        + (f"= {hw.world} processes ({hw.world // cfg.train.sequence_parallel} data-parallel x sequence parallel "
           f"{cfg.train.sequence_parallel})" if cfg.train.sequence_parallel > 1 else
           f"= {hw.world} data-parallel processes") + f"; usable per GPU {usable:.1f} GiB ({margin:.0%} margin)",
    ]
    if shape.note:
        out.append(shape.note)
    out += [
        f"model: {shape.model_type}, P = {shape.params:,} parameters ({size}): hidden h={shape.hidden}, "
        f"intermediate i={shape.intermediate}, {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} kv), "
        f"vocab {shape.vocab}" + moe_line(shape),
    ]
    out += state_lines(cfg, shape, hw.world, weights)
    gen = None
    if cfg.loss.mode == "rl":  # the training pass is the answers' rows; the generation's cache sits beside it
        from harness.model import load_run_tokenizer  # lazy: start-up time (torch: rl's prompts' tokens alone)
        tokenizer = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
        gen = rl_plan.GenerationPlan(cfg.rl, cfg.rft, cfg.train, shape, rl_plan.prompt_tokens(cfg.rft, tokenizer),
                                     hw.world, lora_config(cfg.model).enabled)
        out += gen.lines(weight_bytes("3", weights)[0])
        cfg = rl_plan.training_view(cfg, hw.world, gen.memory(w).width)
    seq = cfg.data.max_len if cfg.data.max_len != "auto" else \
        int(cfg.model.config.get("max_position_embeddings", 0) or 4096)  # (activation_terms' bound under auto)
    teacher = TeacherPlan(cfg.distill, cfg.model, (cfg.train.micro_batch_size, seq), shape, compute, hw) \
        if "distill" in facts(cfg.loss.mode).sections else None
    out += teacher.lines(weight_bytes("3", weights)[0]) if teacher else []
    budget = Budget(hw, w, usable, overhead_gb, weights)
    table, rows, choice = _table(cfg, shape, budget, gen, teacher)
    out += table
    proposal: Optional[str] = None
    proposal_args: tuple = ()
    if choice not in OPTIONS[:4]:
        # what makes a stage 0-3 fit without CPU offload, cheapest first (docstring: "Proposals")
        for sp, ckpt in _proposals(cfg, shape, budget, gen, teacher):
            trial = with_overrides(cfg, sp, ckpt)
            _, t_rows, t_choice = _table(trial, shape, budget, gen, teacher)
            if t_choice not in OPTIONS[:4]:
                continue
            r = t_rows[OPTIONS.index(t_choice)]
            proposal = t_choice
            proposal_args = ((f"train.sequence_parallel={sp}",) if sp > 1 else ()) + ((CHECKPOINTING,) if ckpt else ())
            seq = cfg.data.max_len
            how = " and ".join(
                ([f"sequence parallelism (train.sequence_parallel={sp}: each GPU holds {seq} / {sp} = {seq // sp} "
                  f"positions of every row)"] if sp > 1 else [])
                + ([f"activation checkpointing ({CHECKPOINTING})"] if ckpt else []))
            out.append(f"with {how}: activations {r.activations / GIB:.1f} GiB, stage {t_choice} fits at "
                       f"{r.total / GIB:.1f} GiB per GPU (of {usable:.1f}), before "
                       + ("CPU offload" if choice == "3-offload" else "any stage fits without it"))
            break
    if choice not in OPTIONS[:4]:
        room = usable - (rows[3].total - rows[3].weights - rows[3].grads - rows[3].optim) / GIB
        wd = weight_bytes("3", weights)[0]
        states = (16 * shape.params if shape.trainable is None else
                  16 * shape.trainable + frozen_bytes(shape, "none", wd)) + (teacher.weights if teacher else 0)
        need = math.ceil(states / GIB / room) if room > 0 and rows[3].supported else None
        out.append(("no stage fits" if choice is None else "ZeRO-3 without offload does not fit") + ": " + (
            f"it needs at least {need} GPUs of {hw.gpu_mem_gb:g} GiB ({math.ceil(need / hw.gpus_per_node)} nodes of "
            f"{hw.gpus_per_node}): " + ("16 x P" if shape.trainable is None else f"16 x T + {wd} x F") + (" + the teacher" if teacher else "")
            + f" = {states / GIB:.1f} GiB over {room:.1f} GiB left per GPU"
            if need else "the activations alone exceed a GPU: lower train.micro_batch_size or data.max_len, set "
            "model.gradient_checkpointing=true, or share each row over GPUs (train.sequence_parallel)" if gen is None
            else "the answers' activations and the KV cache exceed a GPU: raise train.grad_accum (fewer answers a "
            "micro-batch), set model.gradient_checkpointing=true, cap the cache with rft.kv_cache_gb"
            if rows[3].supported else
            "quantized weights are not partitioned (no ZeRO-3): lower train.micro_batch_size or data.max_len, or use "
            "a larger GPU"))
    if choice is not None:
        name = "single_gpu" if choice == "0" and hw.world == 1 else ACCELERATE_CONFIG[choice]
        out.append(f"lowest stage that fits: {choice} -> accelerate_configs/{name}.yaml")
    if proposal is not None:
        name = "single_gpu" if proposal == "0" and hw.world == 1 else ACCELERATE_CONFIG[proposal]
        keys = " or ".join(a.split("=")[0] for a in proposal_args)
        out.append(f"proposed: zero{proposal} {' '.join(proposal_args)} -> accelerate_configs/{name}.yaml "
                   f"(launch/train.sh --zero auto takes it unless {keys} is given)")
    out.append(f"choice: {'zero' + choice.replace('-', '_') if choice else 'none'}")
    return Plan("\n".join(out), choice, rows, shape, usable, proposal, proposal_args)


def _proposals(cfg: Config, shape: ModelShape, budget: Budget, gen=None, teacher=None) -> list[tuple[int, bool]]:
    """(sequence_parallel, checkpointing) to try, cheapest first. A row of data.max_len tokens that does not fit a
    GPU even one to a micro-batch is a long-sequence problem: sequence parallelism (no recomputation, an all-to-all
    inside each node) comes before activation checkpointing (the forward computed twice: about a third more
    compute), and both last. Where one row fits (the micro-batch is what is too large), checkpointing alone: a
    smaller train.micro_batch_size is the other way, and the "no stage fits" line says so."""
    hw, w, usable, overhead_gb, weights = budget
    ckpt = not cfg.model.gradient_checkpointing  # (already on: nothing to add)
    sizes = sp_sizes(cfg, shape, hw.gpus_per_node) if gen is None else []  # (loss.mode=rl: no sequence parallelism)
    if sizes:
        one_row = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
        if _table(one_row, shape, budget, None, teacher)[2] in OPTIONS[:4]:
            sizes = []  # one row fits: the micro-batch is too large, not the row
    return [(n, False) for n in sizes] + ([(1, True)] if ckpt else []) + ([(n, True) for n in sizes] if ckpt else [])


def _host_mem_gb() -> Optional[float]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness zero-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    recipe_args.add(p)
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: the GPUs torch sees)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="memory per GPU in GiB (default: GPU 0's)")
    p.add_argument("--host-mem-gb", type=float, default=None, help="host memory per node in GiB, for 3-offload "
                   "(default: this machine's)")
    p.add_argument("--margin", type=float, default=0.10, help="share of GPU memory kept free (default 0.10)")
    p.add_argument("--overhead-gb", type=float, default=2.0, help="fixed GiB per GPU for the CUDA context, NCCL, "
                   "workspaces (default 2)")
    args = recipe_args.resolve(p.parse_intermixed_args(argv), p)
    try:
        if args.gpus is None or args.gpu_mem_gb is None:
            import torch

            if not torch.cuda.is_available():
                raise HarnessError("no GPU visible: give --gpus N and --gpu-mem-gb G")
            args.gpus = args.gpus or torch.cuda.device_count()
            args.gpu_mem_gb = args.gpu_mem_gb or torch.cuda.get_device_properties(0).total_memory / GIB
        if args.gpus < 1 or args.nodes < 1 or args.gpu_mem_gb <= 0 or not 0 <= args.margin < 1:
            raise HarnessError("--gpus and --nodes must be >= 1, --gpu-mem-gb > 0, 0 <= --margin < 1")
        cfg = load_config(args.config, args.overrides)
        hw = Hardware(args.gpus, args.gpu_mem_gb, args.nodes,
                      args.host_mem_gb if args.host_mem_gb is not None else _host_mem_gb())
        result = plan(cfg, hw, args.margin, args.overhead_gb, source=args.config)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code
    print(result.text)
    return 0 if result.choice or result.proposal else 3

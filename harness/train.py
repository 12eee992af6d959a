"""The training entry point: config -> data -> model -> the loop -> final export and report.

Run it any of these ways; all run the same `main()`:

    python -m harness.train --config configs/default.yaml train.max_steps=20
    harness train configs/default.yaml train.max_steps=20
    accelerate launch --num_processes 8 harness/train.py --config configs/default.yaml
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 harness/train.py --config configs/default.yaml

Overrides are `section.key=value` (see harness/config.py for every key and the precedence).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # `accelerate launch harness/train.py` runs this file as a script: import the package, not its siblings.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from harness import checkpoint, distributed, hardware, losses, metrics, planner
from harness import data as data_lib
from harness import cost, monitor, summary  # run observability: utilisation, cost, summary
from harness.compiling import CompilerWarmup
from harness.config import Config, describe, load_config, save_config
from harness.errors import HarnessError

# DeepSpeed still calls collectives that torch deprecated; the warning repeats every step and says nothing to users.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)


LOG_KEYS = ("gen_sum", "gen_count", "gen_mean_sum", "gen_micro", "emb_sum", "emb_count", "tokens", "samples",
            "positions", "flops", "wait_s")


@dataclass
class LoopState:
    """Where the loop is; with the accelerate state this is everything needed to continue a run exactly."""

    step: int = 0  # optimizer steps done
    streams: dict = field(default_factory=dict)  # per data stream: {"epoch": e, "batches": micro-batches of e consumed}
    tokens: int = 0  # non-padding input tokens processed, all processes, up to the last log
    elapsed_s: float = 0.0  # training wall time of earlier attempts (resume)
    log_acc: list = field(default_factory=lambda: [0.0] * len(LOG_KEYS))  # unlogged sums, all ranks (LOG_KEYS)
    first_loss: Optional[float] = None


# ----------------------------------------------------------------------------------------------- building blocks


def build_optimizer(model: torch.nn.Module, cfg: Config, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases and norm weights); fused on CUDA; DeepSpeed's
    CPU Adam (AdamW mode) when ZeRO offloads the optimizer to the CPU."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]  # ds_shape: full shape under ZeRO-3
    decay = [p for p, m in zip(params, is_matrix) if m]
    no_decay = [p for p, m in zip(params, is_matrix) if not m]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA adapters are all matrices; ZeRO-3 drops empty groups
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=torch.cuda.is_available())


def lr_lambda(cfg: Config, total_steps: int):
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then cosine / linear / constant."""
    o = cfg.optim
    warmup = o.warmup_steps if o.warmup_steps > 0 else int(o.warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if o.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if o.scheduler == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay

    return fn


def micro_batches(accelerator, loader, pos: dict):
    """Endless stream of micro-batches across epochs; pos = {"epoch", "batches"} is kept current. A resumed epoch
    skips the micro-batches it has already seen (same seeded order and groups: exactly the same data)."""
    while True:
        loader.set_epoch(pos["epoch"])
        if hasattr(loader.dataset, "set_epoch"):  # accelerate does not forward it when the sampler has one
            loader.dataset.set_epoch(pos["epoch"])
        skip = pos["batches"]
        for batch in (accelerator.skip_first_batches(loader, skip) if skip else loader):
            pos["batches"] += 1
            yield batch
        pos["epoch"] += 1
        pos["batches"] = 0


@torch.no_grad()
def evaluate_generative(accelerator, model, loader) -> float:
    """Per-token generative loss on the eval set, over all processes."""
    model.eval()
    acc = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in loader:
        logits = model(**data_lib.model_inputs(batch), use_cache=False).logits
        total, count = losses.token_loss_sum(logits, batch["labels"])
        acc += torch.stack([total.double(), count.double()])
    model.train()
    acc = accelerator.reduce(acc, "sum")
    return (acc[0] / acc[1].clamp(min=1)).item()


@torch.no_grad()
def encode_items(accelerator, objective, items: list, batch_size: int, pad_id: int) -> torch.Tensor:
    """Embeddings of tokenized items [(ids, instr_len)], each process encoding an equal shard (ZeRO-3 needs every
    process in every forward), gathered in order."""
    world, rank = accelerator.num_processes, accelerator.process_index
    per = math.ceil(len(items) / world)
    shard = items[rank * per:(rank + 1) * per]
    shard += [items[0]] * (per - len(shard))
    parts = []
    for i in range(0, per, batch_size):
        batch = {k: v.to(accelerator.device) for k, v in data_lib.pad_embed(shard[i:i + batch_size], pad_id).items()}
        parts.append(objective.embed(batch))
    return accelerator.gather(torch.cat(parts))[: len(items)]


def evaluate_retrieval(accelerator, model, objective, eval_set: dict, batch_size: int, pad_id: int) -> dict:
    """recall@1 and MRR of the held-out queries against the corpus of all their passages."""
    model.eval()
    q = encode_items(accelerator, objective, eval_set["queries"], batch_size, pad_id)
    c = encode_items(accelerator, objective, eval_set["corpus"], batch_size, pad_id)
    model.train()
    return metrics.retrieval_metrics(q, c, eval_set["positives"])


def resolve_max_len(cfg: Config, rows, tokenizer, say) -> int:
    """data.max_len, or for `auto` the data's length percentile (what is truncated is reported)."""

    if cfg.data.max_len != "auto":
        return cfg.data.max_len
    full, _ = data_lib.tokenize_dataset(rows, tokenizer, 1 << 30)
    lengths = list(full["length"])
    max_len = data_lib.auto_max_len(lengths, cfg.data.max_len_percentile)
    cut = sum(max(0, n - max_len) for n in lengths)
    say(f"[harness] data.max_len=auto: p{cfg.data.max_len_percentile:g} of {len(lengths)} sample lengths -> "
        f"{max_len}; {sum(n > max_len for n in lengths)} samples truncated, {cut} tokens "
        f"({100 * cut / sum(lengths):.2f}%) cut")
    return max_len


def build_data(cfg: Config, accelerator, tokenizer) -> dict:
    """Validated, tokenized data sets and their loaders (not yet prepared) for the configured loss.mode."""
    from torch.utils.data import DataLoader

    from harness.profiles import resolve_pin_memory

    d, mode, cuda = cfg.data, cfg.loss.mode, torch.cuda.is_available()
    out: dict = {"stats": {}}
    common = dict(num_workers=d.num_workers, pin_memory=resolve_pin_memory(d.pin_memory, cuda))
    if d.num_workers > 0:
        common.update(prefetch_factor=d.prefetch_factor, persistent_workers=d.persistent_workers)
    with accelerator.main_process_first():  # rank 0 validates and tokenizes; the others read its cache
        if mode in ("generative", "unified"):
            rows = data_lib.load_generative_rows(d.train_files, d.cache_dir)
            max_len = resolve_max_len(cfg, rows, tokenizer, accelerator.print)
            ds, st = data_lib.tokenize_dataset(rows, tokenizer, max_len)
            out["stats"]["generative"] = st
            padded = data_lib.GenerativeCollator(tokenizer.pad_token_id, pad_to_multiple_of=8 if cuda else 1)
            if d.packing:
                ds = data_lib.pack_dataset(ds, max_len)
                st["packed_rows"] = len(ds)
                st["packing_fill"] = sum(ds["length"]) / (len(ds) * max_len)
            collate = data_lib.PackedCollator(tokenizer.pad_token_id, max_len) if d.packing else padded
            out["gen"] = DataLoader(ds, batch_size=cfg.train.micro_batch_size, shuffle=d.shuffle, collate_fn=collate,
                                    **common)
            if d.eval_files:
                rows = data_lib.load_generative_rows(d.eval_files, d.cache_dir, "data.eval_files")
                ds, _ = data_lib.tokenize_dataset(rows, tokenizer, max_len)
                out["gen_eval"] = DataLoader(ds, batch_size=cfg.train.micro_batch_size, shuffle=False,
                                             collate_fn=padded, **common)
        if mode in ("embedding", "unified"):
            fmt = data_lib.EmbedFormat(d.emb_instruction_template, d.emb_plain_template,
                                       append_eos=cfg.model.pooling == "lasttoken")
            rows = data_lib.load_embedding_rows(d.emb_train_files, d.train_group_size - 1, d.cache_dir)
            ds, out["stats"]["embedding"] = data_lib.tokenize_embedding_dataset(
                rows, tokenizer, d.query_max_len, d.passage_max_len, fmt)
            groups = data_lib.EmbeddingGroups(ds, d.train_group_size, cfg.train.seed)
            order = {"shuffle": d.shuffle}
            if d.group_by_length:  # queries + their longest passages of similar length batched together
                lengths = [len(q) + max(map(len, p)) for q, p in zip(ds["q_ids"], ds["pos_ids"])]
                mega = cfg.train.emb_micro_batch_size * accelerator.num_processes * 32
                order = {"sampler": data_lib.LengthGroupedSampler(lengths, mega, cfg.train.seed)}
            out["emb"] = DataLoader(groups, batch_size=cfg.train.emb_micro_batch_size,
                                    collate_fn=data_lib.EmbeddingCollator(tokenizer.pad_token_id), **order, **common)
            if d.emb_eval_files:
                rows = data_lib.load_embedding_rows(d.emb_eval_files, 0, d.cache_dir, "data.emb_eval_files")
                out["emb_eval"] = data_lib.retrieval_eval_set(rows, tokenizer, d.query_max_len, d.passage_max_len,
                                                              fmt)
    return out


# ----------------------------------------------------------------------------------------------- the run


def run(cfg: Config, auto_batch: Optional[dict] = None) -> dict:
    """Train according to `cfg`; returns the report (also written to <output_dir>/report.json). auto_batch: set by
    `run_auto_batch` (train.micro_batch_size=auto): a trial step on the longest batch comes first."""
    from accelerate.utils import set_seed

    from harness import model as model_lib
    from harness.objective import Objective
    from harness.profiles import resolve_compile

    t_start, t_process = time.time(), hardware.process_start_time()
    timings = planner.Timings()  # where the wall time goes (report.json; what `harness plan` calibrates from)
    out = Path(cfg.train.output_dir)
    precision = hardware.resolve_precision(cfg.train.precision)
    hardware.check_attention(cfg.model.attn_implementation)
    compile_mode = resolve_compile(cfg.train.compile, torch.cuda.is_available())
    accelerator = distributed.make_accelerator(cfg, hardware.accelerate_mixed_precision(precision), compile_mode)
    resume_from, incomplete = checkpoint.resolve_resume(out, cfg.train.resume, accelerator)
    # the compiler's model-independent start-up (imports, CPU ISA probe, worker pool) overlaps the set-up below
    warmup = CompilerWarmup.start(accelerator.device.type) if compile_mode != "none" else None
    tf32 = hardware.enable_tf32(cfg.train.tf32)
    sampler = monitor.start_sampler(cfg.train.monitor_interval_s, accelerator.is_main_process)  # GPU/CPU utilisation
    say = accelerator.print
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    else:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    world, mode = accelerator.num_processes, cfg.loss.mode
    env = hardware.environment_report()
    zero = distributed.zero_info(accelerator)
    say(f"[harness] {world} process(es), {accelerator.distributed_type.value}, ZeRO stage {zero['zero_stage']}, "
        f"device {accelerator.device}, precision {precision}, tf32 {tf32}, compile {compile_mode}, "
        f"profile {cfg.train.profile}, torch {env['torch']}, loss {mode}")
    say(f"[harness] environment: {hardware.describe(env)}")
    if accelerator.is_main_process:
        checkpoint.write_json(out / "environment.json", env)
    for p in incomplete:
        say(f"[harness] warning: {p} is an incomplete checkpoint (no {checkpoint.MARKER} marker): not resumed from")

    # ---- data
    tokenizer = model_lib.load_tokenizer(cfg.model)
    data = build_data(cfg, accelerator, tokenizer)
    for kind, st in data["stats"].items():
        say(f"[harness] {kind} data: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in st.items() if k != "dropped_examples"))
        if st.get("dropped_no_labels"):
            say(f"[harness] warning: dropped samples with no trained token, e.g. {', '.join(st['dropped_examples'])}")

    # ---- model, optimizer, schedule (same seed on every rank: identical initial weights)
    set_seed(cfg.train.seed)
    with distributed.model_init_context(accelerator, cfg.model.name_or_path is None or cfg.model.random_init):
        model = model_lib.build_model(cfg.model, tokenizer)
    if mode != "generative":
        model_lib.check_embedding_support(model.config.model_type, cfg.model.attn_implementation,
                                          cfg.model.embed_attention)
    n_params = model_lib.count_parameters(model)
    n_matmul = metrics.matmul_params(model)
    probe = (metrics.CompileProbe(metrics.repeated_blocks(model), accelerator.device) if compile_mode != "none"
             else None)
    optimizer = build_optimizer(model, cfg, offload=zero["offload_optimizer"] not in (None, "none"))
    names = [n for n in ("emb", "gen") if n in data]  # the first is the primary stream: it defines epochs
    accum = cfg.train.grad_accum
    sched = planner.schedule_steps(len(data[names[0]].dataset), data[names[0]].batch_size, world, accum,
                                   cfg.train.max_steps, cfg.train.epochs)  # the planner's arithmetic
    micro_per_epoch, steps_per_epoch, total_steps = sched["micro_per_epoch"], sched["steps_per_epoch"], sched["total_steps"]
    # The schedule acts on the raw optimizer's param groups, which DeepSpeed's ZeRO optimizers keep using. It is not
    # prepared (accelerate would step it once per process) but stepped once per optimizer step, and checkpointed.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    accelerator.register_for_checkpointing(scheduler)
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *[data[n] for n in names])
    left_eager = []
    if compile_mode == "regional":  # accelerate compiled every leaf too; keep the repeated blocks only
        left_eager = distributed.narrow_regional_compile(model)
        say(f"[harness] regional compile: decoder blocks compiled; left eager: {', '.join(left_eager) or 'nothing'}")
    toolchain = warmup.join() if warmup else {}  # before the model first runs: compile seconds are the model's own
    loaders = dict(zip(names, loaders))
    gen_eval = accelerator.prepare(data["gen_eval"]) if "gen_eval" in data else None
    objective = Objective(cfg, accelerator, model)
    mconf = accelerator.unwrap_model(model, keep_torch_compile=False).config
    objective.flop_dims = (n_matmul, getattr(mconf, "num_hidden_layers", 0), getattr(mconf, "hidden_size", 0))
    held = accelerator.gather(torch.tensor([distributed.parameters_held(model)], device=accelerator.device)).tolist()
    batch_desc = []
    if cfg.train.global_batch_size and cfg.train.micro_batch_size * accum * world != cfg.train.global_batch_size:
        raise HarnessError(f"config key 'train.global_batch_size': {cfg.train.global_batch_size} is not micro-batch "
                           f"{cfg.train.micro_batch_size} x grad_accum {accum} x {world} process(es); fix one of "
                           f"them, or use train.micro_batch_size=auto")
    if "gen" in loaders:
        batch_desc.append(f"{cfg.train.micro_batch_size * accum * world} sequences")
    if "emb" in loaders:
        batch_desc.append(f"{cfg.train.emb_micro_batch_size * accum * world} queries x {cfg.data.train_group_size} "
                          f"passages (contrastive batch {cfg.train.emb_micro_batch_size * (world if cfg.loss.gather_negatives else 1)} queries)")
    say(f"[harness] model: {n_params / 1e6:.2f}M parameters ({', '.join(f'{h / 1e6:.2f}M' for h in held)} held per "
        f"rank); global batch per step: {' + '.join(batch_desc)} = micro-batch x accumulation {accum} x {world} "
        f"process(es); {steps_per_epoch} steps/epoch of {names[0]} data; {total_steps} steps "
        f"({total_steps / steps_per_epoch:.2f} epochs)")

    is_deepspeed, peak = zero["zero_stage"] is not None, None
    if torch.cuda.is_available():
        peak_one, _ = hardware.peak_flops(torch.cuda.get_device_name())
        peak = peak_one * world if peak_one else None

    # ---- resume: accelerate state (weights, optimizer, scheduler, RNG) + loop state (step, data position, time)
    state = LoopState(streams={n: {"epoch": 0, "batches": 0} for n in names})
    if resume_from is not None:
        state = LoopState(**checkpoint.load_checkpoint(accelerator, resume_from))
        say(f"[harness] resumed from {resume_from}: step {state.step}, data position {state.streams}")
    if cfg.train.report_to:
        monitor.init_trackers(accelerator, cfg.train.output_dir, _flat(cfg.to_dict()))
    logger = metrics.MetricsLogger(accelerator, out, resume_step=state.step if resume_from else None)
    start_step = state.step
    streams = {n: micro_batches(accelerator, loaders[n], state.streams[n]) for n in names}
    bar = metrics.progress_bar(total_steps, state.step, cfg.train.progress_bar and accelerator.is_main_process)
    # sums since the last log on this rank (LOG_KEYS); rank 0 carries the remainder saved with a checkpoint
    log_acc = torch.tensor(state.log_acc if accelerator.is_main_process else [0.0] * len(LOG_KEYS),
                           dtype=torch.float64, device=accelerator.device)
    last: dict = {}
    model.train()

    def epoch_now() -> float:
        pos = state.streams[names[0]]
        return round(pos["epoch"] + pos["batches"] / micro_per_epoch, 4)

    def evaluate(step: int) -> dict:
        t_eval, res = time.perf_counter(), {}
        if gen_eval is not None:
            res["eval_loss"] = evaluate_generative(accelerator, model, gen_eval)
        if "emb_eval" in data:
            r = evaluate_retrieval(accelerator, model, objective, data["emb_eval"], cfg.train.emb_micro_batch_size * 4,
                                   tokenizer.pad_token_id)
            res.update(eval_recall_at_1=r["recall_at_1"], eval_mrr=r["mrr"])
        if res:
            say(f"[harness] eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))
            timings.add("eval", time.perf_counter() - t_eval)
        return res

    def loop_state() -> dict:
        """The loop state to checkpoint, with the unlogged sums of every rank folded into rank 0's copy."""
        acc = accelerator.reduce(log_acc.clone(), "sum")
        return {**asdict(state), "elapsed_s": state.elapsed_s + meter.elapsed(), "log_acc": acc.tolist()}

    if auto_batch is not None and not is_deepspeed:  # DeepSpeed: its first step is the trial
        try:
            memory_trial(accelerator, model, optimizer, objective, data)
        except RuntimeError:  # too large: this try ends here (find_executable_batch_size starts a smaller one)
            if sampler is not None:
                sampler.stop()
            raise
    if cfg.train.eval_at_start and resume_from is None:
        first_eval = evaluate(0)
        if first_eval:
            logger.log({"step": 0, **first_eval})
            last.update(first_eval_at_0=first_eval)
    meter = metrics.Throughput()  # training time starts here (the step-0 evaluation is not training)
    timings.loop_started(t_process)
    budget = planner.BudgetTracker(t_process, cfg.train.time_budget_hours) if cfg.train.time_budget_hours else None

    # ---- the loop: one iteration = one optimizer step over `accum` micro-steps on every process
    stop_at = cfg.train.stop_at_step if 0 < cfg.train.stop_at_step < total_steps else total_steps
    signals = checkpoint.StopSignals()
    deadline = budget.deadline if budget else None  # the window counts from the process start
    last_save, save_cost, stopped_by = time.time(), 10.0, None  # save_cost: measured at the first save
    nonfinite_run = 0
    before_first = metrics.dynamo_counters()  # compiled before the loop: step-0 evaluation, auto micro-batch trial
    first_step_s, after_first = 0.0, before_first  # replaced after this process's first step
    while state.step < stop_at:
        t_step = time.perf_counter()
        # fetch the step's micro-batches first: token averaging needs the step's global trained-token count
        gen_batches = [next(streams["gen"]) for _ in range(accum)] if "gen" in streams else [None] * accum
        emb_batches = [next(streams["emb"]) for _ in range(accum)] if "emb" in streams else [None] * accum
        log_acc[LOG_KEYS.index("wait_s")] += time.perf_counter() - t_step
        gen_scale = objective.gen_scale(gen_batches) if "gen" in streams else 0.0

        # forward / backward per micro-step (accelerate defers the gradient sync to the last one)
        for gen, emb in zip(gen_batches, emb_batches):
            with accelerator.accumulate(model):
                sums = objective.micro_step(gen, emb, gen_scale)
            log_acc += torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64, device=accelerator.device)
                                    for k in LOG_KEYS])

        # optimizer step: clip (DeepSpeed clips inside its engine and reports the norm); a step whose gradient is
        # not finite is skipped (DeepSpeed has applied it already: the run stops), max_nonfinite_skips in a row
        t_opt = time.perf_counter()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm or float("inf"))
        finite = grad_norm is None or math.isfinite(float(grad_norm))
        if finite or is_deepspeed:
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
        nonfinite_run = 0 if finite else nonfinite_run + 1
        optimizer.zero_grad(set_to_none=True)
        timings.optimizer_s += time.perf_counter() - t_opt
        if not finite:
            say(f"[harness] warning: step {state.step + 1}: gradient norm is {float(grad_norm)}; "
                + ("DeepSpeed already applied it" if is_deepspeed else
                   f"update skipped ({nonfinite_run} in a row, at most {cfg.train.max_nonfinite_skips})"))
            if is_deepspeed or nonfinite_run > cfg.train.max_nonfinite_skips:
                stopped_by = "nonfinite"
        state.step += 1
        bar.update(1)
        if state.step == start_step + 1:  # the first step of this process carries the (cold) compilation
            first_step_s = meter.elapsed()
            after_first = metrics.dynamo_counters()
        if state.step == start_step + planner.WARMUP_STEPS:
            timings.warmup_done_s = timings.in_loop(meter.elapsed())

        # log every log_every steps and at the end
        if state.step % cfg.train.log_every == 0 or state.step == total_steps:
            tot = dict(zip(LOG_KEYS, accelerator.reduce(log_acc, "sum").tolist()))
            log_acc.zero_()
            interval_s = meter.interval()
            tok_s = tot["tokens"] / interval_s
            record = {"step": state.step, "epoch": epoch_now()}
            parts = {}
            if tot["gen_micro"]:
                parts["loss_gen"] = (tot["gen_sum"] / max(tot["gen_count"], 1) if cfg.loss.gen_averaging == "token"
                                     else tot["gen_mean_sum"] / tot["gen_micro"])
            if tot["emb_count"]:
                parts["loss_emb"] = tot["emb_sum"] / tot["emb_count"]
            record["loss"] = (cfg.loss.gen_weight * parts["loss_gen"] + cfg.loss.emb_weight * parts["loss_emb"]
                              if mode == "unified" else next(iter(parts.values())))
            if mode == "unified":
                record.update(parts)
            state.first_loss = record["loss"] if state.first_loss is None else state.first_loss
            state.tokens += int(tot["tokens"])
            record.update({
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": tok_s,
                "samples_per_s": tot["samples"] / interval_s,
                "mfu": metrics.mfu(tot["flops"] / interval_s, 1.0, peak),
                "padding_share": 1 - tot["tokens"] / max(tot["positions"], 1),
                "data_wait_share": tot["wait_s"] / interval_s,
                "mem_gb": metrics.memory_gb(),
                "tokens": state.tokens,
                "elapsed_s": state.elapsed_s + meter.elapsed(),
                "eta_s": metrics.eta_seconds(meter.elapsed(), state.step - start_step, total_steps - start_step),
            })
            if budget is not None:  # the window: elapsed, remaining, ETA, on track
                record.update(budget.status(state.step - start_step, total_steps - state.step, meter.elapsed()))
            record.update(sampler.drain() if sampler else {})  # utilisation since the previous log line
            run_cost = cost.of_run(cfg, world, state.elapsed_s + time.time() - t_start, record.get("eta_s"))
            record.update(cost.fields(run_cost))
            if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step != total_steps:
                record.update(evaluate(state.step))
            logger.log(record)
            last.update(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tok_s:,.0f}",
                            **({"window": budget.short(record)} if budget else {}))
            line = (f"[harness] step {state.step}/{total_steps} loss {record['loss']:.4f}"
                    + "".join(f" {k} {v:.4f}" for k, v in parts.items() if mode == "unified")
                    + f" lr {record['lr']:.2e} grad_norm {record['grad_norm'] or 0:.3f} tokens/s {tok_s:,.0f}")
            line += monitor.progress_text(record) + cost.progress_text(run_cost)
            line += f" | {budget.describe(record)}" if budget else ""
            bar.write(line) if not bar.disable else say(line)

        # checkpoint on schedule (steps, minutes), on a stop signal, before the time window closes; every rank
        # takes the same decision (one all-reduce of the flags per step)
        now, step_s = time.time(), time.perf_counter() - t_step
        flags = accelerator.reduce(torch.tensor([
            signals.received is not None,
            cfg.train.save_every_minutes > 0 and now - last_save >= 60 * cfg.train.save_every_minutes,
            deadline is not None and now + 2 * step_s + 2 * save_cost + 15 >= deadline,  # room to save and export
        ], dtype=torch.float32, device=accelerator.device), "max").tolist()
        if stopped_by == "nonfinite":
            break
        stopped_by = "signal" if flags[0] else "time_budget" if flags[2] else None
        stopped_by = stopped_by or ("stop_at_step" if state.step == stop_at < total_steps else None)
        if (cfg.train.save_every_steps and state.step % cfg.train.save_every_steps == 0) or flags[1] or stopped_by:
            t_save = time.time()
            path = checkpoint.save_checkpoint(accelerator, out, loop_state(), cfg.train.save_total_limit)
            last_save, save_cost = time.time(), time.time() - t_save
            timings.add("save", save_cost)
            say(f"[harness] checkpoint: {path} ({save_cost:.1f}s)")
        if stopped_by:
            break
    bar.close()
    signals.restore()
    train_time = meter.elapsed()
    t_loop_end, eval_before_final = time.time(), timings.eval_s
    timings.loop(train_time, state.step - start_step)
    if stopped_by == "nonfinite":
        logger.close()
        if is_deepspeed:
            raise HarnessError(f"non-finite gradient at step {state.step} under DeepSpeed (already applied): resume from "
                               f"the last checkpoint with a lower optim.lr or check the data")
        path = checkpoint.save_checkpoint(accelerator, out, loop_state(), cfg.train.save_total_limit)
        raise HarnessError(f"non-finite gradients in {nonfinite_run} steps in a row (train.max_nonfinite_skips="
                           f"{cfg.train.max_nonfinite_skips}): stopped; the last good weights are in {path}. Lower "
                           f"optim.lr, check the data, or use train.precision=fp32/bf16")
    if stopped_by in ("signal", "stop_at_step"):  # this attempt ends early: the state is saved, nothing exported
        say(f"[harness] stopped ({stopped_by}) at step {state.step}/{total_steps} with checkpoint "
            f"{checkpoint.checkpoints_root(out) / f'step-{state.step}'}; continue with train.resume=auto")
        logger.close()
        accelerator.end_training()
        if sampler:
            sampler.stop()
        return {"steps": state.step, "stopped_early": stopped_by}
    if stopped_by == "time_budget":
        say(f"[harness] time budget of {cfg.train.time_budget_hours} h nearly used: stopping at step "
            f"{state.step}/{total_steps} with a checkpoint and the final export")

    # ---- the end: final evaluation, export, report
    compile_report = None
    if probe is not None:
        probe.remove()
        steady = (train_time - first_step_s) / max(1, state.step - start_step - 1)
        now, calls = metrics.dynamo_counters(), probe.calls  # calls: read off the device once
        compile_report = {
            "mode": compile_mode, "first_step_s": first_step_s, "later_step_mean_s": steady,
            "cold_compile_s": after_first["compile_time_s"], "compile_time_total_s": now["compile_time_s"],
            "graphs": now["graphs"], "frames_compiled": now["frames_compiled"],
            "recompiles_after_first_step": now["graphs"] - after_first["graphs"],
            "block_calls_compiled": calls["compiled"], "block_calls_eager": calls["eager"],
            "ran_compiled": calls["compiled"] > 0, "left_eager": left_eager,
            "compile_before_first_step_s": before_first["compile_time_s"], **toolchain,
        }
        before = (f", {before_first['compile_time_s']:.1f}s of it before the loop (step-0 evaluation / batch trial)"
                  if before_first["compile_time_s"] else "")
        say(f"[harness] compile ({compile_mode}): cold compile {after_first['compile_time_s']:.1f}s up to the end of "
            f"the first step ({first_step_s:.1f}s){before}, {now['compile_time_s']:.1f}s in all; {now['graphs']} graphs, "
            f"{compile_report['recompiles_after_first_step']} recompiles after step 1; decoder-block calls compiled "
            f"{calls['compiled']}, eager {calls['eager']}")
        if toolchain:
            say(f"[harness] compiler start-up before the first step: imports {toolchain['toolchain_import_s']:.1f}s, "
                f"ISA probe and workers {toolchain['toolchain_background_s']:.1f}s in the background during set-up "
                f"(waited {toolchain['toolchain_wait_s']:.1f}s)"
                + (f"; warm-up failed: {toolchain['toolchain_error']}" if toolchain["toolchain_error"] else ""))
        if not compile_report["ran_compiled"]:
            say("[harness] warning: torch.compile was requested but no compiled decoder block ever ran")
    final_eval = evaluate(state.step)
    if final_eval:
        logger.log({"step": state.step, **final_eval})
    final_dir = None
    if cfg.train.save_final:
        final_dir = checkpoint.export_final(accelerator, model, tokenizer, out / "final",
                                            extra={"harness.json": embedding_settings(cfg)})
        say(f"[harness] final model: {final_dir}")
    logger.close()
    pos = state.streams[names[0]]
    timings.export_s = time.time() - t_loop_end - (timings.eval_s - eval_before_final)
    timings.process_wall_s = time.time() - t_process
    report = {
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        **zero,
        "loss_mode": mode,
        "parameters": n_params,
        "parameters_per_rank": held,
        "precision": precision,
        "tf32": tf32,
        "profile": cfg.train.profile,
        "compile": compile_report,
        "steps": state.step,
        "planned_steps": total_steps,
        "stopped_by": stopped_by,
        "resumed_from": str(resume_from) if resume_from else None,
        "epochs": round(pos["epoch"] + pos["batches"] / micro_per_epoch, 4),
        "tokens": state.tokens,
        "train_time_s": state.elapsed_s + train_time,
        "wall_time_s": time.time() - t_start,
        "tokens_per_s": state.tokens / max(state.elapsed_s + train_time, 1e-9),
        "first_loss": state.first_loss,
        "final_loss": last.get("loss"),
        "final_loss_gen": last.get("loss_gen"),
        "final_loss_emb": last.get("loss_emb"),
        "eval_at_start": last.get("first_eval_at_0"),
        "eval": final_eval,
        "data": data["stats"],
        "final_dir": str(final_dir) if final_dir else None,
        "hardware": env,
        "flop_dims": list(objective.flop_dims),
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": accum,
        "micro_batch_auto": auto_batch,
        "timings": timings.as_dict(),
        "time_budget": budget.summary(timings.process_wall_s, stopped_by == "time_budget") if budget else None,
        "plan": planner.plan_vs_actual(out / "plan.json", cfg, timings.process_wall_s),
    }
    report["utilisation"] = sampler.stop() if sampler else None
    report["cost"] = cost.of_run(cfg, world, state.elapsed_s + time.time() - t_start, 0.0)
    if accelerator.is_main_process:
        checkpoint.write_json(out / "report.json", report)
        if cfg.train.summary:  # the figures table, summary.md, plots/*.png
            summary.finish_run(out, say)
    accelerator.end_training()
    if report["plan"]:
        say(f"[harness] plan: estimated {report['plan']['estimated_s']:.1f}s, actual {report['plan']['actual_s']:.1f}s "
            f"({report['plan']['error_pct']:+.1f}%)")
    say(f"[harness] done: step {state.step}, {train_time:.1f}s this attempt, loss "
        f"{state.first_loss if state.first_loss is not None else float('nan'):.4f} -> "
        f"{last.get('loss', float('nan')):.4f}; report {out / 'report.json'}")
    return report


def memory_trial(accelerator, model, optimizer, objective, data: dict) -> None:
    """train.micro_batch_size=auto: one forward and backward of the longest micro-batch the data can produce, with
    gradients discarded and the RNG put back (the run is unchanged). Every process takes part and they agree: when
    one ran out of memory, all raise the out-of-memory error that find_executable_batch_size reacts to."""
    loader = data["gen"]
    lengths = loader.dataset["length"]
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[: loader.batch_size]
    batch = {k: v.to(accelerator.device) for k, v in loader.collate_fn([loader.dataset[i] for i in longest]).items()}
    rng, failed = torch.random.get_rng_state(), ""
    try:
        with accelerator.no_sync(model):
            objective.micro_step(batch, None, objective.gen_scale([batch]))
    except RuntimeError as e:
        from accelerate.utils.memory import should_reduce_batch_size

        if not should_reduce_batch_size(e):
            raise
        failed = str(e).splitlines()[0]
    optimizer.zero_grad(set_to_none=True)
    torch.random.set_rng_state(rng)
    if accelerator.reduce(torch.tensor([float(bool(failed))], device=accelerator.device), "max").item():
        accelerator.free_memory()
        raise RuntimeError(f"micro-batch {loader.batch_size} ran out of memory. ({failed or 'on another process'})")


def run_auto_batch(cfg: Config) -> dict:
    """train.micro_batch_size=auto: the largest micro-batch that fits, from the per-process share of
    train.global_batch_size down (accelerate's find_executable_batch_size; each retry takes the largest divisor of
    the share at most half the last size), with grad_accum = share / micro-batch so the global batch is kept."""
    import gc

    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import find_executable_batch_size

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.train.global_batch_size % world:
        raise HarnessError(f"config key 'train.global_batch_size': {cfg.train.global_batch_size} does not divide "
                           f"over {world} processes")
    share = cfg.train.global_batch_size // world
    tried: list[int] = []
    environ = dict(os.environ)  # accelerate records its DeepSpeed choice in the environment: start each try afresh

    def smaller() -> int:
        return max((d for d in range(1, tried[-1] // 2 + 1) if share % d == 0), default=0)

    @find_executable_batch_size(starting_batch_size=share, reduce_batch_size_fn=smaller)
    def attempt(micro: int) -> dict:
        if tried:  # a fresh accelerator state (DeepSpeed's filled-in batch values) for the retry
            AcceleratorState._reset_state(reset_partial_state=False)
            GradientState._reset_state()
            os.environ.clear()
            os.environ.update(environ)
            gc.collect()
            print(f"[harness] micro-batch {tried[-1]} did not fit: trying {micro}", flush=True)
        tried.append(micro)
        sub = replace(cfg, train=replace(cfg.train, micro_batch_size=micro, grad_accum=share // micro))
        return run(sub, auto_batch={"global_batch_size": cfg.train.global_batch_size, "tried": list(tried),
                                    "micro_batch_size": micro, "grad_accum": share // micro})

    try:
        return attempt()
    except RuntimeError as e:
        if "No executable batch size found" in str(e):
            raise HarnessError(f"train.micro_batch_size=auto: even a micro-batch of 1 does not fit in memory (tried "
                               f"{tried}); use model.gradient_checkpointing=true, a shorter data.max_len or ZeRO-3") from None
        raise


def embedding_settings(cfg: Config) -> dict:
    """What harness.encode needs to embed like training did, saved as final/harness.json."""
    return {
        "loss_mode": cfg.loss.mode,
        "pooling": cfg.model.pooling,
        "embed_attention": cfg.model.embed_attention,
        "instruction_template": cfg.data.emb_instruction_template,
        "plain_template": cfg.data.emb_plain_template,
        "query_max_len": cfg.data.query_max_len,
        "passage_max_len": cfg.data.passage_max_len,
        "append_eos": cfg.model.pooling == "lasttoken",
    }


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config -> flat {section.key: scalar} for the trackers' hyper-parameter table."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


# ----------------------------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="harness train",
        description="Train a language model. Precedence: defaults < --config file < section.key=value overrides.",
    )
    p.add_argument("--config", help="run recipe (YAML), e.g. configs/default.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=20")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print(describe())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        run_auto_batch(cfg) if cfg.train.micro_batch_size == "auto" else run(cfg)
    except HarnessError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

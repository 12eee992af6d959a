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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from harness import checkpoint, distributed, hardware, losses, metrics
from harness.config import Config, describe, load_config, save_config
from harness.errors import HarnessError

# DeepSpeed still calls collectives that torch deprecated; the warning repeats every step and says nothing to users.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)


@dataclass
class LoopState:
    """Where the loop is; with the accelerate state this is everything needed to continue a run exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed on each process
    tokens: int = 0  # non-padding input tokens processed, all processes, up to the last log
    elapsed_s: float = 0.0  # training wall time of earlier attempts (resume)
    log_acc: tuple = (0.0, 0.0, 0.0, 0.0)  # unlogged sums since the last log (all ranks): loss, trained, tokens, samples
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


def micro_batches(accelerator, loader, state: LoopState):
    """Endless stream of micro-batches across epochs, keeping state.epoch / state.batches_in_epoch current.
    On resume the first epoch skips the micro-batches it has already seen (same seeded order: exact data)."""
    while True:
        loader.set_epoch(state.epoch)
        skip = state.batches_in_epoch
        it = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in it:
            state.batches_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batches_in_epoch = 0


@torch.no_grad()
def evaluate(accelerator, model, loader) -> float:
    """Per-token generative loss on the eval set, over all processes."""
    model.eval()
    acc = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        total, count = losses.token_loss_sum(logits, batch["labels"])
        acc += torch.stack([total.double(), count.double()])
    model.train()
    acc = accelerator.reduce(acc, "sum")
    return (acc[0] / acc[1].clamp(min=1)).item()


# ----------------------------------------------------------------------------------------------- the run


def run(cfg: Config) -> dict:
    """Train according to `cfg`; returns the report (also written to <output_dir>/report.json)."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from harness import data as data_lib
    from harness import model as model_lib

    t_start = time.time()
    out = Path(cfg.train.output_dir)
    resume_from, incomplete = checkpoint.resolve_resume(out, cfg.train.resume)
    precision = hardware.resolve_precision(cfg.train.precision)
    accelerator = distributed.make_accelerator(cfg, hardware.accelerate_mixed_precision(precision))
    tf32 = hardware.enable_tf32(cfg.train.tf32)
    say = accelerator.print
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    else:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    world = accelerator.num_processes
    env = hardware.environment_report()
    zero = distributed.zero_info(accelerator)
    say(f"[harness] {world} process(es), {accelerator.distributed_type.value}, ZeRO stage {zero['zero_stage']}, "
        f"device {accelerator.device}, precision {precision}, tf32 {tf32}, torch {env['torch']}")
    for p in incomplete:
        say(f"[harness] warning: {p} is an incomplete checkpoint (no {checkpoint.MARKER} marker): not resumed from")

    # ---- data: validate, tokenize (rank 0 first, the others read its cache), batch
    tokenizer = model_lib.load_tokenizer(cfg.model)
    with accelerator.main_process_first():
        rows = data_lib.load_generative_rows(cfg.data.train_files, cfg.data.cache_dir)
        train_ds, data_stats = data_lib.tokenize_dataset(rows, tokenizer, cfg.data.max_len)
        eval_ds = None
        if cfg.data.eval_files:
            eval_rows = data_lib.load_generative_rows(cfg.data.eval_files, cfg.data.cache_dir, "data.eval_files")
            eval_ds, _ = data_lib.tokenize_dataset(eval_rows, tokenizer, cfg.data.max_len)
    say(f"[harness] data: {data_stats['samples']} samples, {data_stats['tokens']} tokens, mean length "
        f"{data_stats['mean_len']:.1f}, p95 {data_stats['p95_len']}, truncated to {cfg.data.max_len}: "
        f"{data_stats['truncated']}, dropped (no trained token left): {data_stats['dropped_no_labels']}")
    if data_stats["dropped_no_labels"]:
        say(f"[harness] warning: dropped samples, e.g. {', '.join(data_stats['dropped_examples'])}")
    collate = data_lib.GenerativeCollator(tokenizer.pad_token_id, pad_to_multiple_of=8 if torch.cuda.is_available() else 1)
    loader_kw = dict(batch_size=cfg.train.micro_batch_size, collate_fn=collate, num_workers=cfg.data.num_workers,
                     pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(train_ds, shuffle=cfg.data.shuffle, **loader_kw)
    eval_loader = DataLoader(eval_ds, shuffle=False, **loader_kw) if eval_ds is not None else None

    # ---- model, optimizer, schedule (same seed on every rank: identical initial weights)
    set_seed(cfg.train.seed)
    with distributed.model_init_context(accelerator, cfg.model.name_or_path is None or cfg.model.random_init):
        model = model_lib.build_model(cfg.model, tokenizer)
    n_params = model_lib.count_parameters(model)
    optimizer = build_optimizer(model, cfg, offload=zero["offload_optimizer"] not in (None, "none"))
    accum = cfg.train.grad_accum
    micro_per_epoch = math.ceil(len(train_loader) / world)  # what each process gets once prepared
    steps_per_epoch = max(1, micro_per_epoch // accum)
    total_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else max(1, math.ceil(cfg.train.epochs * micro_per_epoch / accum))
    # The schedule acts on the raw optimizer's param groups, which DeepSpeed's ZeRO optimizers keep using. It is not
    # prepared (accelerate would step it once per process) but stepped once per optimizer step, and checkpointed.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    accelerator.register_for_checkpointing(scheduler)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    if len(train_loader) != micro_per_epoch:
        raise RuntimeError(f"prepared loader has {len(train_loader)} batches per process, expected {micro_per_epoch}")
    global_batch = cfg.train.micro_batch_size * accum * world
    held = accelerator.gather(torch.tensor([distributed.parameters_held(model)], device=accelerator.device)).tolist()
    say(f"[harness] model: {n_params / 1e6:.2f}M parameters ({', '.join(f'{h / 1e6:.2f}M' for h in held)} held per "
        f"rank); global batch {global_batch} = micro-batch {cfg.train.micro_batch_size} x accumulation {accum} x "
        f"{world} process(es); {steps_per_epoch} steps/epoch; {total_steps} steps ({total_steps / steps_per_epoch:.2f} epochs)")

    mconf = accelerator.unwrap_model(model).config
    flops_tok = metrics.flops_per_token(n_params, getattr(mconf, "num_hidden_layers", 0),
                                        getattr(mconf, "hidden_size", 0), round(data_stats["mean_len"]))
    peak = None
    if torch.cuda.is_available():
        peak_one, _ = hardware.peak_flops(torch.cuda.get_device_name())
        peak = peak_one * world if peak_one else None

    # ---- resume: accelerate state (weights, optimizer, scheduler, RNG) + loop state (step, data position, time)
    state = LoopState()
    if resume_from is not None:
        saved = checkpoint.load_checkpoint(accelerator, resume_from)
        state = LoopState(**{**saved, "log_acc": tuple(saved["log_acc"])})
        say(f"[harness] resumed from {resume_from}: step {state.step}, epoch {state.epoch}, "
            f"{state.batches_in_epoch} micro-batches into it")
    if cfg.train.report_to:
        accelerator.init_trackers("tensorboard", config=_flat(cfg.to_dict()))
    logger = metrics.MetricsLogger(accelerator, out, resume_step=state.step if resume_from else None)
    start_step = state.step
    stream = micro_batches(accelerator, train_loader, state)
    meter = metrics.Throughput()
    bar = metrics.progress_bar(total_steps, state.step, cfg.train.progress_bar and accelerator.is_main_process)
    # sums since the last log on this rank: loss, trained tokens, tokens, samples (rank 0 carries a resumed remainder)
    log_acc = torch.tensor(state.log_acc if accelerator.is_main_process else (0.0,) * 4,
                           dtype=torch.float64, device=accelerator.device)
    last_loss = eval_loss = None
    model.train()

    def loop_state() -> dict:
        """The loop state to checkpoint, with the unlogged sums of every rank folded into rank 0's copy."""
        acc = accelerator.reduce(log_acc.clone(), "sum")
        return {**asdict(state), "elapsed_s": state.elapsed_s + meter.elapsed(), "log_acc": acc.tolist()}

    # ---- the loop: one iteration = one optimizer step over `accum` micro-batches on every process
    stop_at = cfg.train.stop_at_step if 0 < cfg.train.stop_at_step < total_steps else total_steps
    while state.step < stop_at:
        # fetch the step's micro-batches first: the per-token loss needs the step's global trained-token count
        batches = [next(stream) for _ in range(accum)]
        local = torch.stack([losses.trained_tokens(b["labels"]) for b in batches]).sum()
        global_tokens = accelerator.reduce(local.to(accelerator.device), "sum").item()
        scale = losses.step_scale(world, accum, global_tokens)

        # forward / backward, accumulated (accelerate skips the gradient sync until the last micro-batch)
        for b in batches:
            with accelerator.accumulate(model):
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
                loss_sum, count = losses.token_loss_sum(logits, b["labels"])
                accelerator.backward(loss_sum * scale)
            n_tok = int(b["attention_mask"].sum())
            log_acc += torch.tensor([loss_sum.item(), count.item(), n_tok, b["input_ids"].shape[0]],
                                    dtype=torch.float64, device=accelerator.device)
            meter.add(n_tok, b["input_ids"].shape[0])

        # optimizer step: clip (DeepSpeed clips inside its engine and reports the norm), step, schedule
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm) \
            if cfg.optim.max_grad_norm > 0 else None
        optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        bar.update(1)

        # log every log_every steps and at the end
        if state.step % cfg.train.log_every == 0 or state.step == total_steps:
            tot = accelerator.reduce(log_acc, "sum")
            log_acc.zero_()
            rate = meter.interval()
            world_tok_s = tot[2].item() / rate["interval_s"]
            last_loss = tot[0].item() / max(tot[1].item(), 1)
            state.first_loss = last_loss if state.first_loss is None else state.first_loss
            state.tokens += int(tot[2].item())
            record = {
                "step": state.step,
                "epoch": round(state.epoch + state.batches_in_epoch / micro_per_epoch, 4),
                "loss": last_loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": world_tok_s,
                "samples_per_s": tot[3].item() / rate["interval_s"],
                "mfu": metrics.mfu(world_tok_s, flops_tok, peak),
                "mem_gb": metrics.memory_gb(),
                "tokens": state.tokens,
                "elapsed_s": state.elapsed_s + meter.elapsed(),
                "eta_s": metrics.eta_seconds(meter.elapsed(), state.step - start_step, total_steps - start_step),
            }
            if cfg.train.eval_every and eval_loader is not None and state.step % cfg.train.eval_every == 0:
                record["eval_loss"] = eval_loss = evaluate(accelerator, model, eval_loader)
            logger.log(record)
            bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{world_tok_s:,.0f}")
            line = (f"[harness] step {state.step}/{total_steps} loss {last_loss:.4f} lr {record['lr']:.2e} "
                    f"grad_norm {record['grad_norm'] or 0:.3f} tokens/s {world_tok_s:,.0f}")
            bar.write(line) if not bar.disable else say(line)

        # checkpoint every save_every_steps
        if cfg.train.save_every_steps and state.step % cfg.train.save_every_steps == 0:
            path = checkpoint.save_checkpoint(accelerator, out, loop_state(), cfg.train.save_total_limit)
            say(f"[harness] checkpoint: {path}")
    bar.close()
    train_time = meter.elapsed()
    if state.step < total_steps:  # this attempt ends early (train.stop_at_step): keep the state, export nothing
        if not cfg.train.save_every_steps or state.step % cfg.train.save_every_steps:
            path = checkpoint.save_checkpoint(accelerator, out, loop_state(), cfg.train.save_total_limit)
        say(f"[harness] stopped at step {state.step}/{total_steps} with checkpoint "
            f"{checkpoint.checkpoints_root(out) / f'step-{state.step}'}; continue with train.resume=auto")
        logger.close()
        accelerator.end_training()
        return {"steps": state.step, "stopped_early": True}

    # ---- the end: final evaluation, export, report
    if eval_loader is not None:
        eval_loss = evaluate(accelerator, model, eval_loader)
        logger.log({"step": state.step, "eval_loss": eval_loss})
        say(f"[harness] eval loss {eval_loss:.4f}")
    final_dir = None
    if cfg.train.save_final:
        final_dir = checkpoint.export_final(accelerator, model, tokenizer, out / "final")
        say(f"[harness] final model: {final_dir}")
    logger.close()
    report = {
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        **zero,
        "parameters": n_params,
        "parameters_per_rank": held,
        "precision": precision,
        "tf32": tf32,
        "steps": state.step,
        "resumed_from": str(resume_from) if resume_from else None,
        "epochs": round(state.epoch + state.batches_in_epoch / micro_per_epoch, 4),
        "global_batch": global_batch,
        "tokens": state.tokens,
        "train_time_s": state.elapsed_s + train_time,
        "wall_time_s": time.time() - t_start,
        "tokens_per_s": state.tokens / max(state.elapsed_s + train_time, 1e-9),
        "first_loss": state.first_loss,
        "final_loss": last_loss,
        "eval_loss": eval_loss,
        "data": data_stats,
        "final_dir": str(final_dir) if final_dir else None,
        "hardware": env,
    }
    if accelerator.is_main_process:
        checkpoint.write_json(out / "report.json", report)
    accelerator.end_training()
    say(f"[harness] done: step {state.step}, {train_time:.1f}s this attempt, loss "
        f"{state.first_loss if state.first_loss is not None else float('nan'):.4f} -> "
        f"{last_loss if last_loss is not None else float('nan'):.4f}; report {out / 'report.json'}")
    return report


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
        run(cfg)
    except HarnessError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

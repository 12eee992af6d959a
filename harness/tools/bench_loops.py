"""The contenders `harness bench` measures the harness against, each run in a worker process of its own
(`python -m harness.tools.bench --worker raw|trainer|trainer_grouped ...`, started by harness/tools/bench.py):

    raw       a minimal loop: forward, token-mean loss, backward, clip, step, schedule, zero_grad;
    trainer   transformers.Trainer with the harness's collator and optimizer/schedule, timed by a callback;
    trainer_grouped   the same with train_sampling_strategy="group_by_length".

Both build the harness's model, data, optimizer and schedule (`_build_common`) before their clock starts.
"""

from __future__ import annotations

import tempfile
import time
from typing import Optional

from harness.errors import ConfigError
from harness import hardware
from harness import model as model_lib
from harness.data import samples as data_lib
from harness.data.loaders import resolve_max_len, training_rows
from harness.optim import build_optimizer, lr_lambda
from harness.losses import token_loss_sum
from harness.observe.metrics import memory_gb

# ----------------------------------------------------------------------------------------------- workers
#
# A worker builds everything before its clock starts; the clock covers optimizer steps W+1..W+N only.


def _build_common(m, d, t, loss_mode: str, threads: int) -> dict:
    """What raw and trainer share with the harness: device, precision, tokenizer, data, model, optimizer, schedule
    (`m`, `d`, `t`: cfg.model, cfg.data, cfg.train; loss_mode: loss.mode)."""
    import torch
    from accelerate.utils import set_seed

    torch.set_num_threads(threads)
    if loss_mode != "generative":
        raise ConfigError(f"harness bench compares generative training; got loss.mode={loss_mode}")
    cuda = torch.cuda.is_available()
    if t.precision == "fp8":
        raise ConfigError("harness bench compares fp32/bf16 loops; fp8 against bf16 is measured by "
                          "scripts/gpu_check.py --preset fp8")
    precision = hardware.resolve_precision(t.precision)
    hardware.enable_tf32(t.tf32)
    tok = model_lib.load_run_tokenizer(m, d.chat_template, loss_mode)
    rows, _ = training_rows(d, t.seed, "generative")  # the sources mixed by weight, as the harness trains on them
    max_len = resolve_max_len(d, rows, tok, lambda *a: None)  # data.max_len=auto: the harness's resolution
    ds, _ = data_lib.tokenize_dataset(rows, tok, max_len)
    collate = data_lib.GenerativeCollator(tok.pad_token_id, pad_to_multiple_of=8 if cuda else 1)
    set_seed(t.seed)
    model = model_lib.build_model(m, tok)
    model.config.use_cache = False  # training: no KV cache (the harness passes use_cache=False)
    total = t.max_steps
    pin = getattr(d, "pin_memory", "auto")
    loader_kw = {"num_workers": d.num_workers, "pin_memory": cuda if pin == "auto" else bool(pin) and cuda}
    if d.num_workers > 0:
        loader_kw.update(prefetch_factor=getattr(d, "prefetch_factor", 2),
                         persistent_workers=getattr(d, "persistent_workers", False))
    return {"torch": torch, "cuda": cuda, "device": torch.device("cuda" if cuda else "cpu"), "precision": precision,
            "tokenizer": tok, "dataset": ds, "collate": collate, "model": model, "total": total,
            "loader_kw": loader_kw, "build_optimizer": build_optimizer, "lr_lambda": lr_lambda}


class _EpochShuffle:
    """Sampler: epoch e visits the samples in torch.randperm(n) order from a generator seeded with seed + e, which is
    the order of the harness's (accelerate's seedable) sampler and the Trainer's, so every contender sees the same
    batches."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        self.epoch += 1
        yield from torch.randperm(self.n, generator=g).tolist()


def run_raw(cfg, warmup: int, steps: int, threads: int, log_every: int) -> dict:
    """A minimal PyTorch loop with the harness's settings."""
    c = _build_common(cfg.model, cfg.data, cfg.train, cfg.loss.mode, threads)
    torch, device, model = c["torch"], c["device"], c["model"]
    from torch.utils.data import DataLoader

    model.to(device).train()
    opt = c["build_optimizer"](model, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, c["lr_lambda"](cfg.optim, c["total"]))
    sampler = _EpochShuffle(len(c["dataset"]), cfg.train.seed) if cfg.data.shuffle else None
    loader = DataLoader(c["dataset"], batch_size=cfg.train.micro_batch_size, sampler=sampler,
                        collate_fn=c["collate"], **c["loader_kw"])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c["precision"])
    scaler = torch.amp.GradScaler(device.type) if c["precision"] == "fp16" else None
    clip = cfg.optim.max_grad_norm
    sync = torch.cuda.synchronize if c["cuda"] else (lambda: None)
    step, tokens, t0, t1, window = 0, 0, None, None, []
    total = c["total"]
    while step < total:
        for batch in loader:
            n_tok = int(batch["attention_mask"].sum())  # on the host, before the copy: no device sync
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss_sum, count = token_loss_sum(logits, batch["labels"])
            loss = loss_sum / count.clamp(min=1)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step > warmup:
                tokens += n_tok
            if step > total - log_every:  # for the loss check only: kept, read after the clock stops
                window.append((loss_sum.detach(), count))
            if step == warmup:
                sync()
                t0 = time.perf_counter()
            if step == total:
                sync()
                t1 = time.perf_counter()
                break
    final_loss = float(sum(s for s, _ in window) / max(1, int(sum(n for _, n in window))))
    return result("raw", steps, tokens, t1 - t0, final_loss, threads=torch.get_num_threads())


def run_trainer(cfg, warmup: int, steps: int, threads: int, log_every: int, grouped: bool = False) -> dict:
    """transformers.Trainer with the harness's model, data, collator, optimizer and schedule; `grouped`: with
    train_sampling_strategy="group_by_length" (transformers 4's group_by_length=True) instead of random order."""
    c = _build_common(cfg.model, cfg.data, cfg.train, cfg.loss.mode, threads)
    torch = c["torch"]
    from transformers import Trainer, TrainerCallback, TrainingArguments

    sync = torch.cuda.synchronize if c["cuda"] else (lambda: None)
    total = c["total"]
    counts: list[int] = []  # tokens of each collated micro-batch, in order (batch k is consumed by step k+1)

    def collate(samples):
        batch = c["collate"](samples)
        counts.append(int(batch["attention_mask"].sum()))
        return batch

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: dict = {}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, total):
                sync()
                self.marks[state.global_step] = time.perf_counter()

    o = cfg.optim
    model = c["model"]
    opt = c["build_optimizer"](model, cfg.optim)  # the harness's AdamW and param groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, c["lr_lambda"](cfg.optim, total))  # and its schedule
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=cfg.train.micro_batch_size, gradient_accumulation_steps=1,
            max_steps=total, learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
            adam_beta2=o.beta2, adam_epsilon=o.eps, max_grad_norm=o.max_grad_norm, lr_scheduler_type="cosine",
            logging_steps=log_every, save_strategy="no", eval_strategy="no", report_to="none",
            use_cpu=not c["cuda"], bf16=c["precision"] == "bf16", fp16=c["precision"] == "fp16",
            dataloader_num_workers=c["loader_kw"]["num_workers"], dataloader_pin_memory=c["loader_kw"]["pin_memory"],
            dataloader_prefetch_factor=c["loader_kw"].get("prefetch_factor"),
            dataloader_persistent_workers=c["loader_kw"].get("persistent_workers", False),
            seed=cfg.train.seed, data_seed=cfg.train.seed, disable_tqdm=True, remove_unused_columns=False,
            train_sampling_strategy=("group_by_length" if grouped else "random" if cfg.data.shuffle
                                     else "sequential"),
        )
        trainer = Trainer(model=model, args=args, train_dataset=c["dataset"], data_collator=collate,
                          optimizers=(opt, sched), callbacks=[clock])
        trainer.train()
    logged = [r["loss"] for r in trainer.state.log_history if r.get("step") == total and "loss" in r]
    tokens = sum(counts[warmup:total])
    seconds = clock.marks[total] - clock.marks[warmup]
    return result("trainer_grouped" if grouped else "trainer", steps, tokens, seconds,
                   logged[-1] if logged else None, threads=torch.get_num_threads())


def peak_memory_gb() -> float:
    """This process's peak memory so far, in GiB: torch.cuda.max_memory_allocated on a GPU, the peak resident set
    size (VmHWM, getrusage's ru_maxrss) on CPU. The harness logs the same figure as mem_gb in metrics.jsonl."""
    return memory_gb()


def result(kind: str, steps: int, tokens: int, seconds: float, final_loss: Optional[float], **extra) -> dict:
    return {"kind": kind, "steps": steps, "tokens": int(tokens), "seconds": seconds,
            "tokens_per_s": tokens / seconds, "step_time_s": seconds / steps, "final_loss": final_loss, **extra}

"""loss.mode=distill (docs/distill.md): on-policy distillation (GKD). The student trains on completions against a
frozen teacher's per-token distribution: the generalized JSD over the vocabulary (distill.loss=jsd, TRL's) or the
reverse KL on the tokens the student drew (sampled_kl), both output heads in chunks of positions (harness/distill/
loss.py). A share distill.lmbda of the micro-batches is on-policy: their prompts (each row's tokens before its first
trained label, or distill.prompts' records in the model's chat template) answered by the student with the continuous
engine (harness/rl/generation.py, as loss.mode=rl samples), the draws seeded by (distill.seed, step, micro-batch,
process, row); the others train on the data's own completions (data.train_files: prompt / completion or messages
records), or with distill.seq_kd on the teacher's own samples (its own engine, the same seeding)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, replace

import torch

from harness import IGNORE_INDEX, losses, moe
from harness.config import Config
from harness.config.distill import DistillConfig
from harness.data.samples import model_inputs, real_tokens
from harness.distill.loss import Divergence, DivergenceHead, teacher_hidden
from harness.distill.teacher import check_vocabulary, load_teacher
from harness.errors import ConfigError
from harness.objective import Objective, Parts, generative_loss_sum
from harness.rft.contract import Sampling
from harness.rl.batch import rows
from harness.rl.generation import Generation, Prompts, SamplingSettings
from harness.rl.prompts import PromptTask
from harness.rl.rollout import index_batch
from harness.state import StepSums, distill_figures


def on_policy(d: DistillConfig, step: int, micro: int) -> bool:
    """Whether micro-batch `micro` of step `step` is sampled by the student: a draw < distill.lmbda, seeded by
    (distill.seed, step, micro) alone, so every process draws the same (the engine's call is collective under
    ZeRO-3) and a resumed run draws what the uninterrupted one did."""
    return random.Random(f"{d.seed}:{step}:{micro}").random() < d.lmbda


def prompts_of(batch: dict) -> list[list[int]]:
    """Each row's prompt: its tokens before the first trained label (a row trained from its first token: that
    token alone)."""
    out = []
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        trained = (labels != IGNORE_INDEX).nonzero()
        start = max(int(trained[0]) if len(trained) else int(mask.sum()), 1)
        out.append(ids[:start].tolist())
    return out


DIVERGENCE_CHUNK_SHARE = 4  # distill's chunks: loss.chunked_ce_size / this, positions (DistillMode.__init__)


class DistillMode(Objective):
    def __init__(self, cfg: Config, parts: Parts, teacher, vocab, engines: dict, prompts=None):
        """`engines`: {"student": the on-policy samples' Generation (distill.lmbda > 0), "teacher": seq_kd's};
        `prompts`: distill.prompts encoded (harness.rl.generation.Prompts), or None (data.train_files' rows)."""
        super().__init__(cfg.loss, cfg.model, cfg.train.grad_accum, parts, chunk_size=cfg.loss.chunked_ce_size)
        self.d, self.teacher, self.vocab, self.engines, self.prompts = cfg.distill, teacher, vocab, engines, prompts
        self.div = Divergence(cfg.distill.beta, cfg.distill.temperature, cfg.distill.loss)
        self.pad_id = parts.tokenizer.pad_token_id
        self.rank = parts.accelerator.process_index
        # the divergence keeps about 4x the chunked CE's chunk x vocab tensors alive (both heads' log-softmaxes,
        # the mixture, the gradients): a quarter of loss.chunked_ce_size positions a chunk holds its peak near the
        # CE's (docs/bench/distill-vocab128k-2x1024-cpu.txt: 1024 positions 0.53x full logits, 256: 0.17x)
        self.div_chunk = max(1, cfg.loss.chunked_ce_size // DIVERGENCE_CHUNK_SHARE)

    def step_batches(self, streams: dict, step: int, unlogged) -> tuple[list, list]:
        """The step's micro-batches of the data (data.train_files' rows, or distill.prompts' indices); those drawn
        on-policy (`on_policy`) answered by the student, the others by the teacher under distill.seq_kd, else kept
        with the data's completions (distill.prompts' are all answered: lmbda 1 or seq_kd, config/distill.py)."""
        gen, emb = super().step_batches(streams, step, unlogged)
        drawn = [on_policy(self.d, step, k) for k in range(self.accum)]
        if self.prompts is not None or self.d.seq_kd or any(drawn):
            t0 = time.perf_counter()
            gen = [self.answered(b, step, k, on) for k, (b, on) in enumerate(zip(gen, drawn))]
            unlogged.add(StepSums(rl_gen_s=time.perf_counter() - t0 if self.accelerator.is_main_process else 0.0))
        for b, on in zip(gen, drawn):
            b["on_policy"] = on
        return gen, emb

    def answered(self, batch, step: int, micro: int, on: bool) -> dict:
        """Micro-batch `micro` with the completions it trains on: the student's (`on`), the teacher's (seq_kd),
        or the data's (`batch` as it is)."""
        who = "student" if on else "teacher" if self.d.seq_kd else None
        if who is None:
            return batch
        prompts = prompts_of(batch) if self.prompts is None else \
            self.prompts.ids([self.prompts.train[int(i)] for i in batch])
        return self.sample(prompts, step, micro, who)

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], step: int, micro: int, who: str) -> dict:
        """The prompts answered by `who` (student, teacher: one completion each, EOS kept, seeded by (distill.seed,
        step, micro-batch, process, row), the teacher's draws apart), as training rows."""
        tag = () if who == "student" else (who,)
        seed = (lambda i, j: (self.d.seed, step, micro, self.rank, i, *tag))
        got = self.engines[who].answer(prompts, 1, Sampling(self.d.temperature, 1.0, seed=seed))
        made = rows(prompts, [list(group[0].ids) or [self.pad_id] for group in got], self.pad_id)
        return {k: v.to(self.accelerator.device) for k, v in made.items()}

    def passes(self, batch: dict, emb, scale) -> StepSums:
        """One micro-batch: the teacher's final hidden states (no gradient), the student's forward with its head
        returning the chunked divergence, its backward pass (token averaging: W A / the step's trained tokens)."""
        inputs = model_inputs(batch)
        teacher = teacher_hidden(self.teacher, inputs)
        with moe.RouterLoss(self.model, self.router_coef) as router, \
                DivergenceHead(self.model, batch["labels"], teacher, self.div, self.div_chunk, self.vocab) as head:
            out = self.model(**inputs, use_cache=False)  # (a MoE student: the router's aux loss of the pass too)
        total, count = head.result(out)
        self.check.backward(total * scale + router.term)
        reverse, agree = head.figures
        return StepSums(gen_sum=total.detach(), gen_count=count, gen_micro=1, distill_reverse_kl_sum=reverse,
                        distill_agree=agree, distill_on_policy=int(batch["on_policy"]), tokens=real_tokens(batch),
                        positions=batch["input_ids"].numel(), samples=batch["input_ids"].shape[0],
                        flops=self.flops(batch, backward=True), **router.sums())

    def gen_scale(self, gen_batches: list[dict]) -> torch.Tensor:
        """W A / the step's trained tokens over every process (TRL's num_items_in_batch: token averaging, one
        all-reduce), whatever loss.gen_averaging says."""
        local = torch.stack([losses.trained_tokens(b["labels"]) for b in gen_batches]).sum()
        total = self.accelerator.reduce(local.to(self.accelerator.device), "sum")
        return losses.step_scale(self.world, self.accum, total.double()).float()

    def figures(self, sums: StepSums) -> dict:
        """A MoE student's router term in the loss (a mean over the step's micro-batches), aux_loss and
        expert_load apart."""
        term, router = moe.router_figures(asdict(sums))
        out = distill_figures(sums)
        return {**out, "loss": out["loss"] + term, **router}

    @torch.no_grad()
    def evaluate(self, data) -> dict:
        """On data.gen_eval's completions: the student's reverse KL to the teacher per token, the top-1 agreement,
        and the student's own next-token loss (over every process; each row counted once)."""
        if data.gen_eval is None:
            return {}
        world, ds, size = self.world, data.gen_eval.dataset, data.gen_eval.batch_size
        mine = list(range(self.rank, len(ds), world))
        totals = torch.zeros(4, dtype=torch.float64, device=self.accelerator.device)
        self.model.eval()
        for i in range(math.ceil(math.ceil(len(ds) / world) / size)):
            samples = [ds[j] for j in mine[i * size:(i + 1) * size]]
            samples = samples or [{**ds[0], "labels": [IGNORE_INDEX] * len(ds[0]["labels"])}]  # counts nothing
            batch = {k: v.to(self.accelerator.device) for k, v in data.gen_eval.collate_fn(samples).items()}
            inputs = model_inputs(batch)
            teacher = teacher_hidden(self.teacher, inputs)
            with DivergenceHead(self.model, batch["labels"], teacher, Divergence(1.0, 1.0), self.div_chunk,
                                self.vocab) as head:  # (its figures: the reverse KL at temperature 1, the agreement)
                out = self.model(**inputs, use_cache=False)
            _, count = head.result(out)
            nll, _ = generative_loss_sum(self.model, batch, self.chunk_size)
            totals += torch.stack([head.figures[0].double(), head.figures[1].double(), count.double(), nll.double()])
        self.model.train()
        totals = self.accelerator.reduce(totals, "sum")
        n = totals[2].clamp(min=1)
        return {"eval_reverse_kl": (totals[0] / n).item(), "eval_top1_agreement": (totals[1] / n).item(),
                "eval_loss": (totals[3] / n).item()}


def prompt_stream(cfg: Config, accelerator):
    """distill.prompts: (their records as a task, a DataLoader of their indices, train.micro_batch_size a
    micro-batch; not prepared), the stream in place of data.train_files; None without them."""
    from torch.utils.data import DataLoader

    d = cfg.distill
    if cfg.loss.mode != "distill" or not d.prompts:
        return None
    task = PromptTask(d.prompts, cfg.data.cache_dir, key="distill.prompts")
    if cfg.data.train_files:
        accelerator.print(f"[harness] distill: the {len(task.records)} prompts of distill.prompts in place of "
                          f"data.train_files, which is not read")
    return task, DataLoader(list(range(len(task.records))), batch_size=cfg.train.micro_batch_size,
                            shuffle=cfg.data.shuffle, collate_fn=index_batch)


def encoded_prompts(d: DistillConfig, parts: Parts, models: list) -> Prompts:
    """distill.prompts (the stream's task, `parts.data.source`) in the model's chat template, encoded once; each
    prompt and distill.max_new_tokens within the context of every model that answers (`models`)."""
    prompts = Prompts(parts.data.source, parts.tokenizer, parts.say)
    for model in models:
        try:
            prompts.check_context(parts.accelerator.unwrap_model(model).config, d.max_new_tokens)
        except ConfigError as e:
            raise ConfigError(str(e).replace("rft.max_new_tokens", "distill.max_new_tokens")) from None
    return prompts


SEQ_KD = ", the rest on the teacher's own samples (seq_kd)"


def build(cfg: Config, parts: Parts) -> DistillMode:
    """The teacher loaded and checked before step 1; the engines of the on-policy samples (distill.lmbda > 0) and
    of the teacher's (distill.seq_kd)."""
    d = cfg.distill
    teacher = load_teacher(d, parts.tokenizer, parts.accelerator.mixed_precision, parts.accelerator.device,
                           parts.accelerator, parts.zero_stage)
    vocab = check_vocabulary(d, parts.model, teacher, parts.tokenizer)
    sampling = SamplingSettings(temperature=d.temperature, max_new_tokens=d.max_new_tokens, seed=d.seed,
                                compile=cfg.rft.compile)
    answering = {"student": parts.model} if d.lmbda > 0 else {}
    if d.seq_kd:
        answering["teacher"] = teacher
    engines = {who: Generation(sampling, cfg.train.micro_batch_size, replace(parts, model=model))
               for who, model in answering.items()}
    prompts = encoded_prompts(d, parts, list(answering.values())) if d.prompts else None
    held = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in teacher.parameters())
    parts.say(f"[harness] distill: teacher {d.teacher} ({held:,} parameters, frozen"
              f"{', partitioned (ZeRO-3)' if parts.zero_stage == 3 else ''}, {next(teacher.parameters()).dtype}), "
              f"loss {d.loss}"
              f"{f' beta {d.beta}' if d.loss == 'jsd' else ''}, temperature {d.temperature}, on-policy share "
              f"lmbda {d.lmbda}{SEQ_KD if d.seq_kd else ''}"
              + (f", {len(prompts.train)} prompts (distill.prompts)" if prompts is not None else "")
              + (f" (head rows {vocab} of both)" if vocab else ""))
    return DistillMode(cfg, parts, teacher, vocab, engines, prompts)

"""loss.mode=rl (docs/rl.md): GRPO on sampled answers. Every rl.iterations steps the mode's rollouts
(harness/rl/rollout.py) answer the step's questions from the current weights and turn the answers into micro-batches
with their advantages; the micro-step is the policy's log-probs of a micro-batch of answers, GRPO's loss times the
step's factor (harness/rl/loss.py), its backward pass through the LossCheck, and the sums of the log line."""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from harness import moe
from harness.config import Config
from harness.data.samples import real_tokens
from harness.objective import Objective, Parts
from harness.rl import loss as rl_loss
from harness.rl.batch import completion_logps, completion_mask
from harness.rl.generation import SamplingSettings
from harness.rl.rollout import Rollouts, question_loader
from harness.state import StepSums, rl_figures


class RlMode(Objective):
    def __init__(self, cfg: Config, parts: Parts, rollouts: Rollouts):
        super().__init__(cfg.loss, cfg.model, cfg.train.grad_accum, parts, chunk_size=cfg.loss.chunked_ce_size)
        self.rl, self.temperature = cfg.rl, cfg.rft.temperature  # the answers were sampled at rft.temperature
        self.grpo = rl_loss.Grpo.of(cfg.rl, cfg.rft.max_new_tokens)
        self.rollouts = rollouts

    def step_batches(self, streams: dict, step: int, unlogged) -> tuple[list, list]:
        """The step's micro-batches of answers: every rl.iterations steps new questions from the question stream,
        answered by these weights."""
        return self.rollouts.step_batches(streams["gen"], step, unlogged), [None] * self.accum

    def gen_scale(self, gen_batches: list[dict]) -> torch.Tensor:
        return gen_batches[0]["scale"]  # W A / the step's denominator (rl.loss_type), set with the answers

    def passes(self, batch: dict, emb, scale: torch.Tensor) -> StepSums:
        t0 = time.perf_counter()
        # MoE: the router's aux loss of the pass (TRL's GRPO adds it too), except on shared_prompts' rows, whose
        # [rows, 1, width, width] attention mask the model's load-balancing loss cannot read (said at the start)
        with moe.RouterLoss(self.model, self.router_coef, on="packed_unit" not in batch) as router:
            logps = completion_logps(self.model, batch, self.chunk_size, self.temperature)
        mask = completion_mask(batch)
        per_token, clipped, kl = rl_loss.per_token_terms(logps, batch.get("old_logps"), batch["advantages"],
                                                         self.grpo, batch.get("ref_logps"), mask)
        total = rl_loss.loss_sum(self.grpo.loss_type, per_token, mask)
        self.check.backward(total * scale + router.term)
        main = self.accelerator.is_main_process
        on = mask.bool()
        return StepSums(rl_loss_sum=total.detach() * scale / (self.world * self.accum),
                        rl_steps=int(self.check.micro == 0 and main),
                        rl_clipped=(clipped & on).sum(), rl_tokens=batch["all_tokens"],  # advantage-0 answers' too
                        rl_kl_sum=(kl.detach() * mask).sum(),
                        rl_train_s=(time.perf_counter() - t0) if main else 0.0,
                        tokens=batch["packed_tokens"] if "packed_tokens" in batch else real_tokens(batch),
                        positions=batch.get("packed_input_ids", batch["input_ids"]).numel(),
                        samples=batch["all_answers"],
                        flops=self.flops(batch, backward=True), **router.sums())

    def figures(self, sums: StepSums) -> dict:
        """GRPO's log line, each reward function's figures and rl.log_completions' rows (collective); a MoE's
        router term in the loss (a mean over the step's micro-batches), aux_loss and expert_load apart."""
        term, router = moe.router_figures(asdict(sums))
        out = rl_figures(asdict(sums), self.rl.beta)
        return {**out, "loss": out["loss"] + term, **router, **self.rollouts.logged()}

    def evaluate(self, data) -> dict:
        return self.rollouts.evaluate()  # `rft test` accuracy on the task's test split

    def describe_rows(self, sequences: int) -> str:
        return f"{self.rl.questions_per_step} questions x {self.rl.num_generations} answers"

    def generation_graphs(self) -> int:
        return self.rollouts.engine.compiled_graphs  # the engine's compiled decode step: graphs of its own


def question_stream(cfg: Config, accelerator):
    """(the task, its train questions' index loader): the stream the mode answers, in place of data.train_files;
    the task is built once a run, here, and handed to `build` through the run's data (`source`)."""
    return question_loader(cfg.rl, cfg.rft, cfg.train.grad_accum, cfg.data.shuffle, accelerator.num_processes,
                           cfg.data.cache_dir)


def build(cfg: Config, parts: Parts) -> RlMode:
    """Before a checkpoint is loaded: the reference (rl.beta > 0) is the starting model."""
    rollouts = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum, parts, parts.data.source,
                        cfg.loss.chunked_ce_size)
    parts.accelerator.register_for_checkpointing(rollouts)  # the half-used generation batch, with each checkpoint
    parts.say(f"[harness] rl: {cfg.rl.algorithm}, {cfg.rl.questions_per_step} questions x {cfg.rl.num_generations} "
              f"answers per generation batch, {cfg.rl.iterations} step(s) on each, loss_type {cfg.rl.loss_type}, "
              f"{len(rollouts.questions)} train questions")
    per_step = cfg.rl.questions_per_step * cfg.rl.num_generations
    per_process = per_step // parts.accelerator.num_processes
    parts.say(f"[harness] rl: {per_step} completions per step, {per_process} per process, "
              f"{per_process // cfg.train.grad_accum} per micro-batch (TRL's per_device_train_batch_size; "
              f"rl.questions_per_step counts prompts, TRL's generation batch / num_generations)")
    config = moe.base_model(parts.model).config
    coef = moe.router_coef(config, cfg.model.router_aux_loss_coef) if moe.is_moe(config) else 0.0
    if cfg.rl.rows == "shared_prompts" and coef:
        parts.say("[harness] rl: the router's aux loss is not added on rl.rows=shared_prompts (its attention mask is "
                  "not one the model's load-balancing loss reads); rl.rows=packed or padded adds it")
    return RlMode(cfg, parts, rollouts)

"""loss.mode=preference (docs/preference.md): pairs {prompt, chosen, rejected}, one forward of chosen + rejected a
micro-batch, the loss loss.preference (dpo, ipo, simpo, orpo: TRL's) on the sequences' log-probs through the output
head in chunks; the reference log-probs (dpo, ipo) computed once before training, from the starting model."""

from __future__ import annotations

from dataclasses import asdict

import torch

from harness import moe
from harness.config import Config
from harness.data.samples import real_tokens
from harness.objective import Objective, Parts
from harness.preference import attach_reference, evaluate_preference, pair_terms, sequence_logps, step_scale
from harness.state import StepSums, preference_figures


class PreferenceMode(Objective):
    def gen_scale(self, gen_batches: list[dict]) -> torch.Tensor:
        """[W A / pairs, W A / chosen tokens] of the step (one all-reduce)."""
        return step_scale(self.accelerator, self.world, self.accum, gen_batches)

    def passes(self, gen: dict, emb, scale: torch.Tensor) -> StepSums:
        """One pair micro-batch: forward, the step-averaged loss's backward pass, the sums for the log line."""
        with moe.RouterLoss(self.model, self.router_coef) as router:  # MoE: the router's aux loss of the pass
            logps, counts = sequence_logps(self.model, gen, self.chunk_size)
        per_pair, rc, rr, nll, chosen_tokens = pair_terms(self.loss, logps, counts, gen)
        loss = per_pair.sum() * scale[0]
        if self.loss.preference == "orpo":
            loss = loss + nll * scale[1]
        self.check.backward(loss + router.term)
        n = per_pair.shape[0]
        return StepSums(pref_sum=per_pair.detach().sum(), pref_pairs=n, nll_sum=nll.detach(), nll_count=chosen_tokens,
                        reward_chosen_sum=rc.sum(), reward_rejected_sum=rr.sum(), reward_correct=(rc > rr).sum(),
                        gen_micro=1, tokens=real_tokens(gen), positions=gen["input_ids"].numel(),
                        samples=2 * n, flops=self.flops(gen, backward=True), **router.sums())

    def figures(self, sums: StepSums) -> dict:
        """TRL's figures; a MoE's router term in the loss (a mean over the step's micro-batches, as in generative
        mode), aux_loss and expert_load apart."""
        term, router = moe.router_figures(asdict(sums))
        out = preference_figures(asdict(sums), self.loss.preference == "orpo")
        return {**out, "loss": out["loss"] + term, **router}

    def evaluate(self, data) -> dict:
        if data.gen_eval is None:
            return {}
        return evaluate_preference(self.accelerator, self.model, data.gen_eval, self.loss, self.chunk_size)

    def describe_rows(self, sequences: int) -> str:
        return f"{sequences} pair{'s' if sequences != 1 else ''}"  # chosen and rejected: twice the sequences


def build(cfg: Config, parts: Parts) -> PreferenceMode:
    chunk_size = cfg.loss.chunked_ce_size  # sequence log-probs: always through the output head, in chunks
    # the reference (dpo, ipo): the model as it starts, before a checkpoint is loaded; stored in output_dir
    attach_reference(cfg.loss.preference, cfg.model, cfg.train, parts, chunk_size)
    return PreferenceMode(cfg.loss, cfg.model, cfg.train.grad_accum, parts, chunk_size=chunk_size)

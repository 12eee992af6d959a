"""The micro-step of loss.mode=rl: the policy's log-probs of a micro-batch of answers, GRPO's loss times the step's
factor (harness/rl/loss.py), its backward pass through the objective's LossCheck, and the sums of the log line.

    python -c "from harness.rl.step import micro_step; help(micro_step)"
"""

from __future__ import annotations

import time

import torch

from harness.data.samples import real_tokens
from harness.rl import loss as rl_loss
from harness.rl.batch import completion_logps, completion_mask
from harness.state import StepSums


def micro_step(objective, batch: dict, scale: torch.Tensor) -> StepSums:
    t0 = time.perf_counter()
    rl, temperature = objective.rl_cfg, objective.rl_temperature
    eps_high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
    logps = completion_logps(objective.model, batch, objective.chunk_size, temperature)
    mask = completion_mask(batch)
    per_token, clipped, kl = rl_loss.per_token_terms(logps, batch.get("old_logps"), batch["advantages"], rl.epsilon,
                                                     eps_high, rl.beta, batch.get("ref_logps"), mask,
                                                     rl.importance_sampling)
    total = rl_loss.loss_sum(rl.loss_type, per_token, mask)
    objective.check.backward(total * scale)
    world, accum = objective.world, objective.accum
    first = objective.check.micro == 0 and objective.accelerator.is_main_process
    on = mask.bool()
    return StepSums(rl_loss_sum=total.detach() * scale / (world * accum), rl_steps=int(first),
                    rl_clipped=(clipped & on).sum(), rl_tokens=batch["all_tokens"],  # advantage-0 answers' too
                    rl_kl_sum=(kl.detach() * mask).sum(),
                    rl_train_s=(time.perf_counter() - t0) if objective.accelerator.is_main_process else 0.0,
                    tokens=batch["packed_tokens"] if "packed_tokens" in batch else real_tokens(batch),
                    positions=batch.get("packed_input_ids", batch["input_ids"]).numel(),
                    samples=batch["all_answers"],
                    flops=objective.flops(batch, backward=True))

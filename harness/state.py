"""The loop's named state: where a run is (`LoopState`, saved with every checkpoint) and what its steps add up between
two log lines (`StepSums`, kept on the device by `UnloggedSums` and all-reduced once per log line)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import torch

Number = Any  # a Python number or a 0-d device tensor (adding it up never waits for the GPU)


@dataclass
class StepSums:
    """Sums over micro-steps: what `Objective.micro_step` returns, and what a log line is computed from."""

    gen_sum: Number = 0  # generative loss summed over trained tokens
    gen_count: Number = 0  # trained (labelled) tokens
    gen_mean_sum: Number = 0  # per-micro-batch mean generative losses, summed (mixed averaging)
    gen_micro: Number = 0  # generative micro-batches
    emb_sum: Number = 0  # contrastive losses, summed over micro-steps
    emb_count: Number = 0  # embedding micro-steps
    tokens: Number = 0  # non-padding input tokens
    samples: Number = 0  # sequences (generative rows + queries)
    positions: Number = 0  # input positions, padding included
    flops: Number = 0  # model FLOPs (for MFU)
    wait_s: Number = 0  # seconds spent waiting for the data loader
    pref_sum: Number = 0  # preference losses, summed over pairs
    pref_pairs: Number = 0  # preference pairs
    nll_sum: Number = 0  # ORPO: NLL of the chosen completions, summed over their tokens
    nll_count: Number = 0  # ORPO: chosen completion tokens
    reward_chosen_sum: Number = 0  # rewards of the chosen completions, summed over pairs
    reward_rejected_sum: Number = 0  # rewards of the rejected completions, summed over pairs
    reward_correct: Number = 0  # pairs whose chosen reward is above the rejected one
    rl_loss_sum: Number = 0  # loss.mode=rl: each step's loss (summed over its micro-steps and processes), summed
    rl_steps: Number = 0  # optimizer steps (counted on one process)
    rl_reward_sum: Number = 0  # rewards of the sampled answers, summed
    rl_reward_sq_sum: Number = 0  # their squares (the spread)
    rl_answers: Number = 0  # sampled answers scored
    rl_flat_groups: Number = 0  # questions whose answers all got the same reward (no advantage, no gradient)
    rl_groups: Number = 0  # questions sampled
    rl_length_sum: Number = 0  # answer tokens (EOS included) of the sampled answers
    rl_clipped: Number = 0  # answer tokens trained whose ratio was clipped
    rl_tokens: Number = 0  # answer tokens trained
    rl_kl_sum: Number = 0  # KL to the reference, summed over the answer tokens trained
    rl_gen_s: Number = 0  # seconds generating (the main process's)
    rl_train_s: Number = 0  # seconds in the training passes (the main process's)
    rl_gen_calls: Number = 0  # engine calls generating the answers (the main process's)
    distill_reverse_kl_sum: Number = 0  # loss.mode=distill: KL(student || teacher) summed over the trained tokens
    distill_agree: Number = 0  # ... the trained tokens whose top-1 token the teacher's is
    distill_on_policy: Number = 0  # ... the micro-batches the student sampled (distill.lmbda's draws)
    aux_sum: Number = 0  # MoE: the router's aux_loss, summed over generative micro-batches (harness/moe.py)
    aux_term_sum: Number = 0  # MoE: router_aux_loss_coef * aux_loss (what the loss adds), summed likewise
    load_sum: Number = 0  # MoE: the largest expert's share of the routed tokens (per-layer mean), summed likewise
    aux_micro: Number = 0  # MoE: the micro-batches summed in the three above

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def gritlm_figures(sums, loss, combined: bool) -> dict:
    """{"loss"} (and "loss_gen", "loss_emb" of a combined loss: loss.mode=unified) from summed StepSums; `loss`:
    cfg.loss (gen_averaging, the two weights)."""
    parts = {}
    if sums.gen_micro:
        parts["loss_gen"] = (sums.gen_sum / max(sums.gen_count, 1) if loss.gen_averaging == "token"
                             else sums.gen_mean_sum / sums.gen_micro)
    if sums.emb_count:
        parts["loss_emb"] = sums.emb_sum / sums.emb_count
    if combined:
        return {"loss": loss.gen_weight * parts["loss_gen"] + loss.emb_weight * parts["loss_emb"], **parts}
    return {"loss": next(iter(parts.values()))}


def preference_figures(sums: dict, orpo: bool, prefix: str = "") -> dict:
    """{loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies} (TRL's names; `prefix` eval_
    for the evaluation) from summed preference StepSums values."""
    pairs = max(sums["pref_pairs"], 1)
    loss = sums["pref_sum"] / pairs + (sums["nll_sum"] / max(sums["nll_count"], 1) if orpo else 0.0)
    chosen, rejected = sums["reward_chosen_sum"] / pairs, sums["reward_rejected_sum"] / pairs
    return {f"{prefix}loss": loss, f"{prefix}rewards/chosen": chosen, f"{prefix}rewards/rejected": rejected,
            f"{prefix}rewards/margins": chosen - rejected, f"{prefix}rewards/accuracies": sums["reward_correct"] / pairs}


def distill_figures(sums) -> dict:
    """loss.mode=distill's log line from summed StepSums: the loss per trained token, the reverse KL to the teacher
    and the top-1 agreement on the interval's tokens, the on-policy share of its micro-batches."""
    n = max(sums.gen_count, 1)
    return {"loss": sums.gen_sum / n, "reverse_kl": sums.distill_reverse_kl_sum / n,
            "top1_agreement": sums.distill_agree / n, "on_policy_share": sums.distill_on_policy / max(sums.gen_micro, 1)}


def rl_figures(sums: dict, beta: float) -> dict:
    """The log line of loss.mode=rl from summed StepSums values: loss, reward mean and std, the share of questions
    whose answers all scored alike, clip fraction, KL (beta > 0), mean answer length, seconds generating and
    training per step and the engine calls of the interval (the main process's)."""
    steps, n = max(sums["rl_steps"], 1), max(sums["rl_answers"], 1)
    mean = sums["rl_reward_sum"] / n
    out = {"loss": sums["rl_loss_sum"] / steps, "reward": mean,
           "reward_std": max(sums["rl_reward_sq_sum"] / n - mean * mean, 0.0) ** 0.5,
           "flat_group_share": sums["rl_flat_groups"] / max(sums["rl_groups"], 1),
           "clip_fraction": sums["rl_clipped"] / max(sums["rl_tokens"], 1),
           "completion_length": sums["rl_length_sum"] / n,
           "gen_s_per_step": sums["rl_gen_s"] / steps, "train_s_per_step": sums["rl_train_s"] / steps,
           "gen_calls": sums["rl_gen_calls"]}
    if beta:
        out["kl"] = sums["rl_kl_sum"] / max(sums["rl_tokens"], 1)
    return out


class UnloggedSums:
    """The `StepSums` of this process since the last log line, as one float64 vector on the run's device: one
    addition per micro-step, one all-reduce per log line. Rank 0 also carries what was unlogged when the checkpoint
    it resumed from was written."""

    def __init__(self, device, carried: Optional[dict] = None):
        self.device = device
        values = carried or {}
        self.vector = torch.tensor([float(values.get(n, 0.0)) for n in StepSums.names()], dtype=torch.float64,
                                   device=device)

    def add(self, sums: StepSums) -> None:
        self.vector += torch.stack([torch.as_tensor(getattr(sums, n), dtype=torch.float64, device=self.device)
                                    for n in StepSums.names()])

    def total(self, accelerator, reset: bool) -> StepSums:
        """Summed over every process (collective); `reset` starts the next interval."""
        summed = accelerator.reduce(self.vector.clone(), "sum").tolist()
        if reset:
            self.vector.zero_()
        return StepSums(*summed)


@dataclass
class LoopState:
    """Where the loop is; with the accelerate state this is everything needed to continue a run exactly."""

    step: int = 0  # optimizer steps done
    streams: dict = field(default_factory=dict)  # per data stream: {"epoch": e, "batches": micro-batches of e consumed}
    tokens: int = 0  # non-padding input tokens processed, all processes, up to the last log
    elapsed_s: float = 0.0  # training wall time of earlier attempts (resume)
    unlogged: dict = field(default_factory=dict)  # StepSums of every process not yet in a log line, by name
    first_loss: Optional[float] = None
    unwritten: list = field(default_factory=list)  # metrics.jsonl lines a full disk kept out (written on resume)
    layout: dict = field(default_factory=dict)  # how the global batch was split (checkpoint.layout.Layout)
    data_files: dict = field(default_factory=dict)  # the training files' fingerprints (checkpoint/datafiles.py)
    seed: Optional[int] = None  # the train.seed the run started with (None: a checkpoint before it was recorded)
    best: dict = field(default_factory=dict)  # the best evaluation and the patience count (stopping.BestMetric)
    settings: dict = field(default_factory=dict)  # what the run trained with beyond its files (checkpoint/settings.py)

    @classmethod
    def from_saved(cls, saved: dict) -> "LoopState":
        """The state of harness_state.json. Checkpoints written before the sums were named carry them as `log_acc`,
        a list in StepSums order."""
        saved = dict(saved)
        if "log_acc" in saved:
            saved["unlogged"] = dict(zip(StepSums.names(), saved.pop("log_acc")))
        return cls(**saved)

    def to_save(self, elapsed_s: float, unlogged: StepSums) -> dict:
        """What harness_state.json holds: this state with this attempt's time and every process's unlogged sums."""
        return {**asdict(self), "elapsed_s": self.elapsed_s + elapsed_s, "unlogged": asdict(unlogged)}

"""train.early_stopping and train.keep_best: the metric a run ranks its evaluations by, its direction, and whether
this run logs it (checked when the config loads, before step 1). Light: no torch.

    python -c "from harness.config.best import DIRECTIONS; print(DIRECTIONS)"
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.coerce import nested_section
from harness.errors import ConfigError

# Every evaluation metric the run logs, with its direction (True: higher is better), and what logs it.
DIRECTIONS = {
    "eval_loss": False,  # data.eval_files / data.eval_split: the held-out generative (or preference) loss
    "eval_recall_at_1": True,  # data.emb_eval_files: retrieval
    "eval_mrr": True,
    "eval_accuracy": True,  # loss.mode=rl: greedy answers to the task's test split
    "eval_answer_rate": True,
    "eval_rewards/accuracies": True,  # loss.mode=preference with eval pairs
    "eval_rewards/margins": True,
}


@dataclass
class EarlyStoppingConfig:
    """The keys of `train.early_stopping` (a mapping, so that `train.early_stopping.patience=3` overrides one key)."""

    metric: str = "eval_loss"  # an evaluation metric of DIRECTIONS that this run logs
    patience: int = 0  # evaluations in a row without improvement that stop the run; 0: never stop (keep_best ranks)
    min_delta: float = 0.0  # an improvement is a change of more than this, in the metric's direction


EARLY_STOPPING_HELP = {
    "metric": "The evaluation metric ranked (its direction is known): eval_loss (lower is better), eval_recall_at_1, "
              "eval_mrr, eval_accuracy, eval_answer_rate, eval_rewards/accuracies, eval_rewards/margins (higher).",
    "patience": "Stop after this many evaluations in a row that did not improve on the best (train.eval_every "
                "apart; the step-0 baseline is not counted); 0: never stop, the metric only ranks for train.keep_best.",
    "min_delta": "An evaluation improves when it beats the best by more than this (HF Trainer's "
                 "early_stopping_threshold).",
}


def logged_metrics(cfg) -> list[str]:
    """The evaluation metrics of DIRECTIONS that a run of `cfg` (the whole Config) logs at each evaluation."""
    d, mode = cfg.data, cfg.loss.mode
    out = []
    held_out = d.eval_split is not None
    if (d.eval_files or (held_out and mode != "embedding")) and mode in ("generative", "unified", "preference"):
        out.append("eval_loss")
    if mode == "preference" and "eval_loss" in out:
        out += ["eval_rewards/accuracies", "eval_rewards/margins"]
    if mode == "rl":
        out += ["eval_accuracy", "eval_answer_rate"]
    if (d.emb_eval_files or (held_out and mode != "generative")) and mode in ("embedding", "unified"):
        out += ["eval_recall_at_1", "eval_mrr"]
    return out


def early_stopping_config(cfg) -> EarlyStoppingConfig:
    """`train.early_stopping` of `cfg` (the whole Config) checked key by key, with the defaults filled in: a metric of
    known direction that this run logs, evaluations that happen (train.eval_every), a patience >= 0, min_delta >= 0.
    Each failure is one line naming the key."""
    t = cfg.train
    es = nested_section(EarlyStoppingConfig, t.early_stopping, "train.early_stopping")
    if es.metric not in DIRECTIONS:
        raise ConfigError(f"config key 'train.early_stopping.metric': unknown metric {es.metric!r} (its direction is "
                          f"not known); one of {', '.join(DIRECTIONS)}")
    if es.patience < 0 or es.min_delta < 0:
        bad = "patience" if es.patience < 0 else "min_delta"
        raise ConfigError(f"config key 'train.early_stopping.{bad}': must be >= 0, got {getattr(es, bad)}")
    if not (t.early_stopping or t.keep_best):
        return es
    logged = logged_metrics(cfg)
    if es.metric not in logged:
        has = f"this run logs {', '.join(logged)}" if logged else "this run has no evaluation data"
        raise ConfigError(f"config key 'train.early_stopping.metric': {es.metric} is not logged by this run "
                          f"(loss.mode={cfg.loss.mode}); {has}")
    if t.eval_every < 1:
        key = "train.early_stopping" if t.early_stopping else "train.keep_best"
        raise ConfigError(f"config key '{key}': needs evaluations during training: set train.eval_every (steps "
                          f"between two evaluations), e.g. 50")
    return es

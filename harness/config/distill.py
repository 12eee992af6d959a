"""The `distill` section (loss.mode=distill, docs/distill.md): the teacher, the divergence, the on-policy share; TRL's
names where TRL has one (GKDConfig / DistillationConfig: beta, temperature, lmbda, seq_kd). Light: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from harness.config.coerce import help_field as _f
from harness.errors import ConfigError


@dataclass
class DistillConfig:
    """loss.mode=distill: a student trained against a frozen teacher's per-token distribution (GKD)."""

    teacher: Optional[str] = _f(None, "The teacher: a Hugging Face model id or a local folder, with the student's "
                                      "vocabulary (checked before step 1).")
    teacher_recipe: Optional[str] = _f(None, "A recipe that trains the teacher: `harness train` runs it first when "
                                             "distill.teacher is a local folder that does not exist yet.")
    teacher_dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto", "The teacher's weights' dtype. auto: the run's precision (bf16 where train.precision is bf16).")
    teacher_quantization: Literal["none", "4bit", "8bit"] = _f(
        "none", "Load the teacher quantized by bitsandbytes (nf4 / LLM.int8; pip install harness[qlora]).")
    teacher_trust_remote_code: bool = _f(False, "Allow the teacher's model code from its repository.")
    beta: float = _f(0.5, "TRL's beta of the generalized JSD: 0 forward KL(teacher || student), 1 reverse "
                          "KL(student || teacher), between: the generalized JSD with mixture beta.")
    temperature: float = _f(1.0, "Both distributions' softmax temperature in the loss (TRL's temperature); also the "
                                 "on-policy samples' temperature.")
    lmbda: float = _f(0.0, "TRL's lmbda: the share of micro-batches whose completions the student samples itself "
                           "(on-policy, the continuous engine); the rest train on the data's completions.")
    seq_kd: bool = _f(False, "TRL's seq_kd: the micro-batches not sampled by the student (1 - lmbda) train on the "
                             "teacher's own samples (the same engine and seeding) in place of the data's completions.")
    prompts: list = _f([], "Prompt sources (as rl.prompts takes them: a `prompt` per record, a string or chat "
                           "messages) in place of data.train_files (not read then); needs lmbda=1 or seq_kd.")
    teacher_config: dict = _f({}, "The teacher's architecture (its config.json's keys, model_type among them) for "
                                  "`harness zero-plan` to size a hub teacher offline; the run loads the teacher's own.")
    loss: Literal["jsd", "sampled_kl"] = _f(
        "jsd", "jsd: the generalized JSD over the vocabulary at every completion token (TRL's generalized_jsd_loss); "
               "sampled_kl: the reverse KL on the tokens drawn, log p_student - log p_teacher as an advantage "
               "(the cheap form on-policy distillation uses at scale).")
    max_new_tokens: int = _f(64, "On-policy completions: tokens sampled per prompt at most.")
    seed: int = _f(0, "Seed of the on-policy draws (which micro-batches, and the sampled tokens).")


def check_distill(cfg, given: frozenset = frozenset()) -> None:
    """loss.mode=distill: a teacher, the ranges TRL accepts, what is not built yet refused in one line; the distill
    keys set for another mode are refused (`given`: the keys the recipe and the overrides set)."""
    d = cfg.distill
    if cfg.loss.mode != "distill":
        defaults = DistillConfig()  # a saved config.yaml gives every key at its default: only a setting is stray
        stray = sorted(k for k in given if k.startswith("distill.")
                       and getattr(d, k.partition(".")[2], None) != getattr(defaults, k.partition(".")[2], None))
        if stray:
            raise ConfigError(f"config key '{stray[0]}': only loss.mode=distill reads the distill section "
                              f"(loss.mode is {cfg.loss.mode})")
        return
    if not d.teacher:
        raise ConfigError("config key 'distill.teacher': loss.mode=distill needs a teacher (a hub id or a folder)")
    for key, value in (("beta", d.beta), ("lmbda", d.lmbda)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"config key 'distill.{key}': must be in [0, 1], got {value}")
    if not d.temperature > 0:
        raise ConfigError(f"config key 'distill.temperature': must be > 0, got {d.temperature}")
    if d.max_new_tokens < 1:
        raise ConfigError(f"config key 'distill.max_new_tokens': must be >= 1, got {d.max_new_tokens}")
    if d.loss == "sampled_kl" and d.lmbda != 1.0:
        raise ConfigError(f"config key 'distill.loss': sampled_kl scores the student's own samples; set "
                          f"distill.lmbda=1 (got {d.lmbda})")
    if d.prompts and d.lmbda < 1 and not d.seq_kd:
        raise ConfigError(f"config key 'distill.prompts': prompts carry no completions; the student answers them "
                          f"(distill.lmbda=1) or the teacher does (distill.seq_kd=true) (lmbda is {d.lmbda})")
    if d.prompts and cfg.data.eval_split is not None and not cfg.data.eval_files:
        raise ConfigError("config key 'data.eval_split': it holds records out of data.train_files, which "
                          "distill.prompts replace; give the held-out records as data.eval_files")
    if d.teacher_quantization != "none":
        raise ConfigError("config key 'distill.teacher_quantization': a quantized teacher is not supported yet")
    if cfg.data.packing:
        raise ConfigError("config key 'data.packing': loss.mode=distill scores one sequence a row; set "
                          "data.packing=false")

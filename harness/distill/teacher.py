"""loss.mode=distill's teacher: loaded once, frozen (no gradient, no optimizer state: it is not given to the
optimizer nor to accelerate's prepare), in eval mode, in the run's precision unless distill.teacher_dtype says;
its vocabulary checked against the student's before step 1 (`check_vocabulary`).

    python -c "from harness.distill.teacher import load_teacher; help(load_teacher)"
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from harness.config import ModelConfig
from harness.config.distill import DistillConfig
from harness.distributed.zero import frozen_engine
from harness.errors import ConfigError
from harness.model import build_model, source_problem, unwrap

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def teacher_dtype(d: DistillConfig, mixed_precision: str) -> torch.dtype:
    """distill.teacher_dtype; auto: bf16 / fp16 where the run computes so (accelerate's mixed_precision), else fp32."""
    if d.teacher_dtype != "auto":
        return DTYPES[d.teacher_dtype]
    return DTYPES.get(mixed_precision, torch.float32)


def load_teacher(d: DistillConfig, tokenizer, mixed_precision: str, device, accelerator=None,
                 zero_stage: int | None = None) -> torch.nn.Module:
    """The frozen teacher on `device` (a missing folder or an id that cannot be loaded: one line naming
    distill.teacher); under ZeRO-3 (`zero_stage` 3, the run's `accelerator`) loaded partitioned (zero.Init) and
    made a DeepSpeed engine without optimizer: each process holds 1/N of it."""
    problem = source_problem(d.teacher)
    if problem:
        raise ConfigError(f"config key 'distill.teacher': cannot load the teacher '{d.teacher}': {problem}")
    m = ModelConfig(name_or_path=d.teacher, trust_remote_code=d.teacher_trust_remote_code)
    try:
        teacher = build_model(m, tokenizer, dtype=teacher_dtype(d, mixed_precision))
    except ConfigError as e:
        raise ConfigError(str(e).replace("config key 'model.name_or_path'", "config key 'distill.teacher'")) from None
    if zero_stage == 3:
        return frozen_engine(accelerator, teacher)
    return teacher.to(device).eval().requires_grad_(False)


def head_rows(model) -> int:
    """Rows of the output head (the vocabulary the logits span; out_features is right under ZeRO-3 too)."""
    return unwrap(model).get_output_embeddings().out_features


def check_vocabulary(d: DistillConfig, student, teacher, tokenizer) -> int | None:
    """Before step 1: the teacher's tokenizer (where its folder or id has one) maps every token as the student's
    does, and both heads span the tokenizer. Returns the rows both losses read: None (all) where the heads agree,
    else len(tokenizer) (padded heads of one family, e.g. Qwen2.5-7B's 152,064 rows and 0.5B's 151,936)."""
    try:
        theirs = AutoTokenizer.from_pretrained(d.teacher, trust_remote_code=d.teacher_trust_remote_code)
    except (OSError, ValueError):
        theirs = None  # no tokenizer beside the teacher: its head rows are checked alone
    if theirs is not None and theirs.get_vocab() != tokenizer.get_vocab():
        mine, other = tokenizer.get_vocab(), theirs.get_vocab()
        differ = len(set(mine.items()) ^ set(other.items()))
        raise ConfigError(f"config key 'distill.teacher': the teacher's tokenizer differs from the student's "
                          f"({len(other)} vs {len(mine)} tokens, {differ} (token, id) pairs not shared); "
                          f"distillation compares the two distributions token by token")
    rows_s, rows_t, n = head_rows(student), head_rows(teacher), len(tokenizer)
    if min(rows_s, rows_t) < n:
        raise ConfigError(f"config key 'distill.teacher': the output heads span {rows_s} (student) and {rows_t} "
                          f"(teacher) tokens, fewer than the tokenizer's {n}")
    return None if rows_s == rows_t else n

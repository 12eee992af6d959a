"""loss.mode=distill in `harness zero-plan` (harness/tools/zero_plan.py): the frozen teacher beside the student's
training state, and the engines that sample the completions (docs/distill.md).

Memory (GiB = 2**30 bytes):
* The teacher's weights, P_t x t bytes, t its dtype (distill.teacher_dtype; auto: the run's compute precision, 2 bytes
  in a bf16 run); frozen: no gradients, no optimizer states (it is not given to the optimizer). ZeRO-0/1/2: each
  process holds all of it; ZeRO-3: a DeepSpeed engine without optimizer (harness.distributed.zero.frozen_engine),
  P_t x t / N a GPU, its forward gathering 2 x its largest layer at a time (the working set: the larger of the
  student's and the teacher's, their forwards run one after the other); 3-offload: its weights in host memory as the
  student's (the run's offload_param).
* Its final hidden states, micro-batch x max_len x its hidden size x the activations' bytes, held through the
  student's pass (the teacher's output head runs in the student's chunks, harness/distill/loss.py).
* The continuous engine's key/value cache when completions are sampled: the student's (distill.lmbda > 0, the
  training weights' bytes) and the teacher's (distill.seq_kd, t bytes), one slot a row of the micro-batch, W =
  data.max_len + distill.max_new_tokens positions, 2 x layers x kv heads x head dim x W values a slot; counted as
  kept through the training pass (the compiled decode step keeps it; an eager one frees it). Under ZeRO-3 a
  generation gathers the answering model's full weights (in place of the training pass's working set and
  activations).

    python -c "from harness.tools.distill_plan import TeacherPlan; help(TeacherPlan)"
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from harness.config import ModelConfig, load_config
from harness.config.distill import DistillConfig
from harness.errors import ConfigError, HarnessError
from harness.tools.rl_plan import kv_slot_bytes
from harness.tools.sizing import GIB, ModelShape, shape_of

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def teacher_shape(d: DistillConfig, tokenizer: Optional[str] = None) -> ModelShape:
    """The teacher (`d`: cfg.distill) counted on the meta device as the student is (harness.tools.sizing.shape_of): a
    local folder's config.json, or a hub id sized offline from distill.teacher_config (its architecture, model_type
    among them); a folder not there yet that distill.teacher_recipe trains: that recipe's model. `tokenizer`:
    model.tokenizer (the bundled one stands in offline)."""
    m = ModelConfig(name_or_path=d.teacher, config=dict(d.teacher_config), trust_remote_code=d.teacher_trust_remote_code,
                    tokenizer=tokenizer)
    if d.teacher_recipe and not Path(d.teacher).exists():  # not trained yet (`harness train` trains it first)
        shape = shape_of(load_config(d.teacher_recipe).model)
        return dataclasses.replace(shape, note=f"{d.teacher} is not trained yet: sized from distill.teacher_recipe's "
                                               f"model ({d.teacher_recipe})")
    try:
        shape = shape_of(m)
    except (ConfigError, OSError, ValueError) as e:
        why = str(e).replace("config key 'model.name_or_path': ", "")
        raise HarnessError(f"config key 'distill.teacher': zero-plan cannot read the teacher's shape ({why}); give its "
                           f"architecture as distill.teacher_config (its config.json's keys, model_type among them) "
                           f"to size it offline") from None
    return dataclasses.replace(shape, note=shape.note.replace("model.config", "distill.teacher_config"))


class TeacherPlan:
    """zero-plan's loss.mode=distill part: the lines that explain the teacher's and the engines' memory, and the bytes
    they add to each stage's row (`apply`)."""

    def __init__(self, d: DistillConfig, model: ModelConfig, rows: tuple, student: ModelShape, compute: str,
                 hw) -> None:
        """`d`, `model`: cfg.distill, cfg.model; `rows`: (train.micro_batch_size, the rows' positions); the student's
        shape; `compute`: the run's compute precision (bf16, fp16, fp32: the teacher's dtype under auto, the
        activations'); `hw`: zero_plan's Hardware."""
        self.student, self.world, self.gpus_per_node = student, hw.world, hw.gpus_per_node
        self.shape = teacher_shape(d, model.tokenizer)
        self.t = DTYPE_BYTES[d.teacher_dtype if d.teacher_dtype != "auto" else compute]
        act_bytes = DTYPE_BYTES[compute]
        self.rows, self.seq = rows
        self.hidden_states = self.rows * self.seq * self.shape.hidden * act_bytes
        self.width = self.seq + d.max_new_tokens
        self.answering = (["student"] if d.lmbda > 0 else []) + (["teacher"] if d.seq_kd else [])
        self.dtype_name = d.teacher_dtype if d.teacher_dtype != "auto" else f"auto: {compute}"

    @property
    def weights(self) -> float:
        """The teacher's weights, whole."""
        return self.shape.params * self.t

    def _kv(self, who: str, w: int) -> float:
        s, b = (self.student, w) if who == "student" else (self.shape, self.t)
        return self.rows * kv_slot_bytes(s.layers, s.kv_heads, s.head_dim or s.hidden // s.heads, self.width, b)

    def apply(self, row, w: int) -> None:
        """Adds to a zero_plan Row (the student's weights of w bytes): the teacher's weights (partitioned under
        ZeRO-3; in host memory under 3-offload), its working set, its hidden states, the engines' caches and, under
        ZeRO-3, the gathered weights of a generation."""
        zero3, N = row.option.startswith("3"), self.world
        if row.option == "3-offload":  # (the run's offload_param: its share in each node's host memory)
            row.host += self.weights * self.gpus_per_node / N
        else:
            row.teacher = self.weights / N if zero3 else self.weights
        if zero3:
            row.extra = max(row.extra, 2 * max(self.shape.layer_params, self.shape.embed_params) * self.t)
        row.activations += self.hidden_states
        row.generation += sum(self._kv(who, w) for who in self.answering)
        if zero3 and self.answering:  # a generation gathers the answering model's whole weights
            full = max(self.student.params * w if "student" in self.answering else 0,
                       self.weights if "teacher" in self.answering else 0)
            row.gen_peak = max(row.gen_peak, full)

    def lines(self, w: int) -> list[str]:
        s, N = self.shape, self.world
        size = f"{s.params / 1e9:.2f}B" if s.params >= 1e9 else f"{s.params / 1e6:.1f}M"
        out = []
        if s.note:
            out.append(f"teacher: {s.note}")
        out.append(f"teacher (loss.mode=distill, frozen: no gradients, no optimizer states): {s.model_type}, P_t = "
                   f"{s.params:,} parameters ({size}), hidden {s.hidden}, {s.layers} layers; weights "
                   f"P_t x {self.t} B (distill.teacher_dtype {self.dtype_name}) = {self.weights / GIB:.2f} GiB a "
                   f"process at stages 0-2, / N={N} = {self.weights / N / GIB:.2f} GiB under ZeRO-3 (working set 2 x "
                   f"{max(s.layer_params, s.embed_params):,} x {self.t} B); 3-offload: in host memory")
        out.append(f"  its final hidden states through the student's pass: micro-batch {self.rows} x {self.seq} x "
                   f"{s.hidden} x the activations' bytes = {self.hidden_states / GIB:.2f} GiB (in activ)")
        if self.answering:
            kv = {who: self._kv(who, w) for who in self.answering}
            out.append(f"  sampled completions ({', '.join(self.answering)}): {self.rows} slots of W = max_len "
                       f"{self.seq} + distill.max_new_tokens {self.width - self.seq} positions, KV cache "
                       + ", ".join(f"{who} {b / GIB:.2f} GiB" for who, b in kv.items())
                       + " (column gen, kept through the training pass); under ZeRO-3 a generation gathers the "
                       "answering model's whole weights")
        return out

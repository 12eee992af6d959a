"""loss.mode=rl in the plans: the generation's memory beside the training state (`harness zero-plan`) and a step's
time split into generation and training (`harness plan`).

Memory (GiB = 2**30 bytes). The continuous engine (harness/rft/engine.py) allocates its key/value cache once and keeps
it between calls, through the training passes (the compiled step reads it in place): a slot holds one sequence of
W = longest prompt + rft.max_new_tokens positions, 2 (key, value) x layers x kv_heads x head_dim x W values in the
weights' dtype (the engine runs the training weights: fp32 by default, 2 bytes with 16-bit weights), and a decode
step adds harness.rft.stats.logit_bytes(dtype) x vocab bytes per slot (the logits, their fp32 copy, the sampling's
peak: 40 bytes with fp32 weights). The slots are
rft.micro_batch_sequences or the answers of a process's generation batch (one engine call answers them all),
fewer when rft.kv_cache_gb (the budget over KV + logits) holds fewer; with kv_cache_gb null the engine takes up to
90% of the GPU memory free at the generation, so the plan counts the full slot count and says what budget the
rollouts need.
Under ZeRO-3 the generation gathers the full weights (P x the weights' bytes on every GPU) instead of the training
pass's working set; rl.beta > 0 keeps a frozen reference copy of the model (P x the weights' bytes; under ZeRO-3
partitioned as the weights are: the row's weights again).
The training pass's micro-batch is rl.questions_per_step / (processes x train.grad_accum) questions x
rl.num_generations answers, rows of W positions, log-probs through the output head in chunks (always chunked).

Time. A step trains on a generation batch made every rl.iterations steps; the calibration times both parts
(`gen_s_per_step`, `train_s_per_step` of the log, the main process's), and the estimate counts steps x (the step
without generation) + generation batches x seconds per generation batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from harness.rft.stats import logit_bytes
from harness.rft.tasks import build_task
from harness.errors import HarnessError

GIB = 2**30


def prompt_tokens(rft, tokenizer) -> dict:
    """The longest prompt of the rft task's train and test splits, in tokens, as the run encodes it (the question in
    the chat template up to where the answer starts, no special tokens added: harness.rl.rollout)."""
    task = build_task(rft)
    out = {}
    for split in ("train", "test"):
        texts = [tokenizer.apply_chat_template(task.messages(q), add_generation_prompt=True, tokenize=False)
                 for q in task.split(split)]
        out[split] = max((len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]), default=0)
    return out


def kv_slot_bytes(layers: int, kv_heads: int, head_dim: int, width: int, dtype_bytes: int) -> int:
    """Key/value bytes of one sequence of `width` positions (the engine's `slot_bytes`)."""
    return 2 * layers * kv_heads * head_dim * width * dtype_bytes


@dataclass
class GenerationMemory:
    """The engine's cache for one dtype: what it allocates and what the rollouts need at least (bytes)."""

    slots: int  # sequences the cache holds (rft.micro_batch_sequences, or fewer within rft.kv_cache_gb)
    width: int  # positions per slot: longest prompt + rft.max_new_tokens
    slot_bytes: int
    kv: float  # the cache: slots x slot_bytes
    logits: float  # a decode step's logits and sampling: slots x logit_bytes(dtype) x vocab
    rollout_gb: float  # the rft.kv_cache_gb that holds one rollout call (rl.num_generations sequences)


class KvShape(NamedTuple):
    """What a KV cache's slot size reads of the model: layers, kv heads, their width, the vocabulary (the logits)."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int


def generation_memory(rl, rft, kv: KvShape, prompt_len: int, dtype_bytes: int, world: int = 1) -> GenerationMemory:
    """The engine's plan_slots arithmetic for sequences of prompt_len + rft.max_new_tokens positions (rl, rft: the
    config sections): at most the answers of a process's generation batch (harness.rl.rollout: one engine call)."""
    width, vocab = prompt_len + rft.max_new_tokens, kv.vocab
    slot = kv_slot_bytes(kv.layers, kv.kv_heads, kv.head_dim, width, dtype_bytes)
    per_slot = slot + logit_bytes(dtype_bytes) * vocab
    answers = rl.questions_per_step // max(1, world) * rl.num_generations
    slots = min(rft.micro_batch_sequences, answers)
    if rft.kv_cache_gb is not None:
        slots = min(slots, int(rft.kv_cache_gb * GIB // per_slot))
    rollout = min(answers, rft.micro_batch_sequences) * per_slot
    return GenerationMemory(slots, width, slot, slots * slot, slots * logit_bytes(dtype_bytes) * vocab,
                            math.ceil(100 * rollout / GIB) / 100)


def micro_batch_rows(rl, train, world: int) -> int:
    """Rows of a training micro-batch: rl.questions_per_step / (processes x grad_accum) questions x their answers."""
    return max(1, rl.questions_per_step // max(1, world * train.grad_accum)) * rl.num_generations


def training_view(cfg, world: int, width: int):
    """The recipe as the activation arithmetic (harness.tools.sizing.activation_terms) reads a generative pass: a
    micro-batch of micro_batch_rows rows of `width` positions, the output head always in chunks."""
    return dataclasses.replace(
        cfg, loss=dataclasses.replace(cfg.loss, mode="generative", chunked_ce=True),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro_batch_rows(cfg.rl, cfg.train, world)),
        data=dataclasses.replace(cfg.data, max_len=width))


class GenerationPlan:
    """zero-plan's loss.mode=rl part: the lines that explain the generation's memory, and the bytes it adds to each
    stage's row (`apply`)."""

    def __init__(self, rl, rft, train, shape, prompts: dict, world: int, lora: bool = False) -> None:
        """lora: model.lora.enabled (with rl.beta > 0 the reference is the model with its adapters disabled: no copy)."""
        self.rl, self.rft, self.train, self.shape, self.world = rl, rft, train, shape, world
        self.copy = bool(rl.beta) and not lora  # a frozen reference copy of the weights
        self.prompt, self.prompts = max(prompts.values()), prompts
        self.head_dim = shape.head_dim or shape.hidden // shape.heads

    def memory(self, dtype_bytes: int) -> GenerationMemory:
        s = self.shape
        kv = KvShape(s.layers, s.kv_heads, self.head_dim, s.vocab)
        return generation_memory(self.rl, self.rft, kv, self.prompt, dtype_bytes, self.world)

    def apply(self, row, w: int) -> None:
        """Adds to a zero_plan Row (weights of w bytes): the cache (kept through the training pass), the reference
        copy (rl.beta > 0), and what a generation holds instead of the activations (logits; ZeRO-3 the gathered
        weights beyond the partition)."""
        m, full, zero3 = self.memory(w), self.shape.params * w, row.option.startswith("3")
        reference = row.weights if zero3 else full  # ZeRO-3: the copy partitioned as the weights
        row.generation = m.kv + (reference if self.copy else 0)
        row.gen_peak = m.logits + (full - row.weights if zero3 else 0)

    def lines(self, w: int) -> list[str]:
        m, s, rl, rft = self.memory(w), self.shape, self.rl, self.rft
        out = [f"generation (loss.mode=rl, the continuous engine): slots of W = longest prompt {self.prompt} (train "
               f"{self.prompts['train']}, test {self.prompts['test']}) + rft.max_new_tokens {rft.max_new_tokens} = "
               f"{m.width} positions; per slot 2 x {s.layers} layers x {s.kv_heads} kv heads x {self.head_dim} x "
               f"{m.width} x {w} B = {m.slot_bytes / 2**20:.2f} MiB (+ {logit_bytes(w)} x {s.vocab} B of logits in a "
               f"decode step)"]
        budget = (f"rft.kv_cache_gb {rft.kv_cache_gb:g} holds {m.slots}" if rft.kv_cache_gb is not None else
                  f"rft.kv_cache_gb null: up to 90% of the free memory, counted here at all {m.slots}")
        out.append(f"  KV cache: {m.slots} slots (rft.micro_batch_sequences {rft.micro_batch_sequences}; {budget}) x "
                   f"{m.slot_bytes / 2**20:.2f} MiB = {m.kv / GIB:.2f} GiB (freed for the training pass when the "
                   f"decode step is eager, kept when compiled); decode logits {m.logits / GIB:.2f} GiB; a rollout "
                   f"call answers the process's generation batch: {rl.questions_per_step // max(1, self.world)} "
                   f"questions x {rl.num_generations} sequences need rft.kv_cache_gb={m.rollout_gb:g}")
        if rl.beta and not self.copy:
            out.append(f"  rl.beta {rl.beta:g}: the reference is the model with its LoRA adapters disabled (no copy)")
        elif rl.beta:
            out.append(f"  rl.beta {rl.beta:g}: a frozen reference copy of the model, {s.params:,} x {w} B = "
                       f"{s.params * w / GIB:.2f} GiB (ZeRO 0-2; under ZeRO-3 partitioned as the weights are)")
        out.append(f"  under ZeRO-3 the generation gathers all {s.params:,} weights ({s.params * w / GIB:.2f} GiB) in "
                   f"place of the training working set; column gen = KV cache"
                   + (" + reference" if self.copy else "") + "; total = states + gen + overhead + the larger of "
                   "(extra + activations) and (decode logits + gathered weights)")
        out.append(f"training pass: {rl.questions_per_step} questions / ({self.world} processes x grad_accum "
                   f"{self.train.grad_accum}) x {rl.num_generations} answers = "
                   f"{micro_batch_rows(rl, self.train, self.world)} rows of {m.width} positions per micro-batch")
        return out


def rl_rates(records: list[dict], settle: int, iterations: int) -> tuple[float, float, int]:
    """(seconds per generation batch, seconds of training passes per step, generation batches) over the steps after
    `settle` of a loss.mode=rl run's metrics records. A record logs the mean gen_s_per_step and train_s_per_step of
    the steps since the record before (settle: a logged step); a generation batch starts at every step s with
    (s - 1) % rl.iterations == 0."""
    timed = sorted((r["step"], r) for r in records if "gen_s_per_step" in r and "loss" in r)
    gen = train = 0.0
    prev, last = 0, settle
    for step, r in timed:
        if prev >= settle:
            gen += r["gen_s_per_step"] * (step - prev)
            train += r["train_s_per_step"] * (step - prev)
            last = step
        prev = step
    if last <= settle:
        raise HarnessError(f"calibration logged steps {[s for s, _ in timed]}: need a logged step {settle} and a "
                           f"later one with gen_s_per_step")
    batches = sum(1 for s in range(settle + 1, last + 1) if (s - 1) % iterations == 0)
    return (gen / batches if batches else 0.0), train / (last - settle), batches

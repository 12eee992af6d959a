"""Evaluation during training: the held-out generative loss (data.eval_files) and retrieval recall@1 / MRR
(data.emb_eval_files), before the first step of a fresh run, every `train.eval_every` steps and at the end; with
train.eval_prompts, the model's greedy answers to a few prompts at each of them (`PromptAnswers`).

Every process takes part in every evaluation (under ZeRO-3 each forward needs all of them); the results are reduced
over processes, so every process returns the same numbers.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from harness.data import samples as data_lib
from harness.distributed.zero import gathered_for_generation
from harness.observe import metrics
from harness.objective import evaluate_generative  # noqa: F401 (here before: the tests' import)
from harness.rft.contract import GREEDY, encode, texts
from harness.rft.engine import ContinuousEngine, servable


@torch.no_grad()
def encode_items(accelerator, objective, items: list, batch_size: int, pad_id: int, widths=None) -> torch.Tensor:
    """Embeddings of tokenized items [(ids, instr_len)], each process encoding an equal shard (ZeRO-3 needs every
    process in every forward), gathered in order; padded to each batch's longest, or to its width bucket (`widths`:
    the training passes' data.embed_length_buckets, so that the evaluation compiles a few static shapes once)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    per = math.ceil(len(items) / world)
    shard = items[rank * per:(rank + 1) * per]
    shard += [items[0]] * (per - len(shard))
    parts = []
    for i in range(0, per, batch_size):
        padded = data_lib.pad_embed(shard[i:i + batch_size], pad_id, widths)
        batch = {k: v.to(accelerator.device) for k, v in padded.items()}
        parts.append(objective.embed(batch))
    return accelerator.gather(torch.cat(parts))[: len(items)]


def evaluate_retrieval(accelerator, model, objective, eval_set: dict, batch_size: int, pad_id: int) -> dict:
    """recall@1 and MRR of the held-out queries against the corpus of all their passages."""
    model.eval()
    wq, wp = objective.widths or (None, None)
    q = encode_items(accelerator, objective, eval_set["queries"], batch_size, pad_id, wq)
    c = encode_items(accelerator, objective, eval_set["corpus"], batch_size, pad_id, wp)
    model.train()
    return metrics.retrieval_metrics(q, c, eval_set["positives"])


# Retrieval evaluation encodes ENCODE_BATCH_FACTOR x train.emb_micro_batch_size queries or passages per forward:
# without gradients no activations are kept, so a larger batch fits.
ENCODE_BATCH_FACTOR = 4


class PromptAnswers:
    """train.eval_prompts: greedy answers of the model as it is now, through the continuous engine
    (harness/rft/engine.py; model.generate where it cannot serve the model), on the main process alone: under
    ZeRO-3 every process takes part in gathering the weights (distributed/zero.py's gathered_for_generation), then waits
    for the main process at a barrier. Returns [{"prompt", "answer"}] on the main process, [] on the others."""

    def __init__(self, accelerator, model, tokenizer, prompts: list, max_new_tokens: int, zero_stage: int, say):
        self.accelerator, self.model, self.tok, self.zero_stage, self.say = accelerator, model, tokenizer, zero_stage, say
        self.max_new_tokens = max_new_tokens
        self.shown = [p["text"] if isinstance(p, dict) else p for p in prompts]  # as the user wrote them
        self.ids = encode(tokenizer, [p["text"] if isinstance(p, dict) else tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in prompts])  # once
        self.engine = None  # built on first use, on the main process

    def answer(self) -> list[dict]:
        acc, answers = self.accelerator, []
        with gathered_for_generation(acc, self.model, self.zero_stage) as model:
            if acc.is_main_process:
                was = model.training
                model.eval()
                try:
                    answers = self._generate(model)
                finally:
                    model.train(was)
        acc.wait_for_everyone()
        return [{"prompt": p, "answer": a} for p, a in zip(self.shown, answers)]

    def _generate(self, model) -> list[str]:
        if self.engine is None:
            why = servable(model)
            if why is None:
                self.engine = ContinuousEngine(model, self.tok, self.max_new_tokens, len(self.ids), say=self.say)
            else:
                self.engine = "static"
                self.say(f"[harness] train.eval_prompts: the continuous engine cannot serve {why}: model.generate")
        if self.engine != "static":
            with self.engine.serving(model):
                got = self.engine.generate(self.ids, 1, GREEDY)
            return [group[0] for group in texts(self.tok, got, self.engine.eos)]
        return static_greedy(model, self.tok, self.ids, self.max_new_tokens)


@torch.no_grad()
def static_greedy(model, tok, ids: list[list[int]], max_new_tokens: int) -> list[str]:
    """Greedy answers through model.generate, the prompts left-padded in one batch (as rft's static engine)."""
    width, dev = max(map(len, ids)), next(model.parameters()).device
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids], device=dev)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=dev)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return [t.strip() for t in tok.batch_decode(out[:, width:], skip_special_tokens=True)]


class Evaluator:
    """The run's evaluations: `due(step)` says when (every train.eval_every steps), `run(step)` evaluates what the
    job has eval data for (`job.data.gen_eval`, `job.data.emb_eval`) and answers train.eval_prompts
    (`on_samples(step, rows)`); `on_done(seconds)` after each; `best` (stopping.BestMetric: train.early_stopping,
    keep_best) ranks each. `final(step)` is the run's last evaluation: the loop's own when it was of that step (an
    early stop), else a new one."""

    def __init__(self, job, on_done: Callable[[float], None], on_samples: Callable[[int, list], None], best=None):
        self.job, self.on_done, self.on_samples, self.best = job, on_done, on_samples, best
        t = job.cfg.train
        self.every, self.total_steps = t.eval_every, job.total_steps
        self.encode_batch = t.emb_micro_batch_size * ENCODE_BATCH_FACTOR
        self.prompts = PromptAnswers(job.accelerator, job.model, job.tokenizer, t.eval_prompts,
                                     t.eval_prompts_max_new_tokens, job.zero["zero_stage"], job.say) \
            if t.eval_prompts else None
        self.last: tuple = (None, {})  # (step, results) of the latest evaluation

    def due(self, step: int) -> bool:
        """Every `train.eval_every` steps; the last step's evaluation is the final one, after the loop, unless the
        evaluations are ranked (`best`): then it is the loop's, so that the checkpoint of the last step holds its
        ranking (a longer rerun continues from it) and keep_best checkpoints it like any other."""
        return bool(self.every) and (step % self.every == 0 and step != self.total_steps or
                                     step == self.total_steps and self.best is not None)

    def final(self, step: int) -> tuple[dict, bool]:
        """(the results of the evaluation of `step`, whether it is new: not the loop's, already logged)."""
        if self.last[0] == step:
            return self.last[1], False
        return self.run(step), True

    def run(self, step: int) -> dict:
        """{"eval_loss", "eval_recall_at_1", "eval_mrr"} for the eval data the run has ({} without any)."""
        t = time.perf_counter()
        results = self._metrics(step)
        if self.best is not None:
            self.best.observe(step, results)
        if self.prompts is not None:
            rows = self.prompts.answer()
            if rows:
                self.on_samples(step, rows)
        if results or self.prompts is not None:
            self.on_done(time.perf_counter() - t)
        self.last = (step, results)
        return results

    def _metrics(self, step: int) -> dict:
        job = self.job
        results = job.objective.evaluate(job.data)  # the mode's own (rl: `rft test` accuracy on the task's test split)
        if job.data.emb_eval is not None:
            r = evaluate_retrieval(job.accelerator, job.model, job.objective, job.data.emb_eval, self.encode_batch,
                                   job.tokenizer.pad_token_id)
            results.update(eval_recall_at_1=r["recall_at_1"], eval_mrr=r["mrr"])
        if results:
            job.say(f"[harness] eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
        return results

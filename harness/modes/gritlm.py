"""GritLM's modes, loss.mode generative, embedding and unified: the generic objective (harness/objective.py) with the
output head's loss chunked where loss.chunked_ce decides, and the embedding passes at data.embed_length_buckets'
widths."""

from __future__ import annotations

from harness.chunked_loss import resolve_chunked_ce
from harness.config import Config
from harness.config.modes import facts
from harness.data.loaders import longest_micro_batch
from harness.objective import Objective, Parts


def build(cfg: Config, parts: Parts) -> Objective:
    chunk_size = resolve_chunked_ce(cfg.loss, cfg.train.compile, parts.model, longest_micro_batch(parts.data),
                                    parts.say)
    if chunk_size is not None:
        parts.say(f"[harness] generative loss: chunked through the output head, {chunk_size} positions per chunk "
                  f"(loss.chunked_ce={cfg.loss.chunked_ce})")
    return Objective(cfg.loss, cfg.model, cfg.train.grad_accum, parts, chunk_size=chunk_size,
                     widths=parts.data.emb_widths, combined=facts(cfg.loss.mode).combined)

"""`harness plan`'s look at the data: samples, full and truncated token lengths and the items an epoch of the run's
primary stream holds, by the loop's rules (its packing, max_len, pairs), read without a model.

    python -c "from harness.tools.plan_data import analyse_data; help(analyse_data)"
"""

from __future__ import annotations

from harness.config import Config
from harness.config.modes import facts
from harness.data import chat, pairs
from harness.data import samples as data_lib
from harness.data.loaders import training_rows
from harness.model import load_run_tokenizer
from harness.rft.tasks import build_task
from harness.rl.prompts import PromptTask


def analyse_data(cfg: Config) -> dict:
    """Samples, full and truncated token lengths, items per epoch of the primary stream (the loop's rules)."""
    d, mode, out = cfg.data, facts(cfg.loss.mode), {}
    if mode.gen_rows == "questions":  # the stream is the rft task's train questions, answered during the run
        n = len(build_task(cfg.rft).split("train"))
        return {"primary": "rl", "rl": {"questions": n, "items": n}}
    if "distill" in mode.sections and cfg.distill.prompts:  # distill.prompts in place of data.train_files
        n = len(PromptTask(cfg.distill.prompts, d.cache_dir, key="distill.prompts").records)
        return {"primary": "distill", "distill": {"prompts": n, "items": n}}
    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    if mode.gen_rows == "pairs":  # a pair is two sequences (chosen, rejected) in one forward pass: both are counted
        rows, _ = training_rows(cfg.data, cfg.train.seed, "preference")
        max_len = d.max_len if d.max_len != "auto" else 1 << 20  # as the run's loader
        ds, st = pairs.tokenize_pair_dataset(rows, tok, max_len, chat.resolve_template(tok, d.chat_template))
        tokens = sum(len(c) + len(r) for c, r in zip(ds["chosen_ids"], ds["rejected_ids"]))
        out["preference"] = {"pairs": st["pairs"], "sequences": 2 * st["pairs"], "tokens": tokens,
                             "mean_pair_len": st["mean_len"], "longest": st["max_len"],
                             "truncated_pairs": st["truncated"], "items": st["pairs"]}
        out["primary"] = "preference"
        return out
    if mode.gen_rows == "sequences":
        rows, _ = training_rows(cfg.data, cfg.train.seed, "generative")
        full_ds, _ = data_lib.tokenize_dataset(rows, tok, 1 << 30)
        full = list(full_ds["length"])
        max_len = d.max_len if d.max_len != "auto" else data_lib.auto_max_len(full, d.max_len_percentile)
        ds, st = data_lib.tokenize_dataset(rows, tok, max_len)
        lengths = list(ds["length"])
        items = len(data_lib.pack_rows(lengths, max_len)) if d.packing else len(lengths)
        out["generative"] = {"samples": st["samples"], "tokens": st["tokens"], "max_len": max_len,
                             "p50_len": st["p50_len"], "p95_len": st["p95_len"], "longest": max(full),
                             "truncated_samples": st["truncated"], "truncated_tokens": sum(full) - st["tokens"],
                             "items": items, "packing": d.packing, "full_lengths": full}
    if mode.embeds:
        rows, _ = training_rows(cfg.data, cfg.train.seed, "embedding")
        out["embedding"] = {"samples": len(rows), "items": len(rows)}
    out["primary"] = "embedding" if "embedding" in out else "generative"
    return out

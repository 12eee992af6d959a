"""An untied output head (model.config.tie_word_embeddings=false, as in Mistral-7B or Llama-3-8B) in the embedding
and unified modes: 2 processes x b give the same losses and the same update as 1 process x 2b, under DDP and ZeRO-3,
with and without GradCache (issue 16). An embedding pass computes logits that no loss uses; unless they are tied into
the graph, lm_head takes no part in the micro-step's last backward pass, the one that reduces across processes.
Before the fix: DDP failed at step 2 with "Expected to have finished reduction in the prior iteration" (lm_head's
gradient was never averaged), ZeRO-1 stepped each rank with its own unreduced lm_head gradient in the unified mode,
and in the embedding mode lm_head got no gradient at all on one process (AdamW skipped it) but a zero one under
ZeRO (weight decay applied), so the updates differed."""

from __future__ import annotations

import pytest
import torch

from harness_launch import (FAST, ROOT, final_weights, initial_weights, max_abs_diff, metrics, rel_close, report,
                            run_train, update_rel_diff)

UNTIED = ["model.config.tie_word_embeddings=false"]
EMB = [f"data.emb_train_files=[{ROOT / 'data/sample/emb.jsonl'}]", "data.emb_eval_files=[]",
       "train.eval_at_start=false"]
STEPS = 2  # the DDP failure shows at the second step's forward
EMB_BATCH, GEN_BATCH = 4, 8  # global micro-batches: queries, generative rows


# ----------------------------------------------------------------------------------------------- embed, in-process


def _tiny(tie: bool, lora: bool = False):
    from harness.config import load_config
    from harness.model import build_model, load_tokenizer

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, tie_word_embeddings=str(tie).lower())
    over = [f"model.config.{k}={v}" for k, v in small.items()] + (["model.lora.enabled=true"] if lora else [])
    cfg = load_config(ROOT / "configs" / "default.yaml", over)
    torch.manual_seed(0)
    return build_model(cfg.model, load_tokenizer(cfg.model))


def _grads(model, through_embed: bool) -> dict:
    """Gradients of a fixed function of the embeddings of a padded batch: through harness.model.embed, or through
    the same forward pooled directly (no zero-gradient tie)."""
    from harness.losses import pool
    from harness.model import bidirectional_mask, embed

    torch.manual_seed(1)
    ids = torch.randint(5, 200, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "pool_mask": mask}
    model.zero_grad(set_to_none=True)
    if through_embed:
        e = embed(model, batch, "mean", bidirectional=True)
    else:
        out = model(input_ids=ids, attention_mask=bidirectional_mask(mask, "sdpa"), output_hidden_states=True,
                    logits_to_keep=1, use_cache=False)
        e = pool(out.hidden_states[-1], mask, "mean")
    (e * torch.linspace(-1, 1, e.numel()).view_as(e)).sum().backward()
    return {"emb": e.detach(), **{n: p.grad for n, p in model.named_parameters() if p.requires_grad}}


def test_embed_gives_an_untied_head_an_exact_zero_gradient():
    """The untied head takes part in the embedding backward with a gradient of zeros (not None); the embeddings and
    every other gradient are bit-identical to the same pass without the tie."""
    from harness.model import embed, has_untied_trainable_head

    model = _tiny(tie=False)
    assert has_untied_trainable_head(model)
    tied, plain = _grads(model, True), _grads(model, False)
    assert plain["lm_head.weight"] is None
    assert tied.pop("lm_head.weight").count_nonzero() == 0
    plain.pop("lm_head.weight")
    assert all(torch.equal(tied[k], plain[k]) for k in plain), [k for k in plain if not torch.equal(tied[k], plain[k])]
    one = {k: torch.ones(1, 3, dtype=torch.long) for k in ("input_ids", "attention_mask", "pool_mask")}
    with torch.no_grad():  # evaluation, harness.encode, GradCache's first pass: nothing to tie
        assert not embed(model, one, "mean", bidirectional=True).requires_grad


@pytest.mark.parametrize("tie, lora", [(True, False), (False, True)])
def test_embed_leaves_tied_and_frozen_heads_alone(tie, lora):
    """Tied head (the input embedding matrix, trained by every pass) or a frozen one (LoRA): no tie, the pass is
    exactly what it was before the fix."""
    from harness.model import has_untied_trainable_head

    model = _tiny(tie=tie, lora=lora)
    assert not has_untied_trainable_head(model)
    a, b = _grads(model, True), _grads(model, False)
    assert a.keys() == b.keys()
    assert all((a[k] is None and b[k] is None) or torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------- end to end


def run(out, mode: str, nproc: int, accel: str | None = None, chunks: int = 1):
    run_train([f"train.output_dir={out}", *UNTIED, f"loss.mode={mode}", *EMB, f"train.max_steps={STEPS}", *FAST,
               f"train.emb_micro_batch_size={EMB_BATCH // nproc}", f"train.micro_batch_size={GEN_BATCH // nproc}",
               f"loss.grad_cache_chunks={chunks}"], nproc=nproc, accel=accel)
    return metrics(out), final_weights(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One 1-process run with the whole batch per mode, shared by the cases below."""
    cache: dict = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = run(tmp_path_factory.mktemp(f"one-{mode}"), mode, 1)
        return cache[mode]

    return get


@pytest.fixture(scope="module")
def start():
    return initial_weights(overrides=UNTIED)


# Each mode under DDP and ZeRO-3, GradCache in each mode and under each, and ZeRO-1 (the stage that reduces only on
# the accumulation boundary, like DDP): five 2-process runs against one 1-process run per mode.
@pytest.mark.parametrize("mode, accel, chunks", [("embedding", "ddp", 1), ("unified", "ddp", 2),
                                                 ("embedding", "zero3", 2), ("unified", "zero3", 1),
                                                 ("unified", "zero1", 1)])
@pytest.mark.slow
def test_untied_head_two_processes_equal_one_process(mode, accel, chunks, reference, start, tmp_path):
    m2, w2 = run(tmp_path / "two", mode, 2, accel=accel, chunks=chunks)
    m1, w1 = reference(mode)
    if accel.startswith("zero"):
        assert report(tmp_path / "two")["zero_stage"] == int(accel[-1])
    assert "lm_head.weight" in w1 and "lm_head.weight" in start  # the head really is untied
    assert len(m2) == len(m1) == STEPS
    keys = ["loss", "grad_norm"] + (["loss_emb", "loss_gen"] if mode == "unified" else [])
    for a, b in zip(m2, m1):
        for k in keys:
            assert rel_close(a[k], b[k], 1e-4), (a["step"], k, a[k], b[k])
    assert update_rel_diff(w2, w1, start) < 1e-4
    # the head itself: the same weights on both paths (under the bug, each rank stepped with its own gradient)
    head = "lm_head.weight"
    assert max_abs_diff({head: w2[head]}, {head: w1[head]}) < 1e-6, max_abs_diff({head: w2[head]}, {head: w1[head]})

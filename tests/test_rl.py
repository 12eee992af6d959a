"""Online RL (loss.mode=rl, rl.algorithm=grpo; harness/rl/, docs/rl.md).

- equal to TRL: on one tiny model and one fixed batch (prompts, completions, rewards -> advantages, old and reference
  log-probs, masks), the loss and every parameter's gradient of each rl.loss_type, with beta 0 and beta > 0, equal
  TRL 1.16's GRPOTrainer._compute_loss (a real trainer, its fused LM head) within 1e-5 relative;
- advantages as TRL's (group, batch, none) on hand-made rewards;
- bad settings stop with one `harness: error:` line before any step.

    python -m pytest tests/test_rl.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness.rl import loss as rl_loss
from harness.rl.batch import completion_logps, completion_mask, rows

trl = pytest.importorskip("trl")

PROMPT, COMPLETION, N, GROUP = 5, 7, 6, 3  # prompt tokens (all prompts alike long: no left padding), completion width


def _close(a, b, rel=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    # relative to the tensor's scale: fp32 sums over ~40 positions differ in the last bits between two orders
    assert torch.allclose(a, b, rtol=rel, atol=rel * float(b.abs().max()) + 1e-12), (a, b)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """A tiny Llama saved to disk (TRL builds its trainer from the path), and one fixed batch."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained("harness/assets/tokenizer")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64))
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, len(tok), (N // GROUP, PROMPT), generator=g).repeat_interleave(GROUP, 0)
    lengths = [7, 3, 5, 1, 6, 4]  # completions of every length, right-padded to COMPLETION
    completions = torch.randint(10, len(tok), (N, COMPLETION), generator=g)
    cmask = (torch.arange(COMPLETION)[None] < torch.tensor(lengths)[:, None]).long()
    completions = torch.where(cmask.bool(), completions, tok.pad_token_id)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # old and reference log-probs: the model's own, moved by up to +-0.4 (ratios 0.67..1.5: some clipped)
    batch = rows([p.tolist() for p in prompts], [c[:m.sum()].tolist() for c, m in zip(completions, cmask)],
                 tok.pad_token_id)
    with torch.no_grad():
        own = completion_logps(model, batch, chunk_size=64, temperature=0.7)[:, PROMPT - 1:PROMPT - 1 + COMPLETION]
    old = own + (torch.rand(N, COMPLETION, generator=g) - 0.5) * 0.8
    ref = own + (torch.rand(N, COMPLETION, generator=g) - 0.5) * 0.8
    return tok, model, path, prompts, completions, cmask, rewards, old, ref


def trl_loss(path, tok, model, loss_type, beta, inputs, temperature):
    """TRL's GRPOTrainer (built on the saved model, its weights then set to `model`'s) -> _compute_loss and grads."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(path / "trl"), per_device_train_batch_size=N, num_generations=GROUP,
                      loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=temperature,
                      max_completion_length=COMPLETION, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=str(path), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tok)
    trainer.model.load_state_dict(model.state_dict())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # one micro-batch: the whole batch
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), _grads(trainer.model)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", rl_loss.LOSS_TYPES)
def test_loss_and_gradients_equal_trl(fixed, loss_type, beta):
    tok, model, path, prompts, completions, cmask, rewards, old, ref = fixed
    temperature = 0.7
    adv, _ = rl_loss.advantages(rewards, GROUP, "group")
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": cmask, "advantages": adv, "old_per_token_logps": old,
              "num_items_in_batch": cmask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    ref_loss, ref_grads = trl_loss(path, tok, model, loss_type, beta, inputs, temperature)

    # ours: prompt + completion rows, per-token tensors [rows, width - 1]; TRL's completion columns sit at
    # positions PROMPT - 1 .. PROMPT + COMPLETION - 2
    ours = copy.deepcopy(model).train()
    batch = rows([p.tolist() for p in prompts], [c[:m.sum()].tolist() for c, m in zip(completions, cmask)],
                 tok.pad_token_id)

    def place(t):
        out = torch.zeros(N, batch["input_ids"].shape[1] - 1)
        out[:, PROMPT - 1:PROMPT - 1 + COMPLETION] = t
        return out

    mask = completion_mask(batch)
    assert torch.equal(place(cmask.float()), mask.float())
    logps = completion_logps(ours, batch, chunk_size=5, temperature=temperature)
    loss = rl_loss.grpo_loss(loss_type, logps, place(old), adv, mask, 0.2, 0.28, beta,
                             place(ref) if beta else None, max_new_tokens=COMPLETION)
    loss.backward()
    _, clipped, _ = rl_loss.per_token_terms(logps.detach(), place(old), adv, 0.2, 0.28)
    assert 0 < int((clipped & mask.bool()).sum()) < int(mask.sum())  # the batch exercises the clipping
    _close(loss.detach(), ref_loss)
    grads = _grads(ours)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name])


def test_advantages_by_hand():
    """Two groups of three: [1, 0, 0] (mean 1/3, unbiased std 0.57735) and [1, 1, 1] (all equal: advantage 0)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv, flat = rl_loss.advantages(r, 3, "group")
    s = 0.5773502691896258
    _close(adv, torch.tensor([(2 / 3) / (s + 1e-4), (-1 / 3) / (s + 1e-4), (-1 / 3) / (s + 1e-4), 0, 0, 0]))
    assert flat.tolist() == [False, True]
    batch_std = float(r.std())
    _close(rl_loss.advantages(r, 3, "batch")[0], (r - torch.tensor([1 / 3] * 3 + [1.0] * 3)) / (batch_std + 1e-4))
    _close(rl_loss.advantages(r, 3, "none")[0], r - torch.tensor([1 / 3] * 3 + [1.0] * 3))

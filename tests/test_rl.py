"""Online RL (loss.mode=rl, rl.algorithm=grpo; harness/rl/, docs/rl.md).

- equal to TRL: on one tiny model and one fixed batch (prompts, completions, rewards -> advantages, old and reference
  log-probs, masks), the loss and every parameter's gradient of each rl.loss_type, with beta 0 and beta > 0, equal
  TRL 1.16's GRPOTrainer._compute_loss (a real trainer, its fused LM head) within 1e-5 relative;
- advantages as TRL's (group, batch, none) on hand-made rewards;
- bad settings stop with one `harness: error:` line before any step (num_generations 1, a reward function that raises,
  a task file without numeric answers);
- one shared 1-process run (4 steps, 2 on each generation batch) logs the rl figures and the rft-test evaluation;
  2 processes under ZeRO-2 (extended tier) and ZeRO-3 equal it; kill -9 in the middle of a generation batch and the
  same command again equal it.

    python -m pytest tests/test_rl.py
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from harness.rl import loss as rl_loss
from harness.preference import scored_positions
from harness.rl.batch import completion_logps, completion_mask, padding_free, rows, shared_prompts

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


def trl_trainer(path, tok, loss_type="dapo", beta=0.0, temperature=1.0, level="token", scale="group",
                accum=1, rewards=None, batch=N):
    """TRL's GRPOTrainer built on the saved model (its real code: _compute_loss, _generate_and_score_completions)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(path / "trl"), per_device_train_batch_size=batch, num_generations=GROUP,
                      loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=temperature,
                      max_completion_length=COMPLETION, report_to=[], use_cpu=True, bf16=False,
                      importance_sampling_level=level, scale_rewards=scale, gradient_accumulation_steps=accum)
    fn = rewards or (lambda completions, **_: [0.0] * len(completions))
    trainer = GRPOTrainer(model=str(path), reward_funcs=fn, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tok)
    assert trainer.loss_type == loss_type and trainer.beta == beta
    return trainer


def trl_loss(path, tok, model, loss_type, beta, inputs, temperature, level="token", parts=1):
    """TRL's _compute_loss (its weights set to `model`'s) on `inputs` split into `parts` micro-batches of one
    generation batch (gradient_accumulation_steps = steps_per_generation = parts): the summed loss and grads."""
    trainer = trl_trainer(path, tok, loss_type, beta, temperature, level, accum=parts)
    trainer.model.load_state_dict(model.state_dict())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = parts
    trainer.model.zero_grad()
    rows_ = inputs["prompt_ids"].shape[0]
    total = 0.0
    for k in range(parts):
        part = {k2: (v[k * rows_ // parts:(k + 1) * rows_ // parts] if k2 != "num_items_in_batch" else v)
                for k2, v in inputs.items()}
        loss = trainer._compute_loss(trainer.model, part)
        loss.backward()
        total = total + loss.detach()
    return total, _grads(trainer.model)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", rl_loss.LOSS_TYPES)
def test_loss_and_gradients_equal_trl(fixed, loss_type, beta, level):
    """Each rl.loss_type x beta x rl.importance_sampling (token; sequence: GSPO) = TRL's within 1e-5."""
    tok, model, path, prompts, completions, cmask, rewards, old, ref = fixed
    temperature = 0.7
    adv, _ = rl_loss.advantages(rewards, GROUP, "group")
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": cmask, "advantages": adv, "old_per_token_logps": old,
              "num_items_in_batch": cmask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    ref_loss, ref_grads = trl_loss(path, tok, model, loss_type, beta, inputs, temperature, level)

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
    grpo = rl_loss.Grpo(loss_type, 0.2, 0.28, beta, level, max_new_tokens=COMPLETION)
    loss = rl_loss.grpo_loss(logps, place(old), adv, mask, grpo, place(ref) if beta else None)
    loss.backward()
    clip = rl_loss.Grpo(epsilon=0.2, epsilon_high=0.28, level=level)
    _, clipped, _ = rl_loss.per_token_terms(logps.detach(), place(old), adv, clip, mask=mask)
    if level == "token":  # (one ratio an answer, from the mean of +-0.4 moves: rarely clipped)
        assert 0 < int((clipped & mask.bool()).sum()) < int(mask.sum())  # the batch exercises the clipping
    _close(loss.detach(), ref_loss)
    grads = _grads(ours)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name])


@pytest.mark.parametrize("loss_type", rl_loss.LOSS_TYPES)
def test_left_padded_prompts_and_two_micro_batches_equal_trl(fixed, loss_type):
    """Prompts of unequal lengths (TRL left-pads them, here each row is prompt + completion, right-padded) and the
    generation batch in two micro-batches of one question each, beta 0.1: the summed loss and every gradient equal
    TRL's two micro-batches for grpo, dapo and dr_grpo (their normalisation does not depend on the split: equal
    micro-batches) within 1e-5; bnpo (TRL: / each micro-batch's tokens) equals TRL's one micro-batch of the whole
    batch, and TRL's own two micro-batches differ from it (the dependence docs/rl.md names)."""
    tok, model, path, _, completions, cmask, rewards, old, ref = fixed
    g = torch.Generator().manual_seed(7)
    short, long_ = 3, PROMPT  # the first question's prompt 3 tokens, the second's 5
    plist = [torch.randint(10, len(tok), (short,), generator=g).tolist()] * GROUP + \
            [torch.randint(10, len(tok), (long_,), generator=g).tolist()] * GROUP
    prompt_ids = torch.tensor([[tok.pad_token_id] * (long_ - len(p)) + p for p in plist])  # TRL's left padding
    prompt_mask = (torch.arange(long_)[None] >= torch.tensor([long_ - len(p) for p in plist])[:, None]).long()
    adv, _ = rl_loss.advantages(rewards, GROUP, "group")
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completions,
              "completion_mask": cmask, "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": cmask.sum()}
    temperature = 0.7
    ref_loss, ref_grads = trl_loss(path, tok, model, loss_type, 0.1, inputs, temperature,
                                   parts=1 if loss_type == "bnpo" else 2)

    ours = copy.deepcopy(model).train()
    comps = [c[:m.sum()].tolist() for c, m in zip(completions, cmask)]
    total_counts = [N, int(cmask.sum())]
    denom = rl_loss.denominator(loss_type, *total_counts, COMPLETION)
    factor = rl_loss.step_factor(1, 2, denom)
    summed = 0.0
    for k in range(2):  # one question (3 answers) a micro-batch
        idx = range(k * GROUP, (k + 1) * GROUP)
        batch = rows([plist[i] for i in idx], [comps[i] for i in idx], tok.pad_token_id)
        batch["scored"] = scored_positions(batch["labels"])
        # the forward pass as a run's (rl.rows: shared_prompts): the question's prompt once, its 3 answers after it
        batch.update(shared_prompts(batch, [len(plist[idx[0]])], [GROUP], tok.pad_token_id))
        assert batch["packed_input_ids"].shape[0] == 2  # one row, and a row of padding (`two_rows`)
        assert (batch["packed_input_ids"][1] == tok.pad_token_id).all()
        mask = completion_mask(batch)
        start = len(plist[idx[0]]) - 1

        def place(t):
            out = torch.zeros(GROUP, batch["input_ids"].shape[1] - 1)
            out[:, start:start + COMPLETION] = t[list(idx)][:, :out.shape[1] - start]
            return out

        logps = completion_logps(ours, batch, chunk_size=5, temperature=temperature)
        per_token, _, _ = rl_loss.per_token_terms(logps, place(old), adv[list(idx)],
                                                  rl_loss.Grpo(epsilon=0.2, epsilon_high=0.28, beta=0.1), place(ref),
                                                  mask)
        # as step.micro_step: the sum times W x A / the step's denominator (W = 1, A = 2), back-propagated / A (as
        # the objective's accumulation does)
        part = rl_loss.loss_sum(loss_type, per_token, mask) * factor / 2
        part.backward()
        summed = summed + part.detach()
    _close(summed, ref_loss)
    grads = _grads(ours)
    for name in grads:
        _close(grads[name], ref_grads[name])
    if loss_type == "bnpo":  # TRL's two micro-batches: each normalised by its own tokens, another update
        split_loss, _ = trl_loss(path, tok, model, loss_type, 0.1, inputs, temperature, parts=2)
        assert abs(float(split_loss) - float(ref_loss)) > 1e-3 * abs(float(ref_loss))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["packed", "shared_prompts"])
def test_rows_without_padding_give_the_padded_rows_log_probs_and_gradients(fixed, family, mode):
    """rl.rows: packed (the answers packed whole into rows no wider than the padded batch's, each with position ids
    from 0: transformers' block-diagonal mask, no answer attends to another) and shared_prompts (each prompt once,
    its answers after it, each attending to the prompt and itself through a custom 4D mask, with its own row's
    position ids; the prompt's last position predicts every answer's first token) give every completion token the
    log-prob and every parameter the gradient the right-padded rows give, within 1e-5 (fp32 attention over the same
    real positions, another blocking of the kernel's sums; the shared positions' gradients summed in another order),
    in fewer positions. Two families' masking paths."""
    tok = fixed[0]
    if family == "llama":
        model = copy.deepcopy(fixed[1])
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, len(tok), (n,), generator=g).tolist() for n in (4, 9, 6)]
    lengths = [[1, 12, 3, 7], [2, 5, 16, 4], [9, 1, 6, 3]]
    plist = [p for p in prompts for _ in range(4)]
    comps = [torch.randint(10, len(tok), (n,), generator=g).tolist() for ls in lengths for n in ls]
    padded = rows(plist, comps, tok.pad_token_id)
    padded["scored"] = scored_positions(padded["labels"])
    width, real = padded["input_ids"].shape[1], int(padded["attention_mask"].sum())
    if mode == "packed":
        packed = {**padded, **padding_free(padded, tok.pad_token_id)}
        assert packed["packed_input_ids"].shape[1] <= width
        assert packed["packed_input_ids"].numel() < real * 1.3 < padded["input_ids"].numel()
    else:
        packed = {**padded, **shared_prompts(padded, [len(p) for p in prompts], [4] * len(prompts), tok.pad_token_id)}
        assert packed["packed_input_ids"].shape[1] <= 2 * width
        held = int((packed["packed_input_ids"] != tok.pad_token_id).sum())  # (the random tokens are >= 10)
        assert held == real - 3 * sum(len(p) for p in prompts)  # each prompt once for its 4 answers, not 4 times
    got = []
    for batch in (padded, packed):
        model.zero_grad()
        logps = completion_logps(model, batch, chunk_size=16, temperature=0.7)
        (logps * torch.linspace(0.5, 1.5, logps.numel()).view(logps.shape)).sum().backward()
        got.append((logps.detach(), _grads(model)))
    on = completion_mask(padded).bool()
    assert (got[0][0][~on] == 0).all() and (got[1][0][~on] == 0).all()
    _close(got[1][0], got[0][0])
    for name, grad in got[0][1].items():
        _close(got[1][1][name], grad)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_own(fixed, scale):
    """TRL's own advantages (GRPOTrainer._generate_and_score_completions: it samples 3 answers to each of 2 prompts
    with the tiny model, a reward function returns fixed rewards, one None: no function scored that answer) equal
    rl_loss.advantages of the same rewards (NaN for the unscored one) for each rl.scale_rewards."""
    tok, model, path, *_ = fixed
    given = [1.0, 0.0, None, 0.5, 0.5, 2.0]
    trainer = trl_trainer(path, tok, scale=scale, rewards=lambda completions, **_: list(given))
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([{"prompt": "a"}] * GROUP + [{"prompt": "b"}] * GROUP)
    ours, _ = rl_loss.advantages(torch.tensor([float("nan") if r is None else r for r in given]), GROUP, scale)
    _close(ours, out["advantages"], rel=1e-6)
    assert ours[2] == 0  # the unscored answer: no advantage


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


# ----------------------------------------------------------------------------------------------- bad settings

TINY = ["model.name_or_path=null", "model.tokenizer=bundled",
        "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}"]


def test_num_generations_1_is_refused():
    from harness.config import load_config
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config key 'rl.num_generations': must be >= 2"):
        load_config("configs/grpo-tiny.yaml", ["rl.num_generations=1"])
    load_config("configs/grpo-tiny.yaml", ["rl.num_generations=1", "loss.mode=generative",
                                           "data.train_files=[x.jsonl]"])  # other modes do not read it


def test_reward_that_raises_is_one_line(monkeypatch):
    from harness.config import load_config
    from harness.errors import HarnessError
    from harness.rft.tasks import build_task
    from harness.rl.rollout import load_reward

    monkeypatch.syspath_prepend("tests")
    cfg = load_config("configs/grpo-tiny.yaml", ["rl.reward=rl_rewards:raises"])
    with pytest.raises(HarnessError) as e:
        load_reward(cfg.rl.reward, build_task(cfg.rft))
    assert str(e.value) == ("config key 'rl.reward': rl_rewards:raises raised ValueError: no score for this answer "
                            "(question train-0)")
    cfg = load_config("configs/grpo-tiny.yaml", ["rl.reward=rl_rewards:nothing"])
    with pytest.raises(HarnessError, match=r"config key 'rl.reward': 'rl_rewards:nothing': .*rl_rewards.py has no 'nothing'"):
        load_reward(cfg.rl.reward, build_task(cfg.rft))
    assert load_reward(load_config("configs/grpo-tiny.yaml", []).rl.reward, build_task(cfg.rft)) is not None


def test_task_file_without_verifiable_answers(tmp_path):
    from harness.config import load_config
    from harness.errors import DataError
    from harness.rl.rollout import question_loader

    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "What is 2 + 2?", "answer": 4}\n{"question": "Who wrote Hamlet?", '
                   '"answer": "Shakespeare"}\n')
    cfg = load_config("configs/grpo-tiny.yaml", [f"rft.task={bad}"])
    with pytest.raises(DataError) as e:
        question_loader(cfg.rl, cfg.rft, cfg.train.grad_accum, cfg.data.shuffle, world=1)
    assert str(e.value) == f"{bad}:2: field 'answer' must be a number, got 'Shakespeare'"
    cfg = load_config("configs/grpo-tiny.yaml", ["rl.questions_per_step=6", "train.grad_accum=4"])
    with pytest.raises(Exception, match=r"'rl.questions_per_step': 6 questions do not divide into 1 process"):
        question_loader(cfg.rl, cfg.rft, cfg.train.grad_accum, cfg.data.shuffle, world=1)


def test_rollouts_train_on_the_tokens_sampled():
    """A generation batch's training rows hold the tokens the engine drew, not the answer text re-tokenized (which
    drops special tokens and the whitespace the text is stripped of, may merge tokens otherwise, and appended an EOS
    that was never sampled). Reference: transformers' greedy generate() on the same random model (a temperature of
    1e-6 makes the engine's draw the argmax: the other tokens' probabilities underflow to 0 in fp32)."""
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.num_generations=2", "rft.max_new_tokens=12",
                                                 "rft.temperature=1e-6"])
    torch.manual_seed(0)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    model = model_lib.build_model(cfg.model, tok).float().eval()
    task = build_task(cfg.rft)
    ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None), task, 64)
    ro.generate([torch.tensor([0, 1, 2])], step=1)
    differs = 0
    for item in ro.items:
        prompt = torch.tensor([item["prompt"]])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:].tolist()
        drawn = out[:out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out
        assert item["answers"] == [drawn, drawn]  # both samples are the argmax
        text = tok.decode([t for t in drawn if t != tok.eos_token_id], skip_special_tokens=True).strip()
        differs += tok(text, add_special_tokens=False)["input_ids"] != [t for t in drawn if t != tok.eos_token_id]
    assert differs  # (this model's answers are ones that re-tokenizing would have changed)
    # the output head runs on the completion positions only (not the prompts' or the padding's): rows counted as
    # they enter the head's chunks, against the batch's completion mask
    import harness.preference as preference

    seen, chunk = [], preference._chunk_logps
    preference._chunk_logps = lambda h, *a: seen.append(h.shape[0]) or chunk(h, *a)
    for item in ro.items:  # (both greedy answers score alike: advantage 0, left out of the pass but for one row)
        item["advantages"] = [1.0, -1.0]
    try:
        batch = ro.batch(ro.items)
        logps = completion_logps(model, batch, 64, 1.0)  # (at the sampling's 1e-6 the argmax's log-prob is 0)
    finally:
        preference._chunk_logps = chunk
    on = completion_mask(batch).bool()
    assert sum(seen) == int(on.sum()) < batch["input_ids"].numel() // 2 and (logps[on] < 0).all()


def test_a_seeded_steps_answers_are_the_same_generated_together_or_one_by_one():
    """All the questions of a generation batch go through one engine call, each answer seeded by (rft.seed, step,
    question, answer index): the answers equal those of the questions generated one by one (what each process
    does with its share, so also on any process count), and another step draws others."""
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.num_generations=3", "rft.max_new_tokens=10",
                                                 "rl.questions_per_step=4"])
    torch.manual_seed(0)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    model = model_lib.build_model(cfg.model, tok).float().eval()
    ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None), build_task(cfg.rft), 64)
    ro.generate([torch.tensor([5, 1, 7, 2])], step=3)
    together = [it["answers"] for it in ro.items]
    assert ro.gen_calls == 1 and ro.engine.cache is None  # one call; the cache freed for the training pass
    alone = []
    for q in (5, 1, 7, 2):
        ro.generate([torch.tensor([q])], step=3)
        alone.append(ro.items[0]["answers"])
    assert together == alone
    assert len({tuple(a) for group in together for a in group}) > 4  # sampled: the answers differ
    ro.generate([torch.tensor([5, 1, 7, 2])], step=4)
    assert [it["answers"] for it in ro.items] != together


def test_rollouts_generate_under_the_trainings_autocast():
    """train.precision bf16 (accelerate's autocast over fp32 weights): the rollouts' engine runs under the training's
    autocast, so its KV cache is planned and held in bf16 as the keys come (it was planned outside the prepared
    forward's autocast: an fp32 cache at twice the bytes, each step's keys cast up and back)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from harness import model as model_lib
    from harness.config import load_config
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.num_generations=2", "rft.max_new_tokens=4"])
    torch.manual_seed(0)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    AcceleratorState._reset_state(reset_partial_state=True)  # (this process's other tests made fp32 ones)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(model_lib.build_model(cfg.model, tok).float())
        ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(accelerator, model, tok, zero_stage=0, say=lambda m: None), build_task(cfg.rft), 64)
        held, generate = [], ro.engine.generate  # the cache the call decoded with, read before it is freed
        ro.engine.generate = lambda *a, **k: (generate(*a, **k), held.append(ro.engine.cache.kv.dtype))[0]
        ro.generate([torch.tensor([0, 1])], step=1)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert held == [torch.bfloat16] and next(model.parameters()).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # left as it was found


def test_mask_truncated_completions_leaves_cut_answers_out_of_the_loss():
    """rl.mask_truncated_completions: an answer that reached rft.max_new_tokens without EOS has no trained token (its
    labels ignored: out of the loss and of the step's token count, as TRL's completion_mask); the others keep all."""
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.data import IGNORE_INDEX
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    torch.manual_seed(0)
    got = {}
    for on in (False, True):
        cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.num_generations=4", "rft.max_new_tokens=4",
                                                     "rl.questions_per_step=4", f"rl.mask_truncated_completions={on}"])
        tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
        torch.manual_seed(0)
        model = model_lib.build_model(cfg.model, tok).float().eval()
        bias = torch.zeros(model.lm_head.out_features)  # EOS drawn ~18% of the time: ~half the answers cut at 4
        bias[tok.eos_token_id] = math.log(model.lm_head.out_features) - 1.5
        model.lm_head.bias = torch.nn.Parameter(bias)
        ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None), build_task(cfg.rft), 64)
        batches, _ = ro.generate([torch.tensor([0, 1, 2, 3])], step=1)
        answers = [a for it in ro.items for a in it["answers"]]
        for item in ro.items:  # (a random model's rewards are all 0: every answer in the pass with advantage 0 but one)
            item["advantages"] = [1.0] * len(item["answers"])
        trained = (ro.batch(ro.items)["labels"] != IGNORE_INDEX).sum(1).tolist()
        assert int(batches[0]["all_tokens"]) == sum(trained)  # the step's token count: the answers left out too
        got[on] = (answers, trained)
    answers, trained = got[True]
    assert answers == got[False][0]  # the same draws
    cut = [len(a) == 4 and a[-1] != tok.eos_token_id for a in answers]
    assert any(cut) and not all(cut)
    assert trained == [0 if c else len(a) for a, c in zip(answers, cut)]
    assert got[False][1] == [len(a) for a in answers]


def test_answers_of_advantage_0_are_left_out_of_the_pass_with_the_same_update():
    """With rl.beta 0 an answer of advantage exactly 0 (a question whose answers all scored alike) adds nothing to the
    loss or its gradient, so the training pass leaves it out (Rollouts.trained): the step's loss and every gradient
    equal those of the pass over every answer (within 1e-5 relative: the rows are packed otherwise, so fp32 sums run
    in another order), its token count (the dapo denominator, clip_fraction's) counts the answers left out, and a
    micro-batch of flat questions keeps two answers (every process runs its pass, of more than one row)."""
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "rl.num_generations=4", "rft.max_new_tokens=6",
                                                 "rl.questions_per_step=3"])
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    torch.manual_seed(0)
    model = model_lib.build_model(cfg.model, tok).float()
    ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None), build_task(cfg.rft), 64)
    ro.generate([torch.tensor([0, 1, 2])], step=1)
    flat_rewards = [[1.0] * 4, [0.0, 1.0, 1.0, 0.0], [0.0] * 4]  # questions 0 and 2 flat, question 1 not
    for item, r in zip(ro.items, flat_rewards):
        item["rewards"] = r
        item["advantages"] = rl_loss.advantages(torch.tensor(r), 4, "group")[0].tolist()
    assert ro.items[0]["advantages"] == [0.0] * 4 and 0.0 not in ro.items[1]["advantages"]

    def step(batch):
        model.zero_grad(set_to_none=True)
        logps = completion_logps(model, batch, 64)
        mask = completion_mask(batch)
        per_token, _, _ = rl_loss.per_token_terms(logps, None, batch["advantages"].to(logps.device),
                                                  rl_loss.Grpo(epsilon=0.2, epsilon_high=0.28), None, mask)
        loss = rl_loss.loss_sum("dapo", per_token, mask) / int(batch["all_tokens"])
        loss.backward()
        return loss.detach(), _grads(model), int(mask.sum())
    kept = ro.batch(ro.items)
    assert kept["input_ids"].shape[0] == 4 and int(kept["all_answers"]) == 12  # question 1's answers only
    every = Rollouts.trained
    Rollouts.trained = lambda self, items: [(j, g) for j, it in enumerate(items) for g in range(len(it["answers"]))]
    try:
        full = ro.batch(ro.items)
    finally:
        Rollouts.trained = every
    assert full["input_ids"].shape[0] == 12
    (loss_a, grads_a, tokens_a), (loss_b, grads_b, tokens_b) = step(kept), step(full)
    assert abs(float(loss_a) - float(loss_b)) < 1e-6  # terms of ~1 (the ratio 1 x advantages of ~1) that cancel: ~0
    assert tokens_a < tokens_b == int(full["all_tokens"]) == int(kept["all_tokens"])  # the step's count: every answer
    assert set(grads_a) == set(grads_b)
    for name in grads_b:
        _close(grads_a[name], grads_b[name])
    for item in ro.items:  # every question flat: two answers kept, in two packed rows (one of padding)
        item["advantages"] = [0.0] * 4
    lone = ro.batch(ro.items)
    assert lone["input_ids"].shape[0] == 2 and lone["packed_input_ids"].shape[0] == 2


@pytest.mark.parametrize("mode", ["packed", "shared_prompts"])
def test_a_lone_packed_row_gets_a_row_of_padding_and_the_same_log_probs(mode):
    """A training pass of one packed row (one question's short answers; the answers Rollouts.trained keeps from
    flat questions) had a batch dimension of 1, for which torch.compile specializes: the blocks were compiled
    again (1 recompile after step 1 in 45 steps of the RL benchmark under train.compile=regional). The packed forms
    add a row of padding to a lone row (`two_rows`), its own document: the log-probs and gradients are the padded
    rows' (within 1e-5: other shapes, other fp32 sums)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 64, (5,), generator=g).tolist()
    comps = [torch.randint(3, 64, (n,), generator=g).tolist() for n in ((3,) if mode == "packed" else (3, 2))]
    padded = rows([prompt] * len(comps), comps, 0)  # packed: prompt + answer whole a row; shared: one unit
    padded["scored"] = scored_positions(padded["labels"])
    extra = padding_free(padded, 0) if mode == "packed" else shared_prompts(padded, [5], [2], 0)
    packed = {**padded, **extra}
    assert packed["packed_input_ids"].shape[0] == 2 and (packed["packed_input_ids"][1] == 0).all()
    got = []
    for batch in (padded, packed):
        model.zero_grad()
        logps = completion_logps(model, batch, chunk_size=16)
        logps.sum().backward()
        got.append((logps.detach(), _grads(model)))
    _close(got[1][0], got[0][0])
    for name, grad in got[0][1].items():
        _close(got[1][1][name], grad)


def test_lora_rollouts_sample_the_adapted_model_and_score_the_reference_with_adapters_off():
    """model.lora with rl.beta > 0: the engine runs the peft model's base module with its LoRA layers in place (greedy
    answers = transformers' generate of the adapted model, not of the base), and the reference log-probs are the
    same model's with its adapters disabled (no copy of the base weights kept)."""
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.rft.tasks import build_task
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.rollout import Rollouts

    cfg = load_config("configs/grpo-tiny.yaml", [*TINY, "model.lora.enabled=true", "rl.beta=0.1",
                                                 "rl.num_generations=2", "rft.max_new_tokens=8",
                                                 "rft.temperature=1e-6", "rl.questions_per_step=2"])
    torch.manual_seed(0)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    model = model_lib.build_model(cfg.model, tok).float()
    with torch.no_grad():  # adapters that move the answers (peft starts lora_B at 0: the base model)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model.eval()
    # counted by storage: no tensor shaped as a base weight is left alive by the rollouts (gc's view of the process,
    # against a snapshot taken before them: tests run before this one in the same process may hold models of the
    # same shapes); a frozen deep copy (the full-weight reference) would add one storage per base weight
    import copy
    import gc

    # the base weight matrices (1-D weights share their shape with the batches' small vectors: not counted)
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n and p.dim() == 2}
    shapes, own = {tuple(p.shape) for p in base.values()}, {p.untyped_storage().data_ptr() for p in base.values()}

    def others() -> set:
        gc.collect()
        # plain tensors and parameters only: earlier compiled tests leave fake tensors (torch.compile's tracing
        # values, subclasses of Tensor with no data pointer) alive in gc's view
        plain = (torch.Tensor, torch.nn.Parameter)
        return {t.untyped_storage().data_ptr() for t in gc.get_objects() if type(t) in plain
                and tuple(t.shape) in shapes and t.device.type == "cpu"} - own

    before = others()
    ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum,
                  Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None), build_task(cfg.rft), 64)
    assert ro.reference is model  # no second copy
    batches, _ = ro.generate([torch.tensor([0, 1])], step=1)
    added = others() - before
    assert not added, f"{len(added)} tensor storages shaped as base weights beside the model's {len(own)}"
    twin = copy.deepcopy(model)  # the count sees a copy: each base weight once more
    assert len(others() - before) >= len(own)
    del twin

    def greedy(m, prompt):
        ids = torch.tensor([prompt])
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        return out[:out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out

    moved = 0
    for item in ro.items:
        adapted = greedy(model, item["prompt"])
        assert item["answers"] == [adapted, adapted]
        with model.disable_adapter():
            moved += greedy(model, item["prompt"]) != adapted
    assert moved  # the adapters change the answers: the engine ran the adapted model
    b = batches[0]
    with torch.no_grad(), model.disable_adapter():
        base = completion_logps(model, b, 64, cfg.rft.temperature)
    adapted = completion_logps(model, b, 64, cfg.rft.temperature).detach()
    on = completion_mask(b).bool()
    assert torch.allclose(b["ref_logps"][on], base[on]) and not torch.allclose(b["ref_logps"][on], adapted[on])


# ----------------------------------------------------------------------------------------------- another layout


def test_a_saved_generation_batch_is_shared_out_in_the_new_layout():
    """Process r's k-th micro-batch of a generation batch was the batch's (k x processes + r)-th: the saved items go
    back in the batch's order and each process of the new layout takes the micro-batches it would have drawn."""
    from harness.rl.rollout import share

    two = {"items": [["q0", "q2"], ["q1", "q3"]], "world": 2, "per": 1}  # 2 processes x 2 micro-batches of 1
    assert share(two, 1, 0, 2, 4) == (["q0", "q1", "q2", "q3"], "")  # 1 process x micro-batches q0 q1 | q2 q3
    assert [share(two, 4, r, 1, 4)[0] for r in range(4)] == [["q0"], ["q1"], ["q2"], ["q3"]]
    one = {"items": [["q0", "q1", "q2", "q3"]], "world": 1, "per": 2}  # 1 process x 2 micro-batches of 2
    assert [share(one, 2, r, 2, 4)[0] for r in range(2)] == [["q0", "q2"], ["q1", "q3"]]  # 2 x 2 micro-batches of 1
    assert share({"items": [["q0", "q1"], ["q2", "q3"]], "world": 2}, 2, 1, 2, 4)[0] == ["q2", "q3"]  # no `per`
    assert share({"items": [[], []], "world": 2, "per": 0}, 1, 0, 2, 4) == ([], "")  # no batch yet
    mine, why = share(two, 1, 0, 2, 8)  # rl.questions_per_step changed: the batch cannot continue
    assert mine == [] and "has 4 questions, rl.questions_per_step is 8" in why


def test_an_rl_resume_on_another_process_count_keeps_the_questions_a_step(tmp_path):
    """fit: rl.questions_per_step questions a generation batch on any process count, the accumulation the fewest
    that keeps the checkpoint's questions a micro-batch (or fewer); the data position converted by questions read."""
    from pathlib import Path

    from harness.checkpoint import layout as elastic, resume
    from harness.config import load_config
    from harness.errors import ConfigError

    step = tmp_path / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    saved = {"processes": 2, "micro_batch_size": 8, "emb_micro_batch_size": 8, "grad_accum": 1, "zero_stage": None}
    (step / "harness_state.json").write_text(json.dumps({"step": 1, "streams": {}, "layout": {**saved,
                                                                                               "questions": 4}}))
    cfg = load_config(str(ROOT / "configs/grpo-tiny.yaml"),
                      [*TINY, f"train.output_dir={tmp_path}", "rl.questions_per_step=4", "train.grad_accum=1"])
    planned = resume.plan(cfg, 1)  # 2 questions a micro-batch x 2
    assert planned.cfg.train.grad_accum == 2 and planned.cfg.train.micro_batch_size == cfg.train.micro_batch_size
    assert planned.resize.describe() == "2 -> 1 process(es), train.grad_accum 1 -> 2, global batch 4 questions kept"
    assert resume.plan(cfg, 4).resize.describe() == ("2 -> 4 process(es), questions a micro-batch 2 -> 1, global "
                                                     "batch 4 questions kept")
    with pytest.raises(ConfigError, match=r"'rl.questions_per_step'.*resume on 1, 2, 4 process\(es\)"):
        resume.plan(cfg, 3)
    after = elastic.Layout(1, 8, 8, 2, questions=4)
    for state in ({"streams": {"gen": {"epoch": 0, "batches": 1, "samples": 4}}, "layout": {**saved, "questions": 4}},
                  # a checkpoint of a harness that counted `samples` with train.micro_batch_size (16) and no questions
                  {"streams": {"gen": {"epoch": 0, "batches": 1, "samples": 16}}, "layout": saved}):
        moved, resize, line = elastic.carry_over(Path("ck"), state, after, ("gen",), {"gen": 400}, False)
        assert moved == {"gen": {"epoch": 0, "batches": 2}}  # 4 questions read: 2 micro-batches of 2
        assert "layout changed: 2 -> 1 process(es), train.grad_accum 1 -> 2, global batch 4 questions kept" in line
        assert "data position by rows read (gen 4 rows of epoch 0)" in line


# ----------------------------------------------------------------------------------------------- runs

from harness_launch import ROOT, metrics, report, run_train  # noqa: E402

# 4 steps of 4 questions x 4 answers, two steps on each generation batch (the second with old log-probs), a reward
# that varies among a random model's answers, the KL term to the reference (rl.beta > 0: a copy on 1 process, under
# ZeRO-3 a second partitioned engine); every process count and ZeRO stage runs the same questions
RUN = [*TINY, "rl.reward=rl_rewards:digits", "rl.beta=0.1", "train.max_steps=4", "rl.questions_per_step=4",
       "rl.num_generations=4", "rl.iterations=2", "rl.max_completion_length=8", "rft.num_test_questions=6",
       "train.eval_every=2", "train.eval_at_start=false", "optim.lr=3e-3", "optim.warmup_steps=0",
       "train.progress_bar=false", "train.summary=false", "train.log_every=1"]
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl1")
    proc = run_train([*RUN, f"train.output_dir={out}"], config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV)
    return out, proc


def test_run_logs_the_rl_figures(one_process):
    out, proc = one_process
    steps = [m for m in metrics(out) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert 0 < m["reward"] < 1 and m["reward_std"] > 0 and 0 <= m["flat_group_share"] < 1
        assert 0 < m["completion_length"] <= 8 and m["gen_s_per_step"] >= 0 and m["train_s_per_step"] > 0
        assert 0 <= m["clip_fraction"] <= 1 and torch.isfinite(torch.tensor(m["loss"]))
        assert 0 <= m["padding_share"] < 1  # of the rows the pass runs (rl.rows=shared_prompts: a prompt once)
    # the second step on a generation batch reuses its answers (same rewards) with the old log-probs kept: after
    # one update at lr 3e-3 the ratios move off 1
    assert steps[0]["reward"] == steps[1]["reward"] and steps[2]["reward"] == steps[3]["reward"]
    assert steps[1]["loss"] != steps[0]["loss"]
    # one engine call per generation batch (steps 1 and 3 generate, 2 and 4 train again on the batch)
    assert [m["gen_calls"] for m in steps] == [1, 0, 1, 0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in records if "eval_accuracy" in m]  # step 2's in its log line, the final one on its own
    assert [m["step"] for m in evals] == [2, 4] and all(0 <= m["eval_answer_rate"] <= 1 for m in evals)
    assert "rl: grpo, 4 questions x 4 answers per generation batch" in proc.stdout
    assert "rl: 16 completions per step, 16 per process, 16 per micro-batch (TRL's per_device_train_batch_size" \
        in proc.stdout
    assert list((out / "tensorboard").rglob("events.out.tfevents*"))  # grpo-tiny logs to tensorboard
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())  # an rl run reads both sections: both kept
    assert saved["rl"]["iterations"] == 2 and saved["rft"]["max_new_tokens"] == 8  # rl.max_completion_length: TRL's name


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_processes_equal_one(one_process, tmp_path, stage):
    """2 processes (2 questions each) under ZeRO-2 / ZeRO-3 = 1 process: the same questions and answers (seeded by
    step and question), so the same rewards, and losses and KL terms (rl.beta > 0: on 1 process the reference is a
    deep copy, under ZeRO-3 a second DeepSpeed engine holding half the weights each) within 1e-5 relative (fp32:
    the sums over the step's answers and the gradient's reduction run in another order, ~1e-7; a sampled answer that
    changed would move the reward)."""
    out, _ = one_process
    run_train([*RUN, f"train.output_dir={tmp_path}"], nproc=2, accel=stage,
              config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV, timeout=900)
    ref = [m for m in metrics(out) if "reward" in m]
    got = [m for m in metrics(tmp_path) if "reward" in m]
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    scale = max(abs(m["loss"]) for m in ref)
    for a, b in zip(got, ref):
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6)
        assert a["completion_length"] == b["completion_length"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * scale, (a["loss"], b["loss"])
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-9)  # the reference's log-probs: the same sums
    assert ref[1]["kl"] > 0  # the policy moved off the reference (under ZeRO-3: a second, partitioned engine)


def test_regional_compile_trains_the_blocks_compiled_and_generates_from_the_eager_ones(one_process, tmp_path):
    """train.compile=regional (the CUDA default) with loss.mode=rl: the training pass runs the compiled decoder
    blocks, the engine the eager ones (the model unwrapped without its compiled copies: decode shapes never reach the
    compiled blocks), with no recompile after step 1. Steps 1 and 2 (one generation batch, the weights of step 0 for
    its answers) equal the eager run's: the same answers and rewards, the loss within 1e-4 relative (bit-equal when
    measured on this CPU; inductor's fused kernels may sum in another order elsewhere, ~1e-6 in fp32; later batches
    may sample other answers from weights updated by those kernels)."""
    out, _ = one_process
    run_train([*RUN, f"train.output_dir={tmp_path}", "train.compile=regional"],
              config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV, timeout=900)
    compiled = report(tmp_path)["compile"]
    assert compiled["mode"] == "regional" and compiled["ran_compiled"], compiled
    assert compiled["recompiles_after_first_step"] == 0 and compiled["block_calls_eager"] > 0, compiled
    ref = [m for m in metrics(out) if "reward" in m][:2]
    got = [m for m in metrics(tmp_path) if "reward" in m][:2]
    scale = max(abs(m["loss"]) for m in ref)
    for a, b in zip(got, ref):
        assert (a["reward"], a["completion_length"]) == (b["reward"], b["completion_length"])
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * scale, (a["loss"], b["loss"])


def test_kill_9_mid_batch_then_the_same_command_equals_uninterrupted(one_process, tmp_path):
    """kill -9 once the checkpoint of step 3 is complete, the run waiting before step 4 (step 3 is the first of two on
    the generation batch of step 3): the same command again resumes there with the saved half-used batch (answers, advantages, old log-probs)
    and step 4 equals the uninterrupted run's: the same answers and rewards, and the same loss within 1e-6
    relative (the same weights, optimizer state and rows, the old log-probs saved in fp32 as computed: the same
    arithmetic in the same order, so in practice bit-equal; 1e-6 allows a different summation order of a kernel)."""
    out, _ = one_process
    _kill_9_at_step_3_and_resume(out, tmp_path, [])


def test_lora_grpo_resumes_exactly_after_kill_9(tmp_path):
    """model.lora with rl.beta > 0 (the reference: the adapters disabled): an uninterrupted 4-step run, and one
    killed -9 after step 3's checkpoint then run again, equal at step 4 as the full-weight run's test asks (the
    adapters and their optimizer state restored, the engine serving the restored adapted model)."""
    lora = ["model.lora.enabled=true", "model.lora.r=4", "rl.beta=0.1"]
    ref = tmp_path / "uninterrupted"
    run_train([*RUN, *lora, f"train.output_dir={ref}"], config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV)
    steps = [m for m in metrics(ref) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(m["kl"] >= 0 for m in steps)
    assert steps[3]["kl"] > 0  # the adapters moved off the reference
    _kill_9_at_step_3_and_resume(ref, tmp_path / "killed", lora)


def _kill_9_at_step_3_and_resume(out, tmp_path, extra: list) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [*RUN, *extra, "train.save_every_steps=1", f"train.output_dir={tmp_path}"]
    # the victim waits before step 4 (harness/faults.py): without it a fast machine finished step 4 and its checkpoint
    # before the kill landed (the 50 ms poll below), and the resume no longer started mid-batch
    env = {**os.environ, **ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HARNESS_FAULT_PAUSE": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--config", str(ROOT / "configs/grpo-tiny.yaml"),
                             *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker, t0 = tmp_path / "checkpoints" / "step-3" / "COMPLETE", time.time()
    while not marker.exists() and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (tmp_path / "checkpoints" / "step-4").exists()
    run_train(args, config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["resumed_from"].endswith("step-3")
    ref = {m["step"]: m for m in metrics(out) if "reward" in m}
    got = {m["step"]: m for m in metrics(tmp_path) if "reward" in m}
    assert got[4]["reward"] == ref[4]["reward"] and got[4]["completion_length"] == ref[4]["completion_length"]
    assert got[4]["loss"] == pytest.approx(ref[4]["loss"], rel=1e-6, abs=1e-9)
    assert got[4]["clip_fraction"] == ref[4]["clip_fraction"]
    if "kl" in ref[4]:
        assert got[4]["kl"] == pytest.approx(ref[4]["kl"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("stage", ["ddp", "zero2"])
def test_two_processes_stopped_mid_batch_resume_on_one_as_uninterrupted(one_process, tmp_path, stage):
    """2 processes (DDP; ZeRO-2 in the extended tier: its optimizer state through a universal checkpoint) with 2
    questions each stop after step 1, the first of two steps on its generation batch; the same
    command on 1 process goes on with train.grad_accum 1 -> 2 (2 questions a micro-batch as before: the 4 questions
    a step kept). Step 2 trains on the saved batch (answers, advantages, old log-probs gathered from both processes,
    taken in the new layout), step 3 draws the next 4 questions from the data position converted by questions read
    (4: two micro-batches of 2 on 1 process, not the 1 each process had read), and steps 2-4 equal the uninterrupted
    1-process run's: the same rewards and answer lengths (the same questions and answers: a wrong position or saved
    batch would change them) and losses within 1e-5 relative (as test_two_processes_equal_one: the same sums in
    another order and micro-batch split, fp32 ~1e-7)."""
    from harness_launch import report

    args = [*RUN, f"train.output_dir={tmp_path}"]
    config = str(ROOT / "configs/grpo-tiny.yaml")
    first = run_train([*args, "train.stop_at_step=1"], nproc=2, accel=stage, config=config, extra_env=ENV, timeout=900)
    assert "stopped (stop_at_step) at step 1/4" in first.stdout, first.stdout[-3000:]
    second = run_train(args, accel=None if stage == "ddp" else stage, config=config, extra_env=ENV, timeout=900)
    said = second.stdout
    assert ("layout changed: 2 -> 1 process(es), train.grad_accum 1 -> 2, global batch 4 questions kept; data position "
            "by rows read (gen 4 rows of epoch 0)") in said, said[-3000:]
    assert "no generation batch to continue" not in said
    rep = report(tmp_path)
    assert rep["world_size"] == 1 and rep["grad_accum"] == 2 and rep["resumed_from"].endswith("step-1")
    ref = {m["step"]: m for m in metrics(one_process[0]) if "reward" in m}
    got = {m["step"]: m for m in metrics(tmp_path) if "reward" in m}
    assert sorted(got) == [1, 2, 3, 4]
    scale = max(abs(m["loss"]) for m in ref.values())
    for s in (2, 3, 4):
        assert got[s]["reward"] == pytest.approx(ref[s]["reward"], rel=1e-6), s
        assert got[s]["completion_length"] == ref[s]["completion_length"], s
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-5 * scale, (s, got[s]["loss"], ref[s]["loss"])


def test_an_rl_run_reads_no_data_train_files(tmp_path):
    """loss.mode=rl reads its prompts from the rft task or rl.prompts: a data.train_files entry left in the config (a
    missing SFT file) is not fingerprinted at the start (it stopped the run with the file's error)."""
    from harness.checkpoint import datafiles
    from harness.config import load_config

    cfg = load_config("configs/grpo-tiny.yaml", [f"data.train_files=[{tmp_path / 'missing.jsonl'}]"])
    assert datafiles.fingerprints(cfg.data, cfg.loss.mode) == {}


@pytest.mark.parametrize("nproc,accel", [(1, None), (2, "zero2")])
def test_a_micro_batch_whose_answers_are_all_cut_trains_loss_0(tmp_path, nproc, accel):
    """rl.mask_truncated_completions with every answer cut at rft.max_new_tokens (1 token: a random model draws no
    EOS in these seeded steps): the micro-batch has no trained token, and its pass still runs, loss 0 (TRL's), every
    parameter given a gradient (zeros: DDP's and DeepSpeed's reductions see every parameter), and the run goes on to
    its planned end (failed before: RuntimeError 'element 0 of tensors does not require grad' at step 1); on two
    processes under ZeRO-2 each rank's all-masked pass takes part in the gradient reduction (no hang: the launch's
    timeout)."""
    run_train([*TINY, "rl.reward=rl_rewards:digits", "train.max_steps=2", "rl.questions_per_step=2",
               "rl.num_generations=2", "rft.max_new_tokens=1", "rl.mask_truncated_completions=true",
               "rft.num_test_questions=0", "train.eval_at_start=false", "train.progress_bar=false",
               "train.summary=false", "train.log_every=1", f"train.output_dir={tmp_path}"], nproc=nproc, accel=accel,
              config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV, timeout=600)
    assert report(tmp_path)["world_size"] == nproc and report(tmp_path)["zero_stage"] == (2 if accel else None)
    steps = [m for m in metrics(tmp_path) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(m["loss"] == 0.0 for m in steps)


def test_no_trained_token_still_gives_every_parameter_a_gradient():
    """completion_logps of rows whose labels are all ignored: zeros connected to the model (the head and every
    block get a zero gradient), so a pass of an all-masked micro-batch back-propagates like any other."""
    from harness import model as model_lib
    from harness.config import load_config
    from harness import IGNORE_INDEX

    cfg = load_config("configs/grpo-tiny.yaml", TINY)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    torch.manual_seed(0)
    model = model_lib.build_model(cfg.model, tok).float()
    batch = rows([[5, 6, 7], [8, 9]], [[10, 11], [12]], tok.pad_token_id)
    batch["labels"][:] = IGNORE_INDEX
    logps = completion_logps(model, batch, 16)
    assert logps.requires_grad and float(logps.abs().sum()) == 0.0
    rl_loss.loss_sum("dapo", logps, completion_mask(batch)).backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0.0 for p in model.parameters())

"""harness.chunked_loss.chunked_token_loss_sum (the output head and the next-token loss over chunks of positions) against
token_loss_sum on full logits, and harness.chunked_loss.ChunkedHeadLoss (the same inside a HF model's forward).

    python -m pytest tests/test_chunked_ce.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from harness.data import IGNORE_INDEX
from harness.errors import ConfigError
from harness.chunked_loss import ChunkedHeadLoss, chunked_token_loss_sum, output_head
from harness.losses import token_loss_sum
from harness.model import unwrap

B, T, H, V = 3, 16, 12, 37  # 48 positions


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Relative to the tensor's scale (elements near zero get the same absolute slack as the largest)."""
    got, ref = got.detach().double(), ref.detach().double()
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * float(ref.abs().max()) + 1e-12)


def _labels(gen: torch.Generator, keep: float = 0.7, batch: int = B, seq: int = T, vocab: int = V) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) > keep] = IGNORE_INDEX
    return labels


def _leaves(gen: torch.Generator, dtype=torch.float32, bias: bool = False):
    hidden = (torch.randn(B, T, H, generator=gen) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b


def _grads(total: torch.Tensor, tensors, scale=1.0):
    return torch.autograd.grad(total * scale, [t for t in tensors if t is not None])


def _plain(hidden, weight, labels, bias=None, softcap=None):
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits.float() / softcap)
    return token_loss_sum(logits, labels)


# ----------------------------------------------------------------------------------------------- fp32, exactness


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 7 does not divide the 48 positions; 1000 > all of them
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skip_ignored", [False, True])
def test_fp32_loss_and_gradients_match_full_logits(chunk, bias, skip_ignored):
    gen = torch.Generator().manual_seed(chunk * 4 + 2 * bias + skip_ignored)
    hidden, weight, b = _leaves(gen, bias=bias)
    labels = _labels(gen)
    total, count = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=chunk, skip_ignored=skip_ignored)
    ref_total, ref_count = _plain(hidden, weight, labels, b)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert count.dtype == ref_count.dtype and int(count) == int(ref_count) > 0
    _close(total, ref_total, 1e-5)
    for got, ref in zip(_grads(total, (hidden, weight, b)), _grads(ref_total, (hidden, weight, b))):
        _close(got, ref, 1e-5)


@pytest.mark.parametrize("scale", [0.37, 2.5e-4, 0.0])
def test_incoming_gradient_scales_every_gradient(scale):
    """The loss is back-propagated scaled (W * A / N token averaging, a loss weight): the stored gradients follow."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight, b = _leaves(gen, bias=True)
    labels = _labels(gen)
    total, _ = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=10)
    ref_total, _ = _plain(hidden, weight, labels, b)
    s = torch.tensor(scale)
    got = _grads(total, (hidden, weight, b), s)
    ref = _grads(ref_total, (hidden, weight, b), s)
    for g, r in zip(got, ref):
        _close(g, r, 1e-5)
    if scale == 0.0:
        assert all(not g.any() for g in got)
    # .backward() with an explicit grad_output, and the gradient landing in .grad of leaves
    total, _ = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=10)
    total.backward(torch.tensor(scale))
    for leaf, r in zip((hidden, weight, b), ref):
        _close(leaf.grad, r, 1e-5)


def test_all_ignored_rows_and_batches():
    gen = torch.Generator().manual_seed(4)
    hidden, weight, _ = _leaves(gen)
    labels = _labels(gen)
    labels[1] = IGNORE_INDEX  # a row with nothing trained
    labels[2, 1:] = IGNORE_INDEX
    labels[2, 0] = 5  # position 0 is never a target
    total, count = chunked_token_loss_sum(hidden, weight, labels, chunk_size=5)
    ref_total, ref_count = _plain(hidden, weight, labels)
    assert int(count) == int(ref_count)
    _close(total, ref_total, 1e-5)
    gh, gw = _grads(total, (hidden, weight))
    for g, r in zip((gh, gw), _grads(ref_total, (hidden, weight))):
        _close(g, r, 1e-5)
    assert not gh[1].any() and not gh[2].any() and not gh[:, -1].any()  # nothing flows into untrained positions

    nothing = torch.full((B, T), IGNORE_INDEX)
    nothing[:, 0] = 1
    for skip in (False, True):
        total, count = chunked_token_loss_sum(hidden, weight, nothing, chunk_size=5, skip_ignored=skip)
        assert total.item() == 0.0 and int(count) == 0
        gh, gw = _grads(total, (hidden, weight))
        assert not gh.any() and not gw.any() and torch.isfinite(gh).all()


def test_untrained_positions_may_hold_anything():
    """Ignored positions contribute nothing even with inf/NaN hidden states there (F.cross_entropy ignores them)."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight, _ = _leaves(gen)
    labels = _labels(gen)
    labels[0, 5] = IGNORE_INDEX  # position 4 predicts nothing
    ref_total, _ = chunked_token_loss_sum(hidden, weight, labels, chunk_size=6)
    poisoned = hidden.detach().clone()
    poisoned[0, 4] = float("inf")
    poisoned[0, 4, 0] = float("nan")
    poisoned.requires_grad_()
    total, _ = chunked_token_loss_sum(poisoned, weight, labels, chunk_size=6)
    assert total.item() == pytest.approx(ref_total.item(), rel=1e-6)
    gh, _ = _grads(total, (poisoned, weight))
    assert torch.isfinite(gh).all() and not gh[0, 4].any()


def test_packed_rows_equal_the_sum_of_their_documents():
    """A packed row (documents back to back, the first label of each document IGNORE_INDEX so that no position
    predicts across a boundary) has the loss of its documents taken one by one."""
    gen = torch.Generator().manual_seed(6)
    lengths = [5, 1, 7, 3]
    row = sum(lengths)
    hidden = torch.randn(1, row, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (1, row), generator=gen)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for s in starts:
        labels[0, s] = IGNORE_INDEX
    labels[0, starts[2] + 2] = IGNORE_INDEX  # an untrained token inside a document (a prompt)
    total, count = chunked_token_loss_sum(hidden, weight, labels, chunk_size=4)
    ref_total, ref_count = _plain(hidden, weight, labels)
    _close(total, ref_total, 1e-5)
    assert int(count) == int(ref_count) == row - len(lengths) - 1
    parts = [chunked_token_loss_sum(hidden[:, s:s + n], weight, labels[:, s:s + n], chunk_size=3)
             for s, n in zip(starts, lengths)]
    _close(sum(p[0] for p in parts), total, 1e-5)
    assert sum(int(p[1]) for p in parts) == int(count)
    for g, r in zip(_grads(total, (hidden, weight)), _grads(ref_total, (hidden, weight))):
        _close(g, r, 1e-5)


def test_tied_weight_gradients_add_up():
    """The head's weight is the input embedding's (tie_word_embeddings): its gradient is the sum of both uses."""
    gen = torch.Generator().manual_seed(7)
    emb = torch.nn.Embedding(V, H)
    mix = torch.nn.Linear(H, H)
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX

    def run(chunked: bool):
        emb.zero_grad(set_to_none=True)
        mix.zero_grad(set_to_none=True)
        hidden = torch.tanh(mix(emb(ids)))
        if chunked:
            total, _ = chunked_token_loss_sum(hidden, emb.weight, labels, chunk_size=11)
        else:
            total, _ = _plain(hidden, emb.weight, labels)
        (total * 0.5).backward()
        return total.detach(), emb.weight.grad.clone(), mix.weight.grad.clone()

    got, ref = run(True), run(False)
    for g, r in zip(got, ref):
        _close(g, r, 1e-5)
    # and the head's part alone is not the whole gradient
    hidden = torch.tanh(mix(emb(ids))).detach()
    head_only = _grads(_plain(hidden, emb.weight, labels)[0], (emb.weight,), 0.5)[0]
    assert (head_only - ref[1]).abs().max() > 1e-3


def test_frozen_head_or_frozen_hidden():
    """Only the gradients asked for are computed (a frozen head under LoRA; a frozen trunk)."""
    gen = torch.Generator().manual_seed(8)
    hidden, weight, _ = _leaves(gen)
    labels = _labels(gen)
    frozen_w = weight.detach()
    total, _ = chunked_token_loss_sum(hidden, frozen_w, labels, chunk_size=9)
    (gh,) = torch.autograd.grad(total, [hidden])
    _close(gh, torch.autograd.grad(_plain(hidden, frozen_w, labels)[0], [hidden])[0], 1e-5)
    frozen_h = hidden.detach()
    total, _ = chunked_token_loss_sum(frozen_h, weight, labels, chunk_size=9)
    (gw,) = torch.autograd.grad(total, [weight])
    _close(gw, torch.autograd.grad(_plain(frozen_h, weight, labels)[0], [weight])[0], 1e-5)


def test_no_grad_computes_only_the_loss():
    gen = torch.Generator().manual_seed(9)
    hidden, weight, _ = _leaves(gen)
    labels = _labels(gen)
    with torch.no_grad():
        total, count = chunked_token_loss_sum(hidden, weight, labels, chunk_size=9)
        ref_total, ref_count = _plain(hidden, weight, labels)
    assert not total.requires_grad and total.grad_fn is None
    _close(total, ref_total, 1e-5)
    assert int(count) == int(ref_count)


def test_second_backward_through_the_same_graph_is_refused():
    gen = torch.Generator().manual_seed(10)
    hidden, weight, _ = _leaves(gen)
    total, _ = chunked_token_loss_sum(hidden, weight, _labels(gen), chunk_size=9)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        total.backward()


@pytest.mark.parametrize("cap", [30.0, 2.0])
def test_softcap_matches_capped_logits(cap):
    gen = torch.Generator().manual_seed(11)
    hidden, weight, b = _leaves(gen, bias=True)
    labels = _labels(gen)
    total, _ = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=7, softcap=cap)
    ref_total, _ = _plain(hidden, weight, labels, b, softcap=cap)
    _close(total, ref_total, 1e-5)
    for g, r in zip(_grads(total, (hidden, weight, b), 0.3), _grads(ref_total, (hidden, weight, b), 0.3)):
        _close(g, r, 1e-5)
    uncapped, _ = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=7)
    assert abs(uncapped.item() - total.item()) > 1e-3


def test_argument_errors():
    gen = torch.Generator().manual_seed(12)
    hidden, weight, _ = _leaves(gen)
    labels = _labels(gen)
    with pytest.raises(ValueError, match="labels"):
        chunked_token_loss_sum(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="weight"):
        chunked_token_loss_sum(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="bias"):
        chunked_token_loss_sum(hidden, weight, labels, torch.zeros(V + 1))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_loss_sum(hidden, weight, labels, chunk_size=0)
    with pytest.raises(TypeError, match="autocast"):
        chunked_token_loss_sum(hidden.bfloat16(), weight, labels)
    bad = labels.clone()
    bad[0, 3] = V  # out of the vocabulary: an error, as in F.cross_entropy
    with pytest.raises((RuntimeError, IndexError)):
        chunked_token_loss_sum(hidden, weight, bad)


# ----------------------------------------------------------------------------------------------- low precision


def _fp64_reference(hidden, weight, labels):
    """Loss and gradients in float64 from the (rounded) low-precision values."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    total, _ = _plain(h, w, labels)
    total = total.double() if total.dtype != torch.float64 else total
    gh, gw = torch.autograd.grad(total, [h, w])
    return total.detach(), gh, gw


def _rel_err(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def test_bf16_close_to_float64_and_as_close_as_full_bf16_logits():
    """bf16 hidden and weight (logits built in bf16, softmax in fp32). Stated tolerance: loss within 1e-3 relative,
    gradients within 2e-2 relative (Frobenius norm) of a float64 reference from the same bf16 values, and within
    1.5x (+1e-3) of the error of the full-logit path in bf16."""
    gen = torch.Generator().manual_seed(13)
    hidden, weight, _ = _leaves(gen, dtype=torch.bfloat16)
    labels = _labels(gen)
    ref_total, ref_gh, ref_gw = _fp64_reference(hidden, weight, labels)
    total, _ = chunked_token_loss_sum(hidden, weight, labels, chunk_size=7)
    assert total.dtype == torch.float32
    gh, gw = _grads(total, (hidden, weight))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    plain_total, _ = _plain(hidden, weight, labels)
    pgh, pgw = _grads(plain_total, (hidden, weight))
    assert abs(total.item() - ref_total.item()) <= 1e-3 * abs(ref_total.item())
    for got, plain, ref in ((gh, pgh, ref_gh), (gw, pgw, ref_gw)):
        err, plain_err = _rel_err(got, ref), _rel_err(plain, ref)
        assert err <= 2e-2 and err <= 1.5 * plain_err + 1e-3, (err, plain_err)


def test_autocast_computes_in_the_autocast_dtype():
    """fp32 master weights under autocast: logits in bf16 (as F.linear would), gradients back in fp32."""
    gen = torch.Generator().manual_seed(14)
    hidden, weight, b = _leaves(gen, bias=True)
    labels = _labels(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = chunked_token_loss_sum(hidden, weight, labels, b, chunk_size=7)
        plain_total, _ = token_loss_sum(torch.nn.functional.linear(hidden, weight, b), labels)
    got = _grads(total, (hidden, weight, b))
    plain = _grads(plain_total, (hidden, weight, b))
    assert [g.dtype for g in got] == [torch.float32] * 3
    fp32_total, _ = _plain(hidden, weight, labels, b)
    fp32 = _grads(fp32_total, (hidden, weight, b))
    # bf16 rounding, not fp32 exactness: the chunked result is as far from fp32 as the autocast full-logit path is
    assert abs(total.item() - plain_total.item()) <= 2e-3 * abs(plain_total.item())
    assert abs(total.item() - fp32_total.item()) > 0  # really computed in bf16
    for g, p, r in zip(got, plain, fp32):
        err, plain_err = _rel_err(g, r.double()), _rel_err(p, r.double())
        assert err <= 2e-2 and err <= 1.5 * plain_err + 1e-3, (err, plain_err)


# ----------------------------------------------------------------------------------------------- inside a HF model

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64, vocab_size=96)


def _tiny(model_type: str = "llama", **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**TINY, **extra})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)


def _batch(gen: torch.Generator, vocab: int = 96):
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, 7] = IGNORE_INDEX  # a packing boundary
    pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(12).unsqueeze(0), pos])}, labels


def _model_grads(model, inputs, labels, chunked: bool, chunk_size: int = 5):
    model.zero_grad(set_to_none=True)
    if chunked:
        with ChunkedHeadLoss(model, labels, chunk_size=chunk_size) as head_loss:
            out = model(**inputs, use_cache=False)
        total, count = head_loss.result(out)
    else:
        total, count = token_loss_sum(model(**inputs, use_cache=False).logits, labels)
    (total * 0.25).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), int(count), grads


@pytest.mark.parametrize("family,extra", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    ("gemma2", {"final_logit_softcapping": 5.0, "head_dim": 16}),
])
def test_head_loss_in_a_model_matches_full_logits(family, extra):
    model = _tiny(family, **extra)
    if extra.get("tie_word_embeddings"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    inputs, labels = _batch(torch.Generator().manual_seed(15))
    got = _model_grads(model, inputs, labels, chunked=True)
    ref = _model_grads(model, inputs, labels, chunked=False)
    _close(got[0], ref[0], 1e-5)
    assert got[1] == ref[1] == int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert got[2].keys() == ref[2].keys() and len(ref[2]) == len(list(model.parameters()))
    for name in ref[2]:
        _close(got[2][name], ref[2][name], 1e-5)
    # the head is restored, and so is the config
    assert "forward" not in vars(model.get_output_embeddings())
    assert getattr(model.config, "final_logit_softcapping", None) == extra.get("final_logit_softcapping")
    logits = model(**inputs, use_cache=False).logits
    assert logits.shape == (*labels.shape, 96)


def test_head_loss_through_peft_and_torch_compile_wrappers():
    from peft import LoraConfig, get_peft_model

    base = _tiny("llama")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    assert output_head(model)[0] is base.lm_head
    assert unwrap(torch.compile(model)) is model
    inputs, labels = _batch(torch.Generator().manual_seed(16))
    got = _model_grads(model, inputs, labels, chunked=True)
    ref = _model_grads(model, inputs, labels, chunked=False)
    _close(got[0], ref[0], 1e-5)
    assert ref[2] and all("lora_" in n for n in ref[2])
    for name in ref[2]:
        _close(got[2][name], ref[2][name], 1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_head_loss_with_peft_trainable_tokens_on_the_head_matches_full_logits(tied):
    """LoRA on a base whose vocabulary was extended (the chat markers added to its tokenizer): peft trains the new
    rows apart (trainable_token_indices, harness.lora.apply_lora), and wraps the head in a TrainableTokensLayer,
    tied head or not. The chunked loss takes the head with those rows merged in: the loss and the gradients of the
    adapters and of the trained rows equal the full logits'; with the adapter off (a DPO reference pass) it is the
    base's. Before: refused ("not a plain Linear"), so chunked_ce=auto fell back to full logits and DPO refused LoRA
    on such a base."""
    from peft import LoraConfig, get_peft_model

    from harness.chunked_loss import _token_layer, head_params
    from harness.lora import _token_targets
    from harness.preference import sequence_logps

    base = _tiny("llama", tie_word_embeddings=tied)
    added = list(range(90, 96))  # the last rows stand for the added tokens
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM", trainable_token_indices=_token_targets(base, added)))
    head = output_head(model)[0]
    layer = _token_layer(head)  # peft 0.21: a TrainableTokensWrapper in place of lm_head, the layer inside
    assert layer is not None
    with torch.no_grad():  # trained rows that differ from the base's, and adapters that are not zero
        for name, p in model.named_parameters():
            if "trainable_tokens_delta" in name or "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    assert not torch.equal(head_params(head)[0][added], layer.base_layer.weight[added])
    inputs, labels = _batch(torch.Generator().manual_seed(17))
    inputs["input_ids"][:, 3] = 92  # an added token as input and as target
    labels[:, 4] = 93
    got = _model_grads(model, inputs, labels, chunked=True)
    ref = _model_grads(model, inputs, labels, chunked=False)
    _close(got[0], ref[0], 1e-5)
    assert got[2].keys() == ref[2].keys() and any("trainable_tokens_delta" in n for n in ref[2])
    for name in ref[2]:
        _close(got[2][name], ref[2][name], 1e-5)
    assert "forward" not in vars(head)  # restored
    # the DPO reference pass: the adapter off, the base's rows
    batch = {**inputs, "labels": labels, "attention_mask": torch.ones_like(labels)}
    with torch.no_grad(), model.disable_adapter():
        off, _ = sequence_logps(model, batch, chunk_size=5)
        full = torch.log_softmax(model(**inputs, use_cache=False).logits.float(), -1)
    want = torch.where(labels[:, 1:] != IGNORE_INDEX, full[:, :-1].gather(
        -1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros(())).sum(1)
    _close(off, want, 1e-5)


def test_head_loss_refusals():
    from peft import LoraConfig, get_peft_model

    with pytest.raises(ConfigError, match="logit_scale"):
        output_head(_tiny("cohere", logit_scale=0.0625))
    with pytest.raises(ConfigError, match="logits_scaling"):
        output_head(_tiny("granite", logits_scaling=8.0))
    lora_head = get_peft_model(_tiny("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="not a plain Linear"):
        output_head(lora_head)

    class Doubling(torch.nn.Module):  # a family that transforms the head's output without a config flag for it
        def __init__(self):
            super().__init__()
            self.lm = _tiny("llama")
            self.config = self.lm.config

        def get_output_embeddings(self):
            return self.lm.lm_head

        def forward(self, **kw):
            out = self.lm(**kw)
            out.logits = out.logits * 2
            return out

    model = Doubling()
    inputs, labels = _batch(torch.Generator().manual_seed(17))
    with ChunkedHeadLoss(model, labels) as head_loss:
        out = model(**inputs, use_cache=False)
    with pytest.raises(RuntimeError, match="transforms the output head"):
        head_loss.result(out)
    with ChunkedHeadLoss(model, labels) as head_loss, pytest.raises(RuntimeError, match="logits_to_keep=0"):
        model(**inputs, use_cache=False, logits_to_keep=1)


class _DetachedView(torch.autograd.Function):
    """What ZeRO-3's pre-backward hook does to every module output: a detached view with a backward of its own."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_head_loss_accepts_outputs_rewrapped_like_zero3():
    """ZeRO-3 replaces the head's output and then the model's ModelOutput values with views of them (forward hooks
    registered at engine start, before ChunkedHeadLoss's): accepted, and the gradients still arrive."""
    model = _tiny("llama")

    def wrap_head(module, args, out):
        return _DetachedView.apply(out)

    def wrap_logits(module, args, out):
        out["logits"] = _DetachedView.apply(out["logits"])

    hooks = [model.lm_head.register_forward_hook(wrap_head), model.register_forward_hook(wrap_logits)]
    inputs, labels = _batch(torch.Generator().manual_seed(18))
    got = _model_grads(model, inputs, labels, chunked=True)
    for h in hooks:
        h.remove()
    ref = _model_grads(model, inputs, labels, chunked=False)
    _close(got[0], ref[0], 1e-5)
    for name in ref[2]:
        _close(got[2][name], ref[2][name], 1e-5)

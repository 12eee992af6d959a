"""harness.losses: the summed next-token loss against a float64 reference, per-token averaging over a step, the
'mixed' micro-batch averaging, embedding pooling and the contrastive loss (float64 loop references)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.losses import (
    IGNORE_INDEX,
    contrastive_loss,
    gather_with_grad,
    mixed_scale,
    pool,
    step_scale,
    token_loss_sum,
    trained_tokens,
)


def reference_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Explicit float64 loops: position t predicts labels[t + 1]; IGNORE_INDEX targets are skipped."""
    lg = logits.double()
    total, count = 0.0, 0
    for b in range(lg.shape[0]):
        for t in range(lg.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            row = [float(x) for x in lg[b, t]]
            m = max(row)
            log_z = m + math.log(sum(math.exp(x - m) for x in row))
            total += log_z - row[target]  # -log_softmax(row)[target]
            count += 1
    return total, count


def random_batch(gen: torch.Generator, batch: int, seq: int, vocab: int, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(batch, seq, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) > keep] = IGNORE_INDEX
    return logits, labels


def test_token_loss_sum_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits, labels = random_batch(gen, batch=3, seq=9, vocab=11, keep=0.6)
    labels[0, 0] = 5  # position 0 is never a target (nothing predicts it)
    total, count = token_loss_sum(logits, labels)
    ref_total, ref_count = reference_loss_sum(logits, labels)
    assert int(count) == ref_count > 0
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(ref_total, rel=1e-5)


def test_token_loss_sum_shift_by_hand():
    # One sequence, vocab 3. Targets are labels[1:] = [2, IGNORE, 0], predicted from logits at positions 0, 1, 2.
    logits = torch.tensor([[[0.0, 1.0, 2.0], [5.0, 5.0, 5.0], [1.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 0]])
    total, count = token_loss_sum(logits, labels)

    def nll(row, target):
        return math.log(sum(math.exp(x) for x in row)) - row[target]

    expected = nll([0.0, 1.0, 2.0], 2) + nll([1.0, 0.0, 0.0], 0)
    assert int(count) == 2
    assert total.item() == pytest.approx(expected, rel=1e-6)


def test_token_loss_sum_low_precision_input_is_computed_in_fp32():
    gen = torch.Generator().manual_seed(1)
    logits, labels = random_batch(gen, batch=2, seq=6, vocab=7, keep=1.0)
    total, count = token_loss_sum(logits.bfloat16(), labels)
    ref_total, _ = reference_loss_sum(logits.bfloat16().float(), labels)
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(ref_total, rel=1e-5)
    assert int(count) == 2 * 5


def test_all_ignored_gives_zero():
    logits = torch.randn(2, 4, 5)
    labels = torch.full((2, 4), IGNORE_INDEX)
    labels[:, 0] = 1  # only position 0 is labelled, and it is never a target
    total, count = token_loss_sum(logits, labels)
    assert total.item() == 0.0 and int(count) == 0
    assert int(trained_tokens(labels)) == 0


def test_trained_tokens():
    labels = torch.tensor([[7, 1, IGNORE_INDEX, 3], [IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX]])
    assert int(trained_tokens(labels)) == 3  # position 0 is not counted
    gen = torch.Generator().manual_seed(2)
    logits, labels = random_batch(gen, batch=4, seq=8, vocab=5, keep=0.5)
    assert int(trained_tokens(labels)) == int(token_loss_sum(logits, labels)[1])


def test_step_scale():
    assert step_scale(1, 1, 10) == pytest.approx(0.1)
    assert step_scale(8, 4, 64) == pytest.approx(0.5)
    scale = step_scale(2, 3, torch.tensor(12))
    assert torch.is_tensor(scale) and scale.item() == pytest.approx(0.5)


def _micro_batches(gen: torch.Generator, vocab: int):
    """Micro-batches whose trained-token counts differ a lot (different sizes and label densities)."""
    shapes = [(1, 12, 0.9), (3, 7, 0.2), (2, 10, 0.6), (1, 5, 1.0)]
    return [random_batch(gen, b, s, vocab, keep) for b, s, keep in shapes]


@pytest.mark.parametrize("world, accum", [(1, 4), (2, 2), (4, 1)])
def test_per_token_step_average(world, accum):
    """sum_i token_loss_sum_i * step_scale(world, accum, N) / (world * accum) == per-token mean over the step.

    The division by world * accum is what accelerate (1/accum) and the DDP all-reduce (1/world) apply."""
    gen = torch.Generator().manual_seed(3)
    vocab = 13
    micro = _micro_batches(gen, vocab)
    assert len(micro) == world * accum
    counts = [int(trained_tokens(lab)) for _, lab in micro]
    assert len(set(counts)) == len(counts)  # unequal trained-token counts
    n_total = sum(counts)

    # The reference: every trained token of the step weighted equally (float64 loops).
    ref_sum = sum(reference_loss_sum(lg, lab)[0] for lg, lab in micro)
    ref_mean = ref_sum / n_total

    scale = step_scale(world, accum, torch.tensor(n_total))
    step_loss = sum(token_loss_sum(lg, lab)[0] * scale / (world * accum) for lg, lab in micro)
    assert step_loss.item() == pytest.approx(ref_mean, rel=1e-5)

    # Averaging each micro-batch by its own token count and then over micro-batches weights tokens unequally.
    naive = sum((token_loss_sum(lg, lab)[0] / token_loss_sum(lg, lab)[1]).item() for lg, lab in micro) / len(micro)
    assert abs(naive - ref_mean) > 1e-3


def test_per_token_step_average_gradients():
    """Accumulating the scaled micro-batch losses gives the gradient of the whole step's per-token mean."""
    gen = torch.Generator().manual_seed(4)
    vocab, accum = 9, 4
    micro = _micro_batches(gen, vocab)
    n_total = sum(int(trained_tokens(lab)) for _, lab in micro)

    leaves = [lg.clone().requires_grad_(True) for lg, _ in micro]
    for leaf, (_, lab) in zip(leaves, micro):
        loss = token_loss_sum(leaf, lab)[0] * step_scale(1, accum, n_total)
        (loss / accum).backward()  # what accelerate does with gradient accumulation

    ref_leaves = [lg.double().clone().requires_grad_(True) for lg, _ in micro]
    ref_sum = sum(
        torch.nn.functional.cross_entropy(
            leaf[:, :-1].reshape(-1, vocab), lab[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        for leaf, (_, lab) in zip(ref_leaves, micro)
    )
    (ref_sum / n_total).backward()
    for leaf, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


def test_split_invariance():
    """The step loss does not depend on how the same samples are split into micro-batches."""
    gen = torch.Generator().manual_seed(5)
    logits, labels = random_batch(gen, batch=6, seq=8, vocab=10, keep=0.5)
    labels[0, 1:] = IGNORE_INDEX  # one sample with no trained token at all
    labels[1, 1:] = torch.randint(0, 10, (7,), generator=gen)  # one fully trained

    def step_loss(splits):
        n = int(trained_tokens(labels))
        pieces = torch.split(torch.arange(6), splits)
        return sum(token_loss_sum(logits[i], labels[i])[0] * step_scale(1, len(pieces), n) / len(pieces) for i in pieces)

    whole = token_loss_sum(logits, labels)
    expected = (whole[0] / whole[1]).item()
    for splits in ([6], [1, 5], [2, 2, 2], [1, 1, 1, 1, 1, 1], [4, 2]):
        assert step_loss(list(splits)).item() == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------------------------- mixed averaging


def test_mixed_scale_values():
    assert mixed_scale(4) == pytest.approx(0.25)
    assert mixed_scale(torch.tensor(8)) == pytest.approx(0.125)
    assert mixed_scale(1) == 1.0
    assert mixed_scale(0) == 1.0  # a micro-batch without trained tokens: its sum is 0, no division by zero
    assert mixed_scale(torch.tensor(0)) == 1.0


def test_mixed_scale_is_the_mean_of_micro_batch_means():
    """sum_i token_loss_sum_i * mixed_scale(count_i) / n_micro == mean over micro-batches of each one's token mean
    (what accelerate's 1/accum and the DDP average make of it); on unequal counts that is not the per-token mean."""
    gen = torch.Generator().manual_seed(6)
    micro = _micro_batches(gen, vocab=11)
    refs = [reference_loss_sum(lg, lab) for lg, lab in micro]
    counts = [c for _, c in refs]
    assert len(set(counts)) > 1 and min(counts) > 0  # unequal trained-token counts

    ref_mean_of_means = sum(t / c for t, c in refs) / len(refs)
    ref_token_mean = sum(t for t, _ in refs) / sum(counts)

    step = 0.0
    for lg, lab in micro:
        total, count = token_loss_sum(lg, lab)
        step = step + total * mixed_scale(count) / len(micro)
    assert step.item() == pytest.approx(ref_mean_of_means, rel=1e-5)
    assert abs(ref_mean_of_means - ref_token_mean) > 1e-3
    assert step.item() != pytest.approx(ref_token_mean, rel=1e-4)


def test_mixed_scale_gradient_matches_mean_of_means():
    gen = torch.Generator().manual_seed(7)
    micro = _micro_batches(gen, vocab=7)
    leaves = [lg.clone().requires_grad_(True) for lg, _ in micro]
    for leaf, (_, lab) in zip(leaves, micro):
        total, count = token_loss_sum(leaf, lab)
        (total * mixed_scale(count) / len(micro)).backward()
    ref_leaves = [lg.double().clone().requires_grad_(True) for lg, _ in micro]
    ref = sum(
        torch.nn.functional.cross_entropy(
            leaf[:, :-1].reshape(-1, 7), lab[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )
        for leaf, (_, lab) in zip(ref_leaves, micro)
    ) / len(micro)
    ref.backward()
    for leaf, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.double(), r.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------- pooling


def reference_pool(hidden: torch.Tensor, pool_mask: torch.Tensor, method: str) -> list[list[float]]:
    """Explicit float64 loops over the pooled positions; then L2 normalisation."""
    out = []
    for b in range(hidden.shape[0]):
        positions = [t for t in range(hidden.shape[1]) if int(pool_mask[b, t]) == 1]
        size = hidden.shape[2]
        if method == "lasttoken":
            vec = [float(hidden[b, positions[-1], h]) for h in range(size)]
        else:
            weights = list(range(1, len(positions) + 1)) if method == "weightedmean" else [1] * len(positions)
            vec = [0.0] * size
            for w, t in zip(weights, positions):
                for h in range(size):
                    vec[h] += w * float(hidden[b, t, h])
            vec = [v / sum(weights) for v in vec]
        norm = math.sqrt(sum(v * v for v in vec))
        out.append([v / norm for v in vec])
    return out


def _pool_inputs(seed: int):
    """Hidden states [4, 9, 6] and a mask: instruction tokens first (not pooled), then text, then padding."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 9, 6, generator=gen) + 0.5
    layout = [(2, 5), (0, 9), (3, 1), (1, 7)]  # (instruction length, text length); row 2 pools a single token
    mask = torch.zeros(4, 9, dtype=torch.long)
    for b, (instr, text) in enumerate(layout):
        mask[b, instr:instr + text] = 1
    return hidden, mask, layout


@pytest.mark.parametrize("method", ["mean", "weightedmean", "lasttoken"])
def test_pool_matches_reference(method):
    hidden, mask, _ = _pool_inputs(8)
    emb = pool(hidden, mask, method)
    assert emb.shape == (4, 6) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(4), rtol=0, atol=1e-6)
    ref = torch.tensor(reference_pool(hidden, mask, method), dtype=torch.float64)
    torch.testing.assert_close(emb.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["mean", "weightedmean", "lasttoken"])
def test_pool_ignores_masked_out_positions(method):
    hidden, mask, _ = _pool_inputs(9)
    emb = pool(hidden, mask, method)
    changed = hidden.clone()
    gen = torch.Generator().manual_seed(10)
    noise = torch.randn(changed.shape, generator=gen) * 1e3
    changed[mask == 0] = noise[mask == 0]  # instruction tokens and padding
    assert not torch.equal(changed, hidden)
    torch.testing.assert_close(pool(changed, mask, method), emb, rtol=0, atol=0)
    # ... while a pooled position does matter.
    changed[0, 6] += 1.0  # the last pooled token of row 0
    assert not torch.allclose(pool(changed, mask, method), emb)


def test_pool_weightedmean_weights_by_rank_among_pooled_tokens():
    """The k-th *pooled* token gets weight k, whatever its absolute position (instruction tokens do not count)."""
    hidden = torch.zeros(1, 5, 2)
    hidden[0, 2] = torch.tensor([1.0, 0.0])  # 1st pooled token, weight 1
    hidden[0, 3] = torch.tensor([0.0, 1.0])  # 2nd pooled token, weight 2
    hidden[0, :2] = 100.0  # instruction
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    expected = torch.tensor([[1.0, 2.0]]) / math.sqrt(5.0)
    torch.testing.assert_close(pool(hidden, mask, "weightedmean"), expected)
    torch.testing.assert_close(pool(hidden, mask, "mean"), torch.tensor([[1.0, 1.0]]) / math.sqrt(2.0))
    torch.testing.assert_close(pool(hidden, mask, "lasttoken"), torch.tensor([[0.0, 1.0]]))


def test_pool_low_precision_input_gives_fp32():
    hidden, mask, _ = _pool_inputs(11)
    emb = pool(hidden.bfloat16(), mask, "weightedmean")
    assert emb.dtype == torch.float32
    ref = torch.tensor(reference_pool(hidden.bfloat16().float(), mask, "weightedmean"), dtype=torch.float64)
    torch.testing.assert_close(emb.double(), ref, rtol=1e-5, atol=1e-6)


def test_pool_unknown_method():
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        pool(torch.zeros(1, 2, 3), torch.ones(1, 2), "max")


# ----------------------------------------------------------------------------------------------- contrastive loss


def reference_contrastive(q: list[list[float]], p: list[list[float]], temperature: float) -> float:
    """Explicit float64 loops: query b scores every passage (its group b*G.. first, the positive at b*G; all other
    rows are negatives) and the loss is the mean of -log softmax at its positive."""
    group = len(p) // len(q)
    total = 0.0
    for b, qv in enumerate(q):
        scores = [sum(x * y for x, y in zip(qv, pv)) / temperature for pv in p]
        m = max(scores)
        log_z = m + math.log(sum(math.exp(s - m) for s in scores))
        total += log_z - scores[b * group]
    return total / len(q)


def reference_contrastive_autograd(q: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """The same loops on float64 tensors, so torch.autograd differentiates them (no matmul, no cross_entropy)."""
    group = p.shape[0] // q.shape[0]
    terms = []
    for b in range(q.shape[0]):
        scores = torch.stack([(q[b] * p[j]).sum() / temperature for j in range(p.shape[0])])
        terms.append(torch.logsumexp(scores, 0) - scores[b * group])
    return torch.stack(terms).mean()


def _unit_rows(gen: torch.Generator, n: int, dim: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=gen)
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_contrastive_loss_matches_reference(group, temperature):
    gen = torch.Generator().manual_seed(100 + group)
    batch, dim = 3, 8
    q, p = _unit_rows(gen, batch, dim), _unit_rows(gen, batch * group, dim)
    p[0] = 0.8 * q[0] + 0.2 * p[0]  # make one positive actually close, so the loss is not near log(B*G) everywhere
    p[0] /= p[0].norm()
    loss = contrastive_loss(q, p, temperature)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    ref = reference_contrastive(q.double().tolist(), p.double().tolist(), temperature)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    # bf16 embeddings are scored in fp32
    low = contrastive_loss(q.bfloat16(), p.bfloat16(), temperature)
    assert low.dtype == torch.float32
    ref_low = reference_contrastive(q.bfloat16().double().tolist(), p.bfloat16().double().tolist(), temperature)
    assert low.item() == pytest.approx(ref_low, rel=1e-5, abs=1e-6)


def test_contrastive_loss_positive_is_the_first_row_of_each_group():
    """Swapping a hard negative with the positive changes the loss; permuting the negatives does not."""
    gen = torch.Generator().manual_seed(12)
    q, p = _unit_rows(gen, 2, 5), _unit_rows(gen, 2 * 3, 5)
    base = contrastive_loss(q, p, 0.1)
    negs_permuted = p[[0, 2, 1, 3, 5, 4]]
    assert contrastive_loss(q, negs_permuted, 0.1).item() == pytest.approx(base.item(), rel=1e-6)
    pos_swapped = p[[1, 0, 2, 3, 4, 5]]
    ref = reference_contrastive(q.double().tolist(), pos_swapped.double().tolist(), 0.1)
    assert contrastive_loss(q, pos_swapped, 0.1).item() == pytest.approx(ref, rel=1e-5)
    assert abs(ref - base.item()) > 1e-3


def test_contrastive_loss_in_batch_negatives_count():
    """The other queries' passages are negatives too: with B=2, G=2 each query's term is -log softmax over all 4
    passages, and that is larger than the term of the query alone with its own group."""
    gen = torch.Generator().manual_seed(13)
    q, p = _unit_rows(gen, 2, 6), _unit_rows(gen, 4, 6)
    qd, pd = q.double().tolist(), p.double().tolist()
    alone = contrastive_loss(q[:1], p[:2], 0.5).item()
    assert alone == pytest.approx(reference_contrastive(qd[:1], pd[:2], 0.5), rel=1e-5)
    # one query against 4 passages with its positive first = its term in the batch of two (rows rotated for q1)
    term0 = reference_contrastive(qd[:1], pd, 0.5)
    term1 = reference_contrastive(qd[1:], pd[2:] + pd[:2], 0.5)
    assert term0 > reference_contrastive(qd[:1], pd[:2], 0.5)
    assert contrastive_loss(q, p, 0.5).item() == pytest.approx((term0 + term1) / 2, rel=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_contrastive_loss_gradient(group, temperature):
    gen = torch.Generator().manual_seed(200 + group)
    batch, dim = 3, 6
    q0, p0 = _unit_rows(gen, batch, dim), _unit_rows(gen, batch * group, dim)
    q, p = q0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    contrastive_loss(q, p, temperature).backward()

    rq, rp = q0.double().requires_grad_(True), p0.double().requires_grad_(True)
    ref = reference_contrastive_autograd(rq, rp, temperature)
    ref.backward()
    assert ref.item() == pytest.approx(reference_contrastive(q0.double().tolist(), p0.double().tolist(), temperature))
    torch.testing.assert_close(q.grad.double(), rq.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.grad.double(), rp.grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- gathering


def test_gather_with_grad_without_process_group_is_identity():
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    x = torch.randn(3, 4, requires_grad=True)
    out = gather_with_grad(x)
    assert out is x
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 4))
    y = torch.randn(2, 5)
    assert gather_with_grad(y) is y

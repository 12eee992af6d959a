"""harness.losses: the summed next-token loss against a float64 reference, and per-token averaging over a step."""

from __future__ import annotations

import math

import pytest
import torch

from harness.losses import IGNORE_INDEX, step_scale, token_loss_sum, trained_tokens


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

"""Weighted mixing of data sources, and the eval split held out of the training data.

Weights (`weight:` on each entry of a data list) set each source's share of an epoch. An epoch keeps as many samples
as the sources hold together (N = the sum of their rows); source s contributes k_s = N * w_s / sum(w) of them
(largest-remainder rounding, so the k_s add up to N). A source with k_s <= its rows gives a seeded subset of its rows
without repeats; a source with more gives every row floor(k_s / rows) times and a seeded subset for the remainder.
The selection is drawn once from train.seed, before packing: the same on every process and on every resume (exact
resume needs nothing more), and the same subset of a down-weighted source in every epoch; the loader's per-epoch
shuffle then interleaves the sources. Without weights the sources are simply concatenated.

The eval split (`data.eval_split`: a fraction in (0, 1) or a count of records) is drawn from the training sources
before any weighting, from a seeded permutation of all their rows: deterministic, the same on every process, and
disjoint from the training rows (a held-out record is in no source's training rows, whatever its weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.errors import ConfigError

_MIX, _SPLIT = 0x6D6978, 0x73706C  # stream tags: the mix and the eval split draw from different seeded streams


@dataclass(frozen=True)
class MixShare:
    """One source's part of an epoch, as `harness data-check` and the run log print it."""

    name: str
    rows: int
    weight: float
    samples: int  # per epoch

    @property
    def passes(self) -> float:
        return self.samples / self.rows


def epoch_counts(rows: list[int], weights: list[float]) -> list[int]:
    """Samples per epoch for each source: shares of sum(rows) proportional to the weights, adding up exactly."""
    total, wsum = sum(rows), sum(weights)
    exact = [total * w / wsum for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(rows)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def pick(rows: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` row indices of a source with `rows` rows: whole passes, then a seeded subset without repeats."""
    whole, rest = divmod(count, rows)
    parts = [np.arange(rows)] * whole + [np.sort(rng.permutation(rows)[:rest])]
    return np.concatenate(parts).astype(np.int64)


def mix(parts: list, names: list[str], weights: list[float | None], seed: int):
    """The sources (`datasets.Dataset`s) as one data set of an epoch's samples, and the MixShare of each.
    All weights None: plain concatenation. Some but not all None: a ConfigError."""
    import datasets

    rows = [len(p) for p in parts]
    if all(w is None for w in weights):
        shares = [MixShare(n, r, 1.0, r) for n, r in zip(names, rows)]
        return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), shares
    missing = [n for n, w in zip(names, weights) if w is None]
    if missing:
        raise ConfigError(f"data source {missing[0]!r} has no weight while others have one: give every source of "
                          f"the list a weight, or none")
    counts = epoch_counts(rows, weights)
    rng = np.random.default_rng([seed, _MIX])
    picked = [p.select(pick(r, k, rng)) for p, r, k in zip(parts, rows, counts) if k > 0]
    shares = [MixShare(n, r, float(w), k) for n, r, w, k in zip(names, rows, weights, counts)]
    return datasets.concatenate_datasets(picked), shares


def held_out_count(split: float | int, total: int, what: str) -> int:
    """data.eval_split as a number of records out of `total`: a fraction (0 < f < 1) or a count (>= 1)."""
    count = round(split * total) if isinstance(split, float) else int(split)
    if not 1 <= count < total:
        raise ConfigError(f"config key 'data.eval_split': {split} of {total} training records in {what} leaves "
                          f"{'no eval record' if count < 1 else 'no training record'}")
    return count


def hold_out(parts: list, split: float | int, seed: int, what: str) -> tuple[list, object]:
    """(training parts without the held-out rows, the held-out rows as one data set), both in file order."""
    import datasets

    rows = [len(p) for p in parts]
    total = sum(rows)
    chosen = np.random.default_rng([seed, _SPLIT]).permutation(total)[: held_out_count(split, total, what)]
    held = np.zeros(total, dtype=bool)
    held[chosen] = True
    train, evals, start = [], [], 0
    for p, r in zip(parts, rows):
        mask = held[start: start + r]
        train.append(p.select(np.flatnonzero(~mask)))
        if mask.any():
            evals.append(p.select(np.flatnonzero(mask)))
        start += r
    return train, datasets.concatenate_datasets(evals)


def describe(shares: list[MixShare]) -> str:
    """One line per source: rows, weight, samples per epoch, share of the epoch, passes over the source."""
    total = sum(s.samples for s in shares)
    return "\n".join(f"  {s.name}: {s.rows} rows, weight {s.weight:g} -> {s.samples} samples an epoch "
                     f"({100 * s.samples / total:.1f}%, {s.passes:.2f} passes)" for s in shares)

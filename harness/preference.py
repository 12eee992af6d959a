"""Preference training (loss.mode=preference; docs/preference.md): sequence log-probs, the reference model's
log-probs computed once before training, the step's scale and the evaluation of pairs; the mode's micro-step is
harness/modes/preference.py's.

A micro-batch of n pairs is one batch of 2n rows (the chosen sequences, then the rejected ones: harness.data.pairs),
run in one forward pass. The output head returns per-position log-probs of the labels instead of logits
(`SequenceLogps`, through the model's wrappers as the chunked generative loss does): the logits of one chunk of
positions exist at a time, and each chunk is recomputed in the backward pass (torch.utils.checkpoint), so no
[2n, T, V] tensor is ever kept, once the pass's log-probs over the vocabulary would take more than 64 MiB (below
that they are kept: no recomputation). The row sums over the completion tokens are the sequence log-probs.

Scale: the loss of a step is the mean over the step's pairs on every process (plus, for ORPO, the NLL of the chosen
completions per token of the step); a micro-batch back-propagates its sums times W * A / (pairs of the step), as the
generative token averaging does (harness/losses.py), so any split of the global batch gives the same update.

The reference model (dpo, ipo) is the model as it starts: its log-probs of every pair are computed before the first
step (before a resumed run loads its checkpoint), kept in <output_dir>/reference_logps.pt with the data and model
fingerprint (a resumed run reads them back), and put in each batch by the collator. Under LoRA the starting adapter
is zero, so this is the base model; no second model is held.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness import losses
from harness.chunked_loss import ChunkedHeadLoss, head_params
from harness import IGNORE_INDEX
from harness.data.samples import model_inputs
from harness.state import preference_figures
from harness.distributed.collectives import on_main
from harness.errors import HarnessError, one_line
from harness.files import disk_full

REFERENCE_FILE = "reference_logps.pt"
# token_logps keeps the head's chunks for the backward pass (no recomputation: the head's forward pass again, time
# spent where memory is not short) while the pass's fp32 log-probs over the vocabulary (what autograd keeps of them)
# take at most this; above it each chunk is recomputed. At most what zero-plan counts for one chunk of the head
# (1,024 x vocab x 10 B; harness/tools/rl_plan.py: the output head always in chunks) for a vocabulary of 6,554 or more
KEEP_LOGPS_BYTES = 64 * 2**20


# ----------------------------------------------------------------------------------------------- sequence log-probs


def _chunk_logps(h, weight, bias, targets, softcap):
    logits = F.linear(h, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = targets != IGNORE_INDEX
    picked = logits.log_softmax(-1).gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                chunk_size: int = 1024, softcap: float | None = None,
                scored: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] log p(labels[:, t + 1] | ..t) at position t (0 where the label is IGNORE_INDEX and at the last
    position), from the final hidden states, chunk_size positions at a time; with gradients each chunk is
    recomputed in the backward pass (its logits are not kept) when the pass's fp32 log-probs would take more than
    KEEP_LOGPS_BYTES (64 MiB), else kept for it. `scored`: the flat indices (into B x T) of the
    positions whose next label is not IGNORE_INDEX (`scored_positions`): only those go through the head (TRL's
    logits_to_keep, without the prompt and padding positions it keeps); None: every position. `targets` (with
    `scored`, which may then repeat a position): the token each scored position is scored on, in place of the next
    labels; the result is then [1, len(scored)], one log-prob per entry."""
    given = targets is not None
    flat = hidden.reshape(-1, hidden.shape[-1])
    if not given:
        targets = next_labels(labels).reshape(-1)
    if scored is not None:
        flat = flat.index_select(0, scored)
        targets = targets if given else targets.index_select(0, scored)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and flat.shape[0] * weight.shape[0] * 4 > KEEP_LOGPS_BYTES
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        args = (flat[start:start + chunk_size], weight, bias, targets[start:start + chunk_size], softcap)
        parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False) if recompute else _chunk_logps(*args))
    if not parts:  # no scored position (every answer of an rl micro-batch masked): none, still in the graph, so
        parts = [_chunk_logps(flat[:0], weight, bias, targets[:0], softcap)]  # the pass back-propagates zeros
    picked = torch.cat(parts)
    if given:
        return picked.view(1, -1)
    if scored is None:
        return picked.view(labels.shape)
    return picked.new_zeros(labels.numel()).index_copy(0, scored, picked).view(labels.shape)


def next_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, T]: at position t the label t + 1 (IGNORE_INDEX at the last position), what position t is scored on."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat indices (into labels' B x T) of the positions t whose label t + 1 is trained: token_logps' `scored`.
    Computed where the labels are built (on the host: no wait for the device)."""
    return (next_labels(labels).reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


class SequenceLogps(ChunkedHeadLoss):
    """While active the output head returns `token_logps` ([B, T]) in place of the logits; `result(out)` gives
    (sequence log-probs [B], completion tokens [B])."""

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1 or hidden.shape[:2] != self.labels.shape:
            raise RuntimeError("SequenceLogps: the output head must run once, on every position")
        weight, bias = head_params(self.head)
        return token_logps(hidden, weight, self.labels, bias, self.chunk_size, self.softcap)

    def result(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        per_token, _ = super().result(out)
        return per_token.sum(1), (self.labels[:, 1:] != IGNORE_INDEX).sum(1)


def sequence_logps(model, batch: dict, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence log-probs [2n] in fp32, completion tokens [2n]) of a pair batch, in one forward pass."""
    with SequenceLogps(model, batch["labels"], chunk_size=chunk_size) as head:
        out = model(**model_inputs(batch), use_cache=False)
    return head.result(out)


def pair_terms(cfg_loss, logps: torch.Tensor, counts: torch.Tensor, batch: dict):
    """(per-pair losses, chosen rewards, rejected rewards, chosen NLL sum, chosen tokens) of one pair batch. A
    stand-in (no pair_index: the filling of an epoch's last round, harness/data/loaders.without_padding) gives no
    pair and zeros that keep the backward pass connected to the model (no loss of its ignored labels: 0 / 0)."""
    n = logps.shape[0] // 2
    if "pair_index" in batch and batch["pair_index"].shape[0] == 0:
        none = logps[:0]
        return none, none.detach(), none.detach(), -none.sum(), counts[:0].sum()
    ref = batch.get("ref_logps")
    needs_ref = cfg_loss.preference in ("dpo", "ipo")
    if needs_ref and ref is None:
        raise RuntimeError("loss.preference needs the reference log-probs (attach_reference) in the batch")
    per_pair, rc, rr = losses.preference_loss(cfg_loss, logps[:n], logps[n:], counts[:n], counts[n:],
                                              ref[:n] if needs_ref else None, ref[n:] if needs_ref else None)
    return per_pair, rc, rr, -logps[:n].sum(), counts[:n].sum()


def step_scale(accelerator, world: int, accum: int, batches: list[dict]) -> torch.Tensor:
    """[W A / pairs of the step, W A / chosen completion tokens of the step] (one all-reduce)."""
    local = torch.stack([torch.stack([torch.tensor(b["pair_index"].shape[0], device=b["labels"].device),
                                      (b["labels"][: b["pair_index"].shape[0], 1:] != IGNORE_INDEX).sum()])
                         for b in batches]).sum(0)
    total = accelerator.reduce(local.to(accelerator.device), "sum").double()
    return (world * accum / total.clamp(min=1)).float()


# ----------------------------------------------------------------------------------------------- shards of a data set


def _shard_batches(accelerator, loader):
    """(batch or None, real) of process r: rows r, r + W, ... in batches of the loader's size; a process with fewer
    batches than the others runs its first pair again (`real` False) so that every process runs every forward."""
    world, rank, size, ds = accelerator.num_processes, accelerator.process_index, loader.batch_size, loader.dataset
    rows = list(range(rank, len(ds), world))
    for i in range(math.ceil(math.ceil(len(ds) / world) / size)):
        part = rows[i * size:(i + 1) * size]
        samples = [ds[j] for j in (part or [0])]
        yield {k: v.to(accelerator.device) for k, v in loader.collate_fn(samples).items()}, bool(part)


@torch.no_grad()
def evaluate_preference(accelerator, model, loader, cfg_loss, chunk_size: int) -> dict:
    """eval_loss and eval_rewards/* over the eval pairs, each pair counted once whatever the process count."""
    names = ("pref_sum", "pref_pairs", "nll_sum", "nll_count", "reward_chosen_sum", "reward_rejected_sum",
             "reward_correct")
    totals = torch.zeros(len(names), dtype=torch.float64, device=accelerator.device)
    model.eval()
    for batch, real in _shard_batches(accelerator, loader):
        logps, counts = sequence_logps(model, batch, chunk_size)
        per_pair, rc, rr, nll, tokens = pair_terms(cfg_loss, logps, counts, batch)
        if real:
            totals += torch.stack([t.double() for t in (per_pair.sum(), torch.tensor(per_pair.shape[0]).to(nll),
                                                        nll, tokens.to(nll), rc.sum(), rr.sum(), (rc > rr).sum())])
    model.train()
    totals = accelerator.reduce(totals, "sum").tolist()
    return preference_figures(dict(zip(names, totals)), cfg_loss.preference == "orpo", prefix="eval_")


# ----------------------------------------------------------------------------------------------- the reference


def fingerprint(m, t, ds) -> str:
    """The data's token ids and the model that scores them (name, config, precision, seed, LoRA; `m`: cfg.model,
    `t`: cfg.train)."""
    h = hashlib.sha256(json.dumps([m.name_or_path, m.config, m.random_init, t.seed,
                                   t.precision, m.quantization], sort_keys=True,
                                  default=str).encode())
    for column in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
        h.update(json.dumps(list(ds[column])).encode())
    return h.hexdigest()


@torch.no_grad()
def reference_logps(accelerator, model, loader, chunk_size: int) -> torch.Tensor:
    """[pairs, 2] (chosen, rejected) sequence log-probs of the model as it is, in eval mode, divided between the
    processes and gathered."""
    model.eval()
    mine = []
    for batch, real in _shard_batches(accelerator, loader):
        logps, _ = sequence_logps(model, batch, chunk_size)
        n = logps.shape[0] // 2
        index = batch["pair_index"] if real else torch.full_like(batch["pair_index"], -1)
        mine.append(torch.cat([index.double().unsqueeze(1), logps[:n].double().unsqueeze(1),
                               logps[n:].double().unsqueeze(1)], 1))
    model.train()
    local = torch.cat(mine) if mine else torch.zeros(0, 3, dtype=torch.float64, device=accelerator.device)
    # the last batches of the processes may differ in size: padded with index -1
    gathered = accelerator.gather(accelerator.pad_across_processes(local.contiguous(), dim=0, pad_index=-1)).cpu()
    out = torch.zeros(len(loader.dataset), 2, dtype=torch.float64)
    keep = gathered[:, 0] >= 0
    out[gathered[keep, 0].long()] = gathered[keep, 1:]
    return out


def stored_reference(path: Path, say=print) -> dict:
    """What <output_dir>/reference_logps.pt holds ({} where there is none). A file that cannot be read (cut short by a
    full disk, damaged) is said in one line and computed again, never a traceback: the values are the starting
    model's, which a run computes before loading its checkpoint."""
    if not path.exists():
        return {}
    try:
        if not path.is_file():
            raise ValueError("a folder or other non-file is in its place")
        held = torch.load(path, weights_only=True)
        if not isinstance(held, dict):
            raise ValueError(f"holds a {type(held).__name__}, not a dict")
        for name, entry in held.items():  # {split: {"fingerprint": str, "logps": [pairs, 2]}}
            if not (isinstance(entry, dict) and isinstance(entry.get("fingerprint"), str)
                    and isinstance(entry.get("logps"), torch.Tensor) and entry["logps"].dim() == 2
                    and entry["logps"].shape[1] == 2):
                raise ValueError(f"another layout: its {name!r} entry is not {{'fingerprint': str, 'logps': "
                                 f"[pairs, 2] tensor}}")
        return held
    except Exception as e:  # noqa: BLE001 - any unreadable file is recomputed
        say(f"[harness] {path} cannot be read ({one_line(e, 200)}); the reference log-probs are computed again")
        return {}


def write_reference(path: Path, values: dict, say=print) -> None:
    """Save the reference log-probs whole or not at all (a temporary file renamed into place; none is left behind).
    A folder in the file's place is left alone with one line (a resume computes them again, from the starting
    model); a write that fails (a full disk) is a one-line HarnessError before anything is trained."""
    if path.exists() and not path.is_file():
        say(f"[harness] warning: {path} is not a file: the reference log-probs are not stored (a resume computes "
            f"them again); move it away to store them")
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(values, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # (torch.save reports ENOSPC as a RuntimeError 'unexpected pos ...')
        tmp.unlink(missing_ok=True)
        full = ": the disk is full" if disk_full(e, path.parent) else ""
        raise HarnessError(f"could not write {path} ({one_line(e, 200)}){full}; nothing was trained: free some "
                           f"space, then rerun") from None


def attach_reference(preference: str, m, t, parts, chunk_size: int) -> None:
    """For dpo / ipo (`preference`: loss.preference; `m`, `t`: cfg.model, cfg.train; `parts`: the build's
    harness.objective.Parts, its accelerator, prepared model, data and say): the reference log-probs of the training
    and eval pairs (the data's gen and gen_eval loaders), read from <output_dir>/
    reference_logps.pt when it holds this data and model's, else computed now (before any update) and saved;
    each loader's collator then puts them in its batches."""
    accelerator, model, say = parts.accelerator, parts.model, parts.say
    loaders = {"train": parts.data.gen, "eval": parts.data.gen_eval}
    if preference not in ("dpo", "ipo"):
        return
    path = Path(t.output_dir) / REFERENCE_FILE
    stored = stored_reference(path, say)
    fresh, changed = {}, False
    for name, loader in loaders.items():
        if loader is None:
            continue
        key = fingerprint(m, t, loader.dataset)
        held = stored.get(name)
        if held is not None and held.get("fingerprint") == key:
            values = held["logps"]
            say(f"[harness] reference log-probs of {len(values)} {name} pairs read from {path}")
        else:
            values, changed = reference_logps(accelerator, model, loader, chunk_size), True
            say(f"[harness] reference log-probs of {len(values)} {name} pairs computed (the model before training)")
        fresh[name] = {"fingerprint": key, "logps": values}
        loader.collate_fn.reference = values.float()
    if changed or set(fresh) != set(stored):  # (every process read the same file: the same decision)
        on_main(accelerator, lambda: write_reference(path, fresh, say))

"""The layout arithmetic of a resume under another number of processes: how the global batch, the data position
and the engine carry over (harness/checkpoint/resume.py reads the checkpoint and calls these; no I/O here).

A checkpoint records the layout it was written with (`layout_of`: processes, micro-batches, accumulation, ZeRO stage).
When a run resumes under another number of processes (8 GPUs became 4, 2 became 1):

- the batch: `fit` (before the Accelerator exists) keeps the run's global batch (micro-batch x accumulation x
  processes, for each data stream) by choosing `train.grad_accum`, and where it must a smaller micro-batch (never a
  larger one than the config's: memory); where no combination keeps it, a one-line ConfigError names the process
  counts that would, and how to change the batch knowingly (`train.global_batch_size`);
- the data: `positions` turns each stream's saved position (micro-batches per process) into rows of the epoch
  consumed by all processes together, then into micro-batches per process of the new layout (accelerate's seedable
  sampler orders the rows the same way for any process count);
- the optimizer: DDP and plain checkpoints hold the full state (accelerate loads it under any process count);
  DeepSpeed ZeRO's partitioned state goes through a universal checkpoint (harness/checkpoint/universal.py) when
  `needs_universal` says so.

The checkpoint itself is never changed: the next save is written in the new layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from harness.config.modes import facts
from harness.errors import ConfigError



@dataclass(frozen=True)
class Layout:
    """How a run divides its global batch: micro-batch sizes (generative rows, embedding queries) x accumulation x
    data-parallel processes, and the ZeRO stage (None: DDP or one plain process). `processes` counts data-parallel
    ranks: under sequence parallelism (train.sequence_parallel) the launch has processes x sequence_parallel."""

    processes: int
    micro_batch_size: int
    emb_micro_batch_size: int
    grad_accum: int
    zero_stage: Optional[int] = None
    weights: Optional[str] = None  # the trained parameters' dtype (train.weights): fp32, bf16, fp16; None: unrecorded
    sequence_parallel: int = 1  # processes per sequence-parallel group (checkpoints before it: 1)
    questions: Optional[int] = None  # loss.mode=rl: rl.questions_per_step, the question stream's global batch

    @property
    def world(self) -> int:
        """The launch's processes (ZeRO partitions its state over all of them)."""
        return self.processes * self.sequence_parallel

    def micro(self, stream: str) -> int:
        if stream == "gen" and self.questions:  # loss.mode=rl: questions a micro-batch (harness/rl/rollout.py)
            return self.questions // (self.processes * self.grad_accum)
        return self.emb_micro_batch_size if stream == "emb" else self.micro_batch_size

    def global_batch(self, stream: str) -> int:
        return self.micro(stream) * self.grad_accum * self.processes

    def as_dict(self) -> dict:
        return {"processes": self.processes, "micro_batch_size": self.micro_batch_size,
                "emb_micro_batch_size": self.emb_micro_batch_size, "grad_accum": self.grad_accum,
                "zero_stage": self.zero_stage, "weights": self.weights, "sequence_parallel": self.sequence_parallel,
                **({"questions": self.questions} if self.questions else {})}


def streams_of(loss_mode: str) -> tuple[str, ...]:
    mode = facts(loss_mode)
    return (("emb",) if mode.embeds else ()) + (("gen",) if mode.gen_rows else ())


def rl_questions(loss, rl) -> Optional[int]:
    """rl.questions_per_step for a mode whose stream is questions (loss.mode=rl: the question stream's global batch),
    else None (cfg.loss, cfg.rl)."""
    return rl.questions_per_step if facts(loss.mode).gen_rows == "questions" else None


def layout_of(t, world: int, zero_stage: Optional[int] = None, weights: Optional[str] = None,
              questions: Optional[int] = None) -> Layout:
    """The layout of `world` launched processes (data-parallel ranks: world / train.sequence_parallel; `t`:
    cfg.train; questions: `rl_questions`)."""
    sp = t.sequence_parallel
    return Layout(max(1, world // sp), t.micro_batch_size, t.emb_micro_batch_size, t.grad_accum, zero_stage, weights,
                  sp, questions)


def saved_layout(saved: Optional[dict], questions: Optional[int] = None) -> Optional[Layout]:
    """The layout a checkpoint was written with (its loop state's `layout`; None where it cannot be read).
    `questions` (loss.mode=rl): taken for a checkpoint of a harness that did not record them (rl.questions_per_step
    as configured now)."""
    if not (saved and saved.get("layout")):
        return None
    layout = Layout(**saved["layout"])
    return replace(layout, questions=questions) if questions and not layout.questions else layout


@dataclass
class Resize:
    """A resume under another layout: what the checkpoint was written with and what this attempt runs."""

    checkpoint: Path
    before: Layout
    after: Layout
    streams: tuple
    gather_negatives: bool = False  # loss.gather_negatives: the contrastive batch spans the data-parallel processes

    def contrastive_batch(self, layout: Layout) -> int:
        """Queries a contrastive loss compares (each query's in-batch negatives are the other queries' passages): the
        embedding micro-batch, times the data-parallel processes when their passages are gathered."""
        return layout.emb_micro_batch_size * (layout.processes if self.gather_negatives else 1)

    def describe(self) -> str:
        b, a = self.before, self.after
        # the launched processes first; under sequence parallelism the data-parallel ones (which divide the batch)
        # apart: SP 2 -> SP 1 on 2 processes is "2 process(es), data-parallel 1 -> 2", not "1 -> 2 process(es)"
        parts = [f"{b.world} -> {a.world} process(es)" if b.world != a.world else f"{a.world} process(es)"]
        if b.sequence_parallel != a.sequence_parallel or a.sequence_parallel > 1:
            if b.processes != a.processes:
                parts[0] += f" (data-parallel {b.processes} -> {a.processes})"
            else:
                parts[0] += f" ({a.processes} data-parallel)"
        if b.sequence_parallel != a.sequence_parallel:
            parts.append(f"train.sequence_parallel {b.sequence_parallel} -> {a.sequence_parallel}")
        if b.grad_accum != a.grad_accum:
            parts.append(f"train.grad_accum {b.grad_accum} -> {a.grad_accum}")
        for s in self.streams:
            key = "train.emb_micro_batch_size" if s == "emb" else "train.micro_batch_size"
            if s == "gen" and a.questions:
                key = "questions a micro-batch"
            if b.micro(s) != a.micro(s):
                parts.append(f"{key} {b.micro(s)} -> {a.micro(s)}")
        kept = [f"{a.global_batch(s)} {unit(s, a)}" for s in self.streams]
        same = all(a.global_batch(s) == b.global_batch(s) for s in self.streams)
        # another process count changes the batch only through train.global_batch_size (loss.mode=rl:
        # rl.questions_per_step, on any count); the same count through the config's micro-batch sizes and
        # accumulation (named above)
        why = ", rl.questions_per_step" if a.questions else ", train.global_batch_size" if b.processes != a.processes \
            else ""
        parts.append(f"global batch {' + '.join(kept)} " + ("kept" if same else
                     "(was " + " + ".join(str(b.global_batch(s)) for s in self.streams) + f"{why})"))
        was, now = self.contrastive_batch(b), self.contrastive_batch(a)
        if "emb" in self.streams and was != now:
            parts.append(f"contrastive batch {was} -> {now} queries ({now / was:.2g}x the in-batch negatives: "
                         f"train.emb_micro_batch_size x data-parallel processes"
                         f"{' with loss.gather_negatives' if self.gather_negatives else ''})")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"checkpoint": str(self.checkpoint), "before": self.before.as_dict(), "after": self.after.as_dict(),
                "global_batch": {s: [self.before.global_batch(s), self.after.global_batch(s)] for s in self.streams},
                **({"contrastive_batch": [self.contrastive_batch(self.before), self.contrastive_batch(self.after)]}
                   if "emb" in self.streams else {})}


def unit(stream: str, layout: Layout) -> str:
    return "queries" if stream == "emb" else "questions" if layout.questions else "sequences"


def fit(t, loss_mode: str, gather_negatives: bool, path: Path, before: Optional[Layout], world: int,
        questions: Optional[int] = None):
    """(train section, Resize or None) for an attempt of `world` processes resuming checkpoint `path` written in the
    layout `before`: under another number of data-parallel processes (world / train.sequence_parallel), a config whose
    train.grad_accum (and where it must, micro-batch sizes) keep the checkpoint's global batch (train.global_batch_size, when set, is the batch asked for instead).
    train.micro_batch_size=auto chooses its own split of train.global_batch_size. `t`: cfg.train; loss_mode,
    gather_negatives: loss.mode, loss.gather_negatives; questions: `rl_questions` (loss.mode=rl: `fit_questions`)."""
    launched, world = world, max(1, world // t.sequence_parallel)  # from here: data-parallel ranks
    if before is None or before.processes == world:
        return t, None
    if questions:
        return fit_questions(t, path, before, world, questions)
    if t.micro_batch_size == "auto":
        return t, None
    streams = streams_of(loss_mode)
    targets = {s: before.global_batch(s) for s in streams}
    if t.global_batch_size and "gen" in streams:
        targets["gen"] = t.global_batch_size
    caps = {"gen": t.micro_batch_size, "emb": t.emb_micro_batch_size}
    accum = choose_accum(targets, caps, world)
    if accum is None:
        raise ConfigError(refusal(path, before, targets, caps, world))
    micro = {s: targets[s] // (accum * world) for s in streams}
    train = replace(t, grad_accum=accum, micro_batch_size=micro.get("gen", t.micro_batch_size),
                    emb_micro_batch_size=micro.get("emb", t.emb_micro_batch_size))
    return train, Resize(path, before, layout_of(train, launched), streams, gather_negatives)


def fit_questions(t, path: Path, before: Layout, world: int, questions: int):
    """fit for loss.mode=rl: the generation batch is rl.questions_per_step questions on any process count; the
    accumulation is the fewest that splits them into whole micro-batches of at most the checkpoint's questions a
    micro-batch (the answers' training pass known to fit), and of at most what this config's train.grad_accum gives
    on `world` processes where that is smaller."""
    before = before if before.questions else replace(before, questions=questions)
    cap = before.micro("gen")
    if questions % (world * t.grad_accum) == 0:
        cap = min(cap, questions // (world * t.grad_accum))
    accum = choose_accum({"gen": questions}, {"gen": cap}, world)
    if accum is None:
        counts = [p for p in range(1, 2 * max(world, before.processes) + 1)
                  if choose_accum({"gen": questions}, {"gen": cap}, p) is not None]
        raise ConfigError(f"config key 'rl.questions_per_step': the run's {questions} questions a generation batch "
                          f"({path.name}: {before.micro('gen')} a micro-batch x accumulation {before.grad_accum} x "
                          f"{before.processes} process(es)) do not split into whole micro-batches of at most {cap} "
                          f"questions x accumulation x {world} process(es); resume on "
                          f"{', '.join(map(str, counts)) or 'the original number of'} process(es), or change "
                          f"rl.questions_per_step knowingly")
    train = replace(t, grad_accum=accum)
    return train, Resize(path, before, layout_of(train, world, questions=questions), ("gen",))  # (rl: no SP)


def choose_accum(targets: dict, caps: dict, world: int) -> Optional[int]:
    """The fewest accumulation steps for which every stream's global batch splits into whole micro-batches no larger
    than the config's (the largest micro-batches that are known to fit), or None."""
    if any(g % world for g in targets.values()):
        return None
    per_process = {s: g // world for s, g in targets.items()}
    most = max(per_process.values())
    for accum in range(1, most + 1):
        if all(n % accum == 0 and n // accum <= caps[s] for s, n in per_process.items()):
            return accum
    return None


def refusal(path: Path, before: Layout, targets: dict, caps: dict, world: int) -> str:
    streams = tuple(targets)
    counts = [p for p in range(1, 2 * max(world, before.processes) + 1)
              if choose_accum(targets, caps, p) is not None]
    batch = " + ".join(f"{targets[s]} {'queries' if s == 'emb' else 'sequences'}" for s in streams)
    g = targets.get("gen", next(iter(targets.values())))
    near = sorted({max(world, g // world * world), (g // world + 1) * world})
    return (f"config key 'train.grad_accum': the run's global batch of {batch} per step ({path.name}: "
            f"{' / '.join(str(before.micro(s)) for s in streams)} x accumulation {before.grad_accum} x "
            f"{before.processes} process(es)) cannot be kept on {world} process(es) (no whole micro-batch of at most "
            f"{' / '.join(str(caps[s]) for s in streams)} x accumulation x {world} makes it); resume on "
            f"{', '.join(map(str, counts)) or 'the original number of'} process(es), or change the global batch "
            f"knowingly with train.global_batch_size (e.g. {' or '.join(map(str, near))})")


# ----------------------------------------------------------------------------------------------- the data position


def positions(saved_streams: dict, before: Optional[Layout], after: Layout, sizes: dict) -> tuple[dict, list[str]]:
    """Each stream's position {"epoch", "batches"} in the layout `after`, from the one saved under `before`: rows of
    the epoch consumed by all processes together (`samples`, saved with the position; older checkpoints:
    micro-batches x micro-batch x processes), as micro-batches per process of `after`. sizes: rows (or packed rows)
    an epoch per stream. Returns (positions, notes): a note where the rows do not divide into the new micro-batches
    (an epoch that began inside an optimizer step): the remainder is read again."""
    out, notes = {}, []
    for name, pos in saved_streams.items():
        if before is None or (before.micro(name) == after.micro(name) and before.processes == after.processes):
            out[name] = {"epoch": int(pos["epoch"]), "batches": int(pos["batches"])}
            continue
        rows = rows_read(pos, before, name, sizes[name])
        if rows >= sizes[name]:
            out[name] = {"epoch": pos["epoch"] + 1, "batches": 0}
            continue
        per_round = after.micro(name) * after.processes
        out[name] = {"epoch": pos["epoch"], "batches": rows // per_round}
        if rows % per_round:
            notes.append(f"{name}: the last {rows % per_round} of the {rows} rows read in epoch {pos['epoch']} do not "
                         f"fill a round of {after.processes} x {after.micro(name)}: they are read again")
    return out, notes


def carry_over(path: Path, saved: dict, after: Layout, streams: tuple, sizes: dict, universal: bool,
               gather_negatives: bool = False) -> tuple[dict, Optional[Resize], str]:
    """After loading checkpoint `path` (loop state `saved`) into the layout `after`: (each stream's position in
    `after`, the Resize when the layout changed (else None), what the resume line adds)."""
    before = saved_layout(saved, after.questions)
    if after.questions and before is not None and not saved["layout"].get("questions"):
        # loss.mode=rl, a checkpoint of a harness that counted its `samples` with train.micro_batch_size: from
        # `batches` and the questions a micro-batch instead
        saved = {**saved, "streams": {n: {k: v for k, v in p.items() if k != "samples"}
                                      for n, p in saved["streams"].items()}}
    moved, notes = positions(saved["streams"], before, after, sizes)
    if before is None or (before.processes, before.grad_accum, before.sequence_parallel) == (
            after.processes, after.grad_accum, after.sequence_parallel) and all(
            before.micro(s) == after.micro(s) for s in streams):
        return moved, None, ""
    resize = Resize(path, before, after, streams, gather_negatives)
    rows = ", ".join(f"{n} {rows_read(saved['streams'][n], before, n, sizes[n])} rows of epoch "
                     f"{saved['streams'][n]['epoch']}" for n in streams)
    optimizer = ("ZeRO optimizer state repartitioned through a universal checkpoint (deepspeed ds_to_universal)"
                 if universal else "optimizer state loaded whole")
    line = (f"; layout changed: {resize.describe()}; data position by rows read ({rows}); {optimizer}"
            + "".join(f"; note: {n}" for n in notes))
    return moved, resize, line


def rows_read(pos: dict, layout: Layout, name: str, size: int) -> int:
    """Rows of the epoch all processes have read at stream position `pos` (its `samples`, or for a checkpoint of an
    older harness micro-batches x micro-batch x processes of `layout`), at most the epoch's `size`."""
    return min(int(pos.get("samples", pos["batches"] * layout.micro(name) * layout.processes)), size)


def samples_read(streams: dict, layout: Layout, sizes: dict) -> dict:
    """The positions with `samples`: rows of the epoch consumed by all processes (what `positions` converts)."""
    return {n: {**p, "samples": rows_read({"batches": p["batches"]}, layout, n, sizes[n])} for n, p in streams.items()}


# ----------------------------------------------------------------------------------------------- ZeRO's optimizer


def needs_universal(before: Optional[Layout], processes: int, zero_stage: Optional[int]) -> bool:
    """A DeepSpeed checkpoint loaded by another number of (launched) processes: its partitioned optimizer state goes
    through a universal checkpoint."""
    return zero_stage is not None and before is not None and before.world != processes


def check_same_engine(path: Path, before: Optional[Layout], zero_stage: Optional[int]) -> None:
    """A checkpoint resumes under the engine and ZeRO stage it was written with (any process count): DDP / plain
    checkpoints (full model and optimizer state) and DeepSpeed ones (the engine's partitioned files) do not load into
    each other, and DeepSpeed 0.19's universal loader does not move ZeRO-3 state to stage 1 or 2 (measured: an
    AssertionError in its loader). One line naming the stage to launch with."""
    if before is None or before.zero_stage == zero_stage:
        return
    written = before.zero_stage  # None: DDP / plain

    def name(stage) -> str:
        return "DDP / one process without DeepSpeed" if stage is None else f"DeepSpeed ZeRO-{stage}"

    flag = 0 if written is None else written
    raise ConfigError(f"config key 'train.resume': {path} was written under {name(written)} and this launch runs "
                      f"{name(zero_stage)}: resume under the stage it was written with (launch/train.sh --zero {flag} "
                      f"or its accelerate config), on any number of processes")


def check_same_weights(path: Path, before: Optional[Layout], weights: str) -> None:
    """A checkpoint resumes with the weights dtype it was trained with (train.weights): DeepSpeed's bf16 mode and its
    torch_autocast keep the optimizer state in different files (`bf16_zero_pp_rank_*` vs `zero_pp_rank_*`) and
    formats."""
    written = before.weights if before is not None else None
    if written not in ("fp32", "bf16") or weights not in ("fp32", "bf16") or written == weights:
        return
    raise ConfigError(f"config key 'train.weights': {path} was trained with {written} weights and this run has "
                      f"{weights} weights (their optimizer states differ): resume with train.weights={written}")



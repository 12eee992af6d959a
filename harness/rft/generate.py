"""`harness rft generate`: sample many answers per question, keep the verified ones, write chat records.

    harness rft generate configs/rft-tiny.yaml [--model PATH] [--stop-after N] [section.key=value ...]
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m harness.rft generate configs/rft-tiny.yaml

Each process takes every world-th remaining question of the task's train split and samples `rft.oversample`
answers to each with the engine rft.engine names: continuous (harness/rft/engine.py: sequences leave and enter the
batch as they end, a prompt prefilled once for its samples) or static (model.generate over batches of
`rft.questions_per_batch` questions, harness/rft/sampling.py). As soon as a question's samples have all ended the
process appends its JSON line to its own shard, `<output_dir>/shards/rank-R.jsonl` (flush + fsync): a question is
done once its line is there, so a restarted run (any process count) skips it. At the end rank 0 merges the shards
into `<output_dir>/rft.jsonl`, the kept answers as `{"messages": [user, assistant]}` records that `harness train`
reads directly (identical answers to one question kept once), `pairs.jsonl` (rft.pairs_per_question > 0: a verified
and a failed answer per record, TRL's preference format) and `<output_dir>/stats.json`.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from pathlib import Path
from typing import Optional

from harness.errors import ConfigError, HarnessError  # noqa: F401
from harness.rft.contract import Sampling, encode, text
from harness.rft.sampling import (Sampler, StaticEngine, load_engine, load_for_generation,  # noqa: F401
                                  make_engine, prompt_text, resolve_model_path)
from harness.rft.shards import (OUTPUT, PAIRS, SETTINGS, SHARDS, STATS, append_records, check_settings,  # noqa: F401
                                generation_settings, judge, merge, read_shards, repair_shard, write_lines)
from harness.distributed.processes import process_group_kwargs
from harness.distributed.collectives import on_main
from harness.rundir import lock
from harness.rft.tasks import build_task


def make_accelerator():
    """A plain Accelerator (no model is prepared: each process samples on its own); gloo when launched on CPU."""
    from accelerate import Accelerator

    return Accelerator(kwargs_handlers=process_group_kwargs())


@contextlib.contextmanager
def processes():
    """`make_accelerator()` for one command; on a clean end every process meets the others and the process group is
    destroyed before the interpreter exits. Left to the interpreter's exit, gloo's threads were torn down while the
    other rank was already gone: a rank aborted ('terminate called without an active exception', exit -6) after
    its work was done and written, and the launcher failed the command."""
    acc = make_accelerator()
    yield acc
    acc.wait_for_everyone()
    acc.end_training()


def describe(engine) -> str:
    """The engine in the start line: its name, and the sequences in flight or per generate() call."""
    if isinstance(engine, StaticEngine):
        return f"static engine, {engine.per_call} questions per batch, {engine.sampler.micro} sequences per call"
    if engine.name == "continuous":
        return f"continuous engine, {engine.max_slots} sequences in flight at most"
    return f"{engine.name} engine"


def run(r, model: Optional[str], stop_after: int = 0) -> Optional[dict]:
    """Generate for every question of the train split not yet done; returns the merged stats on rank 0 (None when
    stopped early by `stop_after`: that many x rft.questions_per_batch questions per process). The main process
    holds `<rft.output_dir>/shards/.lock` meanwhile (harness/rundir/lock.py): one generation per folder, or two
    would both sample every question. `r`: cfg.rft; model: --model, else model.name_or_path."""
    if stop_after < 0:
        raise ConfigError(f"--stop-after: must be >= 0 (0: sample every question left; N: stop after N batches of "
                          f"rft.questions_per_batch questions per process), got {stop_after}")

    with processes() as acc:
        held = on_main(acc, lambda: lock.acquire(Path(r.output_dir) / SHARDS, acc.print, key="rft.output_dir"))
        try:
            return _run(r, model, acc, stop_after)
        finally:
            if acc.is_main_process:
                lock.release(held)


def _run(r, model: Optional[str], acc, stop_after: int) -> Optional[dict]:
    """`run`'s work (`r`: cfg.rft; model: --model, else model.name_or_path)."""
    from tqdm.auto import tqdm

    task = build_task(r)
    questions = task.split("train")
    say = acc.print
    out = Path(r.output_dir)
    shard = out / SHARDS / f"rank-{acc.process_index}.jsonl"
    check_settings(out / SHARDS / SETTINGS, generation_settings(r, model), write=acc.is_main_process)
    acc.wait_for_everyone()
    repair_shard(shard)
    acc.wait_for_everyone()
    done = {rec["qid"] for rec in read_shards(out / SHARDS)}
    acc.wait_for_everyone()  # every process has read the same files before anyone appends
    remaining = [q for q in questions if q.qid not in done]
    mine = remaining[acc.process_index::acc.num_processes]
    todo = mine[:stop_after * r.questions_per_batch] if stop_after else mine
    engine, tok = load_engine(r, model, acc.device, say, task, remaining)  # (every process: all of them)
    say(f"[rft] {len(questions)} questions, {len(done)} already done, {len(remaining)} to sample on "
        f"{acc.num_processes} process(es) x {r.oversample} samples (temperature {r.temperature}, "
        f"max_new_tokens {r.max_new_tokens}, {describe(engine)}, device {acc.device}, "
        f"{engine.dtype})")
    bar = tqdm(total=len(todo), desc="rft generate", disable=not acc.is_main_process, dynamic_ncols=True)
    tally = {"correct": 0, "samples": 0, "t0": time.perf_counter()}

    def on_done(i: int, completions: list) -> None:  # a question's samples have all ended: its line, at once
        responses = [text(tok, c, eos) for c in completions]
        rec = judge(task, todo[i], responses, r.keep_per_question)
        append_records(shard, [rec])
        tally["correct"] += rec["correct"]
        tally["samples"] += rec["samples"]
        bar.update(1)
        bar.set_postfix(success=f"{tally['correct'] / max(tally['samples'], 1):.1%}",
                        seq_s=f"{tally['samples'] / max(time.perf_counter() - tally['t0'], 1e-9):.1f}")

    eos = set(engine.eos)
    try:  # (an error ends the bar's line first: its one line is not printed after the bar)
        if todo:  # each sample (continuous) or batch (static: its first question's) seeded from rft.seed, the
            # question's id and the sample's index: a restart draws what the uninterrupted run would (continuous)
            seeded = Sampling(r.temperature, r.top_p,
                              seed=lambda i, j: zlib.crc32(f"{r.seed}/{todo[i].qid}/{j}".encode()))
            engine.generate(encode(tok, [prompt_text(task, q, tok) for q in todo]), r.oversample, seeded,
                            on_done=on_done)
    finally:
        bar.close()
    from accelerate.utils import gather_object

    st = engine.stats
    left = len(todo) < len(mine)
    speed = gather_object([(st.sequences, st.seconds, st.tokens, left)])  # every process takes the same decision
    seqs, secs = sum(x[0] for x in speed), max((x[1] for x in speed), default=0.0)
    if any(x[3] for x in speed):
        say(f"[rft] stopped after {stop_after} batch(es) per process; run the same command again to continue")
        return None
    stats = None
    if acc.is_main_process:
        stats = merge(task, questions, out, r.pairs_per_question)
        stats.update(engine=engine.name, sequences_this_run=seqs, sequences_per_s=seqs / max(secs, 1e-9),
                     new_tokens_per_s=sum(x[2] for x in speed) / max(secs, 1e-9), processes=acc.num_processes,
                     slot_waste=round(st.waste(), 4) if st.slot_steps else None)
        write_lines(out / STATS, stats)
        pairs = f", {stats['preference_pairs']} preference pairs" if r.pairs_per_question else ""
        say(f"[rft] done: {stats['questions_covered']}/{stats['questions']} questions covered, "
            f"{stats['kept_examples']} examples kept ({stats['questions_with_kept']} questions with at least one)"
            f"{pairs}, success rate {stats['success_rate']:.1%}, answer rate {stats['answer_rate']:.1%}, "
            f"{stats['duplicates_dropped']} duplicate answers dropped, "
            + (f"{stats['sequences_per_s']:.1f} sequences/s" if seqs else "nothing sampled this time (every question's "
               "answers were in the shards)") + f" -> {out / OUTPUT}")
    acc.wait_for_everyone()
    return stats

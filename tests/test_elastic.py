"""Resume on another number of processes (harness/checkpoint/layout.py, resume.py, universal.py): 2 processes -> 1 and 1 -> 2 under DDP, ZeRO-2
and ZeRO-3 (real DeepSpeed on its CPU accelerator) keep the global batch, read every row exactly once (counted through
HARNESS_TRACE_ROWS, step by step against an uninterrupted run) and end at the uninterrupted run's weights; where the
global batch cannot be kept the resume is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from harness.checkpoint import layout as elastic, resume, universal
from harness_launch import FAST, ROOT, final_weights, max_abs_diff, report, run_train

pytestmark = pytest.mark.usefixtures("all_cpus")  # starts its own launchers: conftest.py

STEPS, STOP = 4, 2
# global batch 16 = micro-batch 4 x accumulation 2 x 2 processes = 4 x 4 x 1
BASE = FAST + [f"train.max_steps={STEPS}", "train.micro_batch_size=4", f"train.save_every_steps={STOP}",
               "train.eval_at_start=false", "train.save_every_minutes=0"]
ACCEL = {"ddp": (None, "ddp"), "zero2": ("zero2", "zero2"), "zero3": ("zero3", "zero3")}  # (1 process, 2 processes)
TOLERANCE = {"ddp": 1e-5, "zero2": 1e-5, "zero3": 1e-5}


def traced(out: Path, overrides: list[str], nproc: int, kind: str, trace: Path, **kw):
    trace.mkdir(parents=True, exist_ok=True)
    one, two = ACCEL[kind]
    return run_train([*BASE, f"train.output_dir={out}", *overrides], nproc=nproc, accel=one if nproc == 1 else two,
                     extra_env={"HARNESS_TRACE_ROWS": str(trace)}, **kw)


def rows_by_step(*traces: Path) -> dict[int, Counter]:
    """{step: Counter of row digests read by all processes}, over the attempts' trace folders."""
    steps: dict[int, Counter] = {}
    for trace in traces:
        for f in sorted(trace.glob("rows-*.jsonl")):
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                steps.setdefault(rec["step"], Counter()).update(rec["gen"])
    return steps


@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_resume_on_another_process_count(tmp_path, kind):
    # the uninterrupted run: one process, accumulation 4; its step-2 checkpoint is the 1 -> 2 case's start
    ref = tmp_path / "ref"
    traced(ref, ["train.grad_accum=4"], 1, kind, tmp_path / "t-ref")
    expected = rows_by_step(tmp_path / "t-ref")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert all(sum(c.values()) == 16 for c in expected.values())
    everything = sum(expected.values(), Counter())
    assert sum(everything.values()) == STEPS * 16 and max(everything.values()) == 1  # 64 distinct rows of 400

    # 2 -> 1: two processes (accumulation 2) stop at step 2; the same command on one process goes on
    a = tmp_path / "a"
    traced(a, ["train.grad_accum=2", f"train.stop_at_step={STOP}"], 2, kind, tmp_path / "t-a1")
    proc = traced(a, ["train.grad_accum=2"], 1, kind, tmp_path / "t-a2")
    assert "layout changed: 2 -> 1 process(es), train.grad_accum 2 -> 4, global batch 16 sequences kept" in proc.stdout
    rep = report(a)
    assert rep["world_size"] == 1 and rep["grad_accum"] == 4 and rep["steps"] == STEPS
    assert rep["resumed_layout"]["global_batch"] == {"gen": [16, 16]}
    assert rep["resumed_layout"]["before"]["processes"] == 2 and rep["resumed_layout"]["after"]["grad_accum"] == 4
    assert rows_by_step(tmp_path / "t-a1", tmp_path / "t-a2") == expected  # each step read the same rows, once

    # 1 -> 2: the uninterrupted run's step-2 checkpoint, continued by two processes (accumulation 4 -> 2)
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / f"step-{STOP}", b / "checkpoints" / f"step-{STOP}")
    proc = traced(b, ["train.grad_accum=4"], 2, kind, tmp_path / "t-b")
    assert "layout changed: 1 -> 2 process(es), train.grad_accum 4 -> 2, global batch 16 sequences kept" in proc.stdout
    if kind != "ddp":
        assert "repartitioned through a universal checkpoint" in proc.stdout
        assert not (b / universal.STAGING).exists()  # the universal view is removed after loading
    rep = report(b)
    assert rep["world_size"] == 2 and rep["grad_accum"] == 2 and rep["zero_stage"] == (None if kind == "ddp" else
                                                                                        int(kind[-1]))
    resumed = rows_by_step(tmp_path / "t-b")
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1))
    assert resumed == {s: expected[s] for s in resumed}

    if kind == "zero2":  # a checkpoint resumes under its own engine and stage: one line naming it
        c = tmp_path / "c"
        shutil.copytree(ref / "checkpoints" / f"step-{STOP}", c / "checkpoints" / f"step-{STOP}")
        proc = run_train([*BASE, "train.grad_accum=4", f"train.output_dir={c}"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert (f"harness: error: config key 'train.resume': {c}/checkpoints/step-{STOP} was written under DeepSpeed "
                f"ZeRO-2 and this launch runs DDP / one process without DeepSpeed: resume under the stage it was "
                f"written with (launch/train.sh --zero 2") in proc.stderr

    want = final_weights(ref)
    for run in (a, b):
        diff = max_abs_diff(final_weights(run), want)
        print(f"{kind} {run.name}: final weights max |diff| vs uninterrupted = {diff:.2e}")
        assert diff <= TOLERANCE[kind], (kind, run.name, diff)


def test_a_global_batch_that_cannot_be_kept_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    # global batch 3 = 3 x 1 x 1: no whole micro-batch x accumulation x 2 processes makes 3
    run_train([*FAST, "train.max_steps=2", "train.micro_batch_size=3", "train.save_every_steps=1",
               "train.stop_at_step=1", "train.eval_at_start=false", f"train.output_dir={out}"])
    proc = run_train([*FAST, "train.max_steps=2", "train.micro_batch_size=3", f"train.output_dir={out}"], nproc=2,
                     check=False)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr  # (the launcher's own
    # ChildFailedError report follows any failed rank)
    assert ("the run's global batch of 3 sequences per step (step-1: 3 x accumulation 1 x 1 process(es)) cannot be "
            "kept on 2 process(es)") in errors[0]
    assert "resume on 1, 3 process(es)" in errors[0] and "train.global_batch_size (e.g. 2 or 4)" in errors[0]
    assert not (out / "checkpoints" / "step-2").exists()


# ----------------------------------------------------------------------------------------------- the arithmetic


def test_choose_accum_keeps_the_micro_batch_where_it_can():
    assert elastic.choose_accum({"gen": 16}, {"gen": 4}, 1) == 4  # 2 x (4 x 2) -> 1 x (4 x 4)
    assert elastic.choose_accum({"gen": 16}, {"gen": 4}, 4) == 1  # -> 4 x (4 x 1)
    assert elastic.choose_accum({"gen": 8}, {"gen": 4}, 8) == 1  # micro-batch 1
    assert elastic.choose_accum({"gen": 12}, {"gen": 4}, 2) == 2  # 6 a process: 3 x 2 (4 does not divide 6)
    assert elastic.choose_accum({"gen": 3}, {"gen": 3}, 2) is None
    # unified: both streams share the accumulation
    assert elastic.choose_accum({"gen": 16, "emb": 32}, {"gen": 4, "emb": 8}, 1) == 4
    assert elastic.choose_accum({"gen": 16, "emb": 24}, {"gen": 4, "emb": 8}, 2) == 2  # 8 and 12 a process: 4, 6


def test_positions_count_rows_not_micro_batches():
    two = elastic.Layout(2, 4, 8, 2)
    one = elastic.Layout(1, 4, 8, 4)
    moved, notes = elastic.positions({"gen": {"epoch": 1, "batches": 6, "samples": 48}}, two, one, {"gen": 400})
    assert moved == {"gen": {"epoch": 1, "batches": 12}} and not notes
    moved, _ = elastic.positions({"gen": {"epoch": 0, "batches": 12}}, one, two, {"gen": 400})  # no `samples`
    assert moved == {"gen": {"epoch": 0, "batches": 6}}
    moved, _ = elastic.positions({"gen": {"epoch": 0, "batches": 50, "samples": 400}}, two, one, {"gen": 400})
    assert moved == {"gen": {"epoch": 1, "batches": 0}}  # the epoch was read to its end
    moved, notes = elastic.positions({"gen": {"epoch": 2, "batches": 3}}, one, two, {"gen": 400})
    assert moved == {"gen": {"epoch": 2, "batches": 1}} and "the last 4 of the 12 rows" in notes[0]
    same, _ = elastic.positions({"gen": {"epoch": 0, "batches": 5, "samples": 20}}, one, one, {"gen": 400})
    assert same == {"gen": {"epoch": 0, "batches": 5}}


# ----------------------------------------------------------------------------------------------- launch/train.sh


def _train_sh(*args: str, **env) -> subprocess.CompletedProcess:
    import os
    import sys

    keep = {k: v for k, v in os.environ.items() if k not in ("NUM_GPUS", "GPU_MEM_GB", "ZERO", "CUDA_VISIBLE_DEVICES",
                                                             "ACCELERATE_USE_CPU")}
    keep.update(HF_HUB_OFFLINE="1", PYTHON=sys.executable, PERSIST_DIR="none", TOKENIZERS_PARALLELISM="false",
                RETRY_DELAY="0", **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", "launch/train.sh", *args], cwd=ROOT, env=keep, capture_output=True, text=True,
                          timeout=300)


def test_train_sh_resumes_on_a_box_with_another_gpu_count_without_flags(tmp_path):
    """Two processes stop at step 2; launch/train.sh with the same arguments on this box (no GPU: one process)
    continues: the global batch kept, the rows of the uninterrupted run read once."""
    out, args = tmp_path / "run", [*BASE, "train.grad_accum=2"]
    traced(out, ["train.grad_accum=2", f"train.stop_at_step={STOP}"], 2, "ddp", tmp_path / "t1")
    (tmp_path / "t2").mkdir()
    proc = _train_sh("configs/default.yaml", *args, f"train.output_dir={out}", CUDA_VISIBLE_DEVICES="",
                     HARNESS_TRACE_ROWS=str(tmp_path / "t2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "layout changed: 2 -> 1 process(es), train.grad_accum 2 -> 4, global batch 16 sequences kept" in log
    assert report(out)["steps"] == STEPS and report(out)["grad_accum"] == 4
    steps = rows_by_step(tmp_path / "t1", tmp_path / "t2")
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(sum(c.values()) == 16 for c in steps.values())
    assert max(sum(steps.values(), Counter()).values()) == 1  # no row read twice


def test_train_sh_zero_auto_keeps_the_stage_of_the_checkpoints(tmp_path):
    out = tmp_path / "run"
    step = out / "checkpoints" / "step-5"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    layout = {"processes": 8, "micro_batch_size": 4, "emb_micro_batch_size": 8, "grad_accum": 1, "zero_stage": 2}
    (step / "harness_state.json").write_text(json.dumps({"step": 5, "streams": {}, "layout": layout}))
    proc = _train_sh("--dry-run", "configs/default.yaml", f"train.output_dir={out}", NUM_GPUS=4, GPU_MEM_GB=80)
    assert proc.returncode == 0, proc.stderr
    assert "--zero auto chose stage 0" in proc.stdout
    assert "resuming: keeping ZeRO stage 2, the stage of the run's checkpoints" in proc.stdout
    launch = next(ln for ln in proc.stdout.splitlines() if "harness.tools.launcher" in ln)
    assert "accelerate_configs/zero2.yaml" in launch and "--num_processes 4" in launch


def test_length_grouped_order_depends_on_the_global_batch_only():
    from dataclasses import replace

    from harness.config import load_config
    from harness.data.loaders import length_group

    cfg = load_config(str(ROOT / "configs" / "default.yaml"), ["train.emb_micro_batch_size=4", "train.grad_accum=2"])
    one = replace(cfg, train=replace(cfg.train, grad_accum=4))  # the same 16 queries a step on 1 process
    assert length_group(cfg.train, 2) == length_group(one.train, 1) == 32 * 16


def test_plan_fits_the_layout_splitting_both_streams_of_a_unified_run(tmp_path):
    from harness.config import load_config

    step = tmp_path / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    layout = {"processes": 2, "micro_batch_size": 4, "emb_micro_batch_size": 8, "grad_accum": 1, "zero_stage": None}
    (step / "harness_state.json").write_text(json.dumps({"step": 4, "streams": {}, "layout": layout}))
    cfg = load_config(str(ROOT / "configs" / "gritlm-tiny.yaml"),
                      [f"train.output_dir={tmp_path}", "train.micro_batch_size=4", "train.emb_micro_batch_size=8",
                       "train.grad_accum=1"])
    planned = resume.plan(cfg, 1)
    fitted, resize = planned.cfg, planned.resize  # 8 sequences + 16 queries a step on one process
    assert (fitted.train.micro_batch_size, fitted.train.emb_micro_batch_size, fitted.train.grad_accum) == (4, 8, 2)
    assert resize.describe() == ("2 -> 1 process(es), train.grad_accum 1 -> 2, global batch 16 queries + 8 sequences "
                                 "kept, contrastive batch 16 -> 8 queries (0.5x the in-batch negatives: "
                                 "train.emb_micro_batch_size x data-parallel processes with loss.gather_negatives)")
    fitted = resume.plan(cfg, 4).cfg  # 2 sequences + 4 queries a process: smaller micro-batches
    assert (fitted.train.micro_batch_size, fitted.train.emb_micro_batch_size, fitted.train.grad_accum) == (2, 4, 1)
    assert (resume.plan(cfg, 2).cfg, resume.plan(cfg, 2).resize) == (cfg, None)  # the same count: the config as it is
    with pytest.raises(Exception, match="cannot be kept on 3 process"):
        resume.plan(cfg, 3)


def test_the_resume_line_names_what_changed_the_batch():
    """On the same process count a changed global batch comes from the config's micro-batch or accumulation (named
    in the line), not from train.global_batch_size; on another count only that key changes it."""
    same = elastic.Resize(Path("ck"), elastic.Layout(2, 8, 8, 1), elastic.Layout(2, 4, 8, 1), ("gen",))
    assert same.describe() == "2 process(es), train.micro_batch_size 8 -> 4, global batch 8 sequences (was 16)"
    other = elastic.Resize(Path("ck"), elastic.Layout(2, 8, 8, 1), elastic.Layout(1, 8, 8, 4), ("gen",))
    assert other.describe() == ("2 -> 1 process(es), train.grad_accum 1 -> 4, global batch 32 sequences (was 16, "
                                "train.global_batch_size)")
    kept = elastic.Resize(Path("ck"), elastic.Layout(2, 8, 8, 1), elastic.Layout(1, 8, 8, 2), ("gen",))
    assert kept.describe().endswith("global batch 16 sequences kept")


def test_the_resume_line_counts_the_launched_processes_under_sequence_parallelism():
    """SP 2 -> SP 1 on 2 processes both times said "1 -> 2 process(es)" (the data-parallel ranks); the line now gives
    the launched processes and the data-parallel ones apart."""
    sp2, sp1 = elastic.Layout(1, 8, 8, 2, 3, sequence_parallel=2), elastic.Layout(2, 8, 8, 1, 3)
    assert elastic.Resize(Path("ck"), sp2, sp1, ("gen",)).describe() == (
        "2 process(es) (data-parallel 1 -> 2), train.sequence_parallel 2 -> 1, train.grad_accum 2 -> 1, global batch "
        "16 sequences kept")
    four = elastic.Layout(2, 8, 8, 1, 3, sequence_parallel=2)  # 4 processes in groups of 2 -> 2 processes, SP 2
    assert elastic.Resize(Path("ck"), four, sp2, ("gen",)).describe() == (
        "4 -> 2 process(es) (data-parallel 2 -> 1), train.grad_accum 1 -> 2, global batch 16 sequences kept")


def test_the_resume_line_says_when_the_contrastive_batch_changes():
    """With loss.gather_negatives the contrastive batch is the embedding micro-batch x the data-parallel processes:
    a unified run resumed from 2 processes on 1 (accumulation 1 -> 2, the global batch kept) compares each query with
    half the queries. The resume line says so and by how much, and report.json's resumed_layout records it."""
    before, after = elastic.Layout(2, 4, 32, 1), elastic.Layout(1, 4, 32, 2)
    resize = elastic.Resize(Path("ck"), before, after, ("emb", "gen"), gather_negatives=True)
    assert resize.describe() == (
        "2 -> 1 process(es), train.grad_accum 1 -> 2, global batch 64 queries + 8 sequences kept, contrastive batch "
        "64 -> 32 queries (0.5x the in-batch negatives: train.emb_micro_batch_size x data-parallel processes with "
        "loss.gather_negatives)")
    assert resize.as_dict()["contrastive_batch"] == [64, 32]
    alone = elastic.Resize(Path("ck"), before, after, ("emb", "gen"), gather_negatives=False)
    assert "contrastive" not in alone.describe() and alone.as_dict()["contrastive_batch"] == [32, 32]
    assert "contrastive" not in elastic.Resize(Path("ck"), before, after, ("gen",), True).describe()
    # what the resume prints (checkpoint.resume.restore passes loss.gather_negatives through)
    saved = {"layout": before.as_dict(), "streams": {"emb": {"epoch": 0, "batches": 2, "samples": 128},
                                                     "gen": {"epoch": 0, "batches": 2, "samples": 16}}}
    _, got, line = elastic.carry_over(Path("ck"), saved, after, ("emb", "gen"), {"emb": 1000, "gen": 1000},
                                      universal=False, gather_negatives=True)
    assert got.gather_negatives and "contrastive batch 64 -> 32 queries" in line, line

"""Sequence parallelism (train.sequence_parallel, harness/distributed/sequence.py), on CPU with real DeepSpeed.

The shard and the documents' mask by hand; the one-line refusals; and one set of runs of the default model on packed
rows of 1024 tokens (15 rows an epoch, 10 steps of micro-batch 1 x accumulation 2: across the epoch boundary):

- 1 process (the reference) against 2 processes with sequence parallel 2 under ZeRO-3 (and ZeRO-2, extended tier):
  the same loss at every step (relative 1e-5), and every row trained once (HARNESS_TRACE_ROWS: both processes of the
  group hold the reference's rows of each step, which they split by position);
- kill -9 of an SP 2 run after a checkpoint, resumed with SP 2: the uninterrupted run's final weights;
- the killed run's checkpoint resumed with SP 1 on the same 2 processes (2 data-parallel ranks): the global batch is
  kept (accumulation 2 -> 1), the rows of each step up to the epoch's end are the reference's and the losses too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.data import IGNORE_INDEX
from harness.distributed import sequence
from harness.errors import ConfigError
from harness_launch import (DEFAULT, FAST, ROOT, cpu_slots, final_weights, free_port, max_abs_diff, metrics, rel_close,
                            report, run_train)

STEPS = 10
BASE = [*FAST, "data.packing=true", "data.max_len=1024", "train.micro_batch_size=1", "train.grad_accum=2",
        f"train.max_steps={STEPS}", "train.eval_at_start=false", "train.save_every_minutes=0"]


# ----------------------------------------------------------------------------------------------- by hand


def test_shards_put_back_together_give_the_shifted_row():
    ids = torch.arange(1, 8).repeat(2, 1)  # width 7: padded to 8 for 2 shards
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos, "token_mask": torch.ones_like(ids)}
    parts = [sequence.shard(batch, r, 2) for r in range(2)]
    whole = {k: torch.cat([p[k] for p in parts], 1) for k in ("input_ids", "position_ids", "shift_labels",
                                                              "token_mask")}
    assert whole["input_ids"].shape == (2, 8) and parts[0]["rows"] == 2
    assert torch.equal(whole["input_ids"][:, :7], ids)
    assert torch.equal(whole["position_ids"][:, :7], pos) and whole["position_ids"][0, 7] == 4
    expected = torch.full((2, 8), IGNORE_INDEX)
    expected[:, :6] = labels[:, 1:]
    assert torch.equal(whole["shift_labels"], expected)
    assert whole["token_mask"].sum() == 14  # the padding position is no real token
    padded = {"input_ids": ids[:, :4], "labels": labels[:, :4], "attention_mask": torch.tensor([[1, 1, 1, 1],
                                                                                                [1, 1, 0, 0]])}
    one = sequence.shard(padded, 1, 2)  # padded rows: positions 0..w-1, no mask
    assert torch.equal(one["position_ids"], torch.tensor([[2, 3], [2, 3]])) and "attention_mask" not in one
    assert one["token_mask"].tolist() == [[1, 1], [0, 0]]


def test_documents_mask_is_causal_within_each_document():
    mask = sequence.block_causal_mask(torch.tensor([[0, 1, 0, 1, 2]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask, expected.bool())
    assert sequence.block_causal_mask(torch.arange(6).repeat(3, 1)) is None  # one document a row: is_causal


def test_documents_mask_with_a_sliding_window_is_transformers_own():
    """A sliding window (q - k < window) inside each document: the mask transformers builds for one process (its
    sliding-window causal mask over packed position ids) is what the SP kernel gets; a window at least the row's
    length changes nothing."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_sliding_window_causal_mask

    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    config = AutoConfig.for_model("mistral", sliding_window=3, hidden_size=8, num_attention_heads=2)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, 16, 8)
    theirs = create_sliding_window_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None,
                                               past_key_values=None, position_ids=positions)
    assert torch.equal(sequence.block_causal_mask(positions, 3), theirs)
    assert torch.equal(sequence.block_causal_mask(positions, 16), sequence.block_causal_mask(positions))
    assert sequence.block_causal_mask(torch.arange(6)[None], 6) is None
    assert sequence.block_causal_mask(torch.arange(6)[None], 2)[0, 0].sum(1).tolist() == [1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("overrides, says", [
    (["train.sequence_parallel=3"], "3 does not divide the model's 4 attention heads"),
    (["train.sequence_parallel=2", "loss.mode=unified", "data.emb_train_files=[data/sample/emb.jsonl]"],
     "embedding passes pool over the whole sequence"),
    (["train.sequence_parallel=2", "loss.mode=preference", "data.train_files=[data/sample/pref.jsonl]"],
     "preference training sums each sequence's log-probs over all its completion tokens"),
    (["train.sequence_parallel=2", "model.attn_implementation=eager"], "needs sdpa or flash attention"),
    (["train.sequence_parallel=2", "loss.gen_averaging=mixed"], "use token"),
    (["train.sequence_parallel=0"], "must be >= 1"),
])
def test_config_refusals_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says) as e:
        load_config(DEFAULT, overrides)
    assert "\n" not in str(e.value)


def test_launch_refusals_are_one_line():
    with pytest.raises(ConfigError, match="2 does not divide the 3 process"):
        sequence.check_launch(2, 3, "zero3", False)
    with pytest.raises(ConfigError, match="ACCELERATE_USE_CPU=1"):
        sequence.check_launch(2, 2, "zero3", True)
    with pytest.raises(ConfigError, match="needs DeepSpeed ZeRO 1-3"):
        sequence.check_launch(2, 2, None, False)
    with pytest.raises(ConfigError, match="ZeRO stage 0"):
        sequence.check_stage(2, 0)
    sequence.check_launch(1, 3, None, True)  # N = 1: nothing to check


@pytest.mark.slow
def test_a_plain_launch_with_sequence_parallel_says_what_to_change(tmp_path):
    proc = run_train([*FAST, f"train.output_dir={tmp_path}", "train.sequence_parallel=2"], nproc=2, check=False,
                     timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("harness: error:")]
    assert lines and "ACCELERATE_USE_CPU=1" in lines[0], proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------- real runs


def rows(trace: Path) -> dict[int, list]:
    """{rank: [each step's row digests]} from a HARNESS_TRACE_ROWS folder."""
    out = {}
    for f in sorted(trace.glob("rows-*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        out[int(f.stem.split("-")[1])] = {r["step"]: r["gen"] for r in recs}
    return out


def launch(out: Path, nproc: int, accel, trace: Path, overrides=()) -> list:
    """The command and environment run_train would use (for a run this test kills)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HARNESS_TRACE_ROWS": str(trace)}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / f"{accel}.yaml"), "--num_processes", str(nproc), "--main_process_port",
           str(free_port()), str(ROOT / "harness" / "train.py"), "--config", DEFAULT, *BASE,
           f"train.output_dir={out}", *overrides]
    return cmd, env


def kill_tree(pid: int) -> None:
    """SIGKILL to a process and all its descendants (the launcher and its workers: processes this test started)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in children:
        kill_tree(int(child))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Runs(dict):
    """{name: (folder, trace, stdout)}; "z2" (the extended tier's ZeRO-2 case) is launched when first asked for."""

    def __init__(self, later):
        super().__init__()
        self.later = later

    def __missing__(self, name):
        self.later[name]()
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("sp")
    done = _Runs({"z2": lambda: go("z2", 2, "zero2", "train.sequence_parallel=2")})

    def go(name, nproc, accel, *extra):
        trace = base / f"t-{name}"
        trace.mkdir()
        proc = run_train([*BASE, f"train.output_dir={base / name}", *extra], nproc=nproc, accel=accel,
                         extra_env={"HARNESS_TRACE_ROWS": str(trace)})
        done[name] = (base / name, trace, proc.stdout)

    go("ref", 1, None)
    go("z3", 2, "zero3", "train.sequence_parallel=2")

    # kill -9 of an SP 2 ZeRO-3 run once its step-4 checkpoint is complete
    killed, trace = base / "killed", base / "t-killed"
    trace.mkdir()
    cmd, env = launch(killed, 2, "zero3", trace, ["train.sequence_parallel=2", "train.save_every_steps=4"])
    with cpu_slots(2):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        marker, t0 = killed / "checkpoints" / "step-4" / "COMPLETE", time.time()
        while not marker.exists() and proc.poll() is None and time.time() - t0 < 300:
            time.sleep(0.2)
        kill_tree(proc.pid)
        proc.wait()
    assert marker.exists(), "the run ended before its step-4 checkpoint"
    ckpts = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert not (killed / "final").exists(), "the run finished before the kill"
    copy = base / "sp1"
    shutil.copytree(killed, copy)
    for step in ckpts:  # the SP 1 resume starts from step 4 exactly
        if step != "step-4":
            shutil.rmtree(copy / "checkpoints" / step)
    (base / "t-resumed").mkdir()
    done["resumed"] = (killed, base / "t-resumed", run_train(
        [*BASE, f"train.output_dir={killed}", "train.sequence_parallel=2", "train.save_every_steps=4"], nproc=2,
        accel="zero3", extra_env={"HARNESS_TRACE_ROWS": str(base / "t-resumed")}).stdout)
    (base / "t-sp1").mkdir()
    done["sp1"] = (copy, base / "t-sp1", run_train(
        [*BASE, f"train.output_dir={copy}", "train.sequence_parallel=1"], nproc=2, accel="zero3",
        extra_env={"HARNESS_TRACE_ROWS": str(base / "t-sp1")}).stdout)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z3", "z2"])
def test_sp2_losses_equal_one_process_and_every_row_is_trained_once(runs, stage):
    ref_dir, ref_trace, _ = runs["ref"]
    out, trace, stdout = runs[stage]
    ref, got = [r["loss"] for r in metrics(ref_dir)], [r["loss"] for r in metrics(out)]
    assert len(ref) == len(got) == STEPS
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(ref, got)) if not rel_close(a, b, 1e-5)]
    assert not bad, f"(step, 1 process, SP 2): {bad}"
    rep = report(out)
    assert (rep["zero_stage"], rep["world_size"], rep["sequence_parallel"], rep["data_parallel_size"],
            rep["global_batch_size"]) == (int(stage[1]), 2, 2, 1, 2)
    assert "2 process(es) (1 data-parallel x sequence parallel 2)" in stdout
    # the rows: each step, both processes of the group hold the reference's rows (each trains its half of every
    # row's positions); over the run every row of the epoch (15 packed rows) once, 5 of them again in epoch 2
    expected = rows(ref_trace)[0]
    traced = rows(trace)
    assert sorted(traced) == [0, 1] and traced[0] == traced[1] == expected
    counts = Counter(d for step in expected.values() for d in step)
    assert len(counts) == 15 and sorted(Counter(counts.values()).items()) == [(1, 10), (2, 5)]


@pytest.mark.slow
def test_sp2_padded_rows_equal_one_process(tmp_path):
    """Rows that are not packed: 4 documents of different lengths a micro-batch, padded to the longest, split by
    position over the group (the padding of a row may fall on one process only). ZeRO-3, 4 steps: every step's loss
    equals one process's (<= 1e-5 relative; 1.2e-7 measured)."""
    padded = [*FAST, "data.packing=false", "data.max_len=256", "train.micro_batch_size=4", "train.grad_accum=2",
              "train.max_steps=4", "train.eval_at_start=false", "train.save_every_minutes=0"]
    run_train([*padded, f"train.output_dir={tmp_path / 'one'}"])
    run_train([*padded, f"train.output_dir={tmp_path / 'sp2'}", "train.sequence_parallel=2"], nproc=2, accel="zero3")
    assert report(tmp_path / "sp2")["sequence_parallel"] == 2
    one, two = ([r["loss"] for r in metrics(tmp_path / name)] for name in ("one", "sp2"))
    assert len(one) == len(two) == 4
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(one, two)) if not rel_close(a, b, 1e-5)]
    assert not bad, f"(step, 1 process, SP 2): {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gemma3_text-window", "gpt_neox"])
def test_sp2_on_other_families_equals_one_process(tmp_path, family):
    """Regressions, each failing before its fix: families whose config has no num_key_value_heads (gpt_neox, gpt2)
    stopped at the attention's installation with a raw AttributeError; then gpt2, whose attention merges the kernel's
    last two dimensions itself, failed on Ulysses' merged [batch, positions, heads x size] output; sliding-window
    layers (gemma3's sliding_attention beside a full_attention layer; mistral, qwen2 alike) attended over the whole
    document under SP, silently (0.7% off one process at a window of 4). Packed rows of 256, ZeRO-3, 3 steps: every
    step's loss equals one process's (<= 1e-5 relative; gpt2 7.7e-8, gemma3 9.3e-8, gpt_neox 3e-8 measured; gpt2's
    dropout is off: its draws differ between one process and the group's shards)."""
    import yaml

    from tests.test_families import FAMILIES, TINY

    family, _, variant = family.partition("-")
    own = {"gpt2": {"n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
           "window": {"max_position_embeddings": 256, "sliding_window": 4,
                      "layer_types": ["sliding_attention", "full_attention"]}}
    model = {"model_type": family, **({} if family == "gpt2" else TINY), **FAMILIES[family],
             **own.get(variant or family, {"max_position_embeddings": 256})}
    job = {"model": {"name_or_path": None, "tokenizer": "bundled", "config": model},
           "data": {"train_files": ["data/sample/gen.jsonl"], "max_len": 256, "packing": True},
           "optim": {"lr": 2.0e-3, "warmup_steps": 0}, "train": {"output_dir": str(tmp_path / "unused")}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    common = [*FAST, "train.max_steps=3", "train.micro_batch_size=1", "train.grad_accum=2",
              "train.eval_at_start=false", "train.compile=none", "train.save_every_minutes=0"]
    run_train([*common, f"train.output_dir={tmp_path / 'one'}"], config=str(config))
    run_train([*common, f"train.output_dir={tmp_path / 'sp2'}", "train.sequence_parallel=2"], nproc=2, accel="zero3",
              config=str(config))
    one, two = ([r["loss"] for r in metrics(tmp_path / name)] for name in ("one", "sp2"))
    assert len(one) == len(two) == 3
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(one, two)) if not rel_close(a, b, 1e-5)]
    assert not bad, f"(step, 1 process, SP 2): {bad}"


@pytest.mark.slow
def test_kill_9_and_resume_under_sp2_ends_with_the_uninterrupted_weights(runs):
    out, trace, stdout = runs["resumed"]
    assert "resumed from" in stdout
    assert max_abs_diff(final_weights(out), final_weights(runs["z3"][0])) <= 1e-6
    resumed_rows = rows(trace)[0]
    assert resumed_rows and all(resumed_rows[s] == rows(runs["ref"][1])[0][s] for s in resumed_rows)


@pytest.mark.slow
def test_sp2_checkpoint_resumed_with_sp1_keeps_the_global_batch_and_the_rows(runs):
    out, trace, stdout = runs["sp1"]
    assert "train.sequence_parallel 2 -> 1" in stdout and "global batch 2 sequences kept" in stdout, stdout[-3000:]
    rep = report(out)
    assert (rep["sequence_parallel"], rep["data_parallel_size"], rep["grad_accum"], rep["global_batch_size"]) == \
        (1, 2, 1, 2)
    ref = rows(runs["ref"][1])[0]
    traced = rows(trace)
    assert sorted(traced[0]) == list(range(5, STEPS + 1))
    # steps 5-7 finish epoch 0's 15 rows: two data-parallel ranks, one row each, together the reference's rows of
    # each step. (Step 8 takes the epoch's odd last row: 2 data-parallel ranks complete that round with a repeated row,
    # accelerate's even_batches, as any 2-process run does; the elastic tests cover the data-parallel epoch ends.)
    for step in (5, 6, 7):
        assert Counter(traced[0][step] + traced[1][step]) == Counter(ref[step]), step
    ref_loss, got = metrics(runs["ref"][0]), metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(ref_loss[:7], got[:7])
           if not rel_close(a["loss"], b["loss"], 1e-5)]
    assert not bad, bad


def test_zero_plan_divides_the_activations_by_n_and_skips_stage_0():
    from harness.tools.sizing import activation_terms, model_shape
    from harness.tools.zero_plan import Hardware, plan

    one = load_config(DEFAULT, ["data.max_len=8192", "train.micro_batch_size=1"])
    two = load_config(DEFAULT, ["data.max_len=8192", "train.micro_batch_size=1", "train.sequence_parallel=2"])
    shape = model_shape(one)
    a1, a2 = activation_terms(one, shape, 2)[1], activation_terms(two, shape, 2)[1]
    assert a2 < 0.55 * a1, (a1, a2)
    got = plan(two, Hardware(gpus_per_node=2, nodes=1, gpu_mem_gb=80.0), shape=shape)
    assert "= 2 processes (1 data-parallel x sequence parallel 2)" in got.text and got.choice == "1"
    assert "train.sequence_parallel=2: each GPU holds 8192 / 2 = 4096 positions" in got.text


def test_zero_plan_proposes_the_sequence_parallel_size_a_long_row_needs():
    """A row of data.max_len tokens that no GPU holds, even one to a micro-batch: the plan proposes the smallest
    train.sequence_parallel that makes a ZeRO stage fit, with the arithmetic, before activation checkpointing (no
    recomputation); checkpointing is added only where sequence parallelism alone is not enough; one GPU, another
    objective or eager attention get no sequence parallelism; a recipe that sets it gets no other size."""
    from harness.tools.sizing import GIB
    from harness.tools.zero_plan import Hardware, plan

    def planned(*overrides, gpus=8):
        cfg = load_config(str(ROOT / "configs/gpu-1b.yaml"), ["train.micro_batch_size=1", *overrides])
        return plan(cfg, Hardware(gpus_per_node=gpus, nodes=1, gpu_mem_gb=80.0, host_mem_gb=1000))

    p = planned("data.max_len=131072")  # 1.1B, 22 layers: 224 GiB of activations for one row
    assert p.choice is None and p.proposal == "1" and p.proposal_args == ("train.sequence_parallel=4",), p.text
    line = next(x for x in p.text.splitlines() if x.startswith("with sequence parallelism"))
    assert line.startswith("with sequence parallelism (train.sequence_parallel=4: each GPU holds 131072 / 4 = 32768 "
                           "positions of every row): activations "), line
    row = p.rows[0]  # (a shorter N does not fit: SP 2 holds 65536 positions, 112 GiB)
    assert "proposed: zero1 train.sequence_parallel=4 -> accelerate_configs/zero1.yaml" in p.text
    assert row.activations / GIB > 200
    huge = planned("data.max_len=1048576")
    assert huge.proposal_args == ("train.sequence_parallel=4", "model.gradient_checkpointing=true"), huge.text
    # a micro-batch that is too large is not a long row: checkpointing as before (or a smaller micro-batch)
    batch = planned("data.max_len=8192", "train.micro_batch_size=16")
    assert batch.proposal_args == ("model.gradient_checkpointing=true",), batch.text
    assert planned("data.max_len=8192", "train.micro_batch_size=64").proposal is None  # nor with sequence parallelism
    for no_sp in (planned("data.max_len=131072", gpus=1), planned("data.max_len=131072", "model.attn_implementation=eager"),
                  planned("data.max_len=131072", "model.attn_implementation=flex_attention"),  # refused under SP
                  planned("data.max_len=131072", "train.sequence_parallel=2")):
        assert not any(a.startswith("train.sequence_parallel") for a in no_sp.proposal_args), no_sp.text


def test_train_sh_zero_auto_takes_the_proposed_sequence_parallel_size():
    from test_launch import launch_cmd, sh

    args = ("--dry-run", "configs/gpu-1b.yaml", "data.max_len=131072", "train.micro_batch_size=1")
    r = sh("train.sh", *args, NUM_GPUS=8, GPU_MEM_GB=80, HOST_MEM_GB=1000)
    assert r.returncode == 0, r.stderr
    assert "--zero auto: stage 1 fits with the plan's proposal; adding train.sequence_parallel=4" in r.stdout, r.stdout
    cmd = launch_cmd(r.stdout)
    assert "--config_file accelerate_configs/zero1.yaml --num_processes 8 " in cmd
    assert cmd.endswith("train.micro_batch_size=1 train.sequence_parallel=4"), cmd
    # the command's own size wins (--sp 2 is not enough alone: checkpointing is proposed with it)
    r = sh("train.sh", "--sp", "2", *args, NUM_GPUS=8, GPU_MEM_GB=80, HOST_MEM_GB=1000)
    assert r.returncode == 0, r.stderr
    cmd = launch_cmd(r.stdout)
    assert "train.sequence_parallel=2" in cmd and "train.sequence_parallel=4" not in cmd, cmd


def test_the_gritlm_unified_recipe_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="trains the generative loss only; loss.mode=unified's embedding passes") as e:
        load_config(str(ROOT / "configs" / "gritlm-tiny.yaml"), ["train.sequence_parallel=2"])
    assert "\n" not in str(e.value)


def test_compile_is_off_under_sequence_parallelism_or_refused():
    assert sequence.compile_mode(2, "auto", "regional")[0] == "none"
    assert sequence.compile_mode(1, "regional", "regional") == ("regional", None)
    with pytest.raises(ConfigError, match="use train.compile=none"):
        sequence.compile_mode(2, "full", "full")

"""The training loop end to end: the default job, 1 vs 2 processes, entry points, accumulation, schedule."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.config import load_config
from harness.optim import lr_lambda
from harness_launch import (FAST, ROOT, final_weights, max_abs_diff, metrics, rel_close, report, run_train,
                            third_party_lines)


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      ["optim.warmup_steps=4", "optim.min_lr_ratio=0.1", "optim.scheduler=cosine"])
    f = lr_lambda(cfg.optim, total_steps=20)
    assert [f(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0)
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(20) == pytest.approx(0.1)
    lin = lr_lambda(load_config(ROOT / "configs" / "default.yaml", ["optim.warmup_steps=0", "optim.scheduler=linear",
                                                                    "optim.min_lr_ratio=0"]).optim, total_steps=10)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])


def test_the_libraries_start_up_quietly():
    """torchao's "Failed to load ... .so" (its CUDA-only ops), torch's register_constant warnings for torchao's Enums,
    DeepSpeed's "Setting accelerator to CPU" and bitsandbytes' CPU "Failed to load CPU gemm_4bit_forward" (on `import
    peft`) were printed by every command: importing them after harness prints nothing, while a warning of the same
    libraries that the harness does not know of still gets through."""
    code = ("import logging, harness, torchao, deepspeed, accelerate.utils.other, peft\n"
            "import accelerate.commands.launch, torch.distributed.run\n"
            "logging.getLogger('torchao').warning('another torchao warning')\n"
            # issue 74: the launchers' messages on every launch (launch/train.sh's train.log), said as they say them
            "logging.getLogger('accelerate.commands.launch').warning('The following values were not passed to "
            "`accelerate launch` and had defaults used instead:\\n\\t`--num_cpu_threads_per_process` was set to `2` "
            "to improve out-of-box performance when training on CPUs\\nTo avoid this warning pass in values')\n"
            "logging.getLogger('torch.distributed.run').warning('\\n****\\nSetting OMP_NUM_THREADS environment "
            "variable for each process to be 1 in default, to avoid your system being overloaded\\n****')\n"
            "logging.getLogger('kernels._internals.hf_hub').warning(\"Skipping publisher trust check for 'a/b' "
            "because Hugging Face Hub is in offline mode.\")\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert third_party_lines(proc.stdout + proc.stderr) == ["another torchao warning"], proc.stderr[-3000:]


@pytest.mark.slow
def test_train_log_holds_no_library_line_and_no_bar_redraw(tmp_path):
    """Issue 74: launch/train.sh's train.log (the run's output through tee: no terminal) of a LoRA run with the
    progress bar left on held tqdm's redraws, transformers' "Writing model shards" bars (two exports: final/ and
    merged/), accelerate's launcher defaults and the kernel hub's offline note. Bars now only on a terminal
    (harness.observe.metrics.on_a_terminal; HF_HUB_DISABLE_PROGRESS_BARS for the libraries, harness/__init__.py), the
    two messages in harness/__init__.py's QUIET: not one carriage return, no line but the harness's."""
    from harness.observe.metrics import on_a_terminal, progress_bar

    assert not on_a_terminal() and progress_bar(3, 0, True).disable  # (pytest captures stderr: no terminal here)
    out = tmp_path / "run"
    proc = subprocess.run(["bash", "launch/train.sh", "configs/default.yaml", f"train.output_dir={out}",
                           "train.max_steps=2", "model.lora.enabled=true", "data.max_len=64", "train.summary=false",
                           "train.eval_at_start=false"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                               "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    log = (out / "train.log").read_text()
    assert "[harness] done" in log and "\r" not in log and (out / "final" / "merged").is_dir()
    assert [ln for ln in third_party_lines(log) if not ln.startswith("=== ")] == [], log[-3000:]


@pytest.mark.slow
def test_default_job_trains_exports_and_reports(tmp_path):
    out = tmp_path / "run"
    proc = run_train([f"train.output_dir={out}", "train.max_steps=40", "train.log_every=10",
                      "train.progress_bar=false"])
    # from start to `done`, only the harness speaks: no library's start-up warnings (harness/__init__.py's QUIET)
    assert "[harness] done" in proc.stdout
    assert third_party_lines(proc.stdout + proc.stderr) == []
    # outputs of the contract
    for name in ("config.yaml", "metrics.jsonl", "report.json", "final/model.safetensors", "final/tokenizer.json"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").rglob("events.out.tfevents.*")), "no tensorboard event file"
    # the resolved config reloads to the same run
    saved = load_config(out / "config.yaml")
    assert saved.train.max_steps == 40 and saved.train.output_dir == str(out)
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 2.0e-3
    # the loss falls; each record has the contract's fields
    recs = metrics(out)
    assert [r["step"] for r in recs] == [10, 20, 30, 40]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "elapsed_s", "eta_s"):
        assert key in recs[0], key
    assert recs[-1]["loss"] < 0.7 * recs[0]["loss"], [r["loss"] for r in recs]
    rep = report(out)
    assert rep["world_size"] == 1 and rep["precision"] == "fp32" and rep["steps"] == 40
    assert rep["hardware"]["versions"]["accelerate"] and rep["tokens_per_s"] > 0
    assert rep["eval"]["eval_loss"] < rep["eval_at_start"]["eval_loss"]  # held-out loss falls too
    # final/ reloads offline and generates
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'final')!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(out / 'final')!r})\n"
        "ids = t('<s><|user|>\\nWhat is 3 + 4?\\n<|assistant|>\\n', return_tensors='pt', add_special_tokens=False)\n"
        "gen = m.generate(**ids, max_new_tokens=12, do_sample=False)\n"
        "assert gen.shape[1] > ids['input_ids'].shape[1]\n"
        "print('GEN:' + t.decode(gen[0, ids['input_ids'].shape[1]:]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1",
                          "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GEN:" in proc.stdout and len(proc.stdout.split("GEN:")[1].strip()) > 0


EVALS = "data.eval_files=[data/sample/gen_eval.jsonl]"


@pytest.fixture(scope="module")
def one_process_16(tmp_path_factory):
    """2 steps of 1 process x micro-batch 16, the held-out set evaluated at the start and the end: the reference of
    2 processes x 8 and of accumulation 2 x 8 (an evaluation changes no weight and no data order)."""
    out = tmp_path_factory.mktemp("one")
    run_train([f"train.output_dir={out}", "train.max_steps=2", "train.micro_batch_size=16", *FAST, EVALS])
    return out


@pytest.mark.slow
def test_two_processes_equal_one_process_with_twice_the_micro_batch(one_process_16, tmp_path):
    """Training losses and the held-out loss (each eval sample counted once, whatever the process count: the eval set
    of 40 records does not divide into 2 x 8-row batches evenly)."""
    two, one = tmp_path / "two", one_process_16
    run_train([f"train.output_dir={two}", "train.max_steps=2", "train.micro_batch_size=8", *FAST, EVALS], nproc=2)
    assert report(two)["world_size"] == 2 and report(one)["world_size"] == 1
    l2, l1 = metrics(two), metrics(one)
    assert rel_close(l2[0]["loss"], l1[0]["loss"], 1e-5), (l2[0]["loss"], l1[0]["loss"])
    assert rel_close(l2[1]["loss"], l1[1]["loss"], 1e-5), (l2[1]["loss"], l1[1]["loss"])
    for when in ("eval_at_start", "eval"):
        e2, e1 = report(two)[when]["eval_loss"], report(one)[when]["eval_loss"]
        assert rel_close(e2, e1, 1e-5), (when, e2, e1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["preference", "generative"])
def test_an_epochs_last_partial_step_is_the_same_on_two_processes(mode, tmp_path):
    """An epoch whose rows do not fill its last step (23 pairs, 15 generative rows; micro-batch 4): 2 processes x
    accumulation 1 train its last step on exactly the rows 1 process x accumulation 2 does. accelerate filled the
    second process's last batch with a row from the epoch's start, trained twice (23 pairs: step 3 0.97% off, 38
    more tokens; the issue's 191 pairs: 1.24%). The same rows in another reduction order: losses and gradient norms
    within 1e-5 relative (the repo's 1-vs-2-process tolerance; measured equal to the last bit on CPU), token
    counts equal (integers)."""
    config, rows, steps = {"preference": ("configs/dpo-tiny.yaml", ROOT / "data/sample/pref.jsonl", 3),
                           "generative": (str(ROOT / "configs/default.yaml"), ROOT / "data/sample/gen.jsonl", 2)}[mode]
    data = tmp_path / "rows.jsonl"  # 23 pairs: 6 batches of 4 (the last 3), 3 steps; 15 rows: 4 batches, 2 steps
    data.write_text("".join(rows.read_text().splitlines(keepends=True)[:{"preference": 23, "generative": 15}[mode]]))
    args = [f"data.train_files=[{data}]", f"train.max_steps={steps}", "train.micro_batch_size=4", *FAST,
            "train.save_final=false"]
    run_train([f"train.output_dir={tmp_path / 'one'}", *args, "train.grad_accum=2"], config=config)
    run_train([f"train.output_dir={tmp_path / 'two'}", *args, "train.grad_accum=1"], nproc=2, config=config)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, steps + 1))
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"], (a["step"], a["tokens"], b["tokens"])  # (the run's count so far)
        for key in ("loss", "grad_norm"):
            assert rel_close(a[key], b[key], 1e-5), (a["step"], key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.usefixtures("all_cpus")  # launch/train.sh
def test_entry_points_run_the_same_loop(one_process_16, tmp_path):
    """python -m harness.train (one_process_16: run_train's plain command; its evaluation changes no weight and no
    data order), the `harness train` console script and `accelerate launch harness/train.py`: the same first loss."""
    args = ["train.max_steps=1", *FAST, "train.save_final=false"]
    assert load_config(ROOT / "configs" / "default.yaml").train.micro_batch_size == 16  # one_process_16's
    run_train([f"train.output_dir={tmp_path / 'launch'}", *args], nproc=1, accel="cpu")
    script = Path(sys.executable).with_name("harness")
    proc = subprocess.run([str(script), "train", str(ROOT / "configs" / "default.yaml"),
                           f"train.output_dir={tmp_path / 'cli'}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [metrics(d)[0]["loss"] for d in (one_process_16, tmp_path / "launch", tmp_path / "cli")]
    assert max(losses) - min(losses) < 1e-9, losses


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(one_process_16, tmp_path):
    """accum 2 x micro-batch 8 == accum 1 x micro-batch 16: same loss and the same first update (per-token mean)."""
    acc, big = tmp_path / "acc", one_process_16
    run_train([f"train.output_dir={acc}", "train.max_steps=2", "train.micro_batch_size=8", "train.grad_accum=2",
               *FAST])
    ma, mb = metrics(acc), metrics(big)
    for a, b in zip(ma, mb):
        assert rel_close(a["loss"], b["loss"], 1e-5) and rel_close(a["grad_norm"], b["grad_norm"], 1e-4), (a, b)
    assert max_abs_diff(final_weights(acc), final_weights(big)) < 1e-6


@pytest.mark.slow
def test_malformed_data_line_stops_the_run_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    proc = run_train([f"train.output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]", *FAST], check=False)
    assert proc.returncode == 1
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    assert err == [f"harness: error: {bad}:2: invalid JSON, column 10: Unterminated string starting at"], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_nonfinite_gradients_are_skipped_then_stop_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = run_train([f"train.output_dir={out}", "train.max_steps=20", "optim.lr=1e30", "optim.warmup_steps=0",
                      "train.max_nonfinite_skips=2", *FAST], check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.count("update skipped") == 3
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    assert len(err) == 1 and "non-finite gradients in 3 steps in a row (train.max_nonfinite_skips=2)" in err[0]
    assert "Traceback" not in proc.stderr
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*/COMPLETE"))


@pytest.mark.slow
def test_auto_micro_batch_backs_off_and_keeps_the_global_batch(tmp_path):
    """train.micro_batch_size=auto under a real memory limit (RLIMIT_AS: the CPU allocator fails as a GPU would run
    out of memory; a micro-batch of 256 needs about 3.5 GB here): it backs off by halving, raises accumulation so that
    micro-batch x accumulation stays the global batch of 256, and trains the same losses as micro-batch 64 x
    accumulation 4 set by hand (token averaging: the split does not change the step's loss or gradient; the trial step
    changed nothing).
    Under DeepSpeed ZeRO-2 the first real step is the trial, and the retry rebuilds the engine."""
    common = ["train.max_steps=2", *FAST, "train.save_final=false"]
    hand = tmp_path / "hand"
    run_train([f"train.output_dir={hand}", "train.micro_batch_size=64", "train.grad_accum=4", *common])
    for name, extra in (("auto", []), ("auto-zero2", ["train.deepspeed=zero2"])):
        out = tmp_path / name
        proc = run_train([f"train.output_dir={out}", "train.micro_batch_size=auto", "train.global_batch_size=256",
                          *extra, *common], address_space_gb=4.5 if extra else 3.5)
        auto = report(out)["micro_batch_auto"]
        tried, micro = auto["tried"], auto["micro_batch_size"]
        assert tried[:2] == [256, 128] and tried[-1] == micro and micro <= 128, proc.stdout[-2000:]
        assert all(b == a // 2 for a, b in zip(tried, tried[1:]))  # halving (256 has only powers of two)
        assert auto["grad_accum"] * micro == 256 == auto["global_batch_size"]
        assert report(out)["micro_batch_size"] == micro and report(out)["grad_accum"] == auto["grad_accum"]
        assert "micro-batch 256 did not fit: trying 128" in proc.stdout
        # step 1 holds the same 256 samples whatever the split; later steps cross the epoch end, where the ragged last
        # micro-batch depends on the micro-batch size
        a, b = metrics(out)[0], metrics(hand)[0]
        assert rel_close(a["loss"], b["loss"], 1e-5) and rel_close(a["grad_norm"], b["grad_norm"], 1e-4), (name, a, b)
        if micro == 64:  # the same split as the hand-set run: the same losses (bit for bit without DeepSpeed; ZeRO-2's
            # flat-buffer AdamW rounds differently from torch's per-tensor one: 7.19813658791866 vs 7.198136634644139
            # at step 2, measured with micro-batch 64 x 4 set by hand under both)
            losses, expected = [r["loss"] for r in metrics(out)], [r["loss"] for r in metrics(hand)]
            assert losses == expected if not extra else all(map(rel_close, losses, expected, [1e-7] * 2)), (name, losses)


@pytest.mark.slow
def test_evaluation_runs_on_its_own_cadence_not_only_on_log_steps(tmp_path):
    """train.eval_every=3 with train.log_every=2: evaluations at 0, 3, 6 and the end (8), as README and the planner
    promise; each evaluation is its own record when its step is not a log step. (It used to sit inside the logging
    block: evaluations at 0, 6 and 8 only.)"""
    from harness.tools.plan_arithmetic import count_evals

    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", "train.max_steps=8", "train.log_every=2", "train.eval_every=3",
               "train.progress_bar=false", "train.report_to=[]", "train.summary=false"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    eval_steps = [r["step"] for r in records if "eval_loss" in r]
    assert eval_steps == [0, 3, 6, 8]
    assert len(eval_steps) == count_evals(8, 3, True, True)
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]

"""harness.observe.metrics and harness.hardware.peak_flops: retrieval metrics on a hand-built case, FLOPs per token, MFU,
ETA, and the peak FLOP/s table by GPU name."""

from __future__ import annotations

import math

import pytest
import torch

from harness.hardware import peak_flops
from harness.observe.metrics import eta_seconds, flops_per_token, mfu, retrieval_metrics

# ----------------------------------------------------------------------------------------------- retrieval


def _unit(*xs: float) -> list[float]:
    n = math.sqrt(sum(x * x for x in xs))
    return [x / n for x in xs]


def test_retrieval_metrics_hand_built():
    # Corpus: the 5 standard basis vectors of R^5, so a query's score for row j is its (normalised) j-th coordinate.
    corpus = torch.eye(5)
    queries = torch.tensor([
        # q0: two positives (rows 0 and 3); row 3 scores best of all (0.8 > 0.6 > 0) -> rank 1.
        _unit(0.0, 0.6, 0.0, 0.8, 0.0),
        # q1: positive row 2 scores 0.3, below rows 0 (0.7) and 4 (0.5) -> rank 3, reciprocal rank 1/3.
        _unit(0.7, 0.0, 0.3, 0.0, 0.5),
        # q2: positive row 1 ties with row 4 (exactly equal scores), nothing above -> rank 1 (ties in its favour).
        _unit(0.0, 1.0, 0.0, 0.0, 1.0),
    ])
    positives = [[0, 3], [2], [1]]
    scores = queries @ corpus.T
    assert scores[2, 1].item() == scores[2, 4].item()  # a true tie
    m = retrieval_metrics(queries, corpus, positives)
    assert set(m) == {"recall_at_1", "mrr"}
    assert m["recall_at_1"] == 2 / 3
    assert m["mrr"] == pytest.approx((1 + 1 / 3 + 1) / 3, rel=0, abs=1e-15)


def test_retrieval_metrics_single_cases():
    corpus = torch.eye(4)
    # The best of several positives decides; other positives below it do not push it down.
    q = torch.tensor([_unit(0.1, 0.2, 0.9, 0.3)])
    assert retrieval_metrics(q, corpus, [[0, 2]]) == {"recall_at_1": 1.0, "mrr": 1.0}
    # Positive last of 4 -> rank 4.
    assert retrieval_metrics(q, corpus, [[0]]) == {"recall_at_1": 0.0, "mrr": 0.25}
    # Positive 2nd -> rank 2.
    assert retrieval_metrics(q, corpus, [[3]]) == {"recall_at_1": 0.0, "mrr": 0.5}
    # A query tied with every corpus row: rank 1.
    flat = torch.tensor([_unit(1.0, 1.0, 1.0, 1.0)])
    assert retrieval_metrics(flat, corpus, [[3]]) == {"recall_at_1": 1.0, "mrr": 1.0}


def test_retrieval_metrics_low_precision_input():
    corpus = torch.eye(5)
    queries = torch.tensor([_unit(0.7, 0.0, 0.3, 0.0, 0.5)]).bfloat16()
    m = retrieval_metrics(queries, corpus.bfloat16(), [[2]])
    assert m == {"recall_at_1": 0.0, "mrr": pytest.approx(1 / 3)}


# ----------------------------------------------------------------------------------------------- FLOPs, MFU, ETA


@pytest.mark.parametrize(
    "n_params, layers, hidden, seq, expected",
    [
        # 6N + 12 L H S by hand: 6e9 + 12 * 24 * 2048 * 2048 = 6e9 + 1_207_959_552
        (10**9, 24, 2048, 2048, 7_207_959_552),
        # GPT-2 small: 6 * 124_439_808 + 12 * 12 * 768 * 1024 = 746_638_848 + 113_246_208
        (124_439_808, 12, 768, 1024, 859_885_056),
    ],
)
def test_flops_per_token(n_params, layers, hidden, seq, expected):
    assert flops_per_token(n_params, layers, hidden, seq) == expected


def test_flops_per_token_forward_only():
    """A pass without backward (GradCache's first pass, evaluation) is a third: 2N + 4 L H S."""
    assert flops_per_token(10**9, 24, 2048, 2048, backward=False) == 2_402_653_184  # 2e9 + 402_653_184
    assert flops_per_token(10**9, 24, 2048, 2048, backward=False) * 3 == flops_per_token(10**9, 24, 2048, 2048)


def test_mfu_by_hand():
    per_token = flops_per_token(10**9, 24, 2048, 2048)
    # 100k tokens/s on one H100 SXM: 1e5 * 7_207_959_552 / 989e12
    assert mfu(1e5, per_token, 989e12) == pytest.approx(720_795_955_200_000 / 989e12, rel=1e-12)
    assert mfu(1e5, per_token, 989e12) == pytest.approx(0.728812897, rel=1e-8)
    # 8 A100s: the peak is the sum over GPUs
    per_token_small = flops_per_token(124_439_808, 12, 768, 1024)
    assert mfu(2.5e5, per_token_small, 8 * 312e12) == pytest.approx(2.5e5 * 859_885_056 / 2.496e15, rel=1e-12)


@pytest.mark.parametrize("peak", [None, 0, 0.0])
def test_mfu_without_peak_is_none(peak):
    assert mfu(1e5, 7e9, peak) is None


def test_eta_seconds():
    assert eta_seconds(100.0, 10, 50) == pytest.approx(400.0)
    assert eta_seconds(30.0, 3, 4) == pytest.approx(10.0)
    assert eta_seconds(12.5, 20, 20) == 0.0
    assert eta_seconds(5.0, 0, 100) is None
    assert eta_seconds(0.0, 0, 0) is None


# ----------------------------------------------------------------------------------------------- peak FLOP/s


@pytest.mark.parametrize(
    "name, flops, label",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", 756e12, "H100 PCIe"),
        ("NVIDIA H100 NVL", 835e12, "H100 NVL"),
        ("NVIDIA H200", 989e12, "H200"),
        ("NVIDIA A100-SXM4-80GB", 312e12, "A100"),
        ("NVIDIA A100 80GB PCIe", 312e12, "A100"),
        ("NVIDIA L40S", 362e12, "L40S"),
        ("NVIDIA L40", 181e12, "L40"),
        ("NVIDIA A10G", 70e12, "A10G"),
        ("NVIDIA GeForce RTX 4090", 165e12, "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", 71e12, "RTX 3090"),
        ("NVIDIA RTX A6000", 155e12, "RTX A6000"),
        ("Tesla V100-SXM2-16GB", 125e12, "V100 (fp16)"),
        ("Tesla T4", 65e12, "T4 (fp16)"),
    ],
)
def test_peak_flops_known(name, flops, label):
    assert peak_flops(name) == (flops, label)


@pytest.mark.parametrize("name", ["Some Future GPU 9000", "AMD Instinct MI300X", ""])
def test_peak_flops_unknown(name):
    flops, message = peak_flops(name)
    assert flops is None
    assert "unknown GPU" in message
    assert message == f"unknown GPU '{name}': MFU not reported"


def test_peak_flops_gh200_label():
    assert peak_flops("NVIDIA GH200 480GB") == (989e12, "GH200")


def test_peak_flops_rtx_6000_ada():
    assert peak_flops("NVIDIA RTX 6000 Ada Generation") == (364e12, "RTX 6000 Ada")


def test_throughput_interval_leaves_out_excluded_time(monkeypatch):
    """An evaluation or a checkpoint inside a log interval does not count as training time for tokens/s."""
    from harness.observe import metrics as m

    clock = iter([100.0, 110.0, 125.0])
    monkeypatch.setattr(m.time, "perf_counter", lambda: next(clock))
    meter = m.Throughput()  # starts at 100
    meter.exclude(4.0)  # e.g. an evaluation of 4 s
    assert meter.interval() == pytest.approx(6.0)  # 10 s, of which 4 s evaluating
    assert meter.interval() == pytest.approx(15.0)  # the exclusion applied to its own interval only


# ----------------------------------------------------------------------------------------------- metrics.jsonl on resume


class _Acc:
    is_main_process = True

    def __init__(self):
        self.printed = []

    def print(self, *args):
        self.printed.append(" ".join(map(str, args)))


def test_resume_drops_cut_and_invalid_lines_with_a_warning_and_replaces_the_file(tmp_path, monkeypatch):
    import json
    import os

    from harness.observe.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4, 5)]
    # line 3: zeroed bytes inside the file; line 7: a record cut by a crash mid-write (no newline)
    path.write_bytes(("\n".join(good[:2]) + "\n").encode() + b"\x00" * 20 + b"\n"
                     + ("\n".join(good[2:]) + "\n").encode() + b'{"step": 6, "lo')
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((str(a), str(b))), real_replace(a, b)))
    acc = _Acc()
    logger = MetricsLogger(acc, tmp_path, resume_step=4)
    logger._fh.write(json.dumps({"step": 5, "loss": 0.2}) + "\n")
    logger.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert acc.printed == [
        f"[harness] warning: {path}:3: not a JSON record (cut by a crash while it was written?): dropped",
        f"[harness] warning: {path}:7: not a JSON record (cut by a crash while it was written?): dropped",
    ]
    assert replaced == [(str(path) + ".tmp", str(path))]  # the rewrite is one rename, never an in-place truncation
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


# metrics.jsonl's disk fills up in the middle of step 3's record (half of it written, then ENOSPC)
METRICS_DISK_FULL = """
import errno, json, sys
from harness.observe import metrics

real_open = open


class FillsUp:
    def __init__(self, fh):
        self.fh = fh

    def write(self, text):
        try:
            step = json.loads(text).get("step")
        except ValueError:
            step = None
        if step == 3:
            self.fh.write(text[: len(text) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(text)

    def __getattr__(self, name):
        return getattr(self.fh, name)


def fills_up(path, mode="r", *args, **kwargs):
    fh = real_open(path, mode, *args, **kwargs)
    return FillsUp(fh) if str(path).endswith("metrics.jsonl") and "a" in mode else fh


metrics.open = fills_up
from harness.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_disk_full_while_writing_metrics_is_one_line_and_nothing_is_lost(tmp_path):
    """The run stops at that step with a checkpoint (there is room for it here), says so in one line, leaves no cut
    line; the restart writes the record the disk kept out, and the file equals an uninterrupted run's steps."""
    import os
    import subprocess
    import sys

    from harness.checkpoint.manifest import verify_checkpoint
    from harness_launch import DEFAULT, FAST, ROOT, metrics as records, run_train

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=4", "train.save_final=false", *FAST]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", METRICS_DISK_FULL, "--config", DEFAULT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: could not write the record of step 3 to {out}/metrics.jsonl (OSError: [Errno 28] No space "
        f"left on device): stopped at step 3 with checkpoint {out}/checkpoints/step-3; free some space, then continue "
        "with train.resume=auto")
    assert [r["step"] for r in records(out)] == [1, 2]  # whole lines only
    assert verify_checkpoint(out / "checkpoints" / "step-3").ok
    resumed = run_train(args)
    assert f"resumed from {out}/checkpoints/step-3: step 3" in resumed.stdout
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]


# the disk fills up for the files named DISK_FULL_FILES (a pattern of the file name) once DISK_FULL_ONCE_EXISTS
# exists (if given): a write there puts half of its bytes on disk, then fails with ENOSPC
FILLS_UP_FILES = """
import builtins, errno, fnmatch, io, os, sys
real_open = io.open
FILES, ONCE = os.environ["DISK_FULL_FILES"], os.environ.get("DISK_FULL_ONCE_EXISTS")


class FillsUp:
    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        self.fh.write(data[: len(data) // 2])
        self.fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()
        return False

    def __getattr__(self, name):
        return getattr(self.fh, name)


def fills_up(file, mode="r", *args, **kwargs):
    fh = real_open(file, mode, *args, **kwargs)
    full = any(c in mode for c in "wax+") and fnmatch.fnmatch(os.path.basename(str(file)), FILES)
    return FillsUp(fh) if full and (not ONCE or os.path.exists(ONCE)) else fh


io.open = builtins.open = fills_up
from harness.train import main
sys.exit(main(sys.argv[1:]))
"""


def _disk_full_run(args: list, files: str, once=None):
    import os
    import subprocess
    import sys

    from harness_launch import DEFAULT, ROOT

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "DISK_FULL_FILES": files,
           **({"DISK_FULL_ONCE_EXISTS": str(once)} if once else {})}
    return subprocess.run([sys.executable, "-c", FILLS_UP_FILES, "--config", DEFAULT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_disk_full_while_writing_tensorboard_events_is_one_line_and_nothing_is_lost(tmp_path):
    """tensorboard's event file fills up after the step-2 checkpoint: the run stops at step 3 with a checkpoint, as
    for metrics.jsonl, in one line (no traceback, not even the writer thread's); the restart finishes the run."""
    from harness.checkpoint.manifest import verify_checkpoint
    from harness_launch import FAST, metrics as records, run_train

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=4", "train.save_every_steps=2", "train.save_final=false",
            *FAST, "train.report_to=[tensorboard]"]
    proc = _disk_full_run(args, "events.out.tfevents.*", once=out / "checkpoints" / "step-2" / "COMPLETE")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: could not write the tensorboard record of step 3 to {out}/tensorboard (OSError: [Errno 28] "
        f"No space left on device): stopped at step 3 with checkpoint {out}/checkpoints/step-3; free some space, "
        "then continue with train.resume=auto")
    assert [r["step"] for r in records(out)] == [1, 2, 3] and verify_checkpoint(out / "checkpoints" / "step-3").ok
    resumed = run_train(args)
    assert f"resumed from {out}/checkpoints/step-3: step 3" in resumed.stdout
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("files", ["report.json*", "summary*.md", "events.out.tfevents.*"])
def test_disk_full_at_the_end_of_a_run_is_one_line_and_nothing_is_lost(tmp_path, files):
    """The disk fills up once the run's last checkpoint (step 3) is written: while writing report.json, summary.md,
    or tensorboard's record of the final evaluation. One line naming the file and what is intact, exit 1, nothing
    cut. Before report.json the run is not finished: the same command resumes at step 3 and writes the rest (the
    same final weights); from summary.md on it is, and `harness summary` writes the summary."""
    import json

    from harness_launch import FAST, final_weights, max_abs_diff, report, run_train

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=2", *FAST]
    if files.startswith("summary"):
        args.append("train.summary=true")
    if files.startswith("events"):  # the final evaluation's record is the last one tensorboard gets
        args += ["train.report_to=[tensorboard]", "data.eval_files=[data/sample/gen_eval.jsonl]"]
    proc = _disk_full_run(args, files, once=out / "checkpoints" / "step-3" / "COMPLETE")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    if files.startswith("summary"):
        assert last == (
            f"harness: error: disk full while writing {out}/summary.md (OSError: [Errno 28] No space left on device): "
            f"the run is complete and nothing is lost (final model {out}/final, report {out}/report.json, checkpoint "
            f"{out}/checkpoints/step-3); free some space, then write the summary with: harness summary {out}")
        assert not (out / "summary.md").exists() and json.loads((out / "report.json").read_text())["steps"] == 3
        assert not list(out.glob("*.tmp")) and not list((out / "plots").glob("*tmp*"))
        again = run_train(args)
        assert "nothing to do" in again.stdout
        return
    what = (f"{out}/report.json" if files.startswith("report") else
            f"the tensorboard record of step 3 to {out}/tensorboard")
    assert last == (
        f"harness: error: could not write {what} (OSError: [Errno 28] No space left on device): nothing is lost: the "
        f"final model {out}/final and the checkpoint {out}/checkpoints/step-3 are intact; free some space, then "
        "run the same command again to write the rest")
    assert not (out / "report.json").exists() and not list(out.glob("*.tmp"))
    weights = final_weights(out)
    again = run_train(args)
    assert f"resumed from {out}/checkpoints/step-3: step 3" in again.stdout and "[harness] step " not in again.stdout
    rep = report(out)
    assert rep["steps"] == 3 and rep["final_loss"] is not None and max_abs_diff(final_weights(out), weights) == 0


def test_disk_full_when_tensorboard_starts_is_one_line(tmp_path):
    """tensorboard's first event file cannot be written (a full disk at the start of an attempt, here a resumed one):
    one line, exit 1, the checkpoint it resumed from intact; once there is space the same command goes on."""
    from harness_launch import FAST, metrics as records, run_train

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_final=false", *FAST]
    run_train([*args, "train.stop_at_step=2"])
    args.append("train.report_to=[tensorboard]")
    proc = _disk_full_run(args, "events.out.tfevents.*")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: could not start tensorboard in {out}/tensorboard (OSError: [Errno 28] No space left on "
        f"device): nothing is lost, no step of this attempt ran (the checkpoint {out}/checkpoints/step-2 is intact); "
        "free some space, then run the same command again")
    assert [r["step"] for r in records(out)] == [1, 2]
    run_train(args)
    assert [r["step"] for r in records(out)] == [1, 2, 3]

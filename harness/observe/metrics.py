"""Run metrics: metrics.jsonl, accelerate trackers (tensorboard), throughput, MFU, memory, the progress bar.

Every logged step becomes one JSON object in `<output_dir>/metrics.jsonl` (main process only) with at least:
step, loss, lr, grad_norm, tokens_per_s, mfu (null where the peak FLOP/s is unknown, e.g. CPU), mem_gb,
elapsed_s, eta_s. The same scalars go to the accelerate trackers (tensorboard by default), grouped by `tracker_tag`
(train/, eval/, system/, time/).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int, backward: bool = True) -> float:
    """Model FLOPs per token (PaLM, appendix B): with backward, 6N for the matmuls (forward 2N + backward 4N) plus
    12 * layers * hidden * seq_len for attention scores and values; a forward without gradient (GradCache's first
    pass, evaluation) is a third of that: 2N + 4 * layers * hidden * seq_len. N counts matmul weights (see
    `matmul_params`): the embedding lookup is not a matmul, a (tied) output projection is."""
    if backward:
        return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len
    return 2.0 * n_params + 4.0 * n_layers * hidden * seq_len


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in matmuls: every nn.Linear (lm_head included, tied or not), counted by its shape,
    so that ZeRO-3's partitioned weights and bitsandbytes' packed 4-bit weights (QLoRA: half a byte each, stored
    as in x out / 2 uint8) count what the matmul computes."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops_total: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1]; None when the hardware peak is unknown (CPU, unlisted GPU)."""
    if not peak_flops_total:
        return None
    return tokens_per_s * flops_per_tok / peak_flops_total


def memory_gb() -> float:
    """Peak allocated accelerator memory on this process (GB); resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except Exception:  # noqa: BLE001 - resource is Unix-only
        return float("nan")


def read_records(path: str | Path, warn=print, max_warnings: int = 5) -> list[tuple[dict, str]]:
    """(record, line) for every line of a JSON-lines file that holds a JSON object. Any other non-blank line (cut by
    a crash mid-write, zeroed, not UTF-8) is dropped with a warning `path:line: ...` (the first `max_warnings`, then
    one count)."""
    out, bad = [], []
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            rec = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            rec = None
        if isinstance(rec, dict):
            out.append((rec, line.rstrip("\r")))
        else:
            bad.append(n)
    for n in bad[:max_warnings]:
        warn(f"[harness] warning: {path}:{n}: not a JSON record (cut by a crash while it was written?): dropped")
    if len(bad) > max_warnings:
        warn(f"[harness] warning: {path}: {len(bad) - max_warnings} more invalid lines dropped")
    return out


SYSTEM_KEYS = {"gpu_util", "gpu_mem_gb", "cpu_util", "rss_gb", "mem_gb"}
TIME_KEYS = {"tokens_per_s", "samples_per_s", "mfu", "elapsed_s", "eta_s", "data_wait_share", "cost",
             "cost_projected"}


def tracker_tag(key: str) -> str:
    """A metrics.jsonl key -> its tracker tag, grouped the way tensorboard and wandb show sections: eval/ (eval_loss ->
    eval/loss), system/ (utilisation, memory), time/ (throughput, MFU, time, cost), train/ (the rest: losses, lr,
    gradient norm, epoch, tokens, padding). metrics.jsonl keeps the flat keys."""
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    if key in SYSTEM_KEYS or (key.startswith("gpu") and key[3:4].isdigit()):
        return f"system/{key}"
    if key in TIME_KEYS:
        return f"time/{key}"
    return f"train/{key}"


def markdown_table(rows: list[dict]) -> str:
    """Rows of a record (loss.mode=rl's sampled completions) as a markdown table, a tracker's text."""
    cols = list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows])


class MetricsLogger:
    """Writes metrics.jsonl and forwards scalars to accelerate's trackers. Call on every process; only the main
    process writes."""

    def __init__(self, accelerator, output_dir: str | Path, resume_step: Optional[int] = None,
                 unwritten: Optional[list] = None):
        """A fresh run starts an empty metrics.jsonl; a resumed one keeps the records up to `resume_step` (later
        ones belong to the interrupted attempt and are logged again). A line that is not a JSON object (the last one
        cut by a crash mid-write, or damage anywhere) is dropped with a warning naming it. The kept records are
        written to a temporary file that replaces metrics.jsonl in one rename, so a kill during the resume leaves
        the old file or the new one, never a cut one. `unwritten`: the lines a full disk kept out of the file before
        the checkpoint resumed from (see `_append`), written after the kept records."""
        self.accelerator = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        self._fh = None
        self.failed: Optional[str] = None  # why a record could not be written (a full disk): the run stops
        self.unwritten: list[str] = []  # the lines since (saved with the checkpoint that stop writes)
        self.trackers_failed = False  # a tracker's write failed: it gets nothing more (its file would fail again)
        self.last_logged: dict = {}  # the last training record kept on resume (the report's final loss, if no more)
        if accelerator.is_main_process:
            kept = []
            if resume_step is not None and self.path.exists():
                records = [(rec, ln) for rec, ln in read_records(self.path, accelerator.print)
                           if rec.get("step", 0) <= resume_step]
                kept = [ln for _, ln in records]
                self.last_logged = next((rec for rec, _ in reversed(records) if "loss" in rec), {})
            kept += [ln for ln in unwritten or [] if json.loads(ln).get("step", 0) <= (resume_step or 0)]
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(ln + "\n" for ln in kept)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self._fh = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if self.failed is not None:
            self.unwritten.append(json.dumps(clean))
        elif self._fh is not None:
            self._append(json.dumps(clean) + "\n", record.get("step"))
        scalars = {tracker_tag(k): v for k, v in clean.items()
                   if isinstance(v, (int, float)) and k != "step" and v is not None}
        scalars.update({tracker_tag(k): markdown_table(v) for k, v in clean.items()  # (tensorboard's text tab)
                        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)})
        if not self.trackers_failed:
            self._track(scalars, record.get("step"))

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """train.eval_prompts' answers of the evaluation of `step`: one metrics.jsonl record {step, eval_samples:
        [{prompt, answer}]} and a markdown table in the trackers' text tab (tensorboard's TEXT, as eval/samples)."""
        self.log({"step": step, "eval_samples": rows})
        if not self.trackers_failed:
            cell = lambda text: text.replace("|", "\\|").replace("\n", "<br>")  # noqa: E731 - one table cell
            table = "| prompt | answer |\n|---|---|\n" + "".join(f"| {cell(r['prompt'])} | {cell(r['answer'])} |\n"
                                                              for r in rows)
            self._track({"eval/samples": table}, step)

    def _track(self, scalars: dict, step) -> None:
        """accelerator.log, one tracker at a time (as accelerate does, main process only), so that a write that fails
        (tensorboard's event file on a full disk) is named and stops the run like a metrics.jsonl write (`failed`)."""
        if not self.accelerator.is_main_process:
            return
        for tracker in self.accelerator.trackers:
            try:
                tracker.log(scalars, step=step)
            except OSError as e:
                where = getattr(tracker, "logging_dir", None)
                self.trackers_failed = True
                if self.failed is None:
                    self.failed = (f"could not write the {tracker.name} record of step {step}"
                                   f"{f' to {where}' if where else ''} ({type(e).__name__}: {e})")
                return

    def _append(self, line: str, step) -> None:
        """One record, whole or not at all: a write that fails (ENOSPC) is cut back to the last whole line, and
        `failed` says why; this line and later ones go to `unwritten` (the loop stops with a checkpoint that holds
        them, and the resume writes them)."""
        size = self._fh.tell()
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as e:
            self.failed = f"could not write the record of step {step} to {self.path} ({type(e).__name__}: {e})"
            self.unwritten.append(line.rstrip("\n"))
            try:
                os.truncate(self.path, size)  # no cut line
                self._fh.close()
            except OSError:
                pass
            self._fh = None

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:  # its last flush on a full disk: already reported, the resume rewrites the file
                pass
            self._fh = None


class Throughput:
    """The training clock (the one clock that leaves evaluations and checkpoints out): since the start, and between
    two logging points (the loop sums tokens and samples on the device and divides by these intervals). Time spent
    on evaluations and checkpoints is `exclude`d, from the current interval and from `trained`, so tokens/s and the
    report's step times measure training alone."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.mark = self.start
        self.excluded = 0.0  # in the current interval
        self.excluded_total = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint) out of the current interval and of the training time."""
        self.excluded += seconds
        self.excluded_total += seconds

    def trained(self) -> float:
        """Seconds since the start spent on steps: without the evaluations and checkpoints."""
        return self.elapsed() - self.excluded_total

    def interval(self) -> float:
        """Training seconds since the previous call, without the excluded time; starts the next interval."""
        now = time.perf_counter()
        dt = max(now - self.mark - self.excluded, 1e-9)
        self.mark, self.excluded = now, 0.0
        return dt

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def eta_seconds(elapsed_s: float, steps_done: int, steps_total: int) -> Optional[float]:
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * (steps_total - steps_done)


def on_a_terminal() -> bool:
    """Whether a progress bar has someone to show itself to: stderr is a terminal, or a notebook runs the code. In a
    log file (launch/train.sh's train.log, a redirect, CI) each redraw would be another run of carriage returns; the
    `[harness] step` lines say the same every train.log_every steps."""
    import sys

    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar (main process only, on a terminal: `on_a_terminal`); its postfix carries loss and tokens/s, tqdm
    itself shows the ETA."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not (enabled and on_a_terminal()), desc="train", unit="step",
                dynamic_ncols=True)


def retrieval_metrics(queries: torch.Tensor, corpus: torch.Tensor, positives: list[list[int]]) -> dict:
    """recall@1 and MRR of ranking `corpus` (normalised [C, H]) for each query ([Q, H]) by cosine similarity;
    positives[i] lists the corpus rows that answer query i. A query's rank is 1 + the number of corpus rows that
    score above its best positive (ties count in its favour)."""
    scores = queries.float() @ corpus.float().T
    ranks = []
    for i, pos in enumerate(positives):
        best = scores[i, pos].max()
        ranks.append(1 + int((scores[i] > best).sum()))
    r = torch.tensor(ranks, dtype=torch.float64)
    return {"recall_at_1": float((r == 1).double().mean()), "mrr": float((1.0 / r).mean())}

"""The loss modes as components (harness/modes/): a sixth mode written here alone trains through `harness train`
with no edit to build.py, train.py or objective.py; the RL task is built once a run.

    python -m pytest tests/test_modes.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from harness import IGNORE_INDEX
from harness.config.modes import ModeFacts
from harness.data.samples import model_inputs, real_tokens
from harness.objective import Objective, Parts
from harness.state import StepSums
from harness_launch import FAST, ROOT, cpu_slots


# ----------------------------------------------------------------------------------------------- a toy mode


class SequenceMeanMode(Objective):
    """A toy loss: each row's mean next-token loss, averaged over the micro-batch's rows (every sequence weighs the
    same, however long), one process."""

    def gen_scale(self, gen_batches: list[dict]) -> float:
        return 1.0 / len(gen_batches)  # the step's mean over its micro-batches

    def passes(self, gen: dict, emb, scale) -> StepSums:
        logits = self.model(**model_inputs(gen), use_cache=False).logits[:, :-1].float()
        labels = gen["labels"][:, 1:]
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        trained = (labels != IGNORE_INDEX).sum(1).clamp(min=1)
        per_row = per_token.sum(1) / trained
        loss = per_row.mean()
        self.check.backward(loss * scale)
        return StepSums(gen_sum=loss.detach(), gen_count=1, gen_mean_sum=loss.detach(), gen_micro=1,
                        tokens=real_tokens(gen), positions=gen["input_ids"].numel(), samples=gen["input_ids"].shape[0],
                        flops=self.flops(gen, backward=True))

    def figures(self, sums: StepSums) -> dict:
        loss = sums.gen_sum / max(sums.gen_count, 1)
        return {"loss": loss, "sequence_mean_loss": loss}


def build_toy(cfg, parts: Parts) -> SequenceMeanMode:
    return SequenceMeanMode(cfg.loss, cfg.model, cfg.train.grad_accum, parts)


def register_toy() -> None:
    from harness import modes

    modes.register(ModeFacts("sequence_mean", gen_rows="sequences", tags=("text-generation", "toy")), build_toy)


def _harness_train(driver: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`harness train ARGS` in a fresh interpreter, after `driver` (this file's code) ran in it."""
    code = f"import sys\n{driver}\nfrom harness import cli\nsys.exit(cli.main(['train', *sys.argv[1:]]))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with cpu_slots(1):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)


def test_a_mode_registered_from_a_test_file_trains_through_harness_train(tmp_path):
    """The sixth mode above, registered here (no edit to build.py, train.py or objective.py), trains 3 steps: its
    own loss is the logged one, and its facts reach the model card."""
    out = tmp_path / "run"
    proc = _harness_train("import test_modes; test_modes.register_toy()",
                          ["configs/default.yaml", "loss.mode=sequence_mean", "train.max_steps=3",
                           f"train.output_dir={out}", *FAST])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["sequence_mean_loss"] == m["loss"] and torch.isfinite(torch.tensor(m["loss"])) for m in steps)
    assert json.loads((out / "report.json").read_text())["loss_mode"] == "sequence_mean"
    assert "- toy" in (out / "final" / "README.md").read_text()  # the model card's tags, from the mode's facts


def test_an_unregistered_mode_is_one_line():
    from harness.config import load_config
    from harness.errors import ConfigError

    try:
        load_config(str(ROOT / "configs/default.yaml"), ["loss.mode=sequence_means"])
    except ConfigError as e:
        assert str(e).startswith("config key 'loss.mode': expected one of 'generative', 'embedding'"), e
    else:
        raise AssertionError("an unknown loss.mode loaded")


COUNT_TASKS = """
from harness.rl import prompts
built = []
def counted(fn):
    def inner(*a, **k):
        built.append(fn.__name__)
        return fn(*a, **k)
    return inner
prompts.build_task = counted(prompts.build_task)
prompts.PromptTask = counted(prompts.PromptTask)
import atexit
atexit.register(lambda: print('tasks built:', len(built), flush=True))
"""


def test_the_rl_task_is_built_once_a_run(tmp_path):
    """loss.mode=rl reads its questions from the task: the question stream and the rollouts share the one built
    (the build made it twice: for the loader and for the rollouts)."""
    from test_rl import TINY

    proc = _harness_train(COUNT_TASKS, [
        "configs/grpo-tiny.yaml", *TINY, "rl.reward=rl_rewards:digits", "train.max_steps=1",
        "rl.questions_per_step=2", "rl.num_generations=2", "rft.max_new_tokens=4", "rft.num_test_questions=2",
        "train.eval_at_start=false", f"train.output_dir={tmp_path / 'rl'}", "train.progress_bar=false",
        "train.summary=false"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "tasks built: 1" in proc.stdout, proc.stdout[-2000:]

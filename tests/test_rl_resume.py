"""loss.mode=rl against changed settings and bad input (issue 55): resumed with changed settings (the task's questions
fingerprinted like training files, a changed rl setting taken with one line and a resumed_changes record, a half-used
generation batch that cannot continue dropped with one line, another model refused), from one stopped run
(checkpoints of step 1, the middle of a generation batch, and step 2, its end) resumed in copies of its folder; a
reward failing on one of 2 processes, a bad rft.test_file and prompts past the context, each one line.

    .venv/bin/python -m pytest tests/test_rl_resume.py
"""

from __future__ import annotations

import shutil

import pytest

from harness_launch import ROOT, report, run_train
from test_rl import ENV
from test_rl import RUN as RL_RUN

RUN = [a for a in RL_RUN if not a.startswith("rl.beta=")]  # rl.beta 0: these tests turn it on in a resume

CONFIG = str(ROOT / "configs/grpo-tiny.yaml")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl-stopped")
    run_train([*RUN, f"train.output_dir={out}", "train.save_every_steps=1", "train.stop_at_step=2"], config=CONFIG,
              extra_env=ENV)
    assert (out / "checkpoints" / "step-1").is_dir() and (out / "checkpoints" / "step-2").is_dir()
    return out


def resume(stopped, tmp_path, changes: list, step: int = 2, check: bool = False):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    return out, run_train([*RUN, f"train.output_dir={out}", f"train.resume={out / 'checkpoints' / f'step-{step}'}",
                           *changes], config=CONFIG, extra_env=ENV, check=check)


def error_line(proc) -> str:
    err = proc.stderr
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode != 0 and "Traceback" not in err and lines[-1].startswith("harness: error: "), err[-3000:]
    return lines[-1]


def test_every_sampling_setting_is_compared_on_resume():
    """The settings a resumed rl run compares with its checkpoint's (checkpoint/settings.py: a change is said in one
    line and recorded in resumed_changes, applied from the next generation batch) cover every sampling knob of the
    engine: rft.top_k and rft.min_p were left out, so a resume that changed them sampled differently with no word."""
    from harness.checkpoint import settings
    from harness.config import load_config

    def changed(extra: list) -> dict:
        a, b = load_config(CONFIG, []), load_config(CONFIG, extra)
        now = [settings.current(c.model, c.data, "rl", {"rl": c.rl, "rft": c.rft}) for c in (a, b)]
        return settings.compare(*now)

    assert changed([]) == {}
    for key, value in (("rft.temperature", 0.7), ("rft.top_p", 0.9), ("rft.top_k", 5), ("rft.min_p", 0.1),
                       ("rl.rows", "padded")):
        assert set(changed([f"{key}={value}"])) == {key}, key


def test_the_task_fingerprint_covers_what_makes_the_questions(tmp_path):
    """Fault 2 in process: the fingerprints compared on resume (checkpoint/datafiles.py) hold the rl task's."""
    from harness.checkpoint import datafiles
    from harness.config import load_config

    def changes(a: list, b: list) -> list:
        fp = [datafiles.fingerprints(c.data, "rl", c.rft) for c in (load_config(CONFIG, a), load_config(CONFIG, b))]
        return datafiles.compare(*fp)

    assert changes([], []) == []
    assert changes([], ["rft.task_seed=1"]) == ["rft.task: arithmetic changed (rft.task_seed 0 -> 1)"]
    assert changes([], ["rft.max_operand=11", "rft.num_train_questions=100"]) == [
        "rft.task: arithmetic changed (rft.num_train_questions 400 -> 100, rft.max_operand 12 -> 11)"]
    assert changes([], ["rft.max_operand=11"]) and changes([], ["rft.num_train_questions=100"])
    task = tmp_path / "q.jsonl"
    task.write_text('{"question": "What is 1 + 1?", "answer": 2}\n')
    before = datafiles.fingerprints(load_config(CONFIG, []).data, "rl", load_config(CONFIG, [f"rft.task={task}"]).rft)
    task.write_text('{"question": "What is 2 + 2?", "answer": 4}\n' + task.read_text())
    after = datafiles.fingerprints(load_config(CONFIG, []).data, "rl", load_config(CONFIG, [f"rft.task={task}"]).rft)
    assert datafiles.compare(before, after) == [f"rft.task: {task} changed (44 -> 88 bytes)"]
    del before["rft.task"]  # a checkpoint of an older harness: no task to compare
    assert datafiles.compare(before, after) == []


def test_the_rl_prompts_files_are_fingerprinted(tmp_path):
    """rl.prompts files are compared on resume as data.train_files are (checkpoint/datafiles.py; resume.py refuses a
    change in one line unless train.resume_changed_data): a prompt file edited in place, one added, are changes."""
    from harness.checkpoint import datafiles
    from harness.config import load_config

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n')
    b.write_text('{"prompt": "What is 2 + 2?", "answer": 4}\n')

    def fp(files: list) -> dict:
        c = load_config(CONFIG, [f"rl.prompts=[{','.join(str(f) for f in files)}]"])
        return datafiles.fingerprints(c.data, "rl", c.rft, c.rl)

    before = fp([a])
    assert before["rl.prompts"] == [[str(a), before["rl.prompts"][0][1]]] and datafiles.compare(before, fp([a])) == []
    assert datafiles.compare(before, fp([a, b])) == [f"rl.prompts: {b} is not among the files the checkpoint's run "
                                                     f"trained on"]
    a.write_text('{"prompt": "What is 3 + 3?", "answer": 6}\n' + a.read_text())
    assert datafiles.compare(before, fp([a])) == [f"rl.prompts: {a} changed (42 -> 84 bytes)"]


@pytest.mark.parametrize("change", ["rft.task_seed=1", "jsonl"])
def test_another_task_is_refused(stopped, tmp_path, change):
    """Fault 2: resumed with another task (the arithmetic task's seed, a JSONL task edited in place), the run
    continued the old question stream's position in another question set, silently. Now one line naming it."""
    if change == "jsonl":  # a JSONL task run, its file then edited in place
        task = tmp_path / "task.jsonl"
        task.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": {i + 1}}}\n' for i in range(12)))
        out = tmp_path / "jsonl"
        run_train([*RUN, f"train.output_dir={out}", f"rft.task={task}", "rft.test_file=null", "train.eval_every=0",
                   "train.stop_at_step=1"], config=CONFIG, extra_env=ENV)
        task.write_text('{"question": "What is 9 x 9?", "answer": 81}\n' + task.read_text())
        proc = run_train([*RUN, f"train.output_dir={out}", f"rft.task={task}", "rft.test_file=null",
                          "train.eval_every=0"], config=CONFIG, extra_env=ENV, check=False)
        line = error_line(proc)
        assert f"(rft.task: {task} changed (" in line, line
        return
    out, proc = resume(stopped, tmp_path, [change])
    line = error_line(proc)
    assert line.startswith("harness: error: the training data changed since ") and "(rft.task: arithmetic " \
        "changed (" in line and "train.resume_changed_data=true" in line, line


def test_a_reward_that_fails_on_process_1_only_is_one_line_from_the_main_process(tmp_path):
    """Fault 3: under 2 processes a reward that raised on one process lost its cause: no `harness: error:` line, the
    other process a raw traceback (8 harness frames, gloo's `Connection closed by peer`). Now the failing process's
    line, naming the question, is printed once by the main process, and no traceback shows a harness frame."""
    import re

    proc = run_train([*RUN, f"train.output_dir={tmp_path}", "rl.reward=rl_rewards:raises_on_rank_1",
                      "train.max_steps=1"], nproc=2, config=CONFIG, extra_env=ENV, check=False, timeout=900)
    said = proc.stdout + proc.stderr
    errors = [ln for ln in said.splitlines() if "harness: error:" in ln]
    assert proc.returncode != 0 and len(errors) == 1, said[-4000:]
    assert re.fullmatch(r"harness: error: config key 'rl.reward': rl_rewards:raises_on_rank_1 raised ValueError: no "
                        r"score on process 1 \(question train-\d+\)", errors[0]), errors
    assert not re.search(r'File ".*/harness/', said), said[-4000:]


def test_changed_settings_in_the_middle_of_a_batch_start_a_new_one(stopped, tmp_path):
    """Fault 4: resumed in the middle of a generation batch (step 1 of 2) with another rl.num_generations and
    rl.beta: a raw traceback (a tensor size mismatch; "rl.beta > 0 needs the reference log-probs"), and at
    num_generations 2 the message called both intact checkpoints damaged. Now the saved batch, which cannot
    continue, is dropped with one line and a new one is sampled."""
    out, proc = resume(stopped, tmp_path, ["rl.num_generations=2", "rl.beta=0.1"], step=1, check=True)
    assert ("[harness] rl: no generation batch to continue at step 2 (rl.num_generations changed since: it has 4 "
            "answers a question): a new one starts here") in proc.stdout, proc.stdout[-3000:]
    assert report(out)["resumed_changes"]["rl.num_generations"]["from_step"] == 2


def test_changed_settings_at_a_batch_boundary_are_said_and_recorded(stopped, tmp_path):
    """Faults 2 and 5: at a generation batch's boundary (step 2 of rl.iterations 2), another task with
    train.resume_changed_data=true trains the new questions from a new epoch; a changed rl.num_generations, rl.reward
    or rl.beta was taken with no line and no record (a changed optim.lr gets both): now each has its line and its
    resumed_changes record."""
    out, proc = resume(stopped, tmp_path, ["rft.task_seed=1", "train.resume_changed_data=true",
                                           "rl.num_generations=2", "rl.reward=verifier", "rl.beta=0.1"], check=True)
    changes = report(out)["resumed_changes"]
    assert changes["data"]["from_epoch"] == 1 and changes["data"]["from_step"] == 3, changes
    assert changes["rl.num_generations"] == {"from": 4, "to": 2, "from_step": 3}, changes
    assert changes["rl.reward"] == {"from": "rl_rewards:digits", "to": "verifier", "from_step": 3}, changes
    assert changes["rl.beta"] == {"from": 0.0, "to": 0.1, "from_step": 3}, changes
    assert "[harness] rl.num_generations changed since " in proc.stdout and ": 4 -> 2, applied from step 3" in \
        proc.stdout, proc.stdout[-3000:]


def test_another_model_is_refused(stopped, tmp_path):
    """Fault 9: model.name_or_path changed on resume was ignored (the checkpoint's weights continued)."""
    other = tmp_path / "other-model"
    other.mkdir()
    out, proc = resume(stopped, tmp_path, [f"model.name_or_path={other}"])
    line = error_line(proc)
    assert line.startswith(f"harness: error: config key 'model.name_or_path': the run to resume ({out}/checkpoints/"
                           f"step-2) trained a random init (null), this config names '{other}'; the checkpoint's "
                           f"weights would continue and '{other}' be ignored: rerun with "
                           f"model.name_or_path=null, "), line


def test_a_bad_test_file_is_one_line_before_step_1(tmp_path):
    """Fault 7: a JSONL task's missing (or empty, or bad) rft.test_file was found after the last step, when the final
    evaluation started: no final/, no report.json, the run's time spent. Now read with the task, before step 1."""
    task = tmp_path / "task.jsonl"
    task.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": {i + 1}}}\n' for i in range(8)))
    (tmp_path / "empty.jsonl").write_text("\n")
    proc = run_train([*RUN, f"train.output_dir={tmp_path / 'run'}", f"rft.task={task}",
                      f"rft.test_file={tmp_path / 'empty.jsonl'}"], config=CONFIG, extra_env=ENV, check=False)
    assert error_line(proc) == f"harness: error: {tmp_path / 'empty.jsonl'}: no questions"
    assert "step 1" not in proc.stdout and not (tmp_path / "run" / "metrics.jsonl").exists(), proc.stdout[-3000:]


def test_prompts_and_answers_past_the_context_are_refused_before_step_1(tmp_path):
    """Fault 8: prompts longer than the model's context, and rft.max_new_tokens past it, were sampled and trained on
    silently (the tiny model's context: 128 positions)."""
    from harness.errors import ConfigError
    from harness.rft.tasks import check_context

    with pytest.raises(ConfigError, match=r"'rft.max_new_tokens': 128 answer tokens do not fit the model's context of "
                                          r"128 positions"):
        check_context({"a": 5}, 128, 128)
    with pytest.raises(ConfigError, match=r"question b's prompt has 100 tokens, and with 40 answer tokens it exceeds "
                                          r"the model's context of 128 positions \(max_position_embeddings\); lower "
                                          r"rft.max_new_tokens to 28 or less"):
        check_context({"a": 5, "b": 100}, 40, 128)
    check_context({"a": 5, "b": 100}, 28, 128)
    from harness.errors import DataError

    with pytest.raises(DataError) as e:  # issue 73, fault 9: the advice was "lower rft.max_new_tokens to -552 or less"
        check_context({"a": 5, "b": 680}, 40, 128)
    assert str(e.value) == ("question b's prompt has 680 tokens, the model's whole context of 128 positions "
                            "(max_position_embeddings) or more, before any answer token: shorten the question, or use "
                            "a model with a longer context")
    proc = run_train([*RUN, f"train.output_dir={tmp_path / 'run'}", "rft.max_new_tokens=120"], config=CONFIG,
                     extra_env=ENV, check=False)
    line = error_line(proc)
    assert line.startswith("harness: error: config key 'rft.max_new_tokens': question ") and \
        "with 120 answer tokens it exceeds the model's context of 128 positions" in line, line

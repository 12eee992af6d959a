"""loss.mode=rl's prompt data and reward functions (harness/rl/prompts.py, docs/rl.md): rl.prompts, rl.rewards.

- a prompt JSONL (text and chat prompts, an extra column) with two weighted reward functions (one reading the column):
  each logged as reward/<name> and reward/<name>_std, `reward` their weighted sum, per answer; completions logged;
- a reward function that returns the wrong count, a string or raises stops in one line naming it;
- bad prompt records and reward entries are one line.

    python -m pytest tests/test_rl_prompts.py
"""

from __future__ import annotations

import json

import pytest
import torch

from harness_launch import ROOT, metrics, run_train

TINY = ["model.name_or_path=null", "model.tokenizer=bundled",
        "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}"]
ENV = {"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}
TWO = "[{function: rl_rewards:length_share, weight: 0.5}, {function: rl_rewards:target_digit, weight: 2.0}]"


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Count to five.", "target": 3},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a number."}],
             "target": 7},
            {"prompt": "Name a digit.", "target": 1},
            {"prompt": "Write anything.", "target": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path, *more):
    from harness.config import load_config

    return load_config(str(ROOT / "configs/grpo-tiny.yaml"),
                       [*TINY, f"rl.prompts=[{_prompts(tmp_path)}]", f"rl.rewards={TWO}", *more])


def test_rewards_are_weighted_and_none_is_left_out(tmp_path, monkeypatch):
    from harness.rl.prompts import Rewards, rl_task

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = _config(tmp_path)
    task = rl_task(cfg.rl, cfg.rft)
    qs = task.split("train")
    assert [q.columns["target"] for q in qs] == [3, 7, 1, None] and task.split("test") == []
    assert task.messages(qs[0]) == [{"role": "user", "content": "Count to five."}]
    assert task.messages(qs[1])[0] == {"role": "system", "content": "Be brief."}
    rewards = Rewards(cfg.rl, task)
    assert rewards.names == ["length_share", "target_digit"]
    texts = ["abc 3", "7", "no", "4444"]
    weighted, per = rewards.score(qs, texts, [[1]] * 4)
    assert per[:, 0].tolist() == [5 / 40, 1 / 40, 2 / 40, 4 / 40]
    assert per[:3, 1].tolist() == [1.0, 1.0, 0.0] and torch.isnan(per[3, 1])  # None: no score, left out
    assert weighted.tolist() == pytest.approx([0.5 * 5 / 40 + 2, 0.5 / 40 + 2, 0.5 * 2 / 40, 0.5 * 4 / 40])


def _no_target(tmp_path):
    path = tmp_path / "untargeted.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}.", "target": None}) + "\n" for i in range(4)))
    return path


def test_rewards_that_never_score_are_said_once_then_stop_the_run(tmp_path, monkeypatch, capsys):
    """Every function returns None for every answer (a column-name mistake): the first such generation batch is a
    warning naming the functions, said once; NO_SCORE_BATCHES of them before any score stop the run in one line
    (failed before: it trained nothing at full price, without a word). A batch with one score ends the count."""
    from harness.errors import HarnessError
    from harness.rl.prompts import NO_SCORE_BATCHES, Rewards, rl_task

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = _config(tmp_path, "rl.rewards=[rl_rewards:never_scores, rl_rewards:target_digit]",
                  f"rl.prompts=[{_no_target(tmp_path)}]")
    task = rl_task(cfg.rl, cfg.rft)
    rewards = Rewards(cfg.rl, task)
    args = (task.split("train"), ["a", "b", "c", "d"], [[1]] * 4)
    assert [q.columns["target"] for q in args[0]] == [None] * 4  # target_digit: None without a target
    for _ in range(NO_SCORE_BATCHES - 1):
        weighted, _ = rewards.score(*args)
        assert torch.isnan(weighted).all()
    said = [line for line in capsys.readouterr().out.splitlines() if "scored none" in line]
    assert said == ["[harness] warning: rl.rewards: rl_rewards:never_scores, rl_rewards:target_digit scored none of "
                    "this generation batch's answers (every value None): its answers train nothing"]
    with pytest.raises(HarnessError) as e:
        rewards.score(*args)
    assert str(e.value) == (f"config key 'rl.rewards': rl_rewards:never_scores, rl_rewards:target_digit scored none "
                            f"of the answers (every value None) of {NO_SCORE_BATCHES} generation batches: nothing "
                            f"trains; check the columns they read")
    ok_cfg = _config(tmp_path)
    ok_task = rl_task(ok_cfg.rl, ok_cfg.rft)
    ok = Rewards(ok_cfg.rl, ok_task)  # target_digit scores 3 of 4: no warning, never stopped
    for _ in range(NO_SCORE_BATCHES + 1):
        ok.score(ok_task.split("train"), *args[1:])
    assert "scored none" not in capsys.readouterr().out


@pytest.mark.parametrize("fn, said", [
    ("wrong_count", "config key 'rl.rewards[1]': rl_rewards:wrong_count returned 3 values for 4 completions "
                    "(one float or None each)"),
    ("a_string", "config key 'rl.rewards[1]': rl_rewards:a_string returned 'high' (str) for completion 0: a finite "
                 "float or None is needed"),
    ("fails", "config key 'rl.rewards[1]': rl_rewards:fails raised RuntimeError: reward server down"),
    # failed before: NaN taken as None ("no score") without a word
    ("a_nan", "config key 'rl.rewards[1]': rl_rewards:a_nan returned nan (float) for completion 0: a finite float "
              "or None is needed"),
])
def test_a_bad_reward_function_is_one_line_naming_it(tmp_path, monkeypatch, fn, said):
    from harness.errors import HarnessError
    from harness.rl.prompts import Rewards, rl_task

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = _config(tmp_path, f"rl.rewards=[rl_rewards:length_share, rl_rewards:{fn}]")
    task = rl_task(cfg.rl, cfg.rft)
    with pytest.raises(HarnessError) as e:
        Rewards(cfg.rl, task).score(task.split("train"), ["a", "b", "c", "d"], [[1]] * 4)
    assert str(e.value) == said


def test_bad_prompt_data_and_reward_entries(tmp_path):
    from harness.config import load_config
    from harness.errors import ConfigError, DataError
    from harness.rl.prompts import rl_task

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    cfg = load_config(str(ROOT / "configs/grpo-tiny.yaml"), [f"rl.prompts=[{bad}]"])
    with pytest.raises(DataError) as e:
        rl_task(cfg.rl, cfg.rft)
    assert str(e.value).startswith(f"{bad}:2: no field 'prompt' (keys: question;")
    cfg = load_config(str(ROOT / "configs/grpo-tiny.yaml"), [f"rl.prompts=[{{path: {bad}, columns: {{prompt: "
                                                             f"question}}}}]"])
    with pytest.raises(DataError, match=r"bad.jsonl:1: column 'question'"):
        rl_task(cfg.rl, cfg.rft)
    with pytest.raises(ConfigError, match=r"config key 'rl.rewards\[0\]': unknown key 'wieght'"):
        load_config(str(ROOT / "configs/grpo-tiny.yaml"), ["rl.rewards=[{function: verifier, wieght: 1}]"])
    with pytest.raises(ConfigError, match=r"config key 'rl.rewards\[0\].function': expected 'verifier' or"):
        load_config(str(ROOT / "configs/grpo-tiny.yaml"), ["rl.rewards=[{function: nocolon}]"])


def test_a_run_on_prompt_data_logs_each_reward_and_completions(tmp_path):
    """2 steps of 2 prompts x 4 answers from a prompt JSONL (its `target` column read by one of the two reward
    functions), data.train_files naming a missing file (an rl run reads none): each function's mean and std logged,
    `reward` their weighted sum per answer, 3 completions rows in each log line."""
    out = tmp_path / "run"
    args = [*TINY, f"rl.prompts=[{_prompts(tmp_path)}]", f"rl.rewards={TWO}", "rl.log_completions=3",
            "data.train_files=[missing-sft.jsonl]", "train.max_steps=2", "rl.questions_per_step=2",
            "rl.num_generations=4", "rft.max_new_tokens=8", "train.eval_at_start=false", "optim.warmup_steps=0",
            "train.progress_bar=false", "train.summary=false", "train.log_every=1", f"train.output_dir={out}"]
    run_train(args, config=str(ROOT / "configs/grpo-tiny.yaml"), extra_env=ENV)
    steps = [m for m in metrics(out) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0 < m["reward/length_share"] <= 8 * 16 / 40 and m["reward/length_share_std"] >= 0
        assert 0 <= m["reward/target_digit"] <= 1 and m["reward/target_digit_std"] >= 0
        rows = m["completions"]
        assert len(rows) == 3 and all(set(r) == {"prompt", "completion", "reward", "advantage"} for r in rows)
        for r in rows:  # the weighted sum: 0.5 x length / 40 + 2 x (0 or 1; None counts 0); the log decodes
            rest = r["reward"] - 0.5 * len(r["completion"].strip()) / 40  # the ids again: whitespace may differ
            assert min(abs(rest), abs(rest - 2.0)) < 0.05, r

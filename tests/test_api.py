"""The Python API beside the CLI (issue 74): `harness.train(config, overrides, reward_funcs=[fn])` is the run
`harness train` makes, with a function given as an object where the recipe names one by a spec; specs as
`path/to/file.py:name` (a recipe's relative path from its folder), and the import error says where it looked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness_launch import ROOT, cpu_slots, metrics, run_train

# grpo-tiny on a random tiny model: 2 steps of 2 questions x 4 answers, a reward that varies among its answers
RUN = ["model.name_or_path=null", "model.tokenizer=bundled",
       "model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
       "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}",
       "train.max_steps=2", "rl.questions_per_step=2", "rl.num_generations=4", "rft.max_new_tokens=8",
       "train.eval_at_start=false", "train.eval_every=100", "optim.lr=3e-3", "optim.warmup_steps=0",
       "train.progress_bar=false", "train.summary=false", "train.log_every=1", "train.save_final=false"]

# the function as a TRL user writes it in their own script (tests/rl_rewards.py's length_share, the CLI's spec)
SCRIPT = """
import json, sys
import harness
from harness.errors import RunFailed

def length_share(prompts, completions, **_):
    return [len(c[0]["content"] if isinstance(c, list) else c) / 40 for c in completions]

report = harness.train("configs/grpo-tiny.yaml", json.loads(sys.argv[1]), reward_funcs=[length_share])
print("steps", report["steps"])
try:
    harness.train("configs/grpo-tiny.yaml", ["train.max_stepz=1"], reward_funcs=[length_share])
except RunFailed as e:
    print("failed", e.status)
"""


def test_python_api_trains_as_the_cli_does_with_the_function_given(tmp_path):
    import json

    cli, api = tmp_path / "cli", tmp_path / "api"
    run_train([*RUN, f"rl.rewards=[{{function: {ROOT / 'tests' / 'rl_rewards.py'}:length_share}}]",
               f"train.output_dir={cli}"], config=str(ROOT / "configs/grpo-tiny.yaml"))
    with cpu_slots(1):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([*RUN, f"train.output_dir={api}"])], cwd=ROOT,
                              capture_output=True, text=True, timeout=600,
                              env={**{k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"},
                                   "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "steps 2" in proc.stdout
    # a failed run: its one line printed, then RunFailed with the command's exit status (2: a config error)
    assert "failed 2" in proc.stdout and "train.max_stepz" in proc.stderr
    theirs, ours = metrics(cli), metrics(api)
    assert [m["step"] for m in ours] == [1, 2] == [m["step"] for m in theirs]
    for a, b in zip(ours, theirs):
        # the same process, config and seeds: the same arithmetic (1e-6: the bound the issue states)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["reward"] == pytest.approx(b["reward"], abs=1e-6)
        assert a["reward/length_share"] == pytest.approx(b["reward/length_share"], abs=1e-6)
    saved = (api / "config.yaml").read_text()
    assert "function: __main__:length_share" in saved  # config.yaml names the function that trained the run


def test_a_recipe_names_a_reward_file_from_its_own_folder(tmp_path, monkeypatch):
    from harness.config import load_config
    from harness.config.objects import load
    from harness.errors import ConfigError

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text("def short(prompts, completions, **_):\n    return [1.0] * len(completions)\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent("""\
        model: {name_or_path: runs/rft-tiny/warmup/final}
        loss: {mode: rl}
        rl:
          rewards:
            - {function: rewards/mine.py:short, weight: 2.0}
    """))
    monkeypatch.chdir(ROOT)  # launched from elsewhere: the recipe's folder, not the launch folder, finds the file
    spec = load_config(recipe).rl.rewards[0]["function"]
    assert spec == f"{tmp_path / 'rewards' / 'mine.py'}:short"
    assert load(spec, "rl.rewards[0].function")([], ["a", "b"]) == [1.0, 1.0]
    with pytest.raises(ConfigError) as e:
        load("rewards/nothere.py:short", "rl.rewards[0].function")
    assert f"looked at {ROOT / 'rewards' / 'nothere.py'}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load("no_such_module_here:fn", "rl.rewards[0].function")
    assert "no module 'no_such_module_here'" in str(e.value) and f"looked in {ROOT}" in str(e.value)
    with pytest.raises(ConfigError, match=r"mine.py has no 'long'"):
        load(f"{tmp_path / 'rewards' / 'mine.py'}:long", "rl.rewards[0].function")
    (tmp_path / "rewards" / "broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    with pytest.raises(ConfigError, match=r"broken.py raised RuntimeError: needs a GPU"):
        load(f"{tmp_path / 'rewards' / 'broken.py'}:fn", "rl.rewards[0].function")


# TRL's environment_factory as a class in the user's own script (a subclass of the shipped calculator, renamed so
# that its reward is logged under its own name), given to harness.train(environment=...)
AGENT_SCRIPT = """
import json, sys
import harness
from harness.rl.calculator import Calculator

class MyCalculator(Calculator):
    pass

report = harness.train("configs/agent-tiny.yaml", json.loads(sys.argv[1]), environment=MyCalculator)
print("steps", report["steps"])
"""
AGENT_RUN = ["model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
             "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512}", "train.max_steps=1",
             "rl.num_generations=2", "rft.max_new_tokens=24", "train.progress_bar=false", "train.save_final=false"]


def test_python_api_takes_an_environment_class_as_trl_takes_environment_factory(tmp_path):
    """harness.train(config, overrides, environment=Class) (issue 74; TRL's environment_factory): the class defined
    in the caller's script runs the episodes, its get_reward() logged under its name, config.yaml names it; the step
    equals the CLI run with the shipped class as a spec (the subclass changes nothing: the same draws, 1e-6)."""
    import json

    from harness.config.objects import agent_overrides, load
    from harness.rl.calculator import Calculator

    assert load(json.loads(agent_overrides(None, Calculator)[0].partition("=")[2]), "rl.environment") is Calculator
    cli, api = tmp_path / "cli", tmp_path / "api"
    run_train([*AGENT_RUN, f"train.output_dir={cli}"], config=str(ROOT / "configs/agent-tiny.yaml"), timeout=300)
    with cpu_slots(1):
        proc = subprocess.run([sys.executable, "-c", AGENT_SCRIPT, json.dumps([*AGENT_RUN, f"train.output_dir={api}"])],
                              cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**{k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"},
                                   "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0 and "steps 1" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    (ours,), (theirs,) = metrics(api), metrics(cli)
    assert "reward/MyCalculator" in ours and "reward/Calculator" in theirs
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    assert ours["reward/MyCalculator"] == pytest.approx(theirs["reward/Calculator"], abs=1e-6)
    assert "environment: __main__:MyCalculator" in (api / "config.yaml").read_text()

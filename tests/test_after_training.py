"""After training: the model card final/README.md (front matter, figures equal to report.json's), `harness chat`
on a tiny run's export (two user turns piped in, a folder without chat template refused), and `harness push`'s
one-line errors (offline, no final/; no network here).

    .venv/bin/python -m pytest tests/test_after_training.py      # one tiny run, ~40 s on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness_launch import FAST, ROOT, report, run_train

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("after") / "run"
    run_train([*FAST, "train.max_steps=2", "data.eval_files=[data/sample/gen_eval.jsonl]", f"train.output_dir={out}"])
    return out


def harness(*args: str, stdin: str = "", **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, input=stdin, env=full,
                          capture_output=True, text=True, timeout=300)


def card_table(text: str) -> dict[str, str]:
    rows = [line.strip("|").split("|") for line in text.split("## Results")[1].split("##")[0].splitlines()
            if line.startswith("| ") and "---" not in line]
    return {k.strip(): v.strip() for k, v in rows[1:]}


def test_model_card_front_matter_and_figures(run_dir):
    text = (run_dir / "final" / "README.md").read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["library_name"] == "transformers" and "harness" in meta["tags"]
    assert meta["pipeline_tag"] == "text-generation" and "base_model" not in meta  # random init: no base
    rep, fig = report(run_dir), card_table(text)
    num = lambda s: float(s.replace(",", ""))  # noqa: E731
    assert num(fig["Optimizer steps"]) == rep["steps"] == 2 and num(fig["Tokens trained"]) == rep["tokens"]
    for label, key in [("Final train loss", "final_loss"), ("Tokens/s", "tokens_per_s"),
                       ("Training time (s)", "train_time_s"), ("Wall time (s)", "wall_time_s")]:
        assert num(fig[label]) == pytest.approx(rep[key], rel=1e-5), label
    assert num(fig["Eval loss"]) == pytest.approx(rep["eval"]["eval_loss"], rel=1e-5)
    assert fig["Hardware"].startswith("CPU") and "data/sample/gen.jsonl" in text
    assert "AutoModelForCausalLM.from_pretrained" in text and "<summary>config.yaml</summary>" in text
    assert (run_dir / "config.yaml").read_text().strip() in text


def test_model_card_unified_lora_and_failure(tmp_path):
    from harness.observe.modelcard import front_matter, try_write_model_card

    cfg = {"model": {"name_or_path": "mistralai/Mistral-7B-v0.1"}, "loss": {"mode": "unified"}}
    meta = front_matter(cfg, lora=True)
    assert meta["library_name"] == "peft" and meta["base_model"] == "mistralai/Mistral-7B-v0.1"
    assert {"sentence-similarity", "feature-extraction", "text-generation"} <= set(meta["tags"])
    said = []
    assert try_write_model_card(tmp_path, said.append) is None  # no config.yaml: a warning, no exception
    assert len(said) == 1 and said[0].startswith("[harness] warning: no model card written")


def test_chat_two_turns_and_missing_template(run_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(run_dir / "final", plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)  # a model folder without a chat template
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    r = harness("chat", str(plain), "--max-new-tokens", "5", stdin="hello\n")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no chat template" in r.stderr, r.stderr

    from transformers import AutoTokenizer

    from harness.data.chat import GRITLM_TEMPLATE

    assert AutoTokenizer.from_pretrained(run_dir / "final").chat_template == GRITLM_TEMPLATE  # the training layout
    r = harness("chat", str(run_dir / "final"), "--max-new-tokens", "5", "--temperature", "0",
                stdin="What is 2 + 3?\nAnd 4 + 4?\n/reset\nhi\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "(conversation cleared)" in lines and "> " not in r.stdout  # no prompt without a terminal
    assert lines.index("(conversation cleared)") >= 2 and len(lines) >= 4  # two replies, the reset, one more

def test_push_errors_are_one_line(run_dir, tmp_path):
    r = harness("push", str(run_dir), "someone/tiny-model")
    assert r.returncode != 0 and "someone/tiny-model" in r.stderr and "offline" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    r = harness("push", str(tmp_path), "someone/tiny-model")
    assert r.returncode == 2 and "final not found" in r.stderr and "Traceback" not in r.stderr

"""Every place a user can be wrong, through the `harness` command: one line `harness: error: ...` naming the file,
line and field or the config key, a non-zero exit, no traceback.

The table runs the real entry point (`harness.cli.main`) in this process (each case stops before any training
process group exists); one case is also run as a separate process to show the exit status and the absence of a
traceback as a shell sees them.

    .venv/bin/python -m pytest tests/test_bad_inputs.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub.constants import HF_HUB_CACHE

from harness import cli
from harness.config.modes import MODES

ROOT = Path(__file__).resolve().parent.parent
GOOD_GEN = '{"text": "a fine sample"}\n'
GOOD_EMB = '{"query": "q", "pos": ["p"], "neg": ["n"]}\n'

# (name, files {name: content}, argv ({d} = the temporary folder), exit status, the exact stderr line)
CASES = [
    # ---- data files (harness data-check validates exactly as training does)
    ("malformed-json", {"a.jsonl": GOOD_GEN + '{"text": "broken\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: invalid JSON, column 10: Unterminated string starting at"),
    ("not-an-object", {"a.jsonl": GOOD_GEN + "[1, 2]\n"}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: expected a JSON object, got list"),
    ("empty-file", {"a.jsonl": ""}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl: file is empty (no records)"),
    ("missing-path", {}, ["data-check", "{d}/nope.jsonl"], 1,
     "harness: error: {d}/nope.jsonl: no such file or folder (paths; relative paths are read from {cwd})"),
    ("empty-folder", {"sub/x.txt": "x"}, ["data-check", "{d}/sub"], 1,
     "harness: error: {d}/sub: folder has no data files (*.jsonl, *.json, *.jsonl.gz, *.parquet, *.csv, *.tsv, "
     "*.arrow) (paths)"),
    ("missing-field", {"a.jsonl": '{"txt": "x"}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:1: missing field 'text' or 'messages' (keys: txt)"),
    ("wrong-type", {"a.jsonl": GOOD_GEN + '{"text": 5}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: field 'text' must be a string, got int"),
    ("empty-text", {"a.jsonl": '{"text": ""}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:1: field 'text' is empty"),
    ("text-and-messages", {"a.jsonl": '{"text": "x", "messages": []}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:1: record has both 'text' and 'messages'; give one"),
    ("bad-role", {"a.jsonl": '{"messages": [{"role": "bot", "content": "x"}]}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:1: field 'messages[0].role' must be one of system, user, assistant, tool, got 'bot'"),
    ("no-assistant", {"a.jsonl": '{"messages": [{"role": "user", "content": "x"}]}\n'}, ["data-check", "{d}/a.jsonl"],
     1, "harness: error: {d}/a.jsonl:1: field 'messages' has no assistant turn (nothing to train on)"),
    ("not-utf8", {"a.jsonl": GOOD_GEN.encode() + b'{"text": "caf\xe9"}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: not UTF-8 text (byte 0xe9 at column 14); convert the file, e.g. iconv -f latin1 "
     "-t utf-8"),
    ("lone-surrogate", {"a.jsonl": GOOD_GEN + '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
                                              '"content": "a \\ud800"}]}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: field 'messages[1].content' has an unpaired surrogate \\ud800 at character 3 "
     "(not valid Unicode)"),
    ("message-not-object", {"a.jsonl": '{"messages": ["hi"]}\n'}, ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:1: field 'messages[0]' must be an object with role and content"),
    ("json-nested-too-deeply", {"a.jsonl": GOOD_GEN + '{"text": "x", "n": ' + "[" * 200_000 + "]" * 200_000 + "}\n"},
     ["data-check", "{d}/a.jsonl"], 1,
     "harness: error: {d}/a.jsonl:2: JSON nested too deeply (more than about 1000 levels of arrays or objects)"),
    ("json-5000-digit-integer", {"a.jsonl": '{"text": "x", "n": ' + "9" * 5000 + "}\n"}, ["data-check", "{d}/a.jsonl"],
     1, "harness: error: {d}/a.jsonl:1: an integer of 5000 digits (Python reads at most 4300); write it as a string"),
    # ---- config files and keys
    ("config-a-folder", {}, ["train", "configs"], 2,
     "harness: error: config file configs is a folder; give a recipe file, e.g. configs/default.yaml"),
    ("config-latin1-byte", {"c.yaml": b"train:\n  max_steps: 3\n  run_name: caf\xe9\n"}, ["train", "{d}/c.yaml"], 2,
     "harness: error: {d}/c.yaml:3: not UTF-8 text (byte 0xe9 at column 16); convert the file, e.g. iconv -f latin1 "
     "-t utf-8"),
    ("config-5000-digit-integer", {"c.yaml": "train:\n  max_steps: " + "9" * 5000 + "\n"}, ["train", "{d}/c.yaml"], 2,
     "harness: error: {d}/c.yaml:2: invalid YAML (an integer of 5000 digits (Python reads at most 4300))"),
    ("config-nested-too-deeply", {"c.yaml": "train:\n  run_name: " + "[" * 200_000 + "]" * 200_000 + "\n"},
     ["train", "{d}/c.yaml"], 2, "harness: error: {d}/c.yaml: invalid YAML (nested too deeply: more than about 1000 "
                                 "levels)"),
    ("override-5000-digit-integer", {}, ["train", "configs/default.yaml", "train.max_steps=" + "9" * 5000], 2,
     "harness: error: config key 'train.max_steps': an integer of 5000 digits (Python reads at most 4300)"),
    ("config-missing", {}, ["train", "{d}/nope.yaml"], 2, "harness: error: config file not found: {d}/nope.yaml"),
    ("config-bad-yaml", {"c.yaml": "train:\n  max_steps: [1,\n"}, ["train", "{d}/c.yaml"], 2,
     "harness: error: {d}/c.yaml:3: invalid YAML (expected the node content, but found '<stream end>')"),
    ("config-duplicate-key", {"c.yaml": "train:\n  max_steps: 3\n  log_every: 1\n  max_steps: 4\n"}, ["train", "{d}/c.yaml"], 2,
     "harness: error: {d}/c.yaml:4: invalid YAML (key 'max_steps' given twice, first on line 2)"),
    ("config-not-mapping", {"c.yaml": "- a\n- b\n"}, ["train", "{d}/c.yaml"], 2,
     "harness: error: {d}/c.yaml: expected a mapping of sections (model:, data:, optim:, train:)"),
    ("unknown-section", {}, ["train", "configs/default.yaml", "trian.max_steps=3"], 2,
     "harness: error: unknown config section 'trian' (did you mean 'train'?)"),
    ("unknown-key", {}, ["train", "configs/default.yaml", "train.max_step=3"], 2,
     "harness: error: unknown config key 'train.max_step' (did you mean 'max_steps'?)"),
    ("wrong-type-key", {}, ["train", "configs/default.yaml", "optim.lr=fast"], 2,
     "harness: error: config key 'optim.lr': expected float, got 'fast'"),
    ("bad-choice", {}, ["train", "configs/default.yaml", "loss.mode=both"], 2,
     "harness: error: config key 'loss.mode': expected one of " + ", ".join(map(repr, MODES)) + ", got 'both'"),
    ("negative-value", {}, ["train", "configs/default.yaml", "train.grad_accum=0"], 2,
     "harness: error: config key 'train.grad_accum': must be >= 1, got 0"),
    ("unknown-profile", {}, ["train", "configs/default.yaml", "train.profile=turbo"], 2,
     "harness: error: config key 'train.profile': unknown profile 'turbo' (known: conservative, balanced, aggressive, "
     "memory_efficient)"),
    ("negative-nonfinite-skips", {}, ["train", "configs/default.yaml", "train.max_nonfinite_skips=-1"], 2,
     "harness: error: config key 'train.max_nonfinite_skips': must be >= 0, got -1"),
    ("heads-do-not-divide", {}, ["train", "configs/default.yaml", "model.config.num_attention_heads=3"], 2,
     "harness: error: config key 'model.config.num_attention_heads': must divide model.config.hidden_size (256), "
     "got 3"),
    ("output-dir-is-a-file", {"out": "x"}, ["train", "configs/default.yaml", "train.output_dir={d}/out"], 2,
     "harness: error: config key 'train.output_dir': {d}/out is a file, not a folder"),
    ("fp16-on-cpu", {}, ["train", "configs/default.yaml", "train.precision=fp16"], 2,
     "harness: error: config key 'train.precision': fp16 needs a CUDA GPU; use fp32 or bf16 on CPU"),
    ("flash-attention-on-cpu", {}, ["train", "configs/default.yaml", "model.attn_implementation=flash_attention_2"], 2,
     "harness: error: config key 'model.attn_implementation': flash_attention_2 needs a CUDA GPU; use sdpa on this "
     "machine"),
    ("flex-attention-on-cpu", {}, ["train", "configs/default.yaml", "model.attn_implementation=flex_attention"], 2,
     "harness: error: config key 'model.attn_implementation': flex_attention trains on a GPU only (torch has no "
     "backward pass for it on CPUs); use sdpa or auto on this machine"),
    ("auto-batch-without-global", {}, ["train", "configs/default.yaml", "train.micro_batch_size=auto"], 2,
     "harness: error: config key 'train.global_batch_size': train.micro_batch_size=auto keeps the global batch and "
     "needs it (sequences per optimizer step over all processes), e.g. 64"),
    ("auto-batch-embedding", {}, ["train", "configs/gritlm-tiny.yaml", "train.micro_batch_size=auto",
                                  "train.global_batch_size=64"], 2,
     "harness: error: config key 'train.micro_batch_size': auto sizes generative micro-batches (loss.mode=generative); "
     "with loss.mode=unified set it and train.emb_micro_batch_size"),
    ("grad-cache-does-not-divide", {}, ["train", "configs/gritlm-tiny.yaml", "loss.grad_cache_chunks=3"], 2,
     "harness: error: config key 'loss.grad_cache_chunks': must divide train.emb_micro_batch_size (32), got 3"),
    ("no-train-files", {}, ["train", "configs/default.yaml", "data.train_files=[]"], 2,
     "harness: error: config key 'data.train_files': loss.mode=generative needs generative JSONL files or folders"),
    ("unknown-deepspeed", {}, ["train", "configs/default.yaml", "train.deepspeed=zero9"], 2,
     "harness: error: config key 'train.deepspeed': no DeepSpeed config 'zero9' (shipped: zero0, zero1, zero2, "
     "zero2_offload, zero3, zero3_offload)"),
    ("deepspeed-bad-json", {"ds.json": '{"zero_optimization": {"stage": 3,}}'},
     ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"], 2,
     "harness: error: {d}/ds.json:1: invalid JSON in DeepSpeed config (Expecting property name enclosed in double "
     "quotes)"),
    ("deepspeed-not-an-object", {"ds.json": '[1]'}, ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"],
     2, "harness: error: {d}/ds.json: a DeepSpeed config must be a JSON object, got list"),
    ("deepspeed-bad-stage", {"ds.json": '{"zero_optimization": {"stage": 4}}'},
     ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"], 2,
     "harness: error: {d}/ds.json: zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ("deepspeed-bad-offload", {"ds.json": '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}'},
     ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"], 2,
     "harness: error: {d}/ds.json: zero_optimization.offload_optimizer.device must be none, cpu or nvme, got 'gpu'"),
    ("deepspeed-bad-param-offload", {"ds.json": '{\n "zero_optimization": {"stage": 3, "offload_param": "disk"}}'},
     ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"], 2,
     "harness: error: {d}/ds.json: zero_optimization.offload_param.device must be none, cpu or nvme, got 'disk'"),
    ("deepspeed-nested-too-deeply", {"ds.json": '{"zero_optimization": ' + "[" * 200_000 + "]" * 200_000 + "}"},
     ["train", "configs/default.yaml", "train.deepspeed={d}/ds.json"], 2,
     "harness: error: {d}/ds.json: DeepSpeed config: JSON nested too deeply (more than about 1000 levels of arrays "
     "or objects)"),
    ("launcher-deepspeed-bad-json", {"l.json": '{\n  "zero_optimization": {"stage": 2,}\n}'},
     ["train", "configs/default.yaml", "env:ACCELERATE_USE_DEEPSPEED=true", "env:ACCELERATE_DEEPSPEED_CONFIG_FILE={d}/l.json"],
     2, "harness: error: {d}/l.json:2: invalid JSON in DeepSpeed config (Expecting property name enclosed in double "
     "quotes)"),
    # ---- resume
    ("resume-not-a-folder", {"ck": "x"}, ["train", "configs/default.yaml", "train.output_dir={d}/out",
                                          "train.resume={d}/ck"], 2,
     "harness: error: config key 'train.resume': {d}/ck is not a folder"),
    ("resume-not-a-checkpoint", {"ck/readme.txt": "x"}, ["train", "configs/default.yaml", "train.output_dir={d}/out",
                                                          "train.resume={d}/ck"], 2,
     "harness: error: config key 'train.resume': {d}/ck is not a complete checkpoint (no COMPLETE marker or "
     "harness_state.json)"),
    ("fresh-start-over-checkpoints", {"out/checkpoints/step-4/COMPLETE": "complete\n",
                                      "out/checkpoints/step-4/harness_state.json": "{}"},
     ["train", "configs/default.yaml", "train.output_dir={d}/out", "train.resume=null"], 2,
     "harness: error: config key 'train.resume': {d}/out/checkpoints already holds checkpoints (newest step-4); use "
     "train.resume=auto to continue or another train.output_dir"),
    # ---- plan and bench
    ("plan-zero-hours", {}, ["plan", "configs/default.yaml", "--hours", "0"], 2,
     "harness: error: harness plan: --hours must be > 0, --margin-minutes >= 0 and --steps >= 1"),
    ("plan-report-missing", {}, ["plan", "configs/default.yaml", "--hours", "1", "--from-report", "{d}/report.json"], 1,
     "harness: error: --from-report: no such file: {d}/report.json"),
    ("plan-report-not-harness", {"report.json": '{"loss": 1}'},
     ["plan", "configs/default.yaml", "--hours", "1", "--from-report", "{d}/report.json"], 1,
     "harness: error: {d}/report.json: not a harness report with timings (field 'timings' missing): use a report.json "
     "written by this version of harness train"),
    ("bench-embedding", {}, ["bench", "configs/gritlm-tiny.yaml"], 2,
     "harness: error: harness bench compares generative training; got loss.mode=unified (--profiles runs the harness alone in any mode)"),
]


def _fill(text: str, d: Path) -> str:
    return text.replace("{d}", str(d)).replace("{cwd}", os.getcwd())


def test_the_table_is_large_enough():
    assert len(CASES) >= 47 and len({c[0] for c in CASES}) == len(CASES)


FINISHED = json.dumps({"steps": 5, "planned_steps": 5, "stopped_by": None, "final_dir": None})


@pytest.mark.parametrize("name, files, argv, status, line", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(name, files, argv, status, line, tmp_path, capsys, monkeypatch):
    """A `train` case without its own train.output_dir trains into a temporary folder that holds a finished run (never
    the repository's runs/): the config and its overrides are checked before the run folder is looked at, so a
    finished run does not answer a bad override with "nothing to do"."""
    monkeypatch.chdir(ROOT)
    if argv[0] == "train" and not any(a.startswith("train.output_dir=") for a in argv):
        argv = [*argv[:2], "train.output_dir={d}/finished", *argv[2:]]
        files = {**files, "finished/report.json": FINISHED}
    for item in [a for a in argv if a.startswith("env:")]:  # env:NAME=value: an environment variable for the case
        name, _, value = item[4:].partition("=")
        monkeypatch.setenv(name, _fill(value, tmp_path))
    argv = [a for a in argv if not a.startswith("env:")]
    for rel, content in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content) if isinstance(content, bytes) else (tmp_path / rel).write_text(content)
    code = cli.main([_fill(a, tmp_path) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Generating", "tokenize", "Map"))]
    assert code == status, err
    assert lines == [_fill(line, tmp_path)], err


def test_a_bad_input_seen_from_the_shell(tmp_path):
    """As a separate process: exit status 2, the one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", "configs/default.yaml", "train.bogus=1"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "harness: error: unknown config key 'train.bogus'"
    assert "Traceback" not in proc.stderr and json.dumps(proc.stdout) == '""'


@pytest.mark.parametrize("bad", ["data.train_files=[{d}/bad.jsonl]", "model.name_or_path={d}/no-model"])
def test_data_or_model_error_leaves_the_run_folders_config_as_it_was(bad, tmp_path, capsys, monkeypatch):
    """The folder's config.yaml describes its checkpoints: a rerun that fails on its data or model rewrites nothing."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("# the config of the run that wrote the checkpoints here\n")
    (tmp_path / "bad.jsonl").write_text(GOOD_GEN + "[1]\n")
    code = cli.main(["train", "configs/default.yaml", f"train.output_dir={out}", "data.eval_files=[]",
                     "train.progress_bar=false", _fill(bad, tmp_path)])
    assert code in (1, 2) and capsys.readouterr().err.strip().splitlines()[-1].startswith("harness: error: ")
    assert (out / "config.yaml").read_text() == "# the config of the run that wrote the checkpoints here\n"
    assert not (out / "environment.json").exists() and not (out / ".lock").exists()


@pytest.mark.slow
def test_two_processes_print_the_error_once(tmp_path):
    """An error every process stops with (here train.resume naming no folder, decided by the main process and
    agreed): the main process alone prints it, not one copy per process."""
    from harness_launch import FAST, run_train

    (tmp_path / "ck").write_text("x")
    proc = run_train([f"train.output_dir={tmp_path / 'out'}", f"train.resume={tmp_path}/ck", *FAST], nproc=2,
                     check=False)
    assert proc.returncode != 0 and "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "harness: error:" in ln]
    assert errors == [f"harness: error: config key 'train.resume': {tmp_path}/ck is not a folder"], proc.stderr[-3000:]


@pytest.mark.parametrize("command", [["train"], ["plan"], ["bench"], ["zero-plan"], ["rft", "test"],
                                     ["rft", "generate"]])
def test_every_command_takes_the_recipe_as_file_or_config(command, capsys, monkeypatch):
    """One rule (harness/config/recipe_args.py): FILE or --config FILE, the overrides after either; the same bad
    override gives the same one line both ways, and a recipe given twice is refused."""
    monkeypatch.chdir(ROOT)
    extra = {"plan": ["--hours", "1"], "zero-plan": ["--gpus", "1", "--gpu-mem-gb", "24"]}.get(command[0], [])
    for recipe in (["configs/dpo-tiny.yaml"], ["--config", "configs/dpo-tiny.yaml"]):
        assert cli.main([*command, *recipe, "train.max_step=3", *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "harness: error: unknown config key 'train.max_step' (did you mean 'max_steps'?)"]
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "configs/default.yaml", "--config", "configs/dpo-tiny.yaml", *extra])
    assert e.value.code == 2 and "the recipe is given twice" in capsys.readouterr().err


def test_train_entry_point_takes_the_recipe_as_file_or_config(capsys, monkeypatch):
    """python -m harness.train (and accelerate launch harness/train.py) follows the same rule."""
    from harness import train

    monkeypatch.chdir(ROOT)
    for recipe in (["configs/default.yaml"], ["--config", "configs/default.yaml"]):
        assert train.main([*recipe, "train.bogus=1"]) == 2
        assert capsys.readouterr().err.strip() == "harness: error: unknown config key 'train.bogus'"


def test_wandb_not_logged_in_is_one_line(tmp_path, capsys, monkeypatch):
    """train.report_to=[wandb] with wandb installed but no API key (a fresh HOME, no WANDB_API_KEY): wandb's own
    UsageError ends 17 frames of traceback; here one line naming train.report_to, `wandb login` and WANDB_MODE=offline."""
    monkeypatch.chdir(ROOT)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    code = cli.main(["train", "configs/default.yaml", f"train.output_dir={tmp_path}/run", "train.report_to=[wandb]",
                     "train.max_steps=1", "data.eval_files=[]", "train.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("harness: error: config key 'train.report_to': wandb could not start (UsageError: No API key"), err
    assert "`wandb login`" in line and "WANDB_MODE=offline" in line


def test_train_sh_passes_the_workers_status_on_without_a_launcher_traceback(tmp_path):
    """A harness error found by the training process itself (here an FSDP launch, refused with status 2): accelerate's
    launcher said exit 1 and appended its CalledProcessError traceback; train.sh now exits 2, the one line, no
    traceback."""
    out = tmp_path / "run"
    proc = subprocess.run(["bash", "launch/train.sh", "configs/default.yaml", f"train.output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "NUM_GPUS": "0", "ACCELERATE_USE_FSDP": "true"})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert "Traceback" not in said and "CalledProcessError" not in said, said[-3000:]
    assert [ln for ln in said.splitlines() if "error:" in ln] == [
        "harness: error: the launch asks for FSDP (accelerate's --use_fsdp or distributed_type: FSDP, "
        "ACCELERATE_USE_FSDP=true), which the harness does not support: shard with DeepSpeed ZeRO instead, "
        "launch/train.sh --zero N (1, 2, 3, 3-offload or auto) or train.deepspeed=zero3"], said[-3000:]
    assert "[train.sh] failed with a harness error (exit 2)" in said


def test_a_hub_id_not_in_the_cache_under_hf_hub_offline_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """HF_HUB_OFFLINE=1 and a hub id that is in no local cache: one line naming model.name_or_path and the offline
    setting (was: model.tokenizer blamed, nothing about HF_HUB_OFFLINE), before any download is tried."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    code = cli.main(["train", "configs/default.yaml", f"train.output_dir={tmp_path}/run",
                     "model.name_or_path=nobody/no-such-model"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 20, err
    assert err.strip().splitlines()[-1] == (
        "harness: error: config key 'model.name_or_path': cannot load 'nobody/no-such-model': not a folder here and "
        f"not in the local hub cache ({HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: download it where there is a "
        "network (hf download nobody/no-such-model, into that cache) or give a local folder"), err
    assert "Traceback" not in err


def test_a_hub_id_with_no_network_fails_at_once(tmp_path):
    """No HF_HUB_OFFLINE, and a hub endpoint that cannot resolve (.invalid never does, here or on a CI with a
    network): huggingface_hub retried for ~50 s before its error; now one line within seconds of the start."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.harness-test.invalid", TOKENIZERS_PARALLELISM="false")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", "configs/default.yaml",
                           f"train.output_dir={tmp_path}/run", "model.name_or_path=nobody/no-such-model"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2 and took < 25, (took, proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    assert len(errors) == 1 and "hub.harness-test.invalid cannot be reached (no network)" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_zero_plan_before_the_warm_up_model_exists_names_the_folder_and_its_recipe(tmp_path, capsys, monkeypatch):
    """configs/grpo-tiny.yaml starts from runs/rft-tiny/warmup/final: before that run, zero-plan said transformers'
    "Repo id must be in the form ..."; now which folder is missing and the recipe that writes it (a copy of
    configs/ in an empty folder, so that a warm-up run of this checkout does not hide the case)."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["zero-plan", "configs/grpo-tiny.yaml", "--gpus", "1", "--gpu-mem-gb", "80"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [
        "harness: error: config key 'model.name_or_path': cannot load 'runs/rft-tiny/warmup/final': no such folder "
        f"runs/rft-tiny/warmup/final (relative paths are read from {tmp_path}); a run's final/ is written when its "
        "training ends: harness train configs/rft-tiny-warmup.yaml first"], err

"""harness.config: precedence, dotted overrides, YAML parsing of values, save/load round trip, error messages."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.config import (
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    load_config,
    parse_override,
    save_config,
)
from harness.errors import ConfigError

# The smallest overrides that make a config valid on their own (validate() needs data and a model).
VALID = ["data.train_files=[a.jsonl]", "model.config.model_type=llama"]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write(
        tmp_path / "recipe.yaml",
        "model:\n"
        "  config:\n"
        "    model_type: llama\n"
        "    hidden_size: 128\n"
        "    num_hidden_layers: 2\n"
        "data:\n"
        "  train_files: [data/a.jsonl]\n"
        "  max_len: 64\n"
        "train:\n"
        "  max_steps: 10\n"
        "  seed: 7\n",
    )


# ----------------------------------------------------------------------------------------------- precedence


def test_defaults_only_need_data_and_model():
    cfg = load_config(None, VALID)
    assert cfg.train == TrainConfig()
    assert cfg.optim == OptimConfig()
    assert cfg.data == DataConfig(train_files=["a.jsonl"])
    assert cfg.model == ModelConfig(config={"model_type": "llama"})


def test_yaml_overrides_defaults(recipe):
    cfg = load_config(recipe)
    assert cfg.train.max_steps == 10  # from the file
    assert cfg.train.seed == 7  # from the file
    assert cfg.data.max_len == 64  # from the file
    assert cfg.train.micro_batch_size == TrainConfig().micro_batch_size  # default kept
    assert cfg.optim == OptimConfig()  # section absent from the file: all defaults
    assert cfg.model.config == {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2}


def test_overrides_beat_yaml(recipe):
    cfg = load_config(recipe, ["train.max_steps=20", "optim.lr=0.01"])
    assert cfg.train.max_steps == 20  # override beats the file
    assert cfg.train.seed == 7  # file value untouched by unrelated overrides
    assert cfg.optim.lr == 0.01  # override beats the default


def test_later_override_wins(recipe):
    cfg = load_config(recipe, ["train.seed=1", "train.seed=2"])
    assert cfg.train.seed == 2


def test_dotted_override_into_dict_field_merges(recipe):
    cfg = load_config(recipe, ["model.config.hidden_size=64", "model.config.num_attention_heads=4"])
    assert cfg.model.config == {
        "model_type": "llama",  # kept from the file
        "hidden_size": 64,  # replaced
        "num_hidden_layers": 2,  # kept from the file
        "num_attention_heads": 4,  # added
    }


def test_dotted_override_nested_dict():
    cfg = load_config(None, [*VALID, "model.config.rope_scaling.rope_type=linear", "model.config.rope_scaling.factor=2.0"])
    assert cfg.model.config == {"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def test_whole_dict_override_replaces(recipe):
    cfg = load_config(recipe, ["model.config={model_type: gpt2, n_embd: 32}"])
    assert cfg.model.config == {"model_type": "gpt2", "n_embd": 32}


def test_override_leading_dashes_are_ignored():
    assert load_config(None, [*VALID, "--train.seed=3"]).train.seed == 3


# ----------------------------------------------------------------------------------------------- override values


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("train.max_steps=20", "train.max_steps", 20),
        ("train.seed=-5", "train.seed", -5),
        ("optim.lr=0.001", "optim.lr", 0.001),
        ("optim.lr=1.0e-3", "optim.lr", 1e-3),
        ("optim.eps=1.0e-10", "optim.eps", 1e-10),
        ("train.epochs=2", "train.epochs", 2.0),  # ints are accepted where floats are
        ("train.progress_bar=false", "train.progress_bar", False),
        ("train.tf32=true", "train.tf32", True),
        ("model.gradient_checkpointing=True", "model.gradient_checkpointing", True),
        ("train.report_to=[]", "train.report_to", []),
        ("train.report_to=[tensorboard, wandb]", "train.report_to", ["tensorboard", "wandb"]),
        ("data.train_files=[x.jsonl, dir/]", "data.train_files", ["x.jsonl", "dir/"]),
        ("model.name_or_path=null", "model.name_or_path", None),
        ("model.tokenizer=bundled", "model.tokenizer", "bundled"),
        ("data.cache_dir=/tmp/c:d", "data.cache_dir", "/tmp/c:d"),
        ("train.output_dir=runs/my run", "train.output_dir", "runs/my run"),
        ("optim.scheduler=linear", "optim.scheduler", "linear"),
        ("model.config.hidden_size=64", "model.config.hidden_size", 64),
        ("model.config.tie_word_embeddings=false", "model.config.tie_word_embeddings", False),
        ("model.config.rms_norm_eps=1.0e-6", "model.config.rms_norm_eps", 1e-6),
    ],
)
def test_override_values_are_parsed_as_yaml(override, key, expected):
    cfg = load_config(None, [*VALID, override])
    value = get(cfg, key)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_override():
    assert parse_override("train.max_steps=20") == ("train.max_steps", 20)
    assert parse_override("optim.lr=0.5") == ("optim.lr", 0.5)
    assert parse_override("train.report_to=[a, b]") == ("train.report_to", ["a", "b"])
    assert parse_override("train.output_dir=") == ("train.output_dir", "")
    assert parse_override("train.output_dir=a=b") == ("train.output_dir", "a=b")


@pytest.mark.parametrize("text", ["1e-3", "3e-4", "1E-3", "2e+1"])
def test_override_float_in_e_notation(text):
    cfg = load_config(None, [*VALID, f"optim.lr={text}"])
    assert cfg.optim.lr == float(text)


def test_yaml_file_float_in_e_notation(tmp_path):
    path = write(tmp_path / "c.yaml", "optim:\n  lr: 1e-3\n")
    assert load_config(path, VALID).optim.lr == 1e-3


def test_dict_field_float_in_e_notation():
    cfg = load_config(None, [*VALID, "model.config.rms_norm_eps=1e-6"])
    assert cfg.model.config["rms_norm_eps"] == 1e-6


# ----------------------------------------------------------------------------------------------- save / load


def test_save_config_round_trip(tmp_path, recipe):
    original = load_config(
        recipe,
        [
            "model.config.rope_scaling.factor=2.0",
            "model.tokenizer=bundled",
            "data.eval_files=[e1.jsonl, e2]",
            "optim.lr=0.0005",
            "optim.eps=1.0e-12",
            "optim.scheduler=constant",
            "train.epochs=2.5",
            "train.report_to=[]",
            "train.progress_bar=false",
            "train.output_dir=runs/round trip",
        ],
    )
    path = tmp_path / "run" / "nested" / "config.yaml"  # parents are created
    save_config(original, path)
    loaded = load_config(path)
    assert loaded == original
    assert dataclasses.asdict(loaded) == dataclasses.asdict(original)
    # Every key is written (the fully resolved config), not only the ones that were set.
    saved = yaml.safe_load(path.read_text())
    assert set(saved) == {"model", "data", "loss", "optim", "train", "rft", "rl", "distill"}
    assert set(saved["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_save_config_round_trip_default_recipe(tmp_path, repo_root):
    original = load_config(repo_root / "configs" / "default.yaml")
    save_config(original, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == original


def test_a_training_runs_config_yaml_has_no_rft_section(tmp_path, repo_root):
    """build.py writes config.yaml without `rft` (a training run reads none of it); it reloads to the same run."""
    original = load_config(repo_root / "configs" / "default.yaml")
    save_config(original, tmp_path / "config.yaml", omit=("rft",))
    assert "rft" not in yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert load_config(tmp_path / "config.yaml") == original


def test_save_config_round_trip_tricky_strings(tmp_path):
    # Strings that YAML would read as other types must be quoted on save.
    original = Config(
        model=ModelConfig(name_or_path="null", tokenizer="1.5"),
        data=DataConfig(train_files=["yes", "123", "a: b"], cache_dir="~"),
        train=TrainConfig(output_dir="on"),
    )
    save_config(original, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == original


# ----------------------------------------------------------------------------------------------- bad inputs

# (id, YAML text or None, overrides, exact message; {path} is the YAML file)
BAD = [
    ("unknown-section", None, [*VALID, "trian.max_steps=5"], "unknown config section 'trian' (did you mean 'train'?)"),
    ("unknown-section-no-hint", None, [*VALID, "foo.bar=1"], "unknown config section 'foo'"),
    ("unknown-key", None, [*VALID, "train.max_step=5"], "unknown config key 'train.max_step' (did you mean 'max_steps'?)"),
    ("unknown-key-no-hint", None, [*VALID, "train.bogus=1"], "unknown config key 'train.bogus'"),
    ("unknown-key-in-file", "train:\n  max_step: 5\n", VALID,
     "{path}:2: unknown config key 'train.max_step' (did you mean 'max_steps'?)"),
    ("unknown-section-in-file", "trainer:\n  seed: 1\n", VALID,
     "{path}:1: unknown config section 'trainer' (did you mean 'train'?)"),
    ("no-key", None, [*VALID, "train=5"], "config key 'train': give section.key=value"),
    ("no-equals", None, [*VALID, "train.max_steps"], "override 'train.max_steps': expected section.key=value"),
    ("sub-key-of-scalar", None, [*VALID, "train.seed.x=1"], "config key 'train.seed.x': 'train.seed' has no sub-keys"),
    ("str-for-int", None, [*VALID, "train.max_steps=ten"], "config key 'train.max_steps': expected int, got 'ten'"),
    ("float-for-int", None, [*VALID, "train.max_steps=1.5"], "config key 'train.max_steps': expected int, got 1.5"),
    ("bool-for-int", None, [*VALID, "train.grad_accum=true"], "config key 'train.grad_accum': expected int, got True"),
    ("bool-for-int-or-auto", None, [*VALID, "train.micro_batch_size=true"],
     "config key 'train.micro_batch_size': expected int or one of 'auto', got True"),
    ("bool-for-float", None, [*VALID, "optim.lr=false"], "config key 'optim.lr': expected float, got False"),
    ("list-for-str", None, [*VALID, "train.output_dir=[a, b]"], "config key 'train.output_dir': expected str, got ['a', 'b']"),
    ("list-for-optional-str", None, [*VALID, "model.name_or_path=[a]"],
     "config key 'model.name_or_path': expected str or null, got ['a']"),
    ("str-for-list", None, [*VALID, "data.train_files=a.jsonl"], "config key 'data.train_files': expected list, got 'a.jsonl'"),
    ("str-for-bool", None, [*VALID, "train.tf32=maybe"], "config key 'train.tf32': expected bool, got 'maybe'"),
    ("wrong-type-in-file", "train:\n  seed: seven\n", VALID, "{path}:2: config key 'train.seed': expected int, got 'seven'"),
    ("bad-choice", None, [*VALID, "optim.scheduler=step"],
     "config key 'optim.scheduler': expected one of 'cosine', 'linear', 'constant', got 'step'"),
    ("bad-choice-precision", None, [*VALID, "train.precision=bf32"],
     "config key 'train.precision': expected one of 'auto', 'fp32', 'bf16', 'fp16', 'fp8', got 'bf32'"),
    ("max-steps-0", None, [*VALID, "train.max_steps=0"],
     "config key 'train.max_steps': must be -1 (use epochs) or >= 1, got 0"),
    ("max-steps-negative", None, [*VALID, "train.max_steps=-2"],
     "config key 'train.max_steps': must be -1 (use epochs) or >= 1, got -2"),
    ("micro-batch-0", None, [*VALID, "train.micro_batch_size=0"], "config key 'train.micro_batch_size': must be >= 1, got 0"),
    ("grad-accum-0", None, [*VALID, "train.grad_accum=0"], "config key 'train.grad_accum': must be >= 1, got 0"),
    ("max-len-0", None, [*VALID, "data.max_len=0"], "config key 'data.max_len': must be >= 1, got 0"),
    ("embed-buckets-negative", None, [*VALID, "data.embed_length_buckets=-1"],
     "config key 'data.embed_length_buckets': must be auto or >= 0, got -1"),
    ("epochs-0", None, [*VALID, "train.epochs=0"], "config key 'train.epochs': must be > 0 when train.max_steps is -1, got 0.0"),
    ("lr-0", None, [*VALID, "optim.lr=0"], "config key 'optim.lr': must be > 0, got 0.0"),
    ("warmup-ratio-1", None, [*VALID, "optim.warmup_ratio=1"], "config key 'optim.warmup_ratio': must be in [0, 1), got 1.0"),
    ("negative-workers", None, [*VALID, "data.num_workers=-1"], "config key 'data.num_workers': must be >= 0, got -1"),
    ("missing-train-files", None, ["model.config.model_type=llama"],
     "config key 'data.train_files': loss.mode=generative needs generative JSONL files or folders"),
    ("unified-without-embedding-files", None, ["model.config.model_type=llama", "data.train_files=[a]",
                                               "loss.mode=unified"],
     "config key 'data.emb_train_files': loss.mode=unified needs embedding JSONL files or folders"),
    ("grad-cache-chunks-not-dividing", None, ["model.config.model_type=llama", "data.train_files=[a]",
                                              "train.emb_micro_batch_size=6", "loss.grad_cache_chunks=4"],
     "config key 'loss.grad_cache_chunks': must divide train.emb_micro_batch_size (6), got 4"),
    ("bad-loss-mode", None, ["model.config.model_type=llama", "data.train_files=[a]", "loss.mode=contrastive"],
     "config key 'loss.mode': expected one of 'generative', 'embedding', 'unified', 'preference', 'rl', 'distill', "
     "got 'contrastive'"),
    ("zero-temperature", None, ["model.config.model_type=llama", "data.train_files=[a]", "loss.temperature=0"],
     "config key 'loss.temperature': must be > 0, got 0.0"),
    ("empty-train-files", None, ["model.config.model_type=llama", "data.train_files=[]"],
     "config key 'data.train_files': loss.mode=generative needs generative JSONL files or folders"),
    ("no-model", None, ["data.train_files=[a.jsonl]"],
     "config key 'model.name_or_path': set it, or give model.config (with model_type) for random init"),
    ("missing-model-type", None, ["data.train_files=[a.jsonl]", "model.config.hidden_size=64"],
     "config key 'model.config.model_type': required to build a model from config (e.g. llama)"),
    ("invalid-yaml-tab", "train:\n  seed: 1\n\tmax_steps: 2\n", [],
     "{path}:3: invalid YAML (found character '\\t' that cannot start any token)"),
    ("invalid-yaml-unclosed", "model: {name_or_path: x\n", [], "{path}:2: invalid YAML (expected ',' or '}}', but got '<stream end>')"),
    ("invalid-yaml-mapping", "train:\n  seed: 1\n  max_steps: : 2\n", [],
     "{path}:3: invalid YAML (mapping values are not allowed here)"),
    ("top-level-list", "- model\n- train\n", [], "{path}: expected a mapping of sections (model:, data:, optim:, train:)"),
    ("top-level-scalar", "hello\n", [], "{path}: expected a mapping of sections (model:, data:, optim:, train:)"),
    ("section-not-mapping", "train: 5\n", VALID, "{path}:1: section 'train' must be a mapping of keys"),
    ("section-is-list", "data:\n  - a.jsonl\n", VALID, "{path}:1: section 'data' must be a mapping of keys"),
]


@pytest.mark.parametrize("yaml_text, overrides, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config(tmp_path, yaml_text, overrides, message):
    path = write(tmp_path / "bad.yaml", yaml_text) if yaml_text is not None else None
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, overrides)
    text = str(excinfo.value)
    assert text == message.format(path=path)
    assert "\n" not in text
    assert excinfo.value.exit_code == 2


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, VALID)
    assert str(excinfo.value) == f"config file not found: {path}"
    assert excinfo.value.exit_code == 2


def test_config_path_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a folder; give a recipe file$"):
        load_config(tmp_path, VALID)


def test_empty_yaml_file_means_defaults(tmp_path):
    path = write(tmp_path / "empty.yaml", "# nothing here\n")
    assert load_config(path, VALID) == load_config(None, VALID)


def test_dotted_override_below_scalar_in_dict_field():
    with pytest.raises(ConfigError):
        load_config(None, [*VALID, "model.config.rope=5", "model.config.rope.x=1"])


# ----------------------------------------------------------------------------------------------- entry point


def test_entry_point_unknown_key(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.train", "--config", "configs/default.yaml", "train.bogus=1"],
        cwd=repo_root, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("harness: error: unknown config key 'train.bogus'")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_harness_train_help_config_through_the_cli(capsys):
    """`harness train --help-config` (the subcommand) lists the keys; it was an argparse error (file required)."""
    from harness import cli

    assert cli.main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model:\n") and "    lora.r (int, default 8): LoRA rank." in out
    assert cli.main(["train"]) == 2
    assert "harness train: a recipe is needed" in capsys.readouterr().err


def test_entry_point_help_config(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.train", "--help-config"],
        cwd=repo_root, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # Every key of every section is listed under its section header, with its type and default.
    for section, cls in [("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig), ("train", TrainConfig)]:
        start = lines.index(f"{section}:")
        block = []
        for line in lines[start + 1:]:
            if not line.startswith("  "):
                break
            block.append(line)
        names = [line.split(" (", 1)[0].strip() for line in block if not line.startswith("    ")]
        assert names == [f.name for f in dataclasses.fields(cls)]
    # the keys of the model.lora mapping are listed under it ("keys below" in its help)
    lora = [line.split(" (", 1)[0].strip() for line in lines if line.startswith("    lora.")]
    assert lora == [f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)]
    train_block = lines[lines.index("train:") + 1:]
    assert any(line.startswith("  max_steps (") for line in train_block)
    assert any(line.startswith("  max_steps (int, default -1): ") for line in lines)


# ----------------------------------------------------------------------------------------------- profiles


def test_profile_sits_between_defaults_and_the_file(tmp_path):
    from harness.config.profiles import PROFILES

    path = write(tmp_path / "p.yaml", "train:\n  profile: aggressive\n  log_every: 7\n")
    cfg = load_config(path, VALID)
    assert cfg.train.compile == "regional" and cfg.data.packing is True  # from the profile
    assert cfg.data.num_workers == PROFILES["aggressive"]["data.num_workers"]
    assert cfg.train.log_every == 7  # the file beats the profile
    cfg = load_config(path, [*VALID, "data.num_workers=1", "train.profile=conservative"])
    assert cfg.data.num_workers == 1  # the command line beats everything
    assert cfg.train.compile == "none" and cfg.data.packing is False  # the command line chose the profile


@pytest.mark.parametrize("name", ["conservative", "balanced", "aggressive", "memory_efficient"])
def test_every_profile_loads(name):
    cfg = load_config(None, [*VALID, f"train.profile={name}"])
    assert cfg.train.profile == name


@pytest.mark.parametrize("name", ["balanced", "aggressive", "memory_efficient"])
def test_a_packing_profile_leaves_preference_pairs_unpacked(name):
    """Regression: train.profile=balanced with loss.mode=preference was refused ("set data.packing=false"): the
    profile's packing is for the modes that pack; its other keys apply, and packing asked for by the user is still
    refused in one line."""
    from harness.config.profiles import PROFILES

    cfg = load_config("configs/dpo-tiny.yaml", ["train.output_dir=/tmp/unused", f"train.profile={name}"])
    assert cfg.data.packing is False and cfg.train.profile == name
    assert cfg.data.num_workers == PROFILES[name]["data.num_workers"]
    with pytest.raises(ConfigError, match="data.packing"):
        load_config("configs/dpo-tiny.yaml", ["train.output_dir=/tmp/unused", f"train.profile={name}",
                                               "data.packing=true"])


def test_unknown_profile():
    with pytest.raises(ConfigError) as e:
        load_config(None, [*VALID, "train.profile=turbo"])
    assert str(e.value) == ("config key 'train.profile': unknown profile 'turbo' "
                            "(known: conservative, balanced, aggressive, memory_efficient)")


def test_compile_auto_resolves_by_hardware():
    from harness.config.profiles import resolve_compile, resolve_pin_memory, shapes_vary

    assert resolve_compile("auto", cuda=True) == "regional" and resolve_compile("auto", cuda=False) == "none"
    assert resolve_compile("full", cuda=False) == "full"
    # batches that change shape compile with dynamic shapes (one graph per kind of pass, not one per length)
    assert shapes_vary("unified", packing=True) and shapes_vary("embedding", packing=False)
    assert shapes_vary("generative", packing=False) and not shapes_vary("generative", packing=True)
    assert resolve_pin_memory("auto", cuda=False) is False and resolve_pin_memory(True, cuda=True) is True


def test_a_stop_string_yaml_reads_as_a_mapping_is_taken_as_written():
    """Issue 55: `rft.stop_strings=[Question:]` (YAML reads `Question:` as the mapping {Question: null}) was refused
    as "non-empty strings needed"; it is the text `Question:`."""
    from harness.config import load_config

    cfg = load_config("configs/rft-tiny.yaml", ["rft.stop_strings=[Question:, 'Q2:', 'Answer']"])
    assert cfg.rft.stop_strings == ["Question:", "Q2:", "Answer"]


@pytest.mark.parametrize("argv", [["-m", "harness.train", "--help"], ["-m", "harness.train", "--help-config"],
                                  ["-m", "harness.cli", "train", "--help"], ["-m", "harness.cli", "--help"]])
def test_help_is_answered_before_torch(argv):
    """--help and --help-config of the training entry points print without importing torch (a second, not 10-25)."""
    probe = ("import runpy, sys; sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
             "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", probe, *argv[1:]], capture_output=True, text=True, cwd=root,
                          timeout=120)
    assert proc.stderr.strip().splitlines()[-1] in ("exit 0 False", "exit None False"), proc.stderr
    assert "usage: harness" in proc.stdout or "name_or_path (str or null" in proc.stdout

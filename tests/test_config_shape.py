"""harness/tools/config_shape.py: a model's shape by arithmetic on its config (issue 74: `harness zero-plan` answers
without torch where a config or a config.json is enough) equals the shape counted on the meta device
(harness/tools/sizing.py's meta_shape, the fallback), field by field; the families' defaults are transformers' own; the
tokenizer's length is transformers'; zero-plan imports neither torch nor transformers.

    .venv/bin/python -m pytest tests/test_config_shape.py
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config import load_config
from harness.tools.config_shape import (BUNDLED_TOKENIZER, FAMILIES, ModelShape, resolved, shape_from_config,
                                        tokenizer_length)
from harness.tools.sizing import meta_shape, model_shape

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs" / "default.yaml")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_FAMILIES = {
    "llama": dict(num_key_value_heads=2),
    "mistral": {},  # its default 8 key/value heads over 4 query heads: what transformers builds, counted as built
    "qwen2": dict(num_key_value_heads=2),  # q/k/v biases
    "qwen3": dict(num_key_value_heads=2),  # q/k norms, head_dim 128 by default (not hidden / heads)
    "gemma": dict(head_dim=16),  # tied by default
    "qwen3_moe": dict(MOE, decoder_sparse_step=2, mlp_only_layers=[0]),  # dense and sparse layers mixed
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=40),  # the shared expert and its gate
    "mixtral": dict(num_local_experts=4),
}


def overrides(family: str, keys: dict) -> list[str]:
    return [f"model.config.model_type={family}"] + [f"model.config.{k}={json.dumps(v)}" for k, v in keys.items()]


def same(cfg) -> ModelShape:
    """The arithmetic's shape, asserted equal to the meta model's in every field."""
    fast = shape_from_config(cfg.model)
    assert fast is not None, "the arithmetic gave up on a recipe it covers"
    assert dataclasses.asdict(fast) == dataclasses.asdict(meta_shape(cfg.model))
    return fast


LORA = ["model.lora.enabled=true"]
CASES = {
    **{f"{f}": (DEFAULT, overrides(f, {**TINY, **k})) for f, k in TINY_FAMILIES.items()},
    **{f"{f}-lora": (DEFAULT, overrides(f, {**TINY, **k}) + LORA) for f, k in TINY_FAMILIES.items()},
    "llama-biases-untied-lora-r4": (DEFAULT, overrides("llama", {**TINY, "attention_bias": True, "mlp_bias": True,
                                                               "tie_word_embeddings": False})
                                    + LORA + ["model.lora.r=4"]),
    "lora-list-with-the-head": (DEFAULT, LORA + ["model.lora.target_modules=[q_proj,v_proj,lm_head]",
                                                 "model.config.tie_word_embeddings=false"]),
    "lora-regex": (DEFAULT, LORA + [r"model.lora.target_modules=.*\.(q|v)_proj"]),
    "moe-lora-router-frozen": ("configs/moe-tiny.yaml", LORA + ["model.train_router=false"]),
    "default": (DEFAULT, []),
    "moe-tiny": ("configs/moe-tiny.yaml", []),
    "llama3-8b-qlora": ("configs/llama3-8b-qlora.yaml", []),  # a hub id sized offline from model.config
    "qwen3-30b-a3b-lora": ("configs/qwen3-30b-a3b-lora.yaml", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arithmetic_equals_the_meta_model(case):
    recipe, over = CASES[case]
    shape = same(load_config(str(ROOT / recipe), over))
    if case.endswith("-lora"):
        assert shape.trainable and shape.linear_params
    if "moe" in case or case in ("mixtral", "qwen2_moe"):
        assert shape.active < shape.params


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_families_defaults_are_transformers_own(family):
    """FAMILIES' defaults, resolved as the config classes resolve them, equal transformers' config attributes: with
    nothing given and with a small shape given (head_dim and key/value heads derived or fixed per family)."""
    from transformers import AutoConfig

    from harness.config.derived import attention_heads

    for given in ({}, dict(hidden_size=64, num_attention_heads=4)):
        ours, theirs = resolved(family, given), AutoConfig.for_model(family, **given)
        for key, value in ours.items():
            if key == "head_dim":
                assert value == attention_heads(theirs)[2], (family, given)
            elif hasattr(theirs, key):
                assert getattr(theirs, key) == value or key == "mlp_only_layers" and not value, (family, key, given)


def test_unknown_families_and_unknown_tokenizers_fall_back_to_the_meta_model():
    gpt2 = load_config(DEFAULT, ["model.config={model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4}"])
    assert shape_from_config(gpt2.model) is None and model_shape(gpt2).params == meta_shape(gpt2.model).params
    lora_experts = load_config("configs/moe-tiny.yaml", LORA + ["model.lora.experts=true",
                                                                "model.lora.target_modules=[q_proj]"])
    assert shape_from_config(lora_experts.model) is None


def save_tokenizer(folder: Path, variant: str) -> Path:
    """The bundled tokenizer, as is, with tokens added through transformers, or without the chat markers."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    if variant == "added":
        tok = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
        tok.add_tokens(["<tool>", "zebra"])
        tok.add_special_tokens({"extra_special_tokens": ["<|im_end|>"]}, replace_extra_special_tokens=False)
        tok.save_pretrained(folder)
        return folder
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    if variant == "no-markers":
        tj = json.loads((folder / "tokenizer.json").read_text())
        tj["added_tokens"] = [t for t in tj["added_tokens"] if not t["content"].startswith("<|")]
        for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|embed|>"):
            tj["model"]["vocab"].pop(t, None)
        (folder / "tokenizer.json").write_text(json.dumps(tj))
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        tc.pop("extra_special_tokens", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return folder


@pytest.mark.parametrize("variant", ["bundled", "added", "no-markers"])
def test_tokenizer_length_is_transformers_len(tmp_path, variant):
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    folder = save_tokenizer(tmp_path / "tok", variant)
    assert tokenizer_length(folder) == len(load_tokenizer(ModelConfig(tokenizer=str(folder))))


def test_a_pretrained_folder_is_sized_from_its_config_json(tmp_path):
    """model.name_or_path a folder (config.json and a tokenizer, no weights needed): its shape, the recipe's keys over
    it as the meta sizing applies them; a vocab_size under the tokenizer's length resized to a multiple of 64 as the
    run resizes it (full fine-tune: counted; LoRA: peft's trainable tokens, left to the meta model)."""
    from transformers import AutoConfig

    base = tmp_path / "base"
    AutoConfig.for_model("qwen2", **TINY, num_key_value_heads=2, vocab_size=2000, tie_word_embeddings=True) \
        .save_pretrained(base)
    save_tokenizer(base, "added")  # 2048 + 3 tokens: over vocab_size, rows 2000 -> 2112
    plain = [f"model.name_or_path={base}", "model.config={}"]
    shape = same(load_config(DEFAULT, plain))
    assert shape.vocab == 2112 and shape.model_type == "qwen2"
    assert same(load_config(DEFAULT, [*plain, "model.config.num_hidden_layers=2"])).layers == 2
    assert shape_from_config(load_config(DEFAULT, [*plain, *LORA]).model) is None


def test_a_hub_id_in_the_local_cache_is_sized_from_its_config_json(tmp_path):
    """A hub id without model.config: its config.json and tokenizer from the local hub cache, no network (in a fresh
    interpreter, where huggingface_hub reads HF_HUB_CACHE)."""
    from transformers import AutoConfig

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    AutoConfig.for_model("llama", **TINY, num_key_value_heads=2, vocab_size=2048).save_pretrained(snap)
    save_tokenizer(snap, "bundled")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    code = ("import dataclasses, json, sys\n"
            "from harness.config import load_config\n"
            "from harness.tools.config_shape import shape_from_config\n"
            f"cfg = load_config({DEFAULT!r}, ['model.name_or_path=org/tiny', 'model.config={{}}'])\n"
            "s = shape_from_config(cfg.model)\n"
            "print(json.dumps([dataclasses.asdict(s), 'torch' in sys.modules]))\n")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fast, torch_loaded = json.loads(proc.stdout.splitlines()[-1])
    assert not torch_loaded
    local = load_config(DEFAULT, [f"model.name_or_path={snap}", "model.config={}"])
    assert fast == dataclasses.asdict(meta_shape(local.model)) and fast["layers"] == 3


@pytest.mark.parametrize("recipe", ["configs/default.yaml", "configs/llama-70b.yaml", "configs/llama3-8b-qlora.yaml",
                                    "configs/qwen3-30b-a3b-lora.yaml"])
def test_zero_plan_imports_neither_torch_nor_transformers(recipe):
    """`harness zero-plan` with --gpus and --gpu-mem-gb: the whole plan printed, torch and transformers never imported
    (the light path: about 0.3-0.6 s where the meta model took 11-19 s, docs/bench/zero-plan-cpu.txt)."""
    code = ("import contextlib, io, json, sys\n"
            "from harness.tools.zero_plan import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = main([{recipe!r}, '--gpus', '8', '--gpu-mem-gb', '80'])\n"
            "print(json.dumps([rc, out.getvalue(), sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'peft', 'deepspeed'))]))\n")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    rc, text, heavy = json.loads(proc.stdout.splitlines()[-1])
    assert heavy == [] and "choice: " in text, (heavy, text[-500:])
    assert seconds < 20, seconds  # (generous: a loaded 2-core machine; the meta model's path took 11-19 s alone)

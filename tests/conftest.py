"""Shared test setup: never touch the Hugging Face Hub; give tests the repository root without chdir."""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
# DeepSpeed builds its CPU ops (the shared-memory all-reduce at every DeepSpeed start on a CPU, CPU Adam for optimizer
# offload) into TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions for every checkout on the machine. The build
# names the venv's include paths, so two checkouts whose tests ran at the same time rebuilt the same op in turns
# (18-52 s a build, measured from its ninja log); one build folder per venv, for the runs these tests start too.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    """The repository root (where configs/ and harness/ live)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def llama_style_tokenizer_dir(tmp_path_factory) -> Path:
    """A SentencePiece-style (Llama / Mistral) tokenizer built offline: BPE with byte fallback over a Metaspace
    pre-tokenizer (a prefix space "▁" before the first word), trained on the sample embedding texts, saved as
    transformers' LlamaTokenizer with add_bos_token (it adds <s> itself). No GritLM markers: harness adds them."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    texts = []
    for line in (REPO_ROOT / "data" / "sample" / "emb.jsonl").read_text().splitlines():
        row = json.loads(line)
        for v in [row["query"], *row["pos"], *row["neg"]]:
            texts += v if isinstance(v, list) else [v]
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]  # byte fallback: "\n" is <0x0A>
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=special, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    tok = LlamaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], add_bos_token=True)
    out = tmp_path_factory.mktemp("llama_style_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def stage_run(tmp_path_factory):
    """stage_run(name) -> the folder of a 2-process run of the default recipe (harness_launch.STAGE_STEPS) under
    "ddp", "zero1", "zero2" or "zero3", run once per session when first asked for: tests/test_zero.py compares the
    stages with one another and with stopped-and-resumed runs, tests/test_multinode.py with two launchers."""
    from harness_launch import STAGE_STEPS, STAGES, run_train

    root = tmp_path_factory.mktemp("stages")

    def run(name: str) -> Path:
        out = root / name
        if not (out / "report.json").is_file():
            run_train([f"train.output_dir={out}", *STAGE_STEPS], nproc=2, accel=STAGES[name])
        return out
    return run

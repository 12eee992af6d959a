"""Shared test setup: never touch the Hugging Face Hub; give tests the repository root without chdir."""

import fcntl
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
# DeepSpeed builds its CPU ops (the shared-memory all-reduce at every DeepSpeed start on a CPU, CPU Adam for optimizer
# offload) into TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions for every checkout on the machine. The build
# names the venv's include paths, so two checkouts whose tests ran at the same time rebuilt the same op in turns
# (18-52 s a build, measured from its ninja log); one build folder per venv, for the runs these tests start too.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# Under pytest-xdist (pyproject's addopts: 2 workers) each worker and the runs it launches get their share of the
# cores for OpenMP: torch's default of one thread a core in two workers at once oversubscribes the machine (measured
# on the 2-core CI machine: test_fp8 + test_weights 99 s on 2 workers at 2 threads each, 80 s in one process, 58 s on
# 2 workers at 1 thread each). A 2-rank launch runs its ranks at 1 thread each anyway (torch's launcher sets it).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import harness_launch  # noqa: E402
from harness_launch import BF16_STEPS, STAGE_STEPS, STAGES, cpu_slots, run_train  # noqa: E402

# Test modules import it as `harness_launch` or as `tests.harness_launch`: one module object under both names, so that
# its record of the CPU slots this process holds (cpu_slots) is one (two copies: a nested launch would wait on itself).
sys.modules.setdefault("tests.harness_launch", harness_launch)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _runs_tree() -> dict:
    runs = REPO_ROOT / "runs"
    return {str(p.relative_to(runs)): p.stat().st_mtime_ns for p in runs.rglob("*")} if runs.is_dir() else {}


@pytest.fixture(scope="session", autouse=True)
def repository_runs_untouched():
    """Tests train into temporary folders: the repository's runs/ (the README's command 1 leaves runs/default there
    before the tests run) is neither written nor changed by them."""
    before = _runs_tree()
    yield
    after = _runs_tree()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the tests wrote into the repository's runs/: {changed[:10]}"


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


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder of this test session shared by its xdist workers (each worker has its own basetemp below the
    session's): a session fixture that writes a run there runs it once, whichever worker asks first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    (root / name).mkdir(parents=True, exist_ok=True)
    return root / name


def run_once(folder: Path, make, nproc: int) -> Path:
    """make(folder) unless an earlier call (in any worker of the session) finished it: a report.json is there. A lock
    file beside it makes the other workers wait for the one that runs it. The run's CPU slots are taken before that
    lock, as every launch takes them first: no worker then holds the lock while waiting for slots held by another
    that waits for the lock."""
    with cpu_slots(nproc), open(f"{folder}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "report.json").is_file():
            make(folder)
    return folder


@pytest.fixture
def all_cpus():
    """Hold every CPU slot for the test (harness_launch.cpu_slots): for tests that start their own launchers
    (train.sh, several ranks, kill and resume) rather than through run_train."""
    with cpu_slots(None):
        yield


@pytest.fixture(scope="session")
def stage_run(tmp_path_factory):
    """stage_run(name) -> the folder of a 2-process run of the default recipe (harness_launch.STAGE_STEPS) under
    "ddp", "zero1", "zero2" or "zero3", run once per session (by whichever xdist worker asks first): tests/test_zero.py
    compares the stages with one another and with stopped-and-resumed runs, tests/test_multinode.py with two
    launchers."""
    root = shared_dir(tmp_path_factory, "stages")

    def run(name: str) -> Path:
        return run_once(root / name, lambda out: run_train([f"train.output_dir={out}", *STAGE_STEPS], nproc=2,
                                                           accel=STAGES[name]), 2)
    return run


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory) -> Path:
    """The default recipe in bf16 (fp32 weights under autocast), one process, 8 steps of 8 rows: tests/test_fp8.py's
    reference for float8, and (its first 6 steps: the learning rate warms up over 10 steps whatever
    train.max_steps) tests/test_weights.py's plain path, run once per session (by whichever xdist worker asks first)."""
    return run_once(shared_dir(tmp_path_factory, "bf16") / "run",
                    lambda out: run_train([f"train.output_dir={out}", *BF16_STEPS]), 1)


# ----------------------------------------------------------------------------------------------- the extended tier

# Variants left out of the default run (pyproject's addopts: -m "not extended") to keep CI under its time: each is
# another ZeRO stage, model family, recipe or file of a check whose other cases run every time. A launched run costs
# about 7-13 s before its first step on the 2-core CI machine (imports of torch, transformers, DeepSpeed in the
# launcher and both ranks), so the suite's time is mostly the number of launches (docs/bench/ci-durations.json:
# 31 minutes on 2 workers, 75 on one before them).
# Back in the default tier since the suite runs on 2 workers (2026-11-28, 33 minutes): two processes killed or stopped
# on streamed data resuming on two or one (test_streaming), early stopping on two processes (test_early_stopping),
# LoRA GRPO resumed exactly after kill -9 (test_rl); 2026-11-29: the GPU visit's preset end to end on the CPU
# (test_gpu_findings, 145 s in CI holding every CPU: a broken preset would waste a GPU visit), RL with regional
# compile, CUDA's default (test_rl, 32 s in CI: inductor's cold compile).
# Run them with `python -m pytest -m extended`, everything with `python -m pytest -m "extended or not extended"`.
EXTENDED = {
    "test_zero::test_deepspeed_bf16_on_cpu_and_zero2_optimizer_offload",  # bf16 on ZeRO: test_weights; CPU Adam build
    "test_multinode::test_two_launchers_equal_one_node_and_resume[zero3]",  # zero3 across nodes: the train.sh test
    "test_elastic::test_resume_on_another_process_count[zero2]",
    "test_sequence_parallel::test_sp2_on_other_families_equals_one_process[gpt_neox]",  # gpt2 has no key/value heads
    "test_zero::test_stopped_and_resumed_run_ends_with_the_same_weights[ddp]",  # zero3's, preemption's, elastic's
    "test_compile::test_compiled_blocks_run[single-full-1-None-extra0]",  # train.compile=full; regional runs
    *(f"test_families::test_generative_zero3_packing[{f}]" for f in
      ("qwen3", "mistral", "gemma3_text", "qwen2", "gemma", "gpt_neox", "starcoder2", "phi3", "olmo2")),
    *(f"test_families::test_unified_bidirectional[{f}]" for f in ("qwen2", "qwen3", "mistral")),
    *(f"test_gritlm::test_cached_representations_match_the_full_batch[{p}]" for p in
      ("2-zero2-2", "2-zero1-2", "2-ddp-2")),
    "test_gritlm::test_two_processes_equal_one_process_with_twice_the_batch[embedding]",
    "test_compile::test_compiled_blocks_run[zero2-regional-2-zero2-extra2]",
    *(f"test_untied::test_untied_head_two_processes_equal_one_process[{p}]" for p in
      ("unified-ddp-2", "embedding-zero3-2", "unified-zero1-1")),
    *(f"test_weights::test_every_zero_stage_trains_the_plain_paths_model_in_bf16[{s}]" for s in ("zero1", "zero2")),
    *(f"test_chunked_objective::test_two_processes_chunked_equal_one_process_full_logits[{s}]" for s in
      ("ddp", "zero1", "zero2")),
    "test_nonfinite::test_poisoned_step_is_skipped_exactly[zero3-bf16]",  # zero2-fp32's, whose reference the
    # max_nonfinite_skips test shares (one launch less); a skip under ZeRO-3: test_gradient_accumulation_skips_...
    "test_train::test_an_epochs_last_partial_step_is_the_same_on_two_processes[generative]",  # the same stream
    "test_rl::test_two_processes_equal_one[zero2]",  # zero3's (gathered weights for the generation) runs
    "test_rl::test_two_processes_stopped_mid_batch_resume_on_one_as_uninterrupted[zero2]",  # ddp's runs by default
    "test_rl_resume::test_another_task_is_refused[jsonl]",  # two runs; the JSONL fingerprint is checked in process
    "test_recipes::test_recipe_loads_and_dry_runs[configs/grpo-tiny.yaml]",  # every recipe loads
    *(f"test_metrics::test_disk_full_at_the_end_of_a_run_is_one_line_and_nothing_is_lost[{p}]" for p in
      ("events.out.tfevents.*", "summary*.md")),
    *(f"test_recipes::test_recipe_loads_and_dry_runs[configs/{r}.yaml]" for r in
      ("bench-vocab128k", "qwen2.5-1.5b-instruct-chat", "dpo-tiny", "rft-tiny-warmup", "gpu-1b", "gritlm-7b-mistral",
       "qwen2.5-0.5b-sft", "llama-70b", "llama-7b", "gritlm-tiny")),  # every recipe loads: test_every_recipe_loads
    *(f"test_recipes::test_real_model_recipe_zero_plan[configs/{r}.yaml]" for r in
      ("qwen2.5-1.5b-instruct-chat", "gritlm-7b-mistral", "qwen2.5-0.5b-sft", "qwen2.5-0.5b-dpo-lora")),
    # 2026-11-27, CI past 44 minutes on a slow run: each of these has a sibling that runs by default
    "test_preference::test_two_processes_under_zero_equal_one[zero2]",  # zero3's
    "test_untied::test_untied_head_two_processes_equal_one_process[embedding-ddp-1]",  # unified-zero3-1
    "test_gritlm::test_cached_representations_match_the_full_batch[1-None-4]",  # 2-zero3-2
    *(f"test_families::test_generative_zero3_packing[{f}]" for f in ("gemma2", "gpt2")),  # llama's; every family's
    # packing is checked in-process by test_packing_isolates_documents
    # 2026-11-27, the merged round's suite ran 70 minutes on a quiet 2-core machine: each of these has a sibling that
    # runs by default
    "test_elastic::test_resume_on_another_process_count[zero3]",  # 94 s; the ddp case runs
    "test_streaming::test_a_bad_record_met_in_training_stops_in_one_line_with_the_checkpoints_intact",  # the
    # stream-level bad record test
    # 2026-11-27, the default tier toward 40 minutes: each of these has a sibling that runs by default
    "test_sequence_parallel::test_sp2_losses_equal_one_process_and_every_row_is_trained_once[z2]",  # z3's (its runs
    # fixture launches the ZeRO-2 run only when this case asks for it)
    "test_moe::test_two_processes_with_a_starved_expert_equal_one_process[separate-ddp]",  # separate-zero2's: the same
    # ties, and ZeRO-2's buckets also check the order their gradients land in
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marker
def pytest_collection_modifyitems(config, items):
    names = set()
    for item in items:
        names.add(name := f"{item.path.stem}::{item.name}")
        if name in EXTENDED:
            item.add_marker(pytest.mark.extended)
    files = {item.path for item in items}
    if files == set(Path(__file__).parent.glob("test_*.py")) and EXTENDED - names:  # a stale name would run nowhere
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names no test: {sorted(EXTENDED - names)}")

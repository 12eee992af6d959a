"""Rejection-sampling fine-tuning (harness/rft): tasks and verifier, sampling with OOM back-off, resumable shards,
and one end-to-end run (warm-up, generate stopped and continued on 2 processes, train with LoRA, test).

    .venv/bin/python -m pytest tests/test_rft.py            # -m "not slow" for the unit tests only
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.config import ModelConfig, load_config
from harness.errors import ConfigError, DataError
from harness.rft import generate as gen
from harness.rft.contract import GREEDY, Completion, Sampling, encode
from harness.rft.tasks import ArithmeticTask, JsonlTask, Question, extract_answer, verify
from tests.harness_launch import ROOT, cpu_slots, free_port

RECIPE = str(ROOT / "configs" / "rft-tiny.yaml")
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": True}


# ----------------------------------------------------------------------------------------------- tasks, verifier


def test_verifier_accepts_right_answers_and_rejects_hand_made_wrong_ones():
    assert verify("17 + 25 = 42. The answer is 42.", 42)
    assert verify("The answer is 42.0", 42) and verify("so the answer is: 1,000.", 1000)
    assert verify("The answer is 7. No wait, the answer is 8.", 8)  # the last answer counts
    assert verify("The answer is 3.14159", 3.1416, tolerance=1e-4)
    for wrong in ["17 + 25 = 42. The answer is 43.", "The answer is 41.9", "42", "17 + 25 = 42.",
                  "The answer is forty-two.", "", "The answer is -42.", "The answer is 42000."]:
        assert not verify(wrong, 42), wrong
    assert not verify("The answer is 3.14", 3.1416, tolerance=1e-4)
    assert extract_answer("no number here") is None and extract_answer("The answer is -5.") == -5.0


def test_arithmetic_task_splits_are_disjoint_seeded_and_worked_answers_verify():
    t = ArithmeticTask(n_train=50, n_test=30, n_sft=40, max_operand=10, seed=3)
    splits = {s: t.split(s) for s in ("train", "test", "sft")}
    assert [len(v) for v in splits.values()] == [50, 30, 40]
    texts = [q.question for v in splits.values() for q in v]
    assert len(set(texts)) == len(texts)  # no question in two splits
    assert splits == {s: ArithmeticTask(50, 30, 40, 10, 3).split(s) for s in splits}  # seeded
    assert splits["test"] != ArithmeticTask(50, 30, 40, 10, 4).split("test")
    for q in [q for v in splits.values() for q in v]:
        assert t.verify(t.worked_answer(q), q)
    kinds = Counter(("+" in q) + 2 * ("-" in q) + 4 * ("times" in q) + 8 * ("How many" in q) for q in texts)
    assert {1, 2, 4, 8} <= set(kinds)  # sums, differences, products, unit conversions (and other wordings)
    assert t.sft_records()[0]["messages"][1]["role"] == "assistant"
    with pytest.raises(ConfigError, match="rft.max_operand"):
        ArithmeticTask(n_train=500, n_test=500, n_sft=500, max_operand=3)


def test_jsonl_task_reads_questions_and_names_bad_lines(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question": "What is 2 + 2?", "answer": 4}\n\n{"question": "Pi?", "answer": "3.14"}\n')
    qs = JsonlTask(str(f)).split("train")
    assert [(q.question, q.answer) for q in qs] == [("What is 2 + 2?", 4.0), ("Pi?", 3.14)]
    assert len({q.qid for q in qs}) == 2
    with pytest.raises(ConfigError, match="rft.test_file"):
        JsonlTask(str(f)).split("test")
    for line, field in [('{"question": "x", "answer": "four"}', "answer"), ('{"answer": 4}', "question"),
                        ('{"question": "x", "answer": true}', "answer"), ("{oops", "invalid JSON")]:
        f.write_text('{"question": "ok", "answer": 1}\n' + line + "\n")
        with pytest.raises(DataError, match=f"{f}:2: .*{field}"):
            JsonlTask(str(f)).split("train")


def test_rft_config_keys_are_checked():
    cfg = load_config(RECIPE, ["rft.oversample=4"])
    assert cfg.rft.oversample == 4 and cfg.rft.task == "arithmetic"
    for bad, says in [("rft.oversample=0", "rft.oversample"), ("rft.samples=3", "rft.samples"),
                      ("rft.temperature=0", r"'rft.temperature': out of range: must be > 0, got 0"),
                      ("rft.top_p=1.5", r"'rft.top_p': out of range: must be in \(0, 1\], got 1.5"),
                      ("rft.kv_cache_gb=-1", r"'rft.kv_cache_gb': out of range: must be > 0 \(or null")]:
        with pytest.raises(ConfigError, match=says):
            load_config(RECIPE, [bad])


def test_overrides_may_follow_the_options(capsys):
    from harness.tools.rft import main as rft_main

    # an override after --out reaches the config (its key is checked: the one-line error names it), not argparse
    assert rft_main(["test", RECIPE, "--out", "unused.json", "rft.oversampl=2"]) == 2
    assert "unknown config key 'rft.oversampl'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a stray option is still an argparse error
        rft_main(["test", RECIPE, "--out", "unused.json", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- judging, shards


def test_judge_keeps_only_verified_distinct_answers():
    t = ArithmeticTask(n_train=5, n_test=0, n_sft=0, max_operand=5)
    q = Question("train-0", "What is 2 + 3?", 5.0)
    right = "2 + 3 = 5. The answer is 5."
    responses = [right, "2 + 3 = 6. The answer is 6.", right, "The answer is 5.", "2 + 3 = 5.", "the answer is 5.0"]
    rec = gen.judge(t, q, responses, keep=2)
    assert rec["kept"] == [right, "The answer is 5."]  # distinct, at most 2, in order
    assert all(t.verify(r, q) for r in rec["kept"])
    assert (rec["samples"], rec["correct"], rec["answered"], rec["duplicates"]) == (6, 4, 5, 1)


def test_shards_survive_a_partial_last_line(tmp_path):
    shard = tmp_path / "rank-0.jsonl"
    gen.append_records(shard, [{"qid": "a", "kept": []}, {"qid": "b", "kept": []}])
    with shard.open("a") as fh:
        fh.write('{"qid": "c", "ke')  # killed while writing
    assert [r["qid"] for r in gen.read_shards(tmp_path)] == ["a", "b"]
    gen.repair_shard(shard)
    gen.append_records(shard, [{"qid": "c", "kept": []}])
    assert [r["qid"] for r in gen.read_shards(tmp_path)] == ["a", "b", "c"]


def test_merge_writes_training_records_in_question_order(tmp_path):
    from harness.data import samples as data

    t = ArithmeticTask(n_train=3, n_test=0, n_sft=0, max_operand=5)
    qs = t.split("train")
    (tmp_path / gen.SHARDS).mkdir()
    recs = [gen.judge(t, q, [t.worked_answer(q)] * 2 + ["The answer is -1."], 4) for q in qs]
    gen.append_records(tmp_path / gen.SHARDS / "rank-1.jsonl", recs[:1])
    gen.append_records(tmp_path / gen.SHARDS / "rank-0.jsonl", recs[2:])
    stats = gen.merge(t, qs, tmp_path, pairs=1)
    assert stats["questions_covered"] == 2 and stats["kept_examples"] == 2 and stats["duplicates_dropped"] == 2
    assert stats["success_rate"] == pytest.approx(4 / 6)
    rows = [json.loads(x) for x in (tmp_path / gen.OUTPUT).read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [qs[0].question, qs[2].question]
    assert len(data.load_generative_rows([str(tmp_path / gen.OUTPUT)])) == 2  # what `harness train` reads
    from harness.data import sources

    pairs = sources.load_rows([str(tmp_path / gen.PAIRS)], "preference")  # what loss.mode=preference reads
    assert stats["preference_pairs"] == len(pairs) == 2
    assert pairs[0]["rejected"][0]["content"] == "The answer is -1." and pairs[0]["prompt"][-1]["role"] == "user"


# ----------------------------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def tiny_model():
    from accelerate.utils import set_seed

    from harness.model import build_model, load_tokenizer

    cfg = ModelConfig(config=dict(TINY))
    tok = load_tokenizer(cfg)
    tok.padding_side = "left"
    set_seed(0)
    return build_model(cfg, tok).eval(), tok


@pytest.mark.parametrize("command", ["generate", "test"])
def test_generation_commands_check_the_context_as_training_does(tiny_model, tmp_path, command):
    """Issue 73, fault 7: `rft generate` (and `rft test`) took rft.max_new_tokens past the model's context of 128
    positions, which `harness train` refuses; now every generation path checks it before sampling: one line naming
    the key, exit 2, nothing sampled (failed before: generate sampled, exit 0)."""
    from harness.errors import ConfigError as Refused
    from harness.rft import evaluate

    model, tok = tiny_model
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    r = load_config(RECIPE, [f"rft.output_dir={tmp_path / 'gen'}", "rft.max_new_tokens=200", "rft.oversample=2",
                             "rft.num_train_questions=2", "rft.num_test_questions=2"]).rft
    with pytest.raises(Refused) as e:
        if command == "generate":
            gen.run(r, str(tmp_path / "m"))
        else:
            evaluate.run(r, str(tmp_path / "m"))
    assert str(e.value) == ("config key 'rft.max_new_tokens': 200 answer tokens do not fit the model's context of 128 "
                            "positions (max_position_embeddings) after a prompt; lower it")
    assert not list((tmp_path / "gen").glob("shards/rank-*.jsonl"))


def test_a_damaged_generation_config_is_one_line_naming_the_file(tiny_model, tmp_path):
    """Issue 73, fault 8: generation_config.json with `"eos_token_id": ["x"]` gave a raw traceback (int('x') in
    eos_ids, 11 frames) naming no file; now one line naming the file and the field, before anything is sampled."""
    from harness.errors import DataError as Damaged

    model, tok = tiny_model
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": ["x"]}))
    r = load_config(RECIPE, [f"rft.output_dir={tmp_path / 'gen'}", "rft.oversample=2", "rft.num_train_questions=2",
                             "rft.max_new_tokens=8"]).rft
    with pytest.raises(Damaged) as e:
        gen.run(r, str(tmp_path / "m"))
    assert str(e.value) == (f"{path}: field 'eos_token_id' must be a token id (an integer from 0 to "
                            f"{model.config.vocab_size - 1}) or a list of them, got ['x']")


def test_batched_sampling_with_left_padding_equals_one_question_at_a_time(tiny_model):
    model, tok = tiny_model
    t = ArithmeticTask(n_train=3, n_test=0, n_sft=0, max_operand=12)
    prompts = [gen.prompt_text(t, q, tok) for q in t.split("train")] + ["<s><|user|>\nHow many minutes are in 12 "
                                                                        "hours?\n<|assistant|>\n"]
    assert prompts[0].startswith("<s><|user|>\nWhat") or prompts[0].startswith("<s><|user|>\nHow")
    assert prompts[0].endswith("\n<|assistant|>\n")
    s = gen.Sampler(model, tok, max_new_tokens=6, micro=64)
    ids = encode(tok, prompts)  # (the engines take ids: harness/rft/contract.py)
    batched = s.sample(ids, 1, GREEDY)
    single = [s.sample([p], 1, GREEDY)[0] for p in ids]
    assert batched == single and s.sequences == 2 * len(prompts)
    assert all(0 < len(g[0].ids) <= 6 for g in batched)  # the tokens drawn, without the batch's padding
    torch.manual_seed(0)
    sampled = s.sample(ids[:2], 3, Sampling(temperature=1.0))
    assert [len(x) for x in sampled] == [3, 3]


def test_out_of_memory_halves_the_micro_batch(tiny_model):
    class SmallGpu(gen.Sampler):
        calls: list = []

        def _generate(self, ids, sampling):
            self.calls.append(len(ids))
            if len(ids) > 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated limit of 3 sequences)")
            return [Completion((p[0], i)) for i, p in enumerate(ids)]

    said = []
    s = SmallGpu(*tiny_model, max_new_tokens=4, micro=16, say=said.append)
    out = s.sample([[1], [2], [3]], 4)
    assert s.micro == 2 and s.calls[:3] == [12, 8, 4]
    assert [[c.ids[0] for c in group] for group in out] == [[1] * 4, [2] * 4, [3] * 4]
    assert s.sequences == 12 and len(said) == 3
    never = SmallGpu(*tiny_model, max_new_tokens=4, micro=1)
    never._generate = lambda *a: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("oom"))
    with pytest.raises(gen.HarnessError, match="one sequence"):
        never.sample([[1]], 1)


# ----------------------------------------------------------------------------------------------- end to end


def run(args: list[str], nproc: int = 1, module: str = "harness.rft") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", module, *args]
    with cpu_slots(nproc):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def qids(folder: Path) -> list[str]:
    return [r["qid"] for r in gen.read_shards(folder / gen.SHARDS)]


@pytest.mark.slow
def test_rft_end_to_end(tmp_path):
    from harness.tools.rft import main as rft_main

    # a supervised warm-up on worked answers; the task's questions are the warm-up questions (as a JSONL task),
    # so that this tiny, briefly trained model is often right
    sft = tmp_path / "sft.jsonl"
    small = ["rft.max_operand=4", "rft.num_sft_questions=12", "rft.num_train_questions=8",
             "rft.num_test_questions=8"]
    assert rft_main(["sft-data", RECIPE, *small, "--out", str(sft)]) == 0
    model_cfg = [f"model.config.{k}={v}" for k, v in TINY.items()]
    run(["--config", str(ROOT / "configs" / "rft-tiny-warmup.yaml"), *model_cfg, f"data.train_files=[{sft}]",
         f"train.output_dir={tmp_path}/warm", "train.max_steps=60", "train.micro_batch_size=12", "optim.lr=1e-2",
         "optim.warmup_steps=3", "train.progress_bar=false", "train.log_every=60"], module="harness.train")
    task = ArithmeticTask(8, 8, 12, 4, 0)
    train_q = tmp_path / "train_q.jsonl"
    train_q.write_text("".join(json.dumps({"id": q.qid, "question": q.question, "answer": q.answer}) + "\n"
                               for q in task.split("sft")))
    out = tmp_path / "gen"
    common = [f"model.name_or_path={tmp_path}/warm/final", f"rft.task={train_q}", f"rft.test_file={train_q}",
              f"rft.output_dir={out}", "rft.oversample=4", "rft.questions_per_batch=4", "rft.max_new_tokens=24",
              "rft.keep_per_question=2", f"data.train_files=[{sft}]"]

    # (4) killed (SIGKILL) once its first batch of questions is on disk, a half-written line left behind, then
    # continued on 2 processes
    shard = out / gen.SHARDS / "rank-0.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # (4 sequences in flight: the continuous engine ends one question at a time, so the kill finds some not done)
    victim = subprocess.Popen([sys.executable, "-m", "harness.rft", "generate", RECIPE, *common,
                               "rft.micro_batch_sequences=4"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while victim.poll() is None and time.time() < deadline and not (shard.is_file() and shard.read_text().count("\n")):
        time.sleep(0.02)
    victim.kill()
    assert victim.wait() == -signal.SIGKILL, "generation ended before it could be killed"
    first = shard.read_text()
    first = first[: first.rindex("\n") + 1]  # what was complete when it was killed
    assert 0 < len(qids(out)) < 12 and not (out / gen.OUTPUT).exists()
    with (out / gen.SHARDS / "rank-0.jsonl").open("a") as fh:
        fh.write('{"qid": "sft-9", "question": "What')
    assert rft_main(["generate", RECIPE, *common, "rft.temperature=0.5"]) == 2  # other settings: refused
    run(["generate", RECIPE, *common], nproc=2)
    ids = qids(out)
    assert sorted(ids) == sorted(q.qid for q in task.split("sft")) and len(ids) == len(set(ids)) == 12
    assert (out / gen.SHARDS / "rank-0.jsonl").read_text().startswith(first)  # finished questions not redone

    # every kept answer verifies; some were kept; the stats add up
    stats = json.loads((out / gen.STATS).read_text())
    rows = [json.loads(x) for x in (out / gen.OUTPUT).read_text().splitlines()]
    by_question = {q.question: q for q in JsonlTask(str(train_q)).split("train")}
    assert rows and all(task.verify(r["messages"][1]["content"], by_question[r["messages"][0]["content"]])
                        for r in rows)
    assert stats["kept_examples"] == len(rows) and stats["questions_covered"] == 12 and stats["samples"] == 48
    assert 0 < stats["success_rate"] <= 1

    # (2) a fresh single-process run covers the same questions, each once
    cfg1 = load_config(RECIPE, [*common, f"rft.output_dir={tmp_path}/gen1"])
    gen.run(cfg1.rft, cfg1.model.name_or_path)
    assert sorted(qids(tmp_path / "gen1")) == sorted(ids)

    # train on the kept answers with LoRA, then test (the adapter's merged model is used)
    run(["train", RECIPE, *common, f"train.output_dir={tmp_path}/rft", "train.max_steps=3", "model.lora.enabled=true",
         "train.progress_bar=false", "train.report_to=[]"])
    assert (tmp_path / "rft" / "final" / "adapter_config.json").is_file()
    assert rft_main(["test", RECIPE, *common, "--model", f"{tmp_path}/rft/final", "--out", f"{tmp_path}/t.json"]) == 0
    rep = json.loads((tmp_path / "t.json").read_text())
    assert rep["questions"] == 12 and rep["model"].endswith("merged")
    assert 0 <= rep["accuracy"] <= rep["answer_rate"] <= 1

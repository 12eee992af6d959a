"""`harness rft generate`: sample many answers per question, keep the verified ones, write chat records.

    harness rft generate configs/rft-tiny.yaml [--model PATH] [--stop-after N] [section.key=value ...]
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m harness.rft generate configs/rft-tiny.yaml

Each process takes every world-th remaining question of the task's train split and samples them in batches of
`rft.questions_per_batch` questions x `rft.oversample` sequences (repeated prompts, left-padded, one generate()
call per at most `rft.micro_batch_sequences` sequences, halved on a CUDA out-of-memory error). After each batch the
process appends one JSON line per question to its own shard, `<output_dir>/shards/rank-R.jsonl` (flush + fsync):
a question is done once its line is there, so a restarted run (any process count) skips it. At the end rank 0
merges the shards into `<output_dir>/rft.jsonl`, the kept answers as `{"messages": [user, assistant]}` records that
`harness train` reads directly (identical answers to one question kept once), and `<output_dir>/stats.json`.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch

from harness.errors import ConfigError, HarnessError
from harness.rft.tasks import Question, Task

SHARDS = "shards"
OUTPUT = "rft.jsonl"
PAIRS = "pairs.jsonl"  # preference pairs: a verified answer (chosen) and a wrong one (rejected) to one question
STATS = "stats.json"
SETTINGS = "settings.json"


# ----------------------------------------------------------------------------------------------- model and sampling


def resolve_model_path(path: Optional[str]) -> str:
    """A model folder for generation: a LoRA final/ (adapter) is replaced by its merged/ sibling."""
    if not path:
        raise ConfigError("config key 'model.name_or_path': rft needs a trained model (a folder such as "
                          "runs/x/final, or a hub id); give it there or with --model")
    p = Path(path)
    if (p / "adapter_config.json").is_file():
        if not (p / "merged").is_dir():
            raise ConfigError(f"config key 'model.name_or_path': {p} holds a LoRA adapter without merged/")
        return str(p / "merged")
    return str(path)


def load_for_generation(path: str, device: torch.device):
    """(model in eval mode, tokenizer with left padding); bf16 on GPUs that support it, fp32 otherwise."""
    from transformers import AutoModelForCausalLM

    from harness import hardware
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    path = resolve_model_path(path)
    dtype = torch.bfloat16 if device.type == "cuda" and hardware.resolve_precision("auto") == "bf16" else torch.float32
    tok = load_tokenizer(ModelConfig(name_or_path=path), markers=None)  # its saved chat template, else GritLM's
    tok.padding_side = "left"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'model.name_or_path': cannot load '{path}': {str(e).splitlines()[0]}")
    return model.to(device).eval(), tok


def prompt_text(task: Task, q: Question, tokenizer) -> str:
    """The question in the model's chat template (the one it was trained with, saved with its tokenizer), ending
    where the assistant's answer starts; bos included when the template writes it."""
    return tokenizer.apply_chat_template(task.messages(q), add_generation_prompt=True, tokenize=False)


class Sampler:
    """Batched sampling with left padding; each prompt `n` times (repeated prompts, so that one call mixes many
    questions). Sequences go through generate() in chunks of at most `micro` sequences; a CUDA out-of-memory error
    halves `micro` and retries the chunk."""

    def __init__(self, model, tokenizer, max_new_tokens: int, micro: int, say: Callable = print) -> None:
        self.model, self.tok, self.max_new_tokens, self.micro, self.say = model, tokenizer, max_new_tokens, micro, say
        self.sequences = 0  # generated so far
        self.seconds = 0.0  # spent in generate()

    def sample(self, prompts: list[str], n: int, temperature: float = 1.0, top_p: float = 1.0,
               greedy: bool = False) -> list[list[str]]:
        """n responses per prompt, grouped by prompt."""
        seqs = [p for p in prompts for _ in range(n)]
        out: list[str] = []
        i = 0
        while i < len(seqs):
            chunk = seqs[i:i + self.micro]
            try:
                t0 = time.perf_counter()
                out += self._generate(chunk, temperature, top_p, greedy)
                self.seconds += time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                if self.micro == 1:
                    raise HarnessError("out of GPU memory with one sequence per generate() call: lower "
                                       "rft.max_new_tokens or use a larger GPU") from None
                self.micro = max(1, self.micro // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.say(f"[rft] out of memory: micro-batch halved to {self.micro} sequences")
                continue
            i += len(chunk)
            self.sequences += len(chunk)
        return [out[k * n:(k + 1) * n] for k in range(len(prompts))]

    @torch.no_grad()
    def _generate(self, texts: list[str], temperature: float, top_p: float, greedy: bool) -> list[str]:
        tok, dev = self.tok, self.model.device
        ids = tok(texts, add_special_tokens=False)["input_ids"]  # the chat template writes bos where it wants one
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids], device=dev)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=dev)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        gen = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw)
        return [t.strip() for t in tok.batch_decode(gen[:, width:], skip_special_tokens=True)]


def judge(task: Task, q: Question, responses: list[str], keep: int) -> dict:
    """One question's shard record: counts, its distinct verified responses (at most `keep`, first come) and as many
    distinct wrong ones (`rejected`: the preference pairs' other side)."""
    kept: list[str] = []
    rejected: list[str] = []
    correct = answered = duplicates = 0
    for r in responses:
        ok = task.verify(r, q)
        answered += task.extract(r) is not None
        correct += ok
        if ok:
            if r in kept:
                duplicates += 1
            elif len(kept) < keep:
                kept.append(r)
        elif r.strip() and r not in rejected and len(rejected) < keep:
            rejected.append(r)
    return {"qid": q.qid, "question": q.question, "answer": q.answer, "samples": len(responses), "correct": correct,
            "answered": answered, "duplicates": duplicates, "kept": kept, "rejected": rejected}


# ----------------------------------------------------------------------------------------------- shards


def repair_shard(path: Path) -> None:
    """Cut a partial last line (a run killed while writing) so that appending continues on a clean line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with path.open("r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())


def read_shards(folder: Path) -> list[dict]:
    """Every complete question record of every shard file (a partial last line is ignored)."""
    records = []
    for f in sorted(folder.glob("rank-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # only the last line of a killed run can be partial
    return records


def append_records(path: Path, records: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
        fh.flush()
        os.fsync(fh.fileno())


def merge(task: Task, questions: list[Question], folder: Path) -> dict:
    """shards/ -> rft.jsonl (chat records in question order) + stats.json; returns the stats."""
    from harness.files import write_json

    by_qid: dict[str, dict] = {}
    repeats = 0
    for r in read_shards(folder / SHARDS):
        repeats += r["qid"] in by_qid
        by_qid.setdefault(r["qid"], r)
    rows = []
    for q in questions:
        r = by_qid.get(q.qid)
        for answer in (r or {}).get("kept", []):
            rows.append({"messages": task.messages(q) + [{"role": "assistant", "content": answer}]})
    pairs = []  # each verified answer against a wrong one of the same question (loss.mode=preference)
    for q in questions:
        r = by_qid.get(q.qid) or {}
        wrong = r.get("rejected", [])
        for i, answer in enumerate(r.get("kept", []) if wrong else []):
            pairs.append({"prompt": task.messages(q), "chosen": [{"role": "assistant", "content": answer}],
                          "rejected": [{"role": "assistant", "content": wrong[i % len(wrong)]}]})
    for name, records in ((OUTPUT, rows), (PAIRS, pairs)):
        tmp = folder / (name + ".tmp")
        tmp.write_text("".join(json.dumps(x) + "\n" for x in records), encoding="utf-8")
        os.replace(tmp, folder / name)
    done = [by_qid[q.qid] for q in questions if q.qid in by_qid]
    samples = sum(r["samples"] for r in done)
    stats = {
        "questions": len(questions),
        "questions_covered": len(done),
        "questions_with_kept": sum(bool(r["kept"]) for r in done),
        "kept_examples": len(rows),
        "preference_pairs": len(pairs),
        "samples": samples,
        "correct_samples": sum(r["correct"] for r in done),
        "success_rate": sum(r["correct"] for r in done) / max(samples, 1),
        "answer_rate": sum(r["answered"] for r in done) / max(samples, 1),
        "duplicates_dropped": sum(r["duplicates"] for r in done),
        "repeated_question_records": repeats,
        "output": str(folder / OUTPUT),
        "pairs": str(folder / PAIRS),
    }
    write_json(folder / STATS, stats)
    return stats


def generation_settings(cfg, model_path: Optional[str]) -> dict:
    """What the shards' answers depend on: a restarted run must use the same, or its output would mix two runs."""
    r = cfg.rft
    return {"model": str(model_path or cfg.model.name_or_path), "task": r.task, "test_file": r.test_file,
            "num_train_questions": r.num_train_questions, "num_test_questions": r.num_test_questions,
            "num_sft_questions": r.num_sft_questions, "max_operand": r.max_operand, "task_seed": r.task_seed,
            "tolerance": r.tolerance, "oversample": r.oversample, "temperature": r.temperature, "top_p": r.top_p,
            "max_new_tokens": r.max_new_tokens, "keep_per_question": r.keep_per_question}


def check_settings(path: Path, settings: dict, write: bool = True) -> None:
    """Record the settings of a new run; refuse to continue one that was started with other settings."""
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            key = "model.name_or_path (or --model)" if diff[0] == "model" else f"rft.{diff[0]}"
            raise ConfigError(f"config key '{key}': {path.parent.parent} was started with "
                              f"{diff[0]}={old.get(diff[0])!r}, now {settings[diff[0]]!r}; use another rft.output_dir "
                              f"or the same settings to continue")
        return
    if write:
        from harness.files import write_json

        write_json(path, settings)


# ----------------------------------------------------------------------------------------------- the command


def make_accelerator():
    """A plain Accelerator (no model is prepared: each process samples on its own); gloo when launched on CPU."""
    from accelerate import Accelerator

    from harness.distributed import process_group_kwargs

    return Accelerator(kwargs_handlers=process_group_kwargs())


def run(cfg, model_path: Optional[str] = None, stop_after: int = 0) -> Optional[dict]:
    """Generate for every question of the train split not yet done; returns the merged stats on rank 0 (None when
    stopped early by `stop_after` question batches per process)."""
    from tqdm.auto import tqdm

    from harness.rft.tasks import build_task

    r = cfg.rft
    task = build_task(r)
    questions = task.split("train")
    acc = make_accelerator()
    say = acc.print
    out = Path(r.output_dir)
    shard = out / SHARDS / f"rank-{acc.process_index}.jsonl"
    if acc.is_main_process:
        (out / SHARDS).mkdir(parents=True, exist_ok=True)
    check_settings(out / SHARDS / SETTINGS, generation_settings(cfg, model_path), write=acc.is_main_process)
    acc.wait_for_everyone()
    repair_shard(shard)
    acc.wait_for_everyone()
    done = {rec["qid"] for rec in read_shards(out / SHARDS)}
    acc.wait_for_everyone()  # every process has read the same files before anyone appends
    remaining = [q for q in questions if q.qid not in done]
    mine = remaining[acc.process_index::acc.num_processes]
    model, tok = load_for_generation(model_path or cfg.model.name_or_path, acc.device)
    sampler = Sampler(model, tok, r.max_new_tokens, r.micro_batch_sequences, say)
    say(f"[rft] {len(questions)} questions, {len(done)} already done, {len(remaining)} to sample on "
        f"{acc.num_processes} process(es) x {r.oversample} samples (temperature {r.temperature}, "
        f"max_new_tokens {r.max_new_tokens}, {r.questions_per_batch} questions per batch, device {acc.device}, "
        f"{next(model.parameters()).dtype})")
    bar = tqdm(total=len(mine), desc="rft generate", disable=not acc.is_main_process, dynamic_ncols=True)
    correct = samples = batches = 0
    for i in range(0, len(mine), r.questions_per_batch):
        if stop_after and batches >= stop_after:
            break
        batch = mine[i:i + r.questions_per_batch]
        torch.manual_seed(r.seed + zlib.crc32(batch[0].qid.encode()))
        prompts = [prompt_text(task, q, sampler.tok) for q in batch]
        responses = sampler.sample(prompts, r.oversample, r.temperature, r.top_p)
        records = [judge(task, q, resp, r.keep_per_question) for q, resp in zip(batch, responses)]
        append_records(shard, records)
        batches += 1
        correct += sum(x["correct"] for x in records)
        samples += sum(x["samples"] for x in records)
        bar.update(len(batch))
        bar.set_postfix(success=f"{correct / max(samples, 1):.1%}",
                        seq_s=f"{sampler.sequences / max(sampler.seconds, 1e-9):.1f}")
    bar.close()
    from accelerate.utils import gather_object

    left = len(mine) > stop_after * r.questions_per_batch if stop_after else False
    speed = gather_object([(sampler.sequences, sampler.seconds, left)])  # every process takes the same decision
    seqs, secs = sum(x[0] for x in speed), max((x[1] for x in speed), default=0.0)
    if any(x[2] for x in speed):
        say(f"[rft] stopped after {stop_after} batch(es) per process; run the same command again to continue")
        return None
    stats = None
    if acc.is_main_process:
        stats = merge(task, questions, out)
        stats.update(sequences_this_run=seqs, sequences_per_s=seqs / max(secs, 1e-9), processes=acc.num_processes)
        from harness.files import write_json

        write_json(out / STATS, stats)
        say(f"[rft] done: {stats['questions_covered']}/{stats['questions']} questions covered, "
            f"{stats['kept_examples']} examples kept ({stats['questions_with_kept']} questions with at least one), "
            f"success rate {stats['success_rate']:.1%}, answer rate {stats['answer_rate']:.1%}, "
            f"{stats['duplicates_dropped']} duplicate answers dropped, {stats['sequences_per_s']:.1f} sequences/s "
            f"-> {out / OUTPUT}")
    acc.wait_for_everyone()
    return stats


# ----------------------------------------------------------------------------------------------- benchmark


def bench(cfg, model_path: Optional[str] = None, questions: int = 32, repeats: int = 2) -> list[dict]:
    """Sequences/s of the same sampling (first `questions` train questions x rft.oversample, same temperature and
    max_new_tokens, same device and dtype) done three ways: one sequence per generate() call, one question (its
    oversample sequences) per call, and rft.questions_per_batch questions per call. Interleaved, best of
    `repeats`."""
    from harness.rft.tasks import build_task

    r = cfg.rft
    task = build_task(r)
    qs = task.split("train")[:questions]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_for_generation(model_path or cfg.model.name_or_path, device)
    prompts = [prompt_text(task, q, tok) for q in qs]
    ways = {"one sequence per call": (1, 1, r.oversample), "one question per call": (1, r.oversample, 1),
            f"{r.questions_per_batch} questions per call": (r.questions_per_batch, r.oversample, 1)}
    best: dict[str, dict] = {}
    for rep in range(repeats):
        for name, (per_call, n, loops) in ways.items():
            s = Sampler(model, tok, r.max_new_tokens, r.micro_batch_sequences)
            torch.manual_seed(r.seed + rep)
            generated = 0
            t0 = time.perf_counter()
            for i in range(0, len(prompts), per_call):
                for _ in range(loops):
                    out = s.sample(prompts[i:i + per_call], n, r.temperature, r.top_p)
                    generated += sum(len(tok(x, add_special_tokens=False)["input_ids"]) for g in out for x in g)
            secs = time.perf_counter() - t0
            row = {"way": name, "sequences": s.sequences, "seconds": round(secs, 2),
                   "sequences_per_s": round(s.sequences / secs, 1), "new_tokens_per_s": round(generated / secs, 1)}
            if name not in best or row["sequences_per_s"] > best[name]["sequences_per_s"]:
                best[name] = row
    rows = list(best.values())
    base = rows[0]["sequences_per_s"]
    for row in rows:
        row["speedup"] = round(row["sequences_per_s"] / base, 1)
    return rows

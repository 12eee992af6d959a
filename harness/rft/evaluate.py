"""`harness rft test`: accuracy and answer rate on the held-out questions, greedy decoding, JSON report.

    harness rft test configs/rft-tiny.yaml --model runs/rft-tiny/train/final --out runs/rft-tiny/test-after.json
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m harness.rft test configs/rft-tiny.yaml

accuracy = questions answered right / questions; answer rate = responses with an extractable answer / questions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from harness.rft.contract import GREEDY, encode, texts
from harness.rft.generate import processes
from harness.rft.sampling import StaticEngine, load_engine, prompt_text, resolve_model_path
from harness.files import write_json
from harness.rft.tasks import build_task


def run(r, path: Optional[str], out: Optional[str] = None, split: str = "test") -> Optional[dict]:
    """Evaluate on `split` (`r`: cfg.rft; path: the model, --model, else model.name_or_path); rank 0 writes and
    returns the report."""
    from accelerate.utils import gather_object

    task = build_task(r)
    questions = task.split(split)
    with processes() as acc:  # (the process group destroyed on a clean end: generate.processes)
        engine, tok = load_engine(r, path, acc.device, acc.print, task, questions)  # (every process: all of them)
        if isinstance(engine, StaticEngine):
            engine.per_call = max(1, r.micro_batch_sequences)  # one generate() call per that many questions
        mine = questions[acc.process_index::acc.num_processes]
        t0 = time.time()
        rows = []
        responses = texts(tok, engine.generate(encode(tok, [prompt_text(task, q, tok) for q in mine]), 1, GREEDY),
                          engine.eos)
        for q, (resp,) in zip(mine, responses):
            rows.append({"qid": q.qid, "question": q.question, "answer": q.answer, "response": resp,
                         "extracted": task.extract(resp), "correct": task.verify(resp, q)})
        rows = gather_object(rows)
        report = None
        if acc.is_main_process:
            n = len(rows)
            report = {
                "model": resolve_model_path(path),
                "task": r.task,
                "split": split,
                "questions": n,
                "accuracy": sum(x["correct"] for x in rows) / max(n, 1),
                "answer_rate": sum(x["extracted"] is not None for x in rows) / max(n, 1),
                "decoding": "greedy",
                "engine": engine.name,
                "max_new_tokens": r.max_new_tokens,
                "processes": acc.num_processes,
                "seconds": time.time() - t0,
                "examples": sorted(rows, key=lambda x: x["qid"])[:8],
            }
            dest = Path(out) if out else Path(r.output_dir) / "test.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_json(dest, report)
            acc.print(f"[rft] test on {n} held-out questions: accuracy {report['accuracy']:.1%}, answer rate "
                      f"{report['answer_rate']:.1%} ({report['model']}) -> {dest}")
    return report

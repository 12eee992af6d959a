"""data.streaming against the data's size, and against the cached path's speed (docs/streaming.md).

    python scripts/bench_streaming.py --json docs/bench/streaming-cpu.json

1. Size: a JSON lines file of N records and one of 10 N (records drawn from data/sample/gen.jsonl, numbered so that
   none repeats), each trained by the default recipe with data.streaming=true, data.packing=true for a few steps:
   peak resident memory of the training process (ru_maxrss of the child) and the time from launch to step 1's
   metrics record. N is above data.shuffle_buffer, so both read the same number of records before step 1.
2. Speed: the default job (configs/default.yaml, its data), cached and streamed, the same number of steps, tokens/s
   of report.json (the loop's own count of real tokens over the training time), interleaved, repeated.
Not a test: the figures go to docs/streaming.md with the date, the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.progress_bar=false", "train.log_every=1", "train.report_to=[]", "train.summary=false",
        "train.eval_at_start=false", "data.eval_files=[]", "train.save_every_minutes=0", "train.save_every_steps=0"]


def make_file(path: Path, n: int) -> None:
    base = [json.loads(line) for line in (ROOT / "data/sample/gen.jsonl").read_text().splitlines()]
    with open(path, "w") as f:
        for i in range(n):
            rec = dict(base[i % len(base)])
            if "text" in rec:
                rec["text"] = f"({i}) {rec['text']}"
            else:
                rec["messages"] = [dict(m) for m in rec["messages"]]
                rec["messages"][0]["content"] = f"({i}) {rec['messages'][0]['content']}"
            f.write(json.dumps(rec) + "\n")


def train(out: Path, overrides: list[str]) -> dict:
    """One training process: its peak RSS (MiB), the seconds to step 1's metrics record, and report.json."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    probe = ("import resource, subprocess, sys, time, json, os\n"
             "t0 = time.time(); p = subprocess.Popen(sys.argv[2:]); first = None\n"
             "m = os.path.join(sys.argv[1], 'metrics.jsonl')\n"
             "while p.poll() is None:\n"
             "    if first is None and os.path.exists(m) and any('\"loss\"' in l for l in open(m)): first = time.time() - t0\n"
             "    time.sleep(0.05)\n"
             "print(json.dumps({'rc': p.returncode, 'first_step_s': first, "
             "'peak_rss_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n")
    cmd = [sys.executable, "-c", probe, str(out), sys.executable, "-m", "harness.train", "--config",
           str(ROOT / "configs/default.yaml"), *FAST, f"train.output_dir={out}", "train.overwrite=true", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["rc"] != 0:
        raise SystemExit(f"training failed: {' '.join(overrides)}\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return {**got, "tokens_per_s": report.get("tokens_per_s"), "steps": report.get("steps")}


def data_only(steps: int) -> dict:
    """CPU seconds (process time, which the machine's load does not inflate as much as wall time) to make the
    default job's micro-batches: streamed (read, tokenize, collate as training does) and cached (the tokenized
    data set built first, then its DataLoader), in this process, no model."""
    from torch.utils.data import DataLoader

    from harness.config import load_config
    from harness.data import samples, streaming
    from harness.model import load_tokenizer

    cfg = load_config(ROOT / "configs/default.yaml", ["data.streaming=true", f"train.max_steps={steps}"])
    tok = load_tokenizer(cfg.model)
    collate = samples.GenerativeCollator(tok.pad_token_id)
    t0 = time.process_time()
    rows = samples.load_generative_rows(cfg.data.train_files)
    ds, _ = samples.tokenize_dataset(rows, tok, cfg.data.max_len)
    prepared = time.process_time() - t0
    loader = iter(DataLoader(ds, batch_size=cfg.train.micro_batch_size, shuffle=True, collate_fn=collate))
    t0 = time.process_time()
    for _ in range(min(steps, len(ds) // cfg.train.micro_batch_size)):
        next(loader)
    cached = (time.process_time() - t0) / min(steps, len(ds) // cfg.train.micro_batch_size)

    class Acc:  # what build_stream reads of the accelerator
        print, device = staticmethod(lambda *a: None), None

    stream = streaming.build_stream(cfg.data, cfg.train, Acc, tok, cfg.data.max_len, collate, 1, 0)
    batches = stream.batches({"epoch": 0, "batches": 0})
    t0 = time.process_time()
    next(batches)
    first = time.process_time() - t0
    t0 = time.process_time()
    for _ in range(steps):
        next(batches)
    streamed = (time.process_time() - t0) / steps
    return {"cached_prepare_cpu_s": prepared, "cached_batch_cpu_s": cached, "streamed_first_batch_cpu_s": first,
            "streamed_batch_cpu_s": streamed, "batches": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=20000, help="N: the smaller file's records (the larger: 10 N)")
    ap.add_argument("--steps", type=int, default=20, help="steps of each speed run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--data-only", action="store_true", help="only the data pipelines' CPU time per micro-batch")
    a = ap.parse_args()
    if a.data_only:
        got = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
               **data_only(a.steps)}
        print(json.dumps(got, indent=1))
        if a.json:
            a.json.write_text(json.dumps(got, indent=1) + "\n")
        return
    rows: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                  "load_avg_at_start": os.getloadavg(), "size": [], "speed": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in (a.records, 10 * a.records):
            data = tmp / f"gen-{n}.jsonl"
            make_file(data, n)
            r = train(tmp / f"size-{n}", [f"data.train_files=[{data}]", "data.streaming=true", "data.packing=true",
                                          "train.max_steps=2"])
            rows["size"].append({"records": n, "bytes": data.stat().st_size, **r})
            print(rows["size"][-1], flush=True)
        for k in range(a.repeats):
            for mode in ("cached", "streamed"):
                extra = ["data.streaming=true"] if mode == "streamed" else []
                r = train(tmp / f"speed-{mode}-{k}", [f"train.max_steps={a.steps}", *extra])
                rows["speed"].append({"mode": mode, "repeat": k, **r})
                print(rows["speed"][-1], flush=True)
    small, large = rows["size"]
    tps = {m: sum(r["tokens_per_s"] for r in rows["speed"] if r["mode"] == m) / a.repeats
           for m in ("cached", "streamed")}
    rows["summary"] = {"peak_rss_ratio_10x": large["peak_rss_mib"] / small["peak_rss_mib"],
                       "first_step_ratio_10x": large["first_step_s"] / small["first_step_s"],
                       "tokens_per_s_cached": tps["cached"], "tokens_per_s_streamed": tps["streamed"],
                       "streamed_over_cached": tps["streamed"] / tps["cached"],
                       "load_avg_at_end": os.getloadavg()}
    print(json.dumps(rows["summary"], indent=1))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Peak memory per process with and without sequence parallelism (issue 40, point 2), on this machine's CPU.

    python scripts/sp_memory.py                      # SP 1 (1 process) and SP 2 (2 processes), ZeRO-3, 8192 tokens
    python scripts/sp_memory.py --max-len 16384 --layers 8 --out docs/bench/sp-memory-cpu.json

A model whose activations dominate (hidden 256, 16 layers, 4 heads: 12.6M parameters) trains one row of `--max-len`
tokens per step (one long document a row, written to <work>/long.jsonl: plain causal attention, no mask) under
DeepSpeed ZeRO-3, 2 steps. (`--packed` packs the sample data instead: under sdpa on a CPU the documents' mask is an
L x L tensor per layer, which the kernel keeps for its backward on every process whatever N: measured at 8192 tokens
and 8 layers SP 2 / SP 1 = 0.86 on the peak's growth. Flash attention reads document boundaries from the position
ids and has no such mask.) Each training process records (a wrapper around harness.train's loop, `--worker`): its resident set
before the first step (libraries, model, optimizer: what no sequence split changes on a CPU) and its peak resident
set (ru_maxrss) after the steps. The measure: the peak's growth during training (activations, gradients, workspaces:
what a GPU's max_memory_allocated counts) and the raw peak, per process; SP 2 / SP 1 for each. One JSON row per
process and run is appended to --out.

The resident set counts what glibc's malloc keeps, not only what is in use. By default glibc raises its mmap threshold
each time a large block is freed, so later activations come from the heap, whose freed space stays resident: measured
at 8192 tokens and 8 layers, that kept 0.6 GiB more at SP 1 and gave the two SP 2 processes different peaks (0.65 and
0.57 of SP 1). The training processes therefore run with a fixed threshold (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ at 128 KiB): every large tensor is its own mapping, returned when freed, and the peak resident
set follows the bytes in use, as a GPU allocator's counters do. `--glibc-default` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MMAP_THRESHOLD = 128 * 1024


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(argv: list[str]) -> int:
    """harness.train's main with its loop wrapped: memory before the first step and the peak after the last."""
    sys.path.insert(0, str(ROOT))
    import harness.train as train

    loop, rows = train.train_loop, {}

    def measured(job, state, side):
        rows.update(rank=job.accelerator.process_index, start_rss_gib=rss_gib(), start_peak_gib=peak_gib())
        stopped = loop(job, state, side)
        rows.update(peak_gib=peak_gib(), steps=state.step, tokens=state.tokens)
        with open(Path(os.environ["SP_MEMORY_OUT"]) / f"rank-{rows['rank']}.json", "w") as f:
            json.dump(rows, f)
        return stopped

    train.train_loop = measured
    return train.main(argv)


def long_rows(out: Path, rows: int = 4, words: int = 40000) -> Path:
    """A data file of `rows` documents of `words` words each (more tokens than any --max-len: each row is cut to it)."""
    import random

    path = out / "long.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    vocab = "the a of to and in is it that was for on are with as by this be at from or have an".split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")
    return path


def run(sp: int, args, out: Path) -> list[dict]:
    folder = out / f"sp{sp}"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SP_MEMORY_OUT": str(folder), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)  # DeepSpeed runs on CPU without it
    if not args.glibc_default:  # the resident set follows the bytes in use (see the module's text)
        env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(MMAP_THRESHOLD))
    overrides = ["train.progress_bar=false", "train.report_to=[]", "train.summary=false", "data.eval_files=[]",
                 "train.eval_at_start=false", "train.save_final=false", "train.save_final_checkpoint=false",
                 f"data.max_len={args.max_len}", "train.micro_batch_size=1",
                 *(["data.packing=true"] if args.packed else ["data.packing=false", f"data.train_files=[{long_rows(out)}]"]),
                 f"train.max_steps={args.steps}", "train.log_every=1", "model.config.hidden_size=256",
                 "model.config.intermediate_size=688", f"model.config.num_hidden_layers={args.layers}",
                 "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4",
                 f"model.config.max_position_embeddings={args.max_len}", "model.attn_implementation=sdpa",
                 f"train.sequence_parallel={sp}", f"train.output_dir={folder / 'run'}", "train.overwrite=true"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", str(sp), "--main_process_port",
           str(29500 + sp), str(Path(__file__).resolve()), "--worker", "--config", str(ROOT / "configs/default.yaml"),
           *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"SP {sp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rows = []
    for r in range(sp):
        row = json.loads((folder / f"rank-{r}.json").read_text())
        row.update(sequence_parallel=sp, processes=sp, max_len=args.max_len, layers=args.layers, packed=args.packed,
                   malloc="glibc default" if args.glibc_default else f"mmap threshold {MMAP_THRESHOLD} fixed",
                   growth_gib=row["peak_gib"] - row["start_rss_gib"], wall_s=round(time.time() - t0, 1))
        rows.append(row)
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--packed", action="store_true", help="the sample data packed (many documents a row)")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's adaptive mmap threshold on (the resident set then keeps freed heap space)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "sp-memory-cpu.json"))
    ap.add_argument("--work", default="/tmp/sp-memory")
    args = ap.parse_args()
    rows = [row for sp in (1, 2) for row in run(sp, args, Path(args.work))]
    one = rows[0]
    for row in rows:
        row["growth_vs_sp1"] = round(row["growth_gib"] / one["growth_gib"], 3)
        row["peak_vs_sp1"] = round(row["peak_gib"] / one["peak_gib"], 3)
        print(json.dumps(row))
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(earlier + [{"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "command": " ".join(sys.argv), "rows": rows}], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

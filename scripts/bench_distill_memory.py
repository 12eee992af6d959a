"""Peak memory (and time) of one distillation loss step over a large vocabulary, forward + backward (issue 76):
full student and teacher logits + harness.distill.loss.divergence_sum ("full") against
harness.distill.loss.chunked_divergence ("chunked:C", chunk size C), the form loss.mode=distill runs.

The shape is configs/bench-vocab128k.yaml's (Llama-3's 128,256-token vocabulary, micro-batch 8 x 1024 tokens); the
student's hidden size 256, the teacher's 512 (a wider teacher, as distillation has it). Each contender runs in a
fresh process (`--child`) and reports the kernel's resident-set high-water mark (VmHWM); "baseline" builds the same
tensors (hidden states, head weights, the student's .grad buffers) and runs no loss, so peak - baseline is what the
loss costs. As in scripts/bench_chunked_ce.py, memory is the point; times are for orientation.

    .venv/bin/python scripts/bench_distill_memory.py --json docs/bench/distill-vocab128k-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child(args) -> dict:
    if args.max_gb:
        limit = int(args.max_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path.insert(0, str(REPO))
    import torch

    from harness import IGNORE_INDEX
    from harness.distill.loss import Divergence, chunked_divergence, divergence_sum

    torch.manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, args.hidden).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5).requires_grad_()
    t_hidden = torch.randn(args.batch, args.seq, args.teacher_hidden)  # the frozen teacher's: no gradient
    t_weight = torch.randn(args.vocab, args.teacher_hidden) / args.teacher_hidden**0.5
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels[:, :8] = IGNORE_INDEX  # a short prompt per row
    (hidden.sum() + weight.sum()).backward()  # the .grad buffers every contender ends up with
    div = Divergence(beta=args.beta, temperature=1.0, kind="jsd")
    name = args.child
    seconds, loss = [], None
    for _ in range(args.repeat if name != "baseline" else 0):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        if name == "full":
            with torch.no_grad():
                t_logits = t_hidden @ t_weight.T
            total, count = divergence_sum(hidden @ weight.T, t_logits, labels, div.beta, div.temperature, div.kind)
            del t_logits
        elif name.startswith("chunked:"):
            total, count, _, _ = chunked_divergence((hidden, weight, None, None), (t_hidden, t_weight, None, None),
                                                    labels, div, chunk_size=int(name.split(":")[1]))
        else:
            raise SystemExit(f"unknown contender {name!r}")
        (total / count).backward()
        seconds.append(time.perf_counter() - start)
        loss = (total / count).item()
        del total, count
    return {"contender": name, "peak_rss_mb": round(vm_hwm_mb(), 1), "seconds": [round(s, 3) for s in seconds],
            "loss": loss, "threads": torch.get_num_threads(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--teacher-hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--contenders", nargs="+", default=["baseline", "full", "chunked:1024"])
    ap.add_argument("--repeat", type=int, default=1, help="timed forward+backward passes per process")
    ap.add_argument("--max-gb", type=float, default=20.0, help="address-space limit of each child (0: none)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    tokens = args.batch * args.seq
    print(f"vocab {args.vocab}, student hidden {args.hidden}, teacher hidden {args.teacher_hidden}, {args.batch} x "
          f"{args.seq} = {tokens} tokens, fp32; one [tokens, vocab] logits tensor: {tokens * args.vocab * 4 / 2**30:.2f} "
          f"GiB")
    started = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": round(os.getloadavg()[0], 2),
               "machine": f"{platform.node()} ({os.cpu_count()} CPUs)"}
    print(f"{started['machine']}, load average {started['load_average']}, {started['date']}")
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("vocab", "hidden", "teacher_hidden", "batch", "seq", "beta", "repeat", "max_gb")]
    results = []
    for name in args.contenders:
        proc = subprocess.run([sys.executable, __file__, "--child", name, *common], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            results.append({"contender": name, "error": tail})
            print(f"{name:>14}: FAILED ({tail})")
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ok = [r for r in results if "error" not in r]
    base = min((r["peak_rss_mb"] for r in ok if r["contender"] == "baseline"), default=0.0)
    print(f"{'contender':>14} {'peak RSS':>10} {'- baseline':>11} {'fwd+bwd s':>10} {'loss':>10}")
    for r in ok:
        secs = ", ".join(f"{s:.2f}" for s in r["seconds"]) or "-"
        loss = f"{r['loss']:.6f}" if r["loss"] is not None else "-"
        print(f"{r['contender']:>14} {r['peak_rss_mb']:>8.0f} MB {r['peak_rss_mb'] - base:>8.0f} MB {secs:>10} "
              f"{loss:>10}")
    peak = {r["contender"]: r["peak_rss_mb"] for r in ok}
    full = peak.get("full")
    for name, mb in peak.items():
        if name.startswith("chunked:") and full:
            print(f"peak {name} / full = {mb / full:.3f} (whole process); loss alone {(mb - base) / (full - base):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **started,
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

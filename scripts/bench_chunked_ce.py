"""Peak memory (and time) of the generative loss over a large vocabulary, forward + backward (issue 18):
full logits + harness.losses.token_loss_sum ("plain") against harness.chunked_loss.chunked_token_loss_sum ("chunked:C",
chunk size C).

Every contender runs in a fresh process (`--child`), so one's allocations cannot hide in another's heap; its peak is
the kernel's resident-set high-water mark, VmHWM in /proc/self/status, read after the timed passes. "baseline" runs
the same set-up (torch imported, hidden [B, T, H] and weight [V, H] built, their .grad allocated) and no loss, so
peak - baseline is what the loss itself costs. torch's CPU allocator returns large blocks to the OS, so VmHWM is the
real high-water mark of the tensors. Memory is the point here; the times are for orientation (CPU, shared machine).

    .venv/bin/python scripts/bench_chunked_ce.py                       # Llama-3 vocabulary, hidden 256, 8 x 1024 tokens
    .venv/bin/python scripts/bench_chunked_ce.py --vocab 32000 --contenders plain chunked:512

Each child sets an address-space limit (--max-gb) so that a contender too big for the machine fails with an
allocation error instead of waking the OOM killer on a shared machine.
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

    from harness.data import IGNORE_INDEX
    from harness.chunked_loss import chunked_token_loss_sum
    from harness.losses import token_loss_sum

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, dtype=dtype) / args.hidden**0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels[:, :8] = IGNORE_INDEX  # a short prompt per row
    (hidden.sum() + weight.sum()).backward()  # the .grad buffers every contender ends up with
    name = args.child
    seconds, loss = [], None
    for _ in range(args.repeat if name != "baseline" else 0):
        hidden.grad = weight.grad = None  # each pass writes fresh gradients (no accumulation into the old ones)
        start = time.perf_counter()
        if name == "plain":
            total, count = token_loss_sum(hidden @ weight.T, labels)
        elif name.startswith("chunked:"):
            total, count = chunked_token_loss_sum(hidden, weight, labels, chunk_size=int(name.split(":")[1]))
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contenders", nargs="+", default=["baseline", "plain", "chunked:1024", "chunked:256"])
    ap.add_argument("--rounds", type=int, default=1, help="each contender this many times, interleaved")
    ap.add_argument("--repeat", type=int, default=2, help="timed forward+backward passes per process")
    ap.add_argument("--max-gb", type=float, default=20.0, help="address-space limit of each child (0: none)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    tokens = args.batch * args.seq
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.batch} x {args.seq} = {tokens} tokens, {args.dtype}; "
          f"full logits alone: {tokens * args.vocab * 4 / 2**30:.2f} GiB in fp32")
    print(f"{platform.node()} ({os.cpu_count()} CPUs), load average {os.getloadavg()[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    results = []
    started = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": round(os.getloadavg()[0], 2),
               "machine": f"{platform.node()} ({os.cpu_count()} CPUs)"}
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("vocab", "hidden", "batch", "seq", "dtype", "repeat", "max_gb")]
    for _ in range(args.rounds):
        for name in args.contenders:
            proc = subprocess.run([sys.executable, __file__, "--child", name, *common], capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                results.append({"contender": name, "error": tail})
                print(f"{name:>14}: FAILED ({tail})")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(res)
    base = min((r["peak_rss_mb"] for r in results if r["contender"] == "baseline" and "error" not in r), default=0.0)
    print(f"{'contender':>14} {'peak RSS':>10} {'- baseline':>11} {'fwd+bwd s (each pass)':>24} {'loss':>10}")
    for r in results:
        if "error" in r:
            continue
        secs = ", ".join(f"{s:.2f}" for s in r["seconds"]) or "-"
        loss = f"{r['loss']:.6f}" if r["loss"] is not None else "-"
        print(f"{r['contender']:>14} {r['peak_rss_mb']:>8.0f} MB {r['peak_rss_mb'] - base:>8.0f} MB {secs:>24} "
              f"{loss:>10}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **started, "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()

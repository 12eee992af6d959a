"""Record or compare the loop's goldens: what a refactor of the loop must not change.

    python scripts/goldens.py record docs/bench/goldens.json     # before moving code
    python scripts/goldens.py compare docs/bench/goldens.json    # after: exit 1 on any difference

Three runs through the real entry point (one process, fp32 CPU): the default job (40 steps), the unified GritLM
recipe (40 steps), and the default job stopped at step 20 and resumed. What is kept of each: metrics.jsonl without its
timing and system fields (loss, lr, grad norm, tokens, epoch, padding, evaluations), the key set of its records, and
report.json's key set (nested keys as dotted paths). Values are compared to a relative 1e-6 (the runs are
deterministic on one machine; the tolerance only absorbs the JSON round trip).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DETERMINISTIC = {"step", "epoch", "loss", "loss_gen", "loss_emb", "lr", "grad_norm", "padding_share", "tokens"}
COMMON = ["train.progress_bar=false", "train.report_to=[]", "train.summary=false", "train.precision=fp32",
          "train.compile=none"]
RUNS = {
    "default": ("configs/default.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=10",
                                         "train.save_every_steps=20"]),
    "unified": ("configs/gritlm-tiny.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=20"]),
    "resume": ("configs/default.yaml", ["train.max_steps=40", "train.log_every=5", "train.eval_every=10"]),
}


def train(config: str, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "harness.train", "--config", str(ROOT / config), *COMMON, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict) and k not in ("data", "hardware", "utilisation", "cost"):
            out += keys(v, f"{prefix}{k}.")
    return sorted(out)


def kept(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [{k: v for k, v in r.items() if k in DETERMINISTIC or k.startswith("eval")} for r in records]
    return {"records": values, "record_keys": sorted({k for r in records for k in r}),
            "report_keys": keys(json.loads((run_dir / "report.json").read_text()))}


def record_all() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, overrides) in RUNS.items():
            run_dir = Path(tmp, name)
            if name == "resume":
                train(config, overrides + [f"train.output_dir={run_dir}", "train.stop_at_step=20"])
                overrides = overrides + ["train.resume=auto"]
            train(config, overrides + [f"train.output_dir={run_dir}"])
            out[name] = kept(run_dir)
            print(f"[goldens] {name}: {len(out[name]['records'])} records", flush=True)
    return out


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in {'golden' if k in a else 'new'}" for k in sorted(set(a) ^ set(b))]
        return out + [d for k in sorted(set(a) & set(b)) for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) and not all(isinstance(x, str) for x in a + b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        if all(isinstance(x, str) for x in a + b):
            return [f"{where}: golden only {sorted(set(a) - set(b))}, new only {sorted(set(b) - set(a))}"] \
                if set(a) != set(b) else []
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) else [f"{where}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        print(__doc__)
        return 2
    verb, path = sys.argv[1], Path(sys.argv[2])
    now = record_all()
    if verb == "record":
        path.write_text(json.dumps(now, indent=1) + "\n")
        print(f"[goldens] written to {path}")
        return 0
    diffs = differences(json.loads(path.read_text()), now)
    print("\n".join(diffs) or "[goldens] identical")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())

"""Rejection-sampling fine-tuning: sample many answers, keep the verified ones, train on them, measure accuracy.

    harness rft sft-data RECIPE --out FILE         worked answers of the arithmetic task's sft split (warm-up data)
    harness rft generate RECIPE [--model PATH] [--stop-after N] [overrides]   sample, verify, keep -> rft.jsonl
    harness rft train    RECIPE [overrides]        harness training on data.train_files + <rft.output_dir>/rft.jsonl
    harness rft test     RECIPE [--model PATH] [--out FILE] [overrides]       accuracy + answer rate -> JSON
    harness rft bench    RECIPE [--model PATH] [--questions N] [--engines static,continuous] [--json FILE]
                                                   the generation engines side by side: tokens/s, sequences/s, waste

Several processes: `accelerate launch ... -m harness.rft generate RECIPE` (test and train alike). Guide: docs/rft.md.
"""

from __future__ import annotations

# `harness rft` lives with the commands (it launches training: `rft train`), not in harness/rft/, which the run's
# parts use (rl/ samples with its engine)

import argparse
import json
import sys
from pathlib import Path

from harness import train
from harness.config import load_config, recipe_args
from harness.errors import HarnessError
from harness.rft import bench, evaluate, generate
from harness.rft.tasks import ArithmeticTask, build_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness rft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("sft-data", "write warm-up SFT records"), ("generate", "sample, verify, keep"),
                       ("train", "train on the kept examples"), ("test", "held-out accuracy"),
                       ("bench", "generation engines side by side")):
        s = sub.add_parser(name, help=text)
        recipe_args.add(s)  # the recipe (YAML) with an rft: section
        s.set_defaults(parser=s)
        if name in ("generate", "test", "bench"):
            s.add_argument("--model", help="model folder (default: model.name_or_path); a LoRA final/ uses merged/")
        if name == "generate":
            s.add_argument("--stop-after", type=int, default=0, help="stop after N question batches per process")
        if name == "bench":
            s.add_argument("--questions", type=int, default=32, help="train questions to sample")
            s.add_argument("--engines", default="static,continuous",
                           help="comma-separated: one, static, continuous, transformers")
            s.add_argument("--repeats", type=int, default=1, help="runs per engine (interleaved; the best is kept)")
            s.add_argument("--json", help="also write the result to this JSON file")
        if name in ("test", "sft-data"):
            s.add_argument("--out", required=name == "sft-data", help="output file")
    # overrides may also come after the options (`... --out x.json rft.oversample=8`): argparse leaves those over
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    stray = [a for a in rest if a.startswith("-") or "=" not in a]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *rest]
    recipe_args.resolve(args, args.parser)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)
            data = Path(cfg.rft.output_dir) / "rft.jsonl"
            if not data.is_file():
                raise HarnessError(f"{data}: no generated examples; run `harness rft generate {args.config}` first")
            files = list(cfg.data.train_files)
            files += [] if str(data) in map(str, files) else [str(data)]
            print(f"[rft] training on {', '.join(files)}")
            return train.main(["--config", args.config, *args.overrides, f"data.train_files={json.dumps(files)}"])
        cfg = load_config(args.config, args.overrides)
        if args.command == "sft-data":
            task = build_task(cfg.rft)
            if not isinstance(task, ArithmeticTask):
                raise HarnessError("rft sft-data needs rft.task=arithmetic (a JSONL task has no worked answers)")
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in task.sft_records()), encoding="utf-8")
            print(f"[rft] {len(task.split('sft'))} warm-up records -> {out}")
        elif args.command == "generate":
            generate.run(cfg.rft, args.model or cfg.model.name_or_path, args.stop_after)
        elif args.command == "bench":
            bench.report(bench.bench(cfg.rft, args.model or cfg.model.name_or_path, args.questions, args.repeats,
                                     tuple(x for x in args.engines.split(",") if x)), args.json)
        else:
            evaluate.run(cfg.rft, args.model or cfg.model.name_or_path, args.out)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0

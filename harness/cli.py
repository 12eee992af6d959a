"""The `harness` command.

    harness train FILE [section.key=value ...]    train (same loop as python -m harness.train --config FILE); every
                                                  command that takes a recipe takes FILE or --config FILE
    harness train --help-config                   every config key with its default and help
    harness env                                   print the environment report (versions, devices)
    harness data-check SOURCE ...                 validate data sources (paths, hub ids, '{path: x, format: y}'):
                                                  format, kind, records, token-length statistics
    harness data-check --config FILE [overrides]  a recipe's data as the run reads it: sources, eval split, weighted
                                                  mix, token lengths with its tokenizer and chat template
    harness data-stats FILE_OR_DIR ... [--max-len N]  token-length distribution, truncation, what max_len=auto picks
    harness bench FILE [overrides] [--profiles ...]  harness vs raw PyTorch vs HF Trainer (or profiles), tokens/s
    harness plan FILE [overrides] --hours H        fit the run into a wall-clock window (calibrates, writes plan.json)
    harness summary RUN_DIR                       (re)write RUN_DIR/summary.md and RUN_DIR/plots/*.png
    harness compare RUN_DIR RUN_DIR ... [--out PNG]  key figures side by side, losses overlaid (runs/compare.png)
    harness zero-plan FILE [overrides] --gpus N --gpu-mem-gb G [--nodes M]  memory per GPU for each ZeRO stage
    harness rft sft-data|generate|train|test FILE ...  rejection-sampling fine-tuning (docs/rft.md)
    harness chat RUN_DIR/final [--max-new-tokens N] [--temperature T] [--top-p P] [--system TEXT]  chat on stdin
    harness push RUN_DIR REPO_ID [--private] [--revision BRANCH] [--token T]  upload final/ and its model card
    harness mteb RUN_DIR/final [EMBED_FILE]  MTEB retrieval scores of the embedder (docs/gritlm.md)

For several processes use launch/train.sh or accelerate's launcher on harness/train.py (docs/multi-gpu.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness.config import describe, load_config, recipe_args
from harness.config.modes import facts
from harness.data.checks import check_data
from harness.rundir.finished import finished_nothing_asked
from harness.errors import HarnessError


def _train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(describe())
        return 0
    if args.config is None:
        print("harness train: a recipe is needed, e.g. harness train configs/default.yaml (every key: harness train "
              "--help-config)", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)  # every config problem at once, before torch is imported
    check_data(cfg.data, cfg.rl.prompts, cfg.distill.prompts)
    missing = missing_teacher(cfg.distill) if "distill" in facts(cfg.loss.mode).sections else None
    if missing is not None:  # loss.mode=distill on a fresh clone: its teacher's recipe first
        print(f"[harness] distill: the teacher {cfg.distill.teacher} is missing: training it first with "
              f"harness train {missing}", flush=True)
        status = subprocess.run([sys.executable, "-m", "harness.cli", "train", missing]).returncode
        if status:
            return status
        if not Path(cfg.distill.teacher).exists():
            print(f"harness train: {missing} finished without writing the teacher {cfg.distill.teacher} (its "
                  f"train.output_dir/final must be distill.teacher)", file=sys.stderr)
            return 2
    if finished_nothing_asked(cfg.to_dict()):  # the same command on a finished run: said at once, without torch
        return 0
    from harness import train  # lazy: start-up time (`harness -h` and the light commands load no torch)

    return train.main(["--config", args.config, *args.overrides])


def missing_teacher(d) -> str | None:
    """distill.teacher_recipe where it is set and distill.teacher is not a folder yet, else None (the run loads the
    teacher: a folder, a hub id)."""
    return d.teacher_recipe if d.teacher_recipe and d.teacher and not Path(d.teacher).exists() else None


def _env(args: argparse.Namespace) -> int:
    from harness.hardware import environment_report  # lazy: start-up time (hardware imports torch)

    print(json.dumps(environment_report(), indent=2))
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from harness.tools import data_check  # lazy: start-up time (`harness -h` and the light commands load no torch)

    return data_check.data_check(args)


def _data_stats(args: argparse.Namespace) -> int:
    from harness.tools import data_check  # lazy: start-up time (`harness -h` and the light commands load no torch)

    return data_check.data_stats(args)


# commands with their own options (harness X --help): module, and whether it takes the command name too
OWN = {"bench": ("harness.tools.bench", False), "plan": ("harness.tools.planner", False),
       "zero-plan": ("harness.tools.zero_plan", False), "summary": ("harness.observe.summary", True),
       "compare": ("harness.observe.summary", True), "rft": ("harness.tools.rft", False),
       "chat": ("harness.tools.chat", False), "push": ("harness.tools.push", False),
       "mteb": ("harness.tools.mteb_eval", False)}


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand (those in OWN as placeholders: `harness X -h` goes to their own parser)."""
    p = argparse.ArgumentParser(prog="harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a recipe (FILE or --config FILE)")
    recipe_args.add(t)
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    t.set_defaults(fn=_train, parser=t)

    e = sub.add_parser("env", help="environment report")
    e.set_defaults(fn=_env)

    st = sub.add_parser("data-stats", help="token-length distribution of generative JSONL data")
    st.add_argument("paths", nargs="+")
    st.add_argument("--tokenizer", default="bundled")
    st.add_argument("--chat-template", default="auto", help="auto, tokenizer, gritlm or a Jinja file "
                    "(data.chat_template)")
    st.add_argument("--max-len", type=int, default=0, help="report what this max_len would truncate")
    st.add_argument("--percentile", type=float, default=99.0, help="percentile used by data.max_len=auto")
    st.set_defaults(fn=_data_stats)

    d = sub.add_parser("data-check", help="validate data sources: format, kind, records, token lengths (a recipe's: "
                                          "also its eval split and weighted mix)")
    d.add_argument("paths", nargs="*", help="files, folders, hub ids or YAML source mappings; with --config: "
                                            "section.key=value overrides")
    d.add_argument("--config", help="check a recipe's data as the run reads it")
    d.add_argument("--tokenizer", default="bundled")
    d.add_argument("--chat-template", default="auto", help="auto, tokenizer, gritlm or a Jinja file "
                    "(data.chat_template)")
    d.add_argument("--max-len", type=int, default=1 << 20)
    d.set_defaults(fn=_data_check)

    sub.add_parser("summary", help="(re)write a run folder's summary.md and plots")
    sub.add_parser("compare", help="compare run folders: key figures side by side, losses overlaid")
    sub.add_parser("rft", help="rejection-sampling fine-tuning: sft-data, generate, train, test (docs/rft.md)")
    sub.add_parser("bench", help="harness vs raw PyTorch vs HF Trainer, or profiles (see harness bench -h)")
    sub.add_parser("plan", help="fit a run into a wall-clock window (harness plan FILE --hours H; see --help)")
    sub.add_parser("chat", help="chat with a trained model (its final/ folder) on stdin (harness chat -h)")
    sub.add_parser("push", help="upload a run's final/ with its model card to the Hugging Face hub (harness push -h)")
    sub.add_parser("mteb", help="MTEB retrieval scores of final/ on a local embedding file (harness mteb FINAL [FILE])")
    sub.add_parser("zero-plan", help="GPU memory per ZeRO stage and the lowest that fits (harness zero-plan -h)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN:
        import importlib

        name, with_command = OWN[argv[0]]
        try:
            return importlib.import_module(name).main(argv if with_command else argv[1:])
        except HarnessError as err:
            print(f"harness: error: {err}", file=sys.stderr)
            return err.exit_code
    args = build_parser().parse_args(argv)
    if args.command == "train":
        recipe_args.resolve(args, args.parser, required=False)
    try:
        return args.fn(args)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())

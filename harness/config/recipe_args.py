"""The one rule for naming a recipe on a command line, for every command that takes one (harness train, plan, bench,
zero-plan, rft, and python -m harness.train / accelerate launch harness/train.py):

    CMD FILE [section.key=value ...]
    CMD --config FILE [section.key=value ...]

`harness data-check` takes the recipe as --config FILE only: its positional arguments are data sources.
This module imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
from typing import Optional


def add(p: argparse.ArgumentParser) -> None:
    """The recipe's arguments: a positional FILE, its overrides, and --config FILE (the same as the positional)."""
    p.add_argument("file", nargs="?", metavar="FILE", help="run recipe (YAML), e.g. configs/default.yaml; or --config "
                                                          "FILE")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides, e.g. train.max_steps=20")
    p.add_argument("--config", dest="config_flag", metavar="FILE", help="run recipe (YAML), the same as FILE")


def resolve(args: argparse.Namespace, p: Optional[argparse.ArgumentParser], required: bool = True) -> argparse.Namespace:
    """Sets args.config (the recipe, None if none was given and `required` is false) and args.overrides. With
    --config the positional slot holds the first override. A recipe given twice, or none when `required`: the
    parser's usage error (SystemExit 2; `p` None: SystemExit 2 without a message)."""
    def error(message: str):
        if p is None:
            raise SystemExit(2)
        p.error(message)

    args.config = args.config_flag if args.config_flag is not None else args.file
    if args.config_flag is not None and args.file is not None:
        if "=" not in args.file:
            error(f"the recipe is given twice ({args.file} and --config {args.config_flag}): give FILE or --config "
                  f"FILE")
        args.overrides = [args.file, *args.overrides]
    if args.config is None and required:
        error("a recipe is needed: FILE or --config FILE, e.g. configs/default.yaml")
    return args


def train_parser() -> argparse.ArgumentParser:
    """The training entry point's parser (python -m harness.train, accelerate launch harness/train.py)."""
    p = argparse.ArgumentParser(
        prog="harness train",
        description="Train a language model. Precedence: defaults < --config file < section.key=value overrides.",
    )
    add(p)
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    return p

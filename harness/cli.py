"""The `harness` command.

    harness train FILE [section.key=value ...]    train (same loop as python -m harness.train --config FILE)
    harness env                                   print the environment report (versions, devices)
    harness data-check FILE_OR_DIR ...            validate generative JSONL files and print token-length statistics

For several processes use accelerate's launcher on harness/train.py (see README.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from harness.errors import HarnessError


def _train(args: argparse.Namespace) -> int:
    from harness import train

    return train.main(["--config", args.file, *args.overrides])


def _env(args: argparse.Namespace) -> int:
    from harness.hardware import environment_report

    print(json.dumps(environment_report(), indent=2))
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from harness import data
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    rows = data.load_generative_rows(args.paths, what="paths")
    tok = load_tokenizer(ModelConfig(tokenizer=args.tokenizer))
    _, stats = data.tokenize_dataset(rows, tok, max_len=args.max_len)
    print(json.dumps(stats, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a recipe")
    t.add_argument("file", help="run recipe (YAML)")
    t.add_argument("overrides", nargs="*", help="section.key=value")
    t.set_defaults(fn=_train)

    e = sub.add_parser("env", help="environment report")
    e.set_defaults(fn=_env)

    d = sub.add_parser("data-check", help="validate generative JSONL data")
    d.add_argument("paths", nargs="+")
    d.add_argument("--tokenizer", default="bundled")
    d.add_argument("--max-len", type=int, default=1 << 20)
    d.set_defaults(fn=_data_check)

    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())

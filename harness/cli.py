"""The `harness` command.

    harness train FILE [section.key=value ...]    train (same loop as python -m harness.train --config FILE)
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
import sys
from pathlib import Path

from harness.errors import ConfigError, HarnessError


def _train(args: argparse.Namespace) -> int:
    from harness import train

    if args.help_config:
        return train.main(["--help-config"])
    if args.file is None:
        print("harness train: a recipe is needed, e.g. harness train configs/default.yaml (every key: harness train "
              "--help-config)", file=sys.stderr)
        return 2
    return train.main(["--config", args.file, *args.overrides])


def _env(args: argparse.Namespace) -> int:
    from harness.hardware import environment_report

    print(json.dumps(environment_report(), indent=2))
    return 0


def _cli_sources(paths: list[str]) -> list:
    """data-check arguments: each a path / hub id or a YAML mapping ('{path: x.csv, format: alpaca}'); a folder of
    plain files is checked file by file (each gets its own line and format)."""
    import yaml

    from harness.data.sources import Source, expand_files, is_saved_dataset, parse_sources

    out = []
    for i, text in enumerate(paths):
        try:
            entry = yaml.safe_load(text) if text.lstrip().startswith("{") else text
        except yaml.YAMLError:
            entry = text
        src = parse_sources([entry], "paths")[0]
        if Path(src.path).is_dir() and not is_saved_dataset(Path(src.path)):
            out += [Source(f, src.split, src.subset, src.format, src.weight, src.columns)
                    for f in expand_files([src.path], "paths")]
        else:
            out.append(src)
    return out


def _data_check(args: argparse.Namespace) -> int:
    """Per source: name, format, kind, records (generative: token-length stats); then the generative stats."""
    from harness.data import samples as data, sources
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    if args.config:
        return _data_check_recipe(args)
    if not args.paths:
        raise ConfigError("data-check: give files, folders or hub ids, or --config RECIPE")
    gen, tok = [], None
    for src in _cli_sources(args.paths):
        fmts = sources.unit_formats(src, "paths")
        kind = next((k for k in ("embedding", "preference") if set(fmts.values()) == {k}), "generative")
        rows = sources.load_source_rows(src, kind, need_negatives=0, what="paths")
        line = _source_line(src, fmts, kind, rows)
        if kind != "embedding":
            tok = tok or load_tokenizer(ModelConfig(tokenizer=args.tokenizer), args.chat_template, markers=None)
        if kind == "preference":  # the longer side of each pair, as the run tokenizes it
            from harness.data import chat, pairs

            _, st = pairs.tokenize_pair_dataset(rows, tok, args.max_len, chat.resolve_template(tok, args.chat_template))
            line += (f", pair length mean {st['mean_len']:.1f}, max {st['max_len']}, prompt mean "
                     f"{st['mean_prompt_len']:.1f}, {st['truncated']} truncated")
        if kind == "generative":
            _, st = data.tokenize_dataset(rows, tok, max_len=args.max_len)
            gen.append(rows)
            line += (f", {st['tokens']} tokens, mean {st['mean_len']:.1f}, p95 {st['p95_len']}, max {st['max_len']}, "
                     f"{st['truncated']} truncated, {st['dropped_no_labels']} dropped")
        print(line)
    if gen:
        import datasets

        _, stats = data.tokenize_dataset(datasets.concatenate_datasets(gen), tok, max_len=args.max_len)
        print(json.dumps(stats, indent=2))
    return 0


def _source_line(src, fmts: dict, kind: str, rows) -> str:
    return f"{src.name}: format {', '.join(sorted({f or 'text' for f in fmts.values()}))}, {kind}, {len(rows)} records"


def _data_check_recipe(args: argparse.Namespace) -> int:
    """data-check --config RECIPE [overrides]: each training list's sources, the eval split and the weighted mix
    as the run draws them, then the token lengths of an epoch with the recipe's tokenizer and chat template."""
    from harness.data import loaders, samples as data, sources
    from harness.config import load_config
    from harness.model import load_run_tokenizer

    cfg = load_config(args.config, args.paths)
    kinds = {"generative": ["generative"], "embedding": ["embedding"], "preference": ["preference"]}.get(
        cfg.loss.mode, ["generative", "embedding"])
    for kind in kinds:
        what = f"data.{loaders.STREAMS[kind][0]}"
        need_negatives = cfg.data.train_group_size - 1 if kind == "embedding" else 0
        for src in sources.parse_sources(getattr(cfg.data, loaders.STREAMS[kind][0]), what):
            rows = sources.load_source_rows(src, kind, cfg.data.cache_dir, need_negatives, what)
            print(f"{what}: " + _source_line(src, sources.unit_formats(src, what, cfg.data.cache_dir), kind, rows))
        rows, _ = loaders.training_rows(cfg.data, cfg.train.seed, kind, print)
        if kind == "generative":
            tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
            _, stats = data.tokenize_dataset(rows, tok, loaders.resolve_max_len(cfg.data, rows, tok, print))
            print(f"generative samples of an epoch (chat template: {cfg.data.chat_template}):")
            print(json.dumps(stats, indent=2))
        if kind == "preference":  # pairs, lengths and truncation as the run tokenizes them
            from harness.data import chat, pairs

            tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
            max_len = cfg.data.max_len if cfg.data.max_len != "auto" else 1 << 20
            _, stats = pairs.tokenize_pair_dataset(rows, tok, max_len, chat.resolve_template(tok, cfg.data.chat_template))
            print(f"preference pairs of an epoch (chat template: {cfg.data.chat_template}):")
            print(json.dumps(stats, indent=2))
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    """Token-length distribution of generative data, what a max_len would cut, and what max_len=auto would pick."""
    from harness.data import samples as data
    from harness.config import ModelConfig
    from harness.model import load_tokenizer

    rows = data.load_generative_rows(args.paths, what="paths")
    tok = load_tokenizer(ModelConfig(tokenizer=args.tokenizer), args.chat_template, markers=None)
    ds, stats = data.tokenize_dataset(rows, tok, max_len=1 << 30)
    lengths = sorted(ds["length"])
    pct = {p: lengths[min(len(lengths) - 1, max(0, -(-p * len(lengths) // 100) - 1))] for p in (50, 90, 95, 99, 100)}
    print(f"{len(lengths)} samples, {sum(lengths)} tokens; mean {sum(lengths) / len(lengths):.1f}; "
          + ", ".join(f"p{p} {v}" if p < 100 else f"max {v}" for p, v in pct.items()))
    top = lengths[-1]
    edges = [0] + [2 ** k for k in range(3, max(4, top.bit_length() + 1))]
    print("length range     samples")
    for lo, hi in zip(edges, edges[1:]):
        n = sum(lo < x <= hi for x in lengths)
        if n:
            print(f"{lo + 1:>6}-{hi:<8} {n:>7}  {'#' * max(1, round(50 * n / len(lengths)))}")
    auto = data.auto_max_len(lengths, args.percentile)
    for name, m in (("--max-len", args.max_len), (f"max_len=auto (p{args.percentile:g})", auto)):
        if m:
            cut = sum(max(0, x - m) for x in lengths)
            print(f"{name} {m}: {sum(x > m for x in lengths)} samples truncated, {cut} tokens "
                  f"({100 * cut / sum(lengths):.2f}%) cut")
    return 0


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

    t = sub.add_parser("train", help="train from a recipe")
    t.add_argument("file", nargs="?", help="run recipe (YAML)")
    t.add_argument("overrides", nargs="*", help="section.key=value")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    t.set_defaults(fn=_train)

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
    try:
        return args.fn(args)
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())

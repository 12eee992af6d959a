"""`harness data-check` and `harness data-stats` (the parsers are harness/cli.py's): data sources checked as the run
reads them, token-length statistics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import yaml

from harness.config import ModelConfig, load_config
from harness.data import chat, loaders, pairs, samples as data, sources
from harness.data.sources import Source, expand_files, is_saved_dataset, parse_sources
from harness.errors import ConfigError
from harness.model import load_run_tokenizer, load_tokenizer

def cli_sources(paths: list[str]) -> list:
    """data-check arguments: each a path / hub id or a YAML mapping ('{path: x.csv, format: alpaca}'); a folder of
    plain files is checked file by file (each gets its own line and format)."""
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


def data_check(args: argparse.Namespace) -> int:
    """Per source: name, format, kind, records (generative: token-length stats); then the generative stats."""
    if args.config:
        return data_check_recipe(args)
    if not args.paths:
        raise ConfigError("data-check: give files, folders or hub ids, or --config RECIPE")
    gen, tok = [], None
    for src in cli_sources(args.paths):
        fmts = sources.unit_formats(src, "paths")
        kind = next((k for k in ("embedding", "preference") if set(fmts.values()) == {k}), "generative")
        rows = sources.load_source_rows(src, kind, need_negatives=0, what="paths")
        line = source_line(src, fmts, kind, rows)
        if kind != "embedding":
            tok = tok or load_tokenizer(ModelConfig(tokenizer=args.tokenizer), args.chat_template, markers=None)
        if kind == "preference":  # the longer side of each pair, as the run tokenizes it

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
        _, stats = data.tokenize_dataset(datasets.concatenate_datasets(gen), tok, max_len=args.max_len)
        print(json.dumps(stats, indent=2))
    return 0


def source_line(src, fmts: dict, kind: str, rows) -> str:
    return f"{src.name}: format {', '.join(sorted({f or 'text' for f in fmts.values()}))}, {kind}, {len(rows)} records"


def data_check_recipe(args: argparse.Namespace) -> int:
    """data-check --config RECIPE [overrides]: each training list's sources, the eval split and the weighted mix
    as the run draws them, then the token lengths of an epoch with the recipe's tokenizer and chat template."""
    cfg = load_config(args.config, args.paths)
    kinds = {"generative": ["generative"], "embedding": ["embedding"], "preference": ["preference"]}.get(
        cfg.loss.mode, ["generative", "embedding"])
    for kind in kinds:
        what = f"data.{loaders.STREAMS[kind][0]}"
        need_negatives = cfg.data.train_group_size - 1 if kind == "embedding" else 0
        for src in sources.parse_sources(getattr(cfg.data, loaders.STREAMS[kind][0]), what):
            rows = sources.load_source_rows(src, kind, cfg.data.cache_dir, need_negatives, what)
            print(f"{what}: " + source_line(src, sources.unit_formats(src, what, cfg.data.cache_dir), kind, rows))
        rows, _ = loaders.training_rows(cfg.data, cfg.train.seed, kind, print)
        if kind == "generative":
            tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
            _, stats = data.tokenize_dataset(rows, tok, loaders.resolve_max_len(cfg.data, rows, tok, print))
            print(f"generative samples of an epoch (chat template: {cfg.data.chat_template}):")
            print(json.dumps(stats, indent=2))
        if kind == "preference":  # pairs, lengths and truncation as the run tokenizes them

            tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
            max_len = cfg.data.max_len if cfg.data.max_len != "auto" else 1 << 20
            _, stats = pairs.tokenize_pair_dataset(rows, tok, max_len, chat.resolve_template(tok, cfg.data.chat_template))
            print(f"preference pairs of an epoch (chat template: {cfg.data.chat_template}):")
            print(json.dumps(stats, indent=2))
    return 0


def data_stats(args: argparse.Namespace) -> int:
    """Token-length distribution of generative data, what a max_len would cut, and what max_len=auto would pick."""
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

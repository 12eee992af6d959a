"""Skewed-length generative data for the packing benchmark: data/bench/skewed.jsonl.

    python scripts/make_skewed_data.py            # deterministic (seed 0)

600 `{"text"}` records built from the sentences of data/sample/gen.jsonl, with word counts drawn from a log-normal
distribution (median about 30 words, a long tail past 300): the shape of real instruction data, where padding to
the longest sample in a batch wastes most of the compute.
"""

import argparse
import json
import math
import random
from pathlib import Path


def source_sentences(path: str) -> list[str]:
    """The sentences of a generative JSONL file's texts and message contents, in file order."""
    sentences = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        texts = [rec["text"]] if "text" in rec else [m["content"] for m in rec["messages"]]
        for t in texts:
            sentences += [s.strip() + "." for s in t.split(".") if s.strip()]
    return sentences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="data/sample/gen.jsonl")
    ap.add_argument("--out", default="data/bench/skewed.jsonl")
    ap.add_argument("--n", type=int, default=600)
    args = ap.parse_args()
    rng = random.Random(0)
    sentences = source_sentences(args.source)
    out = []
    for _ in range(args.n):
        target = min(400, max(5, int(math.exp(rng.gauss(math.log(30), 1.0)))))
        words: list[str] = []
        while len(words) < target:
            words += rng.choice(sentences).split()
        out.append(json.dumps({"text": " ".join(words[:target])}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

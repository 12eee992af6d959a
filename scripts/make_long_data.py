"""Long generative records for the large-vocabulary benchmark: data/bench/long.jsonl.

    python scripts/make_long_data.py            # deterministic (seed 0)

80 `{"text"}` records of 900 words each, built from the sentences of data/sample/gen.jsonl: every record is longer
than 1,024 tokens of the bundled tokenizer, so with data.max_len=1024 every row is a full 1,024-token row without
packing, and every contender of `harness bench` (the harness, the raw loop, the Trainer) sees the same full rows.
"""

import argparse
import json
import random
from pathlib import Path

from make_skewed_data import source_sentences  # scripts/ is on sys.path when a script runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="data/sample/gen.jsonl")
    ap.add_argument("--out", default="data/bench/long.jsonl")
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--words", type=int, default=900)
    args = ap.parse_args()
    rng = random.Random(0)
    sentences = source_sentences(args.source)
    out = []
    for _ in range(args.n):
        words: list[str] = []
        while len(words) < args.words:
            words += rng.choice(sentences).split()
        out.append(json.dumps({"text": " ".join(words[:args.words])}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

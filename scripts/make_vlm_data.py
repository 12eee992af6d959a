"""Generate the tiny vision-language data set of configs/vlm-tiny.yaml: shapes drawn on noise, no download.

Usage:
    python scripts/make_vlm_data.py [--out-dir data/vlm-tiny]

Writes (overwriting) <out-dir>/train.jsonl (48 records), <out-dir>/eval.jsonl (8) and their PNG images under
<out-dir>/img/, in TRL's vision layout: {"messages": [...{"type": "image"}...], "images": ["img/3.png"]}, the paths
relative to the JSON lines file. Each image is a coloured square or disc on grey noise, of one of a few sizes (so the
images have different token counts); the assistant names its colour and shape. Some records have two images, some
two turns. numpy + Pillow, seeded: running it twice gives identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 30)}
SHAPES = ("square", "disc")
SIZES = ((56, 56), (84, 56), (56, 112), (112, 84))


def draw(rng: np.random.Generator, colour: str, shape: str, size: tuple[int, int]) -> Image.Image:
    w, h = size
    img = Image.fromarray((100 + 20 * rng.integers(0, 3, (h, w, 1))).repeat(3, 2).astype(np.uint8))  # grey noise
    r = min(w, h) // 3
    cx, cy = int(rng.integers(r, w - r + 1)), int(rng.integers(r, h - r + 1))
    box = (cx - r, cy - r, cx + r, cy + r)
    (ImageDraw.Draw(img).rectangle if shape == "square" else ImageDraw.Draw(img).ellipse)(box, fill=COLOURS[colour])
    return img


def record(rng: np.random.Generator, out: Path, k: int) -> dict:
    n_images = 2 if k % 5 == 4 else 1
    names, facts = [], []
    for j in range(n_images):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"img/{k}-{j}.png"
        draw(rng, colour, shape, SIZES[int(rng.integers(len(SIZES)))]).save(out / name)
        names.append(name)
        facts.append((colour, shape))
    ask = "What is in the pictures?" if n_images == 2 else "What is in the picture?"
    answer = " and ".join(f"a {c} {s}" for c, s in facts).capitalize() + "."
    messages = [{"role": "user", "content": [{"type": "image"} for _ in names] + [{"type": "text", "text": ask}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    if k % 3 == 2:  # a second turn about the first image
        messages += [{"role": "user", "content": [{"type": "text", "text": "Which colour?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": f"{facts[0][0].capitalize()}."}]}]
    return {"messages": messages, "images": names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="data/vlm-tiny")
    out = Path(ap.parse_args().out_dir)
    (out / "img").mkdir(parents=True, exist_ok=True)
    for name, n, start, seed in (("train.jsonl", 48, 0, 0), ("eval.jsonl", 8, 1000, 1)):
        rng = np.random.default_rng(seed)
        rows = [record(rng, out, start + k) for k in range(n)]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}/train.jsonl, {out}/eval.jsonl and {len(list((out / 'img').glob('*.png')))} images")


if __name__ == "__main__":
    main()

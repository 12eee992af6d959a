"""Write data/sample/pref.jsonl and pref_eval.jsonl: preference pairs for the tiny DPO recipe and tests.

The chosen answer is polite and complete ("Sure! The capital of X is Y. Hope this helps."), the rejected one curt
or wrong; the held-out pairs use other subjects, so a model that learns the preference ranks them right. All three of
TRL's layouts appear: conversational with an explicit prompt, plain text with a prompt, and the implicit prompt.

    python scripts/make_preference_data.py
"""

import json
import random
from pathlib import Path

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey", "gold"]
THINGS = ["apple", "sky", "leaf", "sun", "plum", "carrot", "night", "snow", "rose", "bark", "stone", "coin", "grass",
          "sea", "cherry", "lemon", "cloud", "ink", "milk", "rust", "ash", "fog", "lime", "olive"]


def pair(thing: str, colour: str, rng: random.Random, layout: int) -> dict:
    question = f"What colour is the {thing}?"
    chosen = f"Sure! The {thing} is {colour}. Hope this helps."
    rejected = rng.choice([f"{colour}.", "no idea", f"The {thing} is {rng.choice(COLOURS)}", "why ask me"])
    if layout == 0:
        return {"prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}
    if layout == 1:
        return {"prompt": question + " ", "chosen": chosen, "rejected": rejected}
    user = {"role": "user", "content": question}
    return {"chosen": [user, {"role": "assistant", "content": chosen}],
            "rejected": [user, {"role": "assistant", "content": rejected}]}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parent.parent / "data" / "sample"
    train_things, eval_things = THINGS[:18], THINGS[18:]
    for name, things, n in (("pref.jsonl", train_things, 192), ("pref_eval.jsonl", eval_things, 32)):
        rows = [pair(rng.choice(things), rng.choice(COLOURS), rng, i % 3) for i in range(n)]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()

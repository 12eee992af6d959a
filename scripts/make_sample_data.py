"""Generate the small deterministic sample data set used by the harness tests and demos.

Usage:
    python scripts/make_sample_data.py [--out-dir data/sample]

Writes (overwriting) two JSONL files, one JSON object per line:

    <out-dir>/gen.jsonl       400 records (160 ``{"text": ...}`` + 240 ``{"messages": [...]}``), shuffled
    <out-dir>/gen_eval.jsonl   40 records (16 text + 24 messages) from a separate seed stream, held out

Text records are short synthetic English paragraphs (2-4 sentences, 20-60 words) built from
templates with a strongly repeated structure: facts about fictional towns, diary/weather entries,
counting sequences and tiny pet stories.  Message records are chat samples with roles ``system``
(in ~20% of records), ``user`` and ``assistant`` (2 rounds in ~15% of records) covering integer
arithmetic, unit conversion, list reversal, upper-casing / capitalising words and questions about
the fictional towns.  Assistant answers are templated and always consistent.

Standard library only; the output depends only on the fixed seeds (``random.Random(0)`` for
gen.jsonl, ``random.Random(1)`` for gen_eval.jsonl), so running it twice gives identical files.
Eval records never repeat a train record verbatim.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

N_TRAIN_TEXT = 160
N_TRAIN_MESSAGES = 240
N_EVAL_TEXT = 16
N_EVAL_MESSAGES = 24

# --------------------------------------------------------------------------------------------
# Fixed world: fictional towns with consistent facts (used by text records and town questions).
# --------------------------------------------------------------------------------------------

TOWNS = [
    # name, direction, river, bridges, market day, known for, roof colour, population (hundreds), neighbour
    ("Varnel", "north", "Ost", 4, "Tuesday", "bread", "red", 9, "Kelmar"),
    ("Kelmar", "south", "Ost", 2, "Friday", "cheese", "grey", 6, "Varnel"),
    ("Ostrid", "east", "Lune", 7, "Monday", "wool", "blue", 12, "Tavos"),
    ("Tavos", "west", "Lune", 3, "Saturday", "clocks", "green", 5, "Ostrid"),
    ("Brindle", "north", "Tarn", 5, "Wednesday", "boats", "brown", 8, "Merrow"),
    ("Merrow", "east", "Tarn", 1, "Thursday", "apples", "white", 3, "Brindle"),
    ("Halden", "south", "Vell", 6, "Sunday", "honey", "yellow", 11, "Quillan"),
    ("Quillan", "west", "Vell", 8, "Tuesday", "pottery", "black", 7, "Halden"),
    ("Sorrel", "north", "Wyre", 2, "Monday", "glass", "orange", 4, "Fenwick"),
    ("Fenwick", "south", "Wyre", 9, "Friday", "fish", "red", 15, "Sorrel"),
    ("Dunmore", "east", "Dane", 3, "Saturday", "salt", "blue", 10, "Ashby"),
    ("Ashby", "west", "Dane", 4, "Thursday", "lanterns", "green", 2, "Dunmore"),
]

NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["morning", "afternoon"]
WEATHER = ["cold", "warm", "windy", "wet", "dry", "cloudy", "sunny", "foggy", "calm", "bright"]
PLACES = ["market", "harbour", "library", "bakery", "old mill", "school", "park", "station"]
ACTIONS = [
    "bought three apples",
    "met an old friend",
    "read a short book",
    "drank a cup of tea",
    "fed the grey ducks",
    "bought fresh bread",
    "wrote a long letter",
    "looked at the boats",
    "sold two baskets of eggs",
    "helped my brother",
]
EVENINGS = [
    "the rain stopped and the sky was clear",
    "the wind grew strong and the lamps went out",
    "we ate soup by the fire",
    "I went to bed early",
    "the stars were bright over the river",
    "it began to snow a little",
    "my sister played a song on the piano",
    "the streets were quiet and dark",
]

PEOPLE = ["Anna", "Tom", "Mira", "Leo", "Nora", "Sam", "Ida", "Ben", "Lina", "Otto", "Rosa", "Finn"]
COLOURS = ["red", "black", "white", "brown", "grey", "golden", "spotted", "small"]
ANIMALS = ["cat", "dog", "rabbit", "goat", "hen", "pony", "duck", "parrot"]
PET_VERBS = ["sleeps", "plays", "sits", "runs", "waits", "sings"]
PET_SPOTS = ["garden", "kitchen door", "old oak tree", "river bank", "stone wall", "front gate"]
FOODS = ["carrots", "seeds", "bread", "corn", "grass", "fish"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a careful math tutor. Show the result and the answer.",
    "You are a friendly guide to the towns of the river valley.",
    "Answer every question in one or two short sentences.",
]

LIST_WORDS = [
    "apple", "river", "stone", "cloud", "tree", "bread", "lamp", "boat", "bird", "chair",
    "door", "field", "glass", "horse", "key", "leaf", "moon", "nest", "road", "salt",
    "table", "wall", "wind", "book", "cup", "fish", "hill", "rope", "star", "wheel",
]

CASE_WORDS = [
    "garden", "window", "market", "bridge", "winter", "yellow", "silver", "candle", "forest",
    "orange", "pencil", "basket", "harbour", "letter", "shadow", "rabbit", "summer", "castle",
    "mirror", "thunder", "village", "button", "ladder", "blanket", "kettle", "meadow", "valley",
    "lantern", "pottery", "clock",
]

UNITS = [
    # from unit, to unit, factor, max value
    ("km", "m", 1000, 20),
    ("m", "cm", 100, 50),
    ("kg", "g", 1000, 20),
    ("L", "mL", 1000, 15),
    ("h", "min", 60, 24),
    ("min", "s", 60, 30),
    ("cm", "mm", 10, 99),
]


def n_words(s: str) -> int:
    return len(s.split())


# --------------------------------------------------------------------------------------------
# Text records
# --------------------------------------------------------------------------------------------


def text_town(rng: random.Random) -> str:
    name, direction, river, bridges, market, known, roof, pop, neighbour = rng.choice(TOWNS)
    sents = [
        f"The town of {name} lies {direction} of the river {river}.",
        f"It has {bridges} bridges and a busy market on {market}.",
    ]
    optional = [
        f"The people of {name} are known for their {known}.",
        f"Most houses in {name} have {roof} roofs.",
        f"About {pop * 100} people live in {name}.",
        f"The road from {name} to {neighbour} crosses the river {river}.",
    ]
    k = rng.choice([1, 2])
    picks = sorted(rng.sample(range(len(optional)), k))  # keep the fixed sentence order
    sents += [optional[i] for i in picks]
    return " ".join(sents)


def text_diary(rng: random.Random) -> str:
    town = rng.choice(TOWNS)[0]
    day = rng.choice(DAYS)
    time = rng.choice(TIMES)
    w1, w2 = rng.sample(WEATHER, 2)
    sents = [
        f"On {day} {time} it was {w1} and {w2} in {town}.",
        f"I walked to the {rng.choice(PLACES)} and {rng.choice(ACTIONS)}.",
        f"In the evening {rng.choice(EVENINGS)}.",
    ]
    if rng.random() < 0.5:
        sents.append(f"Tomorrow I will go back to the {rng.choice(PLACES)}.")
    return " ".join(sents)


def text_counting(rng: random.Random) -> str:
    length = rng.randint(6, 12)
    if rng.random() < 0.7:
        start = rng.randint(1, 20 - length)
        seq = list(range(start, start + length))
        first = f"Let us count from {NUMBER_WORDS[seq[0]]} to {NUMBER_WORDS[seq[-1]]}:"
        after = f"After {NUMBER_WORDS[seq[-1]]} comes {NUMBER_WORDS[seq[-1] + 1]}."
        step = "The numbers go up by one."
    else:
        start = rng.randint(length, 20)
        seq = list(range(start, start - length, -1))
        first = f"Let us count down from {NUMBER_WORDS[seq[0]]} to {NUMBER_WORDS[seq[-1]]}:"
        after = f"Before {NUMBER_WORDS[seq[-1]]} comes {NUMBER_WORDS[seq[-1] - 1]}."
        step = "The numbers go down by one."
    body = ", ".join(NUMBER_WORDS[i] for i in seq)
    sents = [f"{first} {body}.", after]
    if rng.random() < 0.6 or n_words(" ".join(sents)) < 20:
        sents.append(step)
    return " ".join(sents)


def text_pet(rng: random.Random) -> str:
    person = rng.choice(PEOPLE)
    colour = rng.choice(COLOURS)
    animal = rng.choice(ANIMALS)
    sents = [
        f"{person} has a {colour} {animal}.",
        f"Every {rng.choice(DAYS)} the {animal} {rng.choice(PET_VERBS)} near the {rng.choice(PET_SPOTS)}.",
        f"{person} gives the {animal} {rng.choice(FOODS)} and fresh water.",
    ]
    if rng.random() < 0.5:
        sents.append(f"The {animal} is happy and {person} is happy too.")
    return " ".join(sents)


TEXT_KINDS = [(text_town, 35), (text_diary, 25), (text_counting, 20), (text_pet, 20)]


# --------------------------------------------------------------------------------------------
# Chat tasks: each returns one (user, assistant) round
# --------------------------------------------------------------------------------------------


def task_arith(rng: random.Random) -> tuple[str, str]:
    op = rng.choice(["+", "-", "*"])
    if op == "+":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        c = a + b
    elif op == "-":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if b > a:
            a, b = b, a
        c = a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = a * b
    word = {"+": "add", "-": "subtract", "*": "multiply"}[op]
    user = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"Compute {a} {op} {b}.",
            f"Please calculate {a} {op} {b}.",
            f"Can you {word} these numbers: {a} {op} {b}?",
        ]
    )
    return user, f"{a} {op} {b} = {c}. The answer is {c}."


def task_units(rng: random.Random) -> tuple[str, str]:
    src, dst, factor, vmax = rng.choice(UNITS)
    v = rng.randint(1, vmax)
    user = rng.choice(
        [
            f"Convert {v} {src} to {dst}.",
            f"How many {dst} are in {v} {src}?",
            f"Please convert {v} {src} into {dst}.",
        ]
    )
    return user, f"{v} {src} = {v * factor} {dst}. The answer is {v * factor}."


def task_reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(LIST_WORDS, rng.randint(3, 5))
    fwd = ", ".join(words)
    rev = ", ".join(reversed(words))
    user = rng.choice(
        [
            f"Reverse the list: {fwd}.",
            f"Write this list in reverse order: {fwd}.",
        ]
    )
    return user, f"The reversed list is: {rev}. The answer is {rev}."


def task_case(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(CASE_WORDS)
    if rng.random() < 0.6:
        user = rng.choice(
            [
                f"Write the word {w} in capital letters.",
                f"Convert {w} to upper case.",
            ]
        )
        return user, f"The word {w} in capital letters is {w.upper()}. The answer is {w.upper()}."
    user = rng.choice(
        [
            f"Capitalize the first letter of the word {w}.",
            f"Start the word {w} with a capital letter.",
        ]
    )
    return user, f"The word {w} with a capital first letter is {w.capitalize()}. The answer is {w.capitalize()}."


def task_town(rng: random.Random) -> tuple[str, str]:
    name, direction, river, bridges, market, known, roof, pop, neighbour = rng.choice(TOWNS)
    q = rng.randrange(6)
    if q == 0:
        return (
            f"Which river is near {name}?",
            f"{name} lies {direction} of the river {river}. The answer is {river}.",
        )
    if q == 1:
        return (
            f"How many bridges does {name} have?",
            f"{name} has {bridges} bridges. The answer is {bridges}.",
        )
    if q == 2:
        return (
            f"On which day is the market in {name}?",
            f"The market in {name} is on {market}. The answer is {market}.",
        )
    if q == 3:
        return (
            f"What are the people of {name} known for?",
            f"The people of {name} are known for their {known}. The answer is {known}.",
        )
    if q == 4:
        return (
            f"What colour are the roofs in {name}?",
            f"Most houses in {name} have {roof} roofs. The answer is {roof}.",
        )
    return (
        f"How many people live in {name}?",
        f"About {pop * 100} people live in {name}. The answer is {pop * 100}.",
    )


CHAT_KINDS = [(task_arith, 30), (task_units, 20), (task_reverse, 15), (task_case, 15), (task_town, 20)]


def weighted(rng: random.Random, kinds):
    fns = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    return rng.choices(fns, weights=weights, k=1)[0]


def make_text(rng: random.Random) -> dict:
    text = weighted(rng, TEXT_KINDS)(rng)
    assert 2 <= text.count(". ") + 1 <= 4 and 20 <= n_words(text) <= 60, text
    return {"text": text}


def make_messages(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    rounds = 2 if rng.random() < 0.15 else 1
    for _ in range(rounds):
        user, assistant = weighted(rng, CHAT_KINDS)(rng)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    return {"messages": messages}


def generate(rng: random.Random, n_text: int, n_messages: int, exclude: set[str]) -> list[dict]:
    """Generate unique records (not in ``exclude``), then shuffle text and chat records together."""
    seen = set(exclude)
    records: list[dict] = []
    for maker, n in ((make_text, n_text), (make_messages, n_messages)):
        made = 0
        tries = 0
        while made < n:
            tries += 1
            if tries > 100 * n:
                raise RuntimeError("could not generate enough unique records")
            rec = maker(rng)
            key = json.dumps(rec, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            records.append(rec)
            made += 1
    rng.shuffle(records)
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="data/sample", help="output folder (default: data/sample)")
    args = ap.parse_args()
    out = Path(args.out_dir)

    train = generate(random.Random(0), N_TRAIN_TEXT, N_TRAIN_MESSAGES, exclude=set())
    train_keys = {json.dumps(r, sort_keys=True) for r in train}
    evals = generate(random.Random(1), N_EVAL_TEXT, N_EVAL_MESSAGES, exclude=train_keys)

    write_jsonl(out / "gen.jsonl", train)
    write_jsonl(out / "gen_eval.jsonl", evals)
    print(f"wrote {len(train)} records to {out / 'gen.jsonl'}")
    print(f"wrote {len(evals)} records to {out / 'gen_eval.jsonl'}")


if __name__ == "__main__":
    main()

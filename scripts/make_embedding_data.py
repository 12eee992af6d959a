"""Generate the small deterministic synthetic retrieval data set for GritLM-style embedding training.

Usage:
    python scripts/make_embedding_data.py [--out-dir data/sample]

Writes (overwriting) two JSONL files, one GritLM embedding record per line:

    {"query": [instruction, text], "pos": [passage], "neg": [passage, ...]}

    <out-dir>/emb.jsonl       480 training records (240 fact lookup, 120 question->answer, 120 paraphrase)
    <out-dir>/emb_eval.jsonl  120 held-out records (60 fact lookup, 30 question->answer, 30 paraphrase)

Every record has exactly one positive and 1-3 hard negatives; every string (query text, passage text)
has 8-45 words drawn from a vocabulary of a few hundred common English words plus fictional names.
The three task types each have their own query instruction:

1. Fact lookup (50%).  Passages describe a fictional town, person or museum object with 3-4 attributes
   taken from small vocabularies; the query identifies the entity by two of them ("Which town makes glass
   and has its market on Tuesday?").  Hard negatives share exactly one of the two queried attributes (and
   possibly others).  Passages and queries are written with several surface templates each, so the
   template words are noise and the attribute values are the signal.  Passages are plain strings.
2. Question -> answer (25%).  Arithmetic ("What number do you get from 7 plus 5?" -> "... 7 plus 5
   equals 12.") and facts about fictional countries (capital, flag, main export).  Hard negatives are
   true sentences about different operands / a different operator / a different country or attribute.
   Passages are plain strings.
3. Paraphrase (25%).  Symmetric task: query, positive and negatives all carry the instruction
   "Retrieve semantically similar text."  The positive rewords the query (clause reordering, passive
   voice, synonym swaps); hard negatives keep the template but change one key content word (or swap
   two people's roles).

Guarantees (asserted at generation time):
  * within each file every passage text is unique, every fact (attribute pair, arithmetic fact, country
    fact, paraphrase meaning) is stated by at most one passage, and each query is matched by exactly one
    passage of its file (its own positive), so a corpus built from all pos+neg of a file is unambiguous;
  * held-out records use fictional names (towns, objects, surnames, countries, cities) from a pool that is
    disjoint from the training pool; no eval query text or passage text occurs in the training file;
    eval fact-lookup query attribute pairs never occur together in any training passage; eval arithmetic,
    country and paraphrase facts never occur in the training file.

Standard library only; the output depends only on fixed seeds (``random.Random(0)`` for emb.jsonl,
``random.Random(1)`` for emb_eval.jsonl, ``random.Random(1234)`` for the name pools and the fictional
world), so running it twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from itertools import combinations
from pathlib import Path

N_TRAIN = {"fact": 240, "qa": 120, "para": 120}
N_EVAL = {"fact": 60, "qa": 30, "para": 30}
QA_ARITH_SHARE = 0.6  # of the question->answer records; the rest are country questions

INSTR_FACT = "Given two facts, retrieve the matching description."
INSTR_QA = "Given a question, retrieve the sentence that answers it."
INSTR_PARA = "Retrieve semantically similar text."

MIN_WORDS, MAX_WORDS = 8, 45

NUM = {
    2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine",
    20: "twenty", 30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy", 80: "eighty",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
DIRECTIONS = ["north", "south", "east", "west"]

# --------------------------------------------------------------------------------------------
# Fictional names.  One pool of place-like names (towns, museum objects, capital cities), one of
# countries and a list of surnames; each is shuffled with a fixed seed and split 3/4 train, 1/4 eval.
# --------------------------------------------------------------------------------------------

ONSETS = [
    "Var", "Kel", "Ost", "Tav", "Brin", "Mer", "Hal", "Quil", "Sor", "Fen", "Dun", "Ash", "Bel", "Cor",
    "Dor", "Gal", "Har", "Lor", "Mal", "Nor", "Pel", "Ros", "Tel", "Wel", "Yar", "Zen", "Ald", "Bram",
    "Cal", "Ems", "Fal", "Gren", "Hol", "Ind", "Jar", "Kin", "Lun", "Mor", "Nev", "Orm",
]
CODAS = [
    "nel", "mar", "rid", "os", "dle", "row", "den", "lan", "rel", "wick", "more", "by", "ford", "ton",
    "ley", "wyn", "mouth", "stead", "holm", "gate", "brook", "well", "combe", "dale", "thorp", "ric",
    "sey", "vin", "ak", "ith",
]
COUNTRY_ROOTS = [
    "Drav", "Estr", "Lorv", "Mald", "Pren", "Quor", "Selv", "Tamb", "Uld", "Vesk", "Zarn", "Bolv",
    "Crem", "Fald", "Grov", "Jesp", "Karn", "Lisk", "Murv", "Nald", "Ostr", "Perv", "Rusk", "Tolm",
]
COUNTRY_SUFFIXES = ["onia", "avia", "land", "mark", "eria", "ovia"]
FIRST_NAMES = ["Anna", "Tom", "Mira", "Leo", "Nora", "Sam", "Ida", "Ben", "Lina", "Otto", "Rosa", "Finn"]
SURNAMES = [
    "Holt", "Marsh", "Reed", "Lund", "Hale", "Moss", "Wren", "Finch", "Crane", "Dale", "Hart",
    "Lane", "Mills", "Nash", "Park", "Rowe", "Shaw", "Tate", "Vale", "Webb", "Ward", "York", "Ames",
    "Birch", "Cole", "Drake", "Flint", "Grove", "Heath", "Kemp", "Lowe", "Marlow", "Pike", "Quinn",
    "Royce", "Sands", "Thorne", "Upton", "Voss", "Wilde",
]


def _split(items: list[str], seed: int) -> tuple[list[str], list[str]]:
    items = sorted(set(items))
    random.Random(seed).shuffle(items)
    cut = (len(items) * 3) // 4
    return items[:cut], items[cut:]


PLACE_NAMES = _split([o + c for o in ONSETS for c in CODAS], 1234)
COUNTRY_NAMES = _split([r + s for r in COUNTRY_ROOTS for s in COUNTRY_SUFFIXES], 1235)
SURNAME_SPLIT = _split(SURNAMES, 1236)


class Names:
    """Hands out unused fictional names of one split (train or eval), in a fixed shuffled order."""

    def __init__(self, split: int, rng: random.Random):
        self.places = list(PLACE_NAMES[split][len(COUNTRY_NAMES[split]) :])  # the head is reserved for capitals
        rng.shuffle(self.places)
        self.surnames = SURNAME_SPLIT[split]
        self.used_people: set[str] = set()

    def place(self) -> str:
        if not self.places:
            raise RuntimeError("ran out of fictional place names")
        return self.places.pop()

    def person(self, rng: random.Random) -> str:
        for _ in range(1000):
            name = f"{rng.choice(FIRST_NAMES)} {rng.choice(self.surnames)}"
            if name not in self.used_people:
                self.used_people.add(name)
                return name
        raise RuntimeError("ran out of person names")


# --------------------------------------------------------------------------------------------
# Task 1: fact lookup.  Each kind has attributes with small value vocabularies, passage sentence
# templates per attribute and query phrase templates per attribute.
# --------------------------------------------------------------------------------------------

TOWN_VALUES = {
    "river": ["Ost", "Lune", "Tarn", "Vell", "Wyre", "Dane", "Brue", "Kell", "Mott", "Rask", "Sill", "Yarrow"],
    "bridges": [NUM[k] for k in range(2, 10)],
    "market": DAYS,
    "trade": [
        "glass", "wool", "cheese", "salt", "honey", "rope", "boats", "clocks", "pottery", "lanterns",
        "bread", "candles", "baskets", "paper", "soap", "shoes", "barrels", "bells",
    ],
    "roof": ["red", "grey", "blue", "green", "brown", "white", "yellow", "black"],
}
TOWN_SENTENCES = {
    "bridges": ["It has {v} bridges.", "There are {v} bridges in the town.", "{V} old bridges cross the town."],
    "market": ["Its market is on {v}.", "The market opens every {v}.", "Market day there is {v}."],
    "trade": ["Its people make {v}.", "The town is known for its {v}.", "Most of its people sell {v}."],
    "roof": [
        "Most houses have {v} roofs.", "The roofs there are painted {v}.", "Nearly every roof in the town is {v}.",
    ],
}
TOWN_QUERY = {
    "river": ["lies on the river {v}", "stands by the river {v}", "is near the river {v}"],
    "bridges": ["has {v} bridges", "is crossed by {v} bridges"],
    "market": ["has its market on {v}", "holds a market every {v}", "has market day on {v}"],
    "trade": ["is known for {v}", "makes {v}", "sells {v}"],
    "roof": ["has {v} roofs", "has houses with {v} roofs"],
}
TOWN_FRAMES = [
    "Which town {p1} and {p2}?",
    "Find the town that {p1} and {p2}.",
    "I am looking for the town that {p1} and {p2}.",
    "Name the town that {p1} and also {p2}.",
]

PERSON_VALUES = {
    "job": [
        "baker", "farmer", "teacher", "sailor", "doctor", "painter", "builder", "tailor", "miller",
        "driver", "gardener", "nurse", "cook", "carpenter",
    ],
    "place": ["harbour", "mill", "station", "library", "park", "school", "bakery", "church", "forest", "castle"],
    "pet": ["cat", "dog", "rabbit", "goat", "hen", "pony", "duck", "parrot"],
    "instrument": ["flute", "piano", "drum", "violin", "harp", "guitar", "horn"],
    "age": [NUM[k] for k in (20, 30, 40, 50, 60, 70, 80)],
}
PERSON_SENTENCES = {
    "job": ["{w} works as a {v}.", "{w} is a {v} by trade.", "{w} has been a {v} for many years."],
    "place": ["{w} lives near the {v}.", "{w} has a house close to the {v}.", "The home of {w} is next to the {v}."],
    "pet": ["{w} keeps a {v}.", "{w} has a pet {v}.", "{w} looks after a {v} at home."],
    "instrument": ["{w} plays the {v}.", "In the evening {w} plays the {v}.", "{w} is learning to play the {v}."],
    "age": ["{w} is {v} years old.", "{w} turned {v} this year."],
}
PERSON_QUERY = {
    "job": ["works as a {v}", "is a {v}"],
    "place": ["lives near the {v}", "has a home by the {v}"],
    "pet": ["keeps a {v}", "has a pet {v}"],
    "instrument": ["plays the {v}"],
    "age": ["is {v} years old"],
}
PERSON_FRAMES = [
    "Which person {p1} and {p2}?",
    "Who {p1} and {p2}?",
    "Find the person who {p1} and {p2}.",
    "Tell me about the person who {p1} and {p2}.",
]

OBJECT_VALUES = {
    "type": ["cup", "lamp", "chest", "bell", "mirror", "vase", "sword", "bowl", "crown", "chair", "table", "box"],
    "material": ["wood", "stone", "brass", "silver", "gold", "iron", "clay", "copper", "bone"],
    "room": ["hall", "kitchen", "tower", "cellar", "attic", "chapel", "gallery", "study"],
    "age": [NUM[k] for k in range(2, 10)],
    "weight": [NUM[k] for k in range(2, 10)],
}
OBJECT_SENTENCES = {
    "material": ["{s} is made of {v}.", "{s} was made from {v} by hand."],
    "room": ["{s} is kept in the {v}.", "{s} stands in the {v} of the museum."],
    "age": ["{s} is {v} hundred years old.", "{s} was made {v} hundred years ago."],
    "weight": ["{s} weighs {v} pounds.", "{s} is heavy and weighs {v} pounds."],
}
OBJECT_QUERY = {
    "material": ["is made of {v}", "was made from {v}"],
    "room": ["is kept in the {v}", "stands in the {v}"],
    "age": ["is {v} hundred years old"],
    "weight": ["weighs {v} pounds"],
}
OBJECT_FRAMES_TYPED = [  # the type is one of the two queried attributes
    "In the museum, which {t} {p}?",
    "Which {t} in the old museum {p}?",
    "Find the {t} in the museum that {p}.",
]
OBJECT_FRAMES = [
    "Which object in the museum {p1} and {p2}?",
    "Find the museum object that {p1} and {p2}.",
    "Which thing in the museum {p1} and {p2}?",
]

FACT_KINDS = {"town": TOWN_VALUES, "person": PERSON_VALUES, "object": OBJECT_VALUES}


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def sample_attrs(kind: str, rng: random.Random) -> dict[str, str]:
    values = FACT_KINDS[kind]
    if kind == "object":  # the type is always part of the object's name
        names = ["type"] + rng.sample([a for a in values if a != "type"], rng.choice([2, 3]))
    else:
        names = rng.sample(list(values), rng.choice([3, 4]))
    names = [a for a in values if a in names]  # canonical attribute order
    return {a: rng.choice(values[a]) for a in names}


def attr_pairs(attrs: dict[str, str]) -> list[tuple]:
    return [tuple(p) for p in combinations(sorted(attrs.items()), 2)]


def render_fact(kind: str, name: str, attrs: dict[str, str], rng: random.Random) -> str:
    if kind == "town":
        d = rng.choice(DIRECTIONS)
        if "river" in attrs:
            r = attrs["river"]
            intro = rng.choice(
                [
                    f"The town of {name} lies {d} of the river {r}.",
                    f"{name} is a small town {d} of the river {r}.",
                    f"{name} is an old town that stands by the river {r}.",
                ]
            )
        else:
            intro = rng.choice(
                [
                    f"{name} is a small town in the {d} of the valley.",
                    f"The town of {name} lies in the {d} hills.",
                    f"{name} is an old town on the {d} road.",
                ]
            )
        rest = [rng.choice(TOWN_SENTENCES[a]).format(v=v, V=cap(v)) for a, v in attrs.items() if a != "river"]
        rng.shuffle(rest)
        return " ".join([intro] + rest)
    if kind == "person":
        first = name.split()[0]
        sents = [rng.choice(PERSON_SENTENCES[a]) for a in attrs]
        order = list(range(len(sents)))
        rng.shuffle(order)
        out = []
        for i, j in enumerate(order):
            a = list(attrs)[j]
            out.append(sents[j].format(w=name if i == 0 else first, v=attrs[a]))
        return " ".join(out)
    # object
    subj = f"The {name} {attrs['type']}"
    keys = [a for a in attrs if a != "type"]
    rng.shuffle(keys)
    out = []
    for i, a in enumerate(keys):
        out.append(rng.choice(OBJECT_SENTENCES[a]).format(s=subj if i == 0 else "It", v=attrs[a]))
    return " ".join(out)


def render_fact_query(kind: str, pair: list[tuple[str, str]], rng: random.Random) -> str:
    pair = list(pair)
    rng.shuffle(pair)
    if kind == "object":
        types = [v for a, v in pair if a == "type"]
        others = [(a, v) for a, v in pair if a != "type"]
        if types:
            (a, v), = others
            p = rng.choice(OBJECT_QUERY[a]).format(v=v)
            return rng.choice(OBJECT_FRAMES_TYPED).format(t=types[0], p=p)
        table, frames = OBJECT_QUERY, OBJECT_FRAMES
    else:
        table, frames = (TOWN_QUERY, TOWN_FRAMES) if kind == "town" else (PERSON_QUERY, PERSON_FRAMES)
    p1, p2 = (rng.choice(table[a]).format(v=v) for a, v in pair)
    return rng.choice(frames).format(p1=p1, p2=p2)


# --------------------------------------------------------------------------------------------
# Task 2: question -> answer (arithmetic and fictional countries)
# --------------------------------------------------------------------------------------------

ARITH_Q = [
    "What number do you get from {a} {op} {b}?",
    "Can you tell me what {a} {op} {b} is equal to?",
    "Please work out the value of {a} {op} {b} for me.",
    "What is the result when you compute {a} {op} {b}?",
]
ARITH_A = [
    "When you work it out, {a} {op} {b} equals {c}.",
    "The result of {a} {op} {b} is the number {c}.",
    "If you take {a} {op} {b}, the answer is {c}.",
    "{a} {op} {b} is equal to {c}, which is the answer.",
]


def arith_value(op: str, a: int, b: int) -> int | None:
    if op == "plus":
        return a + b
    if op == "minus":
        return a - b if a > b else None
    return a * b if a <= 20 and b <= 20 else None


def arith_key(op: str, a: int, b: int) -> tuple:
    return (op, min(a, b), max(a, b)) if op in ("plus", "times") else (op, a, b)


def sample_arith(rng: random.Random) -> tuple[str, int, int]:
    op = rng.choice(["plus", "plus", "minus", "minus", "times"])
    if op == "plus":
        return op, rng.randint(2, 40), rng.randint(2, 40)
    if op == "minus":
        a = rng.randint(10, 60)
        return op, a, rng.randint(2, a - 1)
    return op, rng.randint(2, 12), rng.randint(2, 12)


def arith_negatives(op: str, a: int, b: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """Candidate hard negatives: true facts about nearby operands, another operator, or inverse facts."""
    c = arith_value(op, a, b)
    cands = []
    for d in (-3, -2, -1, 1, 2, 3):
        cands += [(op, a, b + d), (op, a + d, b)]
    cands += [(o, a, b) for o in ("plus", "minus", "times") if o != op]
    if op == "plus":
        cands += [("minus", c, b), ("minus", c, a)]  # shares a, b with the question
    elif op == "minus":
        cands += [("minus", a, c), ("plus", b, c)]  # "12 minus 7 equals 5" for "12 minus 5"
    else:
        cands += [("plus", a, b)]
    out = [(o, x, y) for o, x, y in cands if x >= 1 and y >= 1 and arith_value(o, x, y) is not None]
    out = [n for n in out if arith_key(*n) != arith_key(op, a, b)]
    rng.shuffle(out)
    return out


def render_arith(op: str, a: int, b: int, rng: random.Random) -> str:
    return rng.choice(ARITH_A).format(a=a, op=op, b=b, c=arith_value(op, a, b))


COUNTRY_ATTRS = ["capital", "flag", "export"]
FLAG_COLOURS = ["red", "blue", "green", "white", "black", "golden", "silver", "purple"]
FLAG_ANIMALS = ["lion", "eagle", "bear", "wolf", "horse", "deer", "owl", "fish", "swan", "snake"]
EXPORTS = ["tea", "rice", "cotton", "coffee", "sugar", "timber", "silk", "spices", "olives", "tin", "wine", "fruit"]
COUNTRY_Q = {
    "capital": ["What is the name of the capital city of {c}?", "Which city is the capital of the country {c}?"],
    "flag": ["What animal is shown on the flag of {c}?", "What can you see on the national flag of {c}?"],
    "export": ["What is the main export of the country {c}?", "What does the country of {c} sell to other lands?"],
}
COUNTRY_A = {
    "capital": ["The capital city of {c} is called {v}.", "{v} is the capital and largest city of {c}."],
    "flag": ["The flag of {c} shows a {v}.", "On the national flag of {c} there is a {v}."],
    "export": ["The main export of the country {c} is {v}.", "{c} sells a lot of {v} to other lands."],
}


def make_world(split: int) -> dict[str, dict[str, str]]:
    """Fixed facts for every fictional country of one split; capitals get their own fictional names."""
    rng = random.Random(1237 + split)
    cities = PLACE_NAMES[split][: len(COUNTRY_NAMES[split])]  # reserved: never used for towns or objects
    world = {}
    for i, country in enumerate(sorted(COUNTRY_NAMES[split])):
        world[country] = {
            "capital": cities[i],
            "flag": f"{rng.choice(FLAG_COLOURS)} {rng.choice(FLAG_ANIMALS)}",
            "export": rng.choice(EXPORTS),
        }
    return world


# --------------------------------------------------------------------------------------------
# Task 3: paraphrase.  Frames of one template are word-order variants with the same meaning; {syn}
# slots pick one of a few synonyms.  Key slots carry the meaning; negatives change one of them.
# --------------------------------------------------------------------------------------------

ITEMS = ["apples", "pears", "plums", "eggs", "onions", "lemons", "cakes", "candles", "carrots", "potatoes"]
PARA_TEMPLATES = [
    {
        "keys": {"p": FIRST_NAMES, "n": [NUM[k] for k in range(2, 10)], "item": ITEMS,
                 "shop": ["market", "bakery", "farm", "corner shop", "village store"], "day": DAYS},
        "syn": {"buy": ["bought", "purchased"]},
        "frames": [
            "{p} {buy} {n} {item} at the {shop} on {day} morning.",
            "On {day} morning, {p} {buy} {n} {item} at the {shop}.",
            "{N} {item} were {buy} by {p} at the {shop} on {day} morning.",
            "At the {shop} on {day} morning, {p} {buy} {n} {item}.",
        ],
    },
    {
        "keys": {"p": FIRST_NAMES, "thing": ["chair", "table", "door", "fence", "gate", "window", "clock", "ladder"],
                 "place": ["kitchen", "barn", "garden", "shed", "hall", "attic"],
                 "meal": ["breakfast", "lunch", "dinner", "supper"]},
        "syn": {"fix": ["fixed", "repaired", "mended"], "broken": ["broken", "damaged"]},
        "frames": [
            "{p} {fix} the {broken} {thing} in the {place} before {meal}.",
            "Before {meal}, {p} {fix} the {broken} {thing} in the {place}.",
            "The {broken} {thing} in the {place} was {fix} by {p} before {meal}.",
        ],
    },
    {
        "keys": {"animal": ["cat", "dog", "goat", "pony", "rabbit", "duck", "hen", "fox"],
                 "colour": ["black", "white", "brown", "grey", "red", "spotted"],
                 "spot": ["apple tree", "stone wall", "front gate", "old barn", "river bank", "kitchen door"],
                 "time": ["morning", "afternoon", "evening", "night"]},
        "syn": {"big": ["big", "large"], "sleep": ["slept", "rested", "dozed"]},
        "frames": [
            "The {big} {colour} {animal} {sleep} by the {spot} for the whole {time}.",
            "For the whole {time}, the {big} {colour} {animal} {sleep} by the {spot}.",
            "By the {spot}, the {big} {colour} {animal} {sleep} for the whole {time}.",
        ],
    },
    {
        "keys": {"p": FIRST_NAMES, "q": FIRST_NAMES,
                 "topic": [
                     "harvest", "storm", "new school", "wedding", "old bridge", "summer fair", "lost dog", "flood",
                 ]},
        "syn": {"long": ["long", "lengthy"], "get": ["got", "received"]},
        "frames": [
            "{p} wrote a {long} letter to {q} about the {topic}.",
            "A {long} letter about the {topic} was written by {p} to {q}.",
            "{q} {get} a {long} letter from {p} about the {topic}.",
        ],
        "swap": ("p", "q"),  # a negative may swap the two people's roles
    },
    {
        "keys": {"p": FIRST_NAMES, "n": [NUM[k] for k in range(2, 10)],
                 "veg": ["beans", "peas", "carrots", "onions", "turnips", "leeks", "beets", "cabbages"],
                 "month": MONTHS},
        "syn": {"plant": ["planted", "sowed"], "big": ["big", "large"]},
        "frames": [
            "In {month}, {p} {plant} {n} rows of {veg} in the {big} garden.",
            "{p} {plant} {n} rows of {veg} in the {big} garden in {month}.",
            "{N} rows of {veg} were {plant} by {p} in the {big} garden in {month}.",
        ],
    },
    {
        "keys": {"p": FIRST_NAMES, "vehicle": ["train", "bus", "boat", "bicycle", "cart", "coach"],
                 "dest": ["coast", "city", "mountains", "lake", "islands", "capital"],
                 "season": ["spring", "summer", "autumn", "winter"]},
        "syn": {"travel": ["travelled", "went", "journeyed"], "short": ["short", "brief"]},
        "frames": [
            "{p} {travel} by {vehicle} to the {dest} for a {short} visit in {season}.",
            "In {season}, {p} {travel} to the {dest} by {vehicle} for a {short} visit.",
            "For a {short} visit in {season}, {p} {travel} by {vehicle} to the {dest}.",
        ],
    },
    {
        "keys": {"p": FIRST_NAMES, "food": ["soup", "stew", "pie", "pudding", "porridge", "curry"],
                 "guests": ["children", "neighbours", "farmers", "teachers", "sailors", "visitors"], "day": DAYS},
        "syn": {"cook": ["cooked", "made", "prepared"], "hot": ["hot", "warm"]},
        "frames": [
            "{p} {cook} a {hot} {food} for the {guests} on {day} evening.",
            "On {day} evening, {p} {cook} a {hot} {food} for the {guests}.",
            "For the {guests}, {p} {cook} a {hot} {food} on {day} evening.",
        ],
    },
]


def para_meaning(t: int, slots: dict[str, str]) -> tuple:
    return (t,) + tuple(sorted(slots.items()))


def render_para(t: int, slots: dict[str, str], frame: int, syn: dict[str, str]) -> str:
    text = PARA_TEMPLATES[t]["frames"][frame].format(**slots, **syn, N=cap(slots.get("n", "")))
    return cap(text)


def random_surface(t: int, rng: random.Random) -> tuple[int, dict[str, str]]:
    tpl = PARA_TEMPLATES[t]
    return rng.randrange(len(tpl["frames"])), {k: rng.choice(v) for k, v in tpl["syn"].items()}


# --------------------------------------------------------------------------------------------
# Record generation with per-file bookkeeping
# --------------------------------------------------------------------------------------------


def n_words(s: str) -> int:
    return len(s.split())


def text_of(x) -> str:
    return x[1] if isinstance(x, list) else x


class Book:
    """What a file already contains (used for uniqueness within a file and exclusion of train from eval)."""

    def __init__(self):
        self.passages: set[str] = set()
        self.queries: set[str] = set()
        self.covered = {k: set() for k in FACT_KINDS}  # attribute pairs stated together by some passage
        self.claimed = {k: set() for k in FACT_KINDS}  # attribute pairs used by some query
        self.arith: set[tuple] = set()
        self.country: set[tuple] = set()
        self.para: set[tuple] = set()


class Generator:
    def __init__(self, split: int, seed: int, exclude: Book | None):
        self.rng = random.Random(seed)
        self.names = Names(split, random.Random(seed + 100))
        self.world = make_world(split)
        self.countries = sorted(self.world)
        self.book = Book()
        self.ex = exclude or Book()

    # -- helpers ---------------------------------------------------------------------------------

    def fresh_texts(self, query: str, passages: list[str]) -> bool:
        b, ex = self.book, self.ex
        if query in b.queries or query in ex.queries:
            return False
        if len(set(passages)) != len(passages):
            return False
        if any(p in b.passages or p in ex.passages for p in passages):
            return False
        return all(MIN_WORDS <= n_words(s) <= MAX_WORDS for s in [query] + passages)

    def commit_texts(self, query: str, passages: list[str]) -> None:
        self.book.queries.add(query)
        self.book.passages.update(passages)

    def n_neg(self) -> int:
        return self.rng.choices([1, 2, 3], weights=[3, 4, 3])[0]

    # -- task 1 ----------------------------------------------------------------------------------

    def fact(self, kind: str) -> dict | None:
        rng, b = self.rng, self.book
        covered, claimed = b.covered[kind], b.claimed[kind]
        pos = sample_attrs(kind, rng)
        qattrs = sorted(rng.sample(list(pos), 2))
        qpair = tuple((a, pos[a]) for a in qattrs)
        if qpair in covered or qpair in self.ex.covered[kind]:
            return None  # the pair must identify this positive only (and be new in eval)
        if any(p in claimed for p in attr_pairs(pos)):
            return None
        negs = []
        for i in range(self.n_neg()):
            for _ in range(50):
                if i < 2:  # share exactly one queried attribute: keep qattrs[i], change the other
                    neg = dict(pos)
                    change = qattrs[1 - i]
                    neg[change] = rng.choice([v for v in FACT_KINDS[kind][change] if v != pos[change]])
                    for a in neg:
                        if a not in qattrs and rng.random() < 0.5:
                            neg[a] = rng.choice(FACT_KINDS[kind][a])
                else:  # a same-kind passage that does not match the query
                    neg = sample_attrs(kind, rng)
                pairs = attr_pairs(neg)
                if qpair in pairs or any(p in claimed for p in pairs) or neg in negs:
                    continue
                negs.append(neg)
                break
        if not negs:
            return None
        texts = []
        for attrs in [pos] + negs:
            name = self.names.person(rng) if kind == "person" else self.names.place()
            texts.append(render_fact(kind, name, attrs, rng))
        query = render_fact_query(kind, list(qpair), rng)
        if not self.fresh_texts(query, texts):
            return None
        for attrs in [pos] + negs:
            covered.update(attr_pairs(attrs))
        claimed.add(qpair)
        self.commit_texts(query, texts)
        return {"query": [INSTR_FACT, query], "pos": [texts[0]], "neg": texts[1:]}

    # -- task 2 ----------------------------------------------------------------------------------

    def arith(self) -> dict | None:
        rng, b = self.rng, self.book
        op, a, x = sample_arith(rng)
        used = b.arith | self.ex.arith
        if arith_key(op, a, x) in used:
            return None
        facts = [(op, a, x)]
        for n in arith_negatives(op, a, x, rng):
            if len(facts) > self.n_neg():
                break
            if arith_key(*n) not in used and all(arith_key(*n) != arith_key(*f) for f in facts):
                facts.append(n)
        if len(facts) < 2:
            return None
        query = rng.choice(ARITH_Q).format(a=a, op=op, b=x)
        texts = [render_arith(*f, rng) for f in facts]
        if not self.fresh_texts(query, texts):
            return None
        b.arith.update(arith_key(*f) for f in facts)
        self.commit_texts(query, texts)
        return {"query": [INSTR_QA, query], "pos": [texts[0]], "neg": texts[1:]}

    def country(self) -> dict | None:
        rng, b = self.rng, self.book
        c = rng.choice(self.countries)
        attr = rng.choice(COUNTRY_ATTRS)
        facts = [(c, attr)]
        want = self.n_neg()
        # hard negatives: same question about another country; the same country's other facts
        options = [(rng.choice(self.countries), attr) for _ in range(2)]
        options.append((c, rng.choice([a for a in COUNTRY_ATTRS if a != attr])))
        rng.shuffle(options)
        options.insert(0, (rng.choice(self.countries), attr))  # always at least one other-country neg
        for f in options:
            if len(facts) > want:
                break
            if f not in facts:
                facts.append(f)
        if any(f in b.country for f in facts):
            return None
        query = rng.choice(COUNTRY_Q[attr]).format(c=c)
        texts = [rng.choice(COUNTRY_A[a]).format(c=k, v=self.world[k][a]) for k, a in facts]
        if not self.fresh_texts(query, texts):
            return None
        b.country.update(facts)
        self.commit_texts(query, texts)
        return {"query": [INSTR_QA, query], "pos": [texts[0]], "neg": texts[1:]}

    # -- task 3 ----------------------------------------------------------------------------------

    def para(self) -> dict | None:
        rng, b = self.rng, self.book
        t = rng.randrange(len(PARA_TEMPLATES))
        tpl = PARA_TEMPLATES[t]
        slots = {k: rng.choice(v) for k, v in tpl["keys"].items()}
        if "q" in slots and slots["q"] == slots["p"]:
            return None
        qf, qs = random_surface(t, rng)
        query = render_para(t, slots, qf, qs)
        for _ in range(50):  # the positive: same meaning, different wording
            pf, ps = random_surface(t, rng)
            if rng.random() < 0.7 and pf == qf:
                continue
            pos = render_para(t, slots, pf, ps)
            if pos != query:
                break
        else:
            return None
        neg_slots = []
        keys = list(tpl["keys"])
        rng.shuffle(keys)
        for k in keys[: self.n_neg()]:
            s = dict(slots)
            if "swap" in tpl and k in tpl["swap"] and rng.random() < 0.5:
                s["p"], s["q"] = slots["q"], slots["p"]
            else:
                s[k] = rng.choice([v for v in tpl["keys"][k] if v != slots[k]])
            if "q" in s and s["q"] == s["p"]:
                continue
            if para_meaning(t, s) not in [para_meaning(t, x) for x in neg_slots]:
                neg_slots.append(s)
        if not neg_slots:
            return None
        meanings = [para_meaning(t, s) for s in [slots] + neg_slots]
        if any(m in b.para or m in self.ex.para for m in meanings):
            return None
        negs = []
        for s in neg_slots:  # half keep the query's exact wording, half get a random wording
            f, sy = (qf, qs) if rng.random() < 0.5 else random_surface(t, rng)
            negs.append(render_para(t, s, f, sy))
        if not self.fresh_texts(query, [pos] + negs):
            return None
        b.para.update(meanings)
        self.commit_texts(query, [pos] + negs)
        return {
            "query": [INSTR_PARA, query],
            "pos": [[INSTR_PARA, pos]],
            "neg": [[INSTR_PARA, n] for n in negs],
        }

    # -- driver ----------------------------------------------------------------------------------

    def make(self, counts: dict[str, int]) -> list[dict]:
        n_arith = round(counts["qa"] * QA_ARITH_SHARE)
        plan = []
        kinds = list(FACT_KINDS)
        plan += [(self.fact, (kinds[i % len(kinds)],)) for i in range(counts["fact"])]
        plan += [(self.arith, ())] * n_arith + [(self.country, ())] * (counts["qa"] - n_arith)
        plan += [(self.para, ())] * counts["para"]
        records = []
        for fn, args in plan:
            for _ in range(5000):
                rec = fn(*args)
                if rec is not None:
                    records.append(rec)
                    break
            else:
                raise RuntimeError(f"could not generate a unique record for {fn.__name__}{args}")
        self.rng.shuffle(records)
        return records


def check(records: list[dict]) -> None:
    """Exactly one pos, 1-3 negs, word limits, and all passages of the file distinct."""
    seen = set()
    for r in records:
        assert set(r) == {"query", "pos", "neg"} and len(r["pos"]) == 1 and 1 <= len(r["neg"]) <= 3, r
        for x in [r["query"]] + r["pos"] + r["neg"]:
            assert MIN_WORDS <= n_words(text_of(x)) <= MAX_WORDS, x
        for x in r["pos"] + r["neg"]:
            assert text_of(x) not in seen, x
            seen.add(text_of(x))


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

    train_gen = Generator(split=0, seed=0, exclude=None)
    train = train_gen.make(N_TRAIN)
    evals = Generator(split=1, seed=1, exclude=train_gen.book).make(N_EVAL)
    check(train)
    check(evals)

    write_jsonl(out / "emb.jsonl", train)
    write_jsonl(out / "emb_eval.jsonl", evals)
    print(f"wrote {len(train)} records to {out / 'emb.jsonl'}")
    print(f"wrote {len(evals)} records to {out / 'emb_eval.jsonl'}")


if __name__ == "__main__":
    main()

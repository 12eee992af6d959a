"""Train the small byte-level BPE tokenizer shipped with the harness.

Usage:
    python scripts/build_tokenizer.py [--data-dir data/sample] [--out harness/assets/tokenizer]

Trains a byte-level BPE tokenizer (``tokenizers`` library, vocab_size 2048) on all text of
``<data-dir>/gen.jsonl`` and ``<data-dir>/gen_eval.jsonl`` (every ``text`` field and every message
``content``) plus a built-in list of a few hundred common English words, digits, numbers and
punctuation so that it generalises a little beyond the sample data.  Run
``scripts/make_sample_data.py`` first.

Special tokens, with fixed ids:
    <pad>=0  <s>=1  </s>=2  <unk>=3  <|system|>=4  <|user|>=5  <|assistant|>=6  <|embed|>=7

Byte-level pre-tokenizer (add_prefix_space=False), ByteLevel decoder and no post-processor: the
harness adds bos/eos itself.  The result is wrapped in ``transformers.PreTrainedTokenizerFast`` and
written with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(<out>)`` reloads it offline.
The output is deterministic: running the script twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
MARKER_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|embed|>"]

COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color colour face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran
check game shape equal miss brought heat snow tire bring yes distant fill east paint language among
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July
August September October November December spring summer autumn winter today tomorrow yesterday
zero seven eight nine eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen
twenty thirty forty fifty sixty seventy eighty ninety million plus minus times divided equals sum
total convert reverse capital letters upper lower case meter metre kilometer gram kilogram liter
litre second minutes hours please thank thanks hello goodbye sorry assistant user system question
""".split()

PUNCTUATION = list(".,;:!?'\"()[]{}-+*/=<>%$#@&_|~^`\\")


def data_texts(data_dir: Path) -> list[str]:
    texts: list[str] = []
    for name in ("gen.jsonl", "gen_eval.jsonl"):
        with open(data_dir / name, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if "text" in rec:
                    texts.append(rec["text"])
                for msg in rec.get("messages", []):
                    texts.append(msg["content"])
    return texts


def builtin_texts() -> list[str]:
    words = COMMON_WORDS
    lines = [
        " ".join(words),  # words as they appear mid-sentence (" word")
        " ".join(w.capitalize() for w in words),  # sentence-initial / title case
        " ".join(w.upper() for w in words),
        " ".join(str(d) for d in range(10)),
        " ".join(str(n) for n in range(101)),
        " ".join(PUNCTUATION),
        "".join(PUNCTUATION),
    ]
    # A few sentence-shaped lines so common words also occur without a leading space.
    lines += [f"{w.capitalize()} {words[(i * 7) % len(words)]}." for i, w in enumerate(words)]
    return lines


def build(data_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS + MARKER_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = data_texts(data_dir) + builtin_texts()
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="data/sample", help="folder with gen.jsonl and gen_eval.jsonl")
    ap.add_argument("--out", default="harness/assets/tokenizer", help="output folder (replaced)")
    args = ap.parse_args()

    from transformers import PreTrainedTokenizerFast

    tok = build(Path(args.data_dir))
    for i, t in enumerate(SPECIAL_TOKENS + MARKER_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    # transformers v5 calls the former ``additional_special_tokens`` ``extra_special_tokens``.
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=list(MARKER_TOKENS),
    )

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)  # no stale files from an earlier layout
    out.mkdir(parents=True)
    hf_tok.save_pretrained(str(out))
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote tokenizer (vocab {tok.get_vocab_size()}) to {out}: "
          f"{', '.join(sorted(p.name for p in out.iterdir()))} ({total} bytes)")


if __name__ == "__main__":
    main()

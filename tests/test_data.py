"""harness.data.samples: JSONL validation, chat tokenization and label masks, truncation, caching, collation, data-check CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest
import torch

from harness import cli
from harness.config import ModelConfig
from harness.data.samples import (
    IGNORE_INDEX,
    EmbedFormat,
    EmbeddingCollator,
    EmbeddingGroups,
    GenerativeCollator,
    load_embedding_rows,
    load_generative_rows,
    pad_embed,
    retrieval_eval_set,
    tokenize_dataset,
    tokenize_embed_texts,
    tokenize_embedding_dataset,
)
from harness.data.sources import expand_files
from harness.errors import DataError
from harness.model import load_tokenizer

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."},
    ]
}
TEXT = {"text": "The quick brown fox jumps over the lazy dog."}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def write_jsonl(path: Path, records: list) -> Path:
    """Records (dicts, dumped as JSON) or raw strings (written as they are), one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def rows_of(tmp_path: Path, paths, what: str = "data.train_files"):
    return load_generative_rows([str(p) for p in paths], cache_dir=str(tmp_path / "cache"), what=what)


def tokenized(tmp_path: Path, paths, tok, max_len: int = 1 << 20):
    return tokenize_dataset(rows_of(tmp_path, paths), tok, max_len=max_len)


def spans(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of trained positions."""
    out, start = [], None
    for i, lab in enumerate([*labels, IGNORE_INDEX]):
        if lab != IGNORE_INDEX and start is None:
            start = i
        elif lab == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------- tokenization


def test_messages_labels(tmp_path, tok):
    f = write_jsonl(tmp_path / "chat.jsonl", [CONVERSATION])
    ds, stats = tokenized(tmp_path, [f], tok)
    assert stats["samples"] == 1 and stats["truncated"] == 0 and stats["dropped_no_labels"] == 0
    row = ds[0]
    input_ids, labels = row["input_ids"], row["labels"]
    assert len(input_ids) == len(labels) == row["length"]
    assert input_ids[0] == tok.bos_token_id and labels[0] == IGNORE_INDEX

    # Labels equal input_ids wherever they are set.
    assert all(lab == i for i, lab in zip(input_ids, labels) if lab != IGNORE_INDEX)

    # The trained spans are exactly the two assistant answers, each closed by eos.
    trained = [tok.decode(input_ids[a:b]) for a, b in spans(labels)]
    assert trained == ["Four.</s>", "Six, of course.</s>"]
    for a, b in spans(labels):
        assert input_ids[b - 1] == tok.eos_token_id

    # The whole sample in the chat layout, and the untrained part is bos + system/user turns + assistant prefixes.
    assert tok.decode(input_ids) == (
        "<s><|system|>\nBe brief.\n<|user|>\nWhat is two plus two?\n<|assistant|>\nFour.</s>"
        "<|user|>\nAnd three plus three?\n<|assistant|>\nSix, of course.</s>"
    )
    # Tokenizing the whole text (as apply_chat_template does) gives the same ids as tokenizing the pieces here.
    expected_ids, expected_labels = [tok.bos_token_id], [IGNORE_INDEX]
    for piece, trained_piece in [
        ("<|system|>\nBe brief.\n", False),
        ("<|user|>\nWhat is two plus two?\n", False),
        ("<|assistant|>\n", False),
        ("Four.", True),
        ("<|user|>\nAnd three plus three?\n", False),
        ("<|assistant|>\n", False),
        ("Six, of course.", True),
    ]:
        p = ids(tok, piece) + ([tok.eos_token_id] if trained_piece else [])
        expected_ids += p
        expected_labels += p if trained_piece else [IGNORE_INDEX] * len(p)
    assert input_ids == expected_ids
    assert labels == expected_labels

    # Every chat marker (and the newline after <|assistant|>) is untrained; so is every eos-free prefix.
    markers = {tok.convert_tokens_to_ids(m) for m in ["<|system|>", "<|user|>", "<|assistant|>"]}
    for i, t in enumerate(input_ids):
        if t in markers:
            assert labels[i] == IGNORE_INDEX
    asst = tok.convert_tokens_to_ids("<|assistant|>")
    newline = ids(tok, "<|assistant|>\n")[1:]
    for i in [i for i, t in enumerate(input_ids) if t == asst]:
        assert input_ids[i + 1:i + 1 + len(newline)] == newline
        assert labels[i + 1:i + 1 + len(newline)] == [IGNORE_INDEX] * len(newline)
    assert stats["tokens"] == len(input_ids)
    assert input_ids == list(tok.apply_chat_template(CONVERSATION["messages"], tokenize=True)["input_ids"])


def test_text_labels(tmp_path, tok):
    f = write_jsonl(tmp_path / "text.jsonl", [TEXT])
    ds, stats = tokenized(tmp_path, [f], tok)
    input_ids, labels = ds[0]["input_ids"], ds[0]["labels"]
    assert input_ids[0] == tok.bos_token_id and input_ids[-1] == tok.eos_token_id
    assert labels[0] == IGNORE_INDEX
    assert labels[1:] == input_ids[1:]
    assert input_ids == [tok.bos_token_id, *ids(tok, TEXT["text"]), tok.eos_token_id]
    assert tok.decode(input_ids) == "<s>" + TEXT["text"] + "</s>"
    assert stats["samples"] == 1 and stats["tokens"] == len(input_ids) == stats["max_len"]


def test_mixed_file_keeps_order_and_columns(tmp_path, tok):
    f = write_jsonl(tmp_path / "mix.jsonl", [TEXT, CONVERSATION, {"text": "Second text."}])
    rows = rows_of(tmp_path, [f])
    assert rows["origin"] == [f"{f}:1", f"{f}:2", f"{f}:3"]
    assert rows[0]["segments"] == [{"role": "text", "content": TEXT["text"], "extra": ""}]
    assert rows[1]["segments"] == [{**m, "extra": ""} for m in CONVERSATION["messages"]]
    ds, stats = tokenize_dataset(rows, tok, max_len=1 << 20)
    assert sorted(ds.column_names) == ["input_ids", "labels", "length"]
    assert stats["samples"] == 3
    assert tok.decode(ds[2]["input_ids"]) == "<s>Second text.</s>"


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    f = tmp_path / "gaps.jsonl"
    f.write_text("\n" + json.dumps(TEXT) + "\n   \n\n" + json.dumps({"text": "b"}) + "\n")
    assert rows_of(tmp_path, [f])["origin"] == [f"{f}:2", f"{f}:5"]


def test_folder_input_sorted(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "b.jsonl", [{"text": "b1"}, {"text": "b2"}])
    write_jsonl(d / "a.jsonl", [{"text": "a1"}])
    write_jsonl(d / "sub" / "c.jsonl", [{"text": "c1"}])
    (d / "notes.txt").write_text("not data\n")
    files = expand_files([str(d)])
    assert files == sorted(files) == [str(d / "a.jsonl"), str(d / "b.jsonl"), str(d / "sub" / "c.jsonl")]
    rows = rows_of(tmp_path, [d])
    assert [s[0]["content"] for s in rows["segments"]] == ["a1", "b1", "b2", "c1"]
    assert rows["origin"] == [f"{d / 'a.jsonl'}:1", f"{d / 'b.jsonl'}:1", f"{d / 'b.jsonl'}:2", f"{d / 'sub' / 'c.jsonl'}:1"]


def test_files_and_folders_mixed(tmp_path):
    d = tmp_path / "dir"
    write_jsonl(d / "x.jsonl", [{"text": "x"}])
    f = write_jsonl(tmp_path / "single.jsonl", [{"text": "s"}])
    rows = rows_of(tmp_path, [f, d])
    assert [s[0]["content"] for s in rows["segments"]] == ["s", "x"]


# ----------------------------------------------------------------------------------------------- truncation


def test_truncation_cuts_and_counts(tmp_path, tok):
    long_text = {"text": " ".join(["word"] * 40)}
    f = write_jsonl(tmp_path / "t.jsonl", [long_text, {"text": "Hi."}])
    full, _ = tokenized(tmp_path, [f], tok)
    full_ids = full[0]["input_ids"]
    assert len(full_ids) > 10
    ds, stats = tokenize_dataset(rows_of(tmp_path, [f]), tok, max_len=10)
    assert stats["truncated"] == 1 and stats["dropped_no_labels"] == 0 and stats["samples"] == 2
    assert ds[0]["input_ids"] == full_ids[:10]
    assert ds[0]["labels"] == full[0]["labels"][:10]
    assert ds[0]["length"] == 10 and stats["max_len"] == 10
    assert ds[0]["input_ids"][-1] != tok.eos_token_id  # the eos was cut with the rest
    assert ds[1]["input_ids"] == full[1]["input_ids"]  # the short one is untouched


def test_truncation_keeps_partially_cut_assistant_turn(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [CONVERSATION])
    full, _ = tokenized(tmp_path, [f], tok)
    first_trained = spans(full[0]["labels"])[0][0]
    ds, stats = tokenize_dataset(rows_of(tmp_path, [f]), tok, max_len=first_trained + 1)
    assert stats["samples"] == 1 and stats["truncated"] == 1 and stats["dropped_no_labels"] == 0
    assert ds[0]["labels"][-1] == ds[0]["input_ids"][-1] != IGNORE_INDEX


@pytest.mark.parametrize("cut", ["before_assistant", "after_assistant_prefix"])
def test_truncation_drops_sample_without_trained_tokens(tmp_path, tok, cut):
    long_user = {
        "messages": [
            {"role": "user", "content": " ".join(["question"] * 30)},
            {"role": "assistant", "content": "Answer."},
        ]
    }
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "Short text."}, long_user, {"text": "Another one."}])
    full, _ = tokenized(tmp_path, [f], tok)
    first_trained = spans(full[1]["labels"])[0][0]  # the <|assistant|>\n prefix ends right before this
    max_len = 20 if cut == "before_assistant" else first_trained
    assert max_len <= first_trained and max_len >= len(full[0]["input_ids"]) and max_len >= len(full[2]["input_ids"])
    ds, stats = tokenize_dataset(rows_of(tmp_path, [f]), tok, max_len=max_len)
    assert stats["dropped_no_labels"] == 1
    assert stats["dropped_examples"] == [f"{f}:2"]
    assert stats["samples"] == 2 == len(ds)
    assert [r["input_ids"] for r in ds] == [full[0]["input_ids"], full[2]["input_ids"]]


def test_truncation_dropping_everything_is_an_error(tmp_path, tok):
    sample = {"messages": [{"role": "user", "content": "a long question " * 10}, {"role": "assistant", "content": "A."}]}
    f = write_jsonl(tmp_path / "all.jsonl", [sample, sample])
    with pytest.raises(DataError) as excinfo:
        tokenize_dataset(rows_of(tmp_path, [f]), tok, max_len=8)
    assert str(excinfo.value) == f"no sample has a trained token left after truncation to data.max_len=8 (first: {f}:1)"


def test_max_len_one_drops_text(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [TEXT])
    with pytest.raises(DataError, match=r"data.max_len=1 "):
        tokenize_dataset(rows_of(tmp_path, [f]), tok, max_len=1)


# ----------------------------------------------------------------------------------------------- bad input

MSG = lambda *ms: json.dumps({"messages": list(ms)})  # noqa: E731
USER = {"role": "user", "content": "q"}
ASSISTANT = {"role": "assistant", "content": "a"}
GOOD = json.dumps({"text": "fine"})

# (id, file content, exact message with {f} for the file)
BAD_FILES = [
    ("invalid-json", GOOD + '\n{"text": "a" "b"}\n', "{f}:2: invalid JSON, column 14: Expecting ',' delimiter"),
    ("invalid-json-unquoted-key", "{text: 1}\n", "{f}:1: invalid JSON, column 2: Expecting property name enclosed in double quotes"),
    ("json-array", "[1, 2]\n", "{f}:1: expected a JSON object, got list"),
    ("json-string", GOOD + '\n"text"\n', "{f}:2: expected a JSON object, got str"),
    ("empty-file", "", "{f}: file is empty (no records)"),
    ("blank-lines-only", "\n   \n\t\n\n", "{f}: file is empty (no records)"),
    ("both-text-and-messages", json.dumps({"text": "a", "messages": [USER, ASSISTANT]}) + "\n",
     "{f}:1: record has both 'text' and 'messages'; give one"),
    ("neither", json.dumps({"prompt": "a", "completion": "b"}) + "\n",
     "{f}:1: missing field 'text' or 'messages' (keys: prompt, completion)"),
    ("neither-empty-object", "{}\n", "{f}:1: missing field 'text' or 'messages' (keys: none)"),
    ("text-not-string", GOOD + "\n" + GOOD + '\n{"text": 5}\n', "{f}:3: field 'text' must be a string, got int"),
    ("text-null", '{"text": null}\n', "{f}:1: field 'text' must be a string, got NoneType"),
    ("text-empty", '{"text": ""}\n', "{f}:1: field 'text' is empty"),
    ("text-whitespace", '{"text": "  \\n "}\n', "{f}:1: field 'text' is empty"),
    ("messages-not-list", '{"messages": "hello"}\n', "{f}:1: field 'messages' must be a non-empty list"),
    ("messages-object", '{"messages": {"role": "user"}}\n', "{f}:1: field 'messages' must be a non-empty list"),
    ("messages-empty", '{"messages": []}\n', "{f}:1: field 'messages' must be a non-empty list"),
    ("message-not-object", MSG(USER, "hi") + "\n", "{f}:1: field 'messages[1]' must be an object with role and content"),
    ("bad-role", MSG({"role": "bot", "content": "x"}, ASSISTANT) + "\n",
     "{f}:1: field 'messages[0].role' must be one of system, user, assistant, tool, got 'bot'"),
    ("missing-role", MSG({"content": "x"}, ASSISTANT) + "\n",
     "{f}:1: field 'messages[0].role' must be one of system, user, assistant, tool, got None"),
    ("missing-content", MSG(USER, {"role": "assistant"}) + "\n", "{f}:1: missing field 'messages[1].content'"),
    ("content-not-string", MSG(USER, {"role": "assistant", "content": ["a"]}) + "\n",
     "{f}:1: field 'messages[1].content' must be a string, got list"),
    ("content-empty", MSG({"role": "user", "content": " "}, ASSISTANT) + "\n", "{f}:1: field 'messages[0].content' is empty"),
    ("no-assistant-turn", MSG({"role": "system", "content": "s"}, USER) + "\n",
     "{f}:1: field 'messages' has no assistant turn (nothing to train on)"),
]


@pytest.mark.parametrize("content, message", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_bad_file(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [f])
    text = str(excinfo.value)
    assert text == message.format(f=f)
    assert "\n" not in text
    assert excinfo.value.exit_code == 1


def test_bad_line_in_second_file(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [TEXT, TEXT])
    bad = write_jsonl(tmp_path / "b.jsonl", [TEXT, TEXT, '{"messages": []}'])
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [good, bad])
    assert str(excinfo.value) == f"{bad}:3: field 'messages' must be a non-empty list"


def test_invalid_json_column_of_truncated_line(tmp_path):
    f = tmp_path / "cut.jsonl"
    f.write_text('{"text": \n')
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [f])
    assert str(excinfo.value) == f"{f}:1: invalid JSON, column 10: Expecting value"


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [missing])
    assert str(excinfo.value) == (
        f"{missing}: no such file or folder (data.train_files; relative paths are read from {os.getcwd()})"
    )
    assert excinfo.value.exit_code == 1


def test_missing_path_names_the_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"^.*nope\.jsonl: no such file or folder \(data\.eval_files; "):
        rows_of(tmp_path, [missing], what="data.eval_files")


@pytest.mark.parametrize("with_other_file", [False, True])
def test_empty_folder(tmp_path, with_other_file):
    d = tmp_path / "empty"
    d.mkdir()
    if with_other_file:
        (d / "notes.txt").write_text(json.dumps(TEXT) + "\n")
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [d])
    assert str(excinfo.value) == (f"{d}: folder has no data files (*.jsonl, *.json, *.jsonl.gz, *.parquet, *.csv, "
                                  f"*.tsv, *.arrow) (data.train_files)")


def test_folder_with_bad_nested_file(tmp_path):
    d = tmp_path / "d"
    write_jsonl(d / "a.jsonl", [TEXT])
    bad = write_jsonl(d / "deep" / "z.jsonl", [TEXT, {"text": 1}])
    with pytest.raises(DataError) as excinfo:
        rows_of(tmp_path, [d])
    assert str(excinfo.value) == f"{bad}:2: field 'text' must be a string, got int"


# ----------------------------------------------------------------------------------------------- CLI


def _stderr_lines(err: str) -> list[str]:
    """stderr lines, without the progress bars that `datasets` draws (tqdm, redrawn with \\r)."""
    lines = []
    for line in err.replace("\r", "\n").splitlines():
        if line.strip() and not line.startswith("Generating train split"):
            lines.append(line)
    return lines


@pytest.mark.parametrize(
    "content, suffix",
    [
        ('{"text": "ok"}\n{"text": 5}\n', ":2: field 'text' must be a string, got int"),
        ('{"messages": [{"role": "user", "content": "q"}]}\n', ":1: field 'messages' has no assistant turn (nothing to train on)"),
        ("not json\n", ":1: invalid JSON, column 1: Expecting value"),
    ],
)
def test_cli_data_check_bad_file(tmp_path, capsys, monkeypatch, content, suffix):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # keep ~/.cache clean
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    assert cli.main(["data-check", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    assert _stderr_lines(err) == [f"harness: error: {f}{suffix}"]


def test_cli_data_check_reads_preference_pairs_in_a_folder(tmp_path, capsys, monkeypatch):
    """A folder holding preference pairs beside generative data: each file gets its line (the pairs: their lengths
    as the run tokenizes them), not an error for the pairs."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    write_jsonl(tmp_path / "a.jsonl", [TEXT])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
                                       {"prompt": "3+3?", "chosen": "6", "rejected": "seven"}])
    assert cli.main(["data-check", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'a.jsonl'}: format text, generative, 1 records, ")
    assert lines[1].startswith(f"{tmp_path / 'b.jsonl'}: format preference, preference, 2 records, pair length mean ")
    assert lines[1].endswith(", 0 truncated")


def test_cli_data_check_missing_path(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert cli.main(["data-check", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"harness: error: {missing}: no such file or folder (paths; relative paths are read from {os.getcwd()})"
    ]


def test_cli_data_check_good_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    f = write_jsonl(tmp_path / "good.jsonl", [TEXT, CONVERSATION])
    assert cli.main(["data-check", str(f), "--max-len", "16"]) == 0
    out = capsys.readouterr().out
    first, _, rest = out.partition("\n")  # one line per source, then the statistics of all generative data
    assert first.startswith(f"{f}: format text, generative, 2 records, ")
    stats = json.loads(rest)
    # The text sample is cut to 16 tokens; the conversation's first answer starts after 16 tokens: dropped.
    assert stats["samples"] == 1 and stats["truncated"] == 1 and stats["max_len"] == 16
    assert stats["dropped_no_labels"] == 1 and stats["dropped_examples"] == [f"{f}:2"]


# ----------------------------------------------------------------------------------------------- caching


def test_cache_sees_rewritten_file(tmp_path, tok):
    f = write_jsonl(tmp_path / "data.jsonl", [{"text": "first version"}])
    rows = rows_of(tmp_path, [f])
    assert rows["segments"] == [[{"role": "text", "content": "first version", "extra": ""}]]
    ds, _ = tokenize_dataset(rows, tok, max_len=64)
    assert tok.decode(ds[0]["input_ids"]) == "<s>first version</s>"

    write_jsonl(f, [{"text": "the second, longer version"}, {"text": "and a new line"}])
    rows = rows_of(tmp_path, [f])
    assert [s[0]["content"] for s in rows["segments"]] == ["the second, longer version", "and a new line"]
    ds, stats = tokenize_dataset(rows, tok, max_len=64)
    assert stats["samples"] == 2
    assert tok.decode(ds[0]["input_ids"]) == "<s>the second, longer version</s>"

    # And back to an error: a rewritten file is validated again, not served from the cache.
    write_jsonl(f, ['{"text": 7}'])
    with pytest.raises(DataError, match=r":1: field 'text' must be a string, got int$"):
        rows_of(tmp_path, [f])


def test_cache_reuse_gives_same_rows(tmp_path):
    f = write_jsonl(tmp_path / "data.jsonl", [TEXT, CONVERSATION])
    first = rows_of(tmp_path, [f])
    second = rows_of(tmp_path, [f])
    assert first[:] == second[:]


# ----------------------------------------------------------------------------------------------- collator


def test_collator_right_pads(tok):
    pad = tok.pad_token_id
    samples = [
        {"input_ids": [1, 10, 11], "labels": [IGNORE_INDEX, 10, 11]},
        {"input_ids": [1, 20, 21, 22, 2], "labels": [IGNORE_INDEX, IGNORE_INDEX, 21, 22, 2]},
    ]
    batch = GenerativeCollator(pad_token_id=pad)(samples)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 10, 11, pad, pad], [1, 20, 21, 22, 2]]
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 10, 11, IGNORE_INDEX, IGNORE_INDEX],
        [IGNORE_INDEX, IGNORE_INDEX, 21, 22, 2],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_collator_uses_given_pad_id():
    batch = GenerativeCollator(pad_token_id=99)([{"input_ids": [5], "labels": [5]}, {"input_ids": [6, 7], "labels": [6, 7]}])
    assert batch["input_ids"].tolist() == [[5, 99], [6, 7]]
    assert batch["labels"].tolist() == [[5, IGNORE_INDEX], [6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 0], [1, 1]]


@pytest.mark.parametrize("lengths, width", [([1], 8), ([3, 5], 8), ([8], 8), ([8, 2], 8), ([9, 2], 16), ([16, 17], 24)])
def test_collator_pad_to_multiple_of_8(lengths, width):
    samples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]
    batch = GenerativeCollator(pad_token_id=0, pad_to_multiple_of=8)(samples)
    for key in ("input_ids", "labels", "attention_mask"):
        assert tuple(batch[key].shape) == (len(lengths), width)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for i, n in enumerate(lengths):
        assert batch["labels"][i, n:].eq(IGNORE_INDEX).all()
        assert batch["input_ids"][i, n:].eq(0).all()


def test_collator_on_tokenized_dataset(tmp_path, tok):
    f = write_jsonl(tmp_path / "m.jsonl", [TEXT, CONVERSATION, {"text": "Hi."}])
    ds, _ = tokenized(tmp_path, [f], tok)
    samples = [ds[i] for i in range(len(ds))]
    batch = GenerativeCollator(tok.pad_token_id, pad_to_multiple_of=8)(samples)
    longest = max(len(s["input_ids"]) for s in samples)
    assert batch["input_ids"].shape[1] == -(-longest // 8) * 8
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == s["input_ids"]
        assert batch["labels"][i, :n].tolist() == s["labels"]
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)



# ----------------------------------------------------------------------------------------------- embedding records


def emb_rows_of(tmp_path: Path, paths, need_negatives: int = 0):
    return load_embedding_rows([str(p) for p in paths], need_negatives, cache_dir=str(tmp_path / "cache"))


def E(**record) -> str:  # noqa: N802 - a record as one JSON line
    return json.dumps(record)


EMB_GOOD = E(query="q", pos=["p"], neg=["n"])

# (id, file content, need_negatives, exact message with {f} for the file)
BAD_EMB_FILES = [
    ("missing-query", E(pos=["p"], neg=["n"]) + "\n", 0, "{f}:1: missing field 'query' (keys: pos, neg)"),
    ("missing-pos", EMB_GOOD + "\n" + E(query="q") + "\n", 0, "{f}:2: missing field 'pos' (keys: query)"),
    ("empty-object", "{}\n", 0, "{f}:1: missing field 'query' (keys: none)"),
    ("pos-not-list", E(query="q", pos="p") + "\n", 0, "{f}:1: field 'pos' must be a list"),
    ("pos-object", E(query="q", pos={"text": "p"}) + "\n", 0, "{f}:1: field 'pos' must be a list"),
    ("neg-not-list", E(query="q", pos=["p"], neg="n") + "\n", 0, "{f}:1: field 'neg' must be a list"),
    ("pos-empty", E(query="q", pos=[], neg=["n"]) + "\n", 0,
     "{f}:1: field 'pos' is empty (each query needs a positive)"),
    ("neg-empty-needed", EMB_GOOD + "\n" + EMB_GOOD + "\n" + E(query="q", pos=["p"], neg=[]) + "\n", 1,
     "{f}:3: field 'neg' is empty but data.train_group_size=2 needs hard negatives"),
    ("neg-missing-needed", E(query="q", pos=["p"]) + "\n", 1,
     "{f}:1: field 'neg' is empty but data.train_group_size=2 needs hard negatives"),
    ("neg-empty-group-4", E(query="q", pos=["p"], neg=[]) + "\n", 3,
     "{f}:1: field 'neg' is empty but data.train_group_size=4 needs hard negatives"),
    ("query-number", E(query=5, pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got 5"),
    ("query-null", E(query=None, pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got null"),
    ("query-3-list", E(query=["a", "b", "c"], pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got [\"a\", \"b\", \"c\"]"),
    ("query-1-list", E(query=["only text"], pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got [\"only text\"]"),
    ("query-list-non-string", E(query=["instruct", 7], pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got [\"instruct\", 7]"),
    ("query-object", E(query={"text": "q"}, pos=["p"]) + "\n", 0,  # braces doubled for str.format:
     "{f}:1: field 'query' must be a string or [instruction, text], got {{\"text\": \"q\"}}"),
    ("long-value-cut-at-60", E(query=["x" * 100], pos=["p"]) + "\n", 0,
     "{f}:1: field 'query' must be a string or [instruction, text], got [\"" + "x" * 58),
    ("pos-item-number", E(query="q", pos=["p", 3]) + "\n", 0,
     "{f}:1: field 'pos[1]' must be a string or [instruction, text], got 3"),
    ("neg-item-list", E(query="q", pos=["p"], neg=["n", ["a", "b", "c"]]) + "\n", 0,
     "{f}:1: field 'neg[1]' must be a string or [instruction, text], got [\"a\", \"b\", \"c\"]"),
    ("query-empty", E(query="", pos=["p"]) + "\n", 0, "{f}:1: field 'query' is empty"),
    ("query-whitespace", E(query=" \n ", pos=["p"]) + "\n", 0, "{f}:1: field 'query' is empty"),
    ("query-instruction-empty-text", E(query=["instruct", ""], pos=["p"]) + "\n", 0,
     "{f}:1: field 'query[1]' is empty"),
    ("pos-empty-text", E(query="q", pos=["p", "  "]) + "\n", 0, "{f}:1: field 'pos[1]' is empty"),
    ("pos-instruction-empty-text", E(query="q", pos=[["instruct", " "]]) + "\n", 0,
     "{f}:1: field 'pos[0][1]' is empty"),
    ("neg-empty-text", E(query="q", pos=["p"], neg=["n", ""]) + "\n", 0, "{f}:1: field 'neg[1]' is empty"),
    ("invalid-json", EMB_GOOD + '\n{"query": "q", "pos": ["p"]\n', 0,
     "{f}:2: invalid JSON, column 28: Expecting ',' delimiter"),
    ("json-array", '["q", ["p"]]\n', 0, "{f}:1: expected a JSON object, got list"),
    ("empty-file", "\n\n", 0, "{f}: file is empty (no records)"),
]


@pytest.mark.parametrize("content, need_negatives, message", [b[1:] for b in BAD_EMB_FILES],
                         ids=[b[0] for b in BAD_EMB_FILES])
def test_bad_embedding_file(tmp_path, content, need_negatives, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as excinfo:
        emb_rows_of(tmp_path, [f], need_negatives)
    text = str(excinfo.value)
    assert text == message.format(f=f)
    assert "\n" not in text
    assert excinfo.value.exit_code == 1


def test_embedding_missing_path_names_the_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as excinfo:
        emb_rows_of(tmp_path, [missing])
    assert str(excinfo.value) == (
        f"{missing}: no such file or folder (data.emb_train_files; relative paths are read from {os.getcwd()})"
    )


def test_valid_embedding_records(tmp_path):
    f = write_jsonl(tmp_path / "emb.jsonl", [
        {"query": "plain query", "pos": ["plain pos"], "neg": ["plain neg 1", "plain neg 2"]},
        {"query": ["Find the answer", "instructed query"], "pos": [["Represent", "p1"], "p2"]},
        {"query": ["", "empty instruction"], "pos": ["p"], "neg": [["Represent", "n"]], "extra": 1},
    ])
    rows = emb_rows_of(tmp_path, [f])
    assert len(rows) == 3
    assert rows[0] == {
        "query": {"instruction": "", "text": "plain query"},
        "pos": [{"instruction": "", "text": "plain pos"}],
        "neg": [{"instruction": "", "text": "plain neg 1"}, {"instruction": "", "text": "plain neg 2"}],
        "origin": f"{f}:1",
    }
    assert rows[1] == {
        "query": {"instruction": "Find the answer", "text": "instructed query"},
        "pos": [{"instruction": "Represent", "text": "p1"}, {"instruction": "", "text": "p2"}],
        "neg": [],  # no 'neg' at all is fine without hard negatives
        "origin": f"{f}:2",
    }
    assert rows[2]["query"] == {"instruction": "", "text": "empty instruction"}
    assert rows[2]["neg"] == [{"instruction": "Represent", "text": "n"}]
    # With hard negatives required, record 2 (no 'neg') is the one rejected.
    with pytest.raises(DataError, match=r":2: field 'neg' is empty but data.train_group_size=2 needs hard negatives$"):
        emb_rows_of(tmp_path, [f], need_negatives=1)


# ----------------------------------------------------------------------------------------------- embedding tokens

LONG_TEXT = "The town of Varnel has four bridges over the slow green river, and every one of them is old."


def test_tokenize_embed_texts_layout(tok):
    """GritLM's layout (gritlm.GritLM.encode): prefix + text tokenized in one call with the tokenizer's own special
    tokens (the bundled tokenizer adds none, so no BOS); the prefix alone, tokenized the same way, is not pooled."""
    fmt = EmbedFormat()
    texts = [{"instruction": "Find the answer", "text": LONG_TEXT}, {"instruction": "", "text": "short text"}]
    prefix0, prefix1 = "<|user|>\nFind the answer\n<|embed|>\n", "<|embed|>\n"
    full0, full1 = tok(prefix0 + LONG_TEXT)["input_ids"], tok(prefix1 + "short text")["input_ids"]
    head0, head1 = len(tok(prefix0)["input_ids"]), len(tok(prefix1)["input_ids"])
    assert tok.convert_tokens_to_ids("<|embed|>") in full0[:head0] and tok.bos_token_id not in full0

    out, instr, truncated = tokenize_embed_texts(texts, tok, 1000, fmt)
    assert out == [full0, full1]
    assert instr == [head0, head1]
    assert truncated == 0
    assert tok.decode(out[0]) == prefix0 + LONG_TEXT
    assert tok.decode(out[0][instr[0]:]) == LONG_TEXT

    # Truncation cuts the end of the text, never the prefix.
    max_len = head0 + 3
    assert len(full1) <= max_len < len(full0)
    out, instr, truncated = tokenize_embed_texts(texts, tok, max_len, fmt)
    assert out == [full0[:max_len], full1]
    assert instr == [head0, head1] and truncated == 1

    # The smallest max_len with room for one text token.
    out, instr, truncated = tokenize_embed_texts(texts[:1], tok, head0 + 1, fmt)
    assert out == [full0[:head0 + 1]] and instr == [head0] and truncated == 1


def test_tokenize_embed_texts_with_a_tokenizer_that_adds_bos_and_a_prefix_space(llama_style_tokenizer_dir):
    """SentencePiece-style (Llama, Mistral): the tokenizer's own BOS, once, and the text's tokens as they read after
    the prefix, without the prefix space "▁" that the text tokenized alone would start with (GritLM's tokens)."""
    tok = load_tokenizer(ModelConfig(tokenizer=str(llama_style_tokenizer_dir)))
    text, instruction = "What is 7 plus 21?", "Given a question, retrieve it"
    texts = [{"instruction": instruction, "text": text}, {"instruction": "", "text": text}]
    out, instr, _ = tokenize_embed_texts(texts, tok, 64, EmbedFormat())
    for row, n, prefix in zip(out, instr, (f"<|user|>\n{instruction}\n<|embed|>\n", "<|embed|>\n")):
        assert row == tok(prefix + text)["input_ids"] and n == len(tok(prefix)["input_ids"])
        assert row[0] == tok.bos_token_id and row.count(tok.bos_token_id) == 1
        assert tok.decode(row[n:]) == text
        pooled = tok.convert_ids_to_tokens(row[n:])
        assert not pooled[0].startswith("▁") and pooled != tok.convert_ids_to_tokens(ids(tok, text))
    assert tok.convert_ids_to_tokens(ids(tok, text))[0] == "▁What"  # alone, the text starts with a prefix space


@pytest.mark.parametrize("append_eos", [False, True])
def test_tokenize_embed_texts_instruction_too_long(tok, append_eos):
    fmt = EmbedFormat(append_eos=append_eos)
    instruction = "Retrieve the passage that answers the question about bridges and towns"
    head = ids(tok, f"<|user|>\n{instruction}\n<|embed|>\n")  # the bundled tokenizer adds no special tokens
    max_len = len(head) + (1 if append_eos else 0)  # no room for a single text token
    texts = [{"instruction": "", "text": "fine"}, {"instruction": instruction, "text": "the text"}]
    with pytest.raises(DataError) as excinfo:
        tokenize_embed_texts(texts, tok, max_len, fmt)
    msg = str(excinfo.value)
    assert msg == (f"instruction {instruction[:40]!r} takes {len(head)} tokens with its template: no room for the "
                   f"text within {max_len} tokens (raise data.query_max_len / data.passage_max_len)")
    assert excinfo.value.exit_code == 1
    tokenize_embed_texts(texts, tok, max_len + 1, fmt)  # one more token is enough


def test_tokenize_embed_texts_instruction_too_long_is_one_line(tok):
    instruction = "Retrieve the passage that answers the question"
    with pytest.raises(DataError) as excinfo:
        tokenize_embed_texts([{"instruction": instruction, "text": "x"}], tok, 8, EmbedFormat())
    assert "\n" not in str(excinfo.value)


def test_too_long_instruction_in_a_file_names_file_and_line(tmp_path, tok):
    f = write_jsonl(tmp_path / "long.jsonl", [{"query": ["Retrieve the passage that answers the question", "q"],
                                                "pos": ["p"], "neg": ["n"]}])
    rows = emb_rows_of(tmp_path, [f], need_negatives=1)
    with pytest.raises(DataError) as excinfo:
        tokenize_embedding_dataset(rows, tok, 8, 64, EmbedFormat())
    assert str(excinfo.value) == (
        f"{f}:1: instruction 'Retrieve the passage that answers the qu' takes 20 tokens with its template: no room "
        "for the text within 8 tokens (raise data.query_max_len / data.passage_max_len)")


# ----------------------------------------------------------------------------------------------- groups, collation

GROUP_RECORDS = [
    {"query": ["Find the answer", "which town has four bridges"], "pos": ["alpha positive one", "alpha positive two"],
     "neg": [f"alpha negative number {k}" for k in range(6)]},
    {"query": "beta query", "pos": ["beta positive"], "neg": ["beta only negative"]},
    {"query": "gamma query", "pos": [["Represent", "gamma positive"]], "neg": ["gamma negative a", "gamma negative b"]},
]


@pytest.fixture
def emb_ds(tmp_path, tok):
    f = write_jsonl(tmp_path / "groups.jsonl", GROUP_RECORDS)
    rows = emb_rows_of(tmp_path, [f], need_negatives=1)
    ds, stats = tokenize_embedding_dataset(rows, tok, 32, 32, EmbedFormat())
    assert stats["samples"] == 3
    assert set(ds.column_names) >= {"q_ids", "q_instr", "pos_ids", "pos_instr", "neg_ids", "neg_instr"}
    return ds


def _text_of(tok, item) -> str:
    ids_, instr = item
    return tok.decode(ids_[instr:])


def _group_texts(tok, group) -> tuple:
    return tuple(_text_of(tok, p) for p in group["passages"])


def test_embedding_groups_layout(emb_ds, tok):
    groups = EmbeddingGroups(emb_ds, group_size=4, seed=7)
    assert len(groups) == 3
    for i, rec in enumerate(GROUP_RECORDS):
        g = groups[i]
        assert g["query"] == (emb_ds[i]["q_ids"], emb_ds[i]["q_instr"])
        assert len(g["passages"]) == 4
        texts = _group_texts(tok, g)
        pos = {p if isinstance(p, str) else p[1] for p in rec["pos"]}
        assert texts[0] in pos
        assert all(t in rec["neg"] for t in texts[1:])
        for ids_, instr in g["passages"]:  # (ids, instr_len) pairs straight from the tokenized row
            assert tok.bos_token_id not in ids_ and 0 < instr < len(ids_)
    # Enough negatives: sampled without replacement.
    assert len(set(_group_texts(tok, groups[0])[1:])) == 3
    # Fewer negatives than needed: with replacement (one negative repeated; two negatives, so one repeats).
    assert _group_texts(tok, groups[1])[1:] == ("beta only negative",) * 3
    assert len(set(_group_texts(tok, groups[2])[1:])) <= 2


def test_embedding_groups_group_size_one(emb_ds, tok):
    groups = EmbeddingGroups(emb_ds, group_size=1, seed=0)
    assert [len(groups[i]["passages"]) for i in range(3)] == [1, 1, 1]
    assert _group_texts(tok, groups[1]) == ("beta positive",)


def test_embedding_groups_are_reproducible(emb_ds, tok):
    a, b = EmbeddingGroups(emb_ds, 4, seed=7), EmbeddingGroups(emb_ds, 4, seed=7)
    for epoch in (0, 3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for i in (2, 0, 1):  # order of access does not matter
            assert a[i] == b[i]
            assert a[i] == a[i]
    # Same (seed, epoch, i) after visiting other epochs.
    a.set_epoch(0)
    first = a[0]
    a.set_epoch(5)
    a[0]
    a.set_epoch(0)
    assert a[0] == first


def test_embedding_groups_change_with_epoch_and_seed(emb_ds, tok):
    groups = EmbeddingGroups(emb_ds, 4, seed=7)
    by_epoch = set()
    for epoch in range(8):
        groups.set_epoch(epoch)
        g = groups[0]
        by_epoch.add(_group_texts(tok, g))
        assert g["query"] == (emb_ds[0]["q_ids"], emb_ds[0]["q_instr"])
    assert len(by_epoch) > 1  # 2 positives x (6 choose 3 ordered) negatives: epochs draw different groups
    positives = {t[0] for t in by_epoch}
    assert positives <= {"alpha positive one", "alpha positive two"}
    by_seed = {_group_texts(tok, EmbeddingGroups(emb_ds, 4, seed=s)[0]) for s in range(8)}
    assert len(by_seed) > 1


def test_pad_embed_by_hand():
    batch = pad_embed([([1, 5, 6, 7], 2), ([1, 8], 1), ([1, 9, 10, 11, 12], 3)], pad_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "pool_mask"}
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 0], [1, 8, 0, 0, 0], [1, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["pool_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 1]]


def test_embedding_collator_pool_mask_is_text_only(emb_ds, tok):
    pad = tok.pad_token_id
    groups = EmbeddingGroups(emb_ds, group_size=4, seed=1)
    items = [groups[i] for i in range(3)]
    batch = EmbeddingCollator(pad)(items)
    assert set(batch) == {"query", "passage"}
    q, p = batch["query"], batch["passage"]
    assert q["input_ids"].shape[0] == 3 and p["input_ids"].shape[0] == 3 * 4
    rows = [(q, k, items[k]["query"]) for k in range(3)]
    rows += [(p, b * 4 + j, items[b]["passages"][j]) for b in range(3) for j in range(4)]
    for side, r, (ids_, instr) in rows:
        n, width = len(ids_), side["input_ids"].shape[1]
        assert side["input_ids"][r].tolist() == ids_ + [pad] * (width - n)
        assert side["attention_mask"][r].tolist() == [1] * n + [0] * (width - n)
        assert side["pool_mask"][r].tolist() == [0] * instr + [1] * (n - instr) + [0] * (width - n)
        pooled = side["input_ids"][r][side["pool_mask"][r].bool()].tolist()
        assert pooled == ids_[instr:]
    # The pooled tokens decode to exactly the texts; the positive is row b*G.
    assert tok.decode(q["input_ids"][0][q["pool_mask"][0].bool()]) == "which town has four bridges"
    for b, rec in enumerate(GROUP_RECORDS):
        pos = {x if isinstance(x, str) else x[1] for x in rec["pos"]}
        assert tok.decode(p["input_ids"][b * 4][p["pool_mask"][b * 4].bool()]) in pos
    # Padding is never pooled; every row pools at least one token.
    assert not (p["pool_mask"].bool() & ~p["attention_mask"].bool()).any()
    assert (p["pool_mask"].sum(1) > 0).all() and (q["pool_mask"].sum(1) > 0).all()


def test_embedding_collator_pools_the_appended_eos(tmp_path, tok):
    f = write_jsonl(tmp_path / "e.jsonl", GROUP_RECORDS[1:2])
    ds, _ = tokenize_embedding_dataset(emb_rows_of(tmp_path, [f]), tok, 32, 32, EmbedFormat(append_eos=True))
    batch = EmbeddingCollator(tok.pad_token_id)([EmbeddingGroups(ds, 2, 0)[0]])
    for side in batch.values():
        for r in range(side["input_ids"].shape[0]):
            last = int(side["attention_mask"][r].sum()) - 1
            assert side["input_ids"][r, last] == tok.eos_token_id and side["pool_mask"][r, last] == 1


# ----------------------------------------------------------------------------------------------- retrieval eval


def test_retrieval_eval_set(tmp_path, tok):
    f = write_jsonl(tmp_path / "eval.jsonl", [
        {"query": "query a", "pos": ["passage one"], "neg": ["shared passage", "negative one"]},
        {"query": ["Find the answer", "query b"], "pos": ["shared passage", "passage two"], "neg": ["negative one"]},
        {"query": "query c", "pos": [["Represent", "passage three"]], "neg": [["Represent", "passage one"]]},
    ])
    rows = emb_rows_of(tmp_path, [f])
    fmt = EmbedFormat()
    ev = retrieval_eval_set(rows, tok, 16, 24, fmt)
    assert set(ev) == {"queries", "corpus", "positives"}
    expected_corpus = [
        {"instruction": "", "text": "passage one"},
        {"instruction": "", "text": "shared passage"},  # a passage of two records appears once
        {"instruction": "", "text": "negative one"},
        {"instruction": "", "text": "passage two"},
        {"instruction": "Represent", "text": "passage three"},
        {"instruction": "Represent", "text": "passage one"},  # same text, other instruction: another passage
    ]
    c_ids, c_instr, _ = tokenize_embed_texts(expected_corpus, tok, 24, fmt)
    assert ev["corpus"] == list(zip(c_ids, c_instr))
    assert [_text_of(tok, c) for c in ev["corpus"]] == [c["text"] for c in expected_corpus]
    assert ev["positives"] == [[0], [1, 3], [4]]
    q_ids, q_instr, _ = tokenize_embed_texts([r["query"] for r in rows], tok, 16, fmt)
    assert ev["queries"] == list(zip(q_ids, q_instr))
    assert [_text_of(tok, q) for q in ev["queries"]] == ["query a", "query b", "query c"]
    # Every positive of every record indexes a corpus entry with that record's positive text.
    for rec, pos in zip(rows, ev["positives"]):
        assert sorted(_text_of(tok, ev["corpus"][k]) for k in pos) == sorted(t["text"] for t in rec["pos"])


def test_pad_buckets_widths_by_hand():
    """data.pad_buckets: a batch's width is the smallest of N evenly spaced widths up to the cap that holds its
    longest row (rounded to the multiple); 0 buckets: the longest row itself."""
    from harness.data.samples import Widths

    assert [Widths(1, 4, 64)(n) for n in (1, 16, 17, 49, 64)] == [16, 16, 32, 64, 64]
    assert [Widths(1, 4, 96)(n) for n in (5, 25, 73)] == [24, 48, 96]
    assert [Widths(8, 3, 100)(n) for n in (1, 40, 41, 99)] == [40, 40, 80, 100]  # steps of 34 -> 40 (multiple of 8)
    assert Widths(1, 0, 64)(49) == 49 and Widths(8)(49) == 56
    assert Widths(1, 4, 64)(70) == 70  # longer than the cap (not truncated): its own width
    batch = pad_embed([([1, 5, 6], 1), ([1, 8], 1)], pad_id=0, widths=Widths(1, 4, 16))
    assert batch["input_ids"].shape == (2, 4) and batch["attention_mask"].sum().item() == 5
    gen = GenerativeCollator(0, widths=Widths(1, 2, 10))([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}])
    assert gen["input_ids"].shape == (1, 5) and gen["labels"][0, 3:].eq(-100).all()


# ----------------------------------------------------------------------------------------------- an epoch's filling


@pytest.mark.parametrize("rows,batch,world", [(23, 4, 2), (20, 4, 2), (24, 4, 2), (9, 4, 3), (5, 2, 1)])
def test_an_epochs_filling_is_left_out_of_every_processs_batches(rows, batch, world):
    """accelerate (even_batches) fills an epoch's last round with rows from its start; micro_batches drops them:
    over the processes every row of the epoch is trained exactly once, a partial batch keeps its real rows only,
    and a batch of filling only is a one-row stand-in with nothing to train or count (20 rows of 4 on 2 processes:
    5 batches, the sixth is filling)."""
    import itertools

    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from harness.data.loaders import micro_batches, schedule_steps

    def collate(ids):
        t = torch.tensor(ids).unsqueeze(1).repeat(1, 3)
        return {"input_ids": t, "labels": t.clone(), "attention_mask": torch.ones_like(t)}

    per_process = schedule_steps(rows, batch, world, 1, -1, 1)["micro_per_epoch"]
    trained, stand_ins = [], 0
    for rank in range(world):
        loader = prepare_data_loader(DataLoader(list(range(rows)), batch_size=batch, shuffle=True, collate_fn=collate),
                                     "cpu", num_processes=world, process_index=rank, put_on_device=False,
                                     use_seedable_sampler=True)
        pos = {"epoch": 0, "batches": 0}
        for b in itertools.islice(micro_batches(None, loader, pos), per_process):
            real = b["labels"][:, 0] != IGNORE_INDEX
            trained += b["input_ids"][real, 0].tolist()
            if not real.any():
                stand_ins += 1
                assert b["input_ids"].shape[0] == 1 and int(b["token_mask"].sum()) == 0
        assert pos == {"epoch": 0, "batches": per_process}
    assert sorted(trained) == list(range(rows))
    assert stand_ins == per_process * world - -(-rows // batch)

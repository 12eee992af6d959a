"""harness.data.sources / harness.data.formats: every source kind and record format -> canonical rows, one-line errors for
damaged files, unknown keys and formats and an offline hub id, and (slow) short training runs on a mix of them.

    .venv/bin/python -m pytest tests/test_sources.py -m "not slow"
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest

from harness import cli
from harness.config import load_config
from harness.data.checks import check_data  # the entries' checks (called by the build)
from harness.data.sources import Source, load_rows, load_source_rows, parse_sources
from harness.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
SEG = lambda role, content, extra="": {"role": role, "content": content, "extra": extra}  # noqa: E731


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # keep ~/.cache clean


def rows(tmp_path, entries, kind="generative", what="data.train_files"):
    return load_rows(entries, kind, str(tmp_path / "cache"), what)


def jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ----------------------------------------------------------------------------------------------- sources


def test_every_file_type_reads_the_same_records(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    recs = [{"text": "one"}, {"text": "two"}]
    pd.DataFrame(recs).to_parquet(d / "a.parquet")
    with open(d / "b.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["text"])
        w.writeheader()
        w.writerows(recs)
    (d / "c.tsv").write_text("text\none\ntwo\n")
    with gzip.open(d / "d.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in recs))
    (d / "e.json").write_text("[\n  " + ",\n  ".join(json.dumps(r) for r in recs) + "\n]\n")
    (d / "f.json").write_text("".join(json.dumps(r) + "\n" for r in recs))  # JSON lines named .json
    for name in ("a.parquet", "b.csv", "c.tsv", "d.jsonl.gz", "e.json", "f.json"):
        ds = rows(tmp_path, [str(d / name)])
        assert [s[0]["content"] for s in ds["segments"]] == ["one", "two"], name
    assert rows(tmp_path, [str(d / "a.parquet")])["origin"] == [f"{d}/a.parquet:row 1",
                                                                        f"{d}/a.parquet:row 2"]
    assert rows(tmp_path, [str(d / "e.json")])["origin"] == [f"{d}/e.json:2", f"{d}/e.json:3"]
    folder = rows(tmp_path, [str(d)])  # all of them, sorted, each by its type
    assert len(folder) == 12 and folder["origin"][0].endswith("a.parquet:row 1")


def test_saved_datasets_and_splits(tmp_path):
    datasets.Dataset.from_list([{"text": "saved"}]).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "tr"}]),
                          "test": datasets.Dataset.from_list([{"text": "te"}, {"text": "te2"}])}
                         ).save_to_disk(str(tmp_path / "dd"))
    assert rows(tmp_path, [str(tmp_path / "ds")])["segments"] == [[SEG("text", "saved")]]
    assert rows(tmp_path, [str(tmp_path / "dd")])["origin"] == [f"{tmp_path}/dd[train]:row 1"]
    assert len(rows(tmp_path, [{"path": str(tmp_path / "dd"), "split": "test"}])) == 2
    with pytest.raises(DataError, match=r"dd: no split 'dev' \(splits: train, test; set split: in data.train_files\)"):
        rows(tmp_path, [{"path": str(tmp_path / "dd"), "split": "dev"}])


def test_parse_sources_and_config(tmp_path):
    src = parse_sources(["a.jsonl", {"path": "x/y", "split": "test", "subset": "s", "format": "alpaca", "weight": 2,
                                     "columns": {"instruction": "prompt"}}], "data.train_files")
    assert src[0] == Source("a.jsonl")
    assert src[1] == Source("x/y", "test", "s", "alpaca", 2.0, {"instruction": "prompt"})
    assert src[1].name == "x/y[s:test]"
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      ["data.train_files=[{path: a.parquet, format: alpaca, weight: 0.5}, {path: b.jsonl, weight: 2}]"])
    assert cfg.data.train_files == [{"path": "a.parquet", "format": "alpaca", "weight": 0.5},
                                    {"path": "b.jsonl", "weight": 2}]
    bad = [("[{path: a, fromat: text}]", "config key 'data.train_files[0]': unknown key 'fromat' (did you mean "
            "'format'?)"),
           ("[{path: a, format: chatml}]", "config key 'data.train_files[0].format': expected one of text, messages, "
            "sharegpt, alpaca, gritlm, embedding, preference, got 'chatml'"),
           ("[a, {path: b, weight: 0}]", "config key 'data.train_files[1].weight': must be a number > 0, got 0"),
           ("[{format: text}]", "config key 'data.train_files[0].path': required, a file, folder or hub data set id"),
           ("[{path: a, weight: 3}, b]", "config key 'data.train_files[1]': has no weight while other sources of the "
            "list have one; give every source a weight, or none")]
    for value, message in bad:
        with pytest.raises(ConfigError) as e:
            check_data(load_config(ROOT / "configs" / "default.yaml", [f"data.train_files={value}"]).data)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"'data.eval_files\[0\]': 'weight' mixes training data"):
        check_data(load_config(ROOT / "configs" / "default.yaml", ["data.eval_files=[{path: a.jsonl, weight: 2}]"]).data)


# ----------------------------------------------------------------------------------------------- formats


def test_formats_to_canonical_rows(tmp_path):
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = {"messages": [*CHAT[:1], {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "content": "4", "tool_call_id": "c1"}, CHAT[1]], "tools": [tool]}
    row = rows(tmp_path, [jsonl(tmp_path / "m.jsonl", [messages])])[0]
    parsed = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    assert row["segments"] == [SEG("user", "What is 2+2?"), SEG("assistant", "", json.dumps({"tool_calls": [parsed]})),
                               SEG("tool", "4", '{"tool_call_id": "c1"}'), SEG("assistant", "4.")]
    assert json.loads(row["tools"]) == [tool]

    share = {"system": "Be brief.", "tools": json.dumps([tool]), "conversations": [
        {"from": "human", "value": "2+2?"},
        {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2}}'},
        {"from": "observation", "value": "4"}, {"from": "gpt", "value": "4."}]}
    row = rows(tmp_path, [jsonl(tmp_path / "s.jsonl", [share])])[0]
    assert [s["role"] for s in row["segments"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(row["segments"][2]["extra"]) == {"tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2}}}]}

    alpaca = {"instruction": "Add.", "input": "2 and 2", "output": "4", "system": "S", "history": [["hi", "hello"]]}
    assert rows(tmp_path, [jsonl(tmp_path / "a.jsonl", [alpaca])])[0]["segments"] == [
        SEG("system", "S"), SEG("user", "hi"), SEG("assistant", "hello"), SEG("user", "Add.\n\n2 and 2"),
        SEG("assistant", "4")]
    grit = {"text": ["q1", "a1", "q2", "a2"]}
    assert rows(tmp_path, [jsonl(tmp_path / "g.jsonl", [grit])])[0]["segments"] == [
        SEG("user", "q1"), SEG("assistant", "a1"), SEG("user", "q2"), SEG("assistant", "a2")]


def test_columns_and_csv_alpaca(tmp_path):
    f = tmp_path / "p.csv"
    pd.DataFrame([{"prompt": "Say hi.", "completion": "Hi!", "input": None}]).to_csv(f, index=False)
    src = {"path": str(f), "columns": {"instruction": "prompt", "output": "completion"}}
    assert rows(tmp_path, [src])[0]["segments"] == [SEG("user", "Say hi."), SEG("assistant", "Hi!")]
    d = jsonl(tmp_path / "d.jsonl", [{"dialog": CHAT}])
    assert len(rows(tmp_path, [{"path": d, "columns": {"messages": "dialog"}}])) == 1
    with pytest.raises(DataError) as e:
        rows(tmp_path, [{"path": d, "columns": {"messages": "chat"}}])
    assert str(e.value) == f"{d}:1: column 'chat' (columns: messages: chat) not found (keys: dialog)"


def test_embedding_parquet_and_kind_mismatch(tmp_path):
    f = tmp_path / "e.parquet"
    pd.DataFrame([{"query": "q", "pos": ["p"], "neg": ["n1", "n2"]}]).to_parquet(f)
    ds = load_source_rows(Source(str(f)), "embedding", str(tmp_path / "c"), need_negatives=1)
    assert ds[0]["neg"] == [{"instruction": "", "text": "n1"}, {"instruction": "", "text": "n2"}]
    with pytest.raises(DataError) as e:
        rows(tmp_path, [str(f)])
    assert str(e.value) == (f"data.train_files: {f}: format 'embedding' (detected from the columns query, pos, neg) "
                            "is embedding data; data.train_files takes generative data (text, messages, sharegpt, "
                            "alpaca, gritlm)")
    g = jsonl(tmp_path / "g.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"format 'text' \(detected .*\) is generative data; data.emb_train_files"):
        rows(tmp_path, [g], "embedding", "data.emb_train_files")


def test_openai_tool_calls_load_and_train_through_a_template_with_tools(tmp_path):
    """An OpenAI-style record (arguments as a JSON string) through the loader and Qwen2.5's shipped template: the
    call is trained as the template renders it; the GritLM layout (no tool role) refuses it in one line."""
    from test_chat_template import tokenizer_folder, trained_runs

    from harness.config import ModelConfig
    from harness.data.samples import tokenize_dataset
    from harness.model import load_tokenizer

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    msgs = [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"}, CHAT[1]]
    data = rows(tmp_path, [jsonl(tmp_path / "t.jsonl", [{"messages": msgs}])])
    tok = load_tokenizer(ModelConfig(tokenizer=str(tokenizer_folder(tmp_path, "qwen"))), markers=None)
    ds, stats = tokenize_dataset(data, tok, max_len=1024)
    assert stats["samples"] == 1 and ds.column_names == ["input_ids", "labels", "length"]
    trained = trained_runs(tok, ds[0]["input_ids"], ds[0]["labels"])
    assert trained == ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n',
                       "4.<|im_end|>\n"]
    with pytest.raises(DataError, match="no tool support"):
        tokenize_dataset(data, load_tokenizer(ModelConfig()), max_len=1024)


def test_json_array_and_gzip_errors_name_the_line(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('[\n  {"text": "a"},\n  {"text": 5},\n  {"text": "c"\n]\n')
    with pytest.raises(DataError) as e:
        rows(tmp_path, [str(f)])
    assert str(e.value) == f"{f}:3: field 'text' must be a string, got int"
    f.write_text('[\n  {"text": "a"},\n  {"text": "c"\n]\n')
    with pytest.raises(DataError) as e:
        rows(tmp_path, [str(f)])
    assert str(e.value) == f"{f}:4: invalid JSON, column 1: Expecting ',' delimiter"
    g = tmp_path / "cut.jsonl.gz"
    data = gzip.compress("".join(json.dumps({"text": f"line {i} {i * i}"}) + "\n" for i in range(2000)).encode())
    g.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut.jsonl.gz:\d+: damaged or not gzip data \("):
        rows(tmp_path, [str(g)])


# ----------------------------------------------------------------------------------------------- bad input


def _bad_files(d: Path) -> list:
    """(argv entry, exact stderr line after 'harness: error: ', exit status)."""
    pd.DataFrame([{"text": "x"}] * 50).to_parquet(d / "cut.parquet")
    data = (d / "cut.parquet").read_bytes()
    (d / "cut.parquet").write_bytes(data[: len(data) // 2])
    (d / "junk.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage bytes here")
    (d / "q.csv").write_text('text,other\n"fine",1\n"broken,2\n')
    (d / "l.csv").write_bytes(b"text\ncaf\xe9\n")
    (d / "e.csv").write_text("")
    (d / "v.csv").write_text('text\n"a"\n""\n')
    (d / "g.jsonl").write_text('{"text": "x"}\n')
    return [
        (f"{d}/cut.parquet", f"{d}/cut.parquet: cannot read as Parquet: ", 1),
        (f"{d}/junk.jsonl.gz", f"{d}/junk.jsonl.gz:1: damaged or not gzip data (", 1),
        (f"{d}/q.csv", f"{d}/q.csv: cannot read as CSV: ", 1),
        (f"{d}/l.csv", f"{d}/l.csv:2: not UTF-8 text (byte 0xe9 at column 4)", 1),
        (f"{d}/e.csv", f"{d}/e.csv: file is empty (no records)", 1),
        (f"{d}/v.csv", f"{d}/v.csv:row 2 (line 3): field 'text' must be a string, got NoneType", 1),
        ("{path: %s/g.jsonl, format: chatml}" % d, "config key 'paths[0].format': expected one of ", 2),
        ("{path: %s/g.jsonl, colums: {}}" % d, "config key 'paths[0]': unknown key 'colums' (did you mean "
                                               "'columns'?)", 2),
        ("{path: %s/g.jsonl, columns: {text: body}}" % d, f"{d}/g.jsonl:1: column 'body' (columns: text: body) "
                                                          "not found (keys: text)", 1),
    ]


def test_bad_sources_give_one_line(tmp_path, capfd):
    for arg, start, status in _bad_files(tmp_path):
        assert cli.main(["data-check", arg]) == status, arg
        out, err = capfd.readouterr()  # file-descriptor level: datasets' own logging would show here too
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("harness: error: " + start), (arg, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["data-check", "HuggingFaceH4/ultrachat_200k"],
                                  ["train", "configs/default.yaml", "data.train_files=[HuggingFaceH4/ultrachat_200k]"]])
def test_hub_id_offline_is_one_line(tmp_path, argv):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path),
           "TOKENIZERS_PARALLELISM": "false"}
    argv = argv + ([f"train.output_dir={tmp_path}/run", *FAST_TRAIN] if argv[0] == "train" else [])
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    what = "paths" if argv[0] == "data-check" else "data.train_files"
    assert lines[-1].startswith(f"harness: error: {what}: hub data set 'HuggingFaceH4/ultrachat_200k' cannot be "
                                "loaded: offline (HF_HUB_OFFLINE=1) and not in the datasets cache; download it"), lines
    assert "Traceback" not in proc.stderr


FAST_TRAIN = ["train.max_steps=2", "train.progress_bar=false", "train.report_to=[]", "train.summary=false",
              "data.eval_files=[]"]


# ----------------------------------------------------------------------------------------------- training (slow)


def _mix(d: Path) -> list:
    pd.DataFrame([{"text": "Parquet text number %d." % i} for i in range(4)]).to_parquet(d / "t.parquet")
    pd.DataFrame([{"prompt": "Say %d." % i, "completion": "%d!" % i} for i in range(4)]).to_csv(d / "a.csv",
                                                                                                 index=False)
    with gzip.open(d / "m.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    (d / "j.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                             {"from": "gpt", "value": "hello"}]}] * 4))
    jsonl(d / "g.jsonl", [{"text": ["q", "a", "q2", "a2"]}] * 4)
    datasets.Dataset.from_list([{"instruction": "Name a color.", "output": "Blue."}] * 4).save_to_disk(str(d / "s"))
    return [str(d / "t.parquet"), {"path": str(d / "a.csv"), "format": "alpaca",
                                   "columns": {"instruction": "prompt", "output": "completion"}},
            str(d / "m.jsonl.gz"), str(d / "j.json"), {"path": str(d / "g.jsonl"), "format": "gritlm"}, str(d / "s")]


@pytest.mark.slow
def test_train_on_a_mix_of_sources(tmp_path):
    from tests.harness_launch import FAST, metrics, report, run_train

    out = tmp_path / "run"
    run_train(["train.max_steps=2", *FAST, f"train.output_dir={out}", f"data.train_files={json.dumps(_mix(tmp_path))}",
               f"data.cache_dir={tmp_path / 'cache'}"])
    assert len(metrics(out)) == 2
    assert report(out)["data"]["generative"]["samples"] == 24  # 4 records from each of the 6 sources


@pytest.mark.slow
def test_train_embedding_from_parquet(tmp_path):
    from tests.harness_launch import FAST, metrics, report, run_train

    f = tmp_path / "e.parquet"
    pd.DataFrame([{"query": ["Find:", "q%d" % i], "pos": ["p%d" % i], "neg": ["n%d" % i, "m%d" % i]}
                  for i in range(8)]).to_parquet(f)
    out = tmp_path / "run"
    run_train(["train.max_steps=2", *FAST, f"train.output_dir={out}", "loss.mode=embedding",
               f"data.emb_train_files=[{{path: {f}, format: embedding}}]", "data.emb_eval_files=[]",
               f"data.cache_dir={tmp_path / 'cache'}"])
    assert len(metrics(out)) == 2
    assert report(out)["data"]["embedding"]["samples"] == 8

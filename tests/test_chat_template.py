"""Chat templates (harness.data.chat): the ids trained are exactly apply_chat_template's, the labels cover the assistant
turns and their end-of-turn token, data.chat_template resolves and errs in one line, and final/ carries the
template. Templates as the model makers ship them: tests/assets/chat_templates/*.jinja."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from harness.config import ModelConfig
from harness.data import IGNORE_INDEX
from harness.data import chat
from harness.data import samples as data_lib
from harness.errors import ConfigError, DataError
from harness.model import BUNDLED_TOKENIZER, CHAT_MARKERS, load_tokenizer

ASSETS = Path(__file__).parent / "assets" / "chat_templates"
QWEN = (ASSETS / "qwen2.5-instruct.jinja").read_text()
LLAMA = (ASSETS / "llama-3.1-instruct.jinja").read_text()
ANSWER = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
          "{{ '[ASSISTANT] <answer>' + m['content'] + '</answer>' + eos_token }}"
          "{% else %}{{ '[' + m['role'] | upper + '] ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '[ASSISTANT] <answer>' }}{% endif %}")
SPECIALS = {  # template: (its special tokens, bos, eos, end of an assistant turn)
    "qwen": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|im_end|>\n"),
    "llama": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
               "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "answer": ([], "<s>", "</s>", "</answer></s>"),
}
TEMPLATES = {"qwen": QWEN, "llama": LLAMA, "answer": ANSWER}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "Then 12, since 4 x 3 = 12."},
]


def _plain_base(folder: Path) -> None:
    """The bundled tokenizer with the GritLM markers renamed away (so that adding them would show)."""
    spec = json.loads((BUNDLED_TOKENIZER / "tokenizer.json").read_text())
    rename = {m: f"<|unused{i}|>" for i, m in enumerate(CHAT_MARKERS)}
    spec["model"]["vocab"] = {rename.get(k, k): v for k, v in spec["model"]["vocab"].items()}
    for t in spec["added_tokens"]:
        t["content"] = rename.get(t["content"], t["content"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    conf = json.loads((BUNDLED_TOKENIZER / "tokenizer_config.json").read_text())
    conf.pop("extra_special_tokens", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))


def tokenizer_folder(tmp_path: Path, kind: str) -> Path:
    """A local tokenizer folder shaped like the model maker's: its special tokens, bos/eos, chat_template."""
    folder = tmp_path / f"tok-{kind}"
    _plain_base(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    specials, bos, eos, _ = SPECIALS[kind]
    if specials:
        tok.add_special_tokens({"extra_special_tokens": specials})
    tok.bos_token, tok.eos_token = bos, eos
    tok.chat_template = TEMPLATES[kind]
    tok.save_pretrained(folder)
    return folder


def rows_of(conversations: list[list[dict]], tools: list[str] | None = None) -> dict:
    """A map batch of canonical rows (segments with extra, tools, origin)."""
    segs = [[{"role": m["role"], "content": m["content"] or "",
              "extra": json.dumps({k: v for k, v in m.items() if k not in ("role", "content")}) if len(m) > 2 else ""}
             for m in conv] for conv in conversations]
    origins = [f"t.jsonl:{i + 1}" for i in range(len(segs))]
    return {"segments": segs, "tools": tools or [""] * len(segs), "origin": origins}


def trained_runs(tok, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def _template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kind", ["qwen", "llama", "answer"])
def test_ids_are_apply_chat_templates_and_labels_the_assistant_turns(tmp_path, kind):
    tok = load_tokenizer(ModelConfig(tokenizer=str(tokenizer_folder(tmp_path, kind))), markers=None)
    assert tok.chat_template == TEMPLATES[kind]
    out = data_lib.tokenize_generative(rows_of([CONVERSATION]), tok, max_len=4096)
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert ids == _template_ids(tok, CONVERSATION)
    end = SPECIALS[kind][3]
    assert trained_runs(tok, ids, labels) == [m["content"] + end for m in CONVERSATION if m["role"] == "assistant"]
    text = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert "terse" not in text and "What is" not in text and "assistant" not in text and "Cutting" not in text
    assert out["length"] == [len(ids)] and out["truncated"] == [False]
    if kind == "llama":
        assert "Cutting Knowledge Date" in tok.decode(ids)
    if kind == "qwen":  # no system message: Qwen's default one is rendered, and not trained
        out = data_lib.tokenize_generative(rows_of([CONVERSATION[1:3]]), tok, max_len=4096)
        assert "You are Qwen" in tok.decode(out["input_ids"][0])
        assert trained_runs(tok, out["input_ids"][0], out["labels"][0]) == ["It is 4.<|im_end|>\n"]


def test_gritlm_layout_is_the_gritlm_template(tmp_path):
    tok = load_tokenizer(ModelConfig())  # bundled: no template of its own -> GritLM's
    assert tok.chat_template == chat.GRITLM_TEMPLATE
    out = data_lib.tokenize_generative(rows_of([CONVERSATION]), tok, max_len=4096)
    ids = out["input_ids"][0]
    assert ids == _template_ids(tok, CONVERSATION)
    assert tok.decode(ids).startswith("<s><|system|>\nYou are terse.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n"
                                      "It is 4.</s>")
    assert trained_runs(tok, ids, out["labels"][0]) == ["It is 4.</s>", "Then 12, since 4 x 3 = 12.</s>"]
    prompt = tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|system|>\nYou are terse.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n"
    # plain text: bos + text + eos, all but bos trained, no template
    out = data_lib.tokenize_generative({"segments": [[{"role": "text", "content": "Just text."}]],
                                        "origin": ["t:1"]}, tok, max_len=4096)
    assert tok.decode(out["input_ids"][0]) == "<s>Just text.</s>"
    assert out["labels"][0][0] == IGNORE_INDEX and out["labels"][0][1:] == out["input_ids"][0][1:]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C, sunny", "name": "get_weather"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
]


def test_tool_calls_are_trained_with_a_template_that_has_tools(tmp_path):
    tok = load_tokenizer(ModelConfig(tokenizer=str(tokenizer_folder(tmp_path, "qwen"))), markers=None)
    out = data_lib.tokenize_generative(rows_of([TOOL_CONVERSATION], [json.dumps(TOOLS)]), tok, max_len=4096)
    ids = out["input_ids"][0]
    assert ids == _template_ids(tok, TOOL_CONVERSATION, tools=TOOLS)
    runs = trained_runs(tok, ids, out["labels"][0])
    # the generation prompt "<|im_start|>assistant\n" ends where the call starts
    assert runs[0] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    assert runs[1] == "It is 18 C and sunny in Paris.<|im_end|>\n" and len(runs) == 2
    assert "get_weather" in tok.decode(ids[: ids.index(tok.convert_tokens_to_ids("<|im_end|>"))])  # tools in system


def test_tool_conversations_without_tool_support_are_one_line_errors(tmp_path):
    tok = load_tokenizer(ModelConfig())  # GritLM layout
    for conv in (TOOL_CONVERSATION, TOOL_CONVERSATION[:2] + [{"role": "assistant", "content": "Done."}]):
        with pytest.raises(DataError, match=r"^t.jsonl:1: the GritLM layout has no tool support") as e:
            data_lib.tokenize_generative(rows_of([conv]), tok, max_len=4096)
        assert "\n" not in str(e.value) and "data.chat_template=" in str(e.value)
    silent = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"  # drops tool_calls
    tok.chat_template = silent
    with pytest.raises(DataError, match=r"^t.jsonl:1: the chat template has no tool support"):
        data_lib.tokenize_generative(rows_of([TOOL_CONVERSATION]), tok, max_len=4096)


def test_a_template_that_rewrites_earlier_turns_is_a_one_line_error():
    tok = load_tokenizer(ModelConfig())
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ 'A: ...\\n' }}"
                         "{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(DataError, match=r"^t.jsonl:1: the chat template renders earlier turns differently"):
        data_lib.tokenize_generative(rows_of([CONVERSATION]), tok, max_len=4096)


def test_markers_only_where_needed(tmp_path):
    folder = tokenizer_folder(tmp_path, "qwen")
    raw = AutoTokenizer.from_pretrained(folder)
    tok = load_tokenizer(ModelConfig(tokenizer=str(folder)), markers=None)
    assert len(tok) == len(raw) and tok.convert_tokens_to_ids("<|assistant|>") == tok.unk_token_id
    tok = load_tokenizer(ModelConfig(tokenizer=str(folder)), "gritlm", markers=None)  # GritLM layout: markers
    assert len(tok) == len(raw) + 4 and tok.chat_template == chat.GRITLM_TEMPLATE
    assert len(load_tokenizer(ModelConfig(tokenizer=str(folder)))) == len(raw) + 4  # default: as before


def test_chat_template_choices_and_errors(tmp_path):
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(ANSWER)
    assert load_tokenizer(ModelConfig(), str(jinja)).chat_template == ANSWER
    with pytest.raises(ConfigError, match="tokenizer '.*' has no chat template") as e:
        load_tokenizer(ModelConfig(), "tokenizer")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^config key 'data.chat_template': no such Jinja file '.*nope.jinja'"):
        load_tokenizer(ModelConfig(), str(tmp_path / "nope.jinja"))
    from harness.config import load_config
    from harness.data.checks import check_data

    with pytest.raises(ConfigError, match="no such Jinja file"):
        check_data(load_config("configs/default.yaml", [f"data.chat_template={tmp_path / 'nope.jinja'}"]).data)


def test_the_template_is_part_of_the_tokenize_cache_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    rows = data_lib.load_generative_rows([str(f)], cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(ModelConfig())
    a, _ = data_lib.tokenize_dataset(rows, tok, 4096)
    tok.chat_template = ANSWER
    b, _ = data_lib.tokenize_dataset(rows, tok, 4096)
    assert a[0]["input_ids"] != b[0]["input_ids"]
    assert tok.decode(b[0]["input_ids"]).startswith("<s>[SYSTEM] You are terse.")


def test_final_folder_carries_the_template(tmp_path):
    """What the checkpoints and the export do (tokenizer.save_pretrained) keeps the resolved template; both layouts reload."""
    for tok in (load_tokenizer(ModelConfig()),
                load_tokenizer(ModelConfig(tokenizer=str(tokenizer_folder(tmp_path, "qwen"))), markers=None)):
        out = tmp_path / "final"
        tok.save_pretrained(out)
        again = AutoTokenizer.from_pretrained(out)
        assert again.chat_template == tok.chat_template
        assert again.apply_chat_template(CONVERSATION, tokenize=False) == tok.apply_chat_template(CONVERSATION,
                                                                                                tokenize=False)


@pytest.mark.slow
def test_runs_save_their_template_in_final(tmp_path):
    """A ChatML tokenizer folder trains with its own template (no GritLM markers added) and final/ renders ChatML;
    a default run's final/ carries the GritLM template, which reproduces what was trained."""
    from harness_launch import FAST, run_train

    folder = tokenizer_folder(tmp_path, "qwen")
    for name, extra in (("chatml", [f"model.tokenizer={folder}"]), ("gritlm", [])):
        out = tmp_path / name
        run_train([f"train.output_dir={out}", "train.max_steps=2", "train.micro_batch_size=4", *FAST, *extra])
        final = AutoTokenizer.from_pretrained(out / "final")
        text = final.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
        if name == "chatml":
            assert len(final) == len(AutoTokenizer.from_pretrained(folder))  # no markers added
            assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                            "<|im_start|>assistant\n")
        else:
            assert final.chat_template == chat.GRITLM_TEMPLATE
            assert text == "<s><|system|>\nYou are terse.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n"
            trained = data_lib.tokenize_generative(rows_of([CONVERSATION]), load_tokenizer(ModelConfig()), 4096)
            assert trained["input_ids"][0] == _template_ids(final, CONVERSATION)


def test_labels_hold_with_trimmed_offsets_and_straddling_tokens(tmp_path):
    """A token that straddles the start of an answer (" Sure" after "assistant:" + space) is trained; a ByteLevel
    post-processor with trim_offsets (" word" reported as starting at "w") labels the same tokens."""
    from tokenizers import processors

    tok = load_tokenizer(ModelConfig())
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    conv = [{"role": "user", "content": "Hi  there"}, {"role": "assistant", "content": "Sure,  then more. "},
            {"role": "user", "content": "ok"}]
    out = data_lib.tokenize_generative(rows_of([conv]), tok, max_len=4096)
    assert trained_runs(tok, out["input_ids"][0], out["labels"][0]) == [" Sure,  then more. \n"]
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    assert data_lib.tokenize_generative(rows_of([conv]), tok, max_len=4096) == out


@pytest.mark.parametrize("result", ['{"temp_c": 18}', "18 C,\nsunny", 'said "sunny"'])
def test_tool_results_that_a_template_renders_with_tojson_are_not_refused(tmp_path, result):
    """Llama-3.1-Instruct renders a tool result with `| tojson`: a JSON result, one with a newline or quotes is
    rendered escaped, and is there all the same."""
    tok = load_tokenizer(ModelConfig(tokenizer=str(tokenizer_folder(tmp_path, "llama"))), markers=None)
    conv = [*TOOL_CONVERSATION[:2], {**TOOL_CONVERSATION[2], "content": result}, TOOL_CONVERSATION[3]]
    out = data_lib.tokenize_generative(rows_of([conv], [json.dumps(TOOLS)]), tok, max_len=4096)
    assert out["input_ids"][0] == _template_ids(tok, conv, tools=TOOLS)

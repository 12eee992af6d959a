"""Chat templates: which one a run uses (data.chat_template), and conversations tokenized exactly as
`tokenizer.apply_chat_template` renders them, with labels on the assistant turns only.

    auto       the tokenizer's own template when it has one, else the GritLM layout
    tokenizer  the tokenizer's own template (an error if it has none)
    gritlm     GRITLM_TEMPLATE: <s><|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{assistant}</s>...
    PATH       a Jinja file

The resolved template is set on the tokenizer, so that every `save_pretrained` (checkpoints, final/) carries it and
inference formats prompts as training did.

What is trained (as LLaMA-Factory and axolotl do): the conversation is rendered once; for assistant message i,
P_i = render(messages[:i], add_generation_prompt=True) and S_i = render(messages[:i+1]) must both be prefixes of
the full text, and the characters [len(P_i), len(S_i)) are trained: the assistant content and whatever the template
puts after it up to the next message (its end-of-turn token: </s>, <|im_end|>, <|eot_id|>; for ChatML also the "\\n"
after <|im_end|>, which is harmless: generation stops at <|im_end|>). The full text is tokenized once
(add_special_tokens=False, as apply_chat_template does) and a token is trained when it holds a character of a
trained span (token offsets).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import IGNORE_INDEX
from harness.errors import ConfigError, DataError

# the GritLM layout's markers, added to a tokenizer that lacks them as special tokens (harness.model.load_tokenizer)
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|embed|>"]
GRITLM_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('the GritLM chat layout has no ' + message['role'] + ' role') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHOICES = ("auto", "tokenizer", "gritlm")


def own_template(tokenizer) -> str | None:
    """The tokenizer's own chat template (the default one when it has several), or None."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    return own or None


def check_choice(choice: str) -> None:
    """A data.chat_template value that names no file: a one-line ConfigError (config validation)."""
    if choice not in CHOICES and not Path(choice).is_file():
        raise ConfigError(f"config key 'data.chat_template': no such Jinja file '{choice}' (or use one of "
                          f"{', '.join(CHOICES)})")


def resolve_template(tokenizer, choice: str = "auto", name: str = "the tokenizer") -> str:
    """The template `choice` selects for `tokenizer` (`name` says which tokenizer in errors)."""
    own = own_template(tokenizer)
    if choice == "auto":
        return own or GRITLM_TEMPLATE
    if choice == "tokenizer":
        if own is None:
            raise ConfigError(f"config key 'data.chat_template': tokenizer '{name}' has no chat template; use "
                              f"data.chat_template=gritlm, auto or a Jinja file")
        return own
    if choice == "gritlm":
        return GRITLM_TEMPLATE
    check_choice(choice)
    return Path(choice).read_text(encoding="utf-8")


def uses_markers(template: str) -> bool:
    """Whether a template writes the GritLM markers (then they must be single special tokens)."""
    return template == GRITLM_TEMPLATE or "<|assistant|>" in template


# ----------------------------------------------------------------------------------------------- conversations


def _extra(seg: dict) -> dict:
    extra = seg.get("extra") or ""
    return json.loads(extra) if extra else {}


def conversation(segments: list[dict]) -> list[dict]:
    """Canonical segments -> the message dicts a template reads ({role, content, **extra})."""
    return [{"role": s["role"], "content": s["content"], **_extra(s)} for s in segments]


def _render(tokenizer, template: str, messages: list[dict], tools, origin: str, **kw) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, **kw)
    except Exception as e:  # noqa: BLE001 - jinja errors and raise_exception(): one line naming the record
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{origin}: the chat template cannot render this conversation: {msg}") from None


def _rendered(result, full: str) -> bool:
    """Whether a tool result is in the rendered conversation: as its text, or as the JSON string a template's
    `| tojson` makes of it (Llama-3.1-Instruct: quotes and newlines escaped)."""
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return any(form in full for form in (text, json.dumps(text, ensure_ascii=False), json.dumps(text)))


def _check_tools(messages: list[dict], tools, full: str, template: str, origin: str) -> None:
    """A conversation with tool calls or tool messages whose template drops them: a one-line DataError."""
    names = [(c.get("function") or c).get("name", "") for m in messages for c in (m.get("tool_calls") or [])]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    uses_tools = bool(names or results or tools)
    dropped = any(n not in full for n in names) or any(not _rendered(r, full) for r in results)
    if uses_tools and (template == GRITLM_TEMPLATE or dropped):
        which = "the GritLM layout" if template == GRITLM_TEMPLATE else "the chat template"
        raise DataError(f"{origin}: {which} has no tool support (tool calls or tool messages would be lost); use "
                        f"data.chat_template=tokenizer or a Jinja file with tool support")


def trained_spans(tokenizer, template: str, segments: list[dict], tools_json: str, origin: str):
    """(full text, [(start, end)] character spans of the assistant turns) for one conversation."""
    return message_spans(tokenizer, template, conversation(segments), json.loads(tools_json) if tools_json else None,
                         origin)


def message_spans(tokenizer, template: str, messages: list[dict], tools, origin: str):
    """(full text, assistant spans) of message dicts as a template reads them (their content a string, or a list of
    parts such as {"type": "image"} / {"type": "text", "text"} for a vision-language template)."""
    if template == GRITLM_TEMPLATE:  # before rendering: its raise_exception() on a tool role says less
        _check_tools(messages, tools, "", template, origin)
    full = _render(tokenizer, template, messages, tools, origin)
    _check_tools(messages, tools, full, template, origin)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, template, messages[:i], tools, origin, add_generation_prompt=True)
        upto = _render(tokenizer, template, messages[:i + 1], tools, origin)
        if not (full.startswith(head) and full.startswith(upto) and len(head) <= len(upto)):
            raise DataError(f"{origin}: the chat template renders earlier turns differently once later ones follow "
                            f"(e.g. it drops reasoning from earlier turns), so assistant turn {i} has no stable span "
                            f"to train")
        spans.append((len(head), len(upto)))
    return full, spans


def span_labels(offsets: list, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Labels: a token's id where it holds a character of a trained span (a token that straddles the start of a
    span, e.g. " Sure" after a prompt ending in a space, is trained: it carries content). A token starts at its
    offset or, where the tokenizer trims whitespace off offsets (ByteLevel trim_offsets), where the previous ended."""
    out, k, prev_end = [], 0, 0
    for (start, end), tid in zip(offsets, ids):
        start, prev_end = min(start, prev_end) if out else start, end
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        out.append(tid if k < len(spans) and spans[k][0] < max(end, start + 1) else IGNORE_INDEX)
    return out


def tokenize_conversations(batch: dict, tokenizer, max_len: int, template: str) -> dict:
    """Batched `map` function: canonical rows -> input_ids (exactly apply_chat_template's), labels on the
    assistant turns (IGNORE_INDEX elsewhere), length and truncated. A single `text` segment is plain text:
    bos + text + eos, all trained, no template."""
    n = len(batch["segments"])
    tools = batch.get("tools") or [""] * n
    origins = batch.get("origin") or [f"row {i}" for i in range(n)]
    texts, spans = [], []
    for segments, tools_json, origin in zip(batch["segments"], tools, origins):
        if len(segments) == 1 and segments[0]["role"] == "text":
            texts.append(segments[0]["content"])
            spans.append(None)
            continue
        full, sp = trained_spans(tokenizer, template, segments, tools_json or "", origin)
        texts.append(full)
        spans.append(sp)
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": []}
    for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans):
        if sp is None:  # plain text: loss on every token
            head = [bos] if bos is not None else []
            ids, labels = head + ids + [eos], [IGNORE_INDEX] * len(head) + ids + [eos]
        else:
            labels = span_labels(offsets, ids, sp)
        out["truncated"].append(len(ids) > max_len)
        out["input_ids"].append(ids[:max_len])
        out["labels"].append(labels[:max_len])
        out["length"].append(min(len(ids), max_len))
    return out

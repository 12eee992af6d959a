"""Record layouts: one record of a known format -> the canonical row the tokenizer reads.

Formats (detected per file from the first record's columns after `columns` renames them, or set with `format`):
    text       {"text": str}                                      one segment of role "text" (every token trained)
    messages   {"messages": [{"role", "content", "tool_calls"?, "name"?, "tool_call_id"?}], "tools"?: [...]}
    sharegpt   {"conversations": [{"from": human|gpt|system|function_call|observation|tool, "value"}],
                "system"?: str, "tools"?: str | list}
    alpaca     {"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant], ...]}
    gritlm     {"text": [user, assistant, user, assistant, ...]}  (GritLM's generative layout)
    embedding  {"query": str | [instruction, str], "pos": [...], "neg": [...]}
    preference {"prompt"?, "chosen", "rejected"} (TRL's layouts, text or messages: harness.data.pairs)

Canonical generative row: {"segments": [{"role", "content", "extra"}], "tools", "origin"} with role one of
system/user/assistant/tool/text, `extra` "" or a JSON object string of the message's other keys (tool_calls, name,
tool_call_id, ...) and `tools` "" or the JSON array string of the tool definitions. Every problem is a DataError
naming `origin: field '...'`.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from harness.errors import DataError
from harness.files import json_beyond_limits

GENERATIVE = ("text", "messages", "sharegpt", "alpaca", "gritlm")
FORMATS = GENERATIVE + ("embedding", "preference")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function_call": "assistant"}


def kind_of(fmt: str) -> str:
    return fmt if fmt in ("embedding", "preference") else "generative"


def detect_format(obj: dict) -> Optional[str]:
    """The format a record's columns suggest, or None."""
    if "chosen" in obj and "rejected" in obj:
        return "preference"
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "query" in obj and "pos" in obj:
        return "embedding"
    if "text" in obj:
        return "gritlm" if isinstance(obj["text"], list) else "text"
    return None


def apply_columns(obj: dict, columns: dict, where: str) -> dict:
    """Rename the source's columns to the format's field names ({field: column})."""
    if not columns:
        return obj
    out = dict(obj)
    for field, column in columns.items():
        if column not in obj:
            raise DataError(f"{where}: column '{column}' (columns: {field}: {column}) not found "
                            f"(keys: {', '.join(obj) or 'none'})")
        out[field] = out.pop(column)
    return out


# ----------------------------------------------------------------------------------------------- fields


def string(value: Any, where: str, field: str) -> str:
    """A non-empty, valid Unicode string."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # json.loads accepts a lone "\ud800" escape; no tokenizer or file can hold it
        raise DataError(f"{where}: field '{field}' has an unpaired surrogate {ascii(value[e.start])[1:-1]} at "
                        f"character {e.start + 1} (not valid Unicode)") from None
    return value


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _segment(role: str, content: str, extra: Optional[dict] = None) -> dict:
    return {"role": role, "content": content, "extra": _json(extra) if extra else ""}


def _tools(value: Any, where: str, field: str = "tools") -> str:
    """Tool definitions (a list, or a JSON string of one) -> "" or a JSON array string."""
    if value is None or value == "" or value == []:
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field '{field}' is not valid JSON ({e.msg}, column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{where}: field '{field}': {json_beyond_limits(e)}") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: field '{field}' must be a list of tool definitions (objects)")
    return _json(value)


def _tool_call(call: Any, where: str, field: str) -> dict:
    """An OpenAI tool call ({type, function: {name, arguments}}, or a bare {name, arguments}) with a JSON-string
    `arguments` that holds an object parsed into that object (chat templates expect a dict)."""
    if not isinstance(call, dict):
        raise DataError(f"{where}: field '{field}' must be an object")
    call = dict(call) if "function" in call else {"type": "function", "function": call}
    fn = call["function"]
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{where}: field '{field}.function.name' must be a non-empty string")
    fn = {k: v for k, v in fn.items() if v is not None}
    if isinstance(fn.get("arguments"), str):
        try:
            parsed = json.loads(fn["arguments"])
        except (ValueError, RecursionError):  # kept as the string it is
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    call["function"] = fn
    return {k: v for k, v in call.items() if v is not None}


def _need_assistant(segments: list[dict], where: str, field: str) -> list[dict]:
    if not any(s["role"] == "assistant" for s in segments):
        raise DataError(f"{where}: field '{field}' has no assistant turn (nothing to train on)")
    return segments


# ----------------------------------------------------------------------------------------------- formats


def message_segments(msgs: Any, where: str) -> list[dict]:
    """OpenAI chat messages -> segments; tool_calls normalised, other keys kept in `extra`."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    segments = []
    for i, m in enumerate(msgs):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: field '{f}' must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: field '{f}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        extra = {k: v for k, v in m.items() if k not in ("role", "content") and v is not None}
        if "tool_calls" in extra:
            calls = extra["tool_calls"]
            if role != "assistant" or not isinstance(calls, list):
                raise DataError(f"{where}: field '{f}.tool_calls' must be a list, on an assistant message")
            extra["tool_calls"] = [_tool_call(c, where, f"{f}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if extra.get("tool_calls") and m.get("content") in (None, ""):
            content = ""
        elif "content" not in m:
            raise DataError(f"{where}: missing field '{f}.content'")
        else:
            content = string(m["content"], where, f"{f}.content")
        segments.append(_segment(role, content, extra))
    return _need_assistant(segments, where, "messages")


def text_or_messages(obj: dict, where: str) -> tuple[list[dict], str]:
    """`text` and `messages` records (a file may mix them): (segments, tools)."""
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text and has_messages:
        raise DataError(f"{where}: record has both 'text' and 'messages'; give one")
    if has_text:
        return [_segment("text", string(obj["text"], where, "text"))], ""
    if not has_messages:
        raise DataError(f"{where}: missing field 'text' or 'messages' (keys: {', '.join(obj) or 'none'})")
    return message_segments(obj["messages"], where), _tools(obj.get("tools"), where)


def sharegpt_segments(obj: dict, where: str) -> tuple[list[dict], str]:
    """ShareGPT (LLaMA-Factory's tags): human->user, gpt->assistant, observation/tool->tool, function_call -> an
    assistant message whose tool_calls are the value's JSON ({name, arguments} or a list of them)."""
    conv = obj.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list")
    segments = []
    if obj.get("system") is not None:
        segments.append(_segment("system", string(obj["system"], where, "system")))
    for i, turn in enumerate(conv):
        f = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: field '{f}' must be an object with from and value")
        tag = turn.get("from")
        if tag not in SHAREGPT_ROLES:
            raise DataError(f"{where}: field '{f}.from' must be one of {', '.join(SHAREGPT_ROLES)}, got {tag!r}")
        value = string(turn.get("value"), where, f"{f}.value")
        if tag != "function_call":
            segments.append(_segment(SHAREGPT_ROLES[tag], value))
            continue
        try:
            calls = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field '{f}.value' (from=function_call) is not valid JSON ({e.msg})") from None
        calls = calls if isinstance(calls, list) else [calls]
        extra = {"tool_calls": [_tool_call(c, where, f"{f}.value") for c in calls]}
        segments.append(_segment("assistant", "", extra))
    return _need_assistant(segments, where, "conversations"), _tools(obj.get("tools"), where)


def alpaca_segments(obj: dict, where: str) -> tuple[list[dict], str]:
    """Alpaca: [system], history pairs, instruction (+ "\\n\\n" + input) as the user turn, output as the answer."""
    segments = []
    if obj.get("system") not in (None, ""):
        segments.append(_segment("system", string(obj["system"], where, "system")))
    history = obj.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"{where}: field 'history' must be a list of [user, assistant] pairs")
    for i, pair in enumerate(history):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DataError(f"{where}: field 'history[{i}]' must be a [user, assistant] pair")
        segments += [_segment("user", string(pair[0], where, f"history[{i}][0]")),
                     _segment("assistant", string(pair[1], where, f"history[{i}][1]"))]
    if "instruction" not in obj or "output" not in obj:
        missing = "instruction" if "instruction" not in obj else "output"
        raise DataError(f"{where}: missing field '{missing}' (keys: {', '.join(obj) or 'none'})")
    prompt = string(obj["instruction"], where, "instruction")
    if obj.get("input") not in (None, ""):
        prompt += "\n\n" + string(obj["input"], where, "input")
    segments += [_segment("user", prompt), _segment("assistant", string(obj["output"], where, "output"))]
    return segments, ""


def gritlm_segments(obj: dict, where: str) -> tuple[list[dict], str]:
    """GritLM: {"text": [user, assistant, ...]} alternating, starting with the user (no system element)."""
    turns = obj.get("text")
    if not isinstance(turns, list) or len(turns) < 2 or len(turns) % 2:
        raise DataError(f"{where}: field 'text' must be a list of [user, assistant, ...] pairs (an even number of "
                        f"strings), got {json.dumps(turns)[:60]}")
    return [_segment("user" if i % 2 == 0 else "assistant", string(t, where, f"text[{i}]"))
            for i, t in enumerate(turns)], ""


CONVERTERS = {"text": text_or_messages, "messages": text_or_messages, "sharegpt": sharegpt_segments,
              "alpaca": alpaca_segments, "gritlm": gritlm_segments}


def generative_row(obj: dict, fmt: Optional[str], where: str) -> dict:
    """A record of format `fmt` (None: text/messages) -> {segments, tools, origin}."""
    segments, tools = CONVERTERS.get(fmt or "text")(obj, where)
    return {"segments": segments, "tools": tools, "origin": where}


# ----------------------------------------------------------------------------------------------- embedding
#
# Records: {"query": str | [instruction, str], "pos": [str | [instruction, str], ...], "neg": [...]}


def _embed_text(value: Any, where: str, field: str) -> dict:
    if isinstance(value, str):
        return {"instruction": "", "text": string(value, where, field)}
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return {"instruction": value[0], "text": string(value[1], where, f"{field}[1]")}
    raise DataError(f"{where}: field '{field}' must be a string or [instruction, text], got {json.dumps(value)[:60]}")


def embedding_record(obj: dict, where: str, need_negatives: int) -> dict:
    """Validate one embedding record; `need_negatives` > 0 requires at least one hard negative."""
    for key in ("query", "pos"):
        if key not in obj:
            raise DataError(f"{where}: missing field '{key}' (keys: {', '.join(obj) or 'none'})")
    pos, neg = obj["pos"], obj.get("neg", [])
    neg = [] if neg is None else neg
    for key, val in (("pos", pos), ("neg", neg)):
        if not isinstance(val, list):
            raise DataError(f"{where}: field '{key}' must be a list")
    if not pos:
        raise DataError(f"{where}: field 'pos' is empty (each query needs a positive)")
    if need_negatives and not neg:
        raise DataError(f"{where}: field 'neg' is empty but data.train_group_size={need_negatives + 1} needs "
                        f"hard negatives")
    return {
        "query": _embed_text(obj["query"], where, "query"),
        "pos": [_embed_text(v, where, f"pos[{i}]") for i, v in enumerate(pos)],
        "neg": [_embed_text(v, where, f"neg[{i}]") for i, v in enumerate(neg)],
        "origin": where,
    }


# ----------------------------------------------------------------------------------------------- preference pairs
#
# TRL's preference layouts (harness.data.pairs tokenizes them).


def _side(obj: dict, field: str, where: str) -> tuple[list[dict], bool]:
    """(segments, conversational) of a chosen / rejected / prompt value."""
    if field not in obj or obj[field] is None:
        raise DataError(f"{where}: missing field '{field}' (a preference pair needs chosen and rejected)")
    value = obj[field]
    if isinstance(value, str):
        return [_segment("text", value)], False
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: field '{field}' is an empty list")
        return _messages(value, where, field), True
    raise DataError(f"{where}: field '{field}' must be a string or a list of messages, got {type(value).__name__}")


def _messages(msgs: list, where: str, field: str) -> list[dict]:
    segments = []
    for i, m in enumerate(msgs):
        f = f"{field}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: field '{f}' must be a message with role one of {', '.join(ROLES)}")
        content = "" if m.get("content") is None and m.get("tool_calls") else m.get("content")
        extra = {k: v for k, v in m.items() if k not in ("role", "content") and v is not None}
        segments.append(_segment(m["role"], string(content, where, f"{f}.content"), extra))
    return segments


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def preference_record(obj: dict, where: str) -> dict:
    """One record of TRL's preference formats -> the canonical pair row (errors name `where` and the field)."""
    chosen, conv_c = _side(obj, "chosen", where)
    rejected, conv_r = _side(obj, "rejected", where)
    if conv_c != conv_r:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be text or both be messages")
    if "prompt" in obj and obj["prompt"] is not None:
        prompt, conv_p = _side(obj, "prompt", where)
        if conv_p != conv_c:
            raise DataError(f"{where}: field 'prompt' must be of the same form as 'chosen' (text or messages)")
    elif conv_c:  # implicit prompt: the messages both conversations share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        c, r = chosen[0]["content"], rejected[0]["content"]
        n = _common_prefix(c, r)
        n = c.rfind(" ", 0, n) + 1 if 0 < n < min(len(c), len(r)) and " " in c[:n] else n
        prompt = [{**chosen[0], "content": c[:n]}]
        chosen, rejected = [{**chosen[0], "content": c[n:]}], [{**rejected[0], "content": r[n:]}]
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if not side or all(s["content"] == "" and not s["extra"] for s in side):
            raise DataError(f"{where}: field '{name}': empty completion")
        if conv_c and any(s["role"] != "assistant" for s in side):
            raise DataError(f"{where}: field '{name}': the completion must be assistant messages only")
    if chosen == rejected:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' are equal (no preference to learn)")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "origin": where}

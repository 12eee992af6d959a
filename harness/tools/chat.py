"""`harness chat FOLDER`: talk to a trained model in the terminal.

    harness chat runs/default/final [--max-new-tokens 256] [--temperature 0.7] [--top-p 0.9] [--system "..."]
    printf 'What is 2 + 3?\\nAnd 4 + 4?\\n' | harness chat runs/default/final --temperature 0

FOLDER is an exported model (a run's final/) or any folder/hub id transformers loads; a LoRA adapter folder loads
its merged/ sibling when there is one, else the base it names with the adapter on top. User turns are read from
stdin line by line (prompt "> " only on a terminal); the conversation is kept and formatted with the tokenizer's
chat template. `/reset` clears the conversation, `/exit` or end of input stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.errors import ConfigError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="harness chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="exported model folder, e.g. runs/default/final")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--system", default=None, help="system message at the start of the conversation")
    return p.parse_args(argv)


def load_tokenizer(folder: str):
    """The folder's tokenizer; a ConfigError (one line, exit 2) when it has none or no chat template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {folder}: {(str(e).splitlines() or [''])[0]}") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json or "
                          f"chat_template.jinja); set tokenizer.chat_template and save it there")
    return tok


def load_model(folder: str, device: str):
    """The model in eval mode: a plain folder, or a LoRA adapter (its merged/ sibling, else base + adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    path = Path(folder)
    adapter = path / "adapter_config.json"
    try:
        if adapter.is_file() and (path / "merged").is_dir():
            model = AutoModelForCausalLM.from_pretrained(path / "merged", dtype=dtype)
        elif adapter.is_file():
            from peft import PeftModel

            from harness.checkpoint.export import adapter_base  # lazy: start-up time (torch)

            base = AutoModelForCausalLM.from_pretrained(adapter_base(path), dtype=dtype)
            model = PeftModel.from_pretrained(base, folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load a model from {folder}: {(str(e).splitlines() or [''])[0]}") from None
    return model.to(device).eval()


def reply(model, tok, messages: list[dict], args: argparse.Namespace) -> str:
    """Generate the assistant's next turn for `messages`."""
    import torch

    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(model.device) for k, v in ids.items()}
    sample = args.temperature > 0
    kwargs = {"do_sample": sample, **({"temperature": args.temperature, "top_p": args.top_p} if sample else {})}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad, **kwargs)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(sys.argv[1:] if argv is None else argv)
    tok = load_tokenizer(args.folder)
    model = load_model(args.folder, "cuda" if torch.cuda.is_available() else "cpu")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, tty = list(start), sys.stdin.isatty()
    while True:
        if tty:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if text == "/reset":
            messages = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        answer = reply(model, tok, messages, args)
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)

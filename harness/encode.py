"""Use a trained model: embed texts (with an instruction) and generate, as training did.

    from harness.encode import GritModel
    m = GritModel.load("runs/gritlm-tiny/final")
    q = m.encode(["Which town has 4 bridges?"], instruction="Retrieve the passage that answers the question.")
    d = m.encode(["The town of Varnel has 4 bridges.", "Dunmore has 3 bridges."])
    print(m.similarity(q, d))                                   # cosine similarities [1, 2]
    print(m.generate("What is 17 + 25?", max_new_tokens=24))

    python -m harness.encode runs/gritlm-tiny/final "query text" "passage one" "passage two"

The embedding settings (pooling, attention, templates, max lengths) come from final/harness.json, written at export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from harness.data.samples import EmbedFormat, pad_embed, tokenize_embed_texts
from harness.model import embed

DEFAULTS = {"pooling": "mean", "embed_attention": "bidirectional", "instruction_template": EmbedFormat.instruction_template,
            "plain_template": EmbedFormat.plain_template, "query_max_len": 512, "passage_max_len": 512,
            "append_eos": False}


def embedding_settings(loss_mode: str, m, d, instructions: list[str] | None = None) -> dict:
    """What `GritModel` needs to embed like training did (from the run's loss.mode, model section `m` and data
    section `d`), saved as final/harness.json at export;
    `instructions`: the embedding training data's most frequent ones (data.sources.embedding_instructions), which the
    sentence-transformers export names as prompts."""
    return {
        "loss_mode": loss_mode,
        "pooling": m.pooling,
        "embed_attention": m.embed_attention,
        "instruction_template": d.emb_instruction_template,
        "plain_template": d.emb_plain_template,
        "query_max_len": d.query_max_len,
        "passage_max_len": d.passage_max_len,
        "append_eos": m.pooling == "lasttoken",
        "instructions": list(instructions or []),
    }


class GritModel:
    def __init__(self, model, tokenizer, settings: dict | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.settings = {**DEFAULTS, **(settings or {})}
        s = self.settings
        self.fmt = EmbedFormat(s["instruction_template"], s["plain_template"], s["append_eos"])

    @classmethod
    def load(cls, path: str | Path, device: str | None = None, dtype: torch.dtype | None = None) -> "GritModel":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        settings_file = path / "harness.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), settings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, texts: list[str], instruction: str = "", batch_size: int = 32,
               max_len: int | None = None) -> torch.Tensor:
        """L2-normalised fp32 embeddings [len(texts), hidden]; instruction tokens are not pooled."""
        max_len = max_len or self.settings["query_max_len" if instruction else "passage_max_len"]
        items = [{"instruction": instruction, "text": t} for t in texts]
        ids, instr, _ = tokenize_embed_texts(items, self.tokenizer, max_len, self.fmt)
        bidirectional = self.settings["embed_attention"] == "bidirectional"
        out = []
        for i in range(0, len(ids), batch_size):
            batch = {k: v.to(self.device) for k, v in pad_embed(list(zip(ids[i:i + batch_size], instr[i:i + batch_size])),
                                                                  self.tokenizer.pad_token_id).items()}
            out.append(embed(self.model, batch, self.settings["pooling"], bidirectional).cpu())
        return torch.cat(out)

    @staticmethod
    def similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.float() @ b.float().T

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int = 64, **kwargs) -> str:
        """Answer a user turn in the chat format training used: the chat template saved with the tokenizer (the
        one data.chat_template chose), as `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`
        gives it to gritlm's GritLM.generate or plain transformers. Greedy unless sampling kwargs are given."""
        tok = self.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True).to(self.device)
        gen = self.model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=kwargs.pop("do_sample", False),
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kwargs)
        return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    m = GritModel.load(sys.argv[1])
    q = m.encode([sys.argv[2]])
    d = m.encode(sys.argv[3:])
    for text, score in zip(sys.argv[3:], m.similarity(q, d)[0].tolist()):
        print(f"{score:+.4f}  {text}")

"""harness.encode.GritModel against the GritLM package itself (gritlm 1.0.2, a dev dependency): a final/ folder
embeds the same through gritlm's `GritLM(path, mode="unified", pooling_method="mean", attn="bbcc")` as through
GritModel, queries with an instruction and passages without, with the bundled tokenizer and with a SentencePiece-style
one that adds BOS and a prefix space; and generates the same through both, in the chat format training used.

    python -m pytest tests/test_encode.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.data.chat import tokenize_conversations
from harness.config import ModelConfig, load_config
from harness.encode import GritModel, embedding_settings
from harness.model import build_model, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256}
INSTRUCTION = "Given a question, retrieve the sentence that answers it."
QUERIES = ["What is 7 plus 21?", "Which town has four bridges?", "How many legs does a spider have?", "Why?"]
PASSAGES = ["7 plus 21 is equal to 28.", "The town of Varnel has four bridges over the slow green river.",
            "Spiders have eight legs.", "Because it rained all week and the river rose."]


def gritlm_instruction(instruction: str) -> str:
    """GritLM's README: the text before a query (with an instruction) or a passage (without)."""
    return "<|user|>\n" + instruction + "\n<|embed|>\n" if instruction else "<|embed|>\n"


def export(tokenizer_source: str | None, dest: Path, chat_template: str = "auto") -> Path:
    """What a gritlm-tiny run writes to final/: the model and tokenizer (its chat template included) in Hugging Face
    format, and harness.json; a random 2-layer model."""
    cfg = load_config(str(ROOT / "configs" / "gritlm-tiny.yaml"), [f"model.tokenizer={tokenizer_source or 'bundled'}"])
    tok = load_tokenizer(ModelConfig(tokenizer=tokenizer_source or "bundled"), chat_template)
    torch.manual_seed(0)
    build_model(ModelConfig(config=TINY), tok).save_pretrained(dest)
    tok.save_pretrained(dest)
    (dest / "harness.json").write_text(json.dumps(embedding_settings(cfg.loss.mode, cfg.model, cfg.data)))
    return dest


@pytest.fixture(scope="module", params=["bundled", "llama_style"])
def final(request, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    source = str(request.getfixturevalue("llama_style_tokenizer_dir")) if request.param == "llama_style" else None
    dest = export(source, tmp_path_factory.mktemp(f"final-{request.param}"))
    reloaded = AutoTokenizer.from_pretrained(dest)
    tokens = reloaded.convert_ids_to_tokens(reloaded("What")["input_ids"])
    assert tokens == (["<s>", "▁What"] if source else ["What"])  # the one that adds BOS and a prefix space
    return dest


@pytest.fixture(scope="module")
def both(final):
    from gritlm import GritLM

    theirs = GritLM(str(final), mode="unified", pooling_method="mean", attn="bbcc", device="cpu",
                    torch_dtype=torch.float32)
    return GritModel.load(final, device="cpu"), theirs


def test_gritlm_embeds_a_final_folder_as_grit_model_does(both):
    ours, theirs = both
    q = ours.encode(QUERIES, instruction=INSTRUCTION)
    d = ours.encode(PASSAGES)
    q_ref = torch.from_numpy(theirs.encode(QUERIES, instruction=gritlm_instruction(INSTRUCTION)))
    d_ref = torch.from_numpy(theirs.encode(PASSAGES, instruction=gritlm_instruction("")))
    assert (q - q_ref).abs().max() <= 1e-5 and (d - d_ref).abs().max() <= 1e-5
    assert (q - d).abs().max() > 1e-2  # the comparison can tell texts apart


def test_gritlm_generates_from_a_final_folder_in_the_training_chat_format(both):
    ours, theirs = both
    prompt = "What is 17 + 25?"
    enc = theirs.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    # the prompt is what training put before an answer (harness.chat renders the conversation with the same template)
    row = {"segments": [[{"role": "user", "content": prompt, "extra": ""},
                         {"role": "assistant", "content": "42", "extra": ""}]], "tools": [""], "origin": ["t:1"]}
    trained = tokenize_conversations(row, ours.tokenizer, 256, ours.tokenizer.chat_template)
    n = enc["input_ids"].shape[1]
    assert trained["input_ids"][0][:n] == enc["input_ids"][0].tolist()
    assert set(trained["labels"][0][:n]) == {-100} and trained["labels"][0][n] != -100
    out = theirs.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=theirs.tokenizer.pad_token_id)
    assert ours.generate(prompt, max_new_tokens=6) == theirs.tokenizer.decode(out[0, n:], skip_special_tokens=True)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_grit_model_prompts_with_the_chat_template_training_used(tmp_path):
    """A run whose data.chat_template is not the GritLM layout (here ChatML): GritModel.generate prompts with it."""
    (tmp_path / "chatml.jinja").write_text(CHATML)
    m = GritModel.load(export(None, tmp_path / "final", str(tmp_path / "chatml.jinja")), device="cpu")
    seen = []
    generate = m.model.generate
    m.model.generate = lambda **kw: seen.append(kw["input_ids"][0].tolist()) or generate(**kw)
    m.generate("What is 17 + 25?", max_new_tokens=1)
    expected = m.tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}],
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
    assert seen == [list(expected)] and m.tokenizer.decode(seen[0]).startswith("<|im_start|>user")


@pytest.mark.parametrize("pooling", ["weightedmean", "lasttoken"])
def test_gritlm_pools_as_grit_model_does(pooling, tmp_path):
    """The other poolings: gritlm's pooling_method of the same name (lasttoken: embed_eos = the tokenizer's eos,
    which harness appends)."""
    from gritlm import GritLM

    final = export(None, tmp_path / "final")
    settings = json.loads((final / "harness.json").read_text())
    (final / "harness.json").write_text(json.dumps({**settings, "pooling": pooling,
                                                    "append_eos": pooling == "lasttoken"}))
    ours = GritModel.load(final, device="cpu")
    eos = {"embed_eos": ours.tokenizer.eos_token} if pooling == "lasttoken" else {}
    theirs = GritLM(str(final), mode="unified", pooling_method=pooling, attn="bbcc", device="cpu",
                    torch_dtype=torch.float32, **eos)
    q_ref = torch.from_numpy(theirs.encode(QUERIES, instruction=gritlm_instruction(INSTRUCTION)))
    d_ref = torch.from_numpy(theirs.encode(PASSAGES, instruction=gritlm_instruction("")))
    assert (ours.encode(QUERIES, instruction=INSTRUCTION) - q_ref).abs().max() <= 1e-5
    assert (ours.encode(PASSAGES) - d_ref).abs().max() <= 1e-5

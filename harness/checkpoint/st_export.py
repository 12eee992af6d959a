"""final/ as a sentence-transformers model too: the files that make `SentenceTransformer(final)` embed as
`GritModel.encode` does (harness/encode.py), written at export next to the transformers files.

    modules.json                       Transformer (this folder) -> Pooling (1_Pooling/) -> Normalize (2_Normalize/)
    sentence_bert_config.json          max_seq_length; config_kwargs {"is_causal": false} with bidirectional attention
    1_Pooling/config.json              the run's pooling, include_prompt false (the instruction tokens are not pooled)
    config_sentence_transformers.json  prompts: the plain embed template as the default prompt, each training
                                       instruction by name; cosine similarity

The attention the run embedded with: config.json says `"is_causal": true` (what it is without the key: generation with
plain transformers is unchanged), and sentence_bert_config.json's config_kwargs turn it off for the encoder only
(transformers keeps a from_pretrained config kwarg only when the config already has the attribute).

The instructions of the embedding training data (the most frequent, at most data.sources.MAX_NAMED_PROMPTS = 64:
harness.json "instructions") are named prompts, each named by the instruction itself:
    SentenceTransformer(final).encode(texts, prompt_name="Given a question, retrieve the sentence that answers it.")
Any other instruction is passed as the prompt, formatted with the run's instruction template (harness.json):
    SentenceTransformer(final).encode(texts, prompt="<|user|>\\n{instruction}\\n<|embed|>\\n".format(instruction=...))

With LoRA, final/ is the adapter: the files go to final/merged/, the sentence-transformers model. Only mean pooling is
written (the default and GritLM's): sentence-transformers' weighted mean counts positions from the start of the prompt,
and its last-token pooling does not append the eos training did, so neither would give GritModel's embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def _dump(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def st_folder(final: Path) -> Path:
    """The folder of final/ that is the sentence-transformers model: final/merged/ for a LoRA adapter."""
    final = Path(final)
    return final / "merged" if (final / "adapter_config.json").is_file() else final


def write_sentence_transformers(final: Path, settings: Optional[dict]) -> Optional[Path]:
    """Write the sentence-transformers files into final/ (or final/merged/ for LoRA) for an embedding or unified run
    with mean pooling; returns the folder written, or None (a generative run, another pooling)."""
    if not settings or settings.get("loss_mode") not in ("embedding", "unified") or settings.get("pooling") != "mean":
        return None
    folder = st_folder(final)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    text = config.get("text_config", config)
    hidden = text.get("hidden_size") or text.get("d_model")
    bidirectional = settings.get("embed_attention", "bidirectional") == "bidirectional"
    if bidirectional:  # explicit, so that config_kwargs may override it for the encoder; causal is the default
        config["is_causal"] = True
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _dump(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    st_config = {"max_seq_length": int(settings.get("passage_max_len", 512)), "do_lower_case": False}
    if bidirectional:
        st_config["config_kwargs"] = {"is_causal": False}
    _dump(folder / "sentence_bert_config.json", st_config)
    pooling = {"embedding_dimension": hidden, "pooling_mode": "mean", "include_prompt": False}
    _dump(folder / "1_Pooling" / "config.json", pooling)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    template = settings.get("instruction_template", "<|user|>\n{instruction}\n<|embed|>\n")
    prompts = {"plain": settings.get("plain_template", "<|embed|>\n")}
    for instruction in settings.get("instructions", []):  # named by the instruction itself ("plain" stays plain)
        prompts.setdefault(instruction, template.format(instruction=instruction))
    _dump(folder / "config_sentence_transformers.json", {
        "model_type": "SentenceTransformer",
        "prompts": prompts,
        "default_prompt_name": "plain",
        "similarity_fn_name": "cosine",
    })
    return folder

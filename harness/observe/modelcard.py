"""A Hugging Face model card for a run's export: <output_dir>/final/README.md.

    from harness.observe.modelcard import write_model_card
    write_model_card("runs/default")                       # from runs/default/config.yaml and report.json

The training run writes it after report.json (main process; a failure is one warning line, never a failed run);
`harness push` writes it again with the hub repository id in the loading examples. The card holds YAML front matter
(library_name, base_model, tags, pipeline_tag), the base model, the data entries, the loss mode and key settings,
the figures of report.json, how to load the model, and the full config.yaml in a collapsed block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional

import yaml

from harness.config.modes import facts
from harness.files import write_text

DATA_KEYS = [("train_files", "train"), ("eval_files", "eval"), ("emb_train_files", "embedding train"),
             ("emb_eval_files", "embedding eval")]


def _hub_id(name: Optional[str]) -> Optional[str]:
    """`name` when it looks like a hub model id (owner/name, not a local folder), else None."""
    if not name or Path(name).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return None
    return name


def _num(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def front_matter(cfg: dict, lora: bool) -> dict:
    """The card's metadata (the hub reads it): library, base model, tags, pipeline."""
    mode = facts(cfg["loss"]["mode"])
    meta = {"library_name": "peft" if lora else "transformers"}
    base = _hub_id(cfg["model"].get("name_or_path"))
    if base:
        meta["base_model"] = base
    extra = (["lora"] if lora else []) + ([kind] if mode.tag_key and (kind := cfg["loss"].get(mode.tag_key)) else [])
    meta["tags"] = ["harness", *extra, *mode.tags]
    meta["pipeline_tag"] = mode.pipeline
    return meta


def figures(report: dict) -> list[tuple[str, str]]:
    """(label, value) rows from report.json: progress, losses, evaluation, speed, hardware."""
    rows = [("Optimizer steps", report.get("steps")), ("Tokens trained", report.get("tokens")),
            ("Final train loss", report.get("final_loss")), ("Final generative loss", report.get("final_loss_gen")),
            ("Final embedding loss", report.get("final_loss_emb"))]
    evals = (report.get("eval") or {}).items()
    rows += [(f"Eval {k.removeprefix('eval_')}", v) for k, v in evals if isinstance(v, (int, float))]
    rows += [("Tokens/s", report.get("tokens_per_s")), ("Training time (s)", report.get("train_time_s")),
             ("Wall time (s)", report.get("wall_time_s")), ("Processes", report.get("world_size")),
             ("Precision", report.get("precision")), ("ZeRO stage", report.get("zero_stage"))]
    hw = report.get("hardware") or {}
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in hw.get("gpus") or [])
    rows.append(("Hardware", gpus or (f"CPU, {hw['cpu_count']} cores" if "cpu_count" in hw else None)))
    return [(label, _num(v)) for label, v in rows if v is not None]


def settings(cfg: dict, report: dict) -> list[str]:
    """The loss mode and the settings that matter most, one bullet each."""
    m, d, loss, o, t = cfg["model"], cfg["data"], cfg["loss"], cfg["optim"], cfg["train"]
    mode = facts(loss["mode"])
    accum, world = report.get("grad_accum", t["grad_accum"]), report.get("world_size", 1)
    out = [f"loss mode: {loss['mode']}",
           f"learning rate {o['lr']:g} ({o['scheduler']}, warmup {o['warmup_steps']} steps or ratio "
           f"{o['warmup_ratio']:g})",
           f"steps {report.get('steps', t['max_steps'])}, {world} process(es), gradient accumulation {accum}"]
    if mode.gen_rows == "sequences":
        out.append(f"generative: micro-batch {report.get('micro_batch_size', t['micro_batch_size'])} (batch "
                   f"{_batch(report.get('micro_batch_size', t['micro_batch_size']), accum, world)}), max_len "
                   f"{d['max_len']}, packing {d['packing']}, loss averaging {loss['gen_averaging']}")
    if mode.gen_rows == "pairs":
        out.append(f"preference: {loss['preference']}, beta {loss['beta']:g}, label smoothing "
                   f"{loss['label_smoothing']:g}, micro-batch {t['micro_batch_size']} pairs, max_len {d['max_len']}")
    if mode.gen_rows == "questions" and "rl" in cfg:
        rl = cfg["rl"]
        out.append(f"rl: {rl['algorithm']}, {rl['questions_per_step']} questions x {rl['num_generations']} answers "
                   f"per generation batch, loss_type {rl['loss_type']}, beta {rl['beta']:g}, task "
                   f"{cfg['rft']['task']}")
    if mode.embeds:
        out.append(f"embedding: {t['emb_micro_batch_size']} queries per micro-batch (batch "
                   f"{_batch(t['emb_micro_batch_size'], accum, world)}), {d['train_group_size']} passages per query, "
                   f"temperature {loss['temperature']:g}, pooling {m['pooling']}, {m['embed_attention']} attention, "
                   f"query/passage max_len {d['query_max_len']}/{d['passage_max_len']}")
    lora = m.get("lora") or {}
    if lora.get("enabled"):
        out.append(f"LoRA r={lora.get('r', 8)}, alpha={lora.get('alpha', 16)}, quantization {m['quantization']}")
    return out


def _batch(micro, accum: int, world: int) -> str:
    return str(micro * accum * world) if isinstance(micro, int) else str(micro)


def usage(repo: str, embeds: bool, lora: bool, base: Optional[str], chat: bool, own_base: bool = False) -> str:
    """How to load the model (transformers / peft), and for embeddings harness's encoder. own_base: a LoRA adapter
    over a random-init base, which only its base/ subfolder holds (loaded from the folder, wherever it was copied)."""
    if lora:
        # (a path, not subfolder=: transformers takes a folder holding adapter_config.json for the adapter itself)
        merged = f"\"{repo}/merged\"" if own_base else f"\"{repo}\", subfolder=\"merged\""
        base_path = f"{repo}/base" if own_base else base or "BASE_MODEL"
        load = (f"from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"base = AutoModelForCausalLM.from_pretrained(\"{base_path}\")\n"
                f"model = PeftModel.from_pretrained(base, \"{repo}\")\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n"
                f"# or the merged model: AutoModelForCausalLM.from_pretrained({merged})\n")
    else:
        load = (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\")\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n")
    if chat:
        load += ("messages = [{\"role\": \"user\", \"content\": \"Hello!\"}]\n"
                 "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\")\n"
                 "print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0, ids.shape[1]:]))\n")
    text = f"```python\n{load}```\n\nOr chat in a terminal: `harness chat {repo}` (a local folder).\n"
    if own_base:
        text += ("\nThe base is the run's random initialisation, kept in `base/` inside this folder: load it by this "
                 "folder's path as above, wherever the folder was copied. peft's one-line `AutoPeftModelForCausalLM` "
                 f"reads adapter_config.json's `base_model_name_or_path` (`{base}`) from the current folder: it loads "
                 "from the folder the run was started in only (docs/run-folder.md).\n")
    if embeds:
        text += ("\nEmbeddings as in training (pooling, attention and templates from harness.json), with harness:\n\n"
                 "```python\nfrom harness.encode import GritModel\n\n"
                 f"m = GritModel.load(\"{repo}{'/merged' if lora else ''}\")  # a local folder\n"
                 "q = m.encode([\"a query\"], instruction=\"Retrieve the passage that answers the question.\")\n"
                 "d = m.encode([\"a passage\", \"another passage\"])\nprint(m.similarity(q, d))\n```\n")
    return text


def render(cfg: dict, report: dict, config_text: str, final: Path, repo: Optional[str] = None) -> str:
    """The card's text."""
    lora = (final / "adapter_config.json").is_file()
    base = cfg["model"].get("name_or_path")
    if lora:
        base = json.loads((final / "adapter_config.json").read_text()).get("base_model_name_or_path") or base
    meta = front_matter(cfg, lora)
    if lora and _hub_id(base):
        meta["base_model"] = base
    mode = cfg["loss"]["mode"]
    chat = bool(_chat_template(final))
    data = [f"- {what}: `{e if isinstance(e, str) else json.dumps(e)}`" for key, what in DATA_KEYS
            for e in cfg["data"].get(key) or []]
    arch = f"a {cfg['model']['config'].get('model_type', '')} model initialised randomly"
    what = (f"a LoRA adapter on {f'`{base}`' if base else arch}" if lora else f"fine-tuned from `{base}`" if base
            else arch)
    parts = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             f"# {Path(cfg['train']['output_dir']).name}", "",
             f"Trained with harness ({mode} loss): {what}.", "",
             "## Base model", "", f"`{base}`" if base else "None (random initialisation from `model.config`).", "",
             "## Data", "", *(data or ["(none listed)"]), "",
             "## Training", "", *[f"- {s}" for s in settings(cfg, report)], "",
             "## Results", "", "| figure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in figures(report)], "",
             "## How to use", "", usage(repo or str(final), facts(mode).embeds, lora, base, chat,
                                       lora and (final / "base").is_dir()),
             "## Full config", "", "<details><summary>config.yaml</summary>", "", "```yaml", config_text.rstrip(),
             "```", "", "</details>", ""]
    return "\n".join(parts)


def _chat_template(final: Path) -> Optional[str]:
    """The chat template saved with the tokenizer (tokenizer_config.json or chat_template.jinja), if any."""
    jinja = final / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        return json.loads((final / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None


def write_model_card(run_dir: str | Path, final_dir: str | Path | None = None, repo: Optional[str] = None) -> Path:
    """Write <final_dir or run_dir/final>/README.md from run_dir's config.yaml and report.json; returns its path."""
    run = Path(run_dir)
    final = Path(final_dir) if final_dir else run / "final"
    config_text = (run / "config.yaml").read_text()
    card = render(yaml.safe_load(config_text), json.loads((run / "report.json").read_text()), config_text, final, repo)
    path = final / "README.md"
    write_text(path, card)  # whole or not at all
    return path


def try_write_model_card(run_dir: str | Path, say: Callable[[str], None] = print, **kw) -> Optional[Path]:
    """write_model_card that never raises: a failure is one warning line."""
    try:
        return write_model_card(run_dir, **kw)
    except Exception as e:  # noqa: BLE001 - the card must never break a run
        first = (str(e).splitlines() or [""])[0]
        say(f"[harness] warning: no model card written ({type(e).__name__}: {first})")
        return None

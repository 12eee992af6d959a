"""The config's checks across keys, which types alone cannot express: ranges, the data lists the loss mode needs,
the model to build, QLoRA's conditions, the rft section. `load_config` runs `validate` on every config it builds; every
failure is one line naming the key, all of them raised together (ConfigErrors). Imports no torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from harness.config.best import early_stopping_config
from harness.config.distill import check_distill
from harness.config.modes import facts
from harness.config.sections import NO_RESUME, Config, lora_config
from harness.errors import ConfigError, problems_of, raise_all


def validate(cfg: Config, given: frozenset = frozenset()) -> None:
    """Checks across keys that types alone cannot express, every one of them: each group's problems are collected
    and raised together (one line each: `errors.raise_all`), so a recipe's mistakes come out in one run. `given`:
    the keys the recipe and the overrides set (a key that the mode does not read is refused, never ignored)."""
    facts(cfg.loss.mode)  # a registered mode (harness/config/modes.py): the other checks read its facts
    problems: list[str] = []
    for check in (check_batch, check_ranges, check_streaming, check_run_folder, check_data_sources,
                  check_sequence_parallel, lambda c: check_eval_prompts(c.train), early_stopping_config,
                  check_embedding, check_preference, check_quantization, lambda c: check_rft(c.rft),
                  lambda c: check_rl(c, given), lambda c: check_distill(c, given), lambda c: check_model(c.model)):
        try:
            check(cfg)
        except ConfigError as e:
            problems += problems_of(e)
    raise_all(problems)


def check_batch(cfg: Config) -> None:
    """train.micro_batch_size=auto's conditions."""
    t = cfg.train
    if t.micro_batch_size == "auto" and t.global_batch_size < 1:
        raise ConfigError("config key 'train.global_batch_size': train.micro_batch_size=auto keeps the global batch "
                          "and needs it (sequences per optimizer step over all processes), e.g. 64")
    if t.micro_batch_size == "auto" and cfg.loss.mode != "generative":
        raise ConfigError(f"config key 'train.micro_batch_size': auto sizes generative micro-batches (loss.mode="
                          f"generative); with loss.mode={cfg.loss.mode} set it and train.emb_micro_batch_size")


def check_ranges(cfg: Config) -> None:
    """Each number's range: every key out of its range is one line."""
    t, d, o, loss = cfg.train, cfg.data, cfg.optim, cfg.loss
    rules = [(k, v, v >= 1, ">= 1") for k, v in {
        "train.micro_batch_size": t.micro_batch_size if t.micro_batch_size != "auto" else 1,
        "train.grad_accum": t.grad_accum, "train.log_every": t.log_every,
        "data.max_len": d.max_len if d.max_len != "auto" else 1, "data.prefetch_factor": d.prefetch_factor,
        "data.train_group_size": d.train_group_size, "data.query_max_len": d.query_max_len,
        "data.passage_max_len": d.passage_max_len, "train.emb_micro_batch_size": t.emb_micro_batch_size,
        "loss.grad_cache_chunks": loss.grad_cache_chunks, "loss.chunked_ce_size": loss.chunked_ce_size}.items()]
    rules += [(k, v, v >= 0, ">= 0") for k, v in {
        "train.global_batch_size": t.global_batch_size, "train.save_every_minutes": t.save_every_minutes,
        "train.time_budget_hours": t.time_budget_hours, "train.save_every_steps": t.save_every_steps,
        "train.save_total_limit": t.save_total_limit, "train.stop_at_step": t.stop_at_step,
        "train.profile_steps": t.profile_steps, "optim.warmup_steps": o.warmup_steps,
        "optim.max_grad_norm": o.max_grad_norm, "data.num_workers": d.num_workers, "train.eval_every": t.eval_every,
        "train.monitor_interval_s": t.monitor_interval_s, "train.price_per_hour": t.price_per_hour,
        "train.max_nonfinite_skips": t.max_nonfinite_skips}.items()]
    rules += [("train.max_steps", t.max_steps, t.max_steps == -1 or t.max_steps >= 1, "-1 (use epochs) or >= 1"),
              ("train.epochs", t.epochs, t.max_steps != -1 or t.epochs > 0, "> 0 when train.max_steps is -1"),
              ("optim.lr", o.lr, o.lr > 0, "> 0"),
              ("optim.warmup_ratio", o.warmup_ratio, 0 <= o.warmup_ratio < 1, "in [0, 1)"),
              ("loss.temperature", loss.temperature, loss.temperature > 0, "> 0"),
              ("data.embed_length_buckets", d.embed_length_buckets,
               d.embed_length_buckets == "auto" or d.embed_length_buckets >= 0, "auto or >= 0")]
    raise_all([f"config key '{k}': must be {must}, got {v}" for k, v, ok, must in rules if not ok])


def check_run_folder(cfg: Config) -> None:
    """train.output_dir: a folder that can be made; train.overwrite against train.resume."""
    t = cfg.train
    if not t.output_dir.strip():  # an unset shell variable (train.output_dir=$OUT): never the current folder
        raise ConfigError("config key 'train.output_dir': is empty (an unset shell variable?); give the run folder, "
                          "e.g. train.output_dir=runs/my-run")
    out = Path(t.output_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)  # mkdir would fail under a file
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"config key 'train.output_dir': {existing} is a file, not a folder"
                          + (f" (in {out})" if existing != out else ""))
    if t.overwrite and t.resume not in (*NO_RESUME, "auto"):
        raise ConfigError(f"config key 'train.overwrite': starts the run over, so it cannot resume from "
                          f"train.resume={t.resume}")


def check_embedding(cfg: Config) -> None:
    """The embedding objective's keys against each other, and loss.chunked_ce against train.compile."""
    t, d = cfg.train, cfg.data
    if cfg.loss.chunked_ce is True and t.compile == "full":
        raise ConfigError("config key 'loss.chunked_ce': true is not supported with train.compile=full (the chunked "
                          "loss replaces the output head's forward, inside the compiled graph); use "
                          "train.compile=regional or loss.chunked_ce=false")
    if cfg.loss.grad_cache_chunks >= 1 and t.emb_micro_batch_size % cfg.loss.grad_cache_chunks:
        raise ConfigError(f"config key 'loss.grad_cache_chunks': must divide train.emb_micro_batch_size "
                          f"({t.emb_micro_batch_size}), got {cfg.loss.grad_cache_chunks}")
    if "{instruction}" not in d.emb_instruction_template:
        raise ConfigError("config key 'data.emb_instruction_template': must contain {instruction}")


def check_eval_prompts(t) -> None:
    """train.eval_prompts: strings or {text: ...} mappings; train.eval_prompts_max_new_tokens >= 1."""
    for i, p in enumerate(t.eval_prompts):
        if not (isinstance(p, str) and p.strip()) and not (isinstance(p, dict) and set(p) == {"text"}
                                                          and isinstance(p["text"], str) and p["text"].strip()):
            raise ConfigError(f"config key 'train.eval_prompts[{i}]': expected a prompt (a non-empty string, or "
                              f"{{text: ...}} continued as it is), got {p!r}")
    if t.eval_prompts_max_new_tokens < 1:
        raise ConfigError(f"config key 'train.eval_prompts_max_new_tokens': must be >= 1, got "
                          f"{t.eval_prompts_max_new_tokens}")


def check_eval_split(cfg: Config) -> None:
    """data.eval_split: a fraction in (0, 1) or a count >= 1, and a stream without eval files to take it from."""
    d, mode = cfg.data, cfg.loss.mode
    split = d.eval_split
    if split is None:
        return
    if not (0 < split < 1 if isinstance(split, float) else split >= 1):
        raise ConfigError(f"config key 'data.eval_split': a fraction in (0, 1) or a number of records >= 1, "
                          f"got {split}")
    needs = [k for k, files in (("data.eval_files", d.eval_files), ("data.emb_eval_files", d.emb_eval_files))
             if not files and (mode != "generative" if k.startswith("data.emb") else mode != "embedding")]
    if not needs:
        raise ConfigError("config key 'data.eval_split': every training list already has eval files "
                          "(data.eval_files / data.emb_eval_files); give one or the other")


def check_data_sources(cfg: Config) -> None:
    """The lists the mode needs (each entry's own checks, which need data/'s knowledge: harness.data.checks, called by
    the build)."""
    d, mode = cfg.data, cfg.loss.mode
    prompts = mode == "distill" and cfg.distill.prompts  # (distill.prompts: the stream in place of data.train_files)
    if facts(mode).reads_data and not d.train_files and not prompts:
        raise ConfigError(f"config key 'data.train_files': loss.mode={mode} needs generative JSONL files or folders")
    if facts(mode).embeds and not d.emb_train_files:
        raise ConfigError(f"config key 'data.emb_train_files': loss.mode={mode} needs embedding JSONL files or folders")
    check_eval_split(cfg)


def check_preference(cfg: Config) -> None:
    """loss.mode=preference: beta > 0, label smoothing only where the loss has it, no packing."""
    loss = cfg.loss
    if loss.mode != "preference":
        return
    if loss.beta <= 0:
        raise ConfigError(f"config key 'loss.beta': must be > 0, got {loss.beta}")
    if not 0 <= loss.label_smoothing < 0.5:
        raise ConfigError(f"config key 'loss.label_smoothing': must be in [0, 0.5), got {loss.label_smoothing}")
    if loss.label_smoothing and loss.preference not in ("dpo", "simpo"):
        raise ConfigError(f"config key 'loss.label_smoothing': loss.preference={loss.preference} has no label "
                          f"smoothing (dpo and simpo have); set it to 0")
    if cfg.data.packing:
        raise ConfigError("config key 'data.packing': loss.mode=preference scores whole sequences, one a row; set "
                          "data.packing=false")
    if cfg.train.compile == "full":
        raise ConfigError("config key 'train.compile': full is not supported with loss.mode=preference (the "
                          "sequence log-probs replace the output head's forward); use regional")


def check_model(m) -> None:
    """The model section: something to build, and attention heads that divide."""
    if m.name_or_path is None and not m.config:
        raise ConfigError("config key 'model.name_or_path': set it, or give model.config (with model_type) for random init")
    if m.name_or_path is None and "model_type" not in m.config:
        raise ConfigError("config key 'model.config.model_type': required to build a model from config (e.g. llama)")
    c = m.config
    heads, kv, hidden = c.get("num_attention_heads"), c.get("num_key_value_heads"), c.get("hidden_size")
    if isinstance(heads, int) and isinstance(hidden, int) and (heads < 1 or hidden % heads):
        raise ConfigError(f"config key 'model.config.num_attention_heads': must divide model.config.hidden_size "
                          f"({hidden}), got {heads}")
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise ConfigError(f"config key 'model.config.num_key_value_heads': must divide "
                          f"model.config.num_attention_heads ({heads}), got {kv}")


def check_rft(r) -> None:
    """The rft section's ranges."""
    for key, v in {"rft.oversample": r.oversample, "rft.max_new_tokens": r.max_new_tokens,
                   "rft.questions_per_batch": r.questions_per_batch, "rft.keep_per_question": r.keep_per_question,
                   "rft.micro_batch_sequences": r.micro_batch_sequences}.items():
        if v < 1:
            raise ConfigError(f"config key '{key}': must be >= 1, got {v}")
    for key, v, ok, allowed in (("rft.temperature", r.temperature, r.temperature > 0, "> 0"),
                                ("rft.top_p", r.top_p, 0 < r.top_p <= 1, "in (0, 1]"),
                                ("rft.top_k", r.top_k, r.top_k >= 0, ">= 0 (0: off)"),
                                ("rft.min_p", r.min_p, 0 <= r.min_p <= 1, "in [0, 1] (0: off)"),
                                ("rft.tolerance", r.tolerance, r.tolerance >= 0, ">= 0"),
                                ("rft.pairs_per_question", r.pairs_per_question, r.pairs_per_question >= 0, ">= 0"),
                                ("rft.kv_cache_gb", r.kv_cache_gb, r.kv_cache_gb is None or r.kv_cache_gb > 0,
                                 "> 0 (or null: sized from free memory)")):
        if not ok:
            raise ConfigError(f"config key '{key}': out of range: must be {allowed}, got {v}")
    # `rft.stop_strings=[Question:]`: YAML reads an unquoted `Question:` as the mapping {Question: null}; what was
    # meant is the text, colon included
    r.stop_strings = [f"{next(iter(s))}:" if isinstance(s, dict) and len(s) == 1 and next(iter(s.values())) is None
                      and isinstance(next(iter(s)), str) else s for s in r.stop_strings]
    if any(not isinstance(s, str) or not s for s in r.stop_strings):
        raise ConfigError("config key 'rft.stop_strings': non-empty strings needed (an empty one would stop every answer at once)")


def check_rl(cfg: Config, given: frozenset = frozenset()) -> None:
    """loss.mode=rl: groups of at least 2 answers, ranges, no packing (one answer a row); train.micro_batch_size
    given (`given`: the keys set) is refused: rl mode does not read it."""
    rl = cfg.rl
    if cfg.loss.mode != "rl":
        return
    if "train.micro_batch_size" in given:
        raise ConfigError("config key 'train.micro_batch_size': loss.mode=rl does not read it: a step trains "
                          "rl.questions_per_step x rl.num_generations answers (TRL's per_device_train_batch_size "
                          "counts completions per device), split over the processes and train.grad_accum "
                          "micro-batches; remove it and set rl.questions_per_step or train.grad_accum")
    if rl.num_generations < 2:
        raise ConfigError(f"config key 'rl.num_generations': must be >= 2 (an answer's advantage is its reward against "
                          f"the other answers to its question), got {rl.num_generations}")
    for key, v in {"rl.questions_per_step": rl.questions_per_step, "rl.iterations": rl.iterations}.items():
        if v < 1:
            raise ConfigError(f"config key '{key}': must be >= 1, got {v}")
    if rl.epsilon <= 0 or (rl.epsilon_high is not None and rl.epsilon_high <= 0) or rl.beta < 0:
        bad = "rl.epsilon" if rl.epsilon <= 0 else "rl.beta" if rl.beta < 0 else "rl.epsilon_high"
        raise ConfigError(f"config key '{bad}': out of range")
    if rl.log_completions < 0:
        raise ConfigError(f"config key 'rl.log_completions': must be >= 0, got {rl.log_completions}")
    if rl.max_tool_calls < 1:
        raise ConfigError(f"config key 'rl.max_tool_calls': must be >= 1, got {rl.max_tool_calls}")
    for i, spec in enumerate(rl.tools):
        if not isinstance(spec, str) or ":" not in spec:
            raise ConfigError(f"config key 'rl.tools[{i}]': expected 'module:function' or 'path/file.py:function', "
                              f"got {spec!r}")
    parse_rewards(rl.rewards)  # (rl.prompts' sources: harness.data.checks.check_data)
    if cfg.data.packing:
        raise ConfigError("config key 'data.packing': loss.mode=rl trains one answer a row; set data.packing=false")
    if cfg.train.compile == "full":
        raise ConfigError("config key 'train.compile': full is not supported with loss.mode=rl (the log-probs replace "
                          "the output head's forward); use regional")
    if cfg.train.sequence_parallel > 1:
        raise ConfigError("config key 'train.sequence_parallel': not supported with loss.mode=rl")


REWARD_KEYS = ("function", "weight")


def parse_rewards(entries: list) -> list[tuple[str, str, float]]:
    """rl.rewards -> [(spec, logged name, weight)]; a wrong entry is one line naming it."""
    out = []
    for i, e in enumerate(entries or []):
        key = f"rl.rewards[{i}]"
        if isinstance(e, str):
            e = {"function": e}
        if not isinstance(e, dict) or not isinstance(e.get("function"), str) or not e["function"]:
            raise ConfigError(f"config key '{key}': expected {{function: module:name | verifier, weight}}, got {e!r}")
        bad = [k for k in e if k not in REWARD_KEYS]
        if bad:
            raise ConfigError(f"config key '{key}': unknown key '{bad[0]}' (keys: {', '.join(REWARD_KEYS)})")
        w = e.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"config key '{key}.weight': expected a number, got {w!r}")
        spec = e["function"]
        if spec != "verifier" and ":" not in spec:
            raise ConfigError(f"config key '{key}.function': expected 'verifier' or 'module:function', got {spec!r}")
        name = spec.rpartition(":")[2]
        if any(name == n for _, n, _ in out):
            raise ConfigError(f"config key '{key}.function': a second function logged as reward/{name}")
        out.append((spec, name, float(w)))
    return out


def check_quantization(cfg: Config) -> None:
    """model.quantization needs LoRA on a pretrained base and no ZeRO-3 (as far as the config tells: train.deepspeed;
    a launcher's ZeRO-3 is refused when the run starts, harness.build)."""
    m = cfg.model
    lc = lora_config(m)
    q = m.quantization
    if q == "none":
        return
    if not lc.enabled:
        raise ConfigError(f"config key 'model.quantization': {q} trains LoRA adapters on a frozen quantized base; set "
                          f"model.lora.enabled=true (or model.quantization=none)")
    if m.name_or_path is None or m.random_init:
        raise ConfigError(f"config key 'model.quantization': {q} quantizes pretrained weights loaded from "
                          f"model.name_or_path (a hub id or a folder); not a model from model.config or random_init")
    if deepspeed_stage(cfg.train.deepspeed) == 3:
        raise ConfigError(quantization_zero3_error(q, f"train.deepspeed={cfg.train.deepspeed}"))
    if lc.experts:  # MoE (docs/moe.md): refused in one line rather than an untested path
        raise ConfigError(f"config key 'model.lora.experts': not with model.quantization={q}: bitsandbytes quantizes "
                          f"nn.Linear layers only, and transformers 5's experts are 3-D tensors it leaves in full "
                          f"precision; use model.lora.experts=false (adapters on the quantized layers) or no quantization")


def quantization_zero3_error(q: str, why: str) -> str:
    return (f"config key 'model.quantization': {q} does not work under DeepSpeed ZeRO-3 ({why}): bitsandbytes' "
            f"quantized weights cannot be partitioned; use one process, DDP, or ZeRO stage 0, 1 or 2")


def deepspeed_stage(value: Optional[str]) -> Optional[int]:
    """The ZeRO stage that train.deepspeed names (a shipped name or a JSON path), None if unknown/unset."""
    if not value:
        return None
    shipped = Path(__file__).resolve().parents[2] / "ds_configs"
    path = shipped / f"{value}.json" if "/" not in value and not value.endswith(".json") else Path(value)
    try:
        return json.loads(path.read_text()).get("zero_optimization", {}).get("stage", 0)
    except (OSError, ValueError, AttributeError):
        return None  # reported with its own message when the run starts (distributed.processes.resolve_ds_config)


def check_sequence_parallel(cfg: Config) -> None:
    """train.sequence_parallel against the other keys (the process count and the model's heads: at the launch)."""
    n, m = cfg.train.sequence_parallel, cfg.model
    if n < 1:
        raise ConfigError(f"config key 'train.sequence_parallel': must be >= 1, got {n}")
    if n == 1:
        return
    if cfg.loss.mode != "generative":
        why = ("preference training sums each sequence's log-probs over all its completion tokens (and its pair "
               "batches and reference pass take whole rows), which would split over the processes" if
               cfg.loss.mode == "preference" else
               f"loss.mode={cfg.loss.mode}'s embedding passes pool over the whole sequence, which would split over "
               f"the processes")
        raise ConfigError(f"config key 'train.sequence_parallel': {n} trains the generative loss only; {why}; use "
                          f"loss.mode=generative or train.sequence_parallel=1")
    if cfg.loss.gen_averaging != "token":
        raise ConfigError("config key 'loss.gen_averaging': mixed averages each row's loss, whose tokens sequence "
                          "parallelism splits over processes; use token (train.sequence_parallel > 1)")
    if m.attn_implementation not in ("auto", "sdpa") and not m.attn_implementation.startswith("flash_attention"):
        raise ConfigError(f"config key 'model.attn_implementation': sequence parallelism needs sdpa or flash "
                          f"attention, got {m.attn_implementation}; set model.attn_implementation=sdpa")
    if cfg.train.micro_batch_size == "auto":
        raise ConfigError("config key 'train.micro_batch_size': auto is not supported with train.sequence_parallel "
                          "> 1; give a number")
    heads = (m.config or {}).get("num_attention_heads") if m.name_or_path is None else None
    if heads and heads % n:
        raise ConfigError(f"config key 'train.sequence_parallel': {n} does not divide the model's {heads} "
                          f"attention heads; use a divisor of {heads}")


def check_streaming(cfg: Config) -> None:
    """data.streaming (docs/streaming.md): generative data only, and nothing that needs the whole data before step 1."""
    d = cfg.data
    if d.shuffle_buffer < 0:
        raise ConfigError(f"config key 'data.shuffle_buffer': must be >= 0, got {d.shuffle_buffer}")
    if not d.streaming:
        return
    refusals = [
        (cfg.loss.mode != "generative", "loss.mode", f"data.streaming=true streams generative data only; "
                                                     f"loss.mode={cfg.loss.mode} reads cached data"),
        (d.eval_split is not None, "data.eval_split", "a stream never holds the whole data to hold records out of: "
                                                      "with data.streaming=true give data.eval_files"),
        (d.max_len == "auto", "data.max_len", "auto measures every sample first: with data.streaming=true give a "
                                              "number"),
        (cfg.train.micro_batch_size == "auto", "train.micro_batch_size", "auto tries the data's longest batch first: "
                                                                         "with data.streaming=true give a number"),
        (cfg.train.sequence_parallel > 1, "train.sequence_parallel", "not supported with data.streaming=true"),
        (cfg.train.resume_changed_data, "train.resume_changed_data", "a stream resumes at its sources' positions, "
                                                                     "which changed files no longer have: not "
                                                                     "supported with data.streaming=true"),
    ]
    for bad, key, why in refusals:
        if bad:
            raise ConfigError(f"config key '{key}': {why}")

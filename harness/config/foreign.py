"""The names users bring from other tools, and what harness calls them: HF TrainingArguments, TRL's GRPOConfig,
DPOConfig and SFTConfig, axolotl, LLaMA-Factory. A foreign name anywhere in a recipe (at the top, in a section) or in
an override gets "X is TRL's name: harness calls it Y", with how the meaning differs where it does. `hint` is the one
place an unknown key's suggestion comes from (coerce.unknown): this table, the same name in another section, or a
name spelled almost the same (a typo: difflib at a high cutoff, so that `per_device_train_batch_size` is not offered
`emb_micro_batch_size`). Light: no torch.

    python -c "from harness.config.foreign import hint; print(hint('train.learning_rate', ['lr']))"
"""

from __future__ import annotations

import difflib
from typing import Optional

HF, TRL, AXOLOTL, LF = "HF TrainingArguments'", "TRL's", "axolotl's", "LLaMA-Factory's"
RL_BATCH = ("TRL's counts completions per device; harness's rl mode counts questions: rl.questions_per_step x "
            "rl.num_generations completions a step, over all processes")

# name -> (whose name, harness's key or None where harness has none, how the meaning differs or "")
FOREIGN: dict[str, tuple[str, Optional[str], str]] = {
    # HF TrainingArguments (and so TRL's configs, which extend it)
    "learning_rate": (HF, "optim.lr", ""),
    "per_device_train_batch_size": (HF, "train.micro_batch_size", "per process; in loss.mode=rl " + RL_BATCH),
    "per_device_eval_batch_size": (HF, "train.micro_batch_size", "evaluation runs at the training micro-batch"),
    "gradient_accumulation_steps": (HF, "train.grad_accum", ""),
    "logging_steps": (HF, "train.log_every", ""),
    "eval_steps": (HF, "train.eval_every", ""),
    "eval_strategy": (HF, "train.eval_every", "evaluation is every N steps (0: at the end only)"),
    "evaluation_strategy": (HF, "train.eval_every", "evaluation is every N steps (0: at the end only)"),
    "save_steps": (HF, "train.save_every_steps", "checkpoints are also written by time: train.save_every_minutes"),
    "save_strategy": (HF, "train.save_every_steps", "or train.save_every_minutes"),
    "num_train_epochs": (HF, "train.epochs", "used when train.max_steps is -1"),
    "warmup_ratio": (HF, "optim.warmup_ratio", ""),
    "warmup_steps": (HF, "optim.warmup_steps", ""),
    "weight_decay": (HF, "optim.weight_decay", ""),
    "max_grad_norm": (HF, "optim.max_grad_norm", ""),
    "lr_scheduler_type": (HF, "optim.scheduler", "cosine, linear or constant"),
    "adam_beta1": (HF, "optim.beta1", ""),
    "adam_beta2": (HF, "optim.beta2", ""),
    "adam_epsilon": (HF, "optim.eps", ""),
    "bf16": (HF, "train.precision", "a choice, not a flag: train.precision=bf16"),
    "fp16": (HF, "train.precision", "a choice, not a flag: train.precision=fp16"),
    "tf32": (HF, "train.tf32", ""),
    "gradient_checkpointing": (HF, "model.gradient_checkpointing", ""),
    "resume_from_checkpoint": (HF, "train.resume", "auto (the default) continues from the newest checkpoint"),
    "overwrite_output_dir": (HF, "train.overwrite", ""),
    "dataloader_num_workers": (HF, "data.num_workers", ""),
    "dataloader_pin_memory": (HF, "data.pin_memory", ""),
    "torch_compile": (HF, "train.compile", "a choice: auto, regional, full or none"),
    "load_best_model_at_end": (HF, "train.keep_best", "the best model is exported to best/"),
    "metric_for_best_model": (HF, "train.early_stopping.metric", ""),
    "early_stopping_patience": (HF, "train.early_stopping.patience", ""),
    "optim": (HF, None, "harness trains with torch's AdamW (optim.lr, optim.beta1, ...)"),
    # TRL: GRPOConfig
    "max_completion_length": (TRL, "rft.max_new_tokens", ""),
    "num_generations": (TRL, "rl.num_generations", ""),
    "generation_batch_size": (TRL, "rl.questions_per_step", "TRL's counts completions, harness's counts questions "
                                                            "(each with rl.num_generations answers)"),
    "num_iterations": (TRL, "rl.iterations", ""),
    "epsilon": (TRL, "rl.epsilon", ""),
    "epsilon_high": (TRL, "rl.epsilon_high", ""),
    "scale_rewards": (TRL, "rl.scale_rewards", ""),
    "importance_sampling_level": (TRL, "rl.importance_sampling", ""),
    "mask_truncated_completions": (TRL, "rl.mask_truncated_completions", ""),
    "log_completions": (TRL, "rl.log_completions", "a number of rows, not a flag"),
    "max_tool_calling_iterations": (TRL, "rl.max_tool_calls", ""),
    "environment_factory": (TRL, "rl.environment", "a class spec module:Class (GRPOTrainer's argument)"),
    "reward_funcs": (TRL, "rl.rewards", "[{function: module:name, weight: w}]"),
    "reward_weights": (TRL, "rl.rewards", "each entry's weight"),
    "temperature": (TRL, "rft.temperature", "the sampling temperature (loss.temperature is the contrastive one)"),
    "top_p": (TRL, "rft.top_p", ""),
    "top_k": (TRL, "rft.top_k", ""),
    "min_p": (TRL, "rft.min_p", ""),
    "use_vllm": (TRL, "rft.engine", "a choice: rft.engine=vllm"),
    "beta": (TRL, "rl.beta", "GRPO's KL weight; DPOConfig's beta is loss.beta"),
    # TRL: DPOConfig, SFTConfig
    "loss_type": (TRL, "loss.preference", "DPOConfig's (dpo, ipo, simpo, orpo); GRPOConfig's is rl.loss_type"),
    "label_smoothing": (TRL, "loss.label_smoothing", ""),
    "simpo_gamma": (TRL, "loss.simpo_gamma", ""),
    "max_length": (TRL, "data.max_len", ""),
    "max_seq_length": (TRL, "data.max_len", ""),
    "max_prompt_length": (TRL, "data.max_len", "one limit for prompt and answer together"),
    "packing": (TRL, "data.packing", ""),
    # axolotl
    "base_model": (AXOLOTL, "model.name_or_path", ""),
    "base_model_config": (AXOLOTL, "model.name_or_path", ""),
    "tokenizer_config": (AXOLOTL, "model.tokenizer", ""),
    "sequence_len": (AXOLOTL, "data.max_len", ""),
    "sample_packing": (AXOLOTL, "data.packing", ""),
    "micro_batch_size": (AXOLOTL, "train.micro_batch_size", ""),
    "num_epochs": (AXOLOTL, "train.epochs", ""),
    "lr_scheduler": (AXOLOTL, "optim.scheduler", "cosine, linear or constant"),
    "adapter": (AXOLOTL, "model.lora.enabled", "adapter: qlora is model.lora.enabled=true with model.quantization=4bit"),
    "lora_r": (AXOLOTL, "model.lora.r", ""),
    "lora_alpha": (AXOLOTL, "model.lora.alpha", ""),
    "lora_dropout": (AXOLOTL, "model.lora.dropout", ""),
    "lora_target_modules": (AXOLOTL, "model.lora.target_modules", ""),
    "lora_target_linear": (AXOLOTL, "model.lora.target_modules", "all-linear (the default)"),
    "load_in_4bit": (AXOLOTL, "model.quantization", "a choice: model.quantization=4bit"),
    "load_in_8bit": (AXOLOTL, "model.quantization", "a choice: model.quantization=8bit"),
    "datasets": (AXOLOTL, "data.train_files", "sources as paths, hub ids or {path, format} mappings"),
    "test_datasets": (AXOLOTL, "data.eval_files", ""),
    "val_set_size": (AXOLOTL, "data.eval_split", ""),
    "dataset_prepared_path": (AXOLOTL, "data.cache_dir", ""),
    "shuffle_merged_datasets": (AXOLOTL, "data.shuffle", ""),
    "train_on_inputs": (AXOLOTL, None, "harness trains on the assistant turns of chat records (messages) and on "
                                       "every token of text records"),
    "flash_attention": (AXOLOTL, "model.attn_implementation", "a choice: model.attn_implementation=flash_attention_2"),
    "sdp_attention": (AXOLOTL, "model.attn_implementation", "a choice: model.attn_implementation=sdpa"),
    "saves_per_epoch": (AXOLOTL, "train.save_every_steps", "in steps, not per epoch"),
    "evals_per_epoch": (AXOLOTL, "train.eval_every", "in steps, not per epoch"),
    "wandb_project": (AXOLOTL, "train.tracker_project", "with train.report_to=[wandb]"),
    "wandb_entity": (AXOLOTL, "train.tracker_entity", ""),
    "wandb_name": (AXOLOTL, "train.run_name", ""),
    "optimizer": (AXOLOTL, None, "harness trains with torch's AdamW (optim.lr, optim.beta1, ...)"),
    # LLaMA-Factory
    "model_name_or_path": (LF, "model.name_or_path", ""),
    "cutoff_len": (LF, "data.max_len", ""),
    "dataset": (LF, "data.train_files", "sources as paths, hub ids or {path, format} mappings"),
    "eval_dataset": (LF, "data.eval_files", ""),
    "val_size": (LF, "data.eval_split", ""),
    "template": (LF, "data.chat_template", ""),
    "finetuning_type": (LF, "model.lora.enabled", "finetuning_type: lora is model.lora.enabled=true"),
    "lora_rank": (LF, "model.lora.r", ""),
    "lora_target": (LF, "model.lora.target_modules", ""),
    "quantization_bit": (LF, "model.quantization", "a choice: 4bit or 8bit"),
    "stage": (LF, "loss.mode", "sft is generative, dpo is preference"),
    "pref_beta": (LF, "loss.beta", ""),
    "pref_loss": (LF, "loss.preference", ""),
    "flash_attn": (LF, "model.attn_implementation", ""),
    "preprocessing_num_workers": (LF, "data.num_workers", ""),
    "neat_packing": (LF, "data.packing", ""),
}


def foreign(name: str) -> Optional[str]:
    """'X is TRL's name: harness calls it Y (how it differs)' for a name of another tool, else None."""
    entry = FOREIGN.get(name)
    if entry is None:
        return None
    who, key, note = entry
    if key is None:
        return f"'{name}' is {who} name: harness has no such key ({note})"
    return f"'{name}' is {who} name: harness calls it {key}" + (f" ({note})" if note else "")


def hint(key: str, known: list[str], elsewhere: Optional[dict[str, list[str]]] = None) -> str:
    """What follows "unknown config key 'K'" for the unknown `key` (dotted) among `known` (the keys of its section),
    "" when no name is close in meaning: a foreign name's harness key; the same name in another section
    (`elsewhere`: section -> keys); a name spelled almost the same (a typo: `max_step`, `trian`)."""
    name = key.split(".")[-1]
    said = foreign(name)
    if said:
        return f": {said}"
    for section, keys in (elsewhere or {}).items():
        if name in keys:
            return f": harness calls it {section}.{name}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""

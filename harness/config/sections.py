"""The run configuration's sections: every key with its type, default and help text (harness/config/__init__.py
loads, overrides, validates and writes them). Light: no torch, no transformers.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from harness.config.coerce import help_field as _f
from harness.config.distill import DistillConfig
from harness.config.lora_keys import LoraConfig, lora_config  # noqa: F401 - model.lora
from harness.errors import ConfigError


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = _f(None, "Hugging Face model id or local folder. Null: build from `config`.")
    config: dict = _f(
        {},
        "transformers config kwargs for a randomly initialised model (needs `model_type`, e.g. llama). "
        "With name_or_path set, these override the loaded config.",
    )
    random_init: bool = _f(False, "With name_or_path: take its architecture but initialise the weights randomly.")
    tokenizer: Optional[str] = _f(
        None, "Tokenizer id or folder; `bundled` = the offline tokenizer shipped in harness/assets. "
        "Null: name_or_path, or the bundled one when building from `config`."
    )
    attn_implementation: str = _f(
        "auto", "Attention kernel: auto, sdpa, eager, flex_attention, flash_attention_2, ... auto: flex_attention "
        "for packed generative training on a CUDA GPU (the fastest measured, docs/benchmarks.md), else sdpa where "
        "the model supports it, else eager (one line says so; e.g. gemma2).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward (non-reentrant) to save memory.")
    trust_remote_code: bool = _f(False, "Allow model code from the model's repository.")
    pooling: Literal["mean", "weightedmean", "lasttoken"] = _f(
        "mean", "Embedding pooling over the text tokens (instruction tokens excluded): mean, weightedmean "
        "(position-weighted, GritLM), lasttoken (an eos is appended).")
    embed_attention: Literal["bidirectional", "causal"] = _f(
        "bidirectional", "Attention in embedding passes (generation is always causal). bidirectional: "
        "llama, mistral, qwen2, qwen3 with sdpa or eager attention.")
    quantization: Literal["none", "4bit", "8bit"] = _f(
        "none", "QLoRA: load the pretrained base quantized by bitsandbytes (pip install harness[qlora]) and train LoRA "
        "adapters on it. 4bit: nf4 with double quantisation, computing in the run's precision (bf16 or fp32); 8bit: "
        "LLM.int8. Needs model.lora.enabled=true and a pretrained model.name_or_path; not under ZeRO-3.")
    lora: dict = _f({}, "LoRA through peft (keys below, LoraConfig); e.g. model.lora.enabled=true model.lora.r=16. "
                        "final/ then holds the adapter and final/merged/ the merged model.")
    router_aux_loss_coef: Optional[float] = _f(
        None, "Mixture of experts (docs/moe.md): the weight of the router's load-balancing loss, added to the "
        "generative loss as the model's own forward adds it (logged apart: aux_loss, expert_load). Null: the "
        "model's own router_aux_loss_coef; 0: the cross-entropy alone.")
    train_router: bool = _f(True, "Mixture of experts: train the routers' weights (false: frozen).")
    train_vision: bool = _f(False, "Vision-language models (docs/vision.md): train the vision tower (false: frozen, "
                                   "its projector as model.train_projector says).")
    train_projector: bool = _f(False, "Vision-language models: train the projector (Qwen2-VL's merger, LLaVA's "
                                      "multi_modal_projector) that maps the vision tower's output into the language "
                                      "model (false: frozen, unless model.train_vision).")
    image_min_pixels: Optional[int] = _f(None, "Vision-language models: images smaller are scaled up to this many "
                                               "pixels (null: the processor's own).")
    image_max_pixels: Optional[int] = _f(None, "Vision-language models: images larger are scaled down to at most "
                                               "this many pixels, bounding their tokens (null: the processor's own).")
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = _f(
        "auto", "Mixture of experts: transformers' experts kernel. auto: grouped_mm (torch's grouped matmul; on a "
        "CPU too, the fastest measured there: docs/bench/moe-experts-cpu.json; none where a remote-code model's "
        "experts take no kernel choice); ignored for dense models.")


@dataclass
class DataConfig:
    train_files: list = _f([], "Generative data sources. A source is a path (.jsonl, .jsonl.gz, .json, .parquet, "
                              ".csv, .tsv, .arrow file; a folder of them; a save_to_disk folder) or a hub data set id, "
                              "or a mapping {path, split, subset, format, weight, columns}. format: text, messages, "
                              "sharegpt, alpaca, gritlm (detected from the columns when not given); columns: {field: "
                              "column}; weight: the source's share of each epoch (give all or none; harness.data.mixing).")
    eval_files: list = _f([], "Held-out generative sources (as data.train_files); evaluated every train.eval_every "
                              "steps and at the end.")
    eval_split: Union[int, float, None] = _f(
        None, "Hold out part of the training data for evaluation when no eval files are given (data.eval_files, "
        "data.emb_eval_files): a fraction in (0, 1) or a number of records, drawn once from train.seed before "
        "weighting (the same on every process and on resume; never trained on).")
    max_len: Union[int, Literal["auto"]] = _f(
        512, "Tokens per sample; longer samples are truncated (and counted in the log). auto: the "
        "max_len_percentile of the data's token lengths, rounded up to a multiple of 8.")
    chat_template: str = _f(
        "auto", "How chat records are laid out (harness.data.chat): auto (the tokenizer's own chat template, else the "
        "GritLM layout <|user|>/<|assistant|>), tokenizer (its own; an error if it has none), gritlm, or the path of "
        "a Jinja file. The ids trained are apply_chat_template's, the loss is on the assistant turns, and the "
        "template is saved with the tokenizer (final/, checkpoints).")
    max_len_percentile: float = _f(99.0, "Percentile of sample lengths that data.max_len=auto covers.")
    packing: bool = _f(False, "Pack generative samples into rows of max_len (best-fit; no attention across "
                              "documents: per-document position ids).")
    group_by_length: bool = _f(False, "Embedding data: batch queries of similar length together (less padding).")
    pad_buckets: int = _f(0, "Pad unpacked micro-batches up to one of N evenly spaced widths up to the max length "
                             "(N shapes per stream) instead of to the longest row (0). See docs/speed.md.")
    embed_length_buckets: Union[int, Literal["auto"]] = _f(
        "auto", "Embedding passes under torch.compile: queries and passages padded to one of N fixed widths doubling "
        "up to data.query_max_len / data.passage_max_len (none above the data's longest text), compiled with static "
        "shapes and each run once before step 1, so that no later batch compiles (docs/speed.md). auto: 4 under "
        "torch.compile with packed generative rows (or loss.mode=embedding) and no DeepSpeed, else 0: each batch "
        "padded to its longest (dynamic shapes under compile).")
    emb_train_files: list = _f([], "Embedding sources (as data.train_files, format embedding: {query, pos, neg}; "
                                   "loss.mode embedding or unified).")
    emb_eval_files: list = _f([], "Held-out embedding sources: retrieval recall@1 and MRR every train.eval_every "
                                  "steps and at the end.")
    train_group_size: int = _f(2, "Passages per query in training: 1 positive + (n-1) sampled hard negatives.")
    query_max_len: int = _f(64, "Tokens per query, instruction included (the text is truncated, not the instruction).")
    passage_max_len: int = _f(128, "Tokens per passage, instruction included.")
    emb_instruction_template: str = _f("<|user|>\n{instruction}\n<|embed|>\n",
                                       "Text before an embedded text that has an instruction.")
    emb_plain_template: str = _f("<|embed|>\n", "Text before an embedded text without instruction.")
    shuffle: bool = _f(True, "Shuffle the training samples each epoch (seeded by train.seed and the epoch).")
    streaming: bool = _f(False, "Generative data read, tokenized and packed as training goes instead of cached "
                                "whole before step 1 (docs/streaming.md): memory and start-up independent of the "
                                "data's size; the stream's state is in every checkpoint (exact resume, also on "
                                "another process count with the global batch kept). train.max_steps is required "
                                "when an epoch's size is unknown (JSON lines, packing).")
    shuffle_buffer: int = _f(10000, "data.streaming with data.shuffle: records in the seeded shuffle buffer (each "
                                    "record leaves from a random slot; larger mixes more, holds more in memory and in "
                                    "each checkpoint).")
    num_workers: int = _f(0, "DataLoader worker processes.")
    pin_memory: Union[bool, Literal["auto"]] = _f("auto", "Pin host memory for faster copies (auto: on with a GPU).")
    prefetch_factor: int = _f(2, "Batches each worker prepares ahead (with num_workers > 0).")
    persistent_workers: bool = _f(False, "Keep workers alive between epochs (with num_workers > 0).")
    cache_dir: Optional[str] = _f(None, "datasets cache folder for the tokenized data. Null: the datasets default.")


@dataclass
class LossConfig:
    mode: str = _f(
        "generative", "A registered loss mode (harness/modes/). generative: next-token loss; embedding: contrastive loss; unified: their weighted sum "
        "(GritLM), one generative and one embedding micro-batch per micro-step; preference: pairs {prompt?, chosen, "
        "rejected} in data.train_files, the loss loss.preference (docs/preference.md); rl: GRPO on rft.task (docs/rl.md).")
    preference: Literal["dpo", "ipo", "simpo", "orpo"] = _f(
        "dpo", "loss.mode=preference: dpo (sigmoid loss on the log-ratios to the reference model), ipo, simpo "
        "(length-normalised, no reference, margin loss.simpo_gamma), orpo (NLL on the chosen completion + odds "
        "ratio, no reference). The reference model's log-probs are computed once before training.")
    beta: float = _f(0.1, "Preference loss: beta (DPO/SimPO temperature, IPO's tau, ORPO's lambda).")
    label_smoothing: float = _f(0.0, "Preference loss: label smoothing in [0, 0.5) (conservative DPO, SimPO).")
    simpo_gamma: float = _f(0.5, "SimPO: the target reward margin gamma (TRL's simpo_gamma).")
    temperature: float = _f(0.02, "Contrastive softmax temperature on cosine similarities.")
    gen_averaging: Literal["token", "mixed"] = _f(
        "token", "token: mean over every trained token of the whole (global, accumulated) step; mixed: mean of the "
        "per-micro-batch token means (GritLM's 'mixed').")
    gen_weight: float = _f(1.0, "Weight of the generative loss (GritLM loss_gen_factor).")
    emb_weight: float = _f(1.0, "Weight of the contrastive loss.")
    gather_negatives: bool = _f(True, "Use every process's passages as negatives (gathered with their gradient).")
    grad_cache_chunks: int = _f(
        1, "Cached-representation mode (GradCache): embed each embedding micro-batch in this many chunks without "
        "graph, compute the loss on the whole batch, then back-propagate chunk by chunk. 1: off.")
    chunked_ce: Union[bool, Literal["auto"]] = _f(
        "auto", "Generative loss through the output head in chunks of positions (harness.losses."
        "chunked_token_loss_sum): the [batch, seq, vocab] logits are never built; same loss and gradients. true, "
        "false, or auto: on when the fp32 logits of the longest generative micro-batch (micro-batch x its longest "
        "row x vocab x 4 bytes) would take at least 256 MiB and the model's head supports it (a plain Linear head, "
        "no logit scaling, not with train.compile=full); off otherwise, with a one-line note when only the head "
        "stood in the way. Also used by the generative evaluation.")
    chunked_ce_size: int = _f(1024, "Positions per chunk with loss.chunked_ce (each chunk builds chunk x vocab "
                                    "logits).")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate.")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to biases and norm weights).")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    scheduler: Literal["cosine", "linear", "constant"] = _f("cosine", "Learning-rate decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps (takes precedence over warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total optimizer steps.")
    min_lr_ratio: float = _f(0.0, "Cosine/linear decay ends at lr * min_lr_ratio.")


NO_RESUME = (None, "none", "null", "")  # train.resume values that start fresh (the one list of the spellings)


@dataclass
class TrainConfig:
    output_dir: str = _f("runs/default", "Run folder: config.yaml, metrics.jsonl, tensorboard/, final/, report.json.")
    seed: int = _f(42, "Seed for model init, data order and dropout.")
    max_steps: int = _f(-1, "Optimizer steps to run; -1: run `epochs` epochs.")
    epochs: float = _f(1.0, "Passes over the training data when max_steps is -1 (fractions allowed).")
    micro_batch_size: Union[int, Literal["auto"]] = _f(
        8, "Samples per process per forward/backward. auto: the largest that fits in memory (accelerate's "
        "find_executable_batch_size, halving from train.global_batch_size / processes after a trial step on the "
        "longest batch); grad_accum then follows so that the global batch stays train.global_batch_size.")
    global_batch_size: int = _f(0, "Sequences (or embedding queries) per optimizer step over all processes; needed "
                                   "with micro_batch_size=auto. 0: micro_batch_size x grad_accum x processes.")
    emb_micro_batch_size: int = _f(8, "Embedding queries per process per micro-step (each with train_group_size passages).")
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.")
    sequence_parallel: int = _f(
        1, "Sequence parallelism (docs/long-context.md): N processes train the same rows, each 1/N of every row's "
        "positions (DeepSpeed's Ulysses attention), so activations per process are divided by N. N divides the "
        "processes and the model's attention heads; DeepSpeed ZeRO 1-3, generative loss, sdpa or flash attention. "
        "Batches count data-parallel ranks (processes / N).")
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = _f(
        "auto", "auto: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU. fp8: bf16, with the Linear "
        "layers of the repeated blocks in float8 through torchao (a GPU of compute capability 8.9+: H100, H200, L40S, "
        "RTX 4090; harness/speed/float8.py)."
    )
    weights: Literal["fp32", "bf16"] = _f(
        "fp32", "The parameters' dtype when train.precision is bf16. fp32: fp32 weights with the forward under bf16 "
        "autocast, the same on every path (DeepSpeed ZeRO 1-3 through its torch_autocast), so every ZeRO stage trains "
        "the plain path's model. bf16: bf16 weights and gradients with fp32 master copies in the optimizer "
        "(DeepSpeed's bf16 mode; a run without a DeepSpeed launcher or train.deepspeed uses train.deepspeed=zero0): "
        "2 bytes less per parameter under ZeRO 1-2, half the ZeRO-3 gathers, no weight casts per forward.")
    tf32: bool = _f(True, "Allow TF32 matmuls on Ampere or newer GPUs.")
    malloc_reuse: bool = _f(True, "Linux (glibc): the memory a step frees stays for the next step, not faulted in "
                                  "again (mallopt: 32 MiB mmap threshold, no trim; hardware.reuse_freed_memory); "
                                  "resident size stays at the step's peak. Not when MALLOC_* or LD_PRELOAD are set.")
    profile: Optional[str] = _f(None, "Speed profile (harness/config/profiles.py): conservative, balanced, aggressive, "
                                      "memory_efficient; applied below the recipe file and the overrides.")
    compile: Literal["auto", "regional", "full", "none"] = _f(
        "auto", "torch.compile through accelerate: regional (each repeated block; fast cold start), full, none. "
        "auto: regional on CUDA, none on CPU. Runs whose batches change shape (embedding passes, unpacked rows) "
        "compile with dynamic shapes: one graph per kind of pass, not one per length.")
    compile_dynamic: Optional[bool] = _f(None, "torch.compile shapes. null: static where every pass has one of a few "
                                               "fixed shapes (data.embed_length_buckets with packed or bucketed "
                                               "generative rows), else dynamic where batches change shape (embedding "
                                               "passes, unpacked rows); true: always dynamic; false: dynamo's default "
                                               "(static until a size changes).")
    log_every: int = _f(10, "Log metrics every N optimizer steps (and always at the last step).")
    eval_every: int = _f(0, "Evaluate (eval files, retrieval) every N steps; 0: only at the end.")
    eval_at_start: bool = _f(True, "Also evaluate before the first step of a fresh run (the step-0 baseline).")
    early_stopping: dict = _f({}, "Stop when the evaluations stop improving (keys below, harness/config/best.py), "
                                  "e.g. {metric: eval_loss, patience: 3, min_delta: 0.01}: the attempt ends with "
                                  "a checkpoint and the final export (report.json stopped_by: early_stopping). The "
                                  "best value and the patience count are saved with every checkpoint. {}: off.")
    keep_best: bool = _f(False, "Keep the best evaluation's model (ranked by train.early_stopping.metric, default "
                                "eval_loss): an evaluation that improves on the best is checkpointed (that "
                                "checkpoint is kept beyond train.save_total_limit while it is the best) and exported "
                                "to <output_dir>/best/, in final/'s format.")
    eval_prompts: list = _f([], "Prompts answered greedily at each evaluation (the continuous engine; the static "
                                "model.generate where it cannot serve the model), logged to metrics.jsonl "
                                "(eval_samples) and the trackers' text tab. A string is a user turn in the run's chat "
                                "template; {text: ...} is continued as it is (plain-text training).")
    eval_prompts_max_new_tokens: int = _f(64, "New tokens at most per train.eval_prompts answer.")
    report_to: list = _f(["tensorboard"], "accelerate trackers to log to (tensorboard, wandb, mlflow, ...; "
                                          "installed separately except tensorboard); [] for none.")
    tracker_project: Optional[str] = _f(None, "The wandb project and the mlflow experiment (tensorboard writes to "
                                              "<output_dir>/tensorboard). Null: the output folder's name.")
    tracker_entity: Optional[str] = _f(None, "wandb entity (team or user); null: wandb's default.")
    run_name: Optional[str] = _f(None, "The run's name in wandb and mlflow; null: the output folder's name.")
    monitor_interval_s: float = _f(2.0, "Sample GPU (NVML) / CPU utilisation and memory every N seconds in the "
                                        "background (metrics.jsonl, report.json); 0: off.")
    price_per_hour: float = _f(0.0, "Price of one hour per train.price_unit, for the cost so far and projected in "
                                    "the log lines, report.json and harness plan; 0: not priced.")
    price_unit: Literal["machine", "gpu"] = _f("machine", "What train.price_per_hour is for: one machine, or one "
                                                          "GPU (multiplied by the number of processes).")
    summary: bool = _f(True, "At the end, print the key figures and write summary.md and plots/*.png "
                             "(harness summary RUN_DIR writes them later too).")
    progress_bar: bool = _f(True, "Show a tqdm progress bar on the main process.")
    profile_steps: int = _f(0, "Profile this many training steps with torch.profiler once the run has settled "
                               "(from the 11th step of the attempt): <output_dir>/profile/ ops.txt (top operators by "
                               "device time), summary.json (device time by kernel kind, idle share), trace.json.gz "
                               "(Perfetto). 0: off.")
    save_final: bool = _f(True, "Export the trained model and tokenizer to <output_dir>/final in HF format.")
    save_final_checkpoint: bool = _f(True, "Also checkpoint the last step (weights, optimizer state, data position; "
                                           "within train.save_total_limit), so that a rerun with a larger "
                                           "train.max_steps continues exactly where the run ended. false: the run "
                                           "ends with the export alone (no disk or time for the optimizer state of "
                                           "a large model); a longer rerun continues from the last periodic "
                                           "checkpoint.")
    stop_at_step: int = _f(0, "End this attempt after this many steps of the planned run, with a checkpoint and "
                            "no export (split a run across sessions; continue with train.resume=auto); 0: off.")
    save_every_steps: int = _f(0, "Write a full training checkpoint every N optimizer steps; 0: never.")
    max_nonfinite_skips: int = _f(3, "Skip an optimizer step whose gradient is NaN/inf, up to this many in a row; "
                                     "then stop with a checkpoint of the last good weights (exit 1).")
    save_every_minutes: float = _f(30.0, "Also checkpoint when this many minutes passed since the last save, so "
                                         "that a preemptible box loses at most this much work (default 30 min); "
                                         "0: off.")
    time_budget_hours: float = _f(0.0, "Wall-clock window of this attempt: stop in time for a final checkpoint and "
                                       "export before it closes; 0: no window.")
    save_total_limit: int = _f(2, "Keep only the newest N complete checkpoints; 0: keep all.")
    resume: Optional[str] = _f(
        "auto", "auto: continue from the newest complete checkpoint in output_dir if there is one; "
        "a checkpoint folder; or null to start fresh (refused when output_dir already holds checkpoints). A run "
        "whose report.json says it finished is not run again: the rerun prints where its outputs are and exits 0."
    )
    resume_changed_data: bool = _f(
        False, "A resume whose training data files changed since the checkpoint (size, first or last 64 KiB): false "
        "refuses it in one line naming the file; true trains the new data from the start of a new epoch (weights, "
        "optimizer and schedule continue), said in one line and in report.json's resumed_changes.")
    overwrite: bool = _f(False, "Start over in an output_dir that holds a finished or interrupted run: its "
                                "checkpoints/, final/, metrics.jsonl, report.json, summary.md, plots/ and "
                                "tensorboard/ are deleted first (not kept aside); only in a folder that holds a harness run "
                                "(its config.yaml).")
    deepspeed: Optional[str] = _f(
        None, "DeepSpeed config for runs without a DeepSpeed accelerate launcher: a JSON path or a shipped name "
        "(zero0, zero1, zero2, zero2_offload, zero3, zero3_offload)."
    )


@dataclass
class RftConfig:
    """Rejection-sampling fine-tuning (harness/rft): `harness rft generate | train | test`."""

    task: str = _f("arithmetic", "arithmetic (generated sums, differences, products and unit conversions) or a "
                                 "JSONL file of {question, answer} records with numeric answers.")
    test_file: Optional[str] = _f(None, "JSONL task: the held-out {question, answer} file for `rft test`.")
    num_train_questions: int = _f(200, "arithmetic: questions in the split that `rft generate` answers.")
    num_test_questions: int = _f(100, "arithmetic: held-out questions for `rft test`.")
    num_sft_questions: int = _f(300, "arithmetic: questions with worked answers for a supervised warm-up "
                                     "(`rft sft-data`); disjoint from the other splits.")
    max_operand: int = _f(20, "arithmetic: operands are drawn from 0..max_operand.")
    task_seed: int = _f(0, "Seed of the generated questions and splits.")
    tolerance: float = _f(1e-6, "Verifier: |answer - reference| <= tolerance * max(1, |reference|).")
    oversample: int = _f(8, "Sampled answers per question.")
    temperature: float = _f(1.0, "Sampling temperature of `rft generate` (`rft test` decodes greedily).")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    top_k: int = _f(0, "Sample among the top_k most likely tokens only (transformers' TopKLogitsWarper); 0: off.")
    min_p: float = _f(0.0, "Drop the tokens whose probability is under min_p x the most likely one's "
                           "(transformers' MinPLogitsWarper, after temperature); 0: off.")
    max_new_tokens: int = _f(48, "Tokens generated per answer at most.")
    questions_per_batch: int = _f(16, "Questions per generation batch (each with `oversample` sequences); a batch "
                                      "is the unit of progress that a restarted run does not redo.")
    engine: Literal["continuous", "static", "vllm", "transformers"] = _f(
        "continuous", "Generation engine of `rft generate | test | bench`: continuous (finished sequences leave the "
                      "batch, waiting ones enter; a prompt prefilled once for its samples), static (model.generate "
                      "over fixed batches of repeated prompts), vllm (when installed), transformers "
                      "(transformers' own continuous batching, model.generate_batch).")
    micro_batch_sequences: int = _f(256, "Sequences in flight at most (continuous; fewer when rft.kv_cache_gb holds "
                                         "fewer) or per generate() call (static); halved on a CUDA out-of-memory "
                                         "error.")
    compile: Optional[bool] = _f(None, "continuous: compile the decode step (torch.compile, fullgraph; CUDA graphs "
                                       "per batch bucket on CUDA). null: on CUDA, off on CPU (docs/rft.md).")
    kv_cache_gb: Optional[float] = _f(None, "continuous: KV-cache budget in GiB that sets the sequences in flight "
                                            "(null: 90% of the free GPU memory after the model; 4 on CPU).")
    stop_strings: list = _f([], "Strings that end an answer (besides EOS); the text keeps the stop string.")
    pairs_per_question: int = _f(0, "`rft generate` also writes pairs.jsonl: per question at most this many "
                                    "preference pairs (a verified answer, a failed one; TRL's format). 0: none.")
    keep_per_question: int = _f(4, "Distinct verified answers kept per question at most.")
    output_dir: str = _f("runs/rft/generate", "`rft generate` folder: shards/ (append-only, per rank), rft.jsonl "
                                              "(the kept examples as chat records), stats.json.")
    seed: int = _f(0, "Sampling seed: each answer is seeded from it, its question's id and its index "
                      "(rft.engine=continuous: a restarted `rft generate` draws what an uninterrupted run would; "
                      "static: each batch from its first question); recorded in the shards' settings.")


@dataclass
class RlConfig:
    """loss.mode=rl (harness/rl, docs/rl.md) on the rft section's task, prompt, sampling settings and verifier."""

    algorithm: Literal["grpo"] = _f("grpo", "grpo: group-relative advantages (TRL's GRPOTrainer).")
    questions_per_step: int = _f(16, "Questions per generation batch, over all processes and grad_accum micro-batches.")
    num_generations: int = _f(8, "Answers sampled per question (its group); >= 2.")
    scale_rewards: Literal["group", "batch", "none"] = _f("group", "Advantage = reward - group mean, divided by the "
                                                                   "group's std, the batch's, or not (TRL's).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = _f("dapo", "TRL's loss_type (docs/rl.md).")
    epsilon: float = _f(0.2, "Lower clip of the ratio: 1 - epsilon.")
    epsilon_high: Optional[float] = _f(None, "Upper clip of the ratio: 1 + epsilon_high (null: epsilon).")
    beta: float = _f(0.0, "KL weight to the starting model (k3); 0: no reference model kept or run.")
    iterations: int = _f(1, "Optimizer steps per generation batch (old log-probs kept for the ratio).")
    reward: str = _f("verifier", "verifier (1 verified, 0 otherwise) or module:function, fn(question, text) -> float.")
    prompts: list = _f([], "Prompt data (sources as data.train_files: JSONL, parquet, CSV, hub): a `prompt` per record "
                           "(text or chat messages, in the model's chat template), the other columns handed to "
                           "rl.rewards. Empty: the rft task's questions.")
    rewards: list = _f([], "Reward functions [{function: module:name | verifier, weight}], each called as TRL's "
                           "fn(prompts, completions, completion_ids, **columns) -> list[float | None], their weighted "
                           "sum the reward; logged as reward/<name>. Empty: rl.reward.")
    log_completions: int = _f(0, "Prompt / completion / reward rows (the main process's first) in each log line "
                                 "(metrics.jsonl `completions`, tensorboard's text tab). 0: none.")
    mask_truncated_completions: bool = _f(False, "Leave out of the loss the answers cut at rft.max_new_tokens "
                                                 "(no EOS or stop string; TRL's mask_truncated_completions).")
    tools: list = _f([], "Tool functions [module:name | path/file.py:name] offered to the model through the chat "
                         "template's tools= (type-hinted, docstringed; TRL's tools); multi-turn episodes "
                         "(docs/agents.md).")
    environment: Union[str, dict, None] = _f(
        None, "A class module:Class | path/file.py:Class (TRL's environment_factory), or {name: spec} chosen by each "
              "record's `environment` column: one instance per episode, reset(**record columns), its public methods "
              "the tools, get_reward() one more reward (docs/agents.md).")
    max_tool_calls: int = _f(8, "Tool-calling turns an episode takes at most (TRL's max_tool_calling_iterations).")
    importance_sampling: Literal["token", "sequence"] = _f(
        "token", "The ratio per token (GRPO) or one per answer from its mean log-ratio (GSPO; TRL's "
                 "importance_sampling_level).")
    rows: Literal["shared_prompts", "packed", "padded"] = _f(
        "shared_prompts", "The training pass's rows: shared_prompts: each prompt once for several of its answers, "
                          "packed without padding (a custom 4D mask: sdpa attention; packed otherwise); packed: "
                          "prompt + answer packed without padding (per-answer position ids); padded: one "
                          "right-padded answer a row (docs/rl.md).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rft: RftConfig = field(default_factory=RftConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)

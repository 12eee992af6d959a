"""Everything a training run is made of, built from its config: `build_run(cfg, opened) -> Job`.

In order: precision, the Accelerator (DDP or DeepSpeed, compile), the output folder's lock (one run per folder),
with train.overwrite=true the previous run's outputs deleted, the checkpoint to resume from (before anything heavy),
the utilisation sampler; the tokenizer and the data loaders; the model (the same seed on every process: identical
initial weights), the optimizer and the schedule, `accelerator.prepare`; the objective. What the
run opens is registered with `opened` (an ExitStack), so that it is closed however the run ends.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from harness import hardware, moe, optim, rundir
from harness.checkpoint import resume
from harness.speed.compiling import CompileWatch
from harness.config import Config
from harness.config.checks import quantization_zero3_error
from harness.config.profiles import shapes_vary, static_shapes
from harness.data import loaders
from harness.data.checks import check_data
from harness.data import vision
from harness.distributed import collectives, processes, sequence
from harness.distributed.zero import (model_init_context, parameters_held, planned_weights, repair_stage0_optimizer,
                                      zero_info)
from harness.errors import ConfigError, HarnessError
from harness.observe import metrics, monitor
from harness.observe.record import RunRecord
from harness.observe.timing import Timings
from harness.state import LoopState
from harness.config.profiles import resolve_compile
from harness.config.modes import facts
from harness import model as model_lib
from harness import modes
from harness.objective import Parts
from harness.speed.float8 import check_fp8
from harness.speed import float8


@dataclass(frozen=True)
class Job:
    """A built run: the objects the loop works with, built once at the end of `build_run` from what the build steps
    return (frozen: nothing is assigned later). Facts only the report states are in `record` (observe/ reads it)."""

    cfg: Config
    accelerator: Any
    say: Callable[[str], None]  # prints on the main process
    out: Path
    t_process: float  # the process's own start (the time window counts from it)
    timings: Timings
    precision: str
    zero: dict  # zero_stage, offload_optimizer, offload_param
    compile: Optional[CompileWatch]  # None without torch.compile
    tokenizer: Any
    data: loaders.RunData  # loaders before prepare, eval sets, stats
    model: Any
    optimizer: Any
    scheduler: Any
    objective: Any
    streams: tuple  # names of the training data streams ("emb", "gen"); the first defines epochs
    loaders: dict  # prepared training loaders by stream name
    schedule: dict  # loaders.schedule_steps: micro_per_epoch, steps_per_epoch, total_steps
    weights: str  # dtype of the trained parameters once prepared (train.weights): fp32, bf16, fp16
    sp: Optional[sequence.SequenceParallel]  # train.sequence_parallel > 1: this process's group; else None
    resume_from: Optional[Path]  # the checkpoint this attempt continued from (None: a fresh start)
    record: RunRecord  # what only the report reads

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks (processes / train.sequence_parallel): what the global batch counts."""
        return sequence.dp_world(self.cfg.train.sequence_parallel, self.world)

    @property
    def is_deepspeed(self) -> bool:
        return processes.is_deepspeed(self.accelerator)

    @property
    def accum(self) -> int:
        return self.cfg.train.grad_accum

    @property
    def primary(self) -> str:
        """The stream that defines epochs: the embedding data in unified mode."""
        return self.streams[0]

    @property
    def epoch_rows(self) -> dict:
        """Rows (packed rows, query groups) an epoch per training stream."""
        return epoch_rows(self.data, self.streams)

    @property
    def total_steps(self) -> int:
        return self.schedule["total_steps"]


@dataclass(frozen=True)
class Started:
    """What `start_processes` returns: the processes' set-up, before data and model."""

    cfg: Config
    accelerator: Any
    out: Path
    t_process: float
    precision: str
    zero: dict
    compile: Optional[CompileWatch]
    resume: resume.Start
    record: RunRecord
    sp: Optional[sequence.SequenceParallel]


@dataclass(frozen=True)
class Built:
    """What `build_model` returns: the prepared model, optimizer, schedule, loaders and objective."""

    model: Any
    optimizer: Any
    scheduler: Any
    objective: Any
    loaders: dict
    schedule: dict
    weights: str
    parameters: int
    held: list
    peak_flops: Optional[float]


def build_run(cfg: Config, opened: contextlib.ExitStack) -> tuple[Job, LoopState]:
    """The run's parts, and the loop state to train from (a checkpoint's, restored after prepare(), or step 0's)."""
    # the data entries and the chat template, before anything starts or is written
    check_data(cfg.data, cfg.rl.prompts, cfg.distill.prompts)
    started = start_processes(cfg, opened)
    cfg, accelerator, say = started.cfg, started.accelerator, started.accelerator.print
    tokenizer, data = build_data(cfg, accelerator, say)
    built = build_model(started, tokenizer, data)
    describe_batch(cfg, sequence.dp_world(cfg.train.sequence_parallel, accelerator.num_processes), built,
                   data.streams, say)
    # only now: a data or model error leaves the folder's config.yaml (which describes its checkpoints) as it was
    collectives.on_main(accelerator, lambda: rundir.write_run_files(cfg, started.out, started.record.env))
    resumed = resume.restore(started.resume, accelerator, built.weights, epoch_rows(data, data.streams),
                             built.schedule["total_steps"], say, scheduler=built.scheduler)
    record = replace(started.record, parameters=built.parameters, held=built.held, peak_flops=built.peak_flops,
                     resize=resumed.resize, resume_changes=resumed.changes)
    job = Job(cfg=cfg, accelerator=accelerator, say=say, out=started.out, t_process=started.t_process,
              timings=Timings(), precision=started.precision, zero=started.zero, compile=started.compile,
              tokenizer=tokenizer, data=data, model=built.model, optimizer=built.optimizer, scheduler=built.scheduler,
              objective=built.objective, streams=data.streams, loaders=built.loaders, schedule=built.schedule,
              weights=built.weights, sp=started.sp, resume_from=resumed.path, record=record)
    return job, resumed.state


def epoch_rows(data: loaders.RunData, streams: tuple) -> dict:
    """Rows (packed rows, query groups) an epoch per training stream."""
    return {n: loaders.epoch_size(data.loader(n)) for n in streams}


def weights_dtype(model) -> str:
    """The dtype the trained parameters are stored in, as the run ended up with it (train.weights; DeepSpeed's
    bf16/fp16 modes cast them, its torch_autocast keeps them fp32): fp32, bf16 or fp16."""
    dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def check_machine(cfg: Config) -> str:
    """What this machine and this launch refuse in a config that loaded: the precision (returned, resolved), fp8, the
    attention kernel, sequence parallelism's launch, the DeepSpeed JSONs. One-line ConfigErrors; train.py checks
    them before it looks at the run folder, so a finished run still rejects a bad override."""
    precision = hardware.resolve_precision(cfg.train.precision)
    if precision == "fp8":
        check_fp8(cfg.model.quantization)
    hardware.check_attention(cfg.model.attn_implementation)
    sequence.check_launch(cfg.train.sequence_parallel, processes.launched_world(), processes.deepspeed_wanted(cfg.train),
                          processes.cpu_forced())
    processes.check_deepspeed_configs(cfg.train)
    return precision


def start_processes(cfg: Config, opened: contextlib.ExitStack) -> Started:
    """Precision, the Accelerator, the output folder's lock, the resume target, the compiler's start-up, the sampler
    (config.yaml and environment.json are written by build_run once the data and the model are built)."""
    t_start, t_process = time.time(), hardware.process_start_time()
    # resumed under another number of processes: the checkpoint's global batch, split for this one (before the
    # Accelerator, whose accumulation and DeepSpeed batch settings follow the config)
    plan = resume.plan(cfg, processes.launched_world())
    cfg = plan.cfg
    out = Path(cfg.train.output_dir)
    precision = check_machine(cfg)
    compute = hardware.compute_precision(precision)  # fp8: bf16 outside the float8 Linear layers
    # bf16 weights: DeepSpeed's fp32 master copies
    train, weights_note = processes.route_weights(cfg.train, cfg.model.quantization, compute)
    cfg = replace(cfg, train=train)
    compile_mode = resolve_compile(cfg.train.compile, torch.cuda.is_available())
    compile_mode, compile_note = sequence.compile_mode(cfg.train.sequence_parallel, cfg.train.compile, compile_mode)
    trackers = monitor.tracker_list(cfg.train.report_to, cfg.train.output_dir)  # tensorboard: <output_dir>/tensorboard
    static = static_shapes(cfg.data, cfg.loss.mode, compile_mode, processes.deepspeed_wanted(cfg.train) is not None)
    accelerator = processes.make_accelerator(cfg.train, cfg.optim.max_grad_norm,
                                             shapes_vary(cfg.loss.mode, cfg.data.packing),
                                             hardware.accelerate_mixed_precision(compute), compile_mode, trackers,
                                             static_shapes=static)
    opened.push(processes.end_training(accelerator))
    for note in (weights_note, compile_note):
        if note:
            accelerator.print(note)
    rundir.hold(out, accelerator, opened)  # one run per output folder
    if cfg.train.overwrite:
        collectives.on_main(accelerator, lambda: rundir.start_over(out, accelerator.print))
    zero = zero_info(accelerator)
    sequence.check_stage(cfg.train.sequence_parallel, zero["zero_stage"])
    sp = sequence.start(cfg.train.sequence_parallel, accelerator)  # the groups of N consecutive ranks
    weights = planned_weights(compute, cfg.train.weights, processes.is_deepspeed(accelerator))
    # the checkpoint to resume from: verified, agreed, checked against the schedule, the engine and the weights
    start = resume.choose(replace(plan, cfg=cfg), accelerator, out, zero["zero_stage"], weights)
    # the compiler's model-independent start-up (imports, CPU ISA probe, worker pool) overlaps the set-up below
    watch = CompileWatch(compile_mode, accelerator.device, zero["zero_stage"]) if compile_mode != "none" else None
    if watch is not None:
        opened.callback(watch.close)
    tf32 = hardware.enable_tf32(cfg.train.tf32)
    sampler = monitor.start_sampler(cfg.train.monitor_interval_s, accelerator.is_main_process)  # GPU/CPU utilisation
    if sampler is not None:
        opened.callback(sampler.stop)
    env = hardware.environment_report()
    env["malloc"] = hardware.reuse_freed_memory(cfg.train.malloc_reuse)  # before the data and the model are built
    if not accelerator.is_main_process:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    stored = f" ({weights} weights)" if compute == "bf16" else ""  # (planned_weights: train.weights in bf16)
    ranks = f" ({sp.dp_size} data-parallel x sequence parallel {sp.size})" if sp else ""
    accelerator.print(f"[harness] {accelerator.num_processes} process(es){ranks}, {accelerator.distributed_type.value}, "
                      f"ZeRO stage {zero['zero_stage']}, device {accelerator.device}, precision {precision}{stored}, tf32 "
                      f"{tf32}, compile {compile_mode}, profile {cfg.train.profile}, torch {env['torch']}, loss "
                      f"{cfg.loss.mode}")
    accelerator.print(f"[harness] environment: {hardware.describe(env)}")
    for note in start.notes:
        accelerator.print(note)
    record = RunRecord(t_start=t_start, env=env, tf32=tf32, sampler=sampler)
    return Started(cfg=cfg, accelerator=accelerator, out=out, t_process=t_process, precision=precision, zero=zero,
                   compile=watch, resume=start, record=record, sp=sp)


def build_data(cfg: Config, accelerator, say: Callable[[str], None]) -> tuple[Any, loaders.RunData]:
    mode = facts(cfg.loss.mode)
    tokenizer = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    processor = None
    if vision.is_vision(cfg.model):  # a vision-language model: its processor (the tokenizer's vision markers added)
        vision.check_vision_run(cfg.data, mode)
        processor = vision.load_processor(cfg.model, tokenizer)
    # a mode's own stream (rl: the task's train questions, as indices; distill: distill.prompts', in place of
    # data.train_files, which the loaders then do not read: they are handed none)
    own = modes.own_stream(cfg, accelerator)
    d = replace(cfg.data, train_files=[]) if own is not None and mode.gen_rows == "sequences" else cfg.data
    data = loaders.build_loaders(d, cfg.train, mode, cfg.model.pooling, accelerator, tokenizer, processor)
    if own is not None:
        source, loader = own
        data = replace(data, source=source, gen=loader)
    for kind, st in data.stats.items():
        say(f"[harness] {kind} data: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in st.items()
                                                    if k not in ("dropped_examples", "instructions")))
        if st.get("dropped_no_labels"):
            say(f"[harness] warning: dropped samples with no trained token, e.g. {', '.join(st['dropped_examples'])}")
    return tokenizer, data


def build_model(started: Started, tokenizer, data: loaders.RunData) -> Built:
    """Model, optimizer and schedule (same seed on every rank: identical initial weights), prepared; the loss mode's
    object (harness/modes/), which does its own set-up."""
    cfg, accelerator, say = started.cfg, started.accelerator, started.accelerator.print
    model, parameters, matmul_params = make_model(started, tokenizer)
    optimizer = optim.build_optimizer(model, cfg.optim, offload=started.zero["offload_optimizer"] not in (None, "none"))
    primary = data.loader(data.streams[0])
    dp = started.sp.dp_size if started.sp else accelerator.num_processes
    schedule = loaders.schedule_steps(loaders.epoch_size(primary), primary.batch_size, dp, cfg.train.grad_accum,
                                      cfg.train.max_steps, cfg.train.epochs)  # harness plan's arithmetic too
    # The schedule acts on the raw optimizer's param groups, which DeepSpeed's ZeRO optimizers keep using. It is not
    # prepared (accelerate would step it once per process) but stepped once per optimizer step, and checkpointed.
    scheduler = optim.build_scheduler(optimizer, cfg.optim, schedule["total_steps"])
    accelerator.register_for_checkpointing(scheduler)
    model, optimizer, prepared = prepare(started, model, optimizer, data)
    weights = weights_dtype(model)
    repair_stage0_optimizer(optimizer)  # DeepSpeed without ZeRO: its start-up step undone
    mconf = accelerator.unwrap_model(model, keep_torch_compile=False).config
    flop_dims = (matmul_params, getattr(mconf, "num_hidden_layers", 0), getattr(mconf, "hidden_size", 0))
    objective = modes.build(cfg, Parts(
        accelerator=accelerator, model=model, tokenizer=tokenizer, data=data, say=say,
        zero_stage=started.zero["zero_stage"], sp=started.sp, flop_dims=flop_dims,
        convert=float8.convert_blocks if started.precision == "fp8" else None))
    held = accelerator.gather(torch.tensor([parameters_held(model)], device=accelerator.device)).tolist()
    peak_flops = None  # all processes together; None where unknown (CPU)
    if torch.cuda.is_available():
        peak_one, _ = hardware.peak_flops(torch.cuda.get_device_name())
        peak_flops = peak_one * accelerator.num_processes if peak_one else None  # (sequence-parallel ones included)
    return Built(model=model, optimizer=optimizer, scheduler=scheduler, objective=objective,
                 loaders=dict(zip(data.streams, prepared)), schedule=schedule, weights=weights, parameters=parameters,
                 held=held, peak_flops=peak_flops)


def make_model(started: Started, tokenizer) -> tuple[Any, int, int]:
    """(the model, its parameters, the parameters of its matmuls): built with the same seed on every rank, in
    ZeRO-3's partitioned init where it applies, fp8's float8 blocks, the embedding modes' support checked."""
    from accelerate.utils import set_seed

    cfg, say, zero, sp = started.cfg, started.accelerator.print, started.zero, started.sp
    mode = facts(cfg.loss.mode)
    if cfg.model.quantization != "none" and zero["zero_stage"] == 3:  # a launcher's ZeRO-3; checks.py: the rest
        raise ConfigError(quantization_zero3_error(cfg.model.quantization, "the accelerate config's DeepSpeed"))
    set_seed(cfg.train.seed)
    with model_init_context(started.accelerator, cfg.model.name_or_path is None or cfg.model.random_init):
        model = model_lib.build_model(cfg.model, tokenizer, precision=hardware.compute_precision(started.precision),
                                       packed_causal=mode.packs_causal and cfg.data.packing and sp is None)
    if started.precision == "fp8":  # the blocks' Linear layers in float8 (LoRA's frozen base layers too)
        say(float8.describe(*float8.convert_blocks(model)))
    # MoE, before prepare() hooks the model: ZeRO-3's gathers per block; elsewhere every separate expert in each pass
    line = moe.register_zero3_leaves(model) if zero["zero_stage"] == 3 else moe.tie_separate_experts(model)
    if line:
        say(line)
    if mode.embeds:
        model_lib.check_embedding_support(model.config.model_type, model.config._attn_implementation,
                                          cfg.model.embed_attention)
    if started.compile is not None:
        started.compile.model_built(model)
    if sp is not None:  # DeepSpeed's Ulysses all-to-all around the attention kernel of training passes
        say(f"[harness] sequence parallel {sp.size}: Ulysses attention around "
            f"{sequence.install_attention(sp, model, cfg.train.micro_batch_size)}, groups of {sp.size} consecutive "
            f"processes, each 1/{sp.size} of every row's positions")
    # MoE: the experts' matmuls at top-k / E (the active parameters a token meets)
    return model, model_lib.count_parameters(model), moe.active_matmul_params(model, metrics.matmul_params(model))


def prepare(started: Started, model, optimizer, data: loaders.RunData) -> tuple[Any, Any, list]:
    """accelerate.prepare of the model, the optimizer and the training loaders (a data.streaming loader deals its
    own slices and is checkpointed with its state; sequence parallelism's loaders are sharded over the data-parallel
    ranks); the regional compile narrowed to the blocks. Returns (model, optimizer, loaders in stream order)."""
    accelerator, sp, streams = started.accelerator, started.sp, data.streams
    streamed = {n: data.loader(n) for n in streams if hasattr(data.loader(n), "batches")}
    model, optimizer, *prepared = accelerator.prepare(model, optimizer, *[data.loader(n) for n in streams
                                                                          if n not in streamed])
    prepared = [streamed[n] if n in streamed else prepared.pop(0) for n in streams]
    for stream in streamed.values():
        accelerator.register_for_checkpointing(stream)
    if sp is not None:  # the group's processes read the same rows: loaders sharded over the data-parallel ranks
        mine = sequence.dp_loaders(accelerator, sp, [data.loader(n) for n in streams])
        accelerator._dataloaders = [d for d in accelerator._dataloaders if d not in prepared] + mine
        prepared = mine
    if started.compile is not None:
        started.compile.model_prepared(model, accelerator.print, accelerator.state.dynamo_plugin.to_kwargs())
    return model, optimizer, prepared


def describe_batch(cfg: Config, world: int, built: Built, streams: tuple, say: Callable[[str], None]) -> None:
    """Check that the global batch divides as configured; print it with the schedule."""
    t, accum = cfg.train, cfg.train.grad_accum
    if t.global_batch_size and t.micro_batch_size * accum * world != t.global_batch_size:
        raise HarnessError(f"config key 'train.global_batch_size': {t.global_batch_size} is not micro-batch "
                           f"{t.micro_batch_size} x grad_accum {accum} x {world} process(es); fix one of them, or "
                           f"use train.micro_batch_size=auto")
    parts = []
    if "gen" in built.loaders:  # the mode's rows: sequences, pairs (chosen and rejected), questions x answers
        parts.append(built.objective.describe_rows(t.micro_batch_size * accum * world))
    if "emb" in built.loaders:
        contrastive = t.emb_micro_batch_size * (world if cfg.loss.gather_negatives else 1)
        parts.append(f"{t.emb_micro_batch_size * accum * world} queries x {cfg.data.train_group_size} passages "
                     f"(contrastive batch {contrastive} queries)")
    s, held = built.schedule, built.held
    n = t.sequence_parallel
    sp_note = f" (sequence parallel {n}: {world * n} processes)" if n > 1 else ""
    say(f"[harness] model: {built.parameters / 1e6:.2f}M parameters ({', '.join(f'{h / 1e6:.2f}M' for h in held)}"
        f" held per rank); global batch per step: {' + '.join(parts)} = micro-batch x accumulation {accum} x "
        f"{world} {'data-parallel ' if t.sequence_parallel > 1 else ''}process(es)"
        f"{sp_note}; " + (f"{s['steps_per_epoch']} steps/epoch of {streams[0]} data; {s['total_steps']} steps "
                          f"({s['total_steps'] / s['steps_per_epoch']:.2f} epochs)" if s["steps_per_epoch"] < 1 << 40
                          else f"{s['total_steps']} steps (train.max_steps; a streamed epoch of unknown size)"))

"""Everything a training run is made of, built from its config: `build_run(cfg, opened) -> Job`.

In order: precision, the Accelerator (DDP or DeepSpeed, compile), the output folder's lock (one run per folder),
with train.overwrite=true the previous run's outputs deleted, the checkpoint to resume from (before anything heavy),
the utilisation sampler; the tokenizer and the data loaders; the model (the same seed on every process: identical
initial weights), the optimizer and the schedule, `accelerator.prepare`; the objective. What the
run opens is registered with `opened` (an ExitStack), so that it is closed however the run ends.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from harness import distributed, hardware, optim, runlock
from harness.checkpoint import elastic, store
from harness.checkpoint.manifest import MARKER, STATE_FILE
from harness.compiling import CompileWatch
from harness.config import Config, save_config
from harness.config.checks import quantization_zero3_error
from harness.data import loaders
from harness.errors import ConfigError, HarnessError
from harness.files import write_json
from harness.observe import metrics, monitor
from harness.observe.timing import Timings


@dataclass
class Job:
    """A built run: the objects the loop works with and the facts its report states."""

    cfg: Config
    accelerator: Any
    say: Callable[[str], None]  # prints on the main process
    out: Path
    t_start: float  # this process's run() start (time.time())
    t_process: float  # the process's own start (the time window counts from it)
    timings: Timings
    resume_from: Optional[Path]
    precision: str
    tf32: bool
    env: dict  # hardware.environment_report()
    zero: dict  # zero_stage, offload_optimizer, offload_param
    compile: Optional[CompileWatch]  # None without torch.compile
    sampler: Optional[monitor.UtilisationSampler]
    tokenizer: Any = None
    data: Optional[loaders.RunData] = None  # loaders before prepare, eval sets, stats
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    objective: Any = None
    streams: tuple = ()  # names of the training data streams ("emb", "gen"); the first defines epochs
    loaders: dict = None  # prepared training loaders by stream name
    schedule: dict = None  # loaders.schedule_steps: micro_per_epoch, steps_per_epoch, total_steps
    parameters: int = 0
    held: list = None  # parameter elements held by each rank
    resize: Optional[elastic.Resize] = None  # resumed under another number of processes: the batch's new split
    universal: bool = False  # the ZeRO checkpoint loads through a universal checkpoint (another process count / stage)
    peak_flops: Optional[float] = None  # all processes together; None where unknown (CPU)
    weights: Optional[str] = None  # dtype of the trained parameters once prepared (train.weights): fp32, bf16, fp16

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_deepspeed(self) -> bool:
        return self.zero["zero_stage"] is not None

    @property
    def accum(self) -> int:
        return self.cfg.train.grad_accum

    @property
    def primary(self) -> str:
        """The stream that defines epochs: the embedding data in unified mode."""
        return self.streams[0]

    @property
    def layout(self) -> elastic.Layout:
        """How this attempt splits the global batch (saved with every checkpoint)."""
        return elastic.layout_of(self.cfg, self.world, self.zero["zero_stage"], self.weights)

    @property
    def epoch_rows(self) -> dict:
        """Rows (packed rows, query groups) an epoch per training stream."""
        return {n: len(self.data.loader(n).dataset) for n in self.streams}

    @property
    def total_steps(self) -> int:
        return self.schedule["total_steps"]


def build_run(cfg: Config, opened: contextlib.ExitStack) -> Job:
    job = start_processes(cfg, opened)
    build_data(job)
    build_model(job)
    describe_batch(job)
    # only now: a data or model error leaves the folder's config.yaml (which describes its checkpoints) as it was
    distributed.on_main(job.accelerator, lambda: write_run_files(job))
    return job


def weights_dtype(model) -> str:
    """The dtype the trained parameters are stored in, as the run ended up with it (train.weights; DeepSpeed's
    bf16/fp16 modes cast them, its torch_autocast keeps them fp32): fp32, bf16 or fp16."""
    dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def write_run_files(job: Job) -> None:
    """config.yaml and environment.json (main process); a full disk is one line, with nothing cut left behind."""
    for name, write in (("config.yaml", lambda p: save_config(job.cfg, p)),
                        ("environment.json", lambda p: write_json(p, job.env))):
        try:
            write(job.out / name)
        except OSError as e:
            raise HarnessError(f"could not write {job.out / name} ({type(e).__name__}: {e}); nothing was trained: free "
                               f"some space, then rerun") from None


def start_processes(cfg: Config, opened: contextlib.ExitStack) -> Job:
    """Precision, the Accelerator, the output folder's lock, the resume target, the compiler's start-up, the sampler
    (config.yaml and environment.json are written by build_run once the data and the model are built)."""
    from harness.config.profiles import resolve_compile

    t_start, t_process = time.time(), hardware.process_start_time()
    # resumed under another number of processes: the checkpoint's global batch, split for this one (before the
    # Accelerator, whose accumulation and DeepSpeed batch settings follow the config)
    cfg, resize = elastic.fit_to_world(cfg, distributed.launched_world())
    out = Path(cfg.train.output_dir)
    precision = hardware.resolve_precision(cfg.train.precision)
    cfg, weights_note = distributed.route_weights(cfg, precision)  # bf16 weights: DeepSpeed's fp32 master copies
    hardware.check_attention(cfg.model.attn_implementation)
    compile_mode = resolve_compile(cfg.train.compile, torch.cuda.is_available())
    trackers = monitor.tracker_list(cfg.train.report_to, cfg.train.output_dir)  # tensorboard: <output_dir>/tensorboard
    accelerator = distributed.make_accelerator(cfg, hardware.accelerate_mixed_precision(precision), compile_mode,
                                               trackers)
    opened.push(distributed.end_training(accelerator))
    if weights_note:
        accelerator.print(weights_note)
    hold_output_dir(out, accelerator, opened)  # one run per output folder
    if cfg.train.overwrite:
        distributed.on_main(accelerator, lambda: start_over(out, accelerator.print))
    resume = None if cfg.train.overwrite else cfg.train.resume
    resume_from, incomplete = store.resolve_resume(out, resume, accelerator)  # verified, agreed
    if cfg.train.max_steps > 0:  # (with epochs, resume_or_start checks once the schedule is known)
        past_the_schedule(resume_from, cfg.train.max_steps)
    # the compiler's model-independent start-up (imports, CPU ISA probe, worker pool) overlaps the set-up below
    zero = distributed.zero_info(accelerator)
    weights = distributed.planned_weights(precision, cfg.train.weights, zero["zero_stage"] is not None)
    universal = elastic_checks(resume_from, cfg, accelerator.num_processes, zero["zero_stage"], weights)
    if universal:
        elastic.load_universal(accelerator)
    watch = CompileWatch(compile_mode, accelerator.device, zero["zero_stage"]) if compile_mode != "none" else None
    tf32 = hardware.enable_tf32(cfg.train.tf32)
    sampler = monitor.start_sampler(cfg.train.monitor_interval_s, accelerator.is_main_process)  # GPU/CPU utilisation
    if sampler is not None:
        opened.callback(sampler.stop)
    job = Job(cfg=cfg, accelerator=accelerator, say=accelerator.print, out=out, t_start=t_start, t_process=t_process,
              timings=Timings(), resume_from=resume_from, precision=precision, tf32=tf32,
              env=hardware.environment_report(), zero=zero, compile=watch,
              sampler=sampler, resize=resize, universal=universal)
    if not accelerator.is_main_process:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    stored = f" ({weights} weights)" if precision == "bf16" else ""  # (planned_weights: train.weights in bf16)
    job.say(f"[harness] {job.world} process(es), {accelerator.distributed_type.value}, ZeRO stage "
            f"{job.zero['zero_stage']}, device {accelerator.device}, precision {precision}{stored}, tf32 {tf32}, "
            f"compile {compile_mode}, profile {cfg.train.profile}, torch {job.env['torch']}, loss {cfg.loss.mode}")
    job.say(f"[harness] environment: {hardware.describe(job.env)}")
    for p in incomplete:
        job.say(f"[harness] warning: {p} is an incomplete checkpoint (no {MARKER} marker): not resumed from")
    return job


def elastic_checks(resume_from: Optional[Path], cfg: Config, processes: int, zero_stage: Optional[int],
                   weights: str) -> bool:
    """Whether the checkpoint to resume from is a ZeRO checkpoint of another process count or stage (it then loads
    through a universal checkpoint); a DDP checkpoint under DeepSpeed or the reverse, or another train.weights, is a
    one-line error."""
    if resume_from is None:
        return False
    before = elastic.saved_layout(resume_from, elastic.read_state(resume_from), elastic.layout_of(cfg, processes))
    elastic.check_same_weights(resume_from, before, weights)
    elastic.check_same_engine(resume_from, before, zero_stage)
    return elastic.needs_universal(before, processes, zero_stage)


def past_the_schedule(resume_from: Optional[Path], total_steps: int) -> None:
    """A checkpoint past the last step the config plans (train.max_steps lowered on an interrupted run) is refused:
    resuming would export its weights as a run of fewer steps."""
    if resume_from is None:
        return
    try:
        step = int(json.loads((resume_from / STATE_FILE).read_text())["step"])
    except (OSError, ValueError, TypeError, KeyError):
        return  # load_checkpoint says what is wrong with it
    if step > total_steps:
        raise ConfigError(f"config key 'train.max_steps': the run to resume is at step {step} ({resume_from}), past "
                          f"the {total_steps} steps this config plans; rerun with the run's own train.max_steps (>= "
                          f"{step}), or start over with train.overwrite=true")


def hold_output_dir(out: Path, accelerator, opened: contextlib.ExitStack) -> None:
    """The main process takes <output_dir>/.lock (released when the run ends, however it ends); a refusal stops every
    process with the same one-line error."""

    def take() -> None:
        # the lock and its release's registration as one step: a stop signal in between (the set-up's handler ends
        # the run through `opened`) would leave a lock that nothing removes; one that comes meanwhile waits
        with stop_signals_held():
            lock = runlock.acquire(out, accelerator.print)
            opened.callback(runlock.release, lock)

    distributed.on_main(accelerator, take)


@contextlib.contextmanager
def stop_signals_held():
    """SIGTERM / SIGINT arriving inside are noted and raised again when it ends, to the handlers in place then (the
    set-up's, train.main). Python runs signal handlers in the main thread whichever thread received the signal, so
    the handlers are swapped rather than the signal mask (blocking it in this thread alone let another thread take
    it). Outside the main thread: nothing is held."""
    noted, previous = [], {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: noted.append(signum))
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])


# what a training run writes into its output folder and train.overwrite=true deletes (config.yaml, environment.json
# are rewritten anyway; plan.json (harness plan) and train.log (launch/train.sh) are the user's, kept)
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "report.json", "summary.md", "plots", "tensorboard")


def start_over(out: Path, say: Callable[[str], None]) -> None:
    """train.overwrite=true: delete the previous run's outputs (main process, holding the lock). Only in a folder that
    holds a harness run (its config.yaml): what has those names in any other folder (the current one, when the
    folder was given as `.`) is not the run's, and nothing is deleted."""
    import shutil

    gone = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if gone and not holds_run(out):
        raise ConfigError(f"config key 'train.overwrite': {out} holds {', '.join(gone)} but no harness run (no "
                          f"config.yaml written by harness train): nothing deleted; use another train.output_dir")
    for name in gone:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if gone:
        say(f"[harness] train.overwrite=true: deleted the previous run's {', '.join(gone)} in {out}")


def holds_run(out: Path) -> bool:
    """Whether `out` holds the config.yaml a training run writes (a mapping of config sections with train:)."""
    import yaml

    from harness.config import SECTIONS

    try:
        written = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(written, dict) and "train" in written and set(written) <= set(SECTIONS)


def build_data(job: Job) -> None:
    from harness import model as model_lib

    job.tokenizer = model_lib.load_run_tokenizer(job.cfg)
    job.data = loaders.build_loaders(job.cfg, job.accelerator, job.tokenizer)
    for kind, st in job.data.stats.items():
        job.say(f"[harness] {kind} data: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in st.items() if k != "dropped_examples"))
        if st.get("dropped_no_labels"):
            job.say(f"[harness] warning: dropped samples with no trained token, e.g. "
                    f"{', '.join(st['dropped_examples'])}")


def build_model(job: Job) -> None:
    """Model, optimizer and schedule (same seed on every rank: identical initial weights), prepared; the objective."""
    from accelerate.utils import set_seed

    from harness import model as model_lib
    from harness.objective import Objective, resolve_chunked_ce

    cfg, accelerator = job.cfg, job.accelerator
    if cfg.model.quantization != "none" and job.zero["zero_stage"] == 3:  # a launcher's ZeRO-3; checks.py: the rest
        raise ConfigError(quantization_zero3_error(cfg.model.quantization, "the accelerate config's DeepSpeed"))
    set_seed(cfg.train.seed)
    with distributed.model_init_context(accelerator, cfg.model.name_or_path is None or cfg.model.random_init):
        model = model_lib.build_model(cfg.model, job.tokenizer, precision=job.precision,
                                       packed_causal=cfg.loss.mode == "generative" and cfg.data.packing)
    if cfg.loss.mode != "generative":
        model_lib.check_embedding_support(model.config.model_type, model.config._attn_implementation,
                                          cfg.model.embed_attention)
    job.parameters, matmul_params = model_lib.count_parameters(model), metrics.matmul_params(model)
    if job.compile is not None:
        job.compile.model_built(model)
    optimizer = optim.build_optimizer(model, cfg, offload=job.zero["offload_optimizer"] not in (None, "none"))
    job.streams = job.data.streams
    primary = job.data.loader(job.streams[0])
    job.schedule = loaders.schedule_steps(len(primary.dataset), primary.batch_size, job.world, job.accum,
                                          cfg.train.max_steps, cfg.train.epochs)  # harness plan's arithmetic too
    # The schedule acts on the raw optimizer's param groups, which DeepSpeed's ZeRO optimizers keep using. It is not
    # prepared (accelerate would step it once per process) but stepped once per optimizer step, and checkpointed.
    job.scheduler = optim.build_scheduler(optimizer, cfg, job.total_steps)
    accelerator.register_for_checkpointing(job.scheduler)
    job.model, job.optimizer, *prepared = accelerator.prepare(model, optimizer, *[job.data.loader(n) for n in job.streams])
    if job.compile is not None:
        job.compile.model_prepared(job.model, job.say, accelerator.state.dynamo_plugin.to_kwargs())
    job.loaders = dict(zip(job.streams, prepared))
    job.weights = weights_dtype(job.model)
    distributed.repair_stage0_optimizer(job.optimizer)  # DeepSpeed without ZeRO: its start-up step undone
    chunk_size = resolve_chunked_ce(cfg, job.model, longest_micro_batch(job.data), job.say)
    if chunk_size is not None:
        job.say(f"[harness] generative loss: chunked through the output head, {chunk_size} positions per chunk "
                f"(loss.chunked_ce={cfg.loss.chunked_ce})")
    job.objective = Objective(cfg, accelerator, job.model, chunk_size=chunk_size)
    mconf = accelerator.unwrap_model(job.model, keep_torch_compile=False).config
    job.objective.flop_dims = (matmul_params, getattr(mconf, "num_hidden_layers", 0), getattr(mconf, "hidden_size", 0))
    job.held = accelerator.gather(torch.tensor([distributed.parameters_held(job.model)],
                                               device=accelerator.device)).tolist()
    if torch.cuda.is_available():
        peak_one, _ = hardware.peak_flops(torch.cuda.get_device_name())
        job.peak_flops = peak_one * job.world if peak_one else None


def longest_micro_batch(data: loaders.RunData) -> int:
    """The most positions one generative micro-batch (training or evaluation) can have: batch size x the longest
    row (packed rows: the packing width); 0 without generative data."""
    most = 0
    for loader in (data.gen, data.gen_eval):
        if loader is None:
            continue
        width = getattr(loader.collate_fn, "width", None) or max(loader.dataset["length"], default=0)
        most = max(most, loader.batch_size * width)
    return most


def describe_batch(job: Job) -> None:
    """Check that the global batch divides as configured; print it with the schedule."""
    t, world, accum = job.cfg.train, job.world, job.accum
    if t.global_batch_size and t.micro_batch_size * accum * world != t.global_batch_size:
        raise HarnessError(f"config key 'train.global_batch_size': {t.global_batch_size} is not micro-batch "
                           f"{t.micro_batch_size} x grad_accum {accum} x {world} process(es); fix one of them, or "
                           f"use train.micro_batch_size=auto")
    parts = []
    if "gen" in job.loaders:
        parts.append(f"{t.micro_batch_size * accum * world} sequences")
    if "emb" in job.loaders:
        contrastive = t.emb_micro_batch_size * (world if job.cfg.loss.gather_negatives else 1)
        parts.append(f"{t.emb_micro_batch_size * accum * world} queries x {job.cfg.data.train_group_size} passages "
                     f"(contrastive batch {contrastive} queries)")
    s = job.schedule
    job.say(f"[harness] model: {job.parameters / 1e6:.2f}M parameters ({', '.join(f'{h / 1e6:.2f}M' for h in job.held)}"
            f" held per rank); global batch per step: {' + '.join(parts)} = micro-batch x accumulation {accum} x "
            f"{world} process(es); {s['steps_per_epoch']} steps/epoch of {job.primary} data; {s['total_steps']} steps "
            f"({s['total_steps'] / s['steps_per_epoch']:.2f} epochs)")

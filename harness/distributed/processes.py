"""Process setup: the Accelerator and DeepSpeed ZeRO selection (the ZeRO facts: harness/distributed/zero.py).

How a run becomes distributed, in order of precedence:
  1. The launcher: `accelerate launch --config_file accelerate_configs/zero2.yaml harness/train.py ...` (the YAML names
     a DeepSpeed JSON in ds_configs/). Switching ZeRO stage = choosing another accelerate config file.
  2. `train.deepspeed` in the run config (a JSON path, or a shipped name: zero0, zero1, zero2, zero2_offload, zero3,
     zero3_offload). This is how plain `python -m harness.train` uses DeepSpeed: for a single process the rendezvous
     variables are filled in here, so DeepSpeed does not look for mpi4py.
Giving both is an error, and so is DeepSpeed asked for but not in effect (`ACCELERATE_USE_CPU=1` with a DeepSpeed
accelerate config would otherwise run plain DDP without a word). The JSON is checked when read. The DeepSpeed JSONs leave batch, accumulation, clipping and precision on "auto"; accelerate
fills them from the run config at prepare(); `make_accelerator` fills the clipping value from optim.max_grad_norm.

CPU: two ranks need `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2` (accelerate's `--cpu`
silently runs one process), and the gloo backend, which `make_accelerator` selects when there is no GPU.

The collectives every other part calls (on_main, broadcast, all_gather, spread) are harness/distributed/collectives.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path
from typing import Optional

import torch

from harness.config import TrainConfig
from harness.distributed.zero import apply_weights, deepspeed_config
from harness.errors import ConfigError, HarnessError, one_line
from harness.files import json_beyond_limits

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def launcher_uses_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def resolve_ds_config(value: str) -> Path:
    """`zero2` -> ds_configs/zero2.json; a path is taken as given. Checked to exist and to be valid JSON."""
    path = DS_CONFIG_DIR / f"{value}.json" if "/" not in value and not value.endswith(".json") else Path(value)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")))
        raise ConfigError(f"config key 'train.deepspeed': no DeepSpeed config '{value}' (shipped: {shipped})")
    check_ds_config(path)
    return path


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def check_ds_config(path: Path) -> dict:
    """Read a DeepSpeed JSON and check what DeepSpeed would otherwise reject deep inside its start-up (or ignore):
    valid JSON (file:line), zero_optimization.stage in 0..3, offload devices none/cpu/nvme. One-line ConfigErrors."""
    try:
        ds = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the DeepSpeed config ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON in DeepSpeed config ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: DeepSpeed config: {json_beyond_limits(e)}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(ds).__name__}")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{path}: zero_optimization.{key}.device must be none, cpu or nvme, got {device!r}")
    return ds


def check_launcher_ds_config() -> None:
    """The DeepSpeed JSON named by the launcher's accelerate config, checked before accelerate reads it."""
    name = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launcher_uses_deepspeed() and name and name.endswith(".json"):
        check_ds_config(Path(name))


def check_deepspeed_configs(t: TrainConfig) -> Optional[Path]:
    """The launcher's DeepSpeed JSON and train.deepspeed's (`t`: cfg.train), and that both are not given: one-line
    ConfigErrors. Returns train.deepspeed's JSON (None: unset)."""
    check_launcher_ds_config()
    if not t.deepspeed:
        return None
    if launcher_uses_deepspeed():
        raise ConfigError("config key 'train.deepspeed': the accelerate launcher already configures DeepSpeed; drop "
                          "train.deepspeed or launch without a DeepSpeed accelerate config")
    return resolve_ds_config(t.deepspeed)


def deepspeed_wanted(t: TrainConfig) -> Optional[str]:
    """Why this run should be DeepSpeed (None: it should not): the launcher's accelerate config, or train.deepspeed
    (`t`: cfg.train)."""
    if t.deepspeed:  # first: accelerate's DeepSpeedPlugin sets ACCELERATE_USE_DEEPSPEED itself
        return f"train.deepspeed={t.deepspeed} asks for DeepSpeed"
    if launcher_uses_deepspeed():
        return "the accelerate config asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true)"
    return None


def is_deepspeed(accelerator) -> bool:
    """Whether this run trains under DeepSpeed (the one answer: the loop, the objective, the weights' route)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def cpu_forced() -> bool:
    """Whether the launch forces the CPU (ACCELERATE_USE_CPU: accelerate's --cpu or use_cpu), which turns DeepSpeed off."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def check_deepspeed_in_effect(t: TrainConfig, accelerator) -> None:
    """DeepSpeed asked for but not in effect is an error, never a silent DDP run."""
    wanted = deepspeed_wanted(t)
    if wanted is None or is_deepspeed(accelerator):
        return
    got = accelerator.distributed_type.value
    if cpu_forced():
        raise ConfigError(f"{wanted}, but ACCELERATE_USE_CPU=1 turns DeepSpeed off (the run would be {got}); launch "
                          f"DeepSpeed without it (DeepSpeed runs on CPU by itself)")
    raise ConfigError(f"{wanted}, but accelerate set up {got}: check the accelerate config and launcher flags "
                      f"(--cpu turns DeepSpeed off)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Plain `python` (no launcher): give DeepSpeed a one-process rendezvous so it does not try mpi4py."""
    if "LOCAL_RANK" in os.environ or "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def process_group_kwargs() -> list:
    """Accelerator kwargs handlers for the process group. Without a GPU accelerate leaves the backend unset and each
    rank may believe it is alone: launched ranks get gloo, the CPU backend (a plain single process needs none)."""
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="gloo")] if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ else []


def make_accelerator(t: TrainConfig, max_grad_norm: float, shapes_vary: bool, mixed_precision: str,
                     compile_mode: str = "none", trackers: Optional[list] = None, static_shapes: bool = False):
    """The Accelerator for this run (`t`: cfg.train; max_grad_norm: optim.max_grad_norm, DeepSpeed's clipping when its
    config says auto; shapes_vary: config.profiles.shapes_vary of the run, dynamic compilation when
    train.compile_dynamic is unset; static_shapes: config.profiles.static_shapes, every pass one of a few fixed
    shapes, compiled static). compile_mode: regional | full | none (already resolved from auto); trackers:
    accelerate's `log_with` (observe.monitor.tracker_list)."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DeepSpeedPlugin,
        GradientAccumulationPlugin,
        TorchDynamoPlugin,
    )

    plugin = None
    path = check_deepspeed_configs(t)
    if path is not None:
        ensure_single_process_env()
        plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    handlers = process_group_kwargs()
    dynamo = None
    if compile_mode != "none":
        from torch import _dynamo

        # One compiled block serves several input shapes and masks per step (generative rows, queries, passages,
        # evaluation); past dynamo's default of 8 versions per code object it silently falls back to eager.
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
        # accelerate applies it in prepare(): compile_regions (DDP / single), compile_regions_deepspeed (ZeRO; for
        # ZeRO-3 harness.speed.compiling compiles the block forwards instead). Changing shapes: dynamic from the start;
        # a few fixed shapes (embedding width buckets, each run before step 1: harness.speed.buckets): static.
        dynamic = t.compile_dynamic
        if dynamic is None and static_shapes:
            dynamic = False
        else:
            dynamic = True if dynamic or (dynamic is None and shapes_vary) else None
        dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=compile_mode == "regional",
                                   dynamic=dynamic)
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        deepspeed_plugin=plugin,
        dynamo_plugin=dynamo,
        # Optimizer steps are always `grad_accum` micro-batches (the data stream runs across epoch ends), so the
        # sync point follows the micro-step count, not the end of the dataloader.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=t.grad_accum, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,
        log_with=trackers,
        project_dir=t.output_dir,
        kwargs_handlers=handlers,
    )
    check_deepspeed_in_effect(t, accelerator)
    ds = deepspeed_config(accelerator)
    if ds is not None:
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = max_grad_norm
        if apply_weights(ds, t.weights, mixed_precision):
            # transformers reads its own copy (zero.Init's dtype for pretrained weights under ZeRO-3): renew it
            accelerator.state.deepspeed_plugin.set_deepspeed_weakref()
    return accelerator


def route_weights(t: TrainConfig, quantization: str, precision: str) -> tuple[TrainConfig, Optional[str]]:
    """train.weights checked against the run, before the Accelerator: bf16 weights need bf16 compute and an
    unquantized model, and take their fp32 master copies from DeepSpeed, so a run without a DeepSpeed launcher or
    train.deepspeed gets train.deepspeed=zero0 (DeepSpeed without ZeRO). `t`: cfg.train; quantization:
    model.quantization. Returns (the train section, a note to print or None)."""
    if t.weights != "bf16":
        return t, None
    if precision != "bf16":
        raise ConfigError(f"config key 'train.weights': bf16 weights need train.precision=bf16 (this run computes in "
                          f"{precision}); use train.weights=fp32")
    if quantization != "none":
        raise ConfigError(f"config key 'train.weights': bf16 is for unquantized models (model.quantization="
                          f"{quantization} keeps its base in bitsandbytes' format); use train.weights=fp32")
    if deepspeed_wanted(t) is not None:
        return t, None
    if cpu_forced():
        raise ConfigError("config key 'train.weights': bf16 weights take their fp32 master copies from DeepSpeed, "
                          "which this launch turns off (ACCELERATE_USE_CPU=1: accelerate's --cpu or use_cpu); use "
                          "train.weights=fp32, or launch without it (harness train, python -m harness.train)")
    return dataclasses.replace(t, deepspeed="zero0"), (
        "[harness] train.weights=bf16: bf16 weights with fp32 master copies in DeepSpeed's optimizer "
        "(train.deepspeed=zero0: DeepSpeed without ZeRO)")


def end_training(accelerator):
    """The run's last clean-up, as an exit callback (`ExitStack.push`): the trackers are finished whatever happened;
    the process group is destroyed (`accelerator.end_training`) only when the run ended without an exception, since
    train.micro_batch_size=auto retries a failed try in this same process with the same process group."""

    def close(exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                accelerator.end_training()
            except OSError as e:  # a tracker's last flush (tensorboard's event file) on a full disk
                raise HarnessError(f"could not close the trackers' files ({one_line(e)}); the run itself is "
                                   f"complete") from e
        else:
            for tracker in accelerator.trackers:
                try:
                    tracker.finish()
                except Exception:  # noqa: BLE001 - a full disk, one never started: the run stops with its own error
                    pass
        return False

    return close


def launched_world() -> int:
    """The number of processes of this launch, before the Accelerator exists (the launcher's WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)

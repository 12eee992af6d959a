"""Run monitoring: machine utilisation sampled in the background, and the accelerate trackers.

`UtilisationSampler` is a daemon thread on the main process that every `train.monitor_interval_s` seconds reads
  - each local GPU through NVML (nvidia-ml-py, `pynvml`) when CUDA is present: utilisation % (share of the interval
    in which a kernel ran, what nvidia-smi shows) and memory used (GB, all processes on that GPU);
  - the machine's CPU utilisation % (from /proc/stat deltas; psutil where there is no /proc) and this process's
    resident memory (GB).
The loop folds the mean of the samples since the previous log line into each metrics.jsonl record (gpu_util: mean
over the GPUs, gpu_mem_gb: the fullest GPU, cpu_util, rss_gb; tensorboard gets the same scalars), and the run's
summary (mean, p10 and max per metric, per GPU as well) goes to report.json["utilisation"]. A low p10 of gpu_util
says the GPUs sat idle part of the time (data loading, checkpoints, evaluation, logging). A resumed run's summary
covers its last attempt; the per-step fields in metrics.jsonl cover every attempt.

    python -m harness.observe.monitor 5          # sample this machine for 5 s and print the summary

Trackers: `train.report_to` names accelerate trackers (tensorboard, wandb, mlflow, ...). `check_trackers` refuses
one whose package is not installed (accelerate would silently drop it); `tracker_list` / `init_trackers` keep
tensorboard's events in <output_dir>/tensorboard and name the wandb project / mlflow experiment
train.tracker_project (default: the run folder's name), with train.tracker_entity and train.run_name for wandb.
The check runs when the run starts (a config file stays valid on a machine without the tracker installed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from harness.distributed import collectives
from harness.errors import ConfigError, HarnessError, one_line

# The aggregate fields added to every logged step (metrics.jsonl, tensorboard); per-GPU fields stay in the summary.
LOG_FIELDS = ("gpu_util", "gpu_mem_gb", "cpu_util", "rss_gb")

# train.report_to name -> the module that must be importable for it (accelerate's own trackers)
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",),
                   "mlflow": ("mlflow",), "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",),
                   "dvclive": ("dvclive",), "swanlab": ("swanlab",), "trackio": ("trackio",)}
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "comet_ml": "comet-ml"}  # pip name where it differs


# ----------------------------------------------------------------------------------------------- pure functions


def cpu_times(stat_text: str) -> tuple[float, float]:
    """(busy, total) jiffies from the first line of /proc/stat ('cpu user nice system idle iowait irq softirq steal
    ...'); idle and iowait count as not busy; guest time is already inside user."""
    fields = [float(x) for x in stat_text.splitlines()[0].split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], total


def cpu_util(prev: tuple[float, float], cur: tuple[float, float]) -> Optional[float]:
    """Machine CPU utilisation in % between two `cpu_times` readings (all cores: 100 = every core busy)."""
    d_total = cur[1] - prev[1]
    if d_total <= 0:
        return None
    return 100.0 * (cur[0] - prev[0]) / d_total


def percentile(values: list[float], q: float) -> float:
    """q-th percentile with linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarise(samples: list[dict]) -> dict:
    """{metric: {"mean", "p10", "max", "n"}} over the samples (dicts of metric -> number or None); the sample time
    't' is not a metric. Metrics with no value are left out."""
    out = {}
    keys = sorted({k for s in samples for k in s if k != "t"})
    for k in keys:
        vals = [s[k] for s in samples if s.get(k) is not None]
        if vals:
            out[k] = {"mean": sum(vals) / len(vals), "p10": percentile(vals, 10), "max": max(vals), "n": len(vals)}
    return out


def mean_fields(samples: list[dict], fields=LOG_FIELDS) -> dict:
    """Mean of each of `fields` over the samples (the log record's utilisation since the previous log line);
    fields with no value are left out."""
    out = {}
    for k in fields:
        vals = [s[k] for s in samples if s.get(k) is not None]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def with_aggregates(sample: dict, n_gpus: int) -> dict:
    """Adds gpu_util (mean over GPUs) and gpu_mem_gb (the fullest GPU) to a sample holding gpu{i}_util and
    gpu{i}_mem_gb."""
    utils = [sample[f"gpu{i}_util"] for i in range(n_gpus) if sample.get(f"gpu{i}_util") is not None]
    mems = [sample[f"gpu{i}_mem_gb"] for i in range(n_gpus) if sample.get(f"gpu{i}_mem_gb") is not None]
    if utils:
        sample["gpu_util"] = sum(utils) / len(utils)
    if mems:
        sample["gpu_mem_gb"] = max(mems)
    return sample


# ----------------------------------------------------------------------------------------------- readers


class CpuReader:
    """Machine CPU utilisation since the previous read, and this process's resident memory."""

    def __init__(self) -> None:
        import psutil  # an accelerate dependency

        self._proc = psutil.Process()
        self._psutil = psutil
        self._has_proc_stat = Path("/proc/stat").exists()
        self._prev = self._times()
        if not self._has_proc_stat:
            psutil.cpu_percent(interval=None)  # starts psutil's interval

    def _times(self):
        return cpu_times(Path("/proc/stat").read_text()) if self._has_proc_stat else None

    def read(self) -> dict:
        if self._has_proc_stat:
            cur = self._times()
            util, self._prev = cpu_util(self._prev, cur), cur
        else:
            util = self._psutil.cpu_percent(interval=None)
        return {"cpu_util": util, "rss_gb": self._proc.memory_info().rss / 2**30}


class NvmlReader:
    """Utilisation % and memory used of each GPU visible to this process (CUDA_VISIBLE_DEVICES respected)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            self.handles = [pynvml.nvmlDeviceGetHandleByUUID(v) if v.startswith(("GPU-", "MIG-"))
                            else pynvml.nvmlDeviceGetHandleByIndex(int(v)) for v in ids]
        else:
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self.handles]

    def read(self) -> dict:
        out = {}
        for i, h in enumerate(self.handles):
            try:
                out[f"gpu{i}_util"] = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except self._nvml.NVMLError:  # e.g. MIG instances report no utilisation
                out[f"gpu{i}_util"] = None
            out[f"gpu{i}_mem_gb"] = self._nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
        return with_aggregates(out, len(self.handles))

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# ----------------------------------------------------------------------------------------------- the sampler


class UtilisationSampler:
    """Samples the readers every `interval_s` seconds on a daemon thread. `drain()` gives the mean of the samples
    since its previous call (for the log record), `stop()` the summary of the whole attempt (for the report)."""

    def __init__(self, interval_s: float, gpus: Optional[bool] = None):
        """gpus: read GPUs through NVML (None: when CUDA is available and pynvml imports)."""
        self.interval_s = interval_s
        self.readers: list = [CpuReader()]
        self.gpu_names: list[str] = []
        self.note = None
        if gpus is None:
            import torch

            gpus = torch.cuda.is_available()
        if gpus:
            try:
                nvml = NvmlReader()
                self.readers.append(nvml)
                self.gpu_names = nvml.names
            except Exception as e:  # noqa: BLE001 - pynvml missing or NVML unusable: GPU fields stay absent
                self.note = f"no GPU utilisation: NVML unavailable ({type(e).__name__}: {e})"
        self.samples: list[dict] = []
        self._drained = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-utilisation", daemon=True)
        self._t0 = time.time()
        self._summary: Optional[dict] = None

    def start(self) -> "UtilisationSampler":
        self._thread.start()
        return self

    def sample(self) -> dict:
        """Read every reader once and keep the sample."""
        s = {"t": time.time() - self._t0}
        for r in self.readers:
            s.update(r.read())
        with self._lock:
            self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a failing read must not end the run; say it once and stop
                self.note = f"sampling stopped: {type(e).__name__}: {e}"
                return

    def drain(self) -> dict:
        """Mean of LOG_FIELDS over the samples since the previous drain (the latest sample when none is new)."""
        with self._lock:
            new = self.samples[self._drained:] or self.samples[-1:]
            self._drained = len(self.samples)
        return mean_fields(new)

    def stop(self) -> dict:
        """Stops the thread; the summary for report.json["utilisation"] (a second call returns the same summary)."""
        if self._summary is not None:
            return self._summary
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        for r in self.readers:
            if hasattr(r, "close"):
                r.close()
        with self._lock:
            samples = list(self.samples)
        self._summary = {"interval_s": self.interval_s, "samples": len(samples), "gpus": self.gpu_names,
                         "source": "nvml+cpu" if self.gpu_names else "cpu", "note": self.note,
                         "metrics": summarise(samples)}
        return self._summary


def start_sampler(interval_s: float, is_main_process: bool) -> Optional[UtilisationSampler]:
    """The running sampler on the main process when interval_s > 0; None otherwise."""
    if interval_s <= 0 or not is_main_process:
        return None
    return UtilisationSampler(interval_s).start()


def progress_text(record: dict) -> str:
    """' gpu 87% cpu 12%' for the console log line, from a record's utilisation fields ('' without them)."""
    return "".join(f" {name} {record[k]:.0f}%" for k, name in (("gpu_util", "gpu"), ("cpu_util", "cpu"))
                   if record.get(k) is not None)


def describe(summary: Optional[dict]) -> str:
    """One line: 'gpu_util mean 87% (p10 61%), gpu_mem_gb max 70.1, cpu_util mean 12% (p10 3%), rss_gb max 5.2'."""
    if not summary or not summary.get("metrics"):
        return "no utilisation samples"
    m, parts = summary["metrics"], []
    for k in LOG_FIELDS:
        if k in m:
            if k.endswith("_util"):
                parts.append(f"{k} mean {m[k]['mean']:.0f}% (p10 {m[k]['p10']:.0f}%)")
            else:
                parts.append(f"{k} max {m[k]['max']:.2f}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------- trackers


def check_trackers(names: list) -> None:
    """Raises ConfigError (one line naming train.report_to) for a tracker accelerate does not know or whose package
    is not installed; accelerate would drop it silently and the run would log nowhere."""
    for name in names:
        if name == "all":
            continue
        if name not in TRACKER_MODULES:
            raise ConfigError(f"config key 'train.report_to': unknown tracker '{name}' (known: all, "
                              f"{', '.join(TRACKER_MODULES)})")
        if not any(_importable(m) for m in TRACKER_MODULES[name]):
            raise ConfigError(f"config key 'train.report_to': tracker '{name}' is not installed (pip install "
                              f"{TRACKER_PACKAGES.get(name, name)}), or remove it from train.report_to")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def tracker_list(report_to: list, output_dir: str) -> Optional[list]:
    """`log_with` for the Accelerator: tensorboard as a ready TensorBoardTracker writing to <output_dir>/tensorboard
    (whatever the project name), the other trackers by name."""
    if not report_to:
        return None
    check_trackers(report_to)
    from accelerate.tracking import TensorBoardTracker

    return [TensorBoardTracker("tensorboard", output_dir) if t == "tensorboard" else t for t in report_to]


def tracker_settings(output_dir: str, project: Optional[str], entity: Optional[str], run_name: Optional[str]):
    """(project, init_kwargs) for accelerate's init_trackers: train.tracker_project (the wandb project, the mlflow
    experiment), train.tracker_entity (the wandb team or user) and train.run_name (the run
    as wandb and mlflow list it); the unset ones default to the run folder's name (no entity: wandb's default)."""
    folder = Path(output_dir).resolve().name
    name = run_name or folder
    wandb = {"name": name, **({"entity": entity} if entity else {})}
    return project or folder, {"wandb": wandb, "mlflow": {"run_name": name}}


def flat(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> flat {section.key: scalar}, e.g. for the trackers' hyper-parameter table."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def init_trackers(accelerator, cfg, resume_from: Optional[Path] = None) -> None:
    """Starts the trackers named in train.report_to with `tracker_settings`; the run config (`flat`) is logged as
    hyper-parameters. A tracker that cannot write its first files (a full disk under tensorboard's event file, on
    the main process) stops every process with one line (collective); `resume_from`: the checkpoint it names intact."""
    t, failure = cfg.train, None
    project, init_kwargs = tracker_settings(t.output_dir, t.tracker_project, t.tracker_entity, t.run_name)
    if "tensorboard" in t.report_to or "all" in t.report_to:
        quiet_event_writer_thread()
    try:
        accelerator.init_trackers(project, config=flat(cfg.to_dict()), init_kwargs=init_kwargs)
    except OSError as e:
        where = f"tensorboard in {Path(t.output_dir) / 'tensorboard'}" if "tensorboard" in t.report_to else \
            f"the trackers {', '.join(t.report_to)}"
        kept = f" (the checkpoint {resume_from} is intact)" if resume_from else ""
        failure = (f"could not start {where} ({one_line(e)}): nothing is lost, no step of this attempt ran{kept}; "
                   f"free some space, then run the same command again")
    except Exception as e:
        if not type(e).__module__.startswith("wandb"):
            raise
        failure = wandb_failure(e)
    failed = [f for f in collectives.all_gather(accelerator, failure) if f]
    if failed:
        raise HarnessError(failed[0])


def wandb_failure(e: Exception) -> str:
    """One line for wandb refusing to start (not logged in: 'No API key configured'): the ways to go on."""
    return (f"config key 'train.report_to': wandb could not start ({one_line(e)}): log in with `wandb login` (or set "
            f"WANDB_API_KEY), or log offline with WANDB_MODE=offline (upload later with `wandb sync`), or remove wandb "
            f"from train.report_to")


def quiet_event_writer_thread() -> None:
    """tensorboard writes its event file in a thread of its own; a write that fails there (a full disk) is raised
    again in the run's thread at the next log, where it is one line (metrics.MetricsLogger): the thread's own
    traceback is not printed as well. Other threads' exceptions are printed as before."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "harness_quiet", False):
        return

    def hook(args) -> None:
        if issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.harness_quiet = True
    threading.excepthook = hook


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    sampler = UtilisationSampler(interval_s=min(1.0, seconds / 5)).start()
    time.sleep(seconds)
    summary = sampler.stop()
    print(describe(summary))
    print(summary)

"""Utilisation sampling and summaries (harness/observe/monitor.py), cost (harness/observe/cost.py), tracker checks.

    .venv/bin/python -m pytest tests/test_monitor.py
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from harness.config import load_config
from harness.errors import ConfigError
from harness.observe import cost, monitor

DEFAULT = "configs/default.yaml"


# ---------------------------------------------------------------------------------------------- utilisation


def test_cpu_util_from_proc_stat_deltas():
    # cpu  user nice system idle iowait irq softirq steal guest guest_nice
    prev = monitor.cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n")
    cur = monitor.cpu_times("cpu  160 0 70 850 60 5 5 0 30 0\n")
    assert prev == (150.0, 1000.0)  # busy = all but idle and iowait; guest (inside user) not counted twice
    assert cur == (240.0, 1150.0)
    assert monitor.cpu_util(prev, cur) == pytest.approx(100 * 90 / 150)
    assert monitor.cpu_util(cur, cur) is None  # no time passed


def test_percentile_interpolates_like_numpy():
    assert monitor.percentile([50, 10, 30, 20, 40], 10) == pytest.approx(14.0)  # (5-1)*0.1 = 0.4 -> 10 + 0.4*10
    assert monitor.percentile([7.0], 10) == 7.0
    assert monitor.percentile([30, 80, 90, 100], 10) == pytest.approx(45.0)  # 0.3 of the way from 30 to 80
    assert monitor.percentile([1, 2, 3], 100) == 3


def test_summary_mean_p10_max_per_metric_on_fixed_samples():
    samples = [
        {"t": 0.0, "gpu_util": 90.0, "cpu_util": 10.0},
        {"t": 2.0, "gpu_util": 80.0, "cpu_util": 20.0},
        {"t": 4.0, "gpu_util": None, "cpu_util": 30.0},  # a failed GPU read is not a zero
        {"t": 6.0, "gpu_util": 100.0, "cpu_util": 40.0},
        {"t": 8.0, "gpu_util": 30.0, "cpu_util": 50.0, "rss_gb": 1.5},
    ]
    s = monitor.summarise(samples)
    assert set(s) == {"gpu_util", "cpu_util", "rss_gb"}  # the time is not a metric
    assert s["gpu_util"] == {"mean": 75.0, "p10": pytest.approx(45.0), "max": 100.0, "n": 4}
    assert s["cpu_util"] == {"mean": 30.0, "p10": pytest.approx(14.0), "max": 50.0, "n": 5}
    assert s["rss_gb"] == {"mean": 1.5, "p10": 1.5, "max": 1.5, "n": 1}
    assert monitor.mean_fields(samples[:2]) == {"gpu_util": 85.0, "cpu_util": 15.0}
    assert monitor.summarise([]) == {}


def test_gpu_aggregates_mean_util_and_fullest_memory():
    s = monitor.with_aggregates({"gpu0_util": 80.0, "gpu0_mem_gb": 30.0, "gpu1_util": 60.0, "gpu1_mem_gb": 70.5}, 2)
    assert s["gpu_util"] == 70.0 and s["gpu_mem_gb"] == 70.5
    assert "gpu_util" not in monitor.with_aggregates({"gpu0_util": None, "gpu0_mem_gb": 1.0}, 1)


def test_describe_and_progress_text():
    summary = {"metrics": monitor.summarise([{"gpu_util": 90.0, "rss_gb": 2.0}, {"gpu_util": 50.0, "rss_gb": 3.0}])}
    assert monitor.describe(summary) == "gpu_util mean 70% (p10 54%), rss_gb max 3.00"
    assert monitor.describe({"metrics": {}}) == "no utilisation samples"
    assert monitor.progress_text({"gpu_util": 87.4, "cpu_util": 12.0}) == " gpu 87% cpu 12%"
    assert monitor.progress_text({"loss": 1.0}) == ""


def test_sampler_reads_this_machine_in_the_background():
    sampler = monitor.UtilisationSampler(interval_s=0.05, gpus=False).start()
    x = sum(i * i for i in range(300_000))  # some CPU work while it samples  # noqa: F841
    time.sleep(0.3)
    recent = sampler.drain()
    assert 0.0 <= recent["cpu_util"] <= 100.0 and recent["rss_gb"] > 0.01
    summary = sampler.stop()
    assert not sampler._thread.is_alive()
    assert summary["samples"] >= 3 and summary["source"] == "cpu" and summary["gpus"] == []
    m = summary["metrics"]
    assert m["cpu_util"]["p10"] <= m["cpu_util"]["mean"] <= m["cpu_util"]["max"] <= 100.0
    assert m["rss_gb"]["n"] == summary["samples"]
    assert monitor.start_sampler(0, True) is None and monitor.start_sampler(1.0, False) is None


@pytest.mark.slow
@pytest.mark.usefixtures("all_cpus")  # launches through scripts/gpu_check.py
def test_gpu_check_script_runs_end_to_end_on_cpu(tmp_path):
    """scripts/gpu_check.py --cpu-smoke: the GPU script's own code path works before a GPU is rented for it: a
    DeepSpeed variant launched with a patched DeepSpeed JSON (real DeepSpeed on its CPU accelerator, regional
    compile), report.json and metrics.jsonl parsed into a row with the keys issue 25 asks for, the utilisation
    recorded around the launch and the run's own; then point 5 (rft generate and bench on a tiny random model, harness
    plan against the run) in a second call whose rows are appended to the same bench file."""
    import json
    import subprocess
    import sys

    from harness_launch import ROOT

    bench = tmp_path / "bench" / "gpu-day.json"
    common = ["--cpu-smoke", "--out", str(tmp_path / "runs"), "--bench-out", str(bench)]
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", *common, "--variants", "zero2_nooverlap",
                           "--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "utilisation, training: cpu_util mean" in proc.stdout
    result = json.loads((tmp_path / "runs" / "gpu_check.json").read_text())
    (row,) = result["rows"]
    assert result["device"] == "cpu (smoke)" and row["variant"] == "zero2_nooverlap"
    required = {"variant", "steps", "precision", "weights", "zero_stage", "compile", "attention", "tokens_per_s",
                "mfu", "mem_gb", "gpu_util", "final_loss", "loss_at", "gpu", "command", "accelerate_config",
                "deepspeed_config"}
    assert required <= set(row), required - set(row)
    assert row["steps"] == 3 and row["zero_stage"] == 2 and row["precision"] == "fp32" and row["weights"] == "fp32"
    assert row["attention"] == "sdpa" and row["tokens_per_s"] > 0 and row["final_loss"] > 0
    assert row["compile"]["mode"] == "regional" and row["compile"]["ran_compiled"]
    assert row["compile"]["recompile_limit_hits"] == 0 and row["compile"]["cold_compile_s"] > 0
    assert set(row["loss_curve"]) == {"1", "2", "3"} and row["loss_at"] == {}  # steps 20, 40, 100 not reached
    # compile told from steady state (issue 45): compile seconds in all, the last step that compiled, what came after
    assert row["compile"]["compile_s_total"] >= row["compile"]["cold_compile_s"] > 0
    assert 1 <= row["last_compile_step"] <= 3 and row["cap_s"] == 600
    if row["last_compile_step"] < 3:
        assert row["steady_from_step"] == row["last_compile_step"] + 1 and row["steady_tokens_per_s"] > 0
    else:
        assert row["steady_tokens_per_s"] is None
    assert (row["last_recompile_step"] is None) == (row["compile"]["recompiles"] == 0)
    log = open(row["log"]).read()  # TORCH_LOGS=recompiles: each recompile's guard failure is in the log
    assert row["recompile_log"]["count"] == log.count("Recompiling function") >= row["compile"]["recompiles"]
    patched = tmp_path / "runs" / "_configs" / "zero2_nooverlap.json"  # the shipped zero2.json, overlap_comm off
    assert json.loads(patched.read_text())["zero_optimization"]["overlap_comm"] is False
    assert row["deepspeed_config"]["json"] == json.loads(patched.read_text())
    assert str(patched) in row["accelerate_config"]["text"] and row["accelerate_config"]["path"] in row["command"]
    assert 0 < row["cpu_util_mean"] <= 100
    whole = row["utilisation_whole_launch"]
    assert whole["samples"] >= 1 and whole["source"] == "cpu" and "cpu_util" in whole["metrics"]

    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", *common, "--preset", "rft_plan", "--steps", "10"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    day = json.loads(bench.read_text())
    assert day["device"] == "cpu (smoke)" and len(day["calls"]) == 2
    assert [r["variant"] for r in day["rows"]] == ["zero2_nooverlap", "rft_generate", "plan_300", "rft_bench"]
    assert day["rows"][0]["call"] == day["calls"][0]["id"] != day["rows"][1]["call"] == day["calls"][1]["id"]
    assert all(required - {"command", "accelerate_config", "deepspeed_config"} <= set(r) for r in day["rows"])
    gen, plan, rft_bench = day["rows"][1:]
    assert gen["sequences_per_s"] > 0 and gen["batch"]["sequences_per_batch"] == 16 * 4
    assert gen["stats"]["questions_covered"] == 32 and gen["tokens_per_s_bound"] > 0
    assert plan["steps"] == 10 and plan["plan"]["estimated_s"] > 0 and plan["plan"]["actual_s"] > 0
    assert plan["plan"]["same_config"] and plan["plan"]["ratio_actual_to_estimate"] > 0
    assert rft_bench["tokens_per_s"] > 0 and len(rft_bench["ways"]) == 3
    unknown = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu-smoke", "--variants", "eagre"],
                             cwd=ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown variant(s) eagre" in unknown.stderr


def test_gpu_check_launch_writes_its_log_while_the_launch_runs(tmp_path, monkeypatch):
    """A gpu_check call cut off from outside (the device's time limit, a `timeout` around the script) must leave each
    launch's output so far: on the lent H100 (2026-11-26) two variants stopped that way left no log at all, since
    the output was held in memory until the launch ended. The log now fills as the launch prints; the script's own
    time limit still stops the launch and says so."""
    import sys
    import threading

    from harness_launch import ROOT

    spec = importlib.util.spec_from_file_location("gpu_check_launch", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    log = tmp_path / "variant.log"
    cmd = [sys.executable, "-c", "import time; print('step 5 loss 7.1', flush=True); time.sleep(60)"]
    done = {}
    worker = threading.Thread(target=lambda: done.update(gpu_check.launch(cmd, log, True, 8.0)))
    worker.start()
    deadline = time.time() + 6
    while time.time() < deadline and not (log.is_file() and "step 5" in log.read_text()):
        time.sleep(0.2)
    seen_while_running = log.is_file() and "step 5 loss 7.1" in log.read_text()
    worker.join(60)
    assert seen_while_running, "the log is written only when the launch ends"
    assert done["rc"] is None and "timed out after 8 s" in done["error"] and "step 5 loss 7.1" in done["output"]


# ---------------------------------------------------------------------------------------------- cost


def test_hourly_rate_per_machine_or_per_gpu():
    assert cost.hourly_rate(2.0, "gpu", n_gpus=8) == 16.0
    assert cost.hourly_rate(2.0, "machine", n_gpus=8) == 2.0
    assert cost.hourly_rate(2.0, "machine", n_gpus=16, n_machines=2) == 4.0
    assert cost.hourly_rate(0.0, "gpu", n_gpus=8) is None  # not priced


def test_run_cost_so_far_and_projected_on_fixed_inputs():
    c = cost.run_cost(elapsed_s=1800, eta_s=5400, price_per_hour=2.0, price_unit="gpu", n_gpus=4)
    assert c["rate_per_hour"] == 8.0
    assert c["so_far"] == pytest.approx(4.0)  # half an hour at 8/h
    assert c["projected"] == pytest.approx(16.0)  # two hours in all
    assert cost.run_cost(900, None, 3.0, "machine", 8)["projected"] is None  # no ETA yet
    assert cost.run_cost(900, 10, 0.0, "machine", 8) is None
    assert cost.fields(c) == {"cost": c["so_far"], "cost_projected": c["projected"]} and cost.fields(None) == {}
    assert cost.progress_text(c) == " cost 4.00 (projected 16.00)" and cost.progress_text(None) == ""


def test_plan_cost_and_of_run_read_the_config(monkeypatch):
    per_gpu = load_config(DEFAULT, ["train.price_per_hour=2.5", "train.price_unit=gpu"])
    assert cost.plan_cost(3.0, per_gpu.train, n_gpus=8) == pytest.approx(60.0)
    per_machine = load_config(DEFAULT, ["train.price_per_hour=2.5"])
    assert per_machine.train.price_unit == "machine"
    assert cost.plan_cost(3.0, per_machine.train, n_gpus=8) == pytest.approx(7.5)
    assert cost.plan_cost(3.0, load_config(DEFAULT).train, n_gpus=8) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 16 processes, 8 per machine: two machines
    assert cost.of_run(per_machine.train, 16, 3600, 0.0)["so_far"] == pytest.approx(5.0)
    assert cost.of_run(per_gpu.train, 16, 3600, 0.0)["so_far"] == pytest.approx(40.0)


def test_price_and_interval_keys_are_validated():
    for bad in ("train.price_per_hour=-1", "train.monitor_interval_s=-2"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(DEFAULT, [bad])
    with pytest.raises(ConfigError, match="train.price_unit"):
        load_config(DEFAULT, ["train.price_unit=hour"])


# ---------------------------------------------------------------------------------------------- trackers


def test_tracker_checks_name_the_config_key(tmp_path):
    monitor.check_trackers(["tensorboard", "all"])
    with pytest.raises(ConfigError, match=r"'train.report_to': unknown tracker 'tensorbored'"):
        monitor.check_trackers(["tensorbored"])
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"'train.report_to': tracker 'wandb' is not installed \(pip install "
                                              r"wandb\)"):
            monitor.tracker_list(["tensorboard", "wandb"], str(tmp_path))
    (tb,) = monitor.tracker_list(["tensorboard"], str(tmp_path / "run"))
    assert tb.name == "tensorboard" and tb.run_name == "tensorboard" and tb.logging_dir_param == str(tmp_path / "run")
    assert monitor.tracker_list([], str(tmp_path)) is None


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="mlflow is installed here")
def test_missing_tracker_stops_the_run_with_one_line(tmp_path, capsys):
    from harness import train

    code = train.main(["--config", DEFAULT, f"train.output_dir={tmp_path}", "train.report_to=[mlflow]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["harness: error: config key 'train.report_to': tracker 'mlflow' is not installed "
                                 "(pip install mlflow), or remove it from train.report_to"]


def test_tracker_settings_project_entity_and_run_name():
    """train.tracker_project / tracker_entity / run_name reach accelerate's init_trackers (wandb and mlflow kwargs);
    unset, the run folder's name is the project and the run name, and wandb picks its default entity."""
    from harness.observe.monitor import tracker_settings

    project, kwargs = tracker_settings("runs/qwen-sft", None, None, None)
    assert project == "qwen-sft" and kwargs == {"wandb": {"name": "qwen-sft"}, "mlflow": {"run_name": "qwen-sft"}}
    project, kwargs = tracker_settings("runs/qwen-sft", "chat-models", "my-team", "lr2e-5")
    assert project == "chat-models"
    assert kwargs == {"wandb": {"name": "lr2e-5", "entity": "my-team"}, "mlflow": {"run_name": "lr2e-5"}}


def test_tracker_tags_are_grouped():
    from harness.observe.metrics import tracker_tag

    assert [tracker_tag(k) for k in ["loss", "lr", "grad_norm", "padding_share", "eval_loss", "eval_recall_at_1",
                                     "gpu_util", "gpu0_util", "rss_gb", "tokens_per_s", "mfu", "cost"]] == [
        "train/loss", "train/lr", "train/grad_norm", "train/padding_share", "eval/loss", "eval/recall_at_1",
        "system/gpu_util", "system/gpu0_util", "system/rss_gb", "time/tokens_per_s", "time/mfu", "time/cost"]

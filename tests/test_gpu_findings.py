"""What the first GPU runs (docs/benchmarks.md, "GPU") found, pinned down on the CPU: the attention kernel that
model.attn_implementation=auto picks for packed rows, the FLOPs counted for a 4-bit (QLoRA) model's MFU, and the
step profiler (train.profile_steps) that explained the H100 step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from harness import model as model_lib
from harness.observe import metrics, profiling

ROOT = Path(__file__).resolve().parent.parent


def test_auto_attention_is_flex_for_packed_rows_on_a_cuda_gpu(monkeypatch):
    llama = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, vocab_size=128)
    assert model_lib.auto_attention(llama, packed_causal=True) == "sdpa"  # this CPU: flex has no backward here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_lib.auto_attention(llama, packed_causal=True) == "flex_attention"
    assert model_lib.auto_attention(llama, packed_causal=False) == "sdpa"  # embedding passes, unpacked rows


def test_mfu_counts_a_4bit_weight_by_its_shape():
    """bitsandbytes stores a 4-bit weight as in x out / 2 uint8 values: counting its numel halved QLoRA's MFU
    (17.8% on the H100, against LoRA's 40.8% on the same model)."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4")._quantize("cpu")
    assert layer.weight.numel() == 64 * 32 // 2  # packed
    model = torch.nn.Sequential(layer, torch.nn.Linear(32, 16))
    assert metrics.matmul_params(model) == 64 * 32 + 32 * 16


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("triton_tem_fused_flex_attention_backward_transpose_view_5", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymou...", "optimizer"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_2", "other"),  # not the optimizer's "fused"
    ("triton_poi_fused__to_copy_t_7", "other"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
])
def test_profile_kernel_kinds(name, kind):
    assert profiling.kind_of(name) == kind


@pytest.mark.slow
def test_profile_steps_writes_the_operators_and_a_summary(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "harness.train", "--config", "configs/default.yaml",
                           f"train.output_dir={out}", "train.max_steps=13", "train.profile_steps=2",
                           "train.eval_at_start=false", "data.eval_files=[]", "train.save_final=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "harness: profiled steps 11-12" in proc.stdout + proc.stderr
    summary = json.loads((out / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["first_step"] == 11 and summary["wall_ms_per_step"] > 0
    assert summary["device_ms_per_step_by_kind"]["matmul"] > 0  # on a CPU: aten operators' own time
    assert "aten::mm" in (out / "profile" / "ops.txt").read_text()
    assert (out / "profile" / "trace.json.gz").stat().st_size > 0
    assert not (out / "profile" / "trace.json").exists()


def _gpu_check(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_findings", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_tells_compile_from_steady_state(monkeypatch):
    """Issue 45: on the H100 the compiled GritLM run's medians mixed compilation into its 20-step figures. The row now
    finds the last log interval that still compiled (compile seconds grew, with or without a new graph) and gives
    tokens/s and MFU over the intervals after it (the totals between those log lines, not a median)."""
    gc = _gpu_check(monkeypatch)
    recs = [  # log_every 5: graphs grow up to step 10, a backward graph compiles lazily in 11-15, then steady
        {"step": 5, "loss": 9.0, "elapsed_s": 50.0, "tokens": 5000, "mfu": 0.01, "compile_graphs": 4, "compile_s": 40.0},
        {"step": 10, "loss": 8.0, "elapsed_s": 60.0, "tokens": 10000, "mfu": 0.1, "compile_graphs": 6, "compile_s": 45.0},
        {"step": 15, "loss": 7.0, "elapsed_s": 65.0, "tokens": 15000, "mfu": 0.2, "compile_graphs": 6, "compile_s": 46.0},
        {"step": 20, "loss": 6.0, "elapsed_s": 67.0, "tokens": 20000, "mfu": 0.5, "compile_graphs": 6, "compile_s": 46.0},
        {"step": 25, "loss": 5.0, "elapsed_s": 69.0, "tokens": 25000, "mfu": 0.5, "compile_graphs": 6, "compile_s": 46.0},
        {"step": 25, "eval_loss": 5.5},  # an evaluation record: no loss, not an interval
    ]
    out = gc.steady_state(recs, recompiles=2)
    assert out["last_recompile_step"] == 10 and out["last_compile_step"] == 15
    assert out["steady_from_step"] == 16 and out["steady_steps"] == 10
    assert out["steady_tokens_per_s"] == (25000 - 15000) / (69.0 - 65.0)
    assert out["steady_mfu"] == 0.5  # each interval weighted by its seconds
    assert gc.steady_state(recs, recompiles=0)["last_recompile_step"] is None  # report.json: none after step 1
    eager = [{k: v for k, v in r.items() if not k.startswith("compile")} for r in recs[:5]]
    assert gc.steady_state(eager, None)["steady_from_step"] == 6  # eager: after the first (warm-up) interval
    assert gc.steady_state(recs[:1], 0)["steady_tokens_per_s"] is None  # compiling to the end: no steady state


def test_gpu_check_reads_recompile_reasons_and_the_step_reached(monkeypatch):
    """TORCH_LOGS=recompiles lines in a variant's log (torch 2.13's format) become the row's reasons; the count after
    the first step line is what compiled after the first log interval; a capped variant says how far it got."""
    gc = _gpu_check(monkeypatch)
    log = "\n".join([
        "V1127 03:07:40.1 9652 torch/_dynamo/guards.py:3012] [0/1] [__recompiles] Recompiling function forward in "
        "/x/modeling_llama.py:291",
        "V1127 03:07:40.1 9652 torch/_dynamo/guards.py:3012] [0/1] [__recompiles]     triggered by the following "
        "guard failure(s):",
        "V1127 03:07:40.1 9652 torch/_dynamo/guards.py:3012] [0/1] [__recompiles]     - 0/0: tensor 'hidden_states' "
        "size mismatch at index 1. expected 64, actual 128",
        "[harness] step 5/100 loss 9.1",
        "V1127 03:08:40.1 9652 torch/_dynamo/guards.py:3012] [0/2] [__recompiles] Recompiling function forward in "
        "/x/modeling_llama.py:291",
        "V1127 03:08:40.1 9652 torch/_dynamo/guards.py:3012] [0/2] [__recompiles]     - 0/1: tensor 'hidden_states' "
        "size mismatch at index 0. expected 64, actual 32",
        "[harness] step 10/100 loss 8.2",
    ])
    seen = gc.recompile_reasons(log)
    assert seen["count"] == 2 and seen["after_first_log_line"] == 1
    assert seen["reasons"][0].endswith("| - 0/0: tensor 'hidden_states' size mismatch at index 1. expected 64, "
                                       "actual 128")
    assert gc.reached_step(log) == 10 and gc.reached_step("no step yet") is None
    assert gc.parse_names("gritlm:100,eager,zero3:20", 40) == [("gritlm", 100), ("plain_eager", 40), ("zero3", 20)]
    assert gc.cap_s("zero3", 20) == 1.5 * gc.estimate_s("zero3", 20) + 60


def test_the_visit_preset_fits_one_call_in_the_issues_order(monkeypatch):
    """Issue 57's `--preset visit`: one call of at most 9 minutes (the device's 15 minutes hold the machine's start and
    the wheels' install too), its variants in the issue's order, each under a cap of its own that sums under the call's
    --budget-min (8.8 min), and every variant's overrides accepted by the config loader on the GPU recipe (a renamed
    key would otherwise be found on a rented GPU)."""
    gc = _gpu_check(monkeypatch)
    names, steps = gc.PRESETS["visit"]
    plan = gc.parse_names(",".join(names), steps)
    assert [n for n, _ in plan] == ["visit_engine", "visit_engine_tf", "grpo_1b", "gritlm", "gritlm_eager", "zero3",
                                    "fp8"]
    assert dict(plan)["grpo_1b"] == 3 and dict(plan)["gritlm"] == 100 and dict(plan)["zero3"] == dict(plan)["fp8"] == 20
    caps = [gc.own_cap("visit", n, st) for n, st in plan]
    assert sum(caps) <= 8.8 * 60 < 9 * 60
    assert sum(min(gc.estimate_s(n, st), c) for (n, st), c in zip(plan, caps)) <= sum(caps)
    assert gc.own_cap(None, "gritlm", 100) == gc.cap_s("gritlm", 100)  # other presets keep the variants' caps
    for name, st in plan:
        v = gc.VARIANTS[name]
        if v.accel == "rft":
            over = [o for o in v.overrides]
            assert gc.check_overrides("rft-tiny.yaml", over) is None, name
        else:
            args = [f"train.max_steps={st}", *v.overrides, *v.cpu_overrides]
            assert gc.check_overrides("gpu-1b.yaml", [a for a in args if "{base}" not in a]) is None, name
    assert "--preset visit" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_a_capped_variant_keeps_the_steady_figures_it_measured(monkeypatch, tmp_path):
    """A variant stopped at its cap (the launch timed out) still gives the steady tokens/s of the log intervals it
    finished, from metrics.jsonl, beside `capped` and the step reached; a GRPO run's rows carry generation and training
    seconds apart."""
    gc = _gpu_check(monkeypatch)
    recs = [{"step": s, "loss": 1.0, "elapsed_s": 10.0 * s, "tokens": 1000 * s, "gen_s_per_step": 6.0 + s,
             "train_s_per_step": 2.0, "completion_length": 100.0} for s in (1, 2, 3)]

    def launch(*args, **kwargs):  # the run writes its config and three log lines, then its cap stops it
        run = tmp_path / "grpo_1b"
        run.mkdir()
        (run / "config.yaml").write_text("rl:\n  questions_per_step: 8\n  num_generations: 16\n")
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return {"rc": None, "output": "[harness] step 3/100 loss 1.0", "seconds": 75.0, "error": "timed out"}

    monkeypatch.setattr(gc, "launch", launch)
    monkeypatch.setattr(gc, "train_command", lambda *a, **k: (["x"], tmp_path / "a.yaml", None, []))
    (tmp_path / "a.yaml").write_text("")
    monkeypatch.setattr(gc, "check_overrides", lambda *a: None)
    row = gc.run_variant("grpo_1b", 100, tmp_path, [], True, 75.0)
    assert row["capped"] and row["reached_step"] == 3 and "timed out" in row["error"]
    assert row["steady_from_step"] == 2 and row["steady_tokens_per_s"] == 100.0  # (3000 - 1000) / (30 - 10)
    assert row["rl"]["gen_s_per_step"] == 8.5 and row["rl"]["train_s_per_step"] == 2.0  # medians after the first
    assert row["rl"]["gen_tokens_per_s"] == 128 * 100.0 / 8.5


@pytest.mark.slow
def test_the_visit_preset_runs_on_a_cpu(tmp_path, all_cpus):
    """`gpu_check.py --cpu-smoke --preset visit`: every variant of the visit runs its own code path on this CPU (the
    tiny default recipe; the engine bench on a random copy, GRPO, GritLM compiled and eager, ZeRO-3 under DeepSpeed's
    CPU accelerator, fp8 emulated), each writing its row as it ends. About 2.5 minutes, holding every CPU slot (the
    script starts its own launches); in the default tier because a preset that broke unseen would cost a GPU visit."""
    bench = tmp_path / "gpu-day.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu-smoke", "--preset", "visit", "--steps", "2",
                           "--out", str(tmp_path / "runs"), "--bench-out", str(bench)],
                          cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = json.loads(bench.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["visit_engine", "visit_engine_tf", "grpo_1b", "gritlm", "gritlm_eager",
                                            "zero3", "fp8"]
    assert not [r for r in rows if "error" in r]
    assert rows[0]["tokens_per_s"] > 0 and rows[1]["tokens_per_s"] > 0
    assert rows[2]["rl"]["gen_s_per_step"] > 0 and rows[2]["rl"]["train_s_per_step"] > 0
    assert rows[3]["compile"]["mode"] == "regional" and rows[5]["zero_stage"] == 3 and rows[6]["precision"] == "fp8"
    # none of the visit's time on what it does not read: no final checkpoint, no greedy evaluation after GRPO's steps
    assert not [r["variant"] for r in rows[2:] if (tmp_path / "runs" / r["variant"] / "checkpoints").exists()]
    assert "eval at step" not in (tmp_path / "runs" / "grpo_1b.log").read_text()

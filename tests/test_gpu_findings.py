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

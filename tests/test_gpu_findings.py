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

"""Evaluation: the generative eval loss counts each sample once and every process runs the same number of forwards,
whatever the process count (simulated ranks in process; the 2-process run is in test_train.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from harness.config import load_config
from harness.data import samples as data_lib
from harness.evaluation import evaluate_generative
from harness.model import build_model, load_tokenizer
from harness_launch import DEFAULT, ROOT


@pytest.fixture(scope="module")
def model_and_loader():
    cfg = load_config(DEFAULT, ["model.config.num_hidden_layers=1", "model.config.hidden_size=64",
                                "model.config.intermediate_size=128"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok)
    rows = data_lib.load_generative_rows([str(ROOT / "data/sample/gen_eval.jsonl")])
    ds, _ = data_lib.tokenize_dataset(rows, tok, 64)
    return model, DataLoader(ds, batch_size=4, collate_fn=data_lib.GenerativeCollator(tok.pad_token_id))


def shard_totals(model, loader, world: int) -> tuple[torch.Tensor, list[int]]:
    """Each simulated rank's [loss sum, tokens] (what it hands to the all-reduce) added up, and its forward count."""
    total, forwards = torch.zeros(2, dtype=torch.float64), []
    for rank in range(world):
        handed = []
        acc = SimpleNamespace(num_processes=world, process_index=rank, device=torch.device("cpu"),
                              reduce=lambda t, op: handed.append(t.clone()) or t)
        calls = []
        hook = model.register_forward_pre_hook(lambda m, a: calls.append(1))
        evaluate_generative(acc, model, loader)
        hook.remove()
        total += handed[0]
        forwards.append(len(calls))
    return total, forwards


def test_each_eval_sample_counted_once_with_equal_forwards_per_process(model_and_loader):
    model, loader = model_and_loader
    n = len(loader.dataset)  # 40 records in batches of 4
    one, (single,) = shard_totals(model, loader, 1)
    assert single == n // 4
    for world in (2, 3, 9, 50):  # 9: some processes have 4 rows, others 5 (a second batch); 50: more processes than
        # rows: those left without a batch run one whose labels are all ignored
        total, forwards = shard_totals(model, loader, world)
        assert len(set(forwards)) == 1, forwards  # every process in every forward (ZeRO-3)
        assert total[1] == one[1], (world, total, one)  # the same trained tokens: no sample twice, none missing
        assert torch.isclose(total[0], one[0], rtol=1e-5), (world, total, one)

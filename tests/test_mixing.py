"""Weighted mixing of sources and the eval split (harness.data.mixing), on real `datasets.Dataset`s."""

from collections import Counter

import datasets
import numpy as np
import pytest

from harness.data.mixing import epoch_counts, hold_out, mix
from harness.errors import ConfigError


def source(name: str, n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"origin": [f"{name}:{i + 1}" for i in range(n)]})


def test_counts_add_up_and_follow_the_weights():
    assert epoch_counts([400, 400], [3, 1]) == [600, 200]
    assert epoch_counts([10, 7, 3], [1, 1, 1]) == [7, 7, 6]
    assert sum(epoch_counts([123, 45, 6], [0.5, 2, 7.25])) == 174


@pytest.mark.parametrize("sizes", [(400, 400), (1000, 60), (30, 500)])
def test_weights_3_to_1_give_a_3_to_1_mix_over_an_epoch(sizes):
    parts = [source("a", sizes[0]), source("b", sizes[1])]
    mixed, shares = mix(parts, ["a", "b"], [3.0, 1.0], seed=7)
    by_source = Counter(o.split(":")[0] for o in mixed["origin"])
    assert len(mixed) == sum(sizes)
    assert by_source["a"] / by_source["b"] == pytest.approx(3.0, rel=0.05)
    assert [s.samples for s in shares] == [by_source["a"], by_source["b"]]


def test_a_down_weighted_source_gives_distinct_rows_an_up_weighted_one_whole_passes():
    parts = [source("big", 1000), source("small", 60)]
    mixed, shares = mix(parts, ["big", "small"], [1.0, 1.0], seed=0)
    counts = Counter(mixed["origin"])
    big = {o: c for o, c in counts.items() if o.startswith("big")}
    small = {o: c for o, c in counts.items() if o.startswith("small")}
    assert len(big) == 530 and set(big.values()) == {1}  # a subset, no repeats
    assert sum(small.values()) == 530 and set(small.values()) == {8, 9}  # 8 whole passes + 50 rows once more
    assert shares[1].passes == pytest.approx(530 / 60)


def test_the_mix_is_seeded():
    parts = [source("a", 300), source("b", 200)]
    first = mix(parts, ["a", "b"], [1.0, 4.0], seed=3)[0]["origin"]
    assert mix(parts, ["a", "b"], [1.0, 4.0], seed=3)[0]["origin"] == first
    assert mix(parts, ["a", "b"], [1.0, 4.0], seed=4)[0]["origin"] != first


def test_no_weights_concatenate_and_some_weights_are_an_error():
    parts = [source("a", 5), source("b", 3)]
    mixed, shares = mix(parts, ["a", "b"], [None, None], seed=0)
    assert mixed["origin"] == [f"a:{i}" for i in range(1, 6)] + [f"b:{i}" for i in range(1, 4)]
    with pytest.raises(ConfigError, match="'b' has no weight"):
        mix(parts, ["a", "b"], [2.0, None], seed=0)


@pytest.mark.parametrize("split, expect", [(0.1, 50), (7, 7)])
def test_eval_split_is_deterministic_and_disjoint(split, expect):
    parts = [source("a", 300), source("b", 200)]
    train, held = hold_out(parts, split, seed=11, what="data.train_files")
    again_train, again_held = hold_out(parts, split, seed=11, what="data.train_files")
    train_rows = [o for p in train for o in p["origin"]]
    assert len(held) == expect and held["origin"] == again_held["origin"]
    assert [p["origin"] for p in train] == [p["origin"] for p in again_train]
    assert not set(held["origin"]) & set(train_rows)
    assert sorted(set(held["origin"]) | set(train_rows)) == sorted(o for p in parts for o in p["origin"])
    assert hold_out(parts, split, seed=12, what="x")[1]["origin"] != held["origin"]


def test_eval_split_then_mix_never_puts_a_held_out_row_into_training():
    parts = [source("a", 50), source("b", 400)]
    train, held = hold_out(parts, 0.2, seed=1, what="data.train_files")
    mixed, _ = mix(train, ["a", "b"], [5.0, 1.0], seed=1)
    assert not set(held["origin"]) & set(mixed["origin"])


@pytest.mark.parametrize("split", [0.0001, 500, 900])
def test_eval_split_that_leaves_nothing_is_a_config_error(split):
    with pytest.raises(ConfigError, match="data.eval_split"):
        hold_out([source("a", 500)], split, seed=0, what="data.train_files")


def test_pick_keeps_file_order_within_a_pass():
    from harness.data.mixing import pick

    idx = pick(10, 4, np.random.default_rng(0))
    assert list(idx) == sorted(idx) and len(set(idx)) == 4


# ----------------------------------------------------------------------------------------------- data-check --config


def _data_check(*args: str, **env: str):
    import os
    import subprocess
    import sys

    from harness_launch import ROOT

    return subprocess.run([sys.executable, "-m", "harness.cli", "data-check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_data_check_prints_a_recipes_split_and_mix():
    r = _data_check("--config", "configs/default.yaml", "data.eval_files=[]", "data.eval_split=20",
                    "data.train_files=[{path: data/sample/gen.jsonl, weight: 3}, "
                    "{path: data/sample/gen_eval.jsonl, weight: 1}]")
    assert r.returncode == 0, r.stderr
    assert "data.train_files: data/sample/gen.jsonl: format messages, generative, 400 records" in r.stdout
    assert "20 of 440 records of data.train_files held out for evaluation" in r.stdout
    assert "data/sample/gen.jsonl: 383 rows, weight 3 -> 315 samples an epoch (75.0%, 0.82 passes)" in r.stdout
    assert "data/sample/gen_eval.jsonl: 37 rows, weight 1 -> 105 samples an epoch (25.0%, 2.84 passes)" in r.stdout
    assert '"samples": 420' in r.stdout


def test_data_check_of_the_hub_recipe_offline_names_the_data_set():
    r = _data_check("--config", "configs/qwen2.5-1.5b-instruct-chat.yaml", HF_DATASETS_OFFLINE="1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("harness: error: data.train_files: hub data set 'HuggingFaceH4/ultrachat_200k' cannot "
                               "be loaded: offline")

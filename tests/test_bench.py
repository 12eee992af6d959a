"""harness bench: the plan of runs (fast) and one short end-to-end run of all three contenders (slow).

No assertion on speed here: measured figures live in docs/benchmarks.md, not in tests.
"""

from __future__ import annotations

import json

import pytest

from harness.tools import bench
from harness_launch import DEFAULT, ROOT


def test_plan_and_settings():
    args = bench.parse_args([DEFAULT, "train.micro_batch_size=4", "--steps", "40", "--warmup", "10"])
    assert [r["kind"] for r in bench.plan(args)] == ["harness", "raw", "trainer"]
    assert all(r["overrides"] == ["train.micro_batch_size=4"] for r in bench.plan(args))
    assert bench.log_interval(10, 40) == 10 and bench.log_interval(1, 3) == 1 and bench.log_interval(6, 4) == 2
    forced = bench.forced_overrides(10, 40, plain=True)
    assert "train.max_steps=50" in forced and "train.log_every=10" in forced and "train.grad_accum=1" in forced

    # options may come between the overrides (the CLI passes them through as given)
    args = bench.parse_args([DEFAULT, "--steps", "5", "optim.lr=1e-3", "--profiles", "a,b"])
    assert args.steps == 5 and args.overrides == ["optim.lr=1e-3"]
    runs = bench.plan(args)
    assert [(r["name"], r["kind"]) for r in runs] == [("a", "harness"), ("b", "harness")]
    assert runs[1]["overrides"] == ["optim.lr=1e-3", f"{bench.PROFILE_KEY}=b"]


def test_bad_profile_or_key_stops_before_any_run(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main([DEFAULT, "--profiles", "no-such-profile", "--out", str(out)]) == 2
    assert bench.main([DEFAULT, "train.no_such_key=1", "--out", str(out)]) == 2
    assert "harness: error:" in capsys.readouterr().err and not out.exists()


def test_summary_ratios():
    rounds = [[{"name": "harness", "tokens_per_s": 90.0, "step_time_s": 1.1, "tokens": 99, "peak_mem_gb": 1.5},
               {"name": "raw", "tokens_per_s": 100.0, "step_time_s": 1.0, "tokens": 99, "peak_mem_gb": 1.25},
               {"name": "trainer", "tokens_per_s": 80.0, "step_time_s": 1.25, "tokens": 99}]]
    s = bench.summarise(rounds, ["harness", "raw", "trainer"], "raw")
    assert s["harness"]["peak_mem_gb_max"] == 1.5 and s["trainer"]["peak_mem_gb_max"] is None
    table = bench.format_table(s, "raw", "contender")
    assert "peak mem" in table and "1.50 GiB" in table
    assert bench.peak_memory_gb() > 0  # this process's peak RSS (CPU) or allocated GPU memory
    r = bench.headline_ratios(s)
    assert r["harness_step_time_over_raw"] == pytest.approx(1.1)
    assert r["harness_tokens_per_s_over_trainer"] == pytest.approx(90 / 80)
    assert s["trainer"]["tokens_per_s_vs_raw"] == pytest.approx(0.8)
    assert "harness" in bench.format_table(s, "raw", "contender")


def test_grouped_trainer_and_harness_packing_options():
    args = bench.parse_args([DEFAULT, "data.packing=true", "--contenders", "harness,trainer,trainer_grouped",
                             "--harness-packing", "--steps", "2", "--warmup", "1"])
    assert args.harness_packing and args.overrides == ["data.packing=true"]
    assert [r["kind"] for r in bench.plan(args)] == ["harness", "trainer", "trainer_grouped"]
    assert not bench.parse_args([DEFAULT]).harness_packing
    assert bench.parse_args([DEFAULT]).contenders == ["harness", "raw", "trainer"]  # trainer_grouped: on request
    with pytest.raises(SystemExit):
        bench.parse_args([DEFAULT, "--contenders", "harness,nope"])
    # the harness keeps the recipe's packing only with --harness-packing; torch.compile is off either way
    assert "data.packing=false" in bench.forced_overrides(1, 2, plain=True)
    kept = bench.forced_overrides(1, 2, plain=True, keep_packing=True)
    assert "data.packing=false" not in kept and "train.compile=none" in kept


def test_ratios_against_each_trainer():
    rounds = [[{"name": "harness", "tokens_per_s": 300.0, "step_time_s": 1.0, "tokens": 300, "peak_mem_gb": 1.0,
                "final_loss": 2.0},
               {"name": "trainer", "tokens_per_s": 100.0, "step_time_s": 1.0, "tokens": 100, "peak_mem_gb": 4.0,
                "final_loss": 2.0002},
               {"name": "trainer_grouped", "tokens_per_s": 200.0, "step_time_s": 0.5, "tokens": 100,
                "peak_mem_gb": 2.0, "final_loss": None}]]
    s = bench.summarise(rounds, ["harness", "trainer", "trainer_grouped"], None)
    r = bench.headline_ratios(s)
    assert r["harness_tokens_per_s_over_trainer"] == pytest.approx(3.0)
    assert r["harness_tokens_per_s_over_trainer_grouped"] == pytest.approx(1.5)
    assert r["harness_peak_mem_over_trainer"] == pytest.approx(0.25)
    assert r["harness_peak_mem_over_trainer_grouped"] == pytest.approx(0.5)
    assert r["harness_loss_rel_diff_trainer"] == pytest.approx(1e-4, rel=1e-3)
    assert "harness_loss_rel_diff_trainer_grouped" not in r  # no loss logged: no comparison
    lines = bench.ratio_lines(r, rounds=1)
    assert any("trainer_grouped tokens/s = 1.500" in ln and "peak memory" in ln for ln in lines)
    assert "final loss" in bench.format_table(s, None, "contender")


def test_one_step_of_the_grouped_trainer(tmp_path, monkeypatch):
    """The new contender end to end: one warm-up and one measured step on the skewed data (its own process)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bench.json"
    rc = bench.main([DEFAULT, "data.train_files=[data/bench/skewed.jsonl]", "data.max_len=64",
                     "train.micro_batch_size=4", "--contenders", "trainer_grouped", "--steps", "1", "--warmup", "1",
                     "--rounds", "1", "--threads", "1", "--out", str(out)])
    assert rc == 0
    (res,) = json.loads(out.read_text())["rounds"][0]
    assert res["name"] == "trainer_grouped" and res["tokens"] > 0 and res["peak_mem_gb"] > 0


@pytest.mark.slow
def test_bench_three_contenders(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's data paths are relative to the repository root
    out = tmp_path / "bench.json"
    rc = bench.main([DEFAULT, "train.micro_batch_size=4", "--steps", "3", "--warmup", "1", "--rounds", "1",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"harness", "raw", "trainer"}
    for name, s in res["summary"].items():
        assert s["tokens_per_s_median"] > 0 and s["step_time_s_median"] > 0, name
        assert s["tokens_per_s_vs_raw"] > 0 and s["step_time_vs_raw"] > 0, name
        assert s["peak_mem_gb_max"] > 0, name
    for key in ("harness_step_time_over_raw", "harness_tokens_per_s_over_trainer"):
        assert res["ratios"][key] > 0
    (rnd,) = res["rounds"]
    assert [r["name"] for r in rnd] == ["harness", "raw", "trainer"]
    # the same model, data order and settings: the same batches, and the same loss up to rounding
    assert len({r["tokens"] for r in rnd}) == 1
    losses = [r["final_loss"] for r in rnd]
    assert max(losses) - min(losses) < 1e-3 * max(losses)
    assert res["device"]["torch"] and res["date"] and res["settings"]["steps"] == 3

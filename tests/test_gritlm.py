"""The GritLM unified objective end to end: correctness across processes, GradCache, ZeRO-3, the encode API."""

from __future__ import annotations

import pytest
import torch

from harness_launch import (FAST, ROOT, final_weights, initial_weights, metrics, rel_close, report, run_train,
                            settled_update_diff, update_rel_diff)

pytestmark = pytest.mark.slow

EMB = [f"data.emb_train_files=[{ROOT / 'data/sample/emb.jsonl'}]", "data.emb_eval_files=[]", "train.eval_at_start=false"]


_runs: dict = {}


def one_step(tmp_path_factory, mode, nproc, emb_mb, gen_mb, accel=None, extra=()):
    """The first record and the final weights of a 1-step run; the same settings run once per session (the tests
    below compare some of them with more than one other run)."""
    accel = {None: "ddp"}.get(accel, accel) if nproc > 1 else accel  # run_train: 2 processes and no accel = DDP
    key = (mode, nproc, emb_mb, gen_mb, accel, tuple(extra))
    if key not in _runs:
        out = tmp_path_factory.mktemp(f"{mode}-{nproc}")
        run_train([f"train.output_dir={out}", f"loss.mode={mode}", *EMB, "train.max_steps=1", *FAST,
                   f"train.emb_micro_batch_size={emb_mb}", f"train.micro_batch_size={gen_mb}", *extra],
                  nproc=nproc, accel=accel)
        _runs[key] = metrics(out)[0], final_weights(out)
    return _runs[key]


@pytest.mark.parametrize("mode", ["embedding", "unified"])
def test_two_processes_equal_one_process_with_twice_the_batch(mode, tmp_path_factory):
    """Negatives gathered across processes with their gradient: the loss and the update after one step do not
    depend on how the batch is split."""
    m2, w2 = one_step(tmp_path_factory, mode, 2, emb_mb=4, gen_mb=8)
    m1, w1 = one_step(tmp_path_factory, mode, 1, emb_mb=8, gen_mb=16)
    keys = ["loss"] + (["loss_emb", "loss_gen"] if mode == "unified" else [])
    for k in keys:
        assert rel_close(m2[k], m1[k], 1e-4), (k, m2[k], m1[k])
    assert rel_close(m2["grad_norm"], m1["grad_norm"], 1e-4), (m2["grad_norm"], m1["grad_norm"])
    assert update_rel_diff(w2, w1, initial_weights()) < 1e-4


def test_without_gathering_the_split_changes_the_loss(tmp_path_factory):
    """Control for the test above: with loss.gather_negatives=false each process only sees its own negatives."""
    m2, _ = one_step(tmp_path_factory, "embedding", 2, emb_mb=4, gen_mb=8, extra=["loss.gather_negatives=false"])
    m1, _ = one_step(tmp_path_factory, "embedding", 1, emb_mb=8, gen_mb=16)  # the reference of the test above
    assert not rel_close(m2["loss"], m1["loss"], 1e-3)


@pytest.mark.parametrize("nproc, accel, chunks", [(1, None, 4), (2, "ddp", 2), (2, "zero1", 2), (2, "zero2", 2),
                                                 (2, "zero3", 2)])
def test_cached_representations_match_the_full_batch(nproc, accel, chunks, tmp_path_factory):
    """GradCache with k chunks = one pass over the batch: same loss, same update (unified: the generative unit too).
    The full-batch run under DDP is the 2-process run of the 2-vs-1-process test above."""
    mb = 8 // nproc
    mc, wc = one_step(tmp_path_factory, "unified", nproc, emb_mb=mb, gen_mb=8, accel=accel,
                      extra=[f"loss.grad_cache_chunks={chunks}"])
    mf, wf = one_step(tmp_path_factory, "unified", nproc, emb_mb=mb, gen_mb=8, accel=accel)
    for k in ("loss", "loss_emb", "loss_gen", "grad_norm"):
        assert rel_close(mc[k], mf[k], 1e-5), (k, mc[k], mf[k])
    assert update_rel_diff(wc, wf, initial_weights()) < 1e-4
    # weight by weight where the gradient was clear of Adam's eps (98% of the weights): the same value. A max over
    # all weights (< 1e-5 before) failed at 1.3e-5 on one o_proj weight whose update was 0.16 of the step (2026-11-26)
    worst, share = settled_update_diff(wc, wf, initial_weights())
    assert worst < 1e-6 and share > 0.95, (worst, share)


def test_unified_zero3_with_accumulation_matches_ddp(tmp_path):
    args = ["loss.mode=unified", *EMB, "train.max_steps=4", *FAST, "train.grad_accum=2",
            "train.emb_micro_batch_size=4", "train.micro_batch_size=8"]
    run_train([f"train.output_dir={tmp_path / 'ddp'}", *args], nproc=2)
    run_train([f"train.output_dir={tmp_path / 'z3'}", *args], nproc=2, accel="zero3")
    assert report(tmp_path / "z3")["zero_stage"] == 3
    for a, b in zip(metrics(tmp_path / "ddp"), metrics(tmp_path / "z3")):
        for k in ("loss", "loss_emb", "loss_gen"):
            assert rel_close(a[k], b[k], 1e-4), (a["step"], k, a[k], b[k])


def test_gritlm_tiny_recipe_runs_and_the_model_embeds_and_generates(tmp_path):
    """A short run of configs/gritlm-tiny.yaml: step-0 and final retrieval metrics are logged, losses are logged
    separately, and the exported model embeds (instruction-aware) and generates through harness.encode."""
    from harness.encode import GritModel

    out = tmp_path / "grit"
    run_train([f"train.output_dir={out}", "train.max_steps=6", "train.log_every=3", "train.progress_bar=false",
               "train.report_to=[tensorboard]", "train.tracker_project=grit-proj"],
              config=str(ROOT / "configs" / "gritlm-tiny.yaml"))
    lines = [r for r in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert lines[0]["step"] == 0 and "eval_recall_at_1" in lines[0] and "eval_mrr" in lines[0]
    trained = [r for r in lines if "loss" in r]
    assert all({"loss", "loss_emb", "loss_gen"} <= set(r) for r in trained)
    rep = report(out)
    assert rep["eval_at_start"]["eval_recall_at_1"] is not None and rep["eval"]["eval_recall_at_1"] is not None
    tags = set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for ev in (out / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(ev))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"train/loss", "train/loss_emb", "train/loss_gen", "eval/recall_at_1", "eval/mrr", "train/lr",
            "time/tokens_per_s", "system/mem_gb"} <= tags, tags
    assert not {t for t in tags if "/" not in t}, tags  # every tag in a group

    m = GritModel.load(out / "final", device="cpu")
    q = m.encode(["Which town has 4 bridges?"], instruction="Retrieve the passage that answers the question.")
    d = m.encode(["The town of Varnel has 4 bridges.", "Seven plus five equals twelve.", "A third text."])
    assert q.shape == (1, m.model.config.hidden_size) and d.shape[0] == 3
    assert torch.allclose(d.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert not torch.allclose(q, m.encode(["Which town has 4 bridges?"]))  # the instruction matters
    assert isinstance(m.generate("What is 2 + 3?", max_new_tokens=8), str)

    from gritlm import GritLM  # the run's final/ as it is, in gritlm's own class (issue 27)

    theirs = GritLM(str(out / "final"), mode="unified", pooling_method="mean", attn="bbcc", device="cpu",
                    torch_dtype=torch.float32)
    q_ref = theirs.encode(["Which town has 4 bridges?"],
                          instruction="<|user|>\nRetrieve the passage that answers the question.\n<|embed|>\n")
    d_ref = theirs.encode(["The town of Varnel has 4 bridges.", "Seven plus five equals twelve.", "A third text."],
                          instruction="<|embed|>\n")
    assert (q - torch.from_numpy(q_ref)).abs().max() <= 1e-5 and (d - torch.from_numpy(d_ref)).abs().max() <= 1e-5

    from sentence_transformers import SentenceTransformer  # final/ is a sentence-transformers model too (issue 37)

    st = SentenceTransformer(str(out / "final"), device="cpu")
    q_st = st.encode(["Which town has 4 bridges?"],
                     prompt=m.settings["instruction_template"].format(instruction="Retrieve the passage that answers the question."))
    d_st = st.encode(["The town of Varnel has 4 bridges.", "Seven plus five equals twelve.", "A third text."])
    print("sentence-transformers vs GritModel max abs:", (q - torch.from_numpy(q_st)).abs().max().item(),
          (d - torch.from_numpy(d_st)).abs().max().item())
    assert (q - torch.from_numpy(q_st)).abs().max() <= 1e-5 and (d - torch.from_numpy(d_st)).abs().max() <= 1e-5
    trained = "Given a question, retrieve the sentence that answers it."  # an instruction of data/sample/emb.jsonl
    assert trained in m.settings["instructions"]  # final/harness.json
    named = st.encode(["Which town has 4 bridges?"], prompt_name=trained)  # the export names it (issue 48)
    assert (m.encode(["Which town has 4 bridges?"], instruction=trained) - torch.from_numpy(named)).abs().max() <= 1e-5

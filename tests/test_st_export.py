"""final/ as a sentence-transformers model (harness/checkpoint/st_export.py) and its MTEB evaluation
(harness/tools/mteb_eval.py). The trained gritlm-tiny run checks the same on a real export (tests/test_gritlm.py)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.checkpoint.st_export import write_sentence_transformers
from harness.encode import DEFAULTS, GritModel
from harness.model import BUNDLED_TOKENIZER

TEXTS = ["The town of Varnel has 4 bridges.", "Seven plus five equals twelve.", "A third text, longer than the others."]
INSTRUCTION = "Retrieve the passage that answers the question."


def save_final(folder, loss_mode="unified", write=True, **settings):
    """A random tiny Llama saved as an export would be: weights, tokenizer, harness.json, the ST files."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    settings = {**DEFAULTS, "loss_mode": loss_mode, **settings}
    (folder / "harness.json").write_text(json.dumps(settings))
    return model, tok, settings, write_sentence_transformers(folder, settings) if write else None


@pytest.fixture(scope="module")
def final(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st") / "final"
    model, tok, settings, written = save_final(folder)
    assert written == folder
    return folder, model, tok, settings


def st_and_grit_max_abs(folder, instruction_template, **st_kwargs):
    """(max abs without an instruction, with one) between SentenceTransformer(folder) and GritModel.encode."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu", **st_kwargs)
    grit = GritModel.load(folder, device="cpu")
    plain = (grit.encode(TEXTS) - torch.from_numpy(st.encode(TEXTS))).abs().max().item()
    instr = (grit.encode(TEXTS, instruction=INSTRUCTION)
             - torch.from_numpy(st.encode(TEXTS, prompt=instruction_template.format(instruction=INSTRUCTION))))
    return plain, instr.abs().max().item()


def test_sentence_transformers_embeds_as_grit_model_and_generation_stays_causal(final):
    from transformers import AutoModelForCausalLM

    folder, model, tok, settings = final
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "config_sentence_transformers.json"):
        assert (folder / name).is_file(), name
    plain, instr = st_and_grit_max_abs(folder, settings["instruction_template"])
    assert plain <= 1e-5 and instr <= 1e-5, (plain, instr)
    # the bidirectional attention is what makes them equal: causal attention in the encoder embeds otherwise
    plain_c, instr_c = st_and_grit_max_abs(folder, settings["instruction_template"],
                                           config_kwargs={"is_causal": True})
    assert plain_c > 1e-3 and instr_c > 1e-3, (plain_c, instr_c)
    # plain transformers: causal, the saved model's logits and greedy generation
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert lm.config.is_causal is True
    ids = tok("The town of Varnel has", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(lm(**ids).logits, model.eval()(**ids).logits)
        assert torch.equal(lm.generate(**ids, max_new_tokens=5, do_sample=False),
                           model.generate(**ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("loss_mode,pooling", [("generative", "mean"), ("unified", "lasttoken"),
                                               ("embedding", "weightedmean")])
def test_no_sentence_transformers_files_where_they_would_embed_otherwise(tmp_path, loss_mode, pooling):
    *_, written = save_final(tmp_path, loss_mode=loss_mode, pooling=pooling)
    assert written is None and not (tmp_path / "modules.json").exists()
    assert "is_causal" not in json.loads((tmp_path / "config.json").read_text())


def test_causal_embedding_run_has_no_attention_override(tmp_path):
    *_, written = save_final(tmp_path, loss_mode="embedding", embed_attention="causal")
    assert written == tmp_path and "config_kwargs" not in json.loads((tmp_path / "sentence_bert_config.json").read_text())
    plain, instr = st_and_grit_max_abs(tmp_path, DEFAULTS["instruction_template"])
    assert plain <= 1e-5 and instr <= 1e-5, (plain, instr)


def test_lora_final_writes_the_files_to_merged(tmp_path):
    merged = tmp_path / "merged"
    *_, settings, _ = save_final(merged, write=False)
    (tmp_path / "adapter_config.json").write_text("{}")
    assert write_sentence_transformers(tmp_path, settings) == merged
    assert (merged / "modules.json").is_file() and not (tmp_path / "modules.json").exists()


def test_mteb_evaluates_the_final_on_a_local_retrieval_task(final, tmp_path, repo_root, capsys, monkeypatch):
    from harness.tools import mteb_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = (repo_root / "data" / "sample" / "emb_eval.jsonl").read_text().splitlines()
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(rows[:12]) + "\n")  # every instruction of the sample file, a few rows each
    assert mteb_eval.main([str(final[0]), str(data)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ndcg_at_10=" in ln]
    assert len(lines) == len({json.loads(r)["query"][0] for r in rows[:12]}) >= 2, lines
    for line in lines:
        ndcg = float(line.split("ndcg_at_10=")[1].split()[0])
        assert 0.0 <= ndcg <= 1.0 and "recall_at_10=" in line, line
    # MTEB's recall@1 is GritModel's top-1 hit rate on the same queries and corpus (one positive per query here):
    # the queries got their instruction, the passages theirs or the plain template
    grit = GritModel.load(final[0], device="cpu")
    for (task, prompts), line in zip(mteb_eval.retrieval_tasks(data, DEFAULTS["instruction_template"],
                                                         DEFAULTS["plain_template"]), lines):
        task.load_data()
        split = task.dataset["default"]["test"]
        instruction = task.metadata.description.split(": ", 1)[1]
        q = grit.encode(list(split["queries"]["text"]), instruction=instruction)
        symmetric = prompts["document"] != DEFAULTS["plain_template"]  # passages with the query's instruction
        d = grit.encode(list(split["corpus"]["text"]), instruction=instruction if symmetric else "")
        top = [split["corpus"]["id"][i] for i in (q @ d.T).argmax(1).tolist()]
        hits = sum(top[i] in split["relevant_docs"][qid] for i, qid in enumerate(split["queries"]["id"]))
        assert float(line.split("recall_at_1=")[1].split()[0]) == pytest.approx(hits / len(top), abs=1e-4), line


def test_mteb_command_bad_input_is_one_line(final, tmp_path, capsys):
    from harness.cli import main

    folder = final[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "pos": ["p"]}\n{"query": "q2"}\n')
    for argv, expect in ((["mteb", str(tmp_path), str(bad)], "is not a sentence-transformers model"),
                         (["mteb", str(folder), str(bad)], f"{bad}:2: not an embedding record"),
                         (["mteb", str(folder), str(tmp_path / "none.jsonl")], "no such embedding file")):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harness: error: ") and expect in err[0], err


def test_each_training_instruction_is_a_named_prompt_equal_to_grit_model(tmp_path):
    """The export named only the plain prompt: `st.encode(q, prompt_name=instruction)` failed for the instructions a
    run trained with. Each of harness.json's "instructions" (the training data's, data.sources.embedding_instructions)
    is now a prompt named by the instruction, and embeds as GritModel.encode(q, instruction=...) does."""
    from sentence_transformers import SentenceTransformer

    trained = [INSTRUCTION, "Given a question, retrieve the sentence that answers it.", "plain"]
    *_, folder = save_final(tmp_path, instructions=trained)
    st = SentenceTransformer(str(folder), device="cpu")
    grit = GritModel.load(folder, device="cpu")
    assert st.default_prompt_name == "plain" and st.prompts["plain"] == DEFAULTS["plain_template"]  # kept plain
    exported = json.loads((folder / "config_sentence_transformers.json").read_text())["prompts"]
    assert set(exported) == {"plain", *trained[:2]} <= set(st.prompts)  # (ST adds empty "query" / "document")
    for instruction in trained[:2]:
        gap = (grit.encode(TEXTS, instruction=instruction)
               - torch.from_numpy(st.encode(TEXTS, prompt_name=instruction))).abs().max().item()
        assert gap <= 1e-5, (instruction, gap)  # the same tokens pooled: fp32 rounding only
    # the MTEB wrapper takes a task's prompts from the named ones (else it formats the instruction template)
    named = {"plain": "P", INSTRUCTION: "Q"}
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"query": [INSTRUCTION, "q"], "pos": ["p"]}) + "\n"
                    + json.dumps({"query": ["Other.", "q"], "pos": [["Doc.", "p"]]}) + "\n")
    from harness.tools import mteb_eval

    got = [p for _, p in mteb_eval.retrieval_tasks(data, DEFAULTS["instruction_template"], "<plain>", named)]
    assert got == [{"query": DEFAULTS["instruction_template"].format(instruction="Other."),  # (tasks by instruction)
                    "document": DEFAULTS["instruction_template"].format(instruction="Doc.")},
                   {"query": "Q", "document": "P"}], got


def test_the_training_instructions_are_counted_and_capped(tmp_path):
    from harness.data import sources

    f = tmp_path / "emb.jsonl"
    rows = [{"query": ["Find the answer.", "q1"], "pos": [["Doc.", "p1"]], "neg": ["n"]},
            {"query": ["Find the answer.", "q2"], "pos": ["p2"], "neg": [["Doc.", "n2"], ["Rare.", "n3"]]},
            {"query": "q3", "pos": ["p3"], "neg": [["Doc.", "n4"]]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = sources.load_rows([str(f)], "embedding", None, "data.emb_train_files", 0)
    assert sources.embedding_instructions(ds) == {"instructions": ["Doc.", "Find the answer.", "Rare."],
                                                  "distinct_instructions": 3}
    assert sources.embedding_instructions(ds, most=2)["instructions"] == ["Doc.", "Find the answer."]
    assert sources.MAX_NAMED_PROMPTS == 64

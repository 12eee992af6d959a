"""Evaluate a run's embedder with MTEB's own retrieval evaluation on a local embedding file.

    harness mteb runs/gritlm-tiny/final [data/sample/emb_eval.jsonl]
    python -m harness.tools.mteb_eval runs/gritlm-tiny/final [data/sample/emb_eval.jsonl]

final/ (or final/merged/ for LoRA) is loaded as a sentence-transformers model (harness/checkpoint/st_export.py). The
embedding file (the training format: {"query", "pos", "neg"}; a query or passage is a text or [instruction, text])
becomes one MTEB retrieval task per query instruction: its queries, a corpus of every positive and negative text of
those rows, the positives as the relevant documents. Queries are embedded with the instruction in the run's instruction
template (harness.json), passages with theirs or the plain template: the model's named prompt where the export
named the instruction (each instruction of the training data is one), else formatted from the template. Prints the main score (nDCG@10) and a few more
per task; nothing is downloaded, nothing is cached (mteb's result cache is off).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from harness.errors import DataError, HarnessError, one_line
from harness.checkpoint.st_export import st_folder
from harness.encode import DEFAULTS

SCORES = ("ndcg_at_10", "map_at_10", "recall_at_1", "recall_at_10", "mrr_at_10")


def _split(item) -> tuple[str, str]:
    return (item[0], item[1]) if isinstance(item, list) else ("", item)


def retrieval_tasks(data_file: str | Path, instruction_template: str, plain_template: str,
                    named: dict | None = None) -> list[tuple]:
    """[(MTEB retrieval task, its prompts {"query": text, "document": text})], one per query instruction of data_file
    (mteb takes prompts keyed by task name only for the tasks it registers: one evaluation per task). `named`: the
    model's exported prompts (config_sentence_transformers.json: "plain" and each training instruction by name),
    used for the instructions they name; any other is formatted with instruction_template."""
    named = named or {}

    def prompt(instruction: str) -> str:
        if not instruction:
            return named.get("plain", plain_template)
        return named.get(instruction) or instruction_template.format(instruction=instruction)

    from datasets import Dataset
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
    from mteb.abstasks.task_metadata import TaskMetadata

    groups: dict[str, list[dict]] = {}
    if not Path(data_file).is_file():
        raise DataError(f"{data_file}: no such embedding file")
    for n, line in enumerate(Path(data_file).read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                if not (row["query"] and row["pos"]):
                    raise KeyError("query and pos must not be empty")
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{data_file}:{n}: not an embedding record with query and pos ({one_line(e)})") from e
            groups.setdefault(_split(row["query"])[0], []).append(row)
    tasks = []
    for k, (instruction, rows) in enumerate(sorted(groups.items())):
        name = f"HarnessLocal{k}"
        doc_ids: dict[str, str] = {}
        doc_instruction = ""
        queries, qrels = [], {}
        for i, row in enumerate(rows):
            qid = f"q{i}"
            queries.append({"id": qid, "text": _split(row["query"])[1]})
            for j, item in enumerate([*row["pos"], *row.get("neg", [])]):
                doc_instruction, text = _split(item)
                did = doc_ids.setdefault(text, f"d{len(doc_ids)}")
                if j < len(row["pos"]):
                    qrels.setdefault(qid, {})[did] = 1
        corpus = [{"id": did, "text": text, "title": ""} for text, did in doc_ids.items()]
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:12]
        metadata = TaskMetadata(
            name=name, type="Retrieval", main_score="ndcg_at_10", category="t2t", modalities=["text"],
            description=f"{Path(data_file).name}: {instruction or 'no instruction'}", reference=None,
            dataset={"path": str(Path(data_file).resolve()), "revision": digest}, eval_splits=["test"],
            eval_langs=["eng-Latn"], date=None, domains=None, task_subtypes=None, license=None,
            annotations_creators=None, dialect=None, sample_creation=None, bibtex_citation="")
        split = RetrievalSplitData(queries=Dataset.from_list(queries), corpus=Dataset.from_list(corpus),
                                   relevant_docs=qrels, top_ranked=None)

        def load_data(self, num_proc=None, _split=split, **kwargs) -> None:
            self.dataset = {"default": {"test": _split}}
            self.data_loaded = True

        task_class = type(name, (AbsTaskRetrieval,), {"metadata": metadata, "load_data": load_data})
        prompts = {"query": prompt(instruction), "document": prompt(doc_instruction)}
        tasks.append((task_class(), prompts))
    return tasks


def evaluate(final: str | Path, data_file: str | Path, batch_size: int = 32) -> dict:
    """{task description: {score: value}} of final/'s sentence-transformers model on data_file's retrieval tasks."""
    import mteb
    from sentence_transformers import SentenceTransformer

    folder = st_folder(Path(final))
    if not (folder / "modules.json").is_file():
        raise HarnessError(f"{folder} is not a sentence-transformers model (no modules.json): the export of an "
                           f"embedding or unified run with model.pooling=mean is (docs/gritlm.md)")
    settings_file = folder / "harness.json"
    settings = {**DEFAULTS, **(json.loads(settings_file.read_text()) if settings_file.is_file() else {})}
    # the prompts the export named (the training instructions), else the instruction template of harness.json
    st_config = folder / "config_sentence_transformers.json"
    named = json.loads(st_config.read_text()).get("prompts", {}) if st_config.is_file() else {}
    tasks = retrieval_tasks(data_file, settings["instruction_template"], settings["plain_template"], named)
    model = SentenceTransformer(str(folder), device="cpu" if not _cuda() else "cuda")
    out = {}
    for task, prompts in tasks:
        model.prompts = prompts
        result = mteb.evaluate(model, task, cache=None, encode_kwargs={"batch_size": batch_size},
                               show_progress_bar=False)
        scores = result.task_results[0].scores["test"][0]
        out[task.metadata.description] = {k: float(scores[k]) for k in SCORES if k in scores}
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="harness mteb", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("final", help="a run's final/ folder (the embedder)")
    p.add_argument("data", nargs="?", default=str(Path(__file__).resolve().parents[2] / "data" / "sample" /
                                                  "emb_eval.jsonl"), help="embedding JSONL (default: the sample's)")
    args = p.parse_args(argv)
    for name, scores in evaluate(args.final, args.data).items():
        print(f"{name}: " + "  ".join(f"{k}={v:.4f}" for k, v in scores.items()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except HarnessError as err:
        print(f"harness: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)

"""`harness rft bench`: the generation engines side by side on the same questions, model, device and settings.

    harness rft bench configs/rft-tiny.yaml --questions 32 rft.oversample=16 rft.max_new_tokens=200
    harness rft bench configs/rft-tiny.yaml --engines one,static,continuous
    harness rft bench configs/rft-tiny.yaml --engines continuous,transformers --repeats 2 rft.compile=true

Per engine: the sampling of `rft generate` (the first N train questions x rft.oversample, rft.temperature, rft.top_p,
rft.max_new_tokens): sequences/s, new tokens/s (EOS included), the share of the computed slot-steps (sequences in
the batch x decode steps) spent on padding (finished rows decoded while a static batch waits for its longest), the
mean batch, the answers' lengths, the GPU busy share (NVML, sampled every 0.5 s; null on CPU), the host time per
decode step outside the model calls and the waits for the device (the engine's own work: rows, readback, stop
checks), the graphs dynamo compiled in the first run and the recompilations in the warm runs after it; then greedy
decoding of the same questions (one answer each, as `rft test`) and whether every engine's greedy text equals the
static engine's. Engines: static (batches of rft.questions_per_batch questions), continuous (rft.compile decides
whether its step is compiled), transformers (transformers' continuous batching), one (one sequence per generate()
call). Best of `--repeats`, engines interleaved; each engine is built once and serves every run (its cache
allocated and its step compiled in the first: `graphs` counts that run's, `recompiles` the later runs').
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from harness.errors import ConfigError
from harness.rft.contract import GREEDY, Sampling, encode, texts
from harness.rft.engine import ContinuousEngine, compile_default
from harness.rft.stats import Stats
from harness.rft.sampling import StaticEngine
from harness.observe.monitor import UtilisationSampler
from harness.rft.decode import graphs
from harness.rft.sampling import load_for_generation, prompt_text
from harness.rft.tasks import build_task
from harness.hardware import environment_report
from harness.rft.hf_engine import TransformersEngine
from harness.files import write_json

ENGINES = ("one", "static", "continuous", "transformers")


def build(name: str, r, model, tok):
    stops, warp = tuple(r.stop_strings), dict(top_k=r.top_k, min_p=r.min_p)
    if name == "continuous":
        return ContinuousEngine(model, tok, r.max_new_tokens, r.micro_batch_sequences, r.kv_cache_gb, stops, print,
                                compile=compile_default(r.compile, model), **warp)
    if name == "transformers":
        return TransformersEngine(model, tok, r.max_new_tokens, r.micro_batch_sequences, stops, print, **warp)
    if name == "static":
        return StaticEngine(model, tok, r.max_new_tokens, r.micro_batch_sequences, r.questions_per_batch, stops, print,
                            **warp)
    return StaticEngine(model, tok, r.max_new_tokens, 1, 1, stops, print, **warp)


def fresh(e) -> None:
    """The engine's counters from zero (its other state kept)."""
    launches, e.stats = e.stats.launches, Stats()
    e.stats.launches = launches


def bench(r, model: Optional[str], questions: int = 32, repeats: int = 1,
          engines: tuple = ("static", "continuous")) -> dict:
    """{"rows": one per engine, "greedy": identity check, "settings": ...}; see the module docstring. `r`: cfg.rft;
    model: --model, else model.name_or_path."""
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise ConfigError(f"--engines: unknown engine '{bad[0]}' (one of {', '.join(ENGINES)})")
    task = build_task(r)
    qs = task.split("train")[:questions]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_for_generation(model, device)
    prompts = encode(tok, [prompt_text(task, q, tok) for q in qs])
    best: dict[str, dict] = {}
    compiled: dict[str, list] = {n: [] for n in engines}  # graphs dynamo compiled in each run of the engine
    first: dict[str, float] = {}
    built = {name: build(name, r, model, tok) for name in engines}  # once: its cache and graphs serve every run
    for rep in range(repeats):
        for name in engines:
            e = built[name]
            fresh(e)  # this run's counts
            before = graphs()
            if device.type == "cuda":
                torch.cuda.synchronize()
            util = UtilisationSampler(0.5).start()  # GPU busy share (NVML) or CPU, sampled while it runs
            t0 = time.perf_counter()
            got = e.generate(prompts, r.oversample, Sampling(r.temperature, r.top_p, seed=r.seed + rep))
            secs = time.perf_counter() - t0
            out = texts(tok, got, e.eos)  # (decoded outside the timed call, as a caller does)
            busy = util.stop()["metrics"]
            compiled[name].append(graphs() - before)
            first.setdefault(name, round(secs, 2))  # with compilation, when the step is compiled
            st = e.stats
            row = {"engine": name, "sequences": st.sequences, "new_tokens": st.tokens, "seconds": round(secs, 2),
                   "sequences_per_s": round(st.sequences / secs, 2), "new_tokens_per_s": round(st.tokens / secs, 1),
                   "slot_waste": round(st.waste(), 3) if st.steps else None,  # transformers: not counted
                   "mean_batch": round(st.mean_batch(), 1) if st.steps else None,
                   "slots": getattr(e, "max_slots", None), "compiled_step": getattr(e, "compiled", None),
                   "queue_drains": getattr(st, "queue_drains", None),
                   "host_ms_per_step": None if st.host_ms_per_step() is None else round(st.host_ms_per_step(), 3),
                   "model_ms_per_step": round(1000 * st.model_seconds / st.steps, 3) if st.model_seconds else None,
                   "gpu_busy": (busy.get("gpu_util") or {}).get("mean"),
                   "cpu_busy": (busy.get("cpu_util") or {}).get("mean"),
                   "answer_tokens": {"min": min(st.lengths), "median": statistics.median(st.lengths),
                                     "p90": sorted(st.lengths)[int(0.9 * (len(st.lengths) - 1))],
                                     "max": max(st.lengths)},
                   "success_rate": round(sum(task.verify(a, q) for q, g in zip(qs, out) for a in g)
                                         / max(st.sequences, 1), 3)}
            if name not in best or row["sequences_per_s"] > best[name]["sequences_per_s"]:
                best[name] = row
    rows = [best[n] for n in engines]
    for n, row in zip(engines, rows):  # compiled in the first run; recompiled in the warm runs after it
        row["graphs"], row["recompiles"] = compiled[n][0], sum(compiled[n][1:]) if repeats > 1 else None
        row["first_run_s"] = first[n]
    base = best.get("static", rows[0])
    for row in rows:
        row["speedup_sequences"] = round(row["sequences_per_s"] / base["sequences_per_s"], 2)
        row["speedup_tokens"] = round(row["new_tokens_per_s"] / base["new_tokens_per_s"], 2)
    greedy, lens = {}, []
    for name in engines:
        e = built[name]
        fresh(e)
        greedy[name] = [g[0] for g in texts(tok, e.generate(prompts, 1, GREEDY), e.eos)]
        lens = lens or e.stats.lengths
    ref = greedy.get("static", next(iter(greedy.values())))
    return {"rows": rows, "greedy": {
        "questions": len(prompts), "identical_to_static": {n: g == ref for n, g in greedy.items()},
        "differing": {n: sum(a != b for a, b in zip(g, ref)) for n, g in greedy.items()},
        "answer_tokens": {"min": min(lens), "median": statistics.median(lens), "max": max(lens)}},
        "settings": {"questions": len(prompts), "oversample": r.oversample, "temperature": r.temperature,
                     "top_p": r.top_p, "max_new_tokens": r.max_new_tokens, "questions_per_batch": r.questions_per_batch,
                     "micro_batch_sequences": r.micro_batch_sequences, "device": str(device),
                     "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "repeats": repeats}}


def report(result: dict, path: Optional[str] = None) -> None:
    """The table (and the JSON file when `path` is given)."""
    from datetime import datetime, timezone

    env = environment_report()
    gpus = env.get("gpus") or []
    dev = gpus[0].get("name", "GPU") if gpus else f"CPU ({env.get('cpu_count', '?')} cores)"
    s = result["settings"]
    result["environment"] = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "device": dev, "torch": env["torch"]}
    print(f"rft generation engines, {result['environment']['date']}, {dev}, torch {env['torch']}, {s['dtype']}; "
          f"{s['questions']} questions x {s['oversample']} samples, temperature {s['temperature']}, top-p "
          f"{s['top_p']}, max_new_tokens {s['max_new_tokens']}")
    unit = "gpu" if any(r["gpu_busy"] is not None for r in result["rows"]) else "cpu"
    print(f"| engine | sequences | new tokens | seconds | sequences/s | new tokens/s | slot-steps wasted | "
          f"mean batch | answer tokens min/median/p90/max | {unit.upper()} busy | host ms/step | graphs, "
          f"recompiles | speed-up (tokens/s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        a, b, w = r["answer_tokens"], r[f"{unit}_busy"], r["slot_waste"]
        print(f"| {r['engine']}{' (compiled)' if r.get('compiled_step') else ''} | {r['sequences']} | "
              f"{r['new_tokens']} | {r['seconds']} | {r['sequences_per_s']} | {r['new_tokens_per_s']} | "
              f"{'-' if w is None else f'{w:.1%}'} | {r['mean_batch'] or '-'} | "
              f"{a['min']}/{a['median']}/{a['p90']}/{a['max']} | "
              f"{'-' if b is None else f'{b:.0f}%'} | {r.get('host_ms_per_step') or '-'} | {r.get('graphs')}, "
              f"{r.get('recompiles')} | {r['speedup_tokens']}x |")
    g = result["greedy"]
    same = ", ".join(f"{n}: {'identical' if ok else str(g['differing'][n]) + ' differ'}"
                     for n, ok in g["identical_to_static"].items())
    print(f"greedy ({g['questions']} questions, answers of {g['answer_tokens']['min']}-{g['answer_tokens']['max']} "
          f"tokens) against static: {same}")
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(path), result)

"""Rejection-sampling fine-tuning (docs/rft.md): tasks.py (questions, verifier), the engines (engine.py, decode.py,
sampling.py, hf_engine.py, vllm_engine.py), generate.py, evaluate.py, bench.py, shards.py. The `harness rft` command
(sft-data, generate, train, test, bench) is harness/tools/rft.py; `python -m harness.rft` runs it too (__main__.py).
"""

"""Distributed training, one module a job: processes.py (process setup: the Accelerator, the DeepSpeed choice, the
launcher's environment), collectives.py (on_main, broadcast, all_gather, spread: what every other part calls across
processes), zero.py (ZeRO facts and DeepSpeed's config), sequence.py (train.sequence_parallel)."""

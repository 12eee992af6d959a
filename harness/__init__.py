"""harness: a training harness for language models (generative and GritLM-style embedding objectives).

Train the default job:  python -m harness.train --config configs/default.yaml
See README.md for the quickstarts and docs/multi-gpu.md for CPU, single-GPU, multi-GPU and multi-node launches.
"""

__version__ = "0.1.0"

IGNORE_INDEX = -100  # the label of positions the loss skips (torch cross_entropy's ignore_index)

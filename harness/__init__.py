"""harness: a training harness for language models (generative and GritLM-style embedding objectives).

Train the default job:  python -m harness.train --config configs/default.yaml
See README.md for CPU, single-GPU and multi-GPU launches.
"""

__version__ = "0.1.0"

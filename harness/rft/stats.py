"""What every generation engine of `harness rft generate | test | bench` counts (`Stats`, the rows of `rft bench`)
and the ids that end an answer (`eos_ids`): shared by rft.engine=continuous (harness/rft/engine.py), static
(sampling.py) and transformers (hf_engine.py).

    python -c "from harness.rft.stats import Stats; help(Stats)"
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from harness.errors import DataError


class Stats:
    """Counters of one engine: sequences and new tokens (EOS included), seconds generating, decode steps, and the
    slot-steps computed (sequences in the batch, summed over the decode steps) against the ones a running sequence
    used: 1 - used / computed is the share wasted on padding (a static batch decodes its finished rows until its
    longest ends); computed / steps is the mean batch."""

    def __init__(self) -> None:
        self.sequences = self.tokens = self.slot_steps = self.used_slot_steps = self.steps = 0
        self.seconds = 0.0
        self.lengths: list[int] = []  # new tokens of each sequence
        self.model_seconds = self.wait_seconds = 0.0  # in model calls (launches on CUDA), waiting for tokens
        self.launches = False  # the model calls only launch work (CUDA): their time is the host's
        self.queue_drains = 0  # tokens read with no later decode step queued while sequences were running

    def host_ms_per_step(self) -> Optional[float]:
        """Host time per decode step outside the waits for the device: the engine's own work and, on CUDA, the
        model calls' launches (on CPU a model call computes: left out)."""
        if not self.steps or not self.model_seconds:
            return None
        return 1000 * (self.seconds - self.wait_seconds - (0 if self.launches else self.model_seconds)) / self.steps

    def waste(self) -> float:
        return 1 - self.used_slot_steps / max(self.slot_steps, 1)

    def mean_batch(self) -> float:
        return self.slot_steps / max(self.steps, 1)



def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and every id of the model's generation_config.eos_token_id
    (an int or a list: Llama-3's <|eot_id|>, Qwen's <|im_end|> and <|endoftext|>)."""
    gen = getattr(model, "generation_config", None)
    listed = getattr(gen, "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):  # what the engines read of it
        value = getattr(gen, name, None)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab)):
                where = getattr(getattr(model, "config", None), "_name_or_path", "") or "the model's folder"
                raise DataError(f"{Path(where) / 'generation_config.json'}: field '{name}' must be a token id (an "
                                f"integer from 0 to {vocab - 1 if vocab else 'the vocabulary size'}) or a list of "
                                f"them, got {value!r}")
    return list(dict.fromkeys(int(t) for t in [tokenizer.eos_token_id, *listed] if t is not None))


PICK_BYTES = 36  # per slot and vocabulary entry: decode.pick's peak with top-k, top-p and min-p on (fp32 scaled
# logits, the sort's values and int64 order, softmax, cumulative sum, the float64 cdf): 33 measured on CPU
# (tests/test_rft_engine.py), rounded up for the device's sort scratch


def logit_bytes(dtype_bytes: int) -> int:
    """Bytes per slot and vocabulary entry that a decode step adds to the cache (`ContinuousEngine.plan_slots`,
    harness/tools/rl_plan.py): the model's logits in its dtype, their fp32 copy (none when fp32), the pick's peak."""
    return dtype_bytes + (0 if dtype_bytes == 4 else 4) + PICK_BYTES

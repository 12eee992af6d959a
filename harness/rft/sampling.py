"""Loading a model for generation, the prompt, and the static engine (rft.engine=static): model.generate over fixed
batches of repeated prompts; `make_engine` picks the engine that `rft generate | test | bench` use.

    python -c "from harness.rft.sampling import make_engine; help(make_engine)"
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from harness.errors import ConfigError, HarnessError
from harness.rft.contract import Completion, OnDone, Sampling, holding
from harness.rft.engine import ContinuousEngine, compile_default, servable
from harness.rft.stats import Stats, eos_ids
from harness.rft.tasks import Task, check_context, prompt_text  # noqa: F401 (prompt_text: here before)
from harness import hardware
from harness.config import ModelConfig
from harness.model import load_tokenizer
from harness.rft.hf_engine import TransformersEngine
from harness.rft.vllm_engine import VllmEngine


# ----------------------------------------------------------------------------------------------- model and sampling


def resolve_model_path(path: Optional[str]) -> str:
    """A model folder for generation: a LoRA final/ (adapter) is replaced by its merged/ sibling."""
    if not path:
        raise ConfigError("config key 'model.name_or_path': rft needs a trained model (a folder such as "
                          "runs/x/final, or a hub id); give it there or with --model")
    p = Path(path)
    if (p / "adapter_config.json").is_file():
        if not (p / "merged").is_dir():
            raise ConfigError(f"config key 'model.name_or_path': {p} holds a LoRA adapter without merged/")
        return str(p / "merged")
    return str(path)


def load_for_generation(path: str, device: torch.device):
    """(model in eval mode, tokenizer with left padding); bf16 on GPUs that support it, fp32 otherwise."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(path)
    dtype = torch.bfloat16 if device.type == "cuda" and hardware.resolve_precision("auto") == "bf16" else torch.float32
    tok = load_tokenizer(ModelConfig(name_or_path=path), markers=None)  # its saved chat template, else GritLM's
    tok.padding_side = "left"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'model.name_or_path': cannot load '{path}': {str(e).splitlines()[0]}")
    return model.to(device).eval(), tok



class Sampler:
    """Batched sampling with left padding; each prompt `n` times (repeated prompts, so that one call mixes many
    questions). Sequences go through generate() in chunks of at most `micro` sequences; a CUDA out-of-memory error
    halves `micro` and retries the chunk."""

    def __init__(self, model, tokenizer, max_new_tokens: int, micro: int, say: Callable = print,
                 stop_strings: tuple = (), top_k: int = 0, min_p: float = 0.0) -> None:
        self.model, self.tok, self.max_new_tokens, self.micro, self.say = model, tokenizer, max_new_tokens, micro, say
        self.top_k, self.min_p = int(top_k), float(min_p)
        self.stop_strings = list(stop_strings)
        self.stats = Stats()

    @property
    def sequences(self) -> int:  # generated so far
        return self.stats.sequences

    @property
    def seconds(self) -> float:  # spent in generate()
        return self.stats.seconds

    def sample(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling()) -> list[list[Completion]]:
        """n completions per prompt (its token ids), grouped by prompt."""
        seqs = [p for p in prompts for _ in range(n)]
        out: list[Completion] = []
        i = 0
        while i < len(seqs):
            chunk = seqs[i:i + self.micro]
            try:
                t0 = time.perf_counter()
                out += self._generate(chunk, sampling)
                self.stats.seconds += time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                if self.micro == 1:
                    raise HarnessError("out of GPU memory with one sequence per generate() call: lower "
                                       "rft.max_new_tokens or use a larger GPU") from None
                self.micro = max(1, self.micro // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.say(f"[rft] out of memory: micro-batch halved to {self.micro} sequences")
                continue
            i += len(chunk)
            self.stats.sequences += len(chunk)
        return [out[k * n:(k + 1) * n] for k in range(len(prompts))]

    @torch.no_grad()
    def _generate(self, ids: list[list[int]], sampling: Sampling) -> list[Completion]:
        tok, dev = self.tok, self.model.device
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids], device=dev)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=dev)
        kw = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=self.top_k,
            min_p=self.min_p or None)
        if self.stop_strings:
            kw.update(stop_strings=self.stop_strings, tokenizer=tok)
        eos = eos_ids(self.model, tok)
        gen = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=eos, **kw)
        self._count(gen[:, width:])
        return [Completion(tuple(row)) for row in answers(gen[:, width:].tolist(), eos, tok.pad_token_id)]

    def _count(self, new: torch.Tensor) -> None:
        """New tokens per row (EOS included; the padding after a finished row not) and the slot-steps of the call."""
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        steps = new.shape[1]
        trailing = (new != pad).int().flip(1).cumsum(1).eq(0).sum(1)  # pads after the row's last token
        used = steps - trailing + ((trailing > 0) & (pad == eos)).int()
        self.stats.tokens += int(used.sum())
        self.stats.lengths += used.tolist()
        self.stats.used_slot_steps += int(used.sum())
        self.stats.slot_steps += new.shape[0] * steps
        self.stats.steps += steps


def answers(rows: list[list[int]], eos: list[int], pad: int) -> list[list[int]]:
    """model.generate's new tokens per row as the answers drawn: up to the first ending id (kept), else without the
    padding after a row that a stop string ended (the rows of a batch wait for its longest)."""
    ends, out = set(eos), []
    for row in rows:
        end = next((k + 1 for k, t in enumerate(row) if t in ends), None)
        if end is None:
            end = len(row)
            while end and row[end - 1] == pad:
                end -= 1
        out.append(row[:end])
    return out


class StaticEngine:
    """rft.engine=static: model.generate over fixed batches of `per_call` questions x n samples (today's path, kept
    for comparison); each batch seeded with seed(i, 0), i its first prompt's index, and waits for its longest answer."""

    name = "static"

    def __init__(self, model, tokenizer, max_new_tokens: int, micro: int, per_call: int, stop_strings: tuple = (),
                 say: Callable = print, top_k: int = 0, min_p: float = 0.0) -> None:
        self.sampler = Sampler(model, tokenizer, max_new_tokens, micro, say, stop_strings, top_k, min_p)
        self.per_call = per_call
        self.eos = eos_ids(model, tokenizer)  # the ids that end an answer (a caller drops them from its text)
        self.dtype = next(model.parameters()).dtype

    @property
    def model(self):
        return self.sampler.model

    @model.setter
    def model(self, model) -> None:
        self.sampler.model = model

    def serving(self, model) -> contextlib.AbstractContextManager:
        """Within: model.generate runs `model` (`contract.Engine.serving`)."""
        return holding(self, model)

    @property
    def stats(self) -> Stats:
        return self.sampler.stats

    @stats.setter
    def stats(self, stats: Stats) -> None:  # (`rft bench` counts each run afresh)
        self.sampler.stats = stats

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling = Sampling(),
                 on_done: Optional[OnDone] = None) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        seed = sampling.seed
        for i in range(0, len(prompts), self.per_call):
            torch.manual_seed(seed(i, 0) if callable(seed) else seed + i)
            got = self.sampler.sample(prompts[i:i + self.per_call], n, sampling)
            for k, responses in enumerate(got):
                if on_done is not None:
                    on_done(i + k, responses)
            out += got
        return out


def make_engine(r, model, tokenizer, say: Callable = print):
    """The engine that rft.engine names (r: the rft config section), continuous, static or transformers; a model the
    continuous engine cannot serve falls back to static with one line."""
    stops, warp = tuple(r.stop_strings), dict(top_k=r.top_k, min_p=r.min_p)
    if r.engine == "transformers":
        return TransformersEngine(model, tokenizer, r.max_new_tokens, r.micro_batch_sequences, stops, say, **warp)
    if r.engine == "continuous":
        why = servable(model)
        if why is None:
            return ContinuousEngine(model, tokenizer, r.max_new_tokens, r.micro_batch_sequences, r.kv_cache_gb,
                                    stops, say, compile=compile_default(r.compile, model), **warp)
        say(f"[rft] rft.engine=continuous cannot serve {why}: using rft.engine=static")
    return StaticEngine(model, tokenizer, r.max_new_tokens, r.micro_batch_sequences, r.questions_per_batch, stops, say,
                        **warp)


def load_engine(r, path: Optional[str], device, say: Callable = print, task: Optional[Task] = None,
                questions: Optional[list] = None):
    """(engine, tokenizer) for the model at `path` on `device`, as rft.engine says (vllm loads the model itself).
    Every prompt of `questions` (of `task`) and rft.max_new_tokens answer tokens are checked to fit the model's
    context first (tasks.check_context, as loss.mode=rl's rollouts check theirs; vllm checks its own max_model_len)."""
    if r.engine == "vllm":
        path = resolve_model_path(path)
        engine = VllmEngine(path, r.max_new_tokens, tuple(r.stop_strings), say)
        tok = load_tokenizer(ModelConfig(name_or_path=path), markers=None)
        engine.eos = eos_ids(None, tok)
        return engine, tok
    model, tok = load_for_generation(path, device)
    fits_context(r, model.config, tok, task, questions or [])
    return make_engine(r, model, tok, say), tok


def fits_context(r, config, tok, task: Optional[Task], questions: list) -> None:
    """rft.max_new_tokens, and each question's prompt with them, within the context of the model of `config`."""
    lengths = {q.qid: len(tok(prompt_text(task, q, tok), add_special_tokens=False)["input_ids"]) for q in questions}
    check_context(lengths, r.max_new_tokens,
                  getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None))

"""Sequence parallelism (`train.sequence_parallel: N`, docs/long-context.md): N consecutive processes train the same
rows, each holding 1/N of every row's positions; DeepSpeed's Ulysses attention (`UlyssesSPAttentionHF`) swaps
sequence shards for head shards around the attention kernel (two all-to-alls per layer), so each process sees whole
rows for 1/N of the heads there and 1/N of the positions everywhere else: activations per process divided by N.

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 harness/train.py \
        --config configs/default.yaml train.sequence_parallel=2 data.max_len=4096

What the harness does itself, and why (not accelerate's ParallelismConfig(sp_backend="deepspeed")):
- the rows: the training loaders are sharded over the data-parallel ranks (processes / N; rank // N), so the N
  processes of a group read the same rows and each row is trained once. accelerate's SP path shards over the
  data-parallel ranks too, but DeepSpeed's UlyssesSPDataLoaderAdapter then gathers the group's batches and trains each
  in turn: every row sp_size times (DeepSpeed issue #7484);
- the shard (`shard`): labels are shifted before the split (position t predicts labels[t + 1], which may sit on the
  next process), the width padded to a multiple of N, per-row position ids in every batch (padded rows: 0..w-1; the
  attention mask is dropped: right padding under a causal mask changes no real token);
- the loss: each process sums its positions' losses (the chunked loss: no full logits); the token-averaging scale
  W * A / N_tokens with W all processes and N_tokens the global trained tokens is unchanged, because DeepSpeed averages
  the gradients over all processes and each token is on exactly one of them;
- packed rows: DeepSpeed's wrapper drops transformers' mask (built for the local shard); under sdpa the documents'
  block-diagonal causal mask is rebuilt from the gathered position ids (`_documents_sdpa`); flash-attention kernels
  read the same ids as varlen boundaries. Evaluation runs without SP (whole rows on each process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from harness import IGNORE_INDEX
from harness.errors import ConfigError
from harness.config.derived import attention_heads, check_heads  # noqa: F401 - (light: the plans' too)

KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")


def check_launch(size: int, world: int, deepspeed_wanted: Optional[str], cpu_forced: bool) -> None:
    """Before the Accelerator: N divides the process count, and DeepSpeed is asked for (one line each)."""
    if size == 1:
        return
    if world % size:
        raise ConfigError(f"config key 'train.sequence_parallel': {size} does not divide the {world} process(es) of "
                          f"this launch; launch a multiple of {size} processes or change train.sequence_parallel")
    if cpu_forced:
        raise ConfigError("config key 'train.sequence_parallel': sequence parallelism runs under DeepSpeed, which "
                          "ACCELERATE_USE_CPU=1 (accelerate's --cpu or use_cpu) turns off; launch without it")
    if deepspeed_wanted is None:
        raise ConfigError(f"config key 'train.sequence_parallel': {size} needs DeepSpeed ZeRO 1-3; launch with "
                          f"launch/train.sh --zero 3 (an accelerate config of accelerate_configs/) or set "
                          f"train.deepspeed=zero3")


def compile_mode(size: int, asked: str, resolved: str) -> tuple[str, Optional[str]]:
    """torch.compile with sequence parallelism is not measured yet: `auto` compiles nothing (a note says so), an
    explicit mode is refused in one line. Returns (mode, note or None)."""
    if size == 1 or resolved == "none":
        return resolved, None
    if asked == "auto":
        return "none", f"[harness] train.compile=auto: none with train.sequence_parallel={size} (not measured yet)"
    raise ConfigError(f"config key 'train.compile': {asked} with train.sequence_parallel={size} is not supported yet "
                      f"(the Ulysses all-to-all inside compiled blocks is not measured); use train.compile=none")


def check_stage(size: int, zero_stage: int) -> None:
    if size > 1 and zero_stage not in (1, 2, 3):
        raise ConfigError(f"config key 'train.sequence_parallel': {size} needs DeepSpeed ZeRO 1-3, this launch runs "
                          f"ZeRO stage {zero_stage}; launch with --zero 1, 2 or 3")


@dataclass(frozen=True)
class SequenceParallel:
    """This process's place: `size` processes per group, `rank` within it; the data-parallel ranks are the groups."""

    size: int
    rank: int
    dp_rank: int
    dp_size: int
    group: Any  # the torch.distributed group of this process's sequence-parallel group

    def shard(self, batch: dict) -> dict:
        return shard(batch, self.rank, self.size)


def start(size: int, accelerator) -> Optional[SequenceParallel]:
    """The sequence-parallel groups (consecutive ranks), made on every process (None when N is 1)."""
    if size == 1:
        return None
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state

    sp_state.initialize_sequence_parallel(sequence_parallel_size=size)
    world, index = accelerator.num_processes, accelerator.process_index
    return SequenceParallel(size=size, rank=index % size, dp_rank=index // size, dp_size=world // size,
                            group=sp_state.get_sequence_parallel_group())


def dp_world(size: int, world: int) -> int:
    """Data-parallel ranks of `world` processes in groups of `size`."""
    return max(1, world // max(1, size))


def shard(batch: dict, rank: int, size: int) -> dict:
    """This process's 1/size of the positions of a generative batch (every process of the group holds the whole
    batch): input_ids, position_ids, shift_labels (labels[t + 1] at t, IGNORE_INDEX at a row's end) and token_mask,
    the width padded to a multiple of size. No attention mask (see the module's docstring)."""
    ids = batch["input_ids"]
    n, w = ids.shape
    real = batch["token_mask"] if "token_mask" in batch else batch["attention_mask"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(w, device=ids.device).repeat(n, 1)
    shifted = torch.full_like(batch["labels"], IGNORE_INDEX)
    shifted[:, :-1] = batch["labels"][:, 1:]
    pad = -w % size
    if pad:
        tail = positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)
        ids = torch.cat([ids, ids[:, -1:].expand(n, pad)], 1)  # outputs never read: labels ignored, causal
        positions = torch.cat([positions, tail], 1)
        shifted = torch.cat([shifted, shifted.new_full((n, pad), IGNORE_INDEX)], 1)
        real = torch.cat([real, real.new_zeros((n, pad))], 1)
    chunk = (w + pad) // size
    part = slice(rank * chunk, (rank + 1) * chunk)
    return {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
            "shift_labels": shifted[:, part].contiguous(), "token_mask": real[:, part].contiguous(), "rows": n}


def block_causal_mask(position_ids: torch.Tensor, window: Optional[int] = None) -> Optional[torch.Tensor]:
    """[B, 1, T, T] boolean mask: causal within each document (a document starts where the position id is 0) and,
    with a sliding `window`, over the last `window` positions only (a query sees key k when q - k < window, as
    transformers' sliding_window_overlay); None where every row is one document counted from 0 and no window cuts it
    (plain causal attention needs no mask)."""
    n, t = position_ids.shape
    plain = torch.arange(t, device=position_ids.device).expand(n, t)
    if torch.equal(position_ids, plain) and not (window and window < t):
        return None
    doc = (position_ids == 0).cumsum(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    if window and window < t:
        causal &= ~torch.ones_like(causal).tril(-window)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _documents_sdpa(core):
    """sdpa with the documents' mask from the (gathered, whole-row) position ids; is_causal when there is none. One
    mask serves every layer of a pass with the same sliding window (as transformers' own do). It is L x L: under
    sdpa, packed rows keep an attention term that does not shrink with N (docs/long-context.md); flash attention needs
    no mask."""
    cached: list = [None, {}]  # position ids of the last pass, its mask per sliding window (None: full attention)

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        positions, window = kwargs.get("position_ids"), kwargs.get("sliding_window")
        if attention_mask is None and positions is not None:  # (evaluation keeps its own mask)
            if cached[0] is None or cached[0].shape != positions.shape or not torch.equal(cached[0], positions):
                cached[:] = [positions, {}]
            if window not in cached[1]:  # a layer's window (mistral, gemma3's sliding layers, qwen2's) or None
                cached[1][window] = block_causal_mask(positions, window)
            attention_mask = cached[1][window]
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attend


def install_attention(sp: SequenceParallel, model, micro_batch: int) -> str:
    """Route the model's attention kernel through DeepSpeed's Ulysses all-to-all for training passes (evaluation
    passes, module.training False, run the kernel on whole rows). Returns the kernel's name."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in KERNELS:
        raise ConfigError(f"config key 'model.attn_implementation': sequence parallelism needs sdpa or a flash "
                          f"attention kernel (the model runs {impl}); set model.attn_implementation=sdpa")
    check_heads(sp.size, config)
    text = config.get_text_config()
    core = ALL_ATTENTION_FUNCTIONS[impl]
    heads, kv, head_dim = attention_heads(config)
    ulysses = UlyssesSPAttentionHF(attn=_documents_sdpa(core) if impl == "sdpa" else core, batch_size=micro_batch,
                                   attn_head_count=heads, attn_head_size=head_dim, kv_head_count=kv,
                                   num_hidden_layers=text.num_hidden_layers, process_group=sp.group,
                                   seq_length_is_variable=True, disable_in_eval=True)
    ulysses.core_attn_implementation = impl

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if module.training:  # a short batch (an epoch's last): its own batch size
            n = query.shape[0]
            ulysses.batch_size = n
            ulysses.required_query_shape = torch.Size([1, n, heads, head_dim])
            ulysses.required_key_value_shape = torch.Size([1, n, kv, head_dim])
            ulysses.required_context_shape = torch.Size([1, n, head_dim * heads // sp.size])
            attention_mask = None  # built by transformers for the local shard: the documents' mask is rebuilt
            out, weights = ulysses(module, query, key, value, attention_mask, *args, **kwargs)
            # Ulysses returns [batch, positions, heads x size]; the kernels' contract is [batch, positions, heads,
            # size], which families that merge the last two dimensions themselves (gpt2) need
            return out.view(*out.shape[:2], heads, head_dim), weights
        return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = attention
    return impl


def dp_loaders(accelerator, sp: SequenceParallel, loaders: list) -> list:
    """The training loaders prepared over the data-parallel ranks (the group's processes read the same rows), with
    accelerate's own settings otherwise; they replace the world-sharded ones in the accelerator's checkpoint list."""
    from accelerate.data_loader import prepare_data_loader

    out = []
    for loader in loaders:
        prepared = prepare_data_loader(
            loader, accelerator.device, num_processes=sp.dp_size, process_index=sp.dp_rank,
            split_batches=accelerator.split_batches, put_on_device=accelerator.device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches, use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        out.append(prepared)
    return out

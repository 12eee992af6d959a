"""A model's shape by arithmetic on its config, without torch or transformers: what `harness zero-plan` sizes in
under a second where the config says enough (harness/tools/sizing.py builds the model on the meta device otherwise).

The config is the recipe's model.config (a random-init model; a hub id whose recipe carries the architecture's
shape, sized offline with the bundled tokenizer), or the config.json of a model.name_or_path folder or of a hub id
already in the local hub cache, the recipe's model.config keys over it. The vocabulary is the tokenizer's as the run
builds it: its tokenizer.json and tokenizer_config.json, plus the chat markers it lacks, the embedding resized to a
multiple of 64 where they pass the config's vocab_size.

Counted by families whose layout is written out in FAMILIES (llama, mistral, qwen2, qwen3, gemma, and the mixtures
of experts qwen3_moe, qwen2_moe, mixtral): every parameter of transformers' modules, tied heads once, LoRA adapters
r x (in + out) on the Linear layers peft targets. Anything else (another family, LoRA on the experts, added token
rows trained under LoRA, a quantized checkpoint, a tokenizer without tokenizer.json) returns None: the meta model
counts it. tests/test_config_shape.py holds the counts equal to the meta model's and FAMILIES' defaults equal to
transformers' own."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from harness.config import ModelConfig, lora_config
from harness.config.derived import LOGIT_TRANSFORMS, attention_heads, experts_of, mlp_width
from harness.data.chat import CHAT_MARKERS

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"  # (harness.model's, light here)


@dataclass
class ModelShape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    model_type: str
    layer_params: int  # parameters of the largest decoder layer
    embed_params: int  # parameters of the input embedding
    trainable: Optional[int] = None  # LoRA: adapter (+ added token rows) parameters; None: full fine-tune, all of P
    linear_params: int = 0  # weights of the frozen base's Linear layers but the output head (what bitsandbytes
    # quantizes under model.quantization)
    note: str = ""  # how the shape was obtained when not from the recipe as is (offline sizing)
    chunkable_head: bool = True  # the chunked loss can take the output head (chunked_loss.resolve_chunked_ce)
    head_dim: int = 0  # per attention head (the config's head_dim, else hidden / heads: the KV cache's size)
    active: int = 0  # parameters a token goes through (a mixture of experts: top-k of its experts); 0: all of P

    @property
    def frozen(self) -> int:
        return 0 if self.trainable is None else self.params - self.trainable


@dataclass(frozen=True)
class Family:
    """A decoder family's layout as transformers builds it. `defaults`: its config class's defaults for the keys the
    count reads (None: derived, as its __post_init__ derives them); a bias: the config key that turns it on, or
    True / False where the modeling code fixes it. experts: "" dense, "qwen" (sparse layers by decoder_sparse_step
    and mlp_only_layers, experts moe_intermediate_size wide), "mixtral" (every layer, intermediate_size wide)."""
    defaults: dict
    qkv_bias: object = False
    o_bias: object = False
    mlp_bias: object = False
    qk_norm: bool = False
    experts: str = ""
    shared_expert: bool = False


_DENSE = dict(tie_word_embeddings=False, head_dim=None)
FAMILIES = {
    "llama": Family(dict(_DENSE, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=None, attention_bias=False, mlp_bias=False),
                    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Family(dict(_DENSE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8)),
    "qwen2": Family(dict(_DENSE, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32), qkv_bias=True),
    "qwen3": Family(dict(_DENSE, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128, attention_bias=False),
                    qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
    "gemma": Family(dict(_DENSE, vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=256, tie_word_embeddings=True,
                         attention_bias=False), qkv_bias="attention_bias", o_bias="attention_bias"),
    "qwen3_moe": Family(dict(_DENSE, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                             num_attention_heads=32, num_key_value_heads=4, attention_bias=False, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                             mlp_only_layers=None), qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True,
                        experts="qwen"),
    "qwen2_moe": Family(dict(_DENSE, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=16, qkv_bias=True, num_experts=60,
                             num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                             decoder_sparse_step=1, mlp_only_layers=None), qkv_bias="qkv_bias", experts="qwen",
                        shared_expert=True),
    "mixtral": Family(dict(_DENSE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
                      experts="mixtral"),
}
ALIASES = {"mixtral": {"num_experts": "num_local_experts"}}  # (transformers' attribute_map)


@dataclass(frozen=True)
class Module:
    """A module that holds parameters: its name as transformers names it, its own parameter count, (in, out) for an
    nn.Linear, its decoder layer (None outside them), the routed experts' parameters in it."""
    name: str
    params: int
    linear: Optional[tuple] = None
    layer: Optional[int] = None
    routed: int = 0


def resolved(model_type: str, keys: dict) -> Optional[dict]:
    """The config's keys with the family's defaults filled in and derived as transformers derives them; None for a
    family not in FAMILIES."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        return None
    c = dict(fam.defaults)
    for k, v in keys.items():
        c[ALIASES.get(model_type, {}).get(k, k)] = v
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    c["mlp_only_layers"] = c.get("mlp_only_layers") or []
    if fam.experts == "mixtral":
        c["num_experts"] = c["num_local_experts"]
    c["model_type"] = model_type
    return c


def modules(c: dict, vocab: int) -> list[Module]:
    """Every parameter-holding module of the causal LM of resolved config `c` with `vocab` embedding rows."""
    fam = FAMILIES[c["model_type"]]
    on = lambda bias: c.get(bias, False) if isinstance(bias, str) else bias  # noqa: E731
    h, hd, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def linear(name: str, n_in: int, n_out: int, bias, layer: int) -> Module:
        return Module(name, n_in * n_out + (n_out if on(bias) else 0), (n_in, n_out), layer)

    out = [Module("model.embed_tokens", vocab * h)]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out += [linear(f"{p}.self_attn.q_proj", h, q, fam.qkv_bias, n),
                linear(f"{p}.self_attn.k_proj", h, kv, fam.qkv_bias, n),
                linear(f"{p}.self_attn.v_proj", h, kv, fam.qkv_bias, n),
                linear(f"{p}.self_attn.o_proj", q, h, fam.o_bias, n)]
        if fam.qk_norm:
            out += [Module(f"{p}.self_attn.q_norm", hd, layer=n), Module(f"{p}.self_attn.k_norm", hd, layer=n)]
        out += [Module(f"{p}.input_layernorm", h, layer=n), Module(f"{p}.post_attention_layernorm", h, layer=n)]
        sparse = fam.experts == "mixtral" or (fam.experts == "qwen" and n not in c["mlp_only_layers"]
                                              and c["num_experts"] > 0 and (n + 1) % c["decoder_sparse_step"] == 0)
        if sparse:
            e, width = c["num_experts"], c["moe_intermediate_size"] if fam.experts == "qwen" else i
            out += [Module(f"{p}.mlp.gate", e * h, layer=n),  # the router: a weight, no nn.Linear
                    Module(f"{p}.mlp.experts", e * 3 * width * h, layer=n, routed=e * 3 * width * h)]
            if fam.shared_expert:
                s = c["shared_expert_intermediate_size"]
                out += [linear(f"{p}.mlp.shared_expert.gate_proj", h, s, False, n),
                        linear(f"{p}.mlp.shared_expert.up_proj", h, s, False, n),
                        linear(f"{p}.mlp.shared_expert.down_proj", s, h, False, n),
                        linear(f"{p}.mlp.shared_expert_gate", h, 1, False, n)]
        else:
            out += [linear(f"{p}.mlp.gate_proj", h, i, fam.mlp_bias, n),
                    linear(f"{p}.mlp.up_proj", h, i, fam.mlp_bias, n),
                    linear(f"{p}.mlp.down_proj", i, h, fam.mlp_bias, n)]
    out.append(Module("model.norm", h))
    tied = c["tie_word_embeddings"]
    out.append(Module("lm_head", 0 if tied else vocab * h, (h, vocab)))  # tied: the embedding's weight, counted once
    return out


def lora_targets(mods: list[Module], target_modules) -> Optional[list[Module]]:
    """The modules peft's LoRA wraps (peft's check_target_module_exists: 'all-linear' = every nn.Linear but the output
    head; another string a regular expression over the whole name; a list: a name or a name's last parts). None where
    peft would refuse or the count is not this one: nothing matched, or a match that is no nn.Linear."""
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return [m for m in mods if m.linear and m.name != "lm_head"]
    if isinstance(target_modules, str):
        hit = [m for m in mods if re.fullmatch(target_modules, m.name)]
    else:
        names = [str(t) for t in target_modules]
        hit = [m for m in mods if m.name in names or any(m.name.endswith(f".{t}") for t in names)]
    return hit if hit and all(m.linear for m in hit) else None


def tokenizer_length(folder: Path) -> Optional[int]:
    """len() of the run's tokenizer from `folder` (harness.model.load_tokenizer): tokenizer.json's vocabulary with
    its added tokens, the special tokens tokenizer_config.json names that it lacks, and the chat markers (added by
    the sizing's load_tokenizer). None without a tokenizer.json (a sentencepiece-only tokenizer)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # (Rust; no torch)

    tok = Tokenizer.from_file(str(path))
    known = set(tok.get_vocab(with_added_tokens=True))
    n = tok.get_vocab_size(with_added_tokens=True)
    try:
        extra = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        extra = {}
    named = [v.get("content") for v in (extra.get("added_tokens_decoder") or {}).values() if isinstance(v, dict)]
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        v = extra.get(key)
        named.append(v.get("content") if isinstance(v, dict) else v)
    for key in ("extra_special_tokens", "additional_special_tokens"):
        v = extra.get(key)
        named += [t.get("content") if isinstance(t, dict) else t for t in (v if isinstance(v, list) else [])]
    for t in [*named, *CHAT_MARKERS]:
        if isinstance(t, str) and t not in known:
            known.add(t)
            n += 1
    return n


def _file(source: str, filename: str) -> Optional[Path]:
    """`filename` of a folder, or of a hub id in the local hub cache (no network); None where neither has it."""
    if Path(source).is_dir():
        path = Path(source) / filename
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, filename)
    except Exception:  # noqa: BLE001 - not a repo id, a broken cache: the meta model's path says what is wrong
        return None
    return Path(found) if isinstance(found, str) else None


def _tokenizer_folder(source: str) -> Optional[Path]:
    if source == "bundled":
        return BUNDLED_TOKENIZER
    found = _file(source, "tokenizer.json")
    return found.parent if found is not None else None


def shape_from_config(m: ModelConfig) -> Optional[ModelShape]:
    """The recipe's ModelShape (`m`: cfg.model; as harness.tools.sizing.meta_shape counts it) by arithmetic, or None
    where the config is not enough (module docstring)."""
    note = ""
    from_recipe = m.name_or_path is None or ("model_type" in m.config and not Path(m.name_or_path).is_dir())
    if from_recipe:
        keys = dict(m.config)
        tokenizer = (m.tokenizer or "bundled") if m.name_or_path is None else "bundled"
        if m.name_or_path is not None:
            note = (f"sizing offline from model.config ({m.config['model_type']} shape of {m.name_or_path}); the "
                    f"bundled tokenizer stands in for the hub one")
    else:  # a pretrained folder or hub id: its config.json, the recipe's keys over it (the sizing's random_init)
        found = _file(m.name_or_path, "config.json")
        try:
            keys = json.loads(found.read_text()) if found else None
        except (OSError, ValueError):
            keys = None
        if not isinstance(keys, dict) or keys.get("quantization_config"):
            return None
        keys.update({k: v for k, v in m.config.items() if k != "model_type"})
        tokenizer = m.tokenizer or m.name_or_path
    model_type = keys.pop("model_type", None)
    c = resolved(model_type, keys) if isinstance(model_type, str) else None
    folder = _tokenizer_folder(tokenizer)
    length = tokenizer_length(folder) if c is not None and folder is not None else None
    if length is None:
        return None
    # a model built from model.config: vocab_size the tokenizer's unless given (harness.model.build_model)
    rows = c["vocab_size"] = c["vocab_size"] if "vocab_size" in keys or not from_recipe else length
    vocab = rows if rows >= length else -(-length // 64) * 64  # build_model's resize (pad_to_multiple_of=64)
    mods = modules(c, vocab)
    lc = lora_config(m)
    adapters: dict = {}
    if lc.enabled:
        targets = lora_targets(mods, lc.target_modules)
        moe = FAMILIES[model_type].experts
        if targets is None or lc.experts or vocab > rows or moe and lc.target_modules != "all-linear":
            return None  # (added rows: peft's trainable tokens; a mixture of experts: below)
        adapters = {t.name: lc.r * sum(t.linear) for t in targets}
        for x in mods if moe else ():
            # peft (0.22) converts all-linear on a transformers-5 mixture of experts to transformers 4's targets: the
            # routers' weights (r x (h + E)) and the fused experts, gate and up together at rank 2r (E x 2r x (h +
            # 2w)), down at r (E x r x (w + h)) (peft.utils.transformers_weight_conversion)
            h, e = c["hidden_size"], c["num_experts"]
            if x.name.endswith(".mlp.gate"):
                adapters[x.name] = lc.r * (h + e)
            elif x.routed:
                w = x.routed // (3 * e * h)
                adapters[x.name] = 2 * lc.r * e * (h + 2 * w) + lc.r * e * (w + h)
    params = sum(x.params for x in mods) + sum(adapters.values())
    # model.train_router=false freezes the routers with their adapters (harness.moe.freeze_router)
    trainable = sum(n for name, n in adapters.items() if m.train_router or not name.endswith(".mlp.gate"))
    layer_params = max((sum(x.params + adapters.get(x.name, 0) for x in mods if x.layer == n)
                        for n in range(c["num_hidden_layers"])), default=0)
    routed = sum(x.routed + (adapters.get(x.name, 0) if x.routed else 0) for x in mods)  # (their adapters with them)
    ns = SimpleNamespace(**c)
    n_experts, k = experts_of(ns)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelShape(
        params=params, hidden=h, intermediate=mlp_width(ns, 4 * h), layers=c["num_hidden_layers"], heads=heads,
        kv_heads=c["num_key_value_heads"] or heads, vocab=vocab, model_type=model_type, layer_params=layer_params,
        embed_params=vocab * h, trainable=trainable if lc.enabled else None,
        linear_params=sum(x.linear[0] * x.linear[1] for x in mods if x.linear and x.name != "lm_head")
        if lc.enabled else 0,
        note=note,
        chunkable_head="lm_head" not in adapters and all(c.get(a) in (None, 1) for a in LOGIT_TRANSFORMS),
        head_dim=attention_heads(ns)[2],
        active=params - routed + routed * k // n_experts if n_experts else params,
    )

"""Vision-language data (docs/vision.md): the processor, records with images, samples and their padded batches.

Records are TRL's vision layout, one JSON object a line:
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}],
     "images": ["img/0.png"]}                     # paths relative to the data file, one per {"type": "image"} part
The conversation is rendered by the processor's chat template (one `<|vision_start|><|image_pad|><|vision_end|>` per
image), each image's pad token repeated as many times as the model has tokens for it (its grid / merge_size^2, what the
processor does), and the text tokenized once: the ids are the processor's. Labels: the assistant turns only
(harness.data.chat's spans), the image and vision marker tokens never. data.max_len counts the image tokens; a sample
is cut only after its last image. Every image is opened (and decoded) when the data is read: a missing, truncated or
non-image file is one line naming file:line and the image.

    harness data-check is not yet vision-aware: `harness train` reads and checks every image before step 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from harness import IGNORE_INDEX
from harness.config import DataConfig, ModelConfig
from harness.config.modes import ModeFacts
from harness.data import chat, sources
from harness.data.samples import GenerativeCollator
from harness.errors import ConfigError, DataError

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN_VL = ("qwen2_vl", "qwen2_5_vl")  # the families built from a model.config here (their tokens, their processor)
# the GritLM layout with image parts: what a tokenizer without a template of its own (the bundled one) renders; the
# assistant turns in {% generation %} blocks, which TRL's assistant_only_loss reads (the spans harness trains)
VISION_TEMPLATE = (
    "{% macro body(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ body(message['content']) }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ body(message['content']) }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def model_type(m: ModelConfig) -> Optional[str]:
    """The model's type without loading weights: model.config's model_type, or the config of model.name_or_path."""
    if m.name_or_path is None:
        return m.config.get("model_type")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code).model_type
    except (OSError, ValueError, KeyError):
        return None  # the model's build says why


def is_vision(m: ModelConfig) -> bool:
    """Whether model.* names a vision-language model (transformers' image-text-to-text classes)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type(m) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def check_vision_run(d: DataConfig, mode: ModeFacts) -> None:
    """What a vision-language run refuses, in one line each (`d`: cfg.data, `mode`: the loss mode's facts)."""
    if d.packing:
        raise ConfigError("config key 'data.packing': a vision-language model's 3-D (mRoPE) position ids do not "
                          "survive packing; use data.packing=false (padded rows)")
    if d.streaming:
        raise ConfigError("config key 'data.streaming': vision-language data is read whole before step 1; use "
                          "data.streaming=false")
    if d.max_len == "auto" or d.eval_split is not None:
        key = "data.max_len" if d.max_len == "auto" else "data.eval_split"
        raise ConfigError(f"config key '{key}': not available for vision-language data yet; give "
                          f"{'a number of tokens' if key == 'data.max_len' else 'data.eval_files'}")
    if not mode.vision:
        raise ConfigError(f"config key 'loss.mode': a vision-language model trains with loss.mode=generative, "
                          f"got {mode.name}")


# ----------------------------------------------------------------------------------------------- the processor


def _image_only_class():
    """transformers' Qwen2.5-VL processor that accepts no video processor (transformers builds one only with
    torchvision installed); saved under the processor's own class name, so AutoProcessor loads it back."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):
            save_directory = Path(save_directory)
            save_directory.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save_pretrained(save_directory)
            self.image_processor.save_pretrained(save_directory)
            if self.chat_template:
                (save_directory / "chat_template.jinja").write_text(self.chat_template)
            (save_directory / "processor_config.json").write_text(
                json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2) + "\n")
            return [str(save_directory)]

    return ImageOnlyProcessor


def add_vision_tokens(tokenizer) -> None:
    """The Qwen2-VL markers as special tokens of a tokenizer that lacks them (the bundled one)."""
    missing = [t for t in VISION_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)


def load_processor(m: ModelConfig, tokenizer):
    """The run's processor. A pretrained model's folder or hub id: AutoProcessor's (image-only where transformers
    cannot build its video processor). A model built from model.config: the run's tokenizer with the vision markers
    added and Qwen2-VL's image processor sized from the config's vision_config (patch, merge, temporal patch) and
    model.image_min_pixels / image_max_pixels."""
    from transformers import AutoImageProcessor, AutoProcessor, Qwen2VLImageProcessor

    pixels = {k: v for k, v in (("min_pixels", m.image_min_pixels), ("max_pixels", m.image_max_pixels)) if v}
    if m.name_or_path is not None:  # its processor (model.random_init too: the weights only are random)
        try:
            proc = AutoProcessor.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, **pixels)
            proc.tokenizer = tokenizer  # the run's (model.tokenizer, data.chat_template): the model is sized to it
            return proc
        except (ImportError, TypeError, AttributeError, ValueError):
            images = AutoImageProcessor.from_pretrained(m.name_or_path, **pixels)
    else:
        if m.config.get("model_type") not in QWEN_VL:
            raise ConfigError(f"config key 'model.config': a random vision-language model is built for the Qwen2-VL "
                              f"family ({', '.join(QWEN_VL)}), got {m.config.get('model_type')}; give "
                              f"model.name_or_path with model.random_init=true for another")
        vc = m.config.get("vision_config", {})
        images = Qwen2VLImageProcessor(patch_size=vc.get("patch_size", 14), merge_size=vc.get("spatial_merge_size", 2),
                                       temporal_patch_size=vc.get("temporal_patch_size", 2), **pixels)
    add_vision_tokens(tokenizer)
    template = chat.own_template(tokenizer)
    template = VISION_TEMPLATE if template in (None, chat.GRITLM_TEMPLATE) else template
    tokenizer.chat_template = template
    return _image_only_class()(image_processor=images, tokenizer=tokenizer, video_processor=None,
                               chat_template=template)


def token_ids(tok) -> dict:
    """The vision token ids (in tokenizer `tok`) a model's config names (image_token_id, vision_start_token_id, ...)."""
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    return {n: tok.convert_tokens_to_ids(t) for n, t in zip(names, VISION_TOKENS)}


# ----------------------------------------------------------------------------------------------- records


def _records(path: Path, what: str):
    """(line number, record) of a JSON lines file."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None


def _messages(rec, where: str) -> tuple[list, int]:
    """The record's messages (validated) and how many image parts they hold."""
    if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or not rec["messages"]:
        raise DataError(f"{where}: field 'messages' must be a non-empty list (TRL's vision layout)")
    images = 0
    for i, m in enumerate(rec["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise DataError(f"{where}: field 'messages[{i}].role' must be system, user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise DataError(f"{where}: field 'messages[{i}].content' must be a string or a list of parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images += 1
            elif kind != "text" or not isinstance(part.get("text"), str):
                raise DataError(f"{where}: field 'messages[{i}].content[{j}]' must be {{\"type\": \"image\"}} or "
                                f"{{\"type\": \"text\", \"text\": str}}")
    return rec["messages"], images


def open_image(path: Path, where: str, name: str):
    """The image at `path` decoded (RGB), or a one-line DataError naming the record and the image."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise DataError(f"{where}: image '{name}' not found ({path})")
    try:
        with Image.open(path) as img:
            img.load()  # decodes: a truncated file fails here, not at the first batch
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise DataError(f"{where}: image '{name}' is not an image file ({path})") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"{where}: image '{name}' cannot be decoded ({path}): {str(e).splitlines()[0]}") from None


def load_vision_records(entries: list, what: str) -> list[dict]:
    """Every record of the JSON lines files in `entries`: {messages, images (absolute paths), origin}; every image
    opened once (its size kept for the token count)."""
    out = []
    for source in sources.parse_sources(entries, what):
        for file in sources.expand_files([source.path], what):
            path = Path(file)
            if sources.file_type(file) != "json" or file.endswith(".gz"):
                raise ConfigError(f"config key '{what}': vision-language records are read from JSON lines files "
                                  f"(.jsonl, .json); got {file}")
            for n, rec in _records(path, what):
                where = f"{path}:{n}"
                messages, count = _messages(rec, where)
                names = rec.get("images") or []
                if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
                    raise DataError(f"{where}: field 'images' must be a list of image paths (relative to the file)")
                if len(names) != count:
                    raise DataError(f"{where}: {count} {{\"type\": \"image\"}} part(s) but {len(names)} path(s) in "
                                    f"field 'images'")
                files = [path.parent / x for x in names]
                sizes = [open_image(f, where, x).size for f, x in zip(files, names)]
                out.append({"messages": messages, "images": [str(f) for f in files], "sizes": sizes,
                            "names": names, "origin": where})
    if not out:
        raise DataError(f"{what}: no records")
    return out


# ----------------------------------------------------------------------------------------------- samples


def image_tokens(processor, width: int, height: int) -> int:
    """The tokens the model has for an image of this size: its patch grid / merge_size^2."""
    ip = processor.image_processor
    return ip.get_number_of_image_patches(height, width, {}) // ip.merge_size ** 2


def _expand(text: str, spans: list, pad: str, counts: list[int]) -> tuple[str, list]:
    """The rendered text with the k-th image pad repeated counts[k] times, and the spans moved with it."""
    pieces, shifts, start = [], [], 0
    for n in counts:
        at = text.index(pad, start)
        pieces += [text[start:at], pad * n]
        shifts.append((at, len(pad) * (n - 1)))
        start = at + len(pad)
    pieces.append(text[start:])

    def moved(pos: int) -> int:
        return pos + sum(extra for at, extra in shifts if at < pos)

    return "".join(pieces), [(moved(a), moved(b)) for a, b in spans]


def encode_record(rec: dict, processor, max_len: int) -> dict:
    """One record -> {input_ids, labels, images, length, truncated}: the ids the processor makes, labels on the
    assistant turns without the vision tokens; cut at max_len only after the last image (else a one-line refusal)."""
    tok, where = processor.tokenizer, rec["origin"]
    counts = [image_tokens(processor, w, h) for w, h in rec["sizes"]]
    for (w, h), n, name in zip(rec["sizes"], counts, rec["names"]):
        if n + 2 > max_len:
            raise DataError(f"{where}: image '{name}' ({w}x{h} pixels) takes {n} image tokens, more than "
                            f"data.max_len={max_len} holds; raise data.max_len or lower model.image_max_pixels")
    full, spans = chat.message_spans(tok, processor.chat_template, rec["messages"], None, where)
    if full.count(processor.image_token) != len(counts):
        raise DataError(f"{where}: the chat template wrote {full.count(processor.image_token)} image token(s) for "
                        f"{len(counts)} image(s)")
    text, spans = _expand(full, spans, processor.image_token, counts)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    vision = {tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    labels = [IGNORE_INDEX if t in vision else x for t, x in zip(ids, chat.span_labels(enc["offset_mapping"], ids,
                                                                                       spans))]
    if len(ids) > max_len:
        last = max((i for i, t in enumerate(ids) if t in vision), default=-1)
        if last >= max_len:
            raise DataError(f"{where}: its images end at token {last + 1}, past data.max_len={max_len} (a sample is "
                            f"cut only after its last image); raise data.max_len")
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "images": rec["images"],
            "length": min(len(ids), max_len), "truncated": len(ids) > max_len, "image_tokens": sum(counts),
            "origin": where}


class VisionDataset(torch.utils.data.Dataset):
    """Encoded samples (ids, labels, image paths); the images are decoded and processed by the collator."""

    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int | str):
        """Sample i, or (as a datasets.Dataset answers a column's name) every sample's value of key i."""
        return [s[i] for s in self.samples] if isinstance(i, str) else self.samples[i]


def vision_dataset(entries: list, processor, max_len: int, what: str) -> tuple[VisionDataset, dict]:
    """The data set of `entries` and its statistics; samples without a trained token are dropped and counted."""
    encoded = [encode_record(r, processor, max_len) for r in load_vision_records(entries, what)]
    kept = [s for s in encoded if any(x != IGNORE_INDEX for x in s["labels"][1:])]
    dropped = [s["origin"] for s in encoded if s not in kept]
    if not kept:
        raise DataError(f"{what}: no sample has a trained token within data.max_len={max_len} (first: {dropped[0]})")
    lengths = sorted(s["length"] for s in kept)
    stats = {"samples": len(kept), "tokens": sum(lengths), "image_tokens": sum(s["image_tokens"] for s in kept),
             "images": sum(len(s["images"]) for s in kept), "mean_len": sum(lengths) / len(lengths),
             "max_len": lengths[-1], "truncated": sum(s["truncated"] for s in kept), "dropped_no_labels": len(dropped),
             "dropped_examples": dropped[:5]}
    return VisionDataset(kept), stats


def images_of_rows(batch: dict, keep: int) -> dict:
    """The pixel_values and image_grid_thw of a batch's first `keep` rows (its images are in row order; each image
    has prod(grid) pixel rows and prod(grid) / merge^2 tokens, the same ratio for all)."""
    tokens = batch["mm_token_type_ids"] == 1
    share = int(tokens[:keep].sum()) * batch["pixel_values"].shape[0] // max(1, int(tokens.sum()))
    ends = batch["image_grid_thw"].prod(-1).cumsum(0)
    images = int((ends <= share).sum())
    return {"pixel_values": batch["pixel_values"][:share], "image_grid_thw": batch["image_grid_thw"][:images]}


class VisionCollator:
    """Samples -> right-padded input_ids, labels, attention_mask, mm_token_type_ids (what the model computes its 3-D
    positions from, with image_grid_thw) and the images' pixel_values and image_grid_thw (the processor's)."""

    def __init__(self, processor):
        self.processor = processor
        self.text = GenerativeCollator(processor.tokenizer.pad_token_id)  # the text rows, padded as every run's

    def __call__(self, samples: list[dict]) -> dict:
        batch = self.text(samples)
        types = torch.zeros_like(batch["input_ids"])
        for i, s in enumerate(samples):
            types[i, :len(s["input_ids"])] = torch.tensor(self.processor.create_mm_token_type_ids([s["input_ids"]])[0])
        batch["mm_token_type_ids"] = types
        paths = [p for s in samples for p in s["images"]]
        if paths:
            images = [open_image(Path(p), s["origin"], Path(p).name) for s in samples for p in s["images"]]
            pix = self.processor.image_processor(images=images, return_tensors="pt")
            batch.update(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
        return batch

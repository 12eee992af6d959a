"""Vision-language fine-tuning (harness/data/vision.py, docs/vision.md) on configs/vlm-tiny.yaml: a random-init
Qwen2.5-VL-style model and the generated images of data/vlm-tiny (no download).

    pytest -n 0 tests/test_vision.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from harness import IGNORE_INDEX
from harness.config import load_config
from harness.config.modes import facts
from harness.data import vision
from harness.data.samples import model_inputs
from harness.errors import ConfigError, DataError
from harness.model import build_model, load_run_tokenizer
from harness_launch import metrics, run_train

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "configs" / "vlm-tiny.yaml")
TRAIN = ROOT / "data" / "vlm-tiny" / "train.jsonl"


def processor_of(overrides: list[str] | None = None):
    cfg = load_config(RECIPE, overrides or [])
    tok = load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    return cfg, vision.load_processor(cfg.model, tok)


@pytest.fixture(scope="module")
def tiny():
    return processor_of()


def test_ids_are_the_processors_and_only_assistant_text_is_labelled(tiny):
    """The ids, mm_token_type_ids and pixels equal transformers' processor's on the rendered conversation; labels
    cover the assistant turns only; no image or vision-marker token is ever labelled."""
    cfg, proc = tiny
    ds, stats = vision.vision_dataset([str(TRAIN)], proc, cfg.data.max_len, "data.train_files")
    records = [json.loads(x) for x in TRAIN.read_text().splitlines()]
    vision_ids = {proc.tokenizer.convert_tokens_to_ids(t) for t in vision.VISION_TOKENS}
    assert stats["images"] == sum(len(r["images"]) for r in records) and stats["truncated"] == 0
    for k in (0, 2, 4):  # one image; a second turn; two images
        sample, rec = ds[k], records[k]
        images = [Image.open(TRAIN.parent / x).convert("RGB") for x in rec["images"]]
        text = proc.apply_chat_template(rec["messages"], tokenize=False)
        ref = proc(text=[text], images=images, return_tensors="pt")
        assert sample["input_ids"] == ref["input_ids"][0].tolist()
        batch = vision.VisionCollator(proc)([sample])
        assert torch.equal(batch["mm_token_type_ids"][0], ref["mm_token_type_ids"][0])
        assert torch.equal(batch["pixel_values"], ref["pixel_values"])
        assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
        assert (ref["input_ids"][0] == proc.image_token_id).sum() == sum(
            vision.image_tokens(proc, *im.size) for im in images)
        labels = sample["labels"]
        assert not any(t in vision_ids for t in labels)
        trained = proc.tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
        answers = [p["text"] for m in rec["messages"] if m["role"] == "assistant" for p in m["content"]]
        assert trained == "".join(a + proc.tokenizer.eos_token for a in answers)


def _bad_record(tmp_path: Path, image: str, make) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    make(tmp_path / "img")
    good = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "A thing."}]}]}
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "img" / "ok.png")
    lines = [{**good, "images": ["img/ok.png"]}, {**good, "images": [image]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _truncated(folder: Path) -> None:
    Image.new("RGB", (56, 56), (1, 2, 3)).save(folder / "cut.png")
    data = (folder / "cut.png").read_bytes()
    (folder / "cut.png").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("image,make,words", [
    ("img/gone.png", lambda f: None, "image 'img/gone.png' not found"),
    ("img/cut.png", _truncated, "image 'img/cut.png' cannot be decoded"),
    ("img/text.png", lambda f: (f / "text.png").write_text("not a picture"), "image 'img/text.png' is not an image"),
    ("img/big.png", lambda f: Image.new("RGB", (900, 900)).save(f / "big.png"),
     "image 'img/big.png' (900x900 pixels) takes 64 image tokens, more than data.max_len=40"),
])
def test_bad_images_are_one_line_naming_file_line_and_image(tiny, tmp_path, image, make, words):
    """A missing file, a truncated file, a file that is not an image, an image whose tokens alone pass data.max_len
    (900x900 at model.image_max_pixels=50176: 224x224, 64 tokens): one line naming file:line and the image."""
    _, proc = processor_of(["model.image_max_pixels=50176"]) if "big" in image else tiny
    path = _bad_record(tmp_path, image, make)
    with pytest.raises(DataError) as err:
        vision.vision_dataset([str(path)], proc, 40, "data.train_files")
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: ") and words in msg and "\n" not in msg, msg


def test_packing_and_streaming_are_refused_in_one_line():
    cfg = load_config(RECIPE, ["data.packing=true"])
    assert vision.is_vision(cfg.model)
    with pytest.raises(ConfigError, match=r"^config key 'data.packing': .*mRoPE.*data.packing=false"):
        vision.check_vision_run(cfg.data, facts(cfg.loss.mode))
    with pytest.raises(ConfigError, match=r"^config key 'data.streaming'"):
        vision.check_vision_run(load_config(RECIPE, ["data.streaming=true"]).data, facts("generative"))
    with pytest.raises(ConfigError, match=r"^config key 'loss.mode': .*loss.mode=generative, got preference$"):
        vision.check_vision_run(load_config(RECIPE).data, facts("preference"))


def test_a_filled_last_round_keeps_the_images_of_its_real_rows(tiny):
    """Several processes: a batch cut to its real rows (loaders.without_padding) keeps those rows' images only."""
    from harness.data.loaders import without_padding

    cfg, proc = tiny
    ds, _ = vision.vision_dataset([str(TRAIN)], proc, cfg.data.max_len, "data.train_files")
    collate = vision.VisionCollator(proc)
    samples = [ds[4], ds[0], ds[9]]  # two images, one, two
    for k in (1, 2):
        cut, ref = without_padding(collate(samples), k), collate(samples[:k])
        width = ref["input_ids"].shape[1]
        assert torch.equal(cut["input_ids"][:, :width], ref["input_ids"])
        assert torch.equal(cut["image_grid_thw"], ref["image_grid_thw"])
        assert torch.equal(cut["pixel_values"], ref["pixel_values"])


def _first_batch_and_model(overrides: list[str]):
    """The recipe's first micro-batch (data.shuffle=false) and the model a run starts from (same seed, same build)."""
    from accelerate.utils import set_seed

    cfg, proc = processor_of(overrides)
    ds, _ = vision.vision_dataset(cfg.data.train_files, proc, cfg.data.max_len, "data.train_files")
    batch = vision.VisionCollator(proc)([ds[i] for i in range(cfg.train.micro_batch_size)])
    set_seed(cfg.train.seed)
    return batch, build_model(cfg.model, proc.tokenizer), proc


OVERRIDES = ["data.shuffle=false", "data.eval_files=[]", "train.max_steps=2", "train.log_every=1",
             "train.micro_batch_size=4", "train.eval_at_start=false"]


def test_step1_loss_is_the_models_own_and_the_vision_tower_stays_frozen(tmp_path):
    """harness train's step-1 loss = the model's own `labels=` loss on the same padded batch (whose 3-D positions
    the model computes from image_grid_thw and mm_token_type_ids) within 1e-5; after 2 steps the vision tower's
    weights are unchanged (model.train_vision=false), its merger trained (the recipe's model.train_projector=true);
    final/ holds the processor and reloads with transformers to the run's final evaluation loss; TRL 1.16's
    SFTTrainer collates the same batch (its vision collator with assistant_only_loss: TRL's reference for which
    tokens are trained) and has the same step-1 loss within 1e-5 (measured: 5e-7)."""
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    run_train(OVERRIDES + [f"train.output_dir={out}", "data.eval_files=[data/vlm-tiny/eval.jsonl]"], config=RECIPE)
    batch, model, proc = _first_batch_and_model(OVERRIDES)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(**model_inputs(batch), labels=batch["labels"], use_cache=False).loss.item()
    first = metrics(out)[0]
    assert first["step"] == 1 and abs(first["loss"] - ref) <= 1e-5, (first["loss"], ref)

    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / "final" / name).is_file(), name
    reloaded = AutoModelForImageTextToText.from_pretrained(out / "final")  # transformers' own loading of final/
    final = reloaded.state_dict()
    tower = [k for k in final if k.startswith("model.visual.") and ".merger." not in k]
    merger = [k for k in final if ".merger." in k]
    assert tower and merger and final.keys() == start.keys()
    assert all(torch.equal(final[k], start[k]) for k in tower)
    assert any(not torch.equal(final[k], start[k]) for k in merger)

    # the reloaded model's held-out loss = the trained model's final evaluation (report.json) within 1e-5
    exported = load_config(RECIPE, [f"model.name_or_path={out / 'final'}"])
    again = vision.load_processor(exported.model, load_run_tokenizer(exported.model, "auto", "generative"))
    assert again.image_processor.size == proc.image_processor.size  # model.image_max_pixels kept
    held, _ = vision.vision_dataset([str(TRAIN.parent / "eval.jsonl")], again, 128, "data.eval_files")
    collate, loss_sum, count = vision.VisionCollator(again), 0.0, 0
    with torch.no_grad():
        for i in range(0, len(held), 4):
            b = collate([held[j] for j in range(i, min(i + 4, len(held)))])
            n = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
            loss_sum += reloaded(**model_inputs(b), labels=b["labels"], use_cache=False).loss.item() * n
            count += n
    evaluated = json.loads((out / "report.json").read_text())["eval"]["eval_loss"]
    assert abs(loss_sum / count - evaluated) <= 1e-5, (loss_sum / count, evaluated)

    # TRL 1.16's SFTTrainer on the same records (its vision collator, assistant_only_loss): the same batch, the same
    # step-1 loss
    trl_batch, trl_loss = trl_first_step(model, proc, 4, tmp_path / "trl")
    assert torch.equal(trl_batch["input_ids"], batch["input_ids"]) and torch.equal(trl_batch["labels"], batch["labels"])
    assert abs(trl_loss - first["loss"]) <= 1e-5, (trl_loss, first["loss"])


def trl_first_step(model, proc, n: int, out: Path) -> tuple[dict, float]:
    """(TRL's collated batch, SFTTrainer's step-1 loss) of the first n training records, images as PIL images, one
    step of batch n on the CPU (the model is trained in place)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    records = [json.loads(x) for x in TRAIN.read_text().splitlines()[:n]]
    rows = [{"messages": r["messages"], "images": [Image.open(TRAIN.parent / p).convert("RGB") for p in r["images"]]}
            for r in records]
    collated = DataCollatorForVisionLanguageModeling(proc, assistant_only_loss=True)([dict(r) for r in rows])
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=n, max_steps=1, logging_steps=1,
                     assistant_only_loss=True, report_to=[], use_cpu=True, save_strategy="no", max_length=None,
                     bf16=False)  # fp32, as the run (SFTConfig defaults to bf16)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=proc)
    trainer.train()
    return collated, trainer.state.log_history[0]["loss"]


def test_train_vision_true_trains_the_tower(tmp_path):
    """model.train_vision=true: every weight matrix of the vision tower's blocks moves in one step."""
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    run_train(OVERRIDES + [f"train.output_dir={out}", "train.max_steps=1", "model.train_vision=true"], config=RECIPE)
    _, model, _ = _first_batch_and_model(OVERRIDES)
    start = model.state_dict()
    final = AutoModelForImageTextToText.from_pretrained(out / "final").state_dict()
    blocks = [k for k in final if k.startswith("model.visual.blocks.") and k.endswith("weight")]
    assert blocks and all(not torch.equal(final[k], start[k]) for k in blocks)


def test_lora_adapts_the_language_model_only_and_reloads_through_peft(tmp_path):
    """model.lora.enabled=true: the adapter holds no vision-tower module (LoRA on the language model's layers only);
    final/ (adapter + final/base/, the random base) reloads through peft to the logits of final/merged/ within 1e-5,
    both loaded with transformers' AutoModelForImageTextToText; the processor is in each folder."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    run_train(OVERRIDES + [f"train.output_dir={out}", "train.max_steps=1", "model.lora.enabled=true"], config=RECIPE)
    final = out / "final"
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in adapter) and not any("visual" in k for k in adapter)
    assert all((final / d / "preprocessor_config.json").is_file() for d in (".", "base", "merged"))
    batch, _, _ = _first_batch_and_model(OVERRIDES)
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(final / "base"), final)
    merged = AutoModelForImageTextToText.from_pretrained(final / "merged")
    base = AutoModelForImageTextToText.from_pretrained(final / "base")
    with torch.no_grad():
        a, b, c = (m.eval()(**model_inputs(batch), use_cache=False).logits for m in (peft_model, merged, base))
    assert (a - b).abs().max().item() <= 1e-5
    assert (a - c).abs().max().item() > 1e-4  # the adapter changed the model

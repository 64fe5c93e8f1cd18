"""Vision-language models: loading, image prompts, multimodal model inputs, the tiny Qwen2.5-VL.

The Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) shares one input contract, and
this module is the only place that knows it:

- An image becomes `pixel_values` [patches, C * temporal_patch * patch^2] and one row of
  `image_grid_thw` [1, H / patch, W / patch] (the image processor), and the prompt's single
  `<|image_pad|>` for it is expanded to grid_t * grid_h * grid_w / merge^2 copies (what the HF
  processor does to the text). The image is first resized to a multiple of patch * merge within
  [min_pixels, max_pixels] (`data.min_pixels` / `data.max_pixels`, else the processor's own).
- Positions are mRoPE (3-D: time, height, width for image tokens). The model computes them itself
  from `attention_mask`, `image_grid_thw` and `mm_token_type_ids` (0 text, 1 image, 2 video), so
  callers pass no `position_ids` for sequences with images. transformers 5 needs
  `mm_token_type_ids` for this; without it Qwen2.5-VL silently falls back to 1-D positions.

Why no `AutoProcessor`: the Qwen-VL processors of transformers 5.19 hold a video processor whose
classes need torchvision, which postrl keeps out (PyPI's CUDA build breaks `import vllm` beside CPU
torch). So `VisionTokenizer` does the processor's job with the PIL image processor
(`Qwen2VLImageProcessorPil`, the "slow" one) and the tokenizer's chat template. It wraps the
tokenizer, so the trainer keeps using it as one (pad/eos ids, decoding), and its `save_pretrained`
writes the image processor config too, so checkpoints reload as VLMs.

Per prompt the dataset stores `multi_modal = {"images", "image_grid_thw", "image_processor"}`: the
resized PIL images (what vLLM takes, and 8x smaller than their float patches) and their grid.
`model_inputs` turns the dicts of a batch into the model's keyword arguments (pixel values made
on the fly, `mm_token_type_ids` from the image token).

`builtin:tiny-qwen2.5-vl` is a random-initialised Qwen2.5-VL (a 2-block vision tower and a 4-layer
language model, about 1.1M parameters) with a byte-level BPE tokenizer trained on the built-in
shapes task and the Qwen vision special tokens, built locally from a seed and cached.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.errors import UserError
from postrl.utils import cache_dir

TINY_VL_NAME = "tiny-qwen2.5-vl"
TINY_VL_VERSION = 3  # bump when the architecture or the tokenizer corpus changes (invalidates the cache)
TINY_VL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 1024,
    "vision_depth": 2,
    "vision_hidden_size": 64,
    "vision_heads": 4,
    "vision_intermediate_size": 128,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "seed": 0,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<image>"  # how data marks where an image goes (verl / geo3k convention)
# ChatML with Qwen2-VL's content lists: {"type": "image"} renders as one vision block. No default
# system prompt (prompts of the tiny model stay short); real models bring their own template.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------ tiny factory


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from postrl.data import synthetic, visual_task

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + VISION_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = visual_task.tokenizer_corpus(seed=seed) + synthetic.tokenizer_corpus(n=1000, seed=seed)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=VL_CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="left",
    )


def build_tiny_vlm(out_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Build (or reuse from the cache) a tiny Qwen2.5-VL + tokenizer + image processor; returns its directory."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unknown = set(overrides) - set(TINY_VL_DEFAULTS)
    if unknown:
        raise UserError(
            f"model.tiny has unknown keys {sorted(unknown)} for builtin:{TINY_VL_NAME}; valid: {', '.join(TINY_VL_DEFAULTS)}."
        )
    spec = {**TINY_VL_DEFAULTS, **overrides, "version": TINY_VL_VERSION}
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir else cache_dir() / "models" / f"{TINY_VL_NAME}-{key}"
    if (out / "config.json").exists() and (out / "preprocessor_config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = _train_tokenizer(spec["vocab_size"], spec["seed"])
    head_dim = spec["hidden_size"] // spec["num_heads"]
    half = head_dim // 2  # mRoPE splits the rotary half-dimensions into (time, height, width)
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16 -> [4, 6, 6] as Qwen's [16, 24, 24]
    tid = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec["hidden_size"],
            intermediate_size=spec["intermediate_size"],
            num_hidden_layers=spec["num_layers"],
            num_attention_heads=spec["num_heads"],
            num_key_value_heads=spec["num_kv_heads"],
            max_position_embeddings=spec["max_position_embeddings"],
            rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0},
            tie_word_embeddings=True,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=spec["vision_depth"],
            hidden_size=spec["vision_hidden_size"],
            intermediate_size=spec["vision_intermediate_size"],
            num_heads=spec["vision_heads"],
            out_hidden_size=spec["hidden_size"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[spec["vision_depth"] - 1],
        ),
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec["seed"])
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=spec["min_pixels"], max_pixels=spec["max_pixels"])
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    image_processor.save_pretrained(tmp)
    (tmp / "postrl_tiny.json").write_text(json.dumps(spec, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------------- loading


def _config_dict(path: str) -> dict:
    """config.json of a model directory or hub id ({} when there is none)."""
    local = Path(path) / "config.json"
    try:
        if local.is_file():
            return json.loads(local.read_text())
        if Path(path).exists():
            return {}
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path).to_dict()  # hub id (downloaded once, then cached)
    except (OSError, ValueError):
        return {}


def is_vlm_dir(path: str) -> bool:
    """Whether the model at `path` (directory or hub id) has a vision tower."""
    return "vision_config" in _config_dict(path)


def is_vlm(model: torch.nn.Module) -> bool:
    return getattr(_config(model), "vision_config", None) is not None


def load_vlm(path: str, dtype: torch.dtype, trust_remote_code: bool = False):
    """The image-text-to-text model of `path` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...)."""
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a vision-language model from '{path}' ({exc}). Fix: point model.path at a Hugging Face "
            "image-text-to-text model directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), e.g. the output of `postrl sft`."
        ) from None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder and its merger/projector (`model.visual`), or None for a text-only model."""
    m = _unwrap(model)
    inner = getattr(m, "model", None)
    return getattr(inner, "visual", None) or getattr(m, "visual", None)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients to the vision tower (as verl's freeze_vision_tower); returns its parameter count."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


@dataclass
class ImageSpec:
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int


class VisionTokenizer:
    """A VLM's tokenizer plus its image processor: what the HF processor would be, without torchvision.

    Everything not defined here is the tokenizer's (`pad_token_id`, `batch_decode`, ...).
    """

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        size = image_processor.size
        self.spec = ImageSpec(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # during unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def save_pretrained(self, directory: str | Path, **kwargs) -> Any:
        self.image_processor.save_pretrained(directory)
        return self.tokenizer.save_pretrained(directory, **kwargs)

    # ------------------------------------------------------------------------- prompt encoding
    def encode(self, messages: list[dict], images: list, min_pixels: int | None = None, max_pixels: int | None = None):
        """Token ids of chat `messages` (content lists with {"type": "image"} parts) and their image inputs.

        Returns (ids, multi_modal) with multi_modal = {"images": resized PIL images, "image_grid_thw":
        [n_images, 3], "image_processor"}. Pixel values are made from the images when a batch needs them
        (`model_inputs`): a uint8 picture is 8x smaller than its float32, temporally doubled patches.
        """
        lo = min_pixels or self.spec.min_pixels
        hi = max_pixels or self.spec.max_pixels
        patch, merge = self.spec.patch_size, self.spec.merge_size
        resized = [resize_within(im, lo, hi, patch * merge) for im in images]
        grid = torch.tensor([[1, im.size[1] // patch, im.size[0] // patch] for im in resized], dtype=torch.long)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(resized):
            raise BadImageRow(
                f"the chat template rendered {len(pieces) - 1} image slot(s) for {len(resized)} image(s). "
                "Fix: use a chat template that renders {'type': 'image'} parts (the model's own template does)."
            )
        counts = (grid.prod(-1) // merge**2).tolist()  # image tokens per image after the merge
        text = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sum(1 for t in ids if t == self.image_token_id) == sum(counts), "image tokens must match the image features"
        return list(ids), {"images": resized, "image_grid_thw": grid, "image_processor": self.image_processor}


def load_vision_tokenizer(path: str, tokenizer: Any, trust_remote_code: bool = False) -> VisionTokenizer | None:
    """Wrap `tokenizer` with the image processor of `path` when `path` is a VLM directory, else None."""
    if not is_vlm_dir(path):
        return None
    from transformers import AutoImageProcessor

    try:
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"'{path}' is a vision-language model but its image processor cannot be loaded ({exc}). "
            "Fix: the directory needs preprocessor_config.json (copy it from the original model)."
        ) from None
    cfg = _config_dict(path)
    image_token_id = cfg.get("image_token_id") or cfg.get("image_token_index")
    if image_token_id is None:
        raise UserError(f"'{path}/config.json' has no image_token_id, so image tokens cannot be placed.")
    if not getattr(tokenizer, "chat_template", None):
        tpl = Path(path) / "chat_template.json"
        if tpl.is_file():
            tokenizer.chat_template = json.loads(tpl.read_text())["chat_template"]
    return VisionTokenizer(tokenizer, image_processor, int(image_token_id))


# ------------------------------------------------------------------------------------ image rows


class BadImageRow(Exception):
    """An image row that cannot be used: `str(exc)` says what is wrong and how to fix it."""


def resize_within(image, min_pixels: int, max_pixels: int, factor: int):
    """`image` resized (bicubic, aspect kept) to sides that are multiples of `factor`, area within bounds."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    w, h = image.size
    try:
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:  # absurd aspect ratio
        raise BadImageRow(f"image of {w}x{h} pixels cannot be resized ({exc}). Fix: crop or drop it.") from None
    return image if (rw, rh) == (w, h) else image.resize((rw, rh), Image.BICUBIC)


def decode_image(item: Any, k: int, base_dir: Path | None = None):
    """One image of a row as an RGB PIL image: bytes, a path (absolute, or relative to the data file), or {bytes, path}."""
    from PIL import Image

    data, path = None, None
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
    elif isinstance(item, str):
        path = item
    elif isinstance(item, Image.Image):
        return item.convert("RGB")
    else:
        raise BadImageRow(f"image {k} is a {type(item).__name__}; expected bytes, a path or {{bytes, path}}.")
    if not data and path:
        p = Path(path).expanduser()
        if not p.is_absolute() and not p.exists() and base_dir is not None:
            p = base_dir / p
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise BadImageRow(f"image {k}: cannot read '{path}' ({exc.strerror}). Fix: correct the path.") from None
    if not data:
        raise BadImageRow(f"image {k} has no bytes and no path. Fix: correct the row or drop it.")
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")  # decodes fully: truncated files fail here
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        raise BadImageRow(
            f"image {k} cannot be decoded ({type(exc).__name__}: {exc}). Fix: re-export it as PNG or JPEG, or drop the row."
        ) from None


def image_messages(prompt: Any) -> tuple[list[dict], int]:
    """Chat messages with each `<image>` in the text turned into an image part; and the placeholder count."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    messages, n = [], 0
    for m in prompt:
        content = m["content"]
        if not isinstance(content, str):  # already a content list
            n += sum(1 for part in content if part.get("type") == "image")
            messages.append({"role": m["role"], "content": list(content)})
            continue
        parts: list[dict] = []
        for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
                n += 1
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({"role": m["role"], "content": parts if i else content})
    return messages, n


def has_images(tokenizer: Any, prompt: Any, images: Any) -> bool:
    """Whether a row goes the image way: it has images, or (for a VLM) its prompt has `<image>` placeholders."""
    if images is not None and not (hasattr(images, "__len__") and len(images) == 0):
        return True
    if not isinstance(tokenizer, VisionTokenizer):
        return False
    messages = [{"content": prompt}] if isinstance(prompt, str) else prompt
    return any(
        IMAGE_PLACEHOLDER in m["content"] if isinstance(m.get("content"), str) else any(p.get("type") == "image" for p in m["content"])
        for m in messages
    )


def encode_image_prompt(tokenizer: Any, prompt: Any, images: Any, data_cfg: Any, base_dir: Path | None = None):
    """(prompt ids, multi_modal dict) of one data row with images; raises BadImageRow for a malformed row."""
    if not isinstance(tokenizer, VisionTokenizer):
        raise UserError(
            f"the data has images (column '{data_cfg.image_key}') but the model is text-only. "
            "Fix: use a vision-language model (e.g. model.path: builtin:tiny-qwen2.5-vl or Qwen/Qwen2.5-VL-7B-Instruct), "
            "or set data.image_key to a column that does not exist to train on the text alone."
        )
    if images is None:
        items = []
    elif isinstance(images, (bytes, bytearray, str, dict)) or hasattr(images, "convert"):  # one image (PIL has convert)
        items = [images]
    else:
        items = list(images)  # list, tuple, numpy array of images
    messages, n_placeholders = image_messages(prompt)
    if n_placeholders != len(items):
        raise BadImageRow(
            f"the prompt has {n_placeholders} '{IMAGE_PLACEHOLDER}' placeholder(s) but the row has {len(items)} image(s); "
            f"each image needs exactly one placeholder where it goes. Fix: correct the row, or preprocess the data with "
            "`postrl preprocess` (handler geo3k adds missing placeholders)."
        )
    pil = [decode_image(item, k, base_dir) for k, item in enumerate(items)]
    return tokenizer.encode(messages, pil, getattr(data_cfg, "min_pixels", None), getattr(data_cfg, "max_pixels", None))


# ------------------------------------------------------------------------------------ model inputs


def media_token_ids(model: torch.nn.Module) -> list[int]:
    """Image/video placeholder ids of a VLM ([] for text models): responses must never contain them.

    The forward pass puts image features at every placeholder, so a sampled one would break it; the
    engines suppress them when sampling (the models never emit them after pre-training anyway).
    """
    cfg = _config(model)
    if getattr(cfg, "vision_config", None) is None:
        return []
    return [int(t) for t in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None)) if t is not None]


def vllm_blocker(model: torch.nn.Module) -> str | None:
    """Why vLLM cannot roll out this VLM on this install (None when nothing is known to block it).

    vLLM 0.32's Qwen2-VL code (vllm/model_executor/models/qwen2_vl.py, which its Qwen2.5-VL and Qwen3-VL
    code import) does `from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`;
    in transformers 5 that module is the torchvision image processor and imports torchvision at once.
    vLLM also loads the HF processor, whose video processor needs torchvision.
    """
    import importlib.util

    if not is_vlm(model) or importlib.util.find_spec("torchvision") is not None:
        return None
    return (
        "vLLM cannot roll out vision-language models on this install: vLLM's Qwen2-VL / Qwen2.5-VL / Qwen3-VL code "
        "imports transformers' torchvision image processor (transformers.models.qwen2_vl.image_processing_qwen2_vl), "
        "and torchvision is not installed (PyPI's torchvision is a CUDA build that breaks `import vllm` beside CPU "
        "torch, so postrl's CPU setup leaves it out). Fix: set rollout.engine: hf (what auto falls back to), or "
        "install the torchvision build that matches your torch (CPU wheels: https://download.pytorch.org/whl/cpu)."
    )


def pixel_values(item: dict) -> torch.Tensor:
    """Patches [n_patches, C * temporal_patch * patch^2] of one prompt's (already resized) images."""
    out = item["image_processor"](images=item["images"], do_resize=False, return_tensors="pt")
    assert torch.equal(out["image_grid_thw"], item["image_grid_thw"]), "image grid changed since the prompt was encoded"
    return out["pixel_values"]


def model_inputs(model: torch.nn.Module, input_ids: torch.Tensor, items: list[dict | None] | None) -> dict[str, torch.Tensor]:
    """Keyword arguments for a VLM forward / generate over `input_ids` [B, L] from per-sequence image dicts.

    Sequences without images contribute nothing; an empty result means a text-only batch.
    """
    items = [it for it in (items or []) if it and it.get("images")]
    if not items:
        return {}
    cfg = _config(model)
    tower = vision_tower(model)
    dtype = next(tower.parameters()).dtype if tower is not None else torch.float32
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == cfg.image_token_id] = 1
    video_id = getattr(cfg, "video_token_id", None)
    if video_id is not None:
        types[input_ids == video_id] = 2
    return {
        "pixel_values": torch.cat([pixel_values(it) for it in items]).to(dtype),  # [patches, D]
        "image_grid_thw": torch.cat([it["image_grid_thw"] for it in items]),  # [images, 3]
        "mm_token_type_ids": types,  # [B, L]
    }


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP
        model = model.module
    return model


def _config(model: torch.nn.Module):
    return getattr(_unwrap(model), "config", None)

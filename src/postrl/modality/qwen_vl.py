"""The Qwen-VL adapter: image prompts and model inputs of Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and -MoE).

The family shares one input contract, and this module is the only place that knows it:

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
torch). So the adapter does the processor's job with the PIL image processor
(`Qwen2VLImageProcessorPil`, the "slow" one) and the tokenizer's chat template.

Per prompt the dataset stores plain data, `multi_modal = {"images", "image_grid_thw"}`: the resized
PIL images (what vLLM takes, and 8x smaller than their float patches) and their grid. The adapter
holds the image processor and makes the pixel values of a batch on the fly (`forward_kwargs`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.modality.images import BadImageRow, row_images
from postrl.distributed import unwrap
from postrl.errors import UserError


@dataclass(frozen=True)
class ImageSpec:
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int


class QwenVL:
    name = "qwen_vl"
    takes_images = True

    def __init__(self, image_processor: Any, image_token_id: int, video_token_id: int | None = None):
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        size = image_processor.size
        self.spec = ImageSpec(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    @classmethod
    def from_pretrained(cls, path: str, config: dict, trust_remote_code: bool = False) -> "QwenVL":
        """The adapter of a model with config.json `config`, with the image processor of `path`."""
        # From its module: transformers 5.17 without torchvision exports a placeholder as
        # `transformers.AutoImageProcessor` that refuses to load even the PIL processor.
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"'{path}' is a vision-language model but its image processor cannot be loaded ({exc}). "
                "Fix: the directory needs preprocessor_config.json (copy it from the original model)."
            ) from None
        image_token_id = config.get("image_token_id") or config.get("image_token_index")
        if image_token_id is None:
            raise UserError(f"'{path}/config.json' has no image_token_id, so image tokens cannot be placed.")
        video_token_id = config.get("video_token_id")
        return cls(image_processor, int(image_token_id), None if video_token_id is None else int(video_token_id))

    # ------------------------------------------------------------------------------------- loading
    @staticmethod
    def load_model(
        path: str, dtype: torch.dtype, trust_remote_code: bool = False, attn_implementation: str | None = None
    ) -> torch.nn.Module:
        """The image-text-to-text model of `path`."""
        from transformers import AutoModelForImageTextToText

        try:
            return AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"cannot load a vision-language model from '{path}' ({exc}). Fix: point model.path at a Hugging Face "
                "image-text-to-text model directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), e.g. the output of `postrl sft`."
            ) from None

    def prepare_tokenizer(self, tokenizer: Any, path: str) -> "TokenizerWithProcessor":
        if not getattr(tokenizer, "chat_template", None):  # older checkpoints keep it in chat_template.json
            tpl = Path(path) / "chat_template.json"
            if tpl.is_file():
                tokenizer.chat_template = json.loads(tpl.read_text())["chat_template"]
        return TokenizerWithProcessor(tokenizer, self)

    def save_pretrained(self, directory: str | Path) -> None:
        self.image_processor.save_pretrained(directory)

    def vision_tower(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return vision_tower(model)

    def freeze_vision_tower(self, model: torch.nn.Module) -> int:
        """Stop gradients to the vision tower (as verl's freeze_vision_tower); returns its parameter count."""
        tower = vision_tower(model)
        if tower is None:
            return 0
        tower.requires_grad_(False)
        return sum(p.numel() for p in tower.parameters())

    # ------------------------------------------------------------------------------ prompt encoding
    def encode_prompt(self, tokenizer: Any, prompt: Any, images: Any, data_cfg: Any, base_dir: Path | None = None):
        """Token ids of a row's prompt with its images, and its multi_modal plain data.

        Returns (ids, {"images": resized PIL images, "image_grid_thw": [n_images, 3]}). Pixel values
        are made from the images when a batch needs them (`forward_kwargs`): a uint8 picture is 8x
        smaller than its float32, temporally doubled patches. Raises BadImageRow for a malformed row.
        """
        messages, pictures = row_images(prompt, images, base_dir)
        lo = getattr(data_cfg, "min_pixels", None) or self.spec.min_pixels
        hi = getattr(data_cfg, "max_pixels", None) or self.spec.max_pixels
        patch, merge = self.spec.patch_size, self.spec.merge_size
        resized = [resize_within(im, lo, hi, patch * merge) for im in pictures]
        grid = torch.tensor([[1, im.size[1] // patch, im.size[0] // patch] for im in resized], dtype=torch.long)
        image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pieces = text.split(image_token)
        if len(pieces) - 1 != len(resized):
            raise BadImageRow(
                f"the chat template rendered {len(pieces) - 1} image slot(s) for {len(resized)} image(s). "
                "Fix: use a chat template that renders {'type': 'image'} parts (the model's own template does)."
            )
        counts = (grid.prod(-1) // merge**2).tolist()  # image tokens per image after the merge
        text = pieces[0] + "".join(image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sum(1 for t in ids if t == self.image_token_id) == sum(counts), "image tokens must match the image features"
        return list(ids), {"images": resized, "image_grid_thw": grid}

    # --------------------------------------------------------------------------------- model inputs
    def forward_kwargs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, items: list[dict | None] | None
    ) -> dict[str, torch.Tensor]:
        """pixel_values, image_grid_thw and mm_token_type_ids over `input_ids` [B, L] from per-sequence items.

        Sequences without images contribute nothing; an empty result means a text-only batch.
        """
        items = [it for it in (items or []) if it and it.get("images")]
        if not items:
            return {}
        tower = vision_tower(model)
        first = next(tower.parameters()) if tower is not None else None
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else input_ids.device
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        types[input_ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[input_ids == self.video_token_id] = 2
        return {
            "pixel_values": torch.cat([self._pixel_values(it) for it in items]).to(device=device, dtype=dtype),  # [patches, D]
            "image_grid_thw": torch.cat([it["image_grid_thw"] for it in items]).to(input_ids.device),  # [images, 3]
            "mm_token_type_ids": types,  # [B, L]
        }

    def _pixel_values(self, item: dict) -> torch.Tensor:
        """Patches [n_patches, C * temporal_patch * patch^2] of one prompt's (already resized) images."""
        out = self.image_processor(images=item["images"], do_resize=False, return_tensors="pt")
        assert torch.equal(out["image_grid_thw"], item["image_grid_thw"].cpu()), "image grid changed since the prompt was encoded"
        return out["pixel_values"]

    def suppress_token_ids(self) -> list[int]:
        """The image/video placeholder ids: the forward pass puts image features at every placeholder, so a
        sampled one would break it (the models never emit them after pre-training anyway)."""
        return [t for t in (self.image_token_id, self.video_token_id) if t is not None]

    # --------------------------------------------------------------------------------------- vLLM
    def vllm_request_data(self, item: dict) -> dict:
        if "multi_modal_data" in item:  # already in vLLM's form
            return item["multi_modal_data"]
        if "images" in item:
            return {"image": item["images"]}
        raise ValueError(
            "the vLLM engine needs raw images for vision-language prompts: give each multi_modal dict an "
            f"'images' list (PIL images) or a vLLM 'multi_modal_data' dict; got keys {sorted(item)}."
        )

    def vllm_blocker(self) -> str | None:
        """Why vLLM cannot roll out a Qwen-VL model on this install (None when nothing is known to block it).

        vLLM 0.32's Qwen2-VL code (vllm/model_executor/models/qwen2_vl.py, which its Qwen2.5-VL and Qwen3-VL
        code import) does `from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`;
        in transformers 5 that module is the torchvision image processor and imports torchvision at once.
        vLLM also loads the HF processor, whose video processor needs torchvision.
        """
        import importlib.util

        if importlib.util.find_spec("torchvision") is not None:
            return None
        return (
            "vLLM cannot roll out vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) on this install: "
            "vLLM's code for them imports transformers' torchvision image processor "
            "(transformers.models.qwen2_vl.image_processing_qwen2_vl), and torchvision is not installed. postrl's CPU "
            "setup leaves it out: the only torchvision for torch 2.13.0 on PyPI (0.28.0) is a CUDA 13 build whose "
            "torchvision/_C.so links libc10_cuda.so, libtorch_cuda.so and libcudart.so.13, which CPU torch does not "
            "ship, so `import torchvision` fails (\"operator torchvision::nms does not exist\") and takes `import vllm` "
            "with it; torchvision 0.29 needs torch >= 2.14 (docs/gpu.md). Fix: set rollout.engine: hf (what auto falls "
            "back to), or install the CPU build that matches your torch "
            "(`pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu`)."
        )


class TokenizerWithProcessor:
    """A VLM's tokenizer whose `save_pretrained` also writes the image processor config, so that a
    checkpoint or SFT output (which saves the policy's tokenizer) reloads as a VLM.

    Everything else is the tokenizer's (`pad_token_id`, `batch_decode`, ...).
    """

    def __init__(self, tokenizer: Any, modality: QwenVL):
        self.tokenizer = tokenizer
        self.modality = modality

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # during unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def save_pretrained(self, directory: str | Path, **kwargs) -> Any:
        self.modality.save_pretrained(directory)
        return self.tokenizer.save_pretrained(directory, **kwargs)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder and its merger/projector (`model.visual`), or None for a text-only model."""
    m = unwrap(model)
    inner = getattr(m, "model", None)
    return getattr(inner, "visual", None) or getattr(m, "visual", None)


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

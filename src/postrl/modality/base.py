"""The modality adapter protocol: everything a model family adds to plain token-in, token-out text.

The policy owns one adapter, chosen once from the model's config.json when it loads
(`postrl.modality.load_modality`); generic code (models, rollout engines, datasets, SFT, eval)
calls the adapter and never a model family's module. Data rows carry plain data only (for images:
the resized pictures and their patch grid, `PromptExample.multi_modal`); the adapter holds what
turns them into model inputs (an image processor, the placeholder token ids).

Adapters: `TextModality` (the default: no extra inputs, nothing to suppress) and `QwenVL`
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Modality(Protocol):
    name: str
    takes_images: bool  # whether rows with images (or `<image>` placeholders) go to `encode_prompt`

    @staticmethod
    def load_model(
        path: str, dtype: "torch.dtype", trust_remote_code: bool = False, attn_implementation: str | None = None
    ) -> "torch.nn.Module":
        """The model of `path` with the transformers auto class of this family (raises on failure);
        `attn_implementation` None is transformers' default."""
        ...

    def prepare_tokenizer(self, tokenizer: Any, path: str) -> Any:
        """The tokenizer the policy uses; its `save_pretrained` writes what a checkpoint needs to reload."""
        ...

    def encode_prompt(
        self, tokenizer: Any, prompt: Any, images: Any, data_cfg: Any, base_dir: Path | None = None
    ) -> tuple[list[int], dict]:
        """(prompt ids, multi_modal plain data) of a row with images; raises modality.images.BadImageRow."""
        ...

    def forward_kwargs(
        self, model: "torch.nn.Module", input_ids: "torch.Tensor", items: list[dict | None] | None
    ) -> dict[str, "torch.Tensor"]:
        """Extra keyword arguments of a forward / generate over `input_ids` [B, L]; {} for a text-only batch."""
        ...

    def suppress_token_ids(self) -> list[int]:
        """Token ids a response must never contain (placeholders the forward pass fills with features)."""
        ...

    def vllm_request_data(self, item: dict) -> dict:
        """vLLM's `multi_modal_data` of one prompt's multi_modal item."""
        ...

    def vllm_blocker(self) -> str | None:
        """Why vLLM cannot roll out this model on this install (None when nothing is known to block it)."""
        ...

    def vision_tower(self, model: "torch.nn.Module") -> "torch.nn.Module | None":
        """The vision encoder module (None: there is none); LoRA leaves it out when it is frozen."""
        ...

    def freeze_vision_tower(self, model: "torch.nn.Module") -> int:
        """Stop gradients to the vision encoder; returns its parameter count (0: there is none)."""
        ...

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the adapter's own files (e.g. the image processor config) beside the tokenizer's."""
        ...

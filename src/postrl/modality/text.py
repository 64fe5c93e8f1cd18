"""The text adapter (the default): token ids in, token ids out; no extra inputs, nothing to suppress."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from postrl.errors import UserError

if TYPE_CHECKING:
    import torch


class TextModality:
    name = "text"
    takes_images = False

    @staticmethod
    def load_model(
        path: str, dtype: "torch.dtype", trust_remote_code: bool = False, attn_implementation: str | None = None
    ) -> "torch.nn.Module":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )

    def prepare_tokenizer(self, tokenizer: Any, path: str) -> Any:
        return tokenizer

    def encode_prompt(self, tokenizer: Any, prompt: Any, images: Any, data_cfg: Any, base_dir: Path | None = None):
        raise UserError(
            f"the data has images (column '{data_cfg.image_key}') but the model is text-only. "
            "Fix: use a vision-language model (e.g. model.path: builtin:tiny-qwen2.5-vl or Qwen/Qwen2.5-VL-7B-Instruct), "
            "or set data.image_key to a column that does not exist to train on the text alone."
        )

    def forward_kwargs(self, model: Any, input_ids: Any, items: list[dict | None] | None) -> dict:
        assert not any(items or []), "a text model was handed image inputs (multi_modal)"
        return {}

    def suppress_token_ids(self) -> list[int]:
        return []

    def vllm_request_data(self, item: dict) -> dict:
        raise AssertionError("a text model was handed image inputs (multi_modal)")

    def vllm_blocker(self) -> str | None:
        return None

    def vision_tower(self, model: Any) -> None:
        return None

    def freeze_vision_tower(self, model: Any) -> int:
        return 0

    def save_pretrained(self, directory: str | Path) -> None:
        pass


TEXT = TextModality()

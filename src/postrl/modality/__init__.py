"""Modality adapters the policy owns: text (the default) and Qwen-VL; see `postrl.modality.base`."""

from __future__ import annotations

from postrl.modality.base import Modality
from postrl.modality.text import TEXT, TextModality

__all__ = ["TEXT", "Modality", "TextModality", "load_modality", "modality_type"]


def modality_type(config: dict) -> type:
    """The adapter class for a model's config.json: a vision tower means the Qwen-VL input contract.

    Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE are the vision-language families postrl runs;
    another family with a `vision_config` goes the same way and fails where its processor or inputs differ.
    """
    if "vision_config" in config:
        from postrl.modality.qwen_vl import QwenVL

        return QwenVL
    return TextModality


def load_modality(config: dict, processor_path: str, trust_remote_code: bool = False) -> Modality:
    """The adapter of a model with config.json `config`; its processor files are read from `processor_path`."""
    cls = modality_type(config)
    return TEXT if cls is TextModality else cls.from_pretrained(processor_path, config, trust_remote_code)

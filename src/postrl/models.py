"""Models: load the policy (model, tokenizer, modality adapter), pack sequences, per-token log-probs.

Any Hugging Face causal LM directory or hub id loads the same way (a real Qwen2.5 config included);
a model with a vision tower loads through its modality adapter (`postrl.modality`), chosen once from
config.json. 'builtin:<name>' paths are the demos' tiny models (`postrl.builtin.tiny`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.errors import UserError
from postrl.modality import TEXT, Modality, load_modality, modality_type
from postrl.runtime import DTYPES


def resolve_model_path(path: str, tiny: dict | None = None) -> str:
    """`path` itself, or for 'builtin:<name>' the directory of the built (cached) tiny model."""
    if path.startswith("builtin:"):
        from postrl.builtin.tiny import build_tiny_model

        return str(build_tiny_model(path.split(":", 1)[1], **(tiny or {})))
    return path


# ----------------------------------------------------------------------------------------- loading


def model_config(path: str) -> dict:
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


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of `path`, left-padding, with a pad token (EOS when it has none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a tokenizer from '{path}' ({exc}). The directory needs tokenizer.json or "
            "tokenizer_config.json. Fix: set model.tokenizer_path, or point model.path at a full model directory."
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    path: str,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    modality: Modality | None = None,
):
    """The model of `path`, with the auto class of its modality (chosen from its config.json when not given)."""
    from safetensors import SafetensorError

    loader = modality or modality_type(model_config(path))
    try:
        model = loader.load_model(path, DTYPES[dtype], trust_remote_code)
    except SafetensorError as exc:  # a truncated or garbage weight file
        raise UserError(
            f"a weight file of '{path}' is damaged and cannot be read ({exc}). Fix: restore the model directory "
            "from its source (re-export the checkpoint with `postrl export`, or copy / download the model again)."
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a causal LM from '{path}' ({exc}). Fix: point model.path at a Hugging Face model "
            "directory (config.json + weights), e.g. the output of `postrl sft` or `postrl export`."
        ) from None
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


@dataclass
class Policy:
    """The model being trained, its tokenizer, where it was loaded from, and its modality adapter."""

    model: Any
    tokenizer: Any
    path: str  # resolved: a builtin: name becomes its built directory
    modality: Modality


def load_policy(model_cfg, dtype: str | None = None) -> Policy:
    """The policy of a `ModelConfig`; its modality adapter is chosen once, here, from config.json.

    `dtype` overrides `model.dtype` as the parameter dtype: a model that trains loads in float32 (its
    master weights, runtime.py) and computes in model.dtype under autocast / FSDP2 mixed precision.
    """
    path = resolve_model_path(model_cfg.path, model_cfg.tiny)
    processor_path = model_cfg.tokenizer_path or path
    modality = load_modality(model_config(path), processor_path, model_cfg.trust_remote_code)
    tokenizer = modality.prepare_tokenizer(load_tokenizer(processor_path, model_cfg.trust_remote_code), processor_path)
    model = load_model(path, dtype or model_cfg.dtype, model_cfg.trust_remote_code, model_cfg.gradient_checkpointing, modality)
    if model_cfg.freeze_vision_tower:
        modality.freeze_vision_tower(model)  # no-op for text-only models
    return Policy(model=model, tokenizer=tokenizer, path=path, modality=modality)


# --------------------------------------------------------------------------------------- log-probs


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: input_ids and attention_mask [B, P]."""
    P = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1
    return input_ids, attention_mask


def build_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pack prompt+response pairs: prompts left-padded to P, responses right-padded to T.

    Returns input_ids/attention_mask/position_ids [B, P+T] and response_mask [B, T].
    """
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, P]
    T = max(max(len(r) for r in responses), 1)
    response_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, r in enumerate(responses):
        if r:
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    multi_modal: list[dict | None] | None = None,
    modality: Modality | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the last `response_len` tokens under softmax(logits / temperature).

    Only the logits of response positions are computed (`logits_to_keep`), so one call materialises
    at most [B, T+1, V]; callers pass one micro-batch at a time. `multi_modal` holds each sequence's
    image inputs (VLMs), turned into forward arguments by `modality` (None: text); with images
    the model computes its own (mRoPE) positions.
    """
    from postrl.algorithms import entropy_from_logits

    T = response_len
    mm = (modality or TEXT).forward_kwargs(model, input_ids, multi_modal) if multi_modal is not None else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=None if mm else position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
        **mm,
    )
    logits_BTV = out.logits[:, :-1, :].float() / temperature  # position t predicts token t + 1
    targets_BT = input_ids[:, -T:]
    logp_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    entropy_BT = entropy_from_logits(logits_BTV) if with_entropy else None
    return logp_BT, entropy_BT

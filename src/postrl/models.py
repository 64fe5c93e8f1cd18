"""Models: load Hugging Face causal LMs and tokenizers, per-token log-probs, the tiny-model factory.

Any `AutoModelForCausalLM` directory loads the same way (a real Qwen2.5 config included). The tiny
factory builds a small Qwen2-architecture model and trains a byte-level BPE tokenizer (digits split
one by one, as Qwen's are) with a ChatML chat template, locally and deterministically from a seed,
and caches both on disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from postrl.errors import UserError
from postrl.utils import cache_dir

TINY_VERSION = 2
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 512,
    "seed": 0,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------ tiny factory


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from postrl.data.synthetic import tokenizer_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(seed=seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=4096,
        padding_side="left",
    )


def build_tiny_model(out_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Build (or reuse from the cache) a tiny Qwen2 model + tokenizer; returns its directory."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    unknown = set(overrides) - set(TINY_DEFAULTS)
    if unknown:
        raise UserError(
            f"model.tiny has unknown keys {sorted(unknown)}; valid: {', '.join(TINY_DEFAULTS)}."
        )
    spec = {**TINY_DEFAULTS, **overrides, "version": TINY_VERSION}
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir else cache_dir() / "models" / f"tiny-qwen2-{key}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = _train_tokenizer(spec["vocab_size"], spec["seed"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec["seed"])
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "postrl_tiny.json").write_text(json.dumps(spec, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_model_path(path: str, tiny: dict | None = None) -> str:
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name == "tiny-qwen2.5-vl":
            from postrl.vision import build_tiny_vlm

            return str(build_tiny_vlm(**(tiny or {})))
        if name != "tiny-qwen2":
            raise UserError(
                f"unknown built-in model '{path}'; the built-in models are 'builtin:tiny-qwen2' and 'builtin:tiny-qwen2.5-vl'."
            )
        return str(build_tiny_model(**(tiny or {})))
    return path


# ----------------------------------------------------------------------------------------- loading


def load_tokenizer(path: str, trust_remote_code: bool = False):
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
    from postrl.vision import load_vision_tokenizer

    return load_vision_tokenizer(path, tok, trust_remote_code) or tok  # VLMs: plus the image processor


def load_model(path: str, dtype: str = "float32", trust_remote_code: bool = False, gradient_checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    from postrl.vision import is_vlm_dir, load_vlm

    try:
        if is_vlm_dir(path):
            model = load_vlm(path, DTYPES[dtype], trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a causal LM from '{path}' ({exc}). Fix: point model.path at a Hugging Face model "
            "directory (config.json + weights), e.g. the output of `postrl sft` or `postrl export`."
        ) from None
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def load_policy(model_cfg) -> tuple[Any, Any, str]:
    """(model, tokenizer, resolved path) from a `ModelConfig`."""
    path = resolve_model_path(model_cfg.path, model_cfg.tiny)
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or path, model_cfg.trust_remote_code)
    model = load_model(path, model_cfg.dtype, model_cfg.trust_remote_code, model_cfg.gradient_checkpointing)
    if model_cfg.freeze_vision_tower:
        from postrl.vision import freeze_vision_tower

        freeze_vision_tower(model)  # no-op for text-only models
    return model, tokenizer, path


# --------------------------------------------------------------------------------------- log-probs


def build_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pack prompt+response pairs: prompts left-padded to P, responses right-padded to T.

    Returns input_ids/attention_mask/position_ids [B, P+T] and response_mask [B, T].
    """
    P = max(len(p) for p in prompts)
    T = max(max(len(r) for r in responses), 1)
    B = len(prompts)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, P - len(p) : P] = 1
        if r:
            input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, P : P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, P:].clone(),
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the last `response_len` tokens under softmax(logits / temperature).

    Only the logits of response positions are computed (`logits_to_keep`), so one call materialises
    at most [B, T+1, V]; callers pass one micro-batch at a time. `multi_modal` holds each sequence's
    image inputs (VLMs); with images the model computes its own (mRoPE) positions.
    """
    from postrl.algorithms import entropy_from_logits

    T = response_len
    mm: dict[str, torch.Tensor] = {}
    if multi_modal is not None:
        from postrl.vision import model_inputs

        mm = model_inputs(model, input_ids, multi_modal)
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

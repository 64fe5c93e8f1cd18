"""LoRA adapters (model.lora_rank > 0): peft's LoRA layers put into the Hugging Face model in place.

What changes when the policy trains through adapters (verl's lora_rank, TRL's peft_config):
- The base weights are frozen and held in model.dtype (bf16 on GPUs: no fp32 master copy, no
  gradients, no AdamW moments); only the adapters train, in fp32 like every trained weight.
- The KL reference is the policy with its adapters switched off (`disabled`): the base model,
  without a second copy of it. lora_B starts at zero, so the first step's KL is exactly 0.
- Weights leave merged: the vLLM sync, the checkpoint's model/ and best/model receive W + s B A in
  Hugging Face naming (`merged`), so export, evaluation and any HF tool read them as a plain model.
  The adapters themselves go to the checkpoint's adapter/ in peft's format (`save_adapter`), which
  resume reads back (`load_adapter`) and `PeftModel.from_pretrained(base, adapter_dir)` loads too.

The model stays its own Hugging Face class (peft's `inject_adapter_in_model`, not a PeftModel
wrapper): FSDP2's per-block sharding, the modality adapters and generate() see the same modules.
"""

from __future__ import annotations

import copy
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from postrl.errors import UserError

ADAPTER = "default"  # peft's adapter name; postrl trains one adapter
ADAPTER_DIR = "adapter"  # beside model/ in a checkpoint
_PEFT_PREFIX = "base_model.model."  # how peft names adapter weights on disk


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` (a plain HF model; unwrap DDP first) carries LoRA adapters."""
    return bool(getattr(model, "peft_config", None))


def apply(model: torch.nn.Module, rank: int, alpha: float, target_modules: str | list[str], exclude: str | None = None) -> None:
    """Put LoRA adapters of `rank` into `model`'s `target_modules` (peft names: 'all-linear' or module
    names), skipping modules whose names fully match the regex `exclude`, and freeze everything else.
    The adapters are cast to fp32; the base keeps its dtype."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, exclude_modules=exclude, lora_dropout=0.0, bias="none")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # also freezes all but the adapters
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UserError(
            f"model.target_modules {target_modules!r} names no module LoRA can adapt ({exc}). Fix: use all-linear, or "
            f"names of the model's linear layers ({', '.join(linear)})."
        ) from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def exclude_pattern(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    """A regex for `exclude` matching `module` (e.g. a frozen vision tower) and everything inside it."""
    if module is None:
        return None
    name = next(n for n, m in model.named_modules() if m is module)
    return rf"{re.escape(name)}(\..*)?"


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` computing as its base model (adapters off) for the block: the KL reference."""
    layers = _layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # makes the adapters trainable again, as they were


def merged(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], adapter: str = ADAPTER) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, full tensor) stream of a LoRA model's state dict as a plain model's: Hugging Face
    names, each weight that `adapter` adapts merged (W + scaling x B A, computed in fp32), every floating
    tensor in fp32 (a frozen bf16 base would round most of a small update away; the consumer casts).
    Other adapters' weights are left out (serve-tinker holds several in one model), and a module that
    `adapter` does not adapt gives its base weight.

    `named` comes in state-dict order: a module's base weight before its lora_A and lora_B, so at most
    one adapted module's tensors are held back at a time.
    """
    held: dict[str, dict[str, torch.Tensor]] = {}
    mine = re.compile(rf"(.+)\.lora_([AB])\.{re.escape(adapter)}\.weight")
    for name, tensor in named:
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.")
            if leaf != "weight" or adapter not in model.get_submodule(prefix).lora_A:  # a bias, or not this adapter's
                yield f"{prefix}.{leaf}", tensor.float()
                continue
            held.setdefault(prefix, {})["W"] = tensor
        elif m := mine.fullmatch(name):
            prefix = m.group(1)
            held.setdefault(prefix, {})[m.group(2)] = tensor
        elif ".lora_" in name:  # another adapter's
            continue
        else:
            yield name, tensor.float() if tensor.is_floating_point() else tensor
            continue
        parts = held[prefix]
        if len(parts) == 3:
            del held[prefix]
            scaling = model.get_submodule(prefix).scaling[adapter]
            yield f"{prefix}.weight", parts["W"].float() + scaling * (parts["B"].float() @ parts["A"].float())
    assert not held, f"adapted modules without all of base weight, lora_A and lora_B: {sorted(held)}"


def base_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict renamed for `model` with adapters: `q_proj.weight` -> `q_proj.base_layer.weight`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    out = {}
    for key, tensor in state.items():
        prefix, _, leaf = key.rpartition(".")
        out[f"{prefix}.base_layer.{leaf}" if prefix in adapted else key] = tensor
    return out


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters' (name, full tensor) stream (`full_state_dict(adapters_only=True)`) in peft's on-disk
    naming, copied to host memory."""
    suffix = f".{ADAPTER}.weight"
    return {_PEFT_PREFIX + name.removesuffix(suffix) + ".weight": t.detach().to("cpu", copy=True) for name, t in named}


def save_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], out_dir: Path, base_path: str) -> None:
    """adapter_config.json + adapter_model.safetensors in `out_dir` (peft's format; `state` from `adapter_state`)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.copy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base_path
    config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "adapter_model.safetensors"))


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors renamed for the model: `base_model.model.X.lora_A.weight` -> `X.lora_A.default.weight`."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    return {key.removeprefix(_PEFT_PREFIX).removesuffix(".weight") + f".{ADAPTER}.weight": t for key, t in state.items()}


def summary(model: torch.nn.Module) -> str:
    """One line: the rank, how many modules carry adapters, and the trainable share of the parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    layers = _layers(model)
    rank = layers[0].r[ADAPTER] if layers else 0
    return (
        f"LoRA rank {rank} on {len(layers)} modules: {trainable:,} trainable parameters "
        f"({100 * trainable / total:.2f}% of {total:,}); the base is frozen"
    )


def turn_off_best_weights(ck: Any, log: Callable[[str], None]) -> None:
    """checkpoint.back_off / end_with_best put the best weights back into the policy; with LoRA they are kept merged
    into the base, and the adapters cannot be put back from them, so both are turned off (keep_best still keeps them)."""
    if ck.back_off is not None or ck.end_with_best is not None:  # the recipes set end_with_best
        ck.back_off = ck.end_with_best = None
        log("[yellow]checkpoint.back_off / end_with_best are off with LoRA: the best weights are kept merged "
            "into the base, and the adapters cannot be put back from them (keep_best still keeps them).[/yellow]")

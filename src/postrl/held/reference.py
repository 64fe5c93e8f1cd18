"""The frozen KL reference: built once beside the policy, made ready for each log-prob pass."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

from postrl import distributed, lora
from postrl.models import Policy, cast_weights, load_model
from postrl.runtime import Runtime

if TYPE_CHECKING:
    from postrl.metrics import Timer


def build(cfg: Any, policy: Policy, runtime: Runtime) -> torch.nn.Module:
    """The frozen reference, in the compute dtype (it never trains: no fp32 master copy).

    checkpoint.ref_model_path names other weights (loaded with the policy's options), else it is a copy
    of the policy. With train.ref_offload it lives in host memory: FSDP2 keeps its shards there and
    copies each block to the device for its forward; otherwise it moves to the device only for its pass
    (`ready`). With LoRA adapters it is the policy itself, its adapters off for the pass.
    Call it before the policy is wrapped (FSDP2 shards the policy in place).
    """
    model, ref_path = policy.model, cfg.checkpoint.ref_model_path
    if lora.is_lora(model) and not ref_path:
        return model  # the base, without a copy
    return frozen(cfg, policy, runtime, ref_path)


def frozen(cfg: Any, policy: Policy, runtime: Runtime, path: str | None = None) -> torch.nn.Module:
    """A frozen model beside the policy, held as the reference is: `path`'s weights (loaded with the policy's
    options and modality), else a copy of the policy; in the compute dtype, on the device or (train.ref_offload)
    in host memory, wrapped by train.strategy. The on-policy distillation teacher is built here too."""
    model = policy.model
    if path:
        m, attn = cfg.model, model.config._attn_implementation
        ref = load_model(path, m.dtype, m.trust_remote_code, modality=policy.modality, attn_implementation=attn)
    else:
        ref = copy.deepcopy(model)
    home = torch.device("cpu") if cfg.train.ref_offload else runtime.device
    cast_weights(ref.to(home), runtime.dtype).eval().requires_grad_(False)  # buffers (RoPE) stay fp32
    return distributed.wrap_model(ref, cfg.train.strategy, compute_dtype=runtime.dtype, offload=cfg.train.ref_offload, device=runtime.device)


@contextmanager
def ready(ref_model: torch.nn.Module, policy_model: torch.nn.Module, runtime: Runtime, timer: "Timer") -> Iterator[torch.nn.Module]:
    """The reference, ready for its log-prob pass: on the device, or the policy with its LoRA adapters off."""
    if ref_model is policy_model:
        with lora.disabled(policy_model):
            yield policy_model
    else:  # its trips to and from host memory (train.ref_offload) are timed apart: timing/ref_onload, ref_offload
        placed = distributed.on_device(ref_model, runtime)
        with timer("ref_onload"):
            placed.__enter__()
        try:
            yield ref_model
        finally:
            with timer("ref_offload"):
                placed.__exit__(None, None, None)

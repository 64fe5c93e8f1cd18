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

Starting vLLM (environment checks, per-platform engine arguments, the CPU workarounds, error hints)
is vllm_platform.py's: anything that keeps vLLM from starting raises `VLLMUnavailable` with the
reason and the fix, so `rollout.engine: auto` falls back to HF.
The calling script needs an `if __name__ == "__main__":` guard (vLLM may spawn helpers).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from postrl import distributed
from postrl.config import RolloutConfig
from postrl.modality import TEXT, Modality
from postrl.moe import is_moe
from postrl.rollout.base import Completion, EngineCapabilities, SamplingParams, SamplingStopped, eos_token_ids
from postrl.rollout.vllm_platform import (
    MAX_TEMPERATURE,
    VLLMUnavailable,
    check_environment,
    engine_dtype,
    engine_kwargs,
    keep_rng,
    repack_cpu_moe,
    start_engine,
    start_router_capture,
    stop_router_capture,
)
from postrl.runtime import accelerator

__all__ = ["VLLMEngine", "VLLMUnavailable"]


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
        model_dir: build the engine from this directory's config.json, not the model's own (serve-tinker: a copy
            with untied embeddings, so an adapted unembedding has a head of its own).
    """

    name = "vllm"
    capabilities = EngineCapabilities(reports_logprobs=True, shares_trainer_model=False, can_sleep=True, continuous_batching=True)

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
        model_dir: str | None = None,
    ):
        self.cfg = cfg
        self.modality = modality or TEXT
        self.accelerator = acc = accelerator()
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.sleep_enabled = acc.is_device and cfg.enable_sleep_mode
        # Sampling runs in this process (in-process engine core, no tensor-parallel workers): see generate().
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0" and cfg.tensor_parallel_size == 1
        self._asleep: set[str] = set()  # "weights" / "kv_cache" while sleeping
        problem = found = None
        try:
            found = check_environment(model, tokenizer, cfg, self.modality, acc, model_dir)
        except VLLMUnavailable as exc:
            problem = exc
        # Building the engine is collective across ranks: all ranks use vLLM or none does.
        if distributed.all_reduce_max(int(problem is not None)):
            raise problem or VLLMUnavailable("vLLM cannot start on another rank (see its log); all ranks use hf.")
        vllm, model_dir, tokenizer_dir = found
        self.dtype = engine_dtype(dtype or next(model.parameters()).dtype, acc)
        kwargs = engine_kwargs(cfg, model, (model_dir, tokenizer_dir), self.dtype, seed, max_model_len, trust_remote_code, acc)
        self.llm = start_engine(vllm, kwargs, cfg)
        # Generation runs with the process's thread count (runtime.configure_threads decided it once).
        self.rollout_threads = torch.get_num_threads()
        self._sampling_cls = vllm.SamplingParams
        self._final_only = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        self.moe = is_moe(model)
        self.sync_weights(model)

    # ------------------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None
    ) -> list[Completion]:
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
        with self._rollout_threads(), keep_rng():
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
                        logprobs=_sampled_logprobs(c.logprobs, tokens, params.top_logprobs),
                        top_logprobs=_top_logprobs(c.logprobs, params.top_logprobs) if params.top_logprobs else None,
                    )
                )
        return completions

    @torch.no_grad()
    def generate_continuing(
        self, requests: list[tuple[Any, list[int], SamplingParams]],
        on_finish: Callable[[list[tuple[Any, Completion]]], list[tuple[Any, list[int], SamplingParams]]],
        seed: int | None = None, stop: threading.Event | None = None,
    ) -> None:  # fmt: skip
        """Continuous batching across turns (the agent loop): `requests` are (key, prompt ids, params) with
        n = 1. After every engine step, `on_finish` gets the (key, completion) of each request that finished
        in it and returns the follow-up requests, which join the running batch at the next step, so no
        sequence waits for the slowest one of a turn; their prompt (the one before plus its completion)
        reuses its KV from the prefix cache. Runs until no request is left. `seed`: one seed for the whole
        run (the engine in this process), else a derived seed per request; None: each request's own
        `params.seed` (the endpoint's, agents/endpoint/scheduler.py: one that does not depend on when the request
        came or what else the batch holds; vLLM then gives that request a generator of its own). `stop`: once
        set, the running requests are aborted at the next engine step and `SamplingStopped` is raised."""
        if self._asleep:
            self.wake_up()
        engine, keys, counter = self.llm.llm_engine, {}, 0

        def add(batch: list[tuple[Any, list[int], SamplingParams]]) -> None:
            nonlocal counter
            for key, ids, params in batch:
                assert params.greedy or params.n == 1, "generate_continuing: one sample per request"
                if not params.greedy and params.temperature > MAX_TEMPERATURE:
                    raise ValueError(f"vLLM samples at temperatures up to {MAX_TEMPERATURE}, got {params.temperature}; use the hf engine.")
                request_seed = params.seed if seed is None else None if self.in_process else (seed + 7919 * counter) % 2**31
                sampling = self._vllm_params(params, 1, request_seed)
                sampling.output_kind = self._final_only
                request_id = f"postrl-{counter}"
                counter += 1
                keys[request_id] = key
                engine.add_request(request_id, {"prompt_token_ids": list(ids)}, sampling)

        with self._rollout_threads(), keep_rng():
            if seed is not None and self.in_process:
                torch.manual_seed(seed)
            try:
                add(requests)
                while engine.has_unfinished_requests():
                    if stop is not None and stop.is_set():
                        raise SamplingStopped(f"sampling stopped with {len(keys)} requests unfinished")
                    done = []
                    for out in engine.step():
                        if not out.finished:
                            continue
                        (c,) = out.outputs
                        if c.finish_reason not in ("stop", "length"):
                            raise RuntimeError(f"vLLM finished a request with reason {c.finish_reason!r}")
                        tokens = list(c.token_ids)
                        completion = Completion(prompt_index=0, token_ids=tokens, finished=c.finish_reason == "stop",
                                                logprobs=_sampled_logprobs(c.logprobs, tokens))  # fmt: skip
                        done.append((keys.pop(out.request_id), completion))
                    if done:
                        add(on_finish(done))
            finally:
                if keys:  # an error part-way: the next call must not find this call's requests running
                    engine.abort_request(list(keys))

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
            logprobs=params.top_logprobs,  # the sampled token's log-prob (and the top-k's, for the doctor)
            flat_logprobs=True,  # a few flat lists per request instead of a dict per token
            detokenize=False,  # the trainer wants ids; skips per-token decoding
            **sampling,
        )

    @contextlib.contextmanager
    def _rollout_threads(self) -> Iterator[None]:
        if self.accelerator.is_device:
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
        self.load_weights(_hf_weights(model, self.dtype))

    @torch.no_grad()
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream a whole model's (Hugging Face name, tensor) pairs into vLLM (no disk) and drop cached prefixes."""
        if "weights" in self._asleep:
            self.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.moe and not self.accelerator.is_device:
            self.llm.collective_rpc(repack_cpu_moe)  # vLLM 0.32 leaves CPU expert weights unpacked after a reload
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of token_ids[1:] under the engine's current weights (temperature 1): the sync guard's probe."""
        if self._asleep:
            self.wake_up()
        params = self._sampling_cls(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        with self._rollout_threads(), keep_rng():
            out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], sampling_params=params, use_tqdm=False)[0]
        return [float(step[tok].logprob) for step, tok in zip(out.prompt_logprobs[1:], token_ids[1:])]

    @torch.no_grad()
    def probe_routing(self, token_ids: list[int], top_k: int) -> torch.Tensor | None:
        """MoE: the experts [L, N, K] vLLM's routers pick for each token of `token_ids` (the top-k of its router
        logits, captured by forward hooks in the prefill of one scoring request); None for a dense model."""
        if not self.moe:
            return None
        if self._asleep:
            self.wake_up()
        self.llm.reset_prefix_cache()  # every probe token goes through the routers
        self.llm.collective_rpc(start_router_capture)
        params = self._sampling_cls(max_tokens=1, temperature=1.0, detokenize=False, seed=0)
        try:
            with self._rollout_threads(), keep_rng():
                self.llm.generate([{"prompt_token_ids": list(token_ids)}], sampling_params=params, use_tqdm=False)
        finally:
            calls = self.llm.collective_rpc(stop_router_capture)[0]  # tensor-parallel ranks agree: rank 0's
        prefill = [c for c in calls if c.shape[0] == len(token_ids)]  # the decode step's 1-token calls left out
        return torch.stack([torch.topk(c, top_k, dim=-1).indices for c in prefill])

    # ------------------------------------------------------------------------------ sleep mode

    def set_threads(self, n: int) -> None:
        """The CPU threads of the next calls (the async worker's share, lent or borrowed; _rollout_threads)."""
        self.rollout_threads = n

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def sleep(self) -> None:
        """Free accelerator memory for the policy update (with enable_sleep_mode; else a no-op): the
        weights go to host memory and the KV cache is dropped (vLLM's sleep level 1)."""
        if not self.sleep_enabled or self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}
        self.accelerator.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what `sleep` freed: `["weights"]` before a sync, everything before generating."""
        if not self._asleep:
            return
        wanted = set(tags) if tags else set(self._asleep)
        # vLLM allocates through its own pool: blocks the update left in PyTorch's cache are no use to it.
        self.accelerator.empty_cache()
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


def _hf_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in Hugging Face checkpoint naming, one full tensor at a time (`full_state_dict`),
    cast to the engine's `dtype` (fp32 masters leave as bf16: half the bytes to copy).

    With tied embeddings `lm_head.weight` must still be sent: vLLM reloads layer by layer, and on CPU
    the LM head keeps its own packed copy of the embedding, which is only rebuilt when the layer
    receives its weight (without it, logits use the stale matrix).
    """
    names = set()
    for name, tensor in distributed.full_state_dict(model):  # FSDP2 shards gathered: a collective, every rank syncs
        names.add(name)
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and "lm_head.weight" not in names and model.get_input_embeddings() is not None:
        embedding = model.get_input_embeddings().weight
        yield "lm_head.weight", (embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding).detach().to(dtype)


def _sampled_logprobs(logprobs: Any, tokens: list[int], top: int = 0) -> list[float] | None:
    if logprobs is None:
        return None
    if top and hasattr(logprobs, "start_indices"):  # each position: the sampled token first, then the top-k
        assert [logprobs.token_ids[i] for i in logprobs.start_indices] == tokens, "vLLM lists the sampled token first"
        return [float(logprobs.logprobs[i]) for i in logprobs.start_indices]
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs; with logprobs=0 one entry per position
        assert list(logprobs.token_ids) == tokens, "vLLM returned log-probs of the sampled tokens only"
        return [float(x) for x in logprobs.logprobs]
    assert len(logprobs) == len(tokens), "vLLM returned one log-prob entry per sampled token"
    return [float(step[tok].logprob) for step, tok in zip(logprobs, tokens)]


def _top_logprobs(logprobs: Any, k: int) -> list[tuple[list[int], list[float]]]:
    """The k most likely (ids, log-probs) of each position (ranks 1..k), from vLLM's logprobs=k output."""
    out = []
    for position in logprobs:  # {token id: Logprob} per position, the sampled token among them
        ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in position.items() if lp.rank is not None and lp.rank <= k)
        out.append(([tok for _, tok, _ in ranked], [float(lp) for _, _, lp in ranked]))
    return out


def _request_seeds(seed: int | None, n_prompts: int) -> list[int] | None:
    """One vLLM seed per prompt, derived from the call's seed (vLLM gives sample k seed + k)."""
    if seed is None:
        return None
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(n_prompts, dtype=np.uint32) >> 1]

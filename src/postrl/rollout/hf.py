"""Rollout with transformers `generate` (KV cache, batched, left-padded prompts).

The engine shares the trainer's model object (colocated), so `sync_weights` has nothing to copy. It
generates on the model's device, in the run's compute dtype (`runtime.autocast()`: bf16 on GPU while
the trained weights stay fp32).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import torch

from postrl.modality import TEXT, Modality
from postrl.models import left_pad
from postrl.rollout.base import Completion, EngineCapabilities, SamplingParams, SamplingStopped, eos_token_ids
from postrl.runtime import accelerator

if TYPE_CHECKING:
    from postrl.runtime import Runtime


class HFEngine:
    name = "hf"
    capabilities = EngineCapabilities(reports_logprobs=False, shares_trainer_model=True, can_sleep=False)

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, max_batch_sequences: int = 512, modality: Modality | None = None,
        runtime: "Runtime | None" = None, stop: threading.Event | None = None,
    ):  # fmt: skip
        self.model = model
        self.stop = stop  # once set, generation ends at the next token and SamplingStopped is raised (serve-tinker)
        self.autocast = runtime.autocast if runtime is not None else contextlib.nullcontext
        self.modality = modality or TEXT
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.suppress_ids = self.modality.suppress_token_ids() or None  # VLMs: never sample image/video placeholders
        self.max_batch_sequences = max_batch_sequences  # CPU threads: the process's (runtime.configure_threads)

    def sync_weights(self, model: torch.nn.Module) -> None:
        assert model is self.model, "HFEngine generates with the trainer's own model object"

    def probe_logprobs(self, token_ids: list[int]) -> None:
        """None: this engine generates with the trainer's own model, so a weight sync cannot be missed."""
        return None

    def probe_routing(self, token_ids: list[int], top_k: int) -> None:
        """None: the trainer's own routers route the rollout, so there is no mismatch to measure."""
        return None

    def generate_continuing(self, requests, on_finish, seed=None) -> None:
        raise NotImplementedError("the hf engine has no continuous batching (capabilities.continuous_batching)")

    def set_threads(self, n: int) -> None:
        """Nothing to set: generation runs on the process's threads."""

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def sleep(self) -> None:
        """Nothing to free: the engine is the trainer's model."""

    def close(self) -> None:
        """Nothing to release."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None) -> list[Completion]:
        from transformers import GenerationConfig

        n = 1 if params.greedy else params.n
        gen_cfg = GenerationConfig(
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=params.top_k if (params.top_k > 0 and not params.greedy) else 0,
            max_new_tokens=params.max_tokens,
            num_return_sequences=n,
            eos_token_id=self.eos_ids + [t for t in params.stop_token_ids if t not in self.eos_ids],
            pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        out: list[Completion] = []
        chunk = max(1, self.max_batch_sequences // n)
        device = next(self.model.parameters()).device
        # A seeded call leaves the run's RNG streams as they were (the device's too: sampling draws there).
        with accelerator(device.type).fork_rng(), self.autocast():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(prompts), chunk):
                batch = prompts[start : start + chunk]
                mm = multi_modal[start : start + chunk] if multi_modal else None
                out.extend(self._generate_chunk(batch, start, n, gen_cfg, mm, params.stop_token_ids))
        self.model.train(was_training)
        return out

    def _generate_chunk(self, batch, offset, n, gen_cfg, multi_modal, stop_ids=()) -> list[Completion]:
        input_ids, attention_mask = left_pad(batch, self.pad_id)  # [len(batch), P]
        device = next(self.model.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        P = input_ids.shape[1]
        extra = self.modality.forward_kwargs(self.model, input_ids, multi_modal) if multi_modal else {}  # VLMs: images
        if self.stop is not None:
            from transformers import StoppingCriteriaList

            stop = self.stop
            extra["stopping_criteria"] = StoppingCriteriaList([lambda input_ids, scores, **_: torch.full((input_ids.shape[0],), stop.is_set(), device=input_ids.device)])
        seqs = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg, **extra
        )  # [len(batch) * n, P + new]
        if self.stop is not None and self.stop.is_set():
            raise SamplingStopped(f"sampling stopped after {seqs.shape[1] - P} of at most {gen_cfg.max_new_tokens} tokens")
        completions = []
        eos = set(self.eos_ids) | set(stop_ids)
        for row in range(seqs.shape[0]):
            tokens = seqs[row, P:].tolist()
            finished = False
            for t, tok in enumerate(tokens):
                if tok in eos:
                    tokens, finished = tokens[: t + 1], True
                    break
            completions.append(Completion(prompt_index=offset + row // n, token_ids=tokens, finished=finished))
        return completions


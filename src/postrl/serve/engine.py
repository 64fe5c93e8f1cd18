"""One base model and the LoRA adapters on it: the compute behind the Tinker API.

Every training client is a peft adapter of its own injected into the one base model (named by its model id),
with its own AdamW (torch's, as actor.py's) over that adapter's weights only: a forward-backward activates its
adapter alone, so gradients land on it and nowhere else, and the base stays frozen. A sampler is a frozen copy
of an adapter taken at `save_weights_for_sampler` (its own adapter, never updated again), so a sampling client
keeps answering from the weights it was given however the training client moves on.

Log-probs are the trainer's (`algorithms.token_logprobs` on the model's logits); the losses are postrl's
(serve/losses.py). Sampling runs where `rollout.engine` says, as in the trainer: vLLM where it starts (auto),
else HF `generate` on the served model itself (rollout/hf.py). vLLM holds one set of weights, the base with
one sampler's adapter merged in (`lora.merged`), loaded again only when a request names another sampler; it is
built from a copy of the model's config with untied embeddings, so an adapted unembedding gets a head of its
own. Its log-probs are the distribution each token was drawn from (temperature-scaled), which the trainer's
function gives too up to float rounding; with top_p / top_k masking on (or from HF generate) they are computed
afterwards by the trainer's function, so `sample` reports what training will compute.
A stopping server sets `stopping`: a running sample ends at its next token (`SamplingStopped`).
Only the engine thread (serve/app.py) calls into an Engine: it holds no locks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from postrl.algorithms import token_logprobs
from postrl.errors import UserError
from postrl.runtime import accelerator
from postrl.serve.wire import FwdBwd
from postrl.serve.losses import get_loss

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_UNEMBED = ("lm_head",)
NO_ADAPTER = "__base__"  # an adapter name no module has: the base model alone


@dataclass
class Client:
    """A training client: its adapter's name in the model, its LoRA settings, its optimizer and its step count."""

    adapter: str
    lora: dict[str, Any]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    steps: int = 0


@dataclass
class Sampler:
    """Frozen weights to sample from: an adapter copied at save_weights_for_sampler, or the base model alone."""

    adapter: str  # NO_ADAPTER: the base model
    path: str | None
    lora: dict[str, Any] = field(default_factory=dict)
    released: bool = False  # its adapter was dropped to bound memory (a named one comes back from disk)


class Engine:
    """The base model at `path` (a directory, hub id or builtin:NAME), served under `name`."""

    def __init__(self, path: str, name: str, state_dir: str | Path, dtype: str = "float32", lora_alpha: float = 32.0, max_context: int = 32768,
                 tiny: dict | None = None, max_samplers: int = 32, rollout: Any = None, log: Any = None, micro_tokens: int = 4096):
        from postrl.models import load_model, load_tokenizer, resolve_model_path

        self.name, self.lora_alpha, self.max_context = name, lora_alpha, max_context
        self.state_dir = Path(state_dir)
        self.max_samplers = max_samplers  # sampler adapters held at once; the least recently used beyond are released
        self.held: dict[str, Sampler] = {}  # adapter -> sampler, least recently used first
        self.path = resolve_model_path(path, tiny)
        self.tokenizer = load_tokenizer(self.path)
        # one device for the whole server: this machine's accelerator where there is one (CUDA or NPU; adapters and
        # AdamW state live beside it), else the CPU
        self.device = torch.device(accelerator().kind)
        self.model = load_model(self.path, dtype).to(self.device)
        self.model.requires_grad_(False)
        self.max_context = min(max_context, getattr(self.model.config, "max_position_embeddings", None) or max_context)
        self.model.eval()  # no dropout: the same batch gives the same gradients
        self.linear = {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, Sampler] = {}  # sampling session id -> sampler
        self.paths: dict[str, Sampler] = {}  # tinker:// sampler path -> sampler
        self._ids = itertools.count()
        self.stopping = threading.Event()  # the server is stopping: a running sample ends at its next token
        self._build_dir: str | None = None
        self.vllm = self._start_vllm(rollout, log)  # None: HF generate on the served model
        self.vllm_holds = NO_ADAPTER  # the sampler adapter whose weights vLLM holds (merged into the base)
        self.micro_tokens = self._fit(micro_tokens, log)  # tokens a forward holds the logits and activations of

    def _start_vllm(self, rollout: Any, log: Any) -> Any:
        """vLLM for sampling where `rollout.engine` allows it (auto: where it starts, else None and HF generate)."""
        if rollout is None or rollout.engine == "hf":
            return None
        import json
        import tempfile

        from postrl.rollout import make_engine

        config = json.loads((Path(self.path) / "config.json").read_text())
        if config.get("tie_word_embeddings", getattr(self.model.config, "tie_word_embeddings", False)):
            self._build_dir = tempfile.mkdtemp(prefix="postrl-serve-vllm-")  # config.json only: weights come from the model
            (Path(self._build_dir) / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
            if (Path(self.path) / "generation_config.json").is_file():
                (Path(self._build_dir) / "generation_config.json").write_text((Path(self.path) / "generation_config.json").read_text())
        engine = make_engine(rollout, self.model, self.tokenizer, log=log, max_model_len=self.max_context, model_dir=self._build_dir)
        return engine if engine.name == "vllm" else None

    def _fit(self, budget: int, log: Any) -> int:
        """`budget` tokens a forward, fewer on the CPU where that many would not fit half the free memory."""
        from postrl.memory import shape_from_config, tokens_that_fit
        from postrl.utils import host_memory_available

        shape, free = shape_from_config(self.model.config.to_dict()), host_memory_available()
        fit = tokens_that_fit(shape, free) if self.device.type == "cpu" and shape is not None and free is not None else budget
        if fit >= budget:
            return budget
        if log is not None:
            log(f"forward_backward runs in forwards of at most {fit} tokens (train.max_token_len_per_device {budget} would not fit "
                f"half of the {free / 2**30:.1f} GiB free)")
        return fit

    def close(self) -> None:
        import shutil

        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None
        if self._build_dir is not None:
            shutil.rmtree(self._build_dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------ adapters
    def _targets(self, lora: dict[str, Any]) -> list[str]:
        names = self.linear
        wanted = (_ATTN if lora.get("train_attn", True) else ()) + (_MLP if lora.get("train_mlp", True) else ())
        wanted += _UNEMBED if lora.get("train_unembed", True) else ()
        targets = [t for t in wanted if t in names]
        if not targets:
            raise UserError(f"lora_config trains no layer of this model (its linear layers: {', '.join(sorted(names))})")
        return targets

    def _inject(self, adapter: str, lora: dict[str, Any]) -> list[torch.nn.Parameter]:
        import warnings

        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=lora["rank"], lora_alpha=self.lora_alpha, target_modules=self._targets(lora), lora_dropout=0.0, bias="none")
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.simplefilter("ignore")  # peft: "multiple adapters" and "tied embeddings" are what this server does
            torch.manual_seed(lora.get("seed") or 0)
            inject_adapter_in_model(config, self.model, adapter_name=adapter)
        params = [p for n, p in self.model.named_parameters() if f".{adapter}." in n]
        for p in params:
            p.data = p.data.float()
        self._activate(NO_ADAPTER)
        return params

    def _activate(self, adapter: str) -> None:
        """Route every forward through `adapter` alone (trainable); every other adapter frozen and unused."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in self.model.modules():
            if isinstance(m, BaseTunerLayer):
                m.set_adapter(adapter)

    def create_client(self, model_id: str, base_model: str | None, lora: dict[str, Any]) -> str:
        """A new training client `model_id` (the SDK's `<session>:train:<n>`): a fresh adapter and optimizer."""
        if base_model not in (None, self.name):
            raise UserError(f"base_model '{base_model}' is not served here; this server trains '{self.name}'")
        if not 1 <= lora["rank"] <= 512:
            raise UserError(f"lora_config.rank must be in 1..512, got {lora['rank']}")
        if model_id in self.clients:
            raise UserError(f"model_id '{model_id}' exists already")
        adapter = f"t{next(self._ids)}"
        params = self._inject(adapter, lora)
        self.clients[model_id] = Client(adapter, dict(lora), params, torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95)))
        return model_id

    def client(self, model_id: str) -> Client:
        if model_id not in self.clients:
            raise UserError(f"unknown model_id '{model_id}': never created here (a restarted server holds no clients; load a saved state)")
        return self.clients[model_id]

    # ------------------------------------------------------------------------------------ training
    def _logprobs(self, inputs: list[list[int]], targets: list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, the log-probs of `targets[i][t]` after `inputs[i][: t + 1]`: one forward over the sequences
        right-padded (positions stay 0..len-1), the trainer's `token_logprobs` on its logits."""
        T = max(len(x) for x in inputs)
        tokens_BT = torch.zeros(len(inputs), T, dtype=torch.long)
        targets_BT, mask_BT = torch.zeros_like(tokens_BT), torch.zeros_like(tokens_BT)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            tokens_BT[i, : len(x)], targets_BT[i, : len(x)], mask_BT[i, : len(x)] = torch.tensor(x), y.long(), 1
        tokens_BT, targets_BT, mask_BT = tokens_BT.to(self.device), targets_BT.to(self.device), mask_BT.to(self.device)
        logits_BTV = self.model(input_ids=tokens_BT, attention_mask=mask_BT).logits
        B, T, V = logits_BTV.shape
        logp_N, _ = token_logprobs(logits_BTV.reshape(B * T, V), targets_BT.reshape(-1), temperature)
        logp_BT = logp_N.view(B, T)
        return [logp_BT[i, : len(x)] for i, x in enumerate(inputs)]

    def forward_backward(self, req: FwdBwd) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Tinker's forward_backward: the loss summed over the datums; gradients add to the adapter's until optim_step."""
        client = self.client(req.model_id)
        loss_fn, needs = get_loss(req.loss_fn)
        if not req.data:
            raise UserError("forward_backward needs at least one datum")
        for i, d in enumerate(req.data):
            for key in ("target_tokens",) + needs:
                if key not in d.inputs:
                    raise UserError(f"datum {i}: loss_fn '{req.loss_fn}' needs loss_fn_inputs['{key}']")
                if d.inputs[key].shape != (len(d.tokens),):
                    raise UserError(f"datum {i}: loss_fn_inputs['{key}'] has shape {list(d.inputs[key].shape)}, the input has {len(d.tokens)} tokens")
            if not d.tokens:
                raise UserError(f"datum {i} has no tokens")
            self._check_tokens(d.tokens, f"datum {i}")
            self._check_tokens(d.inputs["target_tokens"].tolist(), f"datum {i}'s target_tokens")
        self._activate(client.adapter)
        logp: list[torch.Tensor] = [torch.empty(0)] * len(req.data)
        total = 0.0
        try:
            with torch.no_grad() if req.forward_only else contextlib.nullcontext():
                for part in self._parts([d.tokens for d in req.data]):  # gradients add up over the parts
                    chunk = [req.data[i] for i in part]
                    chunk_logp = self._logprobs([d.tokens for d in chunk], [d.inputs["target_tokens"] for d in chunk])
                    inputs = [{k: v.to(self.device) for k, v in d.inputs.items()} for d in chunk]
                    loss = torch.stack([loss_fn(lp, x, req.config) for lp, x in zip(chunk_logp, inputs)]).sum()
                    if not req.forward_only:
                        loss.backward()
                    total += float(loss.detach())
                    for i, lp in zip(part, chunk_logp):
                        logp[i] = lp.detach()
        finally:
            self._activate(NO_ADAPTER)
        return [{"logprobs": lp} for lp in logp], {"loss:sum": total}

    def _parts(self, seqs: list[list[int]]) -> list[list[int]]:
        """Positions of `seqs` in forwards of about `micro_tokens` tokens each (a longer sequence alone): the
        logits of a whole forward_backward at once would take B x T x vocab floats (tens of GiB for an rl loop's batch)."""
        from postrl.partition import token_budget_micro_batches

        return token_budget_micro_batches([len(s) for s in seqs], self.micro_tokens, sync_ranks=False)

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step of the client's adapter with this step's hyperparameters, then its gradients cleared."""
        client = self.client(model_id)
        for group in client.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"], weight_decay=adam["weight_decay"])
        grads = [p for p in client.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else math.inf) if grads else torch.zeros(())
        if not torch.isfinite(norm):
            client.optimizer.zero_grad(set_to_none=True)
            raise UserError(f"the gradient norm is {float(norm)}: this step was skipped and the gradients cleared")
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"grad_norm:mean": float(norm)}

    # ------------------------------------------------------------------------------------ sampling
    def save_for_sampler(self, model_id: str, name: str | None) -> tuple[str | None, str]:
        """A frozen copy of the client's adapter; returns (its tinker:// path when named, a sampling session id)."""
        client = self.client(model_id)
        adapter = f"s{next(self._ids)}"
        copies = self._inject(adapter, client.lora)
        for dst, src in zip(copies, client.params):
            dst.data.copy_(src.data)
            dst.requires_grad_(False)
        path = f"tinker://{model_id}/sampler_weights/{name}" if name else None
        sampler = Sampler(adapter, path, client.lora)
        if path:
            self._write(path, client, optimizer=False)
            self.paths[path] = sampler
        self._hold(sampler)
        return path, self.open_session(sampler)

    def _hold(self, sampler: Sampler) -> None:
        """Mark `sampler` most recently used; release the least recently used adapters beyond `max_samplers`."""
        from peft.tuners.tuners_utils import delete_adapter

        self.held.pop(sampler.adapter, None)
        self.held[sampler.adapter] = sampler
        while len(self.held) > self.max_samplers:
            adapter, old = next(iter(self.held.items()))
            del self.held[adapter]
            delete_adapter(self.model, adapter, prefix="lora_")
            self.model.peft_config.pop(adapter, None)
            old.released = True

    def open_session(self, sampler: Sampler) -> str:
        session = f"sampler-{next(self._ids)}"
        self.samplers[session] = sampler
        return session

    def sampler_for(self, base_model: str | None, model_path: str | None) -> Sampler:
        if model_path:
            if model_path not in self.paths or self.paths[model_path].released:  # saved earlier, or released: from disk
                self.paths[model_path] = self._load_sampler(model_path)
            self._hold(self.paths[model_path])
            return self.paths[model_path]
        if base_model != self.name:
            raise UserError(f"base_model '{base_model}' is not served here; this server samples '{self.name}'")
        return Sampler(NO_ADAPTER, None)

    def _load_sampler(self, path: str) -> Sampler:
        saved = self._read(path, "sampler_weights")
        adapter = f"s{next(self._ids)}"
        for p, value in zip(self._inject(adapter, saved["lora"]), saved["weights"]):
            p.data.copy_(value)
            p.requires_grad_(False)
        sampler = Sampler(adapter, path, saved["lora"])
        self._hold(sampler)
        return sampler

    def session(self, session_id: str) -> Sampler:
        if session_id not in self.samplers:
            raise UserError(f"unknown sampling_session_id '{session_id}'")
        sampler = self.samplers[session_id]
        if sampler.released:
            if sampler.path is None:
                raise UserError(
                    f"sampling session '{session_id}' was released: the server holds the {self.max_samplers} most recently used "
                    "samplers (serve-tinker --max-samplers). Fix: save_weights_and_get_sampling_client again, or save with a name."
                )
            sampler = self.samplers[session_id] = self.sampler_for(None, sampler.path)
        if sampler.adapter != NO_ADAPTER:
            self._hold(sampler)
        return sampler

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        V = self.model.get_input_embeddings().num_embeddings
        if any(t < 0 or t >= V for t in tokens):
            raise UserError(f"{what} holds token ids outside the vocabulary [0, {V})")
        if len(tokens) > self.max_context:
            raise UserError(f"{what} has {len(tokens)} tokens, over the model's {self.max_context}")

    @torch.no_grad()
    def sample(self, sampler: Sampler, prompt: list[int], n: int, params: dict[str, Any], prompt_logprobs: bool):
        """`n` completions of `prompt` with the sampler's weights, each with the trainer's log-probs of its tokens."""
        from postrl.rollout.base import SamplingParams

        self._check_tokens(prompt, "the prompt")
        if not prompt:
            raise UserError("the prompt has no tokens")
        stop_ids, stop_texts = self._stops(params.get("stop"))
        temperature = float(params.get("temperature", 1.0))
        max_tokens = params.get("max_tokens") or 16
        if len(prompt) + max_tokens > self.max_context:
            raise UserError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is over the model's {self.max_context}")
        sp = SamplingParams(
            temperature=temperature if temperature > 0 else 1.0, top_p=params.get("top_p", 1.0), top_k=params.get("top_k", -1),
            max_tokens=max_tokens, n=n, seed=params.get("seed"), greedy=temperature <= 0, stop_token_ids=tuple(stop_ids),
        )  # fmt: skip
        completions = self._generate(sampler, prompt, sp)
        completions = completions * n if sp.greedy else completions  # argmax: one completion, n times
        completions = [self._cut(c, stop_texts) for c in completions]
        # the engine's log-probs where they are the trainer's (vLLM, no masking), else the trainer's function's
        if any(c.logprobs is None for c in completions) or sp.top_p < 1 or sp.top_k > 0:
            full = [prompt + c.token_ids for c in completions]
            logp = self._scored(sampler, full, sp.temperature)
            completions = [dataclasses.replace(c, logprobs=lp[len(prompt) - 1 :].tolist()) for c, lp in zip(completions, logp)]
        prompt_lp = None
        if prompt_logprobs:  # the first token has none
            prompt_lp = [math.nan] + (self._scored(sampler, [prompt], sp.temperature)[0].tolist() if len(prompt) > 1 else [])
        return [(c.token_ids, c.logprobs, c.finished) for c in completions], prompt_lp

    def _scored(self, sampler: Sampler, seqs: list[list[int]], temperature: float) -> list[torch.Tensor]:
        """The trainer's log-prob of every token of each sequence after the first, with the sampler's weights."""
        logp: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        self._activate(sampler.adapter)
        try:
            for part in self._parts(seqs):
                lps = self._logprobs([seqs[i][:-1] for i in part], [torch.tensor(seqs[i][1:]) for i in part], temperature)
                for i, lp in zip(part, lps):
                    logp[i] = lp
        finally:
            self._activate(NO_ADAPTER)
        return logp

    def _generate(self, sampler: Sampler, prompt: list[int], sp: Any) -> list[Any]:
        """The completions of `prompt` with the sampler's weights: vLLM's (its weights swapped in when another
        sampler's were there), else HF generate with the sampler's adapter active."""
        from postrl import lora
        from postrl.rollout.hf import HFEngine

        if self.vllm is None:
            self._activate(sampler.adapter)
            try:
                return HFEngine(self.model, self.tokenizer, stop=self.stopping).generate([prompt], sp)
            finally:
                self._activate(NO_ADAPTER)
        if self.vllm_holds != sampler.adapter:
            self.vllm_holds = None  # a failed load leaves weights of no known sampler
            merged = lora.merged(self.model, self.model.state_dict().items(), sampler.adapter)
            self.vllm.load_weights((name, t.to(self.vllm.dtype)) for name, t in merged)
            self.vllm_holds = sampler.adapter
        done: list[tuple[int, Any]] = []
        requests = [(k, prompt, dataclasses.replace(sp, n=1)) for k in range(1 if sp.greedy else sp.n)]
        self.vllm.generate_continuing(requests, lambda finished: done.extend(finished) or [], seed=sp.seed, stop=self.stopping)
        return [c for _, c in sorted(done, key=lambda kc: kc[0])]

    def _stops(self, stop: Any) -> tuple[list[int], list[str]]:
        """Tinker's `stop` (token ids, or strings) as (ids that end a completion, longer strings cut afterwards)."""
        if stop is None:
            return [], []
        ids, texts = [], []
        for s in [stop] if isinstance(stop, str) else list(stop):
            if isinstance(s, int):
                ids.append(s)
            elif isinstance(s, str) and s:
                encoded = self.tokenizer.encode(s, add_special_tokens=False)
                ids.append(encoded[0]) if len(encoded) == 1 else texts.append(s)
        if len(texts) > 16 or any(len(t) > 256 for t in texts):
            raise UserError("at most 16 stop strings of at most 256 characters each")
        return ids, texts

    def _cut(self, c: Any, texts: list[str]) -> Any:
        """The completion up to and including the first token whose text completes a stop string: generation ran on
        to max_tokens (the engines stop on token ids only), so the rest is dropped here."""
        if not texts:
            return c
        for k in range(1, len(c.token_ids) + 1):
            text = self.tokenizer.decode(c.token_ids[:k])
            if any(t in text for t in texts):
                return dataclasses.replace(c, token_ids=c.token_ids[:k], finished=True, logprobs=c.logprobs and c.logprobs[:k])
        return c

    # ------------------------------------------------------------------------------------ checkpoints
    def _dir(self, path: str, kind: str) -> Path:
        """tinker://<model_id>/<kind>/<name> -> <state_dir>/<model_id>/<kind>/<name>, refusing anything else."""
        import re

        m = re.fullmatch(r"tinker://([A-Za-z0-9_.:-]{1,200})/(weights|sampler_weights)/([A-Za-z0-9_.-]{1,200})", path or "")
        if m is None or m.group(2) != kind or ".." in path:
            raise UserError(f"'{path}' is not a tinker://<model_id>/{kind}/<name> path of this server")
        return self.state_dir / m.group(1).replace(":", "_") / kind / m.group(3)

    def _write(self, path: str, client: Client, optimizer: bool) -> None:
        """The client's adapter (safetensors), its LoRA settings and step count, and with `optimizer` AdamW's state,
        written to a scratch directory and renamed into place (checkpoint/files.py: a crash leaves no half copy)."""
        import json
        import shutil

        from safetensors.torch import save_file

        from postrl.checkpoint.files import fsync_tree
        from postrl.utils import scratch_path

        out = self._dir(path, "weights" if optimizer else "sampler_weights")
        tmp = scratch_path(out)
        tmp.mkdir(parents=True)
        save_file({f"{i:05d}": p.detach().cpu().contiguous() for i, p in enumerate(client.params)}, str(tmp / "adapter.safetensors"))
        (tmp / "client.json").write_text(json.dumps({"base_model": self.name, "lora": client.lora, "steps": client.steps}))
        if optimizer:
            torch.save(client.optimizer.state_dict(), tmp / "optimizer.pt")
        fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)

    def _read(self, path: str, kind: str) -> dict[str, Any]:
        import json

        from safetensors.torch import load_file

        from postrl.checkpoint.files import torch_load

        where = self._dir(path, kind)
        if not (where / "client.json").is_file():
            raise UserError(f"no saved weights at '{path}' ({where})")
        meta = json.loads((where / "client.json").read_text())
        tensors = load_file(str(where / "adapter.safetensors"))
        meta["weights"] = [tensors[k] for k in sorted(tensors)]
        if (where / "optimizer.pt").is_file():
            meta["optimizer"] = torch_load(where / "optimizer.pt")
        return meta

    def save_state(self, model_id: str, name: str) -> str:
        path = f"tinker://{model_id}/weights/{name}"
        self._write(path, self.client(model_id), optimizer=True)
        return path

    def load_state(self, model_id: str, path: str, optimizer: bool, create: bool) -> str:
        """The saved adapter (and with `optimizer` AdamW's state and step count) into client `model_id`, made
        here when `create`: resuming continues exactly where the saved client stood."""
        saved = self._read(path, "weights")
        if saved["base_model"] != self.name:
            raise UserError(f"'{path}' was trained on '{saved['base_model']}'; this server serves '{self.name}'")
        if create:
            self.create_client(model_id, None, saved["lora"])
        client = self.client(model_id)
        if client.lora != saved["lora"] or len(client.params) != len(saved["weights"]):
            raise UserError(f"'{path}' holds a LoRA of {saved['lora']}; this client has {client.lora}")
        with torch.no_grad():
            for p, value in zip(client.params, saved["weights"]):
                p.copy_(value)
        if optimizer:
            client.optimizer.load_state_dict(saved["optimizer"])
            client.steps = saved["steps"]
        return model_id

    def export(self, path: str, out: str | Path) -> Path:
        """A saved sampler's weights as a plain Hugging Face model directory: the base with the adapter merged in."""
        import warnings

        from postrl import lora
        from postrl.models import load_model

        saved = self._read(path, "sampler_weights")
        model = load_model(self.path, "float32")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lora.apply(model, saved["lora"]["rank"], self.lora_alpha, self._targets(saved["lora"]))
        adapted = [p for n, p in model.named_parameters() if f".{lora.ADAPTER}." in n]
        with torch.no_grad():
            for p, value in zip(adapted, saved["weights"]):
                p.copy_(value)
        state = dict(lora.merged(model, model.state_dict().items()))
        plain = load_model(self.path, "float32")
        if "lm_head" in self._targets(saved["lora"]):  # the adapted unembedding is no longer the embedding
            plain.config.tie_word_embeddings = False
            plain.lm_head.weight = torch.nn.Parameter(plain.lm_head.weight.detach().clone())
        plain.load_state_dict(state)
        plain.save_pretrained(str(out))
        self.tokenizer.save_pretrained(str(out))
        return Path(out)

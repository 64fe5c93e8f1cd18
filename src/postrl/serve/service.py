"""The Tinker API's operations over one Engine: what each route does with its parsed request.

Work that touches the model (create_model, forward_backward, optim_step, save_weights_for_sampler, asample,
...) is queued to the engine thread and answered with a future; bookkeeping (sessions, capabilities, the SDK's
client config) is answered at once. The request models are the SDK's own (tinker.types), so a body the SDK
would not send is refused with the field named.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from postrl.errors import UserError
from postrl.serve.wire import forward_backward_output, parse_forward_backward, sample_response
from postrl.serve.app import Jobs, Limits


class Service:
    def __init__(self, engine: Any, limits: Limits):
        from tinker import types

        self.engine, self.limits = engine, limits
        self.jobs = Jobs(limits)
        self.sessions: set[str] = set()
        self.routes: dict[str, tuple[Any, Any]] = {
            "client/config": (None, self.client_config),
            "client/dynamic_config": (None, lambda body: {"refresh_interval_sec": 3600}),
            "create_session": (types.CreateSessionRequest, self.create_session),
            "session_heartbeat": (types.SessionHeartbeatRequest, lambda req: {"type": "session_heartbeat"}),
            "telemetry": (None, lambda body: {"status": "accepted"}),
            "get_server_capabilities": (None, self.capabilities),
            "create_model": (types.CreateModelRequest, self.create_model),
            "get_info": (types.GetInfoRequest, self.get_info),
            "forward_backward": (bytes, self.forward_backward),
            "optim_step": (types.OptimStepRequest, self.optim_step),
            "save_weights_for_sampler": (types.SaveWeightsForSamplerRequest, self.save_weights_for_sampler),
            "save_weights": (types.SaveWeightsRequest, self.save_weights),
            "load_weights": (types.LoadWeightsRequest, self.load_weights),
            "create_sampling_session": (types.CreateSamplingSessionRequest, self.create_sampling_session),
            "samplers": (None, self.get_sampler),
            "asample": (types.SampleRequest, self.sample),
            "retrieve_future": (types.FutureRetrieveRequest, self.retrieve_future),
            "cancel_future": (None, lambda body: {}),
            "weights_info": (None, self.weights_info),
        }

    def future(self, fn, model_id: str | None = None) -> dict:
        return {"request_id": self.jobs.submit(fn), **({"model_id": model_id} if model_id else {})}

    # ------------------------------------------------------------------------------ bookkeeping
    def client_config(self, body: dict) -> dict:
        # The SDK's own transport (httpx), requests sent one after another (arrival order is the training
        # client's order), and one retrieve_future per request: what this server implements.
        return {
            "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
            "fwdbwd_max_chunk_len": self.limits.max_datums, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False, "proto_compress_fwdbwd": False,
        }  # fmt: skip

    def create_session(self, req: Any) -> dict:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions.add(session_id)
        return {"type": "create_session", "session_id": session_id}

    def capabilities(self, body: dict) -> dict:
        e = self.engine
        return {"supported_models": [{"model_name": e.name, "max_context_length": e.max_context, "trainable": True, "sampleable": True}]}

    def get_info(self, req: Any) -> dict:
        # tokenizer_id: the model's local directory, so the SDK's get_tokenizer() loads it without the hub (the
        # client runs on this machine; a remote client reads the tokenizer from its own copy)
        client = self.engine.client(req.model_id)
        arch = (getattr(self.engine.model.config, "architectures", None) or [None])[0]
        return {
            "type": "get_info", "model_id": req.model_id, "model_name": self.engine.name, "is_lora": True,
            "lora_rank": client.lora["rank"], "model_data": {"arch": arch, "model_name": self.engine.name, "tokenizer_id": self.engine.path},
        }  # fmt: skip

    def weights_info(self, body: dict) -> dict:
        path = body.get("tinker_path")
        if not isinstance(path, str):
            raise UserError("weights_info needs tinker_path")
        kind = "sampler_weights" if "/sampler_weights/" in path else "weights"
        sampler = self.engine.paths.get(path)
        lora = sampler.lora if sampler is not None else self.engine._read(path, kind)["lora"]
        return {
            "base_model": self.engine.name, "is_lora": True, "lora_rank": lora["rank"], "train_unembed": lora.get("train_unembed", True),
            "train_mlp": lora.get("train_mlp", True), "train_attn": lora.get("train_attn", True),
        }  # fmt: skip

    # ------------------------------------------------------------------------------ training
    def create_model(self, req: Any) -> dict:
        if req.session_id not in self.sessions:
            raise UserError(f"unknown session_id '{req.session_id}': create_session first")
        if req.lora_config is None:
            raise UserError("only LoRA training clients are served: pass lora_config (create_lora_training_client)")
        if req.optimizer_config.type != "adamw":
            raise UserError(f"optimizer '{req.optimizer_config.type}' is not served; AdamW is")
        lora, model_id = req.lora_config.model_dump(), f"{req.session_id}:train:{req.model_seq_id}"  # the SDK's own naming
        return self.future(lambda: {"type": "create_model", "model_id": self.engine.create_client(model_id, req.base_model, lora)}, model_id)

    def save_weights(self, req: Any) -> dict:
        name = _checked_name(req.path) if req.path is not None else f"step-{self.engine.client(req.model_id).steps:06d}"
        return self.future(lambda: {"type": "save_weights", "path": self.engine.save_state(req.model_id, name)}, req.model_id)

    def load_weights(self, req: Any) -> dict:
        if req.model_id is not None:  # into an existing client
            model_id, create = req.model_id, False
        elif req.session_id is not None and req.model_seq_id is not None:  # a new client made by the load
            if req.session_id not in self.sessions:
                raise UserError(f"unknown session_id '{req.session_id}': create_session first")
            model_id, create = f"{req.session_id}:train:{req.model_seq_id}", True
        else:
            raise UserError("load_weights needs model_id, or session_id with model_seq_id")
        if req.base_model not in (None, self.engine.name):
            raise UserError(f"base_model '{req.base_model}' is not served here; this server trains '{self.engine.name}'")

        def run() -> dict:
            self.engine.load_state(model_id, req.path, req.optimizer, create)
            return {"type": "load_weights", "path": req.path, "model_id": model_id}

        return self.future(run, model_id)

    def forward_backward(self, raw: bytes) -> dict:
        req = parse_forward_backward(raw, self.limits.max_datums, self.limits.max_tokens)

        def run() -> bytes:
            outputs, metrics = self.engine.forward_backward(req)
            return forward_backward_output(outputs, metrics)

        return self.future(run, req.model_id)

    def optim_step(self, req: Any) -> dict:
        params = req.optim_params
        if getattr(params, "type", "adamw") not in ("adamw", None) and not hasattr(params, "beta1"):
            raise UserError(f"optimizer params of type '{params.type}' are not served; AdamParams are")
        adam = params.model_dump()
        bad = [k for k, v in adam.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad or adam["learning_rate"] < 0 or not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1) or adam["eps"] <= 0 \
                or adam["weight_decay"] < 0 or adam["grad_clip_norm"] < 0:  # fmt: skip
            raise UserError(f"AdamParams out of range ({adam}): need finite learning_rate >= 0, 0 <= beta1, beta2 < 1, eps > 0, "
                            "weight_decay >= 0, grad_clip_norm >= 0")  # fmt: skip
        return self.future(lambda: {"metrics": self.engine.optim_step(req.model_id, adam)}, req.model_id)

    def save_weights_for_sampler(self, req: Any) -> dict:
        name = _checked_name(req.path) if req.path is not None else None

        def run() -> dict:
            path, session = self.engine.save_for_sampler(req.model_id, name)
            return {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session}

        return self.future(run, req.model_id)

    # ------------------------------------------------------------------------------ sampling
    async def create_sampling_session(self, req: Any) -> dict:
        def run() -> dict:
            sampler = self.engine.sampler_for(req.base_model, req.model_path)
            return {"type": "create_sampling_session", "sampling_session_id": self.engine.open_session(sampler)}

        return await asyncio.wrap_future(self.jobs.get(self.jobs.submit(run)))

    def get_sampler(self, body: dict, session_id: str = "") -> dict:
        sampler = self.engine.samplers.get(session_id)  # read only: the engine thread owns the adapters
        if sampler is None:
            raise UserError(f"unknown sampling_session_id '{session_id}'")
        return {"sampler_id": session_id, "base_model": self.engine.name, "model_path": sampler.path}

    def sample(self, req: Any) -> dict:
        if not 1 <= req.num_samples <= self.limits.max_samples:
            raise UserError(f"num_samples must be in 1..{self.limits.max_samples}, got {req.num_samples}")
        prompt = req.prompt.to_ints()
        if len(prompt) > self.limits.max_tokens:
            raise UserError(f"the prompt has {len(prompt)} tokens, over the server's {self.limits.max_tokens}")
        params = req.sampling_params.model_dump()

        def run() -> bytes:
            e = self.engine
            sampler = e.session(req.sampling_session_id) if req.sampling_session_id else e.sampler_for(req.base_model, req.model_path)
            sequences, prompt_lp = e.sample(sampler, prompt, req.num_samples, params, bool(req.prompt_logprobs))
            return sample_response(sequences, prompt_lp)

        reply = self.future(run)
        reply["sample_sequence_ids"] = [f"{reply['request_id']}-{i}" for i in range(req.num_samples)]
        return reply

    # ------------------------------------------------------------------------------ futures
    async def retrieve_future(self, req: Any) -> Any:
        future = self.jobs.get(req.request_id)
        if future is None:
            raise UserError(f"unknown request_id '{req.request_id}' (never made here, or its result expired)")
        await asyncio.wait({asyncio.wrap_future(future)}, timeout=self.limits.poll_s)
        if not future.done():
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        exc = future.exception()
        if exc is not None:
            user = isinstance(exc, UserError)
            message = " ".join(exc.problems) if user else f"the server failed on this request: {type(exc).__name__}: {exc}"
            return {"error": message[:2000], "category": "user" if user else "server"}
        return future.result()

    def save_all(self, name: str) -> list[str]:
        """Every training client's state saved as `name` (on the engine thread, after the work queued before it);
        one line per client: the path, or why it could not be saved."""

        def run() -> list[str]:
            said = []
            for model_id in list(self.engine.clients):
                try:
                    said.append(f"saved {self.engine.save_state(model_id, name)}")
                except Exception as exc:  # noqa: BLE001 - one client's failure must not cost the others their save
                    said.append(f"could not save {model_id}: {type(exc).__name__}: {exc}")
            return said

        return self.jobs.call(run)

    def close(self) -> None:
        self.jobs.close()


def _checked_name(name: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name) or name in (".", ".."):
        raise UserError(f"checkpoint name {name!r}: use 1-200 letters, digits, '-', '_' and '.'")
    return name

"""Mixture-of-experts policies (Qwen3-MoE, Qwen3-VL-MoE): what the loop measures of the router.

The router of each MoE layer picks K of E experts per token. Three things go wrong in RL that do not
in dense models, and each has a number here:

- load imbalance: a few experts take most tokens; the router's load-balancing loss (Switch
  Transformer's, `load_balancing_loss_func` in transformers: E x sum_e f_e P_e, f_e the share of
  routed slots that went to expert e, P_e the mean router probability of e) is added to the policy
  loss with `model.router_aux_loss_coef`, and the per-expert load f_e is logged (moe/load_max,
  moe/load_min; 1 / E each when balanced);
- train-inference routing mismatch: the engine and the trainer compute the router in different
  kernels and precisions, so near-ties pick different experts and the same token is computed by a
  different network (Megatron-LM #4168, NeMo-RL #4243 report collapses from it). `routing_mismatch`
  measures it (share of tokens whose top-k sets differ): the sync guard compares vLLM's routing of its
  probe sequence (VLLMEngine.probe_routing, hooks on vLLM's gates) with the trainer's after every sync
  (moe/routing_mismatch). `RouterTrace` with `replay_LNK` removes it by running the trainer's forward
  on the engine's experts (verl, NeMo-RL, slime: router replay); that needs the engine's routing of
  every sampled token, which vLLM 0.32 returns (enable_return_routed_experts) only with its Model
  Runner V2 (Triton, GPU), so replay is off and the run says so at start (REPLAY_UNAVAILABLE).
- weight sync: vLLM 0.32 on CPU leaves the fused expert weights unpacked after a reload
  (rollout/vllm_platform.repack_cpu_moe packs them again; without it the sync guard stops the run).
"""

from __future__ import annotations

from typing import Any

import torch


REPLAY_UNAVAILABLE = (
    "MoE: router replay off: vLLM 0.32 returns the experts it routed to (enable_return_routed_experts) only with its "
    "Model Runner V2, which needs Triton (GPU), and postrl does not feed them to the trainer yet; the trainer routes "
    "each token itself (moe/routing_mismatch on the sync probe, moe/aux_loss, moe/load_max, moe/load_min; docs/gpu.md)"
)


def is_moe(model: torch.nn.Module) -> bool:
    """Whether the model (or a VLM's text model) routes tokens to experts."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    return bool(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None))


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE layer, in layer order (transformers' `*TopKRouter`: weight [E, h], top_k)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def load_balancing_loss(logits_LNE: torch.Tensor, experts_LNK: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers computes it (`load_balancing_loss_func`, no mask):
    E x sum over (k, e) of f_ke x P_e, f_ke the share of tokens whose k-th choice is e, P_e the mean router
    probability of e; over all L layers' N tokens at once. K when routing is uniform, up to E when skewed."""
    E = logits_LNE.shape[-1]
    probs_XE = torch.softmax(logits_LNE.float().flatten(0, 1), dim=-1)
    chosen_XKE = torch.nn.functional.one_hot(experts_LNK.flatten(0, 1), E).float()
    return E * (chosen_XKE.mean(0) * probs_XE.mean(0)).sum()


def expert_load(experts_LNK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] share of each layer's routed slots (N tokens x K choices) that went to each expert; rows sum to 1."""
    counts_LE = torch.nn.functional.one_hot(experts_LNK.flatten(1), num_experts).sum(1).float()
    return counts_LE / counts_LE.sum(-1, keepdim=True)


def routing_mismatch(a_LNK: torch.Tensor, b_LNK: torch.Tensor) -> float:
    """Share of (layer, token) pairs whose top-k expert sets differ between two routings (order ignored)."""
    same = torch.sort(a_LNK.long(), -1).values == torch.sort(b_LNK.long(), -1).values
    return float(1.0 - same.all(-1).float().mean())


class RouterTrace:
    """Forward hooks on a model's routers: what they chose in the last forward, and optionally a replay.

    `with trace:` records every router call (logits [N, E] and chosen experts [N, K] per layer); the
    hooks read the router's outputs and change nothing, unless `replay_LNK` is set: then each layer's
    choice is replaced by the given experts (the engine's routing), with weights from the trainer's own
    router probabilities at those experts (renormalised as the model does), so the router still gets
    gradients (router replay, as verl / slime do).
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self.num_experts = int(self.routers[0].num_experts) if self.routers else 0
        self.logits: list[torch.Tensor] = []
        self.experts: list[torch.Tensor] = []
        self.replay_LNK: torch.Tensor | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "RouterTrace":
        self.logits, self.experts = [], []
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            logits_NE, weights_NK, experts_NK = out
            if self.replay_LNK is not None:
                experts_NK = self.replay_LNK[layer].to(experts_NK.device, experts_NK.dtype)
                probs_NK = torch.softmax(logits_NE, dim=-1, dtype=torch.float).gather(-1, experts_NK)
                if getattr(module, "norm_topk_prob", True):
                    probs_NK = probs_NK / probs_NK.sum(-1, keepdim=True)
                weights_NK = probs_NK.to(weights_NK.dtype)
            self.logits.append(logits_NE)
            self.experts.append(experts_NK.detach())
            return logits_NE, weights_NK, experts_NK

        return hook

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [L, N, E], experts [L, N, K]) of the last forward, one router call per layer."""
        return torch.stack(self.logits), torch.stack(self.experts)

    def stats(self) -> tuple[torch.Tensor, dict[str, float]]:
        """The load-balancing loss of the last forward (with its graph) and the moe/* metrics."""
        logits_LNE, experts_LNK = self.stacked()
        aux = load_balancing_loss(logits_LNE, experts_LNK)
        load_LE = expert_load(experts_LNK, self.num_experts)
        return aux, {
            "moe/aux_loss": float(aux.detach()),
            "moe/load_max": float(load_LE.max(-1).values.mean()),
            "moe/load_min": float(load_LE.min(-1).values.mean()),
        }


def aux_loss_coef(configured: float | None, model: torch.nn.Module) -> float:
    """model.router_aux_loss_coef, or the model's own config.json value (Qwen3-MoE: 0.001) when unset."""
    if configured is not None:
        return configured
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)

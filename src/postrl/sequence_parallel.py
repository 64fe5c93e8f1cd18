"""Ulysses sequence parallelism (train.sequence_parallel_size, verl's ulysses_sequence_parallel_size).

A micro-batch's rows are cut along the sequence into u equal shards, one per rank of a sequence-parallel
group; every layer but attention is per token, so each rank runs the model on its shard alone. Attention
needs every key of the sequence: around it, one all-to-all turns [B, H, S/u, D] (all heads, my tokens)
into [B, H/u, S, D] (my heads, all tokens), attention runs over the whole sequence for H/u heads, and a
second all-to-all turns the output back (DeepSpeed-Ulysses, arXiv 2309.14509). Activations and logits
per rank shrink by u; the weights are whatever FSDP2 makes of them.

    ids [B, S] -> shard r: ids[:, r S/u : (r+1) S/u], positions of the full sequence (RoPE stays right)
    attention: all-to-all (seq -> heads), SDPA with the full-sequence mask, all-to-all (heads -> seq)
    log-probs: each rank scores its shard against the next tokens of the full sequence (the label of a
    shard's last token is the next shard's first), then an all-gather returns [B, S - 1] to every rank

The mask is built once per forward from the full sequence: causal, within a packed segment (position
ids restart at 0), keys that are not padding. Gradients: the all-to-alls carry them between ranks,
and the gather hands each rank only its own shard's (every rank computes the same loss on the gathered
log-probs, so summing them would count each token u times); the data-parallel reduction then sums the
ranks' parameter gradients into the one-rank gradient (tests/test_sequence_parallel.py: 2 ranks vs 1).

Heads must divide by u (GQA key / value heads are repeated to the query heads first). The attention is
torch's SDPA with an explicit mask, so flash-attention kernels are not used under sequence parallelism.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = "postrl_ulysses"  # the name registered with transformers' AttentionInterface
_state: dict[str, Any] = {}  # the running forward's group and full-sequence mask (set by `ulysses`)


def _seq_to_heads(x_BHsD: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/u, D] (all heads of my shard) -> [B, H/u, S, D] (my heads of every shard)."""
    u = dist.get_world_size(group)
    B, H, s, D = x_BHsD.shape
    send = x_BHsD.reshape(B, u, H // u, s, D).permute(1, 0, 2, 3, 4).contiguous()  # [u, B, H/u, s, D] by head block
    recv = _all_to_all(send, group)  # recv[r]: shard r of my head block
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // u, u * s, D)


def _heads_to_seq(x_BhSD: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H/u, S, D] -> [B, H, S/u, D]: the inverse of `_seq_to_heads`."""
    u = dist.get_world_size(group)
    B, h, S, D = x_BhSD.shape
    send = x_BhSD.reshape(B, h, u, S // u, D).permute(2, 0, 1, 3, 4).contiguous()  # [u, B, H/u, s, D] by shard
    recv = _all_to_all(send, group)  # recv[r]: head block r of my shard
    return recv.permute(1, 0, 2, 3, 4).reshape(B, u * h, S // u, D)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed.nn.functional import all_to_all_single  # differentiable: the backward is an all-to-all

    return all_to_all_single(torch.empty_like(x), x, group=group)


def ulysses_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: q / k / v [B, heads, S/u, D] after RoPE; returns [B, S/u, H, D]."""
    group, mask_B1SS = _state["group"], _state["mask"]
    H = query.shape[1]
    if key.shape[1] != H:  # grouped-query attention: each key / value head serves H / kv query heads
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    q, k, v = (_seq_to_heads(t, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS, dropout_p=dropout, scale=scaling)
    return _heads_to_seq(out, group).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention builds its own full-sequence mask


def register() -> None:
    """Make `ATTENTION` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def full_mask(attention_mask_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j iff j <= i, both in the same packed segment (position ids
    restart at 0) and j is not padding; a padding query sees itself only (no empty softmax rows)."""
    S = attention_mask_BS.shape[1]
    segment_BS = torch.cumsum((position_ids_BS == 0).long(), dim=1)
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=attention_mask_BS.device).tril()
    same_BSS = segment_BS[:, :, None] == segment_BS[:, None, :]
    keys_B1S = attention_mask_BS.bool()[:, None, :]
    allowed = causal_SS & same_BSS & keys_B1S
    allowed |= torch.eye(S, dtype=torch.bool, device=allowed.device)
    return allowed[:, None]


class _GatherSeq(torch.autograd.Function):
    """All-gather of shards along dim 1; the backward keeps this rank's slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx: Any, x_Bs: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x_Bs) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_Bs.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad_BS: torch.Tensor) -> tuple[torch.Tensor, None]:
        u, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        s = grad_BS.shape[1] // u
        return grad_BS[:, r * s : (r + 1) * s].contiguous(), None


@contextlib.contextmanager
def ulysses(model: torch.nn.Module, group: Any, mask_B1SS: torch.Tensor) -> Iterator[None]:
    """Run `model`'s attention as Ulysses attention over `group` with the full-sequence mask."""
    register()
    before = model.config._attn_implementation
    _state.update(group=group, mask=mask_B1SS)
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
        _state.clear()


def token_logprobs(
    model: torch.nn.Module, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor, position_ids_BS: torch.Tensor,
    group: Any, temperature: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """[B, S - 1] log-probs of input_ids[:, 1:] (the next token at every position), computed with the
    sequence split over `group`; the same on every rank of the group."""
    u, r = dist.get_world_size(group), dist.get_rank(group)
    B, S = input_ids_BS.shape
    pad = -S % u  # equal shards: pad the end with masked tokens
    if pad:
        input_ids_BS = F.pad(input_ids_BS, (0, pad))
        attention_mask_BS = F.pad(attention_mask_BS, (0, pad))
        position_ids_BS = F.pad(position_ids_BS, (0, pad), value=1)  # not 0: no new segment
    labels_BS = F.pad(input_ids_BS[:, 1:], (0, 1))  # the next token of every position (last: unused)
    s = (S + pad) // u
    mine = slice(r * s, (r + 1) * s)
    with ulysses(model, group, full_mask(attention_mask_BS, position_ids_BS)):
        logits_BsV = model(input_ids=input_ids_BS[:, mine], position_ids=position_ids_BS[:, mine], use_cache=False).logits
    logp_BsV = torch.log_softmax(logits_BsV.float() / temperature, dim=-1)
    logp_Bs = logp_BsV.gather(-1, labels_BS[:, mine, None]).squeeze(-1)
    return _GatherSeq.apply(logp_Bs, group)[:, : S - 1]

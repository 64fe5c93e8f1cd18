"""Ulysses sequence parallelism (train.sequence_parallel_size, verl's ulysses_sequence_parallel_size).

A micro-batch's rows are cut along the sequence into u equal shards, one per rank of a sequence-parallel
group; every layer but attention is per token, so each rank runs the model on its shard alone. Attention
needs every key of the sequence: around it, one all-to-all turns [B, H, S/u, D] (all heads, my tokens)
into [B, H/u, S, D] (my heads, all tokens), attention runs over the whole sequence for H/u heads, and a
second all-to-all turns the output back (DeepSpeed-Ulysses, arXiv 2309.14509). Activations and logits
per rank shrink by u; the weights are whatever FSDP2 makes of them.

    ids [R, C] -> shard r: ids[:, r C/u : (r+1) C/u], positions of the full rows (RoPE stays right)
    attention: all-to-all (seq -> heads), SDPA with the full rows' mask, all-to-all (heads -> seq)
    log-probs (`score`): each rank scores the predicting slots of its shard (`logits_to_keep`) against
    their targets (a shard's last slot predicts the next shard's first token), zeros elsewhere, and a
    sum over the group returns every token's log-prob (and entropy) to every rank

The mask comes with the rows (`full_mask`: causal, within a packed segment, keys that are not padding;
or models.py's packed shared-prompt mask). Gradients: the all-to-alls carry them between ranks, and the
sum's backward hands each rank the gradient unchanged, which its graph applies to its own slots only
(every rank computes the same loss from the summed log-probs, so reducing the gradient would count each
token u times); the data-parallel reduction then sums the ranks' parameter gradients into the one-rank
gradient (tests/test_sequence_parallel.py, and tests/test_sequence_parallel_training.py through the actor).
A VLM's image features and mRoPE positions are built over the whole rows before its language model takes
the rank's columns (`_shard_text_inputs`).

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
_state: dict[str, Any] = {}  # the group (set by `ulysses`) and the last forward's full-sequence mask (by `score`)


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


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) of per-rank parts that are zero outside each rank's own entries; the backward hands
    every rank the gradient unchanged (every rank computes the same loss from the sum, so an all-reduce of
    the gradient would count each token u times): each rank's graph then takes its own entries' share."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@contextlib.contextmanager
def ulysses(model: torch.nn.Module, group: Any) -> Iterator[None]:
    """Run `model`'s attention as Ulysses attention over `group` for the block; nested blocks reuse the outer one.

    The actor holds it around forward and backward, so that gradient checkpointing's recomputation in the
    backward runs the same attention with the same mask (`score` leaves its mask in place until the block ends).
    """
    if _state.get("group") is not None:
        assert _state["group"] is group, "nested Ulysses blocks over different groups"
        yield
        return
    register()
    plain = getattr(model, "module", model)  # the HF model inside a DDP wrapper (FSDP2 shards in place)
    text = getattr(plain.config, "text_config", None)
    if text is not None:  # a VLM: the language model's attention only; the vision tower sees whole images
        before: Any = {"text_config": text._attn_implementation}
        plain.set_attn_implementation({"text_config": ATTENTION})
    else:
        before = plain.config._attn_implementation
        plain.set_attn_implementation(ATTENTION)
    _state.update(group=group, mask=None)
    try:
        yield
    finally:
        plain.set_attn_implementation(before)
        _state.clear()


def score(
    model: torch.nn.Module, ids_RC: torch.Tensor, pos_RC: torch.Tensor, mask_R1CC: torch.Tensor, r_M: torch.Tensor,
    c_M: torch.Tensor, targets_M: torch.Tensor, group: Any, temperature: float = 1.0, with_entropy: bool = False,
    chunk_tokens: int = 1024, image_kwargs: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Log-probs (and entropies) [M] of `targets_M` predicted by slots (r_M, c_M) of rows `ids_RC`, with the
    columns split over `group`; the same on every rank of the group.

    `mask_R1CC` is the full rows' attention mask (bool, True attends: `full_mask`, or the packed shared-prompt
    mask). The rows are padded to a multiple of u columns (a padding slot attends itself only); rank r runs
    columns [r s, (r + 1) s) and computes the logits of its own predicting slots only (`logits_to_keep`).

    `image_kwargs` (a VLM's image inputs, `Modality.forward_kwargs`; rows already a multiple of u wide, with
    their attention mask under "attention_mask"): every rank runs the vision tower on the whole images, the
    model scatters the features into the whole rows and computes their mRoPE positions, and only then does
    its language model take this rank's columns (`_shard_text_inputs`), so image tokens and positions are
    sliced together with the text.
    """
    from postrl.algorithms import token_logprobs

    u, me = dist.get_world_size(group), dist.get_rank(group)
    R, C = ids_RC.shape
    pad = -C % u
    if pad:
        assert image_kwargs is None, "rows with images must be padded to a multiple of the group size by the caller"
        ids_RC, pos_RC = F.pad(ids_RC, (0, pad)), F.pad(pos_RC, (0, pad))
        mask_R1CC = F.pad(mask_R1CC, (0, pad, 0, pad), value=False)
        mask_R1CC[..., C:, C:] |= torch.eye(pad, dtype=torch.bool, device=mask_R1CC.device)
    s = (C + pad) // u
    lo = me * s
    mine_M = (c_M >= lo) & (c_M < lo + s)
    keep_K = torch.unique(c_M[mine_M] - lo)  # sorted local columns holding a predicting slot
    with ulysses(model, group):
        _state["mask"] = mask_R1CC
        if image_kwargs:
            with _shard_text_inputs(model, lo, s):
                logits_RKV = model(input_ids=ids_RC, logits_to_keep=keep_K, use_cache=False, **image_kwargs).logits
        else:
            mine = slice(lo, lo + s)
            logits_RKV = model(input_ids=ids_RC[:, mine], position_ids=pos_RC[:, mine], logits_to_keep=keep_K, use_cache=False).logits
    K = keep_K.numel()
    parts = torch.zeros((2 if with_entropy else 1, c_M.numel()), dtype=torch.float32, device=ids_RC.device)
    if K:
        m = mine_M.nonzero()[:, 0]
        flat_m = r_M[m] * K + torch.searchsorted(keep_K, c_M[m] - lo)
        logits_mV = logits_RKV.reshape(R * K, -1).index_select(0, flat_m)
        logp_m, entropy_m = token_logprobs(logits_mV, targets_M[m], temperature, chunk_tokens, with_entropy)
        parts = parts.index_put((torch.zeros_like(m), m), logp_m.float())
        if with_entropy:
            parts = parts.index_put((torch.ones_like(m), m), entropy_m.float())
    elif torch.is_grad_enabled():  # no slot of mine predicts: keep the graph through the model, whose backward
        parts = parts + 0.0 * logits_RKV.sum()  # has the all-to-alls the other ranks' backward joins
    total = _SumOverGroup.apply(parts, group)
    return total[0], total[1] if with_entropy else None


@contextlib.contextmanager
def _shard_text_inputs(model: torch.nn.Module, lo: int, s: int) -> Iterator[None]:
    """A VLM's language model takes columns [lo, lo + s) of what the VLM hands it: the input embeddings (image
    features already in place), the mRoPE positions, and Qwen3-VL's deepstack features of the image tokens there."""
    plain = getattr(model, "module", model)
    text_config = plain.config.text_config
    lm = next(m for m in plain.modules() if m is not plain and getattr(m, "config", None) is text_config and hasattr(m, "layers"))

    def shard(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        assert not args and kwargs.get("inputs_embeds") is not None, "the language model is called with inputs_embeds"
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"][:, lo : lo + s]
        kwargs["position_ids"] = kwargs["position_ids"][..., lo : lo + s]
        kwargs["attention_mask"] = None  # the Ulysses attention holds the whole rows' mask
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:  # Qwen3-VL: features added to the image tokens of the first layers, in row-major order
            cols = visual.nonzero()[:, 1]
            here = (cols >= lo) & (cols < lo + s)
            kwargs["visual_pos_masks"] = visual[:, lo : lo + s]
            kwargs["deepstack_visual_embeds"] = [e[here] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    handle = lm.register_forward_pre_hook(shard, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def token_logprobs(
    model: torch.nn.Module, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor, position_ids_BS: torch.Tensor,
    group: Any, temperature: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """[B, S - 1] log-probs of input_ids[:, 1:] (the next token at every position), computed with the
    sequence split over `group`; the same on every rank of the group."""
    B, S = input_ids_BS.shape
    b_M, c_M = (x.reshape(-1) for x in torch.meshgrid(torch.arange(B), torch.arange(S - 1), indexing="ij"))
    mask = full_mask(attention_mask_BS, position_ids_BS)
    logp_M, _ = score(model, input_ids_BS, position_ids_BS, mask, b_M, c_M, input_ids_BS[b_M, c_M + 1], group, temperature)
    return logp_M.view(B, S - 1)


def widen_for_images(model, input_ids, attention_mask, position_ids, images, group):
    """Padded rows of a batch with images ((multi_modal, modality)) widened at the end to a multiple of the
    group size, and the image inputs (mRoPE positions over the whole rows) built for the very columns the
    ranks split: (input_ids, attention_mask, position_ids, image kwargs or None)."""
    pad = -input_ids.shape[1] % dist.get_world_size(group)
    input_ids, attention_mask = F.pad(input_ids, (0, pad)), F.pad(attention_mask, (0, pad))
    position_ids = F.pad(position_ids, (0, pad), value=1)  # not 0: no new segment (full_mask)
    multi_modal, modality = images
    mm = modality.forward_kwargs(model, input_ids, multi_modal)  # {}: no row of this micro-batch has an image
    return input_ids, attention_mask, position_ids, ({**mm, "attention_mask": attention_mask} if mm else None)

"""Per-token log-probs and entropy from logits, in fp32 chunks, with a hand-written backward."""

from __future__ import annotations


import torch
from torch import Tensor


class _TokenLogprobs(torch.autograd.Function):
    """Log-prob of each target and the entropy, from logits, in fp32 chunks of tokens.

    With s = z / temperature and lse = logsumexp(s): logp = s[y] - lse, H = lse - sum(softmax(s) s).
    Backward (per token, p = softmax(s)): dlogp/ds = onehot(y) - p, dH/ds = -p (s - sum(p s)), both
    divided by the temperature for dz. Only the logits (the model's output, any dtype), lse and
    sum(p s) are kept for backward; each chunk's fp32 softmax is recomputed there. So at most
    [chunk, V] fp32 exists at a time, forward or backward, where autograd through log_softmax
    would keep several [N, V] fp32 copies alive until backward.
    """

    @staticmethod
    def forward(ctx, logits_NV: Tensor, targets_N: Tensor, temperature: float, chunk: int, with_entropy: bool):
        N = logits_NV.shape[0]
        fp = torch.promote_types(logits_NV.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        logp_N = torch.empty(N, dtype=fp, device=logits_NV.device)
        lse_N = torch.empty_like(logp_N)
        mean_s_N = torch.empty_like(logp_N)  # sum(p s): the expected scaled logit
        for lo in range(0, N, chunk):
            s_CV = logits_NV[lo : lo + chunk].to(fp) / temperature
            lse_C = torch.logsumexp(s_CV, dim=-1)
            lse_N[lo : lo + chunk] = lse_C
            logp_N[lo : lo + chunk] = s_CV.gather(-1, targets_N[lo : lo + chunk, None]).squeeze(-1) - lse_C
            if with_entropy:
                mean_s_N[lo : lo + chunk] = (torch.softmax(s_CV, dim=-1) * s_CV).sum(-1)
        entropy_N = lse_N - mean_s_N if with_entropy else torch.zeros_like(logp_N)
        ctx.save_for_backward(logits_NV, targets_N, lse_N, mean_s_N)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.mark_non_differentiable(targets_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N: Tensor, grad_entropy_N: Tensor):
        logits_NV, targets_N, lse_N, mean_s_N = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_NV = torch.empty_like(logits_NV)
        for lo in range(0, logits_NV.shape[0], chunk):
            hi = lo + chunk
            s_CV = logits_NV[lo:hi].to(lse_N.dtype) / tau
            p_CV = torch.exp(s_CV - lse_N[lo:hi, None])
            g_CV = -grad_logp_N[lo:hi, None] * p_CV  # logp part: onehot(y) - p
            y_C1 = targets_N[lo:hi, None]
            g_CV.scatter_(-1, y_C1, g_CV.gather(-1, y_C1) + grad_logp_N[lo:hi, None])  # one target per row
            if ctx.with_entropy:
                g_CV -= grad_entropy_N[lo:hi, None] * p_CV * (s_CV - mean_s_N[lo:hi, None])
            grad_NV[lo:hi] = g_CV / tau
        return grad_NV, None, None, None, None


def token_logprobs(
    logits_NV: Tensor, targets_N: Tensor, temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(log softmax(z / temperature)[target], entropy or None) per token in fp32 (fp64 for fp64), from logits [N, V].

    Computed in chunks of `chunk_tokens` rows (`_TokenLogprobs`), so [N, V] is never materialised in
    fp32 at once; the result does not depend on the chunk size beyond float rounding.
    """
    assert chunk_tokens >= 1, "chunk_tokens must be positive"
    logp_N, entropy_N = _TokenLogprobs.apply(logits_NV, targets_N, float(temperature), int(chunk_tokens), with_entropy)
    return logp_N, entropy_N if with_entropy else None

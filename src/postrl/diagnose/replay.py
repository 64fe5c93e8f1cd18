"""The HF engine's own log-probs of a batch's tokens: generate's computation, replayed.

The HF engine reports no sampling log-probs (it samples with the trainer's model object), but how it computes them
still differs from the trainer's pass: eval mode, left-padded prompts, one prefill then one token at a time through
the KV cache, in the run's autocast. `replay` does exactly that with the sampled tokens forced in, and returns the
temperature-scaled log-probs of each sampled token (the distribution generate drew it from, before top-p / top-k)
and the top-k of that distribution at every position (`postrl doctor --mismatch --full-distribution`).
"""

from __future__ import annotations

from typing import Any

import torch

from postrl.models import left_pad


@torch.no_grad()
def replay(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], pad_id: int, temperature: float,
           autocast: Any, k: int = 0, rows_per_pass: int = 16) -> tuple[list[list[float]], list[tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """(log-probs per response token, per row; (top-k log-probs [T, k], ids [T, k]) per row, empty without k)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logps: list[list[float]] = []
    topks: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for start in range(0, len(prompts), rows_per_pass):
            chunk_p, chunk_r = prompts[start : start + rows_per_pass], responses[start : start + rows_per_pass]
            with autocast():
                lp, tk = _replay_chunk(model, chunk_p, chunk_r, pad_id, temperature, k, device)
            logps += lp
            topks += tk
    finally:
        model.train(was_training)
    return logps, topks


def _replay_chunk(model, prompts, responses, pad_id, temperature, k, device):
    ids, attn = left_pad(prompts, pad_id)  # [B, P], as HFEngine._generate_chunk pads them
    ids, attn = ids.to(device), attn.to(device)
    B, T = len(prompts), max((len(r) for r in responses), default=0)
    resp = torch.full((B, max(T, 1)), pad_id, dtype=torch.long, device=device)
    for i, r in enumerate(responses):
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    position = attn.long().cumsum(-1) - 1  # generate's position ids: left padding does not count
    out = model(input_ids=ids, attention_mask=attn, position_ids=position.clamp(min=0), use_cache=True)
    cache, last = out.past_key_values, position[:, -1:]
    lp_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    top_lp, top_id = [], []
    for t in range(T):
        logp_BV = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        lp_BT[:, t] = logp_BV.gather(1, resp[:, t : t + 1]).squeeze(1)
        if k:
            v, i = logp_BV.topk(k, dim=-1)
            top_lp.append(v.cpu())
            top_id.append(i.cpu())
        if t + 1 < T:  # feed token t; finished rows are fed padding with attention on, as generate does
            attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
            last = last + 1
            out = model(input_ids=resp[:, t : t + 1], attention_mask=attn, position_ids=last, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    logps = [lp_BT[i, : len(r)].tolist() for i, r in enumerate(responses)]
    if not k:
        return logps, []
    lp_TBK, id_TBK = torch.stack(top_lp), torch.stack(top_id)
    return logps, [(lp_TBK[: len(r), i], id_TBK[: len(r), i]) for i, r in enumerate(responses)]

"""`postrl doctor --mismatch CONFIG`: do the rollout engine's log-probs and the trainer's agree, where not, and why?

One rollout batch is drawn as the run's first step draws it (the configured engine and placement, agents included:
assembly.build_run + placement.source.open_source), without dynamic sampling (the doctor keeps every group). The trainer's log-probs of the same tokens are computed as its
old-log-prob pass computes them (fp32 master weights, forwards in model.dtype, the same micro-batching and packing).
The engine's are its sampling log-probs where it reports them (vLLM); the HF engine reports none, so its own
computation is replayed (replay.py: generate's eval-mode KV-cache decoding of the same tokens).

The same forward also returns, at every response position, the logsumexp of the trainer's logits at a grid of
temperatures and its top-k: the temperature at which the trainer's log-probs best match the engine's tells a
sampling-parameter mismatch from the rest, and the top-k gives the whole next-token distribution
(--full-distribution). A probe sequence at temperature 1 (the sync guard's test) tells stale weights from the rest.
verdict.py reads all of it; report.py prints it and writes the JSON.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from postrl.algorithms.mismatch import mismatch_metrics, mismatch_sums
from postrl.diagnose import stats
from postrl.diagnose.replay import replay
from postrl.diagnose.verdict import verdict

TEMPERATURES = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0]  # the fit's grid (with rollout.temperature)
WORST = 10


def diagnose_mismatch(cfg: Any, *, full_distribution: bool = False, top_k: int = 20, positions: int = 64,
                      log: Callable[[str], None] = print, wrap: Callable | None = None) -> dict[str, Any]:  # fmt: skip
    """The mismatch report of one rollout batch (module docstring). `wrap(engine, run)` replaces the engine (tests:
    a deliberately mismatched one), as build_run's `wrap` does."""
    from postrl import guards
    from postrl.assembly import build_run
    from postrl.placement.source import open_source
    from postrl.metrics import Timer

    cfg = cfg.model_copy(deep=True)
    cfg.algorithm.filter_groups.enable = False  # one batch as sampled: no group is dropped for its rewards' spread
    run = build_run(cfg, "trainer", log, wrap=wrap)
    guard = guards.Guards(cfg, log)
    source = None
    try:
        source = open_source(cfg, run, guard, 0, log)
        batch, _ = source.next_batch(0, Timer())
        engine = run.engine
        k = top_k if full_distribution else 0
        trainer = trainer_pass(run.actor, batch, cfg.rollout.temperature, k)
        if batch.has_engine_logprobs:
            q = [list(lp) for lp in batch.engine_logprobs]
            engine_topk, how = None, f"the {engine.name} engine's sampling log-probs"
        else:  # the engine samples with the trainer's model: replay its computation
            q, engine_topk = replay(run.policy.model, batch.prompt_ids, batch.response_ids, run.policy.tokenizer.pad_token_id,
                                    cfg.rollout.temperature, run.runtime.autocast, k)  # fmt: skip
            how = f"the {engine.name} engine's computation replayed (eval mode, KV cache, {run.runtime.dtype})"
        probe = probe_gap(engine, run, batch)
        dist = None
        if k and engine_topk is not None:
            dist = compare_distributions(trainer, batch, engine_topk, positions)
        elif k and not cfg.rollout.takes_rows:  # an engine that reports log-probs: a few samples with its top-k
            dist = engine_distributions(engine, run.actor, batch, cfg, k, positions)
        elif k:
            dist = {"available": False, "why": "the agent loop's engine samples from rows, not prompts; compare with rollout.engine: hf"}
    finally:
        if source is not None:
            source.close()
        run.close()
    report = analyse(cfg, run.policy.tokenizer, batch, trainer, q, probe, guard)
    if dist is not None:
        report["full_distribution"] = dist
    report["engine"] = {"name": engine.name, "logprobs": how, "placement": cfg.rollout.placement, "dtype": cfg.model.dtype}
    report["verdict"] = verdict(report)
    return report


@torch.no_grad()
def trainer_pass(actor: Any, batch: Any, temperature: float, k: int) -> dict[str, Any]:
    """The trainer's log-probs of the batch (as actor.compute_logprobs computes them) and, at every response position,
    logsumexp(z / t) over TEMPERATURES and the top-k raw logits z and their ids (rows in batch order: one process)."""
    from postrl.models import response_logprobs

    grid = sorted({*TEMPERATURES, float(temperature)})
    packed = actor.pack(batch, torch.zeros(batch.size))
    B, T = packed.tensors["response_mask"].shape
    G = len(grid)
    logp = torch.zeros((B, T))
    extra = torch.zeros((B, T, G + 2 * k))

    def logits_fn(logits_MV, b_M, k_M):
        z = logits_MV.float()
        parts = [torch.stack([torch.logsumexp(z / t, dim=-1) for t in grid], dim=-1)]
        if k:
            v, i = z.topk(k, dim=-1)
            parts += [v, i.float()]
        return torch.cat(parts, dim=-1)

    t = actor.cfg.train
    for idx, mb in actor.micro_batches(range(packed.size), packed, log_prob_pass=True):
        Tm = mb["response_mask"].shape[1]
        with actor.runtime.autocast():
            lp, _, ex = response_logprobs(
                actor.model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], Tm, temperature,
                multi_modal=mb.get("multi_modal"), modality=actor.modality, remove_padding=t.use_remove_padding,
                chunk_tokens=t.logprob_chunk_tokens, logits_fn=logits_fn,
            )  # fmt: skip
        ix = torch.tensor(idx)
        logp[ix, :Tm] = lp.float().cpu()
        extra[ix, :Tm] = ex.float().cpu()
    return {"logp": logp, "grid": torch.tensor(grid), "lse": extra[..., :G], "top_v": extra[..., G : G + k],
            "top_i": extra[..., G + k :].long(), "temperature": float(temperature)}  # fmt: skip


@torch.no_grad()
def probe_gap(engine: Any, run: Any, batch: Any) -> dict[str, float] | None:
    """The engine's and the trainer's log-probs of one whole sequence (the batch's first prompt and response) at
    temperature 1, as the sync guard compares them: a gap here is the weights, not the sampling."""
    from postrl.models import response_logprobs

    ids = list(batch.prompt_ids[0]) + list(batch.response_ids[0])
    engine_lp = engine.probe_logprobs(ids)
    if engine_lp is None:  # the engine holds the trainer's own model: its weights cannot be stale
        return None
    model = run.policy.model
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with run.runtime.autocast():
        mine, _ = response_logprobs(model, x, torch.ones_like(x), torch.arange(len(ids), device=device)[None], len(ids) - 1)
    d = (mine[0].float().cpu() - torch.tensor(engine_lp)).abs()
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "max": float(d.max())}


def analyse(cfg, tokenizer, batch, trainer: dict, q_rows: list[list[float]], probe, guard) -> dict:
    """Every statistic of the report from the two sides' log-probs (flat over the tokens the policy sampled)."""
    B, T = trainer["logp"].shape
    mask_BT, q_BT, pos_BT, tok_BT = (torch.zeros((B, T)) for _ in range(4))
    for i in range(B):
        n = len(batch.response_ids[i])
        mask_BT[i, :n] = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        q_BT[i, :n] = torch.tensor(q_rows[i][:n], dtype=torch.float32)
        pos_BT[i, :n] = torch.arange(n, dtype=torch.float32)
        tok_BT[i, :n] = torch.tensor(batch.response_ids[i], dtype=torch.float32)
    p_BT = trainer["logp"]
    sel = mask_BT > 0
    p, q = p_BT[sel], q_BT[sel]
    rc = cfg.algorithm.rollout_correction
    tol = guard.tolerance(cfg.guards.sync_tol)
    report: dict[str, Any] = {
        "sequences": B, "tokens": int(sel.sum()), "temperature": trainer["temperature"],
        "tolerance": {"value": tol, "statistic": "max" if guard.exact else "mean", "dtype": cfg.model.dtype},
        "gap": stats.gap_summary(p, q),
        "by_position": stats.by_position(p, q, pos_BT[sel]),
        "by_frequency": stats.by_frequency(p, q, tok_BT[sel].long()),
        "by_probability": stats.by_probability(p, q),
        "corrections": {"cap": rc.cap, "configured": rc.level if rc.enable else None,
                        **stats.correction_shares(p_BT, q_BT, mask_BT, rc.cap)},  # fmt: skip
        "engine_more_confident": float((q > p).float().mean()) if p.numel() else 0.0,
        "probe": probe,
        "sampling": {"top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k},
    }
    report["step_metrics"] = mismatch_metrics(*mismatch_sums(p_BT, q_BT, mask_BT))
    grid, lse = trainer["grid"], trainer["lse"][sel]
    at_t = int((grid - trainer["temperature"]).abs().argmin())
    z_y = trainer["temperature"] * (p + lse[:, at_t])  # the sampled token's raw logit
    best_t, best_gap = stats.fit_temperature(z_y, lse, grid, q) if p.numel() else (trainer["temperature"], 0.0)
    report["temperature_fit"] = {"best": best_t, "gap_at_best": best_gap, "gap_at_configured": report["gap"]["mean"]}
    report["worst"] = worst_tokens(tokenizer, batch, p_BT, q_BT, mask_BT)
    return report


def worst_tokens(tokenizer, batch, p_BT, q_BT, mask_BT, n: int = WORST, context: int = 12) -> list[dict]:
    """The n tokens with the largest |p - q|, with the response text before them."""
    gap = ((p_BT - q_BT).abs() * mask_BT).flatten()
    out = []
    for flat in gap.topk(min(n, int((mask_BT > 0).sum()))).indices.tolist():
        i, t = divmod(flat, p_BT.shape[1])
        resp = batch.response_ids[i]
        out.append({
            "row": i, "position": t, "token": tokenizer.decode([resp[t]]), "trainer_logp": float(p_BT[i, t]),
            "engine_logp": float(q_BT[i, t]), "gap": float(gap[flat]), "context": tokenizer.decode(resp[max(0, t - context) : t]),
        })  # fmt: skip
    return out


def compare_distributions(trainer: dict, batch, engine_topk: list, positions: int) -> dict:
    """The trainer's and the engine's top-k next-token distributions at up to `positions` sampled token positions
    (engine_topk: per row, (log-probs [T, k], ids [T, k]) of its response positions)."""
    T, grid = trainer["temperature"], trainer["grid"]
    at_t = int((grid - T).abs().argmin())
    p_lp, p_id, e_lp, e_id = [], [], [], []
    for i, (lp, ids) in enumerate(engine_topk):
        keep = [t for t, m in enumerate(batch.loss_masks[i]) if m and t < lp.shape[0]]
        p_lp.append(trainer["top_v"][i, keep] / T - trainer["lse"][i, keep, at_t, None])
        p_id.append(trainer["top_i"][i, keep])
        e_lp.append(lp[keep])
        e_id.append(ids[keep])
    p_lp, p_id, e_lp, e_id = (torch.cat(x) for x in (p_lp, p_id, e_lp, e_id))
    pick = torch.randperm(p_lp.shape[0], generator=torch.Generator().manual_seed(0))[:positions].sort().values
    return {"available": True, **stats.topk_compare((p_lp[pick], p_id[pick]), (e_lp[pick], e_id[pick]))}


def engine_distributions(engine, actor, batch, cfg, k: int, positions: int, prompts: int = 8) -> dict:
    """For an engine that reports sampling log-probs: one sample of each of the batch's first `prompts` prompts with
    the engine's top-k log-probs at every position (SamplingParams.top_logprobs), and the trainer's of the same."""
    import dataclasses

    from postrl.rollout import SamplingParams

    r, G = cfg.rollout, cfg.rollout.n_samples_per_prompt
    chosen = batch.prompt_ids[::G][:prompts]
    params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_tokens, 1, cfg.train.seed, top_logprobs=k)
    done = [c for c in engine.generate(chosen, params) if c.token_ids]
    if not done or done[0].top_logprobs is None:
        return {"available": False, "why": f"the {engine.name} engine reports no top-k log-probs"}
    n = len(done)
    sub = dataclasses.replace(
        batch, prompt_ids=[chosen[c.prompt_index] for c in done], response_ids=[c.token_ids for c in done],
        loss_masks=[[1] * len(c.token_ids) for c in done], turns=[1] * n, finished=[c.finished for c in done],
        scores=[0.0] * n, rewards=[0.0] * n, verifier_metrics=[{}] * n, engine_logprobs=[c.logprobs for c in done],
        multi_modal=[None] * n, versions=[], token_versions=[], segments=[], owners=[],
    )  # fmt: skip
    trainer = trainer_pass(actor, sub, r.temperature, k)
    width = min(min(len(ids) for ids, _ in c.top_logprobs) for c in done)
    engine_topk = [(torch.tensor([lp[:width] for _, lp in c.top_logprobs]), torch.tensor([ids[:width] for ids, _ in c.top_logprobs]))
                   for c in done]  # fmt: skip
    trainer["top_v"], trainer["top_i"] = trainer["top_v"][..., :width], trainer["top_i"][..., :width]
    return compare_distributions(trainer, sub, engine_topk, positions)

"""On-policy distillation's teacher: checked, held beside the policy, and its scoring pass (issue 37).

    before any model loads   `check_tokenizer`: the teacher must share the student's tokenizer
    beside the reference     `build_teacher`: held as the KL reference is (reference.frozen: offload, FSDP2)
    after the ref pass       `score`: teacher log-probs of the sampled tokens (+ its top-k), same micro-batches

Its terms in the update are the actor's (postrl/distill.py, `Distiller`); the formulas are pure functions
in algorithms/distill.py; docs/algorithms.md explains the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from postrl.errors import UserError
from postrl.held import reference
from postrl.models import response_logprobs, resolve_model_path

if TYPE_CHECKING:
    from postrl.actor import Actor, Packed
    from postrl.metrics import Timer
    from postrl.models import Policy
    from postrl.runtime import Runtime


def check_tokenizer(cfg: Any) -> None:
    """Refuse a teacher whose tokenizer differs from the student's, before any model loads.

    The teacher scores the student's token ids, so the two must map ids to the same strings: their
    vocabularies (id -> token, added tokens included) are compared, not their weights (a teacher's
    embedding matrix may be padded beyond its vocabulary, as Qwen2.5's are).
    """
    if not cfg.distill.enable:
        return
    from transformers import AutoTokenizer

    m = cfg.model
    student_path = m.tokenizer_path or resolve_model_path(m.path, m.tiny)
    teacher_path = resolve_model_path(cfg.distill.teacher_path)
    vocabs = []
    for who, path in (("student", student_path), ("teacher", teacher_path)):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(path, trust_remote_code=m.trust_remote_code).get_vocab())
        except (OSError, ValueError) as exc:
            raise UserError(
                f"distill: cannot load the {who}'s tokenizer from '{path}' ({type(exc).__name__}: {exc}); the teacher's "
                "tokenizer is compared with the student's before any model loads. Fix: point distill.teacher_path at a "
                "full model directory (config.json, weights, tokenizer files)."
            ) from None
    student, teacher = vocabs
    if student == teacher:
        return
    differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])
    example = ", ".join(f"{tok!r} -> {i}" for tok, i in differ[:3])
    raise UserError(
        f"distill.teacher_path '{cfg.distill.teacher_path}' has a different tokenizer from the student's ('{student_path}'): "
        f"{len(student)} vs {len(teacher)} tokens, {len(differ)} (token, id) pairs in one but not the other (e.g. {example}). "
        "The teacher scores the student's sampled token ids, so with another vocabulary it would score other text. "
        "Fix: use a teacher of the student's family (same tokenizer), or distil from its outputs off-policy (SFT on "
        "the teacher's samples, `postrl sft`).",
        title="the teacher's tokenizer is not the student's",
    )


def build_teacher(cfg: Any, policy: "Policy", runtime: "Runtime") -> torch.nn.Module | None:
    """The frozen teacher, held where the KL reference is (reference.frozen); None when distillation is off."""
    if not cfg.distill.enable:
        return None
    return reference.frozen(cfg, policy, runtime, resolve_model_path(cfg.distill.teacher_path))


def _teacher_topk(k: int, temperature: float, vocab: int, chunk: int) -> Callable:
    """logits_fn for the teacher's pass: per position, its top-k log-probs (of softmax(z / temperature)) and their ids,
    [M, 2k] (ids as floats: exact below 2^24). Only the student's vocabulary is ranked (padded rows never are sampled)."""

    def fn(logits_MV: torch.Tensor, b_M: torch.Tensor, k_M: torch.Tensor) -> torch.Tensor:
        parts = []
        for lo in range(0, logits_MV.shape[0], chunk):
            s_CV = logits_MV[lo : lo + chunk].float() / temperature
            logp_CV = s_CV - torch.logsumexp(s_CV, -1, keepdim=True)
            values, ids = logp_CV[:, :vocab].topk(k, dim=-1)
            parts.append(torch.cat([values, ids.float()], -1))
        return torch.cat(parts) if parts else logits_MV.new_zeros((0, 2 * k), dtype=torch.float32)

    return fn


@torch.no_grad()
def score(
    teacher: torch.nn.Module | None, actor: "Actor", policy_model: torch.nn.Module, packed: "Packed", runtime: "Runtime", timer: "Timer"
) -> None:
    """The teacher's pass over this rank's rows, in the micro-batches of the reference's pass: log-probs of the
    sampled tokens, its top-1 id, and with distill.top_k its top-k log-probs and ids (postrl.distill.TEACHER_KEYS)."""
    if teacher is None:
        return
    cfg = actor.cfg
    k = max(cfg.distill.top_k, 1)  # top-1 always: distill/top1_agreement
    text = getattr(actor.model.config, "get_text_config", lambda: actor.model.config)()
    fn = _teacher_topk(k, cfg.rollout.temperature, int(text.vocab_size), cfg.train.logprob_chunk_tokens)
    mask = packed.tensors["response_mask"]
    B, T = mask.shape
    logp = torch.zeros((B, T), dtype=torch.float32, device=mask.device)
    top = torch.zeros((B, T, 2 * k), dtype=torch.float32, device=mask.device)
    options = {key: v for key, v in actor._logprob_options.items() if key != "sp_group"}
    if "sp_group" in actor._logprob_options:
        raise UserError("on-policy distillation does not run under train.sequence_parallel_size > 1 yet. Fix: set it to 1.")
    with timer("teacher"), reference.ready(teacher, policy_model, runtime, timer) as model:
        for idx, mb in actor.micro_batches(range(packed.size), packed, log_prob_pass=True):
            t = mb["response_mask"].shape[1]
            with runtime.autocast():
                lp, _, extra = response_logprobs(
                    model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], t, cfg.rollout.temperature,
                    multi_modal=mb.get("multi_modal"), modality=actor.modality, logits_fn=fn, **options,
                )  # fmt: skip
            rows = torch.tensor(idx, device=mask.device)
            logp[rows, :t] = lp
            top[rows, :t] = extra.float()
    x = packed.tensors
    x["teacher_logp"] = logp
    x["teacher_top1"] = top[..., k].long()
    if cfg.distill.top_k:
        x["teacher_topk_logp"], x["teacher_topk_ids"] = top[..., :k], top[..., k:].long()

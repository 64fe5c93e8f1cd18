"""Token-level trajectories: a multi-turn sequence trains on the policy's own tokens only.

A hand-built agent trajectory interleaves model turns with tool results in one token list, its loss mask
1 on the model's tokens. The actor's loss, gradient, KL and entropy must equal the same quantities
computed here by hand from each whole sequence's per-token log-probs with the tool tokens left out (the
formulas of docs/algorithms.md), for every loss_agg_mode; tool tokens must get exactly zero gradient;
packing without padding and token-budget micro-batches must give the padded run's numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_overrides

from postrl.actor import Actor
from postrl.checks import load_config
from postrl.batch import Batch, trajectory_mask
from postrl.experience import batch_metrics
from postrl.models import build_sequences, load_policy
from postrl.rollout import Completion
from postrl.runtime import init_runtime

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # lr is 1e-30 so that both epochs see the same weights; the scheduler notes the wrapped step
    pytest.mark.filterwarnings("ignore:.*optimizer.step.*:UserWarning"),
]

KL_COEF, ENTROPY_COEF, CAP, MAX_TOKENS = 0.1, 0.01, 2.0, 24
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
ADV_B = [1.0, -1.0, 0.5, -1.5]
GARBAGE = 3.0  # old / ref log-probs on tool tokens: if any of them reached the loss, the numbers would move
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

# two prompts x two samples; each response is a list of (text, sampled by the policy)
TRAJECTORIES = [
    # prompt | model turn 1 | tool result 1 | model turn 2 | tool result 2 | model turn 3
    ("What is 3 + 4?", [(" add(3, 4)", 1), ("<tool>7</tool>", 0), (" check 7-4", 1), ("<tool>3</tool>", 0), (" Answer: 7", 1)]),
    ("What is 3 + 4?", [(" add(3,4)", 1), ("<tool>7</tool>", 0), (" 7", 1)]),  # two turns
    ("Name a fruit.", [(" apple", 1)]),  # single turn
    ("Name a fruit.", [(" a pear, or a plum", 1)]),
]


def _completions(tok) -> tuple[list[list[int]], list[Completion]]:
    """The prompts and the completions an agent loop would return for TRAJECTORIES (no log-probs yet)."""
    prompts, completions = [], []
    for i, (prompt, segments) in enumerate(TRAJECTORIES):
        ids, mask, spans = [], [], []
        for text, sampled in segments:
            seg = tok.encode(text)
            if sampled:
                spans.append((len(ids), len(ids) + len(seg)))
            ids += seg
            mask += [sampled] * len(seg)
        multi = len(segments) > 1
        prompts.append(tok.encode(prompt))
        completions.append(
            Completion(i, ids, True, loss_mask=mask if multi else None, turn_spans=spans if multi else None)
        )
    return prompts, completions


def _actor(tmp_path, *extra: str) -> tuple[Actor, object]:
    """An actor on the tiny model (lr ~0: both epochs see the same weights) and its tokenizer."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "rollout.n_samples_per_prompt=2", f"rollout.max_tokens={MAX_TOKENS}", "train.global_batch_size=2",
            "train.lr=1e-30", "train.grad_clip=1e9", "train.epochs_per_batch=2", f"algorithm.kl.coef={KL_COEF}",
            f"algorithm.entropy_coef={ENTROPY_COEF}", f"algorithm.clip_ratio_low={CLIP_LOW}",
            f"algorithm.clip_ratio_high={CLIP_HIGH}", f"algorithm.clip_ratio_c={CLIP_C}",
            f"algorithm.rollout_correction.cap={CAP}", *extra,
        ),
    )  # fmt: skip
    policy = load_policy(cfg.model)
    return Actor(cfg, policy, policy.model, init_runtime("cpu", "float32"), log=lambda *_: None), policy.tokenizer


def _full_sequence(model, prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every response token from one unpadded forward of prompt + response."""
    ids = torch.tensor([prompt + response])
    logits_LV = model(input_ids=ids).logits[0, :-1].float()  # position t predicts token t + 1 (temperature 1)
    logp_L = torch.log_softmax(logits_LV, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    entropy_L = torch.logsumexp(logits_LV, -1) - (torch.softmax(logits_LV, -1) * logits_LV).sum(-1)
    P = len(prompt)
    return logp_L[P - 1 :], entropy_L[P - 1 :]


def _inputs(actor: Actor, tok):
    """The batch and the old / ref / engine log-probs of every response token: near the policy's own on
    model tokens (far enough that the clip and the dual clip fire), GARBAGE (old, ref) and 0.0 (engine,
    as the Completion contract says) on tool tokens. Row 3's engine log-probs sit 0.15 per token below the
    trainer's, so that sequence-level correction masks it out; on rows 0-1 only the tool tokens would."""
    prompts, completions = _completions(tok)
    gen = torch.Generator().manual_seed(0)
    old, ref, engine = [], [], []
    for p, c in zip(prompts, completions):
        with torch.no_grad():
            logp, _ = _full_sequence(actor.model, p, c.token_ids)
        m = torch.tensor(trajectory_mask(c), dtype=torch.bool)
        noise = torch.randn(len(m), generator=gen)
        o = torch.where(m, logp + 1.0 * noise, GARBAGE)
        old.append(o)
        ref.append(torch.where(m, logp + 0.3 * torch.randn(len(m), generator=gen), GARBAGE))
        gap = -0.15 if c.prompt_index == 3 else 0.05 * torch.randn(len(m), generator=gen)
        engine.append(torch.where(m, o + gap, 0.0))
        c.logprobs = engine[-1].tolist()
    B = len(completions)
    batch = Batch(
        prompt_ids=prompts,
        response_ids=[c.token_ids for c in completions],
        loss_masks=[trajectory_mask(c) for c in completions],
        turns=[len(c.turn_spans) if c.turn_spans else 1 for c in completions],
        finished=[c.finished for c in completions],
        scores=[0.0] * B,
        rewards=[0.0] * B,
        verifier_metrics=[{}] * B,
        engine_logprobs=[c.logprobs for c in completions],
        multi_modal=[None] * B,
    )
    return batch, old, ref, engine


def _padded(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _run_update(actor: Actor, batch: Batch, old, ref) -> tuple[dict[str, float], torch.Tensor]:
    """The actor's update on the batch; returns its metrics and its gradient (flat, before the step)."""
    packed = actor.pack(batch, torch.tensor(ADV_B))
    assert packed.lengths == batch.lengths  # one process: the rows stay in order
    T = packed.tensors["response_mask"].shape[1]
    packed.tensors["old_logp"] = _padded(old, T)
    packed.tensors["ref_logp"] = _padded(ref, T)
    grads: list[torch.Tensor] = []
    step = actor.optimizer.step

    def capture_then_step():
        if not grads:
            grads.extend(p.grad.detach().flatten().clone() for p in actor.params)
        step()

    actor.optimizer.step = capture_then_step
    stats = actor.update(packed, use_ref=True)
    actor.optimizer.step = step
    return stats, torch.cat(grads)


def _by_hand(actor: Actor, batch: Batch, old, ref, engine, mode: str, loss: str, level: str | None):
    """Loss terms and gradient from each whole sequence's log-probs at its model tokens only."""
    model = actor.model
    model.zero_grad(set_to_none=True)
    pg, kl, ent = [], [], []  # per kept sequence: one value per model token
    ent_all_tokens = []  # actor/entropy covers every sequence, rejected or not
    for i in range(batch.size):
        logp_all, ent_all = _full_sequence(model, batch.prompt_ids[i], batch.response_ids[i])
        m = torch.tensor(batch.loss_masks[i], dtype=torch.bool)
        lp, o, r, q, A = logp_all[m], old[i][m], ref[i][m], engine[i][m], ADV_B[i]
        if loss == "vanilla":
            ratio = torch.exp(torch.clamp(lp - o, -20, 20))
            l = torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
            if A < 0:
                l = torch.minimum(l, torch.full_like(l, -A * CLIP_C))
        elif loss == "gspo":
            s = torch.exp((lp - o).mean()).detach()
            s_t = s * torch.exp(lp - lp.detach())
            l = torch.maximum(-A * s_t, -A * torch.clamp(s_t, 1 - CLIP_LOW, 1 + CLIP_HIGH))
        else:
            assert loss == "cispo"
            w = torch.clamp(torch.exp(lp - o), 1 - CLIP_LOW, 1 + CLIP_HIGH).detach()
            l = -w * A * lp
        if level == "token":
            l = l * torch.clamp(torch.exp(o - q), max=CAP)
        d = r - lp
        ent_all_tokens.append(ent_all[m])
        if level == "sequence" and abs(float((o - q).sum())) > math.log(CAP):
            continue  # rejected: it leaves every loss term and the normalisers (algorithms.rollout_correction)
        pg.append(l)
        kl.append(torch.exp(d) - d - 1)
        ent.append(ent_all[m])

    def agg(xs: list[torch.Tensor]) -> torch.Tensor:
        B, n_tokens = len(xs), sum(len(x) for x in xs)
        if mode == "token-mean":
            return sum(x.sum() for x in xs) / n_tokens
        if mode == "seq-mean-token-mean":
            return sum(x.mean() for x in xs) / B
        if mode == "seq-mean-token-sum":
            return sum(x.sum() for x in xs) / B
        assert mode == "seq-mean-token-sum-norm"
        return sum(x.sum() for x in xs) / (B * MAX_TOKENS)

    pg_loss, kl_loss = agg(pg), agg(kl)
    (pg_loss + KL_COEF * kl_loss - ENTROPY_COEF * agg(ent)).backward()
    grad = torch.cat([p.grad.flatten() for p in actor.params])
    entropy = torch.cat(ent_all_tokens).mean()  # actor/entropy: the mean over model tokens, whatever the mode
    return {"actor/pg_loss": pg_loss.item(), "actor/kl_loss": kl_loss.item(), "actor/entropy": entropy.item()}, grad


CASES = [(mode, "vanilla", "token") for mode in MODES] + [
    ("seq-mean-token-mean", "gspo", "sequence"),  # MIS sums the log-ratio over model tokens only
    ("token-mean", "cispo", None),
]


@pytest.mark.parametrize("mode, loss, level", CASES)
def test_trajectory_loss_and_gradient_equal_the_model_tokens_by_hand(tmp_path, mode, loss, level):
    actor, tok = _actor(
        tmp_path, f"algorithm.loss_agg_mode={mode}", f"algorithm.policy_loss={loss}", "train.micro_batch_size=2",
        f"algorithm.rollout_correction.enable={level is not None}", f"algorithm.rollout_correction.level={level or 'token'}",
        "train.use_remove_padding=false",
    )  # fmt: skip
    batch, old, ref, engine = _inputs(actor, tok)
    stats, grad = _run_update(actor, batch, old, ref)
    want, want_grad = _by_hand(actor, batch, old, ref, engine, mode, loss, level)
    for key, value in want.items():
        assert stats[key] == pytest.approx(value, abs=1e-5), (key, stats[key], value)
    assert grad.abs().max() > 1e-3, "the check needs a real gradient"
    torch.testing.assert_close(grad, want_grad, atol=2e-6, rtol=1e-4)
    if loss == "vanilla":  # the data hits both clip sides and the dual clip
        assert 0 < stats["actor/pg_clipfrac"] < 1 and stats["actor/pg_clipfrac_lower"] > 0
    if level == "sequence":  # row 3 is masked out; rows 0-1 stay in only because their tool tokens are left out
        def kept(lo, hi):
            return [abs(float((lo[i] - hi[i]).sum())) <= math.log(CAP) for i in range(batch.size)]

        model_only = [(o[torch.tensor(m) == 1], q[torch.tensor(m) == 1]) for o, q, m in zip(old, engine, batch.loss_masks)]
        assert kept(*zip(*model_only)) == [True, True, True, False]
        assert kept(old, engine) == [False, False, True, False]  # what summing over every token would decide
        assert 0 < stats["rollout_corr/masked_frac"] < 1


def test_tool_tokens_get_exactly_zero_gradient(tmp_path):
    """The gradient of the loss w.r.t. the logits that predict tool tokens (and padding) is exactly 0;
    it is not 0 on model tokens."""
    actor, tok = _actor(
        tmp_path, "train.micro_batch_size=4", "train.use_remove_padding=false", "algorithm.rollout_correction.enable=true"
    )
    batch, old, ref, _ = _inputs(actor, tok)
    grads: list[torch.Tensor] = []

    def keep_grad(module, inputs, out):
        if out.requires_grad:
            out.register_hook(grads.append)

    handle = actor.model.lm_head.register_forward_hook(keep_grad)
    _run_update(actor, batch, old, ref)
    handle.remove()
    mask_BT = actor.pack(batch, torch.tensor(ADV_B)).tensors["response_mask"].bool()
    g_BT = grads[0].abs().amax(-1)  # [B, T]: row t holds the logits that predict response token t
    assert g_BT.shape == mask_BT.shape
    assert float(g_BT[~mask_BT].max()) == 0.0
    assert bool((g_BT[mask_BT] > 0).all())
    tool = torch.zeros_like(mask_BT)
    for i, m in enumerate(batch.loss_masks):
        tool[i, : len(m)] = torch.tensor(m) == 0
    assert int(tool.sum()) == 3 * 14 and float(g_BT[tool].max()) == 0.0  # 3 tool results of 14 tokens


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_and_token_budget_micro_batches_equal_padded(tmp_path, mode):
    """train.use_remove_padding (prompts shared within a group) and use_dynamic_bsz give the padded run's
    loss, KL, entropy and gradient within 1e-5 on multi-turn trajectories."""
    runs = []
    layouts = [
        ("train.use_remove_padding=false", "train.micro_batch_size=4"),
        ("train.use_remove_padding=true", "train.micro_batch_size=4"),
        ("train.use_remove_padding=true", "train.micro_batch_size=1"),
        ("train.use_remove_padding=true", "train.use_dynamic_bsz=true", "train.max_token_len_per_device=60"),
        ("train.use_remove_padding=false", "train.use_dynamic_bsz=true", "train.max_token_len_per_device=60"),
    ]
    for i, layout in enumerate(layouts):
        rc = "algorithm.rollout_correction.enable=true"
        actor, tok = _actor(tmp_path / str(i), f"algorithm.loss_agg_mode={mode}", rc, *layout)
        batch, old, ref, _ = _inputs(actor, tok)
        runs.append(_run_update(actor, batch, old, ref))
    (padded, grad), rest = runs[0], runs[1:]
    for stats, g in rest:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "actor/pg_clipfrac"):
            assert abs(stats[key] - padded[key]) < 1e-5, (key, stats[key], padded[key])
        assert float((g - grad).abs().max()) < 1e-5


# ------------------------------------------------------------------------------------- the record


def test_build_sequences_attends_to_every_token_and_masks_the_loss_to_model_tokens():
    t = build_sequences([[5, 6], [7]], [[10, 11, 12, 13, 14], [20, 21]], 0, [[1, 0, 0, 1, 1], [1, 1]])
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert t["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 2, 2, 2]]
    single = build_sequences([[5, 6], [7]], [[10, 11, 12, 13, 14], [20, 21]], 0)  # loss mask = attention
    assert single["response_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert torch.equal(single["attention_mask"], t["attention_mask"])


def test_micro_batches_keep_the_whole_trajectory_and_align_engine_logprobs(tmp_path):
    """A micro-batch is as wide as its longest real response, not its longest run of model tokens; the
    engine's log-probs sit on their own tokens."""
    actor, tok = _actor(tmp_path, "train.micro_batch_size=1")
    batch, _, _, engine = _inputs(actor, tok)
    packed = actor.pack(batch, torch.tensor(ADV_B))
    for (idx,), mb in actor.micro_batches(range(batch.size), packed):
        n = len(batch.response_ids[idx])
        assert mb["response_mask"].shape[1] == n  # row 0: 52 tokens, 24 of them the model's
        assert mb["response_mask"][0].tolist() == batch.loss_masks[idx]
        assert mb["input_ids"][0, -n:].tolist() == batch.response_ids[idx]
        assert torch.equal(mb["engine_logp"][0], engine[idx])
    assert [len(r) for r in batch.response_ids][0] > sum(batch.loss_masks[0])


def test_trajectory_mask_of_a_completion():
    assert trajectory_mask(Completion(0, [4, 5, 6], True)) == [1, 1, 1]  # single turn: every token
    assert trajectory_mask(Completion(0, [4, 5, 6], True, loss_mask=[1, 0, 1])) == [1, 0, 1]
    with pytest.raises(AssertionError, match="2 entries for 3 tokens"):
        trajectory_mask(Completion(0, [4, 5, 6], True, loss_mask=[1, 0]))


class _ScriptedAgent:
    """A rollout engine that returns TRAJECTORIES (with engine log-probs) as an agent loop would."""

    name = "scripted"

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, params, multi_modal=None):
        _, completions = _completions(self.tok)
        assert params.n == 2 and len(prompts) == 2
        for c in completions:
            c.prompt_index //= 2  # two samples per prompt
            c.logprobs = [-0.5 if m else 0.0 for m in trajectory_mask(c)]
        return completions


def test_experience_turns_agent_completions_into_a_batch(tmp_path):
    """Completion -> Batch: loss masks (all ones for single turns), turns and engine log-probs pass through;
    DAPO's overlong shaping measures the model's tokens: row 0 has 24 of them (penalty -(24 - 16) / 8 = -1)
    among 52 tokens (which would give -4.5); row 1 has 10 of 24 (no penalty, -1 on all tokens)."""
    from postrl.data.dataset import PromptExample, PromptSampler
    from postrl.experience import Experience
    from postrl.metrics import Timer
    from postrl.rewards.registry import RewardFunction, register
    from postrl.rewards.verdict import _REGISTRY

    if "trajectory_one" not in _REGISTRY:
        register("trajectory_one", in_process=True)(lambda completion, ground_truth, row: 1.0)
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=8",
            f"rollout.max_tokens={MAX_TOKENS}", "rollout.n_samples_per_prompt=2", "train.global_batch_size=2",
            "data.shuffle=false", "reward.verifiers=[trajectory_one]",
        ),
    )  # fmt: skip
    tok = load_policy(cfg.model).tokenizer
    examples = [PromptExample(tok.encode(q), "", {}, "test") for q, _ in TRAJECTORIES[::2]]
    reward_fn = RewardFunction(cfg.reward)
    experience = Experience(cfg, _ScriptedAgent(tok), tok, reward_fn, examples, PromptSampler(2, cfg.data.shuffle, 0))
    batch, _ = experience.collect(0, Timer())
    reward_fn.close()
    _, want = _completions(tok)
    assert batch.response_ids == [c.token_ids for c in want]
    assert batch.loss_masks == [trajectory_mask(c) for c in want]
    assert batch.loss_masks[2] == [1, 1, 1] and batch.turns == [3, 2, 1, 1]
    assert batch.model_tokens == [24, 10, 3, 15] and [len(r) for r in batch.response_ids] == [52, 24, 3, 15]
    assert batch.engine_logprobs[1] == [-0.5 if m else 0.0 for m in batch.loss_masks[1]]
    assert batch.scores == [1.0] * 4 and batch.rewards == [0.0, 1.0, 1.0, 1.0]
    m = batch_metrics(batch, "grpo", 2)
    assert m["response_length/mean"] == 13.0 and m["response_length/total_mean"] == 23.5 and m["num_turns/mean"] == 1.75


def _record(responses, masks, turns) -> Batch:
    B = len(responses)
    return Batch(
        prompt_ids=[[1, 2, 3]] * B, response_ids=responses, loss_masks=masks, turns=turns, finished=[True] * (B - 1) + [False],
        scores=[1.0, 0.0] * (B // 2), rewards=[1.0, 0.0] * (B // 2), verifier_metrics=[{}] * B,
        engine_logprobs=[None] * B, multi_modal=[None] * B,
    )  # fmt: skip


def test_response_length_metrics_count_model_tokens():
    single = batch_metrics(_record([[7] * 4, [7] * 6], [[1] * 4, [1] * 6], [1, 1]), "grpo", 2)
    assert {k: v for k, v in single.items() if k.startswith(("response_length", "num_turns"))} == {
        "response_length/mean": 5.0, "response_length/max": 6.0, "response_length/min": 4.0,
        "response_length/total_mean": 5.0, "response_length/total_max": 6.0, "response_length/clip_ratio": 0.5,
    }  # fmt: skip
    # a 3-turn trajectory of 10 tokens (6 the model's) and a single turn of 3
    multi = batch_metrics(_record([[7] * 10, [7] * 3], [[1, 1, 0, 0, 1, 1, 0, 1, 1, 0], [1] * 3], [3, 1]), "grpo", 2)
    assert multi["response_length/mean"] == 4.5 and multi["response_length/max"] == 6.0
    assert multi["response_length/min"] == 3.0
    assert multi["response_length/total_mean"] == 6.5 and multi["response_length/total_max"] == 10.0
    assert multi["num_turns/mean"] == 2.0 and multi["num_turns/max"] == 3.0

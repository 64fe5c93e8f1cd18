"""PPO with a critic (issue 25): GAE and the clipped value loss by hand, a short PPO run, its bit-exact
resume, and (slow) the learning test from the `make run` SFT model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides, tiny_trainer
from verifiers_for_tests import length_parity

from postrl import algorithms as algo
from postrl.checks import load_config
from postrl.metrics import read_jsonl
from postrl.rewards.registry import register
from postrl.trainer import Trainer

register("critic_length_parity", in_process=True)(length_parity)  # in-process: no verifier workers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_gae_skips_tool_tokens_and_trailing_padding_by_hand():
    """Row 0: model, tool, model, model, pad; reward 1 on its last model token. Row 1: two model tokens, pad.
    gamma 0.9, lambda 0.8 (gamma lambda = 0.72); the tool token's and the padding's values (9, 7) are never read.

    row 0: t=3  delta = 1 - 0.4 = 0.6                      A = 0.6
           t=2  delta = 0.9 * 0.4 - 0.2 = 0.16             A = 0.16 + 0.72 * 0.6 = 0.592
           t=1  tool token: skipped                        A = 0
           t=0  delta = 0.9 * V_2 - 0.5 = 0.18 - 0.5       A = -0.32 + 0.72 * 0.592 = 0.10624
    row 1: t=1  delta = -1 - 0.3 = -1.3                    A = -1.3
           t=0  delta = 0.9 * 0.3 - 0.1 = 0.17             A = 0.17 + 0.72 * -1.3 = -0.766
    returns = A + V on model tokens.
    """
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.4, 7.0], [0.1, 0.3, 7.0, 7.0, 7.0]])
    rewards = algo.terminal_rewards(torch.tensor([1.0, -1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 1, 0], [0, -1, 0, 0, 0]]
    adv, ret = algo.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.10624, 0.0, 0.592, 0.6, 0.0], [-0.766, -1.3, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.60624, 0.0, 0.792, 1.0, 0.0], [-0.666, -1.0, 0.0, 0.0, 0.0]]))

    # gamma = lambda = 1 (verl's defaults): A_t = R - V_t on every model token, returns = R.
    adv1, ret1 = algo.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv1, torch.tensor([[0.5, 0, 0.8, 0.6, 0], [-1.1, -1.3, 0, 0, 0]]))
    torch.testing.assert_close(ret1, torch.tensor([[1.0, 0, 1.0, 1.0, 0], [-1.0, -1.0, 0, 0, 0]]))

    # Whitening over the batch's 5 model tokens: mean -0.15352, unbiased variance; masked positions stay 0.
    w = algo.masked_whiten(adv, mask)
    x = torch.tensor([0.10624, 0.592, 0.6, -0.766, -1.3])
    expect = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(w[mask.bool()], expect)
    assert w[~mask.bool()].abs().sum() == 0


def test_value_loss_clips_by_hand():
    """c = 0.2. Token 0: V moved 0.5 from V_old = 0, clipped to 0.2; (0.5-1)^2 = 0.25 < (0.2-1)^2 = 0.64, so the
    clipped term wins: 0.5 * 0.64 = 0.32 (a clipped token). Token 1: moved 0.1, inside: 0.5 * 1.1^2 = 0.605.
    Token 2 is masked. token-mean: (0.32 + 0.605) / 2 = 0.4625; clipfrac 1/2."""
    v_old = torch.tensor([[0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 1.1, -3.0]])
    ret = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss_BT, stats = algo.value_loss(v, v_old, ret, mask, cliprange_value=0.2)
    torch.testing.assert_close(loss_BT[0, :2], torch.tensor([0.32, 0.605]))
    assert float(stats["critic/vf_clipfrac"]) == 0.5
    torch.testing.assert_close(algo.aggregate_loss(loss_BT, mask, "token-mean"), torch.tensor(0.4625))
    # When V falls below V_old - c and the target lies below too, the unclipped term is the larger one.
    loss2, stats2 = algo.value_loss(torch.tensor([[-0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), cliprange_value=0.2)
    torch.testing.assert_close(loss2, torch.tensor([[0.5 * 1.5**2]]))
    assert float(stats2["critic/vf_clipfrac"]) == 0.0


def test_kl_in_the_reward_needs_a_per_token_estimator(tmp_path):
    with pytest.raises(Exception, match="use_kl_in_reward puts a KL penalty on every token"):
        load_config(None, tiny_overrides(tmp_path, "algorithm.use_kl_in_reward=true"))


# ------------------------------------------------------------------------------------ PPO runs
PPO = (
    "algorithm.adv_estimator=gae", "algorithm.gamma=0.95", "algorithm.lam=0.9", "critic.lr=1e-3", "critic.warmup_steps=2",
    "critic.cliprange_value=0.2", "reward.verifiers=[critic_length_parity]", "train.mini_batch_size=2", "train.lr=2e-3",
    "train.deterministic=true", "checkpoint.save_freq=2", "train.seed=3", "logging.sinks=[jsonl]",
    "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05",
)  # fmt: skip


class _Stop(Exception):
    pass


def _trainer(run_dir: Path) -> Trainer:
    return tiny_trainer(run_dir, "logging.sinks=[console,jsonl]", *PPO)


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = {r["step"]: r for r in read_jsonl(run_dir / "run" / "metrics.jsonl") if "timing/all" in r}
    return {s: {k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_tps")} for s, r in rows.items()}


def test_ppo_runs_and_resumes_bit_for_bit(tmp_path):
    """3 PPO steps (two optimizer steps per batch, old log-probs, critic warmup, KL in the reward) == 2 steps, stop,
    resume, 1 more:
    the critic's and the policy's weights, the critic's AdamW state and every logged number of step 3."""
    full = _trainer(tmp_path / "full")
    full.fit()
    rows = _rows(tmp_path / "full")
    assert sorted(rows) == [1, 2, 3]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "critic/values/mean", "critic/returns/max", "critic/advantages/min", "actor/pg_loss"):  # fmt: skip
        assert key in rows[3], key
    assert [rows[s]["critic/lr"] for s in (1, 2, 3)] == pytest.approx([5e-4, 1e-3, 1e-3])  # warmup 2, then constant
    assert abs(rows[1]["critic/advantages/mean"]) < 1e-5  # whitened over the batch's model tokens
    assert rows[1]["actor/reward_kl_penalty"] == 0 < rows[3]["actor/reward_kl_penalty"]  # the policy leaves the reference
    assert rows[3]["actor/kl_loss"] == 0  # the KL is in the reward, not a loss (algorithm.kl.coef 0)
    assert rows[1]["critic/vf_loss"] > 0 and any(rows[s]["critic/vf_clipfrac"] > 0 for s in rows)
    ckpt = tmp_path / "full" / "run" / "checkpoints" / "iter_0000002" / "critic"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model", "optimizer_rank0.pt", "scheduler.pt"]

    first = _trainer(tmp_path / "split")
    real_step = first.train_step

    def step_unless_stopped():
        if first.step == 2:
            raise _Stop
        return real_step()

    first.train_step = step_unless_stopped
    with pytest.raises(_Stop):
        first.fit()
    first.close()
    del first
    resumed = _trainer(tmp_path / "split")
    assert resumed.step == 2 and "resumed from" in resumed.console.file.getvalue()
    resumed.fit()

    for model_a, model_b in ((full.critic.model, resumed.critic.model), (full.model, resumed.model)):
        a, b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
        assert [k for k in a if not torch.equal(a[k], b[k])] == []
    sa, sb = full.critic.optimizer.state_dict(), resumed.critic.optimizer.state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    ra, rb = _rows(tmp_path / "full"), _rows(tmp_path / "split")
    assert ra[3] == rb[3], {k: (ra[3].get(k), rb[3].get(k)) for k in ra[3].keys() | rb[3].keys() if ra[3].get(k) != rb[3].get(k)}


# ------------------------------------------------------------------------------- learning (slow)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = 10  # measured: see the docstring


@pytest.mark.slow
def test_ppo_from_the_sft_model_lifts_held_out_greedy_accuracy_by_15_points(sft_model, tmp_path):
    """configs/tiny_ppo.yaml, shortened to STEPS steps. Measured (200 held-out prompts, greedy): 12.0% after SFT,
    51.0% after 5 PPO steps, 52.0% after 10, 50.0% after 15, 51.5% after 20. The critic's mean value starts at
    ~0 (a fresh head) against returns of ~0.45 and tracks them within a few hundredths after a few steps."""
    cfg = load_config(
        CONFIGS / "tiny_ppo.yaml",
        [
            f"model.path={sft_model}", f"train.total_steps={STEPS}", "eval.freq=0", "eval.max_prompts=200",
            f"logging.dir={tmp_path}/rl", "logging.progress=false", "checkpoint.keep_best=null",
        ],
    )  # fmt: skip
    Trainer(cfg).fit()
    rows = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    val = [r["val/arithmetic/acc_mean@1"] for r in rows if "val/arithmetic/acc_mean@1" in r]
    assert len(val) == 2 and val[0] < 0.35, val
    assert val[-1] - val[0] >= 0.15, val
    gaps = [abs(r["critic/values/mean"] - r["critic/returns/mean"]) for r in rows if "critic/values/mean" in r]
    assert gaps[0] > 0.3 and gaps[-1] < 0.5 * gaps[0], gaps  # the critic learns the value of the policy's states

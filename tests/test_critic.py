"""PPO with a critic (issue 25): GAE and the clipped value loss by hand, a short PPO run, its bit-exact
resume, and (slow) the learning test from the `make run` SFT model."""

from __future__ import annotations

import pytest
import torch

from postrl import algorithms as algo

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

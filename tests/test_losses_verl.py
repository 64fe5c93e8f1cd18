"""verl's other policy losses (gpg, sapo, geo_mean, clip_cov, kl_cov): equal to verl's functions, and by hand.

verl's own functions (verl/trainer/ppo/core_algos.py, compute_policy_loss_<name>, at verl commit b178a3c) were run
on the seeded random cases below; their loss, gradient with respect to log_prob and metrics are stored in
tests/data/verl_policy_losses.json. The tests compute the same with postrl's registered loss and postrl's
aggregation and compare to 1e-7 relative (float64). Where verl imports, the last test recomputes verl's side and checks the
stored file; `python tests/test_losses_verl.py` (with verl importable) rewrites it. clip_cov picks its tokens with
torch.randperm on the global generator: both sides seed it alike before the call.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from postrl.algorithms import aggregate_loss, get_policy_loss_fn, policy_loss_spec, token_covariance
from postrl.checks import load_config
from postrl.config import build_config
from postrl.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REFERENCE = Path(__file__).resolve().parent / "data" / "verl_policy_losses.json"
F64 = torch.float64
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
# name -> (loss_agg_mode, policy_loss_args): the defaults, and settings that make the selection rules act on 40 tokens
CASES = {
    "gpg": [("token-mean", {}), ("seq-mean-token-sum", {})],
    "sapo": [("seq-mean-token-mean", {}), ("seq-mean-token-mean", {"tau_pos": 2.0, "tau_neg": 3.0})],
    "geo_mean": [("seq-mean-token-mean", {})],
    "clip_cov": [("token-mean", {}), ("token-mean", {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.5, "clip_cov_ub": 3.0})],
    "kl_cov": [("token-mean", {}), ("seq-mean-token-mean", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0})],
}
# verl's metric name -> postrl's (kl_cov's ppo_kl is verl's mean |logp - logp_old|)
METRICS = {"actor/pg_clipfrac": "pg_clipfrac", "actor/pg_clipfrac_lower": "pg_clipfrac_lower", "actor/ppo_kl": "ppo_kl"}


def random_case(seed: int) -> tuple[torch.Tensor, ...]:
    """old_logp, logp, adv, mask [6, 7] in float64: unequal lengths (1-7), token-level advantages around a per-row one."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    old_logp = -torch.rand(B, T, generator=g, dtype=F64) * 4
    logp = old_logp + 0.4 * torch.randn(B, T, generator=g, dtype=F64)  # ratios on both sides of the clip range
    adv = 1.5 * torch.randn(B, 1, generator=g, dtype=F64) + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.arange(T)[None, :] < torch.tensor([7, 1, 4, 6, 3, 7])[:, None]).to(F64)
    return old_logp, logp, adv, mask


def case_keys():
    return [(name, i) for name, cases in CASES.items() for i in range(len(cases))]


def postrl_side(name: str, i: int) -> dict:
    mode, args = CASES[name][i]
    old_logp, logp, adv, mask = random_case(i)
    logp.requires_grad_(True)
    fn = get_policy_loss_fn(name)
    params = {k: p.default for k, p in policy_loss_spec(fn).params.items()} | args
    torch.manual_seed(1000 + i)
    loss_BT, stats = fn(logp, old_logp, adv, mask, **CLIP, clip_ratio_c=3.0, **params)
    loss = aggregate_loss(loss_BT, mask, mode)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": logp.grad.flatten().tolist(), "stats": {k: float(v) for k, v in stats.items()}}


def _import_verl():
    """verl's core_algos; verl b178a3c imports transformers 4's AutoModelForVision2Seq (transformers 5:
    AutoModelForImageTextToText) in a module the losses never use."""
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
    from verl.trainer.ppo import core_algos

    return core_algos


def verl_side(name: str, i: int) -> dict:
    """verl's function on the same case (needs verl importable)."""
    _import_verl()
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    mode, args = CASES[name][i]
    old_logp, logp, adv, mask = random_case(i)
    logp.requires_grad_(True)
    taus = {k: args[k] for k in ("tau_pos", "tau_neg") if k in args}
    cfg = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, **CLIP, clip_ratio_c=3.0,
        loss_agg_mode=mode, **taus, policy_loss=PolicyLossConfig(loss_mode=name, **{k: v for k, v in args.items() if k not in taus}),
    )  # fmt: skip
    torch.manual_seed(1000 + i)
    loss, metrics = core_algos.get_policy_loss_fn(name)(old_logp, logp, adv, mask, loss_agg_mode=mode, config=cfg)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": logp.grad.flatten().tolist(), "metrics": {k: float(v) for k, v in metrics.items()}}


@pytest.mark.parametrize("name,i", case_keys())
def test_equal_to_verls_function_on_random_inputs(name, i):
    expected = json.loads(REFERENCE.read_text())[f"{name}/{i}"]
    got = postrl_side(name, i)
    # rel 1e-7: verl's seq-mean-token-mean divides by (tokens + 1e-8), postrl by the tokens
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-10, rel=1e-7)
    torch.testing.assert_close(torch.tensor(got["grad"]), torch.tensor(expected["grad"]), atol=1e-10, rtol=1e-7)
    assert any(abs(g) > 1e-3 for g in got["grad"])  # the comparison is not between zeros
    for verl_name, value in expected["metrics"].items():
        ours = "ppo_kl_abs" if (name, verl_name) == ("kl_cov", "actor/ppo_kl") else METRICS[verl_name]
        assert got["stats"][ours] == pytest.approx(value, abs=1e-10, rel=1e-7), verl_name  # verl: mask sum + 1e-8


def test_the_selection_rules_act_in_the_reference_cases():
    # the cases are not degenerate: clip_cov detaches tokens (4 of 28 with ratio 0.1), kl_cov penalises 2 of 28
    assert postrl_side("clip_cov", 1)["stats"]["pg_clipfrac"] == pytest.approx(2 / 28)
    assert postrl_side("clip_cov", 0)["stats"]["pg_clipfrac"] == pytest.approx(1 / 28)
    assert postrl_side("kl_cov", 1)["stats"]["pg_clipfrac"] == pytest.approx(2 / 28)


def test_stored_reference_is_what_verl_computes():
    pytest.importorskip("verl")
    _import_verl()
    stored = json.loads(REFERENCE.read_text())
    for name, i in case_keys():
        fresh = verl_side(name, i)
        assert fresh["loss"] == pytest.approx(stored[f"{name}/{i}"]["loss"], abs=1e-12)
        assert fresh["grad"] == pytest.approx(stored[f"{name}/{i}"]["grad"], abs=1e-12)


# ------------------------------------------------------------------------------------ by hand


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def call(name: str, logp, old_logp, adv, mask, **args):
    fn = get_policy_loss_fn(name)
    params = {k: p.default for k, p in policy_loss_spec(fn).params.items()} | args
    return fn(logp, old_logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, **params)


def test_registered_with_verls_parameters_and_defaults():
    spec = {n: policy_loss_spec(get_policy_loss_fn(n)) for n in CASES}
    assert {k: p.default for k, p in spec["clip_cov"].params.items()} == {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    assert {k: p.default for k, p in spec["kl_cov"].params.items()} == {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}
    assert {k: p.default for k, p in spec["sapo"].params.items()} == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert spec["sapo"].defaults == spec["geo_mean"].defaults == {"loss_agg_mode": "seq-mean-token-mean"}
    assert spec["gpg"].defaults == {"loss_agg_mode": "token-mean"} and spec["clip_cov"].defaults == {}
    a = build_config({"model": {"path": "m"}, "algorithm": {"policy_loss": "kl_cov", "policy_loss_args": {"kl_cov_ratio": 0.002}}}).algorithm
    assert a.policy_loss_args == {"kl_cov_ratio": 0.002, "ppo_kl_coef": 0.1}


def test_gpg_is_minus_a_logp_whatever_the_ratio():
    # l = -A logp: A = 2, logp = ln 0.5 -> 1.386294; A = -1, logp = ln 0.2 -> -1.609438; ratio e^3 is not clipped
    logp = t([[math.log(0.5), math.log(0.2)]]).requires_grad_(True)
    loss, stats = call("gpg", logp, logp.detach() - t([[3.0, 0.0]]), t([[2.0, -1.0]]), t([[1.0, 1.0]]))
    torch.testing.assert_close(loss, t([[-2 * math.log(0.5), math.log(0.2)]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 1.0]]))  # -A
    assert float(stats["pg_clipfrac"]) == 0.0 and float(stats["ppo_kl"]) == pytest.approx(-1.5)  # mean(old - logp)


def test_sapo_gate_is_vanilla_on_policy_and_damped_off_policy():
    # r = 1: f = sigmoid(0) x 4 / tau = 2 / tau; l = -2A / tau: A = 1, tau_pos 1 -> -2; A = -1, tau_neg 1.05 -> 1.904762
    logp = t([[-1.0, -1.0, -1.0 + math.log(2.0)]]).requires_grad_(True)
    loss, _ = call("sapo", logp, t([[-1.0, -1.0, -1.0]]), t([[1.0, -1.0, 1.0]]), t([[1.0, 1.0, 1.0]]))
    # r = 2, A = 1: sigmoid(1) = 0.731059 x 4 = 2.924234 -> l = -2.924234
    torch.testing.assert_close(loss, t([[-2.0, 2 / 1.05, -4 * (1 / (1 + math.exp(-1)))]]))
    loss.sum().backward()
    # dl/dlogp = -A 4 s (1 - s) r: r = 1 -> -A (vanilla's -A r); r = 2 -> -4 x 0.731059 x 0.268941 x 2 = -1.572895
    s = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(logp.grad, t([[-1.0, 1.0, -8 * s * (1 - s)]]))


def test_geo_mean_clips_each_token_in_log_space_and_takes_the_geometric_mean():
    # row 0, A = +1: d = (0.5, -0.1) -> pessimistic (min(d, clip(d, -0.2, 0.28))) = (0.28, -0.1); s = e^0.09
    # row 1, A = -1: d = (-0.5, 0.1, masked) -> max(d, clip) = (-0.2, 0.1); s = e^-0.05; l = +e^-0.05
    logp = t([[0.5, -0.1], [-0.5, 0.1]]).requires_grad_(True)
    old, mask = torch.zeros(2, 2, dtype=F64), t([[1.0, 1.0], [1.0, 1.0]])
    loss, stats = call("geo_mean", logp, old, t([[1.0, 1.0], [-1.0, -1.0]]), mask)
    torch.testing.assert_close(loss, t([[-math.exp(0.09)] * 2, [math.exp(-0.05)] * 2]), atol=1e-7, rtol=0)
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    # mean over 2 rows of l_i; dl_0/dd_t = -s_0 / 2 where unclipped (token 2), 0 where clipped (token 1), halved by the mean
    torch.testing.assert_close(logp.grad, t([[0.0, -math.exp(0.09) / 4], [0.0, math.exp(-0.05) / 4]]), atol=1e-7, rtol=0)
    assert float(stats["pg_clipfrac"]) == pytest.approx(1 / 4) and float(stats["pg_clipfrac_lower"]) == pytest.approx(1 / 4)


def covariance_case():
    # 4 tokens; A = (2, 2, -2, -2) (mean 0), logp = (-0.5, -2.5, -0.5, -2.5) (mean -1.5)
    # c = A' x logp' = (2 x 1, 2 x -1, -2 x 1, -2 x -1) = (2, -2, -2, 2): tokens 0 and 3 raise confidence where
    # it pays (a likely token pushed up, an unlikely one pushed down) and lower the entropy
    return t([[-0.5, -2.5, -0.5, -2.5]]), t([[2.0, 2.0, -2.0, -2.0]]), t([[1.0, 1.0, 1.0, 1.0]])


def test_token_covariance_by_hand():
    logp, adv, mask = covariance_case()
    torch.testing.assert_close(token_covariance(adv, logp, mask), t([[2.0, -2.0, -2.0, 2.0]]))


def test_clip_cov_detaches_tokens_inside_the_covariance_band():
    logp, adv, mask = covariance_case()
    logp.requires_grad_(True)
    # ratio 0.5 of 4 tokens -> 2 detached; the band (1, 5) holds tokens 0 and 3 (c = 2): both picked, whatever the order
    loss, stats = call("clip_cov", logp, logp.detach(), adv, mask, clip_cov_ratio=0.5)
    torch.testing.assert_close(loss, t([[0.0, -2.0, 2.0, 0.0]]))  # on-policy r = 1: l = -A elsewhere
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.0, -2.0, 2.0, 0.0]]))
    assert float(stats["pg_clipfrac"]) == pytest.approx(0.5)
    # ratio 1e-4 -> max(int(4e-4), 1) = 1 token, one of 0 and 3; a band (2.5, 5) holds none: plain PPO
    loss, stats = call("clip_cov", logp, logp.detach(), adv, mask)
    assert loss.detach()[0].tolist() in ([0.0, -2.0, 2.0, 2.0], [-2.0, -2.0, 2.0, 0.0])
    loss, stats = call("clip_cov", logp, logp.detach(), adv, mask, clip_cov_lb=2.5, clip_cov_ub=5.0)
    torch.testing.assert_close(loss, t([[-2.0, -2.0, 2.0, 2.0]]))


def test_kl_cov_penalises_the_top_covariance_tokens_off_policy_only():
    logp0, adv, mask = covariance_case()
    # off-policy: d = logp - old = (0.3, 0.3, 0.3, -0.3); r = e^d; ratio 0.5 -> 2 tokens penalised: c = 2 at 0 and 3
    old = logp0 - t([[0.3, 0.3, 0.3, -0.3]])
    logp = logp0.clone().requires_grad_(True)
    loss, stats = call("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    e, ei = math.exp(0.3), math.exp(-0.3)
    torch.testing.assert_close(loss, t([[-2 * e + 0.3, -2 * e, 2 * e, 2 * ei + 0.3]]))
    loss.sum().backward()
    # d/dlogp: -A r + coef sign(d) on the penalised ones: (-2e + 1, -2e, 2e, 2e^-0.3 - 1)
    torch.testing.assert_close(logp.grad, t([[-2 * e + 1, -2 * e, 2 * e, 2 * ei - 1]]))
    assert float(stats["pg_clipfrac"]) == pytest.approx(0.5) and float(stats["ppo_kl_abs"]) == pytest.approx(0.3)
    # on-policy the penalty's value and gradient are 0: the loss is -A r = -A, its gradient -A
    logp = logp0.clone().requires_grad_(True)
    loss, _ = call("kl_cov", logp, logp0, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -adv)


@pytest.mark.slow
def test_clip_cov_trains_through_the_actor_with_its_arguments(tmp_path):
    """Two steps of the tiny run with clip_cov: every loss token a candidate (band (-1e9, 1e9)), a tenth detached.

    Per micro-batch int(0.1 n) of its n tokens: the token-weighted mean of pg_clipfrac is at most 0.1 and above 0.05
    (micro-batches of 16 sequences of up to 12 tokens)."""
    from postrl.trainer import train

    overrides = [
        "algorithm.policy_loss=clip_cov", "algorithm.policy_loss_args.clip_cov_ratio=0.1", "train.total_steps=2",
        "algorithm.policy_loss_args.clip_cov_lb=-1e9", "algorithm.policy_loss_args.clip_cov_ub=1e9",
        "reward.verifiers=[verifiers_for_tests:length_parity]",
    ]  # fmt: skip
    train(load_config(None, tiny_overrides(tmp_path, *overrides)))
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    assert len(steps) == 2
    assert all(0.05 < s["actor/pg_clipfrac"] <= 0.1 for s in steps), [s["actor/pg_clipfrac"] for s in steps]


if __name__ == "__main__":  # rewrite the stored reference from verl's functions (verl importable)
    out = {f"{n}/{i}": verl_side(n, i) for n, i in case_keys()}
    REFERENCE.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in out.items()) + "\n}\n")
    print(f"wrote {REFERENCE} ({len(out)} cases)", file=sys.stderr)

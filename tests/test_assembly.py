"""One assembly (postrl.assembly) and one seam for batches (postrl.placement.source): every role gets its engine
from the same place with the same settings, and the trainer never asks where rollout runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides

import postrl.assembly
import postrl.rollout.build


@pytest.fixture
def made(monkeypatch):
    """The keyword arguments of every make_engine call build_engine makes (postrl.rollout.build, the assembly's)."""
    calls = []
    real = postrl.rollout.build.make_engine

    def spy(rollout, model, tokenizer, **kw):
        calls.append({"engine": rollout.engine, **kw})
        return real(rollout, model, tokenizer, **kw)

    monkeypatch.setattr(postrl.rollout.build, "make_engine", spy)
    return calls


def test_postrl_eval_builds_the_engine_with_the_runs_settings(tmp_path, made):
    """`postrl eval` lost model.trust_remote_code once (its own copy of the make_engine call): evaluating a model
    that needs it failed on vLLM. It now builds through build_run: trust_remote_code, the seed, the runtime and
    the modality reach the engine, and the KV cache is sized for eval.max_tokens (max_prompt_length 256 + 6)."""
    from postrl.checks import load_config
    from postrl.eval_cli import evaluate_model

    cfg = load_config(None, tiny_overrides(tmp_path, "model.trust_remote_code=true", "train.seed=7", "eval.max_prompts=2",
                                           "eval.max_tokens=6", "eval.n_samples=1", "data.max_prompt_length=256"))  # fmt: skip
    results, _ = evaluate_model(cfg)
    assert "val/arithmetic/acc_mean@1" in results
    (call,) = made
    assert call["trust_remote_code"] is True and call["seed"] == 7 and call["max_model_len"] == 256 + 6
    assert call["runtime"] is not None and call["modality"] is not None and call["engine"] == "hf"


def test_the_ppo_run_holds_a_critic_and_the_reference_that_kl_in_the_reward_loads():
    from postrl.assembly import held_models, processes_per_rank
    from postrl.config import build_config

    m = {"model": {"path": "m"}}
    ppo = held_models(build_config({**m, "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True, "kl": {"coef": 0}}}))
    assert ppo.critic and ppo.reference and ppo.separate_reference and not ppo.worker_copy
    grpo = held_models(build_config({**m, "algorithm": {"kl": {"coef": 0}}}))
    assert not (grpo.critic or grpo.reference)
    lora = held_models(build_config({**m, "model": {"path": "m", "lora_rank": 8}, "algorithm": {"kl": {"coef": 0.01}}}))
    assert lora.reference and not lora.separate_reference  # the base, adapters off
    off = build_config({**m, "rollout": {"mode": "async", "max_staleness": 1}})
    assert held_models(off).worker_copy and processes_per_rank(off) == 2
    pool = build_config({**m, "rollout": {"placement": "pool", "max_staleness": 1}})
    assert not held_models(pool).worker_copy and processes_per_rank(pool) == 2  # the replicas hold their copies


def test_the_trainer_never_branches_on_where_rollout_runs():
    """trainer.py sees rollout only through its BatchSource; the placement is read once, in placement.source.open_source."""
    src = (Path(postrl.assembly.__file__).parent / "trainer.py").read_text()
    assert "async" not in src and "rollout.mode" not in src and "make_engine" not in src
    assert len(src.splitlines()) <= 300

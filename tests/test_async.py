"""Foundations of async rollout (issue 24): engine capabilities, the decoupled PPO objective,
REINFORCE++ token whitening, policy versions and staleness. Numbers are derived by hand in each docstring."""

from __future__ import annotations

import pytest

from postrl.rollout import EngineCapabilities, RolloutEngine


def test_engines_declare_capabilities_and_the_protocol_requires_them():
    """HF samples with the trainer's model (no log-probs of its own, nothing to sleep); vLLM holds its own
    weights, reports sampling log-probs and can free device memory; neither is remote yet. An engine
    that declares no capabilities is not a RolloutEngine."""
    from postrl.rollout.hf import HFEngine
    from postrl.rollout.vllm import VLLMEngine

    assert HFEngine.capabilities == EngineCapabilities(reports_logprobs=False, shares_trainer_model=True, can_sleep=False, remote=False)
    assert VLLMEngine.capabilities == EngineCapabilities(reports_logprobs=True, shares_trainer_model=False, can_sleep=True, remote=False)
    with pytest.raises(AttributeError):  # frozen: an engine's declaration is not changed by the trainer
        HFEngine.capabilities.remote = True  # type: ignore[misc]

    class Nameless:
        name = "x"

        def generate(self, prompts, params, multi_modal=None): ...
        def sync_weights(self, model): ...
        def probe_logprobs(self, token_ids): ...
        def sleep(self): ...
        def close(self): ...

    assert not isinstance(Nameless(), RolloutEngine)
    Nameless.capabilities = HFEngine.capabilities
    assert isinstance(Nameless(), RolloutEngine)

"""Rollout engines: generate completions for prompts given as token ids."""

from postrl.rollout.base import Completion, RolloutEngine, SamplingParams, make_engine

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine"]

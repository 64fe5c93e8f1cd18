"""Environments: a `package.module:Class` that answers the model's turns (verl's Interaction, TRL's environments).

    class Guess:
        def reset(self, row: dict) -> None:            # the dataset row of this trajectory
            self.target = int(row["reward_model"]["ground_truth"])
        def step(self, assistant_text: str) -> tuple[str, float, bool]:
            ...                                        # (observation, reward, done)

One instance per trajectory, `reset` with its row before the first turn. After every model turn that
ends without a tool call, `step` gets the text of that turn; unless `done`, the observation is appended
as a user turn (masked: the policy does not train on it) and the model answers again, up to
`rollout.multi_turn.max_user_turns` observations. The rewards of all steps are summed and added to the
verifier score of the trajectory (so an environment alone, with `reward.verifiers` weighted 0, or both).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from postrl.errors import UserError
from postrl.utils import import_named


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> None:
        """Start a trajectory for this dataset row."""
        ...

    def step(self, assistant_text: str) -> tuple[str, float, bool]:
        """(observation shown to the model as a user turn, reward, done) after one model turn."""
        ...


def load_environment(spec: str) -> type:
    """The class named 'package.module:Class' (a UserError says how to fix a bad name)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(
            f"rollout.multi_turn.interaction '{spec}' is not of the form 'package.module:Class'. "
            "Fix: name a class with reset(row) and step(assistant_text) -> (observation, reward, done)."
        )
    try:
        cls = import_named(spec, f"rollout.multi_turn.interaction '{spec}'", function=False)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise UserError(
            f"rollout.multi_turn.interaction '{spec}' has no {' or '.join(missing)} method. Fix: give it "
            "reset(row) and step(assistant_text) -> (observation, reward, done)."
        )
    return cls


def checked_step(env: Any, text: str, spec: str) -> tuple[str, float, bool]:
    """env.step(text), its result checked: a wrong shape is the user's bug, said plainly."""
    out = env.step(text)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise UserError(
            f"{spec}.step returned {type(out).__name__} {out!r:.80}; it must return (observation: str, reward: float, "
            "done: bool). Fix the environment's step method."
        )
    obs, reward, done = out
    return ("" if obs is None else str(obs)), float(reward), bool(done)

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

A `reset` or `step` that raises, or a step whose values are not declared ones (agents/results.py: a reward
that is not a finite number within bounds, an observation that is not a str of bounded size, `done` not a
bool), is contained as a verifier's failure is (`EnvCalls`): the trajectory gets no reward from it (such a
step also ends the trajectory), the failure is counted (agent/env_errors, agent/env_invalid) and warned about
once, and when (nearly) every call of a batch fails the run stops naming the environment, by the verifiers'
rule (postrl/errors.py).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import postrl.agents.results as results
from postrl.errors import UserError, fails_nearly_always
from postrl.utils import import_named, split_named

log = logging.getLogger("postrl.agents")
ENV_METRICS = {"error": "agent/env_errors", "invalid": "agent/env_invalid"}


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
    split_named(spec, f"rollout.multi_turn.interaction '{spec}' is not of the form 'package.module:Class'. "
                "Fix: name a class with reset(row) and step(assistant_text) -> (observation, reward, done).")
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
    """env.step(text), its result checked: a wrong shape is the user's bug, said plainly (UserError); a value out of
    its type or range is results.BadResult (the caller counts it)."""
    out = env.step(text)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise UserError(
            f"{spec}.step returned {results.show(out)}; it must return (observation: str, reward: float, "
            "done: bool). Fix the environment's step method."
        )
    obs, reward, done = out
    return results.text(obs, "the observation"), results.reward(reward), results.flag(done, "done")


class EnvCalls:
    """The environment's calls of one batch, its failures contained and counted (see the module docstring)."""

    def __init__(self, spec: str):
        self.spec, self.calls, self.failed = spec, 0, {"error": [], "invalid": []}
        self.totals = dict.fromkeys(ENV_METRICS, 0)  # since the last pop_metrics
        self._warned: set[str] = set()

    def reset(self, env: Any, row: dict) -> bool:
        """env.reset(row); False when it raised (the trajectory then runs without the environment). A reset that
        works is not counted as a call: the rule is on the trajectories' rewards, which come from the steps."""
        try:
            env.reset(row)
            return True
        except Exception as exc:  # noqa: BLE001 - the user's environment: counted, not a crash
            self.calls += 1
            self._fail("error", f"reset raised {results.error_text(exc)}")
            return False

    def step(self, env: Any, text: str) -> tuple[str, float, bool] | None:
        """checked_step; None when the step raised or returned values out of their type or range (the trajectory
        ends, without this step's reward)."""
        self.calls += 1
        try:
            return checked_step(env, text, self.spec)
        except UserError:
            raise
        except results.BadResult as exc:
            self._fail("invalid", str(exc))
        except Exception as exc:  # noqa: BLE001 - the user's environment: counted, not a crash
            self._fail("error", results.error_text(exc))
        return None

    def _fail(self, kind: str, message: str) -> None:
        self.failed[kind].append(message[:300])
        self.totals[kind] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            what = "raised" if kind == "error" else "returned a value out of its type or range"
            log.warning(
                "environment '%s' %s (%s); the trajectory gets no reward from it, counted in %s from now on.",
                self.spec, what, message[:300], ENV_METRICS[kind],
            )  # fmt: skip

    def end_batch(self) -> None:
        """Stop the run when (nearly) every call of this batch failed; then start counting the next batch."""
        n_failed = sum(len(m) for m in self.failed.values())
        calls, failed = self.calls, self.failed
        self.calls, self.failed = 0, {"error": [], "invalid": []}
        if not fails_nearly_always(calls, n_failed):
            return
        kind, messages = max(failed.items(), key=lambda kv: len(kv[1]))
        why = "raised an exception" if kind == "error" else "returned a value out of its type or range"
        raise UserError(
            f"environment '{self.spec}' failed on {n_failed} of its {calls} calls in this batch; "
            f"{len(messages)} {why} (counted in {ENV_METRICS[kind]}), for example: {messages[0]}. A failed call gives "
            "no reward, so the environment's reward would carry no signal and training would learn nothing. Fix: fix "
            "its reset / step methods (step returns (observation: str, reward: a finite float, done: bool)).",
            title="the environment fails on (nearly) every call",
        )

    def pop_metrics(self) -> dict[str, float]:
        out = {ENV_METRICS[k]: float(v) for k, v in self.totals.items()}
        self.totals = dict.fromkeys(ENV_METRICS, 0)
        return out


"""verl's fully_async entry point (`python -m verl.experimental.fully_async_policy.fully_async_main`) in postrl's names.

verl's fully_async runs a Rollouter on devices of its own (`rollout.nnodes` x `rollout.n_gpus_per_node`,
one vLLM / SGLang server per `tensor_model_parallel_size` devices) that streams prompts to a Trainer
(`trainer.nnodes` x `trainer.n_gpus_per_node`); the Trainer updates once per `require_batches` x
`ppo_mini_batch_size` prompts and sends its weights to the Rollouter every `trigger_parameter_sync_step`
updates; `async_training.staleness_threshold` lets the Rollouter make up to (1 + threshold) x a sync's
prompts, so that share may come from the previous weights; `partial_rollout` continues the generations in
flight under the new weights (verl's docs/advance/fully_async.md, fully_async_ppo_trainer.yaml).

postrl's counterpart is `rollout.placement: pool` (replicas, Ray actors on their own devices, weights by
broadcast) with `rollout.max_staleness`: one postrl step is the prompts between two weight syncs, so
`train.global_batch_size` = trigger_parameter_sync_step x require_batches x ppo_mini_batch_size and the
mini-batches are verl's local updates; a sample is at most ceil(staleness_threshold) versions old.
"""

from __future__ import annotations

import math
from typing import Any

from postrl.guides.rules import Conversion, Mapped, _bool

MAIN = "verl.experimental.fully_async_policy.fully_async_main"

# verl's fully_async_ppo_trainer.yaml defaults for the keys that decide the placement and the staleness.
DEFAULTS: dict[str, Any] = {
    "async_training.staleness_threshold": 0.1,
    "async_training.trigger_parameter_sync_step": 4,
    "async_training.require_batches": 1,
    "async_training.partial_rollout": True,
    "rollout.nnodes": 1,
    "rollout.n_gpus_per_node": 8,
}
TP_DEFAULT = 2  # verl's actor_rollout_ref.rollout.tensor_model_parallel_size


def is_fully_async(entry: str | None) -> bool:
    return bool(entry) and str(entry).endswith("fully_async_policy.fully_async_main")


def is_key(key: str) -> bool:
    return key.startswith("async_training.") or key in ("rollout.nnodes", "rollout.n_gpus_per_node", "rollout.total_rollout_steps",
                                                         "rollout.total_epochs", "rollout.test_freq")  # fmt: skip


def elsewhere(entry: str | None) -> str:
    """Why a fully_async key of a script that runs another entry point is not mapped."""
    runs = f"this script runs {entry}" if entry else "no entry point was read (an override list)"
    return (f"a key of verl's fully_async entry point ({MAIN}); {runs}, where verl rejects it. postrl's asynchronous "
            "rollout: rollout.placement (worker / pool) and rollout.max_staleness (docs/async.md)")  # fmt: skip


def combine(conv: Conversion, given: dict[str, Any]) -> None:
    """Map the fully_async keys (given, or verl's defaults) onto rollout.placement: pool and its staleness bound."""
    got = {**DEFAULTS, **given}
    threshold = float(got["async_training.staleness_threshold"])
    if threshold < 0:
        raise ValueError(f"async_training.staleness_threshold={threshold} is negative (verl takes 0 or more)")
    staleness = math.ceil(threshold)
    tp = int(given.get("actor_rollout_ref.rollout.tensor_model_parallel_size", TP_DEFAULT))
    devices = int(got["rollout.nnodes"]) * int(got["rollout.n_gpus_per_node"])
    replicas = max(devices // max(tp, 1), 1)
    trigger, require = int(got["async_training.trigger_parameter_sync_step"]), int(got["async_training.require_batches"])
    mini = given.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    partial = _bool(got["async_training.partial_rollout"]) and staleness > 0

    def record(key: str, targets: dict, note: str) -> None:
        for i, u in enumerate(conv.unmapped):
            if u.source == key:
                del conv.unmapped[i]
                conv.mapped.append(Mapped(key, u.value, targets, note))
                return
        for m in conv.mapped:
            if m.source == key:
                m.targets, m.note = targets, note
                return
        conv.mapped.append(Mapped(f"{key} (not given)", got[key], targets, "verl's fully_async default; " + note))

    record("async_training.staleness_threshold", {"rollout.max_staleness": staleness},
           f"verl bounds the share of a sync's prompts made with the previous weights (here {threshold:g}); postrl bounds "
           f"their age: ceil({threshold:g}) = {staleness} version(s), one version per step (one verl weight sync)")  # fmt: skip
    record("rollout.nnodes", {"rollout.placement": "pool", "rollout.pool.replicas": replicas, "rollout.pool.devices_per_replica": tp},
           f"the Rollouter's {devices} device(s) (rollout.nnodes x rollout.n_gpus_per_node), one replica per "
           f"tensor_model_parallel_size ({tp}): {replicas} replica(s) of {tp} device(s), apart from the trainer's "
           "(postrl's worker placement shares rank 0's device, so the pool is verl's Rollouter)")  # fmt: skip
    record("rollout.n_gpus_per_node", {}, "with rollout.nnodes: rollout.pool")
    record("async_training.partial_rollout", {"rollout.partial_rollout": partial},
           "generation in flight continues under new weights" + ("" if staleness else " (verl applies it only when staleness_threshold > 0)"))
    if mini is not None:
        gbs = trigger * require * int(mini)
        record("async_training.trigger_parameter_sync_step", {"train.global_batch_size": gbs},
               f"prompts between two weight syncs (one postrl step): trigger_parameter_sync_step x require_batches x "
               f"ppo_mini_batch_size = {trigger} x {require} x {mini}; verl's local updates are postrl's mini-batches")  # fmt: skip
        record("async_training.require_batches", {}, "in train.global_batch_size (with trigger_parameter_sync_step)")
        total = given.get("rollout.total_rollout_steps")
        if total is not None:
            record("rollout.total_rollout_steps", {"train.total_steps": max(int(total) // gbs, 1)},
                   f"prompts to generate / prompts per step ({total} / {gbs})")
            for m in conv.mapped:
                if m.source in ("trainer.total_epochs", "trainer.total_training_steps"):
                    m.targets, m.note = {}, "ignored: fully_async stops at rollout.total_rollout_steps (train.total_steps)"
    for m in conv.mapped:
        if m.source == "data.train_batch_size":
            m.targets, m.note = {}, "not effective under fully_async (verl); the step's prompts come from async_training (train.global_batch_size)"
        elif m.source == "data.gen_batch_size":
            m.targets, m.note = {}, "fully_async streams prompts one by one; postrl's pool deals a step's prompts in chunks to free replicas"
        elif m.source == "trainer.test_freq" and "rollout.test_freq" in given:
            m.targets, m.note = {}, "fully_async validates every rollout.test_freq weight syncs (that key wins)"

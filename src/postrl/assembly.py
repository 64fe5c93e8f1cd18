"""One assembly of a run (DESIGN.md section 12): what a role holds, built from the config in one order.

    runtime -> policy -> prompts -> reference (+ teacher) -> actor (+ critic) -> validation sets -> rewards
            -> engine (+ agent loop) -> Experience

`build_run(cfg, role)` builds it for a role:

    trainer          everything above; the trainer's batch source (postrl.placement) decides where rollout runs
    rollout-worker   a rollout worker's / pool replica's policy copy, rewards, engine (wrapped by the caller), Experience
    eval / doctor    a policy in model.dtype for generation only, its engine and rule rewards

`build_engine` (postrl.rollout.build, below this module and the rewards) is the one place a rollout engine
is made (HF or vLLM): the trainer, the rollout worker and replicas, eval, doctor, SFT's check and the judge all
get it there, with the same settings (trust_remote_code, max_model_len, seed, modality, runtime).
`policy_engine` (here) puts the agent wrapper the rollout config names around the policy's (postrl.agents.wrap:
the agent loop, a user's agent program, a verifiers environment): the engine package knows no agents.

`held_models(cfg)` says which models a run holds; the memory estimate (memory.py) reads the same
description, so the two cannot drift. A new rollout placement (a pool of replicas, an endpoint) adds a
role here for what its replicas build, and a BatchSource in postrl.placement for how the trainer sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from postrl import distributed
from postrl.algorithms import needs_critic
from postrl.config import derive_total_steps
from postrl.data.dataset import PromptSampler, load_train_prompts
from postrl.evaluate import load_val_sets
from postrl.experience import Experience
from postrl.held import reference, teacher
from postrl.local_cluster import prepare_local_ray
from postrl.models import Policy, load_policy
from postrl.rewards import RewardFunction
from postrl.rollout import RolloutEngine
from postrl.rollout.build import build_engine, max_model_len
from postrl.rollout.sharded import colocate
from postrl.runtime import Runtime, configure_threads, init_runtime, seed_everything

ROLES = ("trainer", "rollout-worker", "eval", "doctor")


@dataclass(frozen=True)
class Held:
    """The models a run holds (trainer and rollout worker together)."""

    reference: bool  # a frozen KL reference: algorithm.kl.coef > 0 or algorithm.use_kl_in_reward
    separate_reference: bool  # ... with weights of its own (LoRA's reference is the base, adapters off)
    critic: bool  # PPO's value model (algorithm.adv_estimator: gae), the policy's size
    worker_copy: bool  # rollout.placement worker: a second copy of the policy in the worker process (a pool's
    # replicas hold theirs on their own devices / cores)
    reward_model: bool  # reward.reward_model
    judge: bool  # reward.judge
    teacher: bool  # distill.teacher_path: on-policy distillation's teacher, held where the reference is


def held_models(cfg) -> Held:
    a, rw = cfg.algorithm, cfg.reward
    ref = a.kl.coef > 0 or a.use_kl_in_reward
    return Held(
        reference=ref,
        separate_reference=ref and (not cfg.model.lora_rank or bool(cfg.checkpoint.ref_model_path)),
        critic=needs_critic(a.adv_estimator),
        worker_copy=cfg.rollout.placement == "worker",
        reward_model=rw.reward_model is not None,
        judge=rw.judge is not None,
        teacher=cfg.distill.enable,
    )


def processes_per_rank(cfg) -> int:
    """Processes sharing a rank's CPU cores: the trainer, and the async rollout worker beside it (or, on one
    machine, the pool's replicas: the trainer keeps half the cores as beside a worker)."""
    return 2 if cfg.rollout.placement in ("worker", "pool") else 1


@dataclass
class Run:
    """What `build_run` built for a role (None where the role holds no such part)."""

    cfg: Any
    runtime: Runtime
    policy: Policy
    engine: RolloutEngine
    reward_fn: RewardFunction
    tools: list[dict] | None = None  # the agent loop's tool schemas, rendered into the prompts
    examples: list | None = None  # the training prompts
    sampler: PromptSampler | None = None
    ref_model: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    actor: Any = None
    critic: Any = None
    val_sets: dict = field(default_factory=dict)
    experience: Experience | None = None

    def close(self) -> None:
        self.reward_fn.close()
        self.engine.close()


def build_run(cfg, role: str, log: Callable[[str], None] | None = None, *, runtime: Runtime | None = None,
              examples: list | None = None, sampler_state: dict | None = None,
              prepare: Callable[[torch.nn.Module], Any] | None = None,
              wrap: Callable[[RolloutEngine, "Run"], RolloutEngine] | None = None) -> Run:  # fmt: skip
    """Build what `role` needs (module docstring). `runtime`: the process's, when the caller made it first
    (the trainer checks its run directory before loading anything). The rollout worker gets the trainer's
    `examples` and `sampler_state`, `prepare`s its policy copy (the published weights) and `wrap`s the
    engine (versions, partial rollout)."""
    assert role in ROLES, f"unknown role {role!r}"
    from postrl.agents.loop.loop import tool_schemas

    say = log or (lambda msg: None)
    if role == "trainer" and cfg.rollout.placement == "pool" and cfg.cluster.ray_address is None:
        prepare_local_ray()  # before anything (vLLM) imports ray: the pool's cluster binds loopback only
    trains = role in ("trainer", "rollout-worker")  # fp32 master weights (the worker holds the trainer's copy)
    if trains:
        seed_everything(cfg.train.seed)
        if role == "trainer" and cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
    if role == "trainer":
        teacher.check_tokenizer(cfg)  # a teacher with another tokenizer is refused before any model loads
    rt = runtime or init_runtime(cfg.train.device, cfg.model.dtype, *((cfg.train.strategy,) if trains else ()))
    # Training: fp32 masters whatever model.dtype says, forwards in model.dtype (runtime.py); generation only:
    # the weights in model.dtype.
    policy = load_policy(cfg.model, dtype="float32" if trains else None, device=rt.device)
    model = policy.model.to(rt.device)
    model.train() if role == "trainer" else model.eval()
    if role == "rollout-worker":
        model.postrl_modality = policy.modality  # the worker's log-prob pass reads it
        prepare(model)
    else:
        configure_threads(model, cfg.train.num_threads, log, per_rank=processes_per_rank(cfg) if role == "trainer" else 1)
    tools = tool_schemas(cfg.rollout.multi_turn)
    run = Run(cfg, rt, policy, engine=None, reward_fn=None, tools=tools, examples=examples)  # type: ignore[arg-type]
    if role == "trainer":
        _build_training(run, say)
    if trains:
        from postrl.rewards.model_rewards import load_model_rewards

        run.sampler = PromptSampler(len(run.examples), cfg.data.shuffle, cfg.data.seed)
        if sampler_state is not None:
            run.sampler.load_state_dict(sampler_state)
        run.reward_fn = RewardFunction(cfg.reward, models=load_model_rewards(cfg, rt.device, rt))  # reward model / judge
    else:
        run.reward_fn = RewardFunction(cfg.reward)  # validation scores with the rule verifiers
    max_tokens = (cfg.eval.max_tokens or cfg.rollout.max_tokens) if role == "eval" else None
    engine = policy_engine(cfg, policy, rt, log if role != "rollout-worker" else None, max_tokens=max_tokens)
    if role == "trainer":
        engine = colocate(engine, model)  # a sharded policy is unsharded around each generate call
    run.engine = wrap(engine, run) if wrap is not None else engine
    if trains:
        run.experience = Experience(cfg, run.engine, policy.tokenizer, run.reward_fn, run.examples, run.sampler)
    return run


def policy_engine(cfg, policy: Policy, runtime: Runtime | None, log: Callable[[str], None] | None = None, *,
                  max_tokens: int | None = None, rollout: Any = None) -> RolloutEngine:  # fmt: skip
    """The policy's rollout engine (build_engine, from `rollout`, default cfg.rollout) in the agent wrapper
    that rollout config names (postrl.agents.wrap: the agent loop, the endpoint, or none)."""
    from postrl.agents.wrap import wrap_engine

    rollout = rollout if rollout is not None else cfg.rollout
    engine = build_engine(cfg, policy, runtime, log, max_tokens=max_tokens, rollout=rollout)
    return wrap_engine(engine, policy.tokenizer, rollout, model=policy.model, log=log,
                       max_model_len=max_model_len(cfg, rollout, max_tokens))  # fmt: skip


def _build_training(run: Run, log: Callable[[str], None]) -> None:
    """The trainer's prompts, reference, actor, critic and validation sets (in this order: the RNG draws of
    a seeded run follow it)."""
    from postrl.actor import Actor
    from postrl.agents.verifiers.env import dataset_rows  # reads 'verifiers:' data files (the environment's rows)
    from postrl.held.critic import Critic

    cfg, rt, policy = run.cfg, run.runtime, run.policy
    held = held_models(cfg)
    run.examples = load_train_prompts(cfg, policy.tokenizer, policy.modality, run.tools, log, dataset_rows)
    if (said := derive_total_steps(cfg, len(run.examples))) is not None:  # before the actor's LR schedule
        log(said)
    run.ref_model = reference.build(cfg, policy, rt) if held.reference else None
    run.teacher = teacher.build_teacher(cfg, policy, rt)  # on-policy distillation, held as the reference
    # FSDP2 shards the model in place (before the optimizer sees its parameters); DDP wraps it.
    train_model = distributed.wrap_model(
        policy.model, cfg.train.strategy, compute_dtype=rt.dtype, reshard_after_forward=cfg.train.reshard_after_forward
    )
    run.actor = Actor(cfg, policy, train_model, rt, log)
    run.critic = Critic(cfg, policy.path, run.actor, rt, log) if held.critic else None
    run.val_sets = load_val_sets(cfg.eval.files or [], policy.tokenizer, cfg.data, cfg.eval.max_prompts, policy.modality, run.tools, dataset_rows)

"""The configuration's cross-section rules, in one place: the values derived after parsing and the checks
that read more than one section.

`derive(cfg)` is the one entry point; `Config`'s model validator (schema.py) calls it once the sections have
parsed. Values left as None are filled in here: `algorithm.name: dapo` switches on DAPO's defaults
(clip-higher 0.28, token-mean, overlong buffer, filter_groups, no KL; every DAPO piece also works alone under
GRPO), checkpoint.dir, eval.files, eval.max_tokens, and async's rollout-correction default. The one derived
value that needs the data, train.total_steps from train.total_epochs, is `derive_total_steps`, which the
assembly calls once the prompts are counted.

Plain functions over a Config (postrl.config.schema.Config); this module does not import the schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


# What `algorithm.name` sets when a key is left unset. A policy loss's own preferences (declared with its
# registration in algorithms/) win over these, and an explicit setting over both.
ALGORITHM_NAME_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "seq-mean-token-mean"},
    "dapo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},  # clip-higher, token-level loss
}


def derive(cfg: Any) -> Any:
    """Config's model validator (schema.py): the derived values, then the checks across sections (one
    ValueError, a paragraph per problem); returns `cfg`."""
    derive_algorithm(cfg.algorithm)
    if cfg.checkpoint.save_freq < 0:  # never: no periodic and no final checkpoint
        cfg.checkpoint.save_freq, cfg.checkpoint.save_final = 0, False
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = str(Path(cfg.logging.dir) / "checkpoints")
    if cfg.rollout.environment:
        derive_environment(cfg)
    if cfg.eval.files is None:
        cfg.eval.files = list(cfg.data.val_files)
    if cfg.eval.max_tokens is None:
        cfg.eval.max_tokens = cfg.rollout.max_tokens
    problems = []
    ob = cfg.algorithm.overlong_buffer
    if ob.enable and ob.len >= cfg.rollout.max_tokens:
        problems.append(
            f"algorithm.overlong_buffer.len ({ob.len}) must be smaller than rollout.max_tokens "
            f"({cfg.rollout.max_tokens}): the penalty starts at max_tokens - len. "
            "Fix: shorten the buffer or raise rollout.max_tokens."
        )
    ep, tp = cfg.rollout.expert_parallel_size, cfg.rollout.tensor_parallel_size
    if ep > 1 and ep != tp:
        problems.append(
            f"rollout.expert_parallel_size ({ep}) must equal rollout.tensor_parallel_size ({tp}): vLLM's expert-parallel "
            "group is the engine's tensor-parallel ranks (tensor x data parallel within one engine; postrl's colocated "
            f"engines are one tensor-parallel group each). Fix: set rollout.expert_parallel_size: {tp}, or 1."
        )
    sp = cfg.train.sequence_parallel_size
    if sp > 1 and cfg.world_size > 1 and cfg.world_size % sp:  # else the launch decides the world (--nproc)
        problems.append(
            f"train.sequence_parallel_size ({sp}) must divide the world size ({cfg.world_size} devices): each "
            "sequence-parallel group is that many ranks. Fix: choose a divisor, or change cluster.devices_per_node / nnodes."
        )
    rc = cfg.algorithm.rollout_correction
    if cfg.rollout.placement != "colocated" and cfg.rollout.max_staleness > 0 and "enable" not in rc.model_fields_set:
        rc.enable = True  # the decoupled objective (AReaL): stale samples weighted by trainer / engine, truncated
    if sp > 1 and _needs_critic(cfg.algorithm.adv_estimator):
        problems.append(
            f"train.sequence_parallel_size ({sp}) with adv_estimator '{cfg.algorithm.adv_estimator}': the critic's "
            "value passes and update do not split sequences yet (only the actor's do). Fix: set "
            "train.sequence_parallel_size: 1 for PPO, or use a critic-free estimator (grpo, rloo, ...)."
        )
    a = cfg.algorithm
    if a.use_kl_in_reward and not _needs_critic(a.adv_estimator):
        problems.append(
            f"algorithm.use_kl_in_reward puts a KL penalty on every token's reward, which only a per-token estimator "
            f"with a critic uses; adv_estimator '{a.adv_estimator}' reads one reward per sequence. Fix: set "
            "algorithm.adv_estimator: gae, or use the KL loss (algorithm.kl.coef) instead."
        )
    d = cfg.distill
    if d.enable and _needs_critic(a.adv_estimator):
        problems.append(
            "distill.teacher_path with adv_estimator 'gae': the critic's per-token advantages and the teacher's would both "
            "claim the advantage slot. Fix: use a critic-free estimator (grpo, rloo, ...) for the group term."
        )
    if d.enable and d.top_k and sp > 1:
        problems.append(
            f"distill.top_k ({d.top_k}) with train.sequence_parallel_size {sp}: the top-k "
            "logits are not gathered across a sequence-parallel group yet. Fix: distill.top_k: 0 (the sampled-token "
            "variant), or train.sequence_parallel_size: 1."
        )
    if problems:
        raise ValueError("\n".join(problems))
    return cfg


def derive_environment(cfg: Any) -> None:
    """rollout.environment (a verifiers environment): its dataset and eval_dataset are the data unless data.train_files
    / val_files name files; its rubric is the reward, so reward.verifiers left at their default only log (weight 0)
    and DAPO's filter reads the score."""
    r = cfg.rollout
    cfg.data._environment = {"spec": r.environment.removeprefix("verifiers:").strip(), "args": dict(r.environment_args),
                             "python": r.environment_python, "passthrough": list(r.agent_env_passthrough)}  # fmt: skip
    if "train_files" not in cfg.data.model_fields_set:
        cfg.data.train_files = ["verifiers:train"]
    if "val_files" not in cfg.data.model_fields_set:
        cfg.data.val_files = ["verifiers:eval"]
    if "reward" not in cfg.model_fields_set or "verifiers" not in cfg.reward.model_fields_set:
        for v in cfg.reward.verifiers:
            v.weight = 0.0
    if "metric" not in cfg.algorithm.filter_groups.model_fields_set:
        cfg.algorithm.filter_groups.metric = "score"


def derive_algorithm(a: Any) -> None:
    """`algorithm`'s unset keys from `algorithm.name` and the policy loss's preferences (DAPO's defaults)."""
    from postrl import algorithms

    if a.policy_loss is None:
        a.policy_loss = algorithms.DEFAULT_POLICY_LOSS
    # The policy loss's paper settings win over the algorithm name's, explicit values over both.
    loss_prefers = algorithms.policy_loss_spec(algorithms.get_policy_loss_fn(a.policy_loss)).defaults
    for key, value in {**ALGORITHM_NAME_DEFAULTS[a.name], **loss_prefers}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    dapo = a.name == "dapo"
    if a.overlong_buffer.enable is None:
        a.overlong_buffer.enable = dapo
    if a.filter_groups.enable is None:
        a.filter_groups.enable = dapo
    if a.kl.estimator == "low_var_kl":
        a.kl.estimator = "k3"


def _needs_critic(adv_estimator: str) -> bool:
    from postrl import algorithms

    return algorithms.needs_critic(adv_estimator)


def derive_total_steps(cfg: Config, train_prompts: int) -> str | None:
    """train.total_epochs -> train.total_steps once the kept prompts are counted (the assembly calls it right
    after loading them, before the LR schedule is built); returns the line that says so, None without epochs."""
    t = cfg.train
    if not t.total_epochs:
        return None
    t.total_steps = max(1, t.total_epochs * (train_prompts // t.global_batch_size))
    return f"train.total_epochs {t.total_epochs}: {t.total_steps} steps"

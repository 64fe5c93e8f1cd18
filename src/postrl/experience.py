"""Experience: prompts -> rollout -> rule rewards (+ overlong shaping) -> dynamic sampling -> advantages.

The record it fills, `Batch`, and its row algebra are batch.py's.

`Experience.collect` draws generation batches until `train.global_batch_size` groups survive dynamic
sampling (DAPO: a group is kept iff its raw verifier metric has non-zero spread), then cuts the batch
to exactly that many groups; surplus groups are dropped, as verl does, so the prompt sampler's
position is the only state that crosses steps. Under several ranks each rank generates and scores a
contiguous slice of the prompts (a group stays on one rank) and the scored slices are gathered, so
every rank takes the same keep decisions and holds the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from postrl import algorithms as algo
from postrl import distributed
from postrl.turns import generate_for, model_text
from postrl.batch import Batch, concat, expand_segments, select, select_groups, trajectories, trajectory_mask
from postrl.data.dataset import PromptExample, PromptSampler
from postrl.errors import UserError
from postrl.metrics import Timer, summary_stats, throughput
from postrl.partition import shard_range, shard_seed
from postrl.rollout import SamplingParams


FAILURE_KEYS = ("reward/calls", "reward/timeouts", "reward/errors", "reward/invalid", "reward/unreadable")


def new_failures() -> dict[str, int]:
    """The reward failure counts a collection starts from (generate_and_score adds to them)."""
    return dict.fromkeys(FAILURE_KEYS, 0)


def sampling_seed(cfg: Any, step: int, gen: int, lo: int) -> int:
    """The sampling seed of the prompts from `lo` on of generation batch `gen` of step `step`: a function of
    the step, so resume lines up, and the same wherever those prompts are generated (a rank, a replica)."""
    return shard_seed((cfg.train.seed * 1_000_003 + step * 1009 + gen) % 2**31, lo)


class DynamicSampling:
    """One step's collection, the one path every placement takes (DAPO's dynamic sampling): whole generation
    batches come in (`add`), the groups whose `algorithm.filter_groups.metric` has no spread are dropped, more
    are drawn (`draw`, refused past max_num_gen_batches) until train.global_batch_size groups are kept, and
    `finish` cuts the batch to that many groups, makes rows of rollout.agent's extra segments and returns
    the collection's metrics (kept ratio, reward failures, the engine's agent/* counts)."""

    def __init__(self, cfg: Any, step: int):
        self.cfg, self.step = cfg, step
        self.G, self.want = cfg.rollout.n_samples_per_prompt, cfg.train.global_batch_size
        self.kept: list[Batch] = []
        self.n_kept = self.n_generated = self.gens = 0
        self.failures: dict[str, float] = {}
        self.agent: list[tuple[int, dict[str, float]]] = []  # (trajectories, engine.pop_metrics()) per part

    @property
    def full(self) -> bool:
        return self.n_kept >= self.want

    def draw(self) -> int:
        """Count the next generation batch (train.gen_batch_size prompts) and return its number (from 1)."""
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        self.gens += 1
        if fg.enable and 0 < fg.max_num_gen_batches < self.gens:
            raise UserError(
                f"dynamic sampling drew {fg.max_num_gen_batches} generation batches of {cfg.train.gen_batch_size} "
                f"prompts at step {self.step} and kept only {self.n_kept} of the {self.want} groups it needs: almost every "
                f"group's '{fg.metric}' has zero spread, i.e. the data is too hard or too easy for this model. "
                "Fix: use data matched to the model's level (or an SFT warm start), raise "
                "rollout.n_samples_per_prompt or train.gen_batch_size, or set "
                "algorithm.filter_groups.max_num_gen_batches: 0 (no limit)."
            )
        self.n_generated += cfg.train.gen_batch_size
        return self.gens

    def add(self, batch: Batch) -> None:
        """A whole scored generation batch (every rank's, every replica's part, prompt order)."""
        if self.cfg.algorithm.filter_groups.enable:
            keep = algo.group_keep_mask(torch.tensor(filter_metric(self.cfg, batch)), self.G)
            batch = select_groups(batch, keep.nonzero().flatten().tolist(), self.G)
        self.kept.append(batch)
        self.n_kept += batch.size // self.G

    def count(self, failures: dict[str, float]) -> None:
        for key, n in failures.items():
            self.failures[key] = self.failures.get(key, 0.0) + float(n)

    def agent_metrics(self, trajectories: int, metrics: dict[str, float]) -> None:
        """An agent engine's counts (`pop_metrics`) over `trajectories` of this step's rollouts."""
        self.agent.append((trajectories, metrics))

    def finish(self) -> tuple[Batch, dict[str, float]]:
        full = expand_segments(select(concat(self.kept), list(range(self.want * self.G))))
        prefix = self.cfg.algorithm.name  # metric namespace: dapo/..., grpo/...
        stats = {f"{prefix}/num_gen_batches": self.gens, f"{prefix}/kept_groups_ratio": self.n_kept / self.n_generated}
        stats.update(self.failures)
        stats.update(merge_agent_metrics(self.agent))
        return full, stats


def filter_metric(cfg: Any, batch: Batch) -> list[float]:
    """Each sequence's value of `algorithm.filter_groups.metric` (refused when no verifier reports it)."""
    name = cfg.algorithm.filter_groups.metric
    known = sorted(batch.verifier_metrics[0]) if batch.size else []
    if name not in ("score", "seq_reward") and name not in known:
        raise UserError(
            f"algorithm.filter_groups.metric is '{name}', but the verifiers report only "
            f"{known} (plus 'score' and 'seq_reward'). Fix: pick one of those."
        )
    return batch.metric(name)


def merge_agent_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One step's agent/* from several parts (a pool's chunks): per-trajectory means and ratios weighted by
    the part's trajectories, counts and seconds summed. One part is returned as it is."""
    if len(parts) <= 1:
        return dict(parts[0][1]) if parts else {}
    total = max(sum(n for n, _ in parts), 1)
    out: dict[str, float] = {}
    for n, m in parts:
        for key, value in m.items():
            weight = n / total if key.endswith(("_mean", "_ratio")) else 1.0
            out[key] = out.get(key, 0.0) + weight * value
    return out


@dataclass
class Experience:
    """Produces the training batch of a step: rollout, rewards, dynamic sampling, advantages."""

    cfg: Any
    engine: Any  # the rollout engine (rollout/)
    tokenizer: Any
    reward_fn: Callable  # rewards.RewardFunction
    examples: list[PromptExample]  # the training prompts
    sampler: PromptSampler  # their order; its position is the only state that crosses steps

    def __post_init__(self) -> None:
        self.G = self.cfg.rollout.n_samples_per_prompt

    def collect(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Draw generation batches until global_batch_size groups survive dynamic sampling."""
        cfg = self.cfg
        sampling = DynamicSampling(cfg, step)
        failures = new_failures()  # generate_and_score adds to it
        if cfg.rollout.takes_rows:
            self.engine.pop_metrics()  # drop what validation's rollouts counted
        while not sampling.full:
            gen = sampling.draw()
            examples = [self.examples[i] for i in self.sampler.next_indices(cfg.train.gen_batch_size)]
            lo, hi = shard_range(len(examples))  # this rank's prompts: a group stays on one rank
            batch = gather(self.generate_and_score(examples[lo:hi], sampling_seed(cfg, step, gen, lo), timer, failures))  # every rank sees every score
            batch.versions = [step if v is None else v for v in batch.versions]  # sync: the engine holds step's weights
            sampling.add(batch)
        sampling.count(distributed.all_reduce_sum_dict({k: float(v) for k, v in failures.items()}))
        if cfg.rollout.takes_rows:  # agent/*, timing/agent_*: this rank's rollouts (docs/agents.md)
            sampling.agent_metrics(sampling.n_generated * self.G, self.engine.pop_metrics())
        return sampling.finish()

    def generate_and_score(self, examples: list[PromptExample], seed: int, timer: Timer, failures: dict[str, int]) -> Batch:
        cfg, G = self.cfg, self.G
        r = cfg.rollout
        params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_tokens, G, seed)
        with timer("rollout"):
            completions = generate_for(self.engine, examples, params, self.cfg.rollout.takes_rows)  # the agent loop / endpoint take rows
        masks = [trajectory_mask(c) for c in completions]  # 1 on the tokens the policy sampled
        with timer("reward"):
            texts = [model_text(self.tokenizer, c) for c in completions]  # what the policy wrote, not tool output
            owners = [examples[c.prompt_index] for c in completions]
            out = self.reward_fn(texts, [e.ground_truth for e in owners], [e.row for e in owners])
            failures["reward/calls"] += len(texts) * len(cfg.reward.verifiers)  # one call per verifier
            for key, n in out.failures.items():
                failures[key] = failures.get(key, 0) + n  # plus model rewards' counts (judge_unparsed)
            scores = [s + c.env_reward for s, c in zip(out.scores, completions)]  # + environments'
            rewards = scores
            ob = cfg.algorithm.overlong_buffer
            if ob.enable:  # the length the model produced: its own tokens, not the tools'
                lengths = torch.tensor([sum(m) for m in masks])
                penalty = algo.overlong_penalty(lengths, r.max_tokens, ob.len, ob.penalty_factor)
                rewards = [s + p for s, p in zip(scores, penalty.tolist())]
        names = list(out.metrics)
        return Batch(
            prompt_ids=[c.prompt_ids or e.prompt_ids for c, e in zip(completions, owners)],  # the gateway's own
            response_ids=[c.token_ids for c in completions],
            loss_masks=masks,
            turns=[len(c.turn_spans) if c.turn_spans is not None else 1 for c in completions],
            finished=[c.finished for c in completions],
            scores=scores,
            rewards=rewards,
            verifier_metrics=[{k: out.metrics[k][i] for k in names} for i in range(len(completions))],
            engine_logprobs=[c.logprobs for c in completions],
            multi_modal=[e.multi_modal for e in owners],
            versions=[c.version for c in completions],
            token_versions=[c.token_versions for c in completions],
            segments=[c.segments for c in completions],
        )

    def advantages(self, batch: Batch) -> torch.Tensor:
        """adv_B of the global batch by `algorithm.adv_estimator` (broadcast to every token by the actor)."""
        a = self.cfg.algorithm
        estimator = algo.get_adv_estimator(a.adv_estimator)
        traj = trajectories(batch)  # extra segments take their trajectory's advantage
        adv = estimator(
            torch.tensor(traj.rewards), self.G, norm_adv_by_std=a.norm_adv_by_std, epsilon=a.epsilon,
            num_tokens_B=torch.tensor(traj.model_tokens),
        )
        extra = [o for o in batch.owners if o is not None]
        return torch.cat([adv, adv[torch.tensor(extra, dtype=torch.long)]]) if extra else adv


def batch_metrics(batch: Batch, prefix: str, group_size: int) -> dict[str, float]:
    """The guides' per-step metrics of a training batch (rewards, scores, lengths, groups without spread).

    response_length/{mean,min,max} count model tokens (what the policy wrote, as in single-turn runs);
    response_length/total_{mean,max} count every token after the prompt, tool results included (what the
    forward computes); num_turns/{mean,max} are logged when some trajectory of the batch has several turns
    or tokens the policy did not sample.
    """
    segments = batch.size
    batch = trajectories(batch)  # per trajectory; the extra segments (rollout.agent) are counted apart
    m = {**summary_stats(f"{prefix}/rewards", batch.rewards), **summary_stats(f"{prefix}/score", batch.scores)}
    if segments > batch.size:
        m["agent/extra_segments"] = float(segments - batch.size)
    if "rm_score" in batch.verifier_metrics[0]:  # the guides: score is the reward model's own when one is on
        m.update(summary_stats(f"{prefix}/score", batch.metric("rm_score")))
    for key in batch.verifier_metrics[0]:
        m[f"{prefix}/{key}/mean"] = sum(batch.metric(key)) / batch.size
    m.update(summary_stats("response_length", [float(n) for n in batch.model_tokens]))
    total = [float(len(r)) for r in batch.response_ids]
    m["response_length/total_mean"] = sum(total) / batch.size
    m["response_length/total_max"] = max(total)
    if any(t > 1 for t in batch.turns) or any(0 in mask for mask in batch.loss_masks):
        m["num_turns/mean"] = sum(batch.turns) / batch.size
        m["num_turns/max"] = float(max(batch.turns))
    m["response_length/clip_ratio"] = sum(not f for f in batch.finished) / batch.size
    m.update(summary_stats("prompt_length", [float(len(p)) for p in batch.prompt_ids]))
    spread = algo.group_keep_mask(torch.tensor(batch.rewards), group_size)
    m[f"{prefix}/zero_spread_groups_ratio"] = 1 - float(spread.float().mean())  # zero advantage: nothing learned
    return m


def staleness_metrics(versions: list[int], step: int) -> dict[str, float]:
    """async/staleness_{mean,max}: how many policy updates behind the trainer (at `step`) each sequence was
    sampled; 0 in sync mode, bounded by rollout.max_staleness once rollout runs asynchronously."""
    lag = [step - v for v in versions]
    assert all(x >= 0 for x in lag), f"a sequence from policy version {max(versions)} is newer than the trainer's step {step}"
    return {"async/staleness_mean": sum(lag) / max(len(lag), 1), "async/staleness_max": float(max(lag, default=0))}


def step_metrics(cfg: Any, batch: Batch, step: int, epoch: int, stats: dict, timing: dict, engine: str) -> dict[str, float]:
    """One training step's metrics row (step `step` + 1): the batch's, its staleness, the rollout's and update's
    `stats`, the timings and the throughput they give."""
    g = cfg.rollout.n_samples_per_prompt
    m = {"training/step": step + 1, "training/epoch": epoch, **batch_metrics(batch, cfg.algorithm.name, g),
         **staleness_metrics(batch.versions, step), **stats, **timing}  # fmt: skip
    return {**m, **throughput(m["response_length/total_mean"], m["prompt_length/mean"], cfg.train.global_batch_size, g,
                              cfg.world_size, timing, engine)}  # fmt: skip


def gather(part: Batch) -> Batch:
    """The whole generation batch from every rank's scored slice (the slice itself on one process)."""
    if not distributed.is_distributed():
        return part
    return concat(distributed.all_gather_object(part))

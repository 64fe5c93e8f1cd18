"""What the trainer checks of every batch a rollout process made ahead (worker.py, pool.py): the staleness
bound (`split_stale`) and the async/* metrics of the hand-over (`take_fresh`); the weights it sampled
with are checked by checksums.py."""

from __future__ import annotations

from postrl.batch import Batch, concat, select, select_groups


def split_stale(batch: Batch, step: int, max_staleness: int, group_size: int) -> tuple[Batch, int]:
    """The groups of `batch` whose every sequence is at most `max_staleness` versions behind `step`, and how
    many groups were dropped for being older."""
    groups = sum(o is None for o in batch.owners) // group_size  # rollout.agent's extra segments come after the groups
    fresh = [g for g in range(groups) if min(batch.versions[g * group_size : (g + 1) * group_size]) >= step - max_staleness]
    kept = select_groups(batch, fresh, group_size)
    if groups * group_size == batch.size:
        return kept, groups - len(fresh)
    new_row = {g * group_size + j: k * group_size + j for k, g in enumerate(fresh) for j in range(group_size)}
    extra = [i for i, o in enumerate(batch.owners) if o is not None and o in new_row]  # those of kept trajectories
    out = concat([kept, select(batch, extra)])
    out.owners = kept.owners + [new_row[batch.owners[i]] for i in extra]
    return out, groups - len(fresh)




def partial_metrics(batch: Batch) -> dict[str, float]:
    """async/partial_ratio: share of sequences sampled by more than one policy version (partial rollout)."""
    mixed = [len(set(v)) > 1 for v in batch.token_versions if v]
    return {"async/partial_ratio": sum(mixed) / len(mixed)} if mixed else {}


def take_fresh(batch: Batch, step: int, max_staleness: int, group_size: int, log, idle: float, queue_depth: int) -> tuple[Batch, dict[str, float]]:
    """The groups of `batch` within the bound at `step` (an older one is logged and counted, never trained on:
    it cannot happen while the rollout side keeps the bound), with the async/* metrics of the hand-over:
    groups dropped, the trainer's wait, the batches made ahead, the partial-rollout share."""
    fresh, dropped = split_stale(batch, step, max_staleness, group_size)
    if dropped:
        log(f"[yellow]async: dropped {dropped} group(s) older than rollout.max_staleness={max_staleness} at step {step}[/yellow]")
    stats = {"async/dropped_stale_groups": float(dropped), "async/trainer_idle_s": idle, "async/queue_depth": float(queue_depth)}
    stats.update(partial_metrics(fresh))
    return fresh, stats

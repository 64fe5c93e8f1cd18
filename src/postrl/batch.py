"""The Batch record: B sequences, every field a per-sequence list, prompt-major (the G samples of a prompt
are contiguous). Because every field has one entry per sequence, concatenation and row selection are generic
(`concat`, `select`), not field by field. A sequence is a token-level trajectory: `response_ids` may
interleave model turns with tool / environment tokens, and its `loss_masks` entry marks which tokens the
policy sampled (all ones for a single-turn completion); every count the loss and the response-length metrics
use is of those model tokens. rollout.agent's extra segments of a trajectory become rows of their own
(`expand_segments`) whose `owners` entry points at the trajectory's row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from postrl import distributed
from postrl.rollout.base import Completion


@dataclass
class Batch:
    """B sequences, prompt-major. Each field holds one entry per sequence."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # everything after the prompt: model turns and, for agents, tool tokens
    loss_masks: list[list[int]]  # one entry per response token: 1 = sampled by the policy (trained on)
    turns: list[int]  # model turns of each trajectory (1: single turn)
    finished: list[bool]  # stopped at EOS (else cut at max_tokens)
    scores: list[float]  # raw weighted verifier score
    rewards: list[float]  # score after overlong shaping
    verifier_metrics: list[dict[str, float]]  # each verifier's named metrics (acc, ...)
    engine_logprobs: list[list[float] | None]  # the engine's sampling log-probs per response token (0.0 where masked)
    multi_modal: list[dict | None]  # each sequence's image inputs (VLMs), else None
    # the policy version (trainer step) that sampled each sequence; None entries are stamped by
    # Experience.collect with the trainer's step; a Batch built without them is from version 0
    versions: list[int | None] = field(default_factory=list)
    # async partial rollout: the version of every response token (None: all of the sequence's version)
    token_versions: list[list[int] | None] = field(default_factory=list)
    # rollout.agent (DESIGN.md section 12): a trajectory's other segments (Completions), carried with its row
    # until `expand_segments` makes each a row of its own whose `owners` entry is the trajectory's row
    segments: list[list | None] = field(default_factory=list)
    owners: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [0] * len(self.response_ids)
        if not self.token_versions:
            self.token_versions = [None] * len(self.response_ids)
        if not self.segments:
            self.segments = [None] * len(self.response_ids)
        if not self.owners:
            self.owners = [None] * len(self.response_ids)

    @property
    def size(self) -> int:
        return len(self.response_ids)

    @property
    def has_engine_logprobs(self) -> bool:
        return self.size > 0 and all(lp is not None for lp in self.engine_logprobs)

    @property
    def lengths(self) -> list[int]:
        """Prompt + response tokens of each sequence, model and tool tokens alike (what a forward computes)."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def model_tokens(self) -> list[int]:
        """Tokens the policy sampled in each sequence (its response length, for the loss and the metrics)."""
        return [sum(m) for m in self.loss_masks]

    def metric(self, name: str) -> list[float]:
        """One verifier metric (or 'score' / 'seq_reward') of every sequence."""
        if name == "score":
            return self.scores
        if name == "seq_reward":
            return self.rewards
        return [m[name] for m in self.verifier_metrics]


def concat(batches: list[Batch]) -> Batch:
    return Batch(**{f.name: [x for b in batches for x in getattr(b, f.name)] for f in fields(Batch)})


def select(batch: Batch, rows: list[int]) -> Batch:
    return Batch(**{f.name: [getattr(batch, f.name)[i] for i in rows] for f in fields(Batch)})


def select_groups(batch: Batch, groups: list[int], group_size: int) -> Batch:
    """Whole groups of `batch`, in the order given."""
    return select(batch, [g * group_size + j for g in groups for j in range(group_size)])


def expand_segments(batch: Batch) -> Batch:
    """Each trajectory's other segments (rollout.agent: a history the program edited) as rows after the
    trajectories, with its reward, score and metrics, and `owners` pointing at its row (DESIGN.md section 12)."""
    extra = [(i, seg) for i, segs in enumerate(batch.segments) for seg in segs or []]
    extra = extra[: len(extra) - len(extra) % distributed.data_parallel_size()]  # every rank gets as many rows
    if not extra:
        return batch
    rows = [i for i, _ in extra]
    more = select(batch, rows)
    more.prompt_ids = [seg.prompt_ids for _, seg in extra]
    more.response_ids = [seg.token_ids for _, seg in extra]
    more.loss_masks = [trajectory_mask(seg) for _, seg in extra]
    more.turns = [len(seg.turn_spans or [None]) for _, seg in extra]
    more.finished = [seg.finished for _, seg in extra]
    more.engine_logprobs = [seg.logprobs for _, seg in extra]
    more.versions = [batch.versions[i] if seg.version is None else seg.version for i, seg in extra]
    more.token_versions = [None] * len(extra)
    more.owners = rows
    out = concat([batch, more])
    out.segments = [None] * out.size
    return out


def trajectories(batch: Batch) -> Batch:
    """The batch without the extra segments `expand_segments` added (one row per trajectory, groups contiguous)."""
    if all(o is None for o in batch.owners):
        return batch
    return select(batch, [i for i, o in enumerate(batch.owners) if o is None])


def trajectory_mask(c: Completion) -> list[int]:
    """The loss mask of a completion: its own, or all ones (a single turn, every token sampled)."""
    if c.loss_mask is None:
        return [1] * len(c.token_ids)
    assert len(c.loss_mask) == len(c.token_ids), f"loss_mask has {len(c.loss_mask)} entries for {len(c.token_ids)} tokens"
    return list(c.loss_mask)

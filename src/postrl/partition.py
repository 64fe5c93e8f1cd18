"""Which rows of a batch each rank works on, and how a rank's rows become micro-batches.

- `shard_range` gives each rank a contiguous slice of every generation batch (a group's n samples
  stay on one rank); the experience step gathers the scored slices so that every rank holds the
  whole generation batch and takes the same dynamic-sampling decisions.
- `rank_rows` then deals each mini-batch's sequences to the ranks in equal numbers (token-balanced
  with dynamic batch size), and `token_budget_micro_batches` cuts a rank's rows into micro-batches by
  token budget with the same number of micro-batches on every rank (FSDP's collectives need matching
  forward calls).

Every function is deterministic, so all ranks compute the same partition without talking; only
`token_budget_micro_batches` takes a collective (the max micro-batch count over ranks).
"""

from __future__ import annotations

import heapq
import math

from postrl.distributed import all_reduce_max, data_parallel_rank, data_parallel_size, rank, world_size


def shard_range(n: int) -> tuple[int, int]:
    """This rank's contiguous slice [lo, hi) of n items (sizes differ by at most one)."""
    W, r = world_size(), rank()
    return r * n // W, (r + 1) * n // W


def shard_seed(seed: int, offset: int) -> int:
    """Sampling seed of a slice that starts at global position `offset` (the seed itself at 0)."""
    return (seed + 1_000_003 * offset) % 2**31


def balanced_partition(lengths: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `lengths` split into k parts of near-equal total length (greedy LPT).

    Longest first, each item goes to the lightest part (with `equal_size`, the lightest part that
    still has room for len(lengths) / k items, which must divide evenly). Deterministic, so every
    rank computes the same partition. Each part's indices are sorted; parts are ordered by their
    first index.
    """
    n = len(lengths)
    assert k >= 1, "need at least one part"
    assert not equal_size or n % k == 0, f"{n} items do not split into {k} equal parts"
    cap = n // k if equal_size else n
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    heap = [(0, 0, j) for j in range(k)]  # (load, items, part): ties go to the part with fewer items
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, count, j = heapq.heappop(heap)
        while count >= cap:  # only with equal_size: this part is full, so it is not offered again
            load, count, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, j))
    result = [sorted(p) for p in parts if p]
    return sorted(result, key=lambda p: p[0])


def token_budget_micro_batches(lengths: list[int], max_token_len: int, sync_ranks: bool = True) -> list[list[int]]:
    """Positions of `lengths` grouped into micro-batches of at most ~max_token_len tokens.

    The number of micro-batches is the smallest that fits the budget (a sequence longer than the
    budget gets a micro-batch of its own); with `sync_ranks` it is raised to the largest count over
    ranks (a collective: every rank must call this together), because FSDP's per-layer collectives
    need the same number of forward/backward passes on every rank. Sequences are dealt to the
    micro-batches by `balanced_partition`, so micro-batches carry similar token counts; callers
    scatter results back by the returned positions, which restores the original order.
    """
    n = len(lengths)
    assert n > 0, "no sequences to split into micro-batches"
    k = min(n, max(1, math.ceil(sum(lengths) / max_token_len)))
    while k < n and max(sum(lengths[i] for i in p) for p in balanced_partition(lengths, k)) > max_token_len:
        k += 1
    if sync_ranks:
        k = min(n, all_reduce_max(k))
    return balanced_partition(lengths, k)


def rank_rows(lengths: list[int], mini_batch: int, balance: bool = False) -> list[int]:
    """Rows of a global batch that this rank trains on, mini-batch after mini-batch.

    Each mini-batch of `mini_batch` sequences is dealt to the ranks in equal numbers, so that every
    rank's local mini-batch is mini_batch / W rows long and the local rows of a mini-batch stay
    contiguous: contiguous slices, or with `balance` an equal-size token-balanced partition (used with
    dynamic batch size, so no rank waits for a rank with longer sequences). With sequence parallelism W is
    the data-parallel size: the ranks of a sequence-parallel group get the same rows.
    """
    W, r, n = data_parallel_size(), data_parallel_rank(), len(lengths)
    if W == 1:
        return list(range(n))
    assert mini_batch % W == 0, f"a mini-batch of {mini_batch} sequences does not split over {W} ranks"
    rows: list[int] = []
    for start in range(0, n, mini_batch):
        idx = list(range(start, min(start + mini_batch, n)))
        if balance:
            parts = balanced_partition([lengths[i] for i in idx], W, equal_size=True)
            rows += [idx[j] for j in parts[r]]
        else:
            per = len(idx) // W
            rows += idx[r * per : (r + 1) * per]
    return rows


def pack_sequences(lengths: list[int], capacity: int | None = None) -> tuple[list[int], list[int], tuple[int, int]]:
    """Rows and offsets that pack sequences of `lengths` without padding: (row_of, offset_of, (rows, width)).

    First-fit decreasing into rows of `capacity` tokens (None: one row holding everything); a
    sequence is never split. The width is the longest row. Deterministic.
    """
    assert lengths, "no sequences to pack"
    cap = capacity or sum(lengths)
    assert max(lengths) <= cap, f"a sequence of {max(lengths)} tokens does not fit a row of {cap}"
    row_of, offset_of = [0] * len(lengths), [0] * len(lengths)
    fill: list[int] = []  # tokens used in each row
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, used in enumerate(fill) if used + lengths[i] <= cap), len(fill))
        if r == len(fill):
            fill.append(0)
        row_of[i], offset_of[i] = r, fill[r]
        fill[r] += lengths[i]
    return row_of, offset_of, (len(fill), max(fill))


def share_prompts(
    same_prompt: list[bool], prompt_lens: list[int], response_lens: list[int], capacity: int | None = None
) -> tuple[list[bool], list[int]]:
    """Which sequences start a packing unit `prompt, response, response, ...`, and each unit's length.

    Sequence i joins the unit before it when its prompt is the same as sequence i-1's (`same_prompt[i]`)
    and the unit stays within `capacity` tokens (None: no limit); otherwise it leads a new unit with its
    own copy of the prompt. Returns (leader flag per sequence, tokens per unit).
    """
    leaders, lengths = [], []
    for i, (same, p, r) in enumerate(zip(same_prompt, prompt_lens, response_lens)):
        if i > 0 and same and (capacity is None or lengths[-1] + r <= capacity):
            leaders.append(False)
            lengths[-1] += r
        else:
            leaders.append(True)
            lengths.append(p + r)
    return leaders, lengths

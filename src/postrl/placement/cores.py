"""How the cores of one machine are shared between the trainer and the rollout worker beside it
(`rollout.placement: worker` on CPU): the side that waits lends its threads to the other."""

from __future__ import annotations

import contextlib

import torch

TRAINER, WORKER = 0, 1


class CoreShare:
    """On CPU the cores are split between the trainer and the worker (runtime.threads_for: `threads` each);
    a side that waits for the other lends it its threads. Each side marks the time it waits (`waiting`) and
    takes `threads(side)` at its next forward (the trainer) or generation call (the worker), so the trainer's
    update runs on every core once the worker has made its batch, and the worker's next call does while
    the trainer waits for it. A side drops back to its own share before it wakes the other (publishing
    weights, taking or handing over a batch), so the two never hold more threads than there are cores.
    Off (`enabled` False) on an accelerator or when the user fixed the thread count."""

    def __init__(self, ctx, threads: int, enabled: bool):
        self.base, self.enabled = threads, enabled
        self.flags = ctx.Array("b", 2, lock=False)  # [trainer, worker]: 1 while that side waits for the other

    def threads(self, side: int) -> int:
        return 2 * self.base if self.enabled and self.flags[1 - side] else self.base

    def take(self, side: int) -> None:
        """This side's thread count for what it does next (its share, plus the other's while that one waits)."""
        if self.enabled and (n := self.threads(side)) != torch.get_num_threads():
            torch.set_num_threads(n)

    def own(self) -> None:
        """Back to this side's own share (before waking the other side)."""
        if self.enabled and torch.get_num_threads() != self.base:
            torch.set_num_threads(self.base)

    @contextlib.contextmanager
    def waiting(self, side: int):
        self.own()
        self.flags[side] = 1
        try:
            yield
        finally:
            self.flags[side] = 0


"""Weight transport from the trainer to its rollout processes (docs/async.md).

`SharedWeights` holds the trainer's trainable parameters, one flat buffer per dtype, allocated once:
after each update the trainer copies its parameters in (`publish`) and raises the version. Only what
training changes travels: a LoRA policy sends its adapters (the rollout side merges them for vLLM, as the
colocated engine does), a full fine-tune every parameter. Every version carries a checksum the rollout side
recomputes from the weights it loaded, so a silently missed or partial update is caught when its samples
reach the trainer (checksums.PublishedChecksums).

Two ways out of the buffers: on one machine (`rollout.placement: worker`) they live in shared memory and
the worker copies them out (`load`) between generation calls, a sequence counter making each copy whole
(no torn read); to a pool's replicas on any node (`rollout.placement: pool`) the same buffers are
broadcast over a process group per replica (pool.py sends, replica.ReceivedWeights receives). With
several trainer ranks, rank 0 writes (under FSDP2 every rank joins the gather, `join_publish`).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from dataclasses import dataclass

import torch

_POLL_S = 0.002  # a reader's look at the counters while it waits (a few microseconds of work each)


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters training changes, in a fixed order (LoRA: the adapters only)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def checksum(tensors: list[torch.Tensor]) -> float:
    """An order-aware fp64 fingerprint of `tensors`: equal weights give the identical number; a stale or
    half-copied tensor changes it."""
    total = 0.0
    for i, t in enumerate(tensors):
        t = t.detach()
        # sum and L1 norm with incommensurate weights: a change to a negative element cannot cancel out
        total += (i + 1) * float(t.sum(dtype=torch.float64)) + math.sqrt(2) * float(torch.linalg.vector_norm(t, 1, dtype=torch.float64))
    return total


def join_publish(model: torch.nn.Module) -> None:
    """A rank other than 0 at `SharedWeights.publish`: the collectives that gather FSDP2 shards (nothing to
    do for replicated parameters); rank 0 writes the gathered weights."""
    for _, p in trainable(model):
        if hasattr(p, "full_tensor"):
            p.full_tensor()


class SharedWeights:
    """The trainer's trainable parameters in shared memory, with a version and a checksum per version.

    Built by the trainer from its model; handed to the worker process whole (torch's multiprocessing
    shares the buffers and counters, nothing is copied at hand-over). No lock is shared: a worker killed
    mid-copy must not leave the trainer blocked. The trainer makes `seq` odd while it writes and even
    when done; a reader that saw it odd, or see it change during its copy, copies again (a seqlock).
    """

    def __init__(self, model: torch.nn.Module, ctx: mp.context.BaseContext):
        self.slots: list[_Slot] = []
        sizes: dict[torch.dtype, int] = {}
        for name, p in trainable(model):
            self.slots.append(_Slot(name, p.dtype, sizes.get(p.dtype, 0), p.numel(), tuple(p.shape)))
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        self.buffers = {dtype: torch.empty(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
        self.seq = ctx.Value("q", 0, lock=False)  # one writer (the trainer): no lock needed to write it
        self.version = ctx.Value("q", -1, lock=False)

    def _views(self) -> list[torch.Tensor]:
        return [self.buffers[s.dtype][s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> float:
        """Copy `model`'s trainable parameters in as `version`; returns their checksum."""
        params = [p for _, p in trainable(model)]
        assert len(params) == len(self.slots), "the model's trainable parameters changed since the buffers were made"
        self.seq.value += 1  # odd: being written
        views = self._views()
        for view, p in zip(views, params):
            view.copy_((p.full_tensor() if hasattr(p, "full_tensor") else p).detach())
        self.version.value = version
        self.seq.value += 1
        return checksum(views)  # of the whole tensors (an FSDP2 shard's sum would be a collective)

    def latest(self) -> int:
        return int(self.version.value)

    def publications(self) -> int:
        """How many copies were published and finished (a version published again counts: a back-off)."""
        return int(self.seq.value) // 2

    @torch.no_grad()
    def load(self, model: torch.nn.Module) -> tuple[int, float]:
        """Copy the newest published weights into `model`'s parameters; returns (version, checksum of what the
        model now holds)."""
        named = dict(model.named_parameters())  # by name: the worker's copy may freeze fewer parameters
        params = [named[s.name] for s in self.slots]
        while True:
            before = self.seq.value
            if before % 2:  # the trainer is writing
                time.sleep(_POLL_S)
                continue
            for view, p in zip(self._views(), params):
                p.copy_(view)
            version = int(self.version.value)
            if self.seq.value == before:
                return version, checksum(params)

    def wait_newer(self, than: int, timeout: float) -> bool:
        """Poll until a version above `than` is published (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while self.version.value <= than:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

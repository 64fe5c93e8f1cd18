"""The replica's side of pool.py (`rollout.placement: pool`): the weights it receives from the
trainer's group, checked by publication number and checksum, and the Ray actor's body that generates the
prompt chunks it is dealt with the assembly's rollout-worker role (engine, agents, rewards). Its replies (where it
runs, each chunk, a failure) go to the trainer as bytes in a declared shape (wire.py) under keys of the trainer's
TCP store, never through Ray's object store (which the trainer would unpickle)."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any

import torch

import postrl.placement.wire as wire
from postrl.placement.transport import checksum
from postrl.placement.versioned import NeverStop, versioned

TIMEOUT = datetime.timedelta(seconds=120)  # a collective that waits longer than this fails (its peer is gone)


def make_group(backend: str, store: Any, rank: int) -> Any:
    """A two-member process group {trainer: 0, replica: 1} on `store`, outside the default group."""
    from postrl.runtime import pair_group

    return pair_group(backend, store, rank, 2, TIMEOUT)


class ReceivedWeights:
    """The replica's side of the broadcast, with SharedWeights' reading interface (VersionedEngine reads it):
    a thread receives each publication into a staging buffer and hands it over whole."""

    def __init__(self, slots: list, device: torch.device):
        self.slots, self.device = slots, device
        sizes: dict[torch.dtype, int] = {}
        for s in slots:
            sizes[s.dtype] = max(sizes.get(s.dtype, 0), s.offset + s.numel)
        self.sizes = sizes
        self.ready: dict[torch.dtype, torch.Tensor] | None = None
        self.header = (-1, 0, 0.0)  # version, publication number, checksum of the ready buffers
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.load_seconds = 0.0

    def receive_forever(self, group: Any) -> None:
        try:
            while True:
                head = torch.zeros(2, dtype=torch.int64, device=self.device)
                group.broadcast(head, 0).wait()
                total = torch.zeros(1, dtype=torch.float64, device=self.device)
                group.broadcast(total, 0).wait()
                bufs = {}
                for dtype, n in self.sizes.items():
                    bufs[dtype] = torch.empty(n, dtype=dtype, device=self.device)
                    group.broadcast(bufs[dtype], 0).wait()
                version, number = (int(x) for x in head.tolist())
                with self.cond:
                    if number != self.header[1] + 1:  # a publication missed: never sample with older weights
                        raise RuntimeError(f"publication {number} arrived after {self.header[1]}: one was missed")
                    self.ready, self.header = bufs, (version, number, float(total.item()))
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the trainer went away, or a check failed: the sampler sees it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the weight receiver stopped: {self.error}")

    def latest(self) -> int:
        self._check()
        return self.header[0]

    def publications(self) -> int:
        return self.header[1]

    def wait_newer(self, than: int, timeout: float) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.header[0] > than or self.error is not None, timeout)
        self._check()
        return self.header[0] > than

    @torch.no_grad()
    def load(self, model: torch.nn.Module) -> tuple[int, float]:
        """The newest publication into `model`; its checksum must equal the trainer's (else it was torn)."""
        start = time.perf_counter()
        with self.cond:
            self._check()
            bufs, (version, _, expected) = self.ready, self.header
        named = dict(model.named_parameters())
        params = [named[s.name] for s in self.slots]
        for s, p in zip(self.slots, params):
            p.copy_(bufs[s.dtype][s.offset : s.offset + s.numel].view(s.shape))
        got = checksum(params)
        if got != expected:
            raise RuntimeError(f"weights of version {version} loaded with checksum {got!r}, published as {expected!r}")
        self.load_seconds += time.perf_counter() - start
        return version, got


class Replica:
    """One rollout replica (the body of a Ray actor): the assembly's rollout-worker role, its weights from the
    trainer's group, generating the chunks it is dealt."""

    def __init__(self, cfg: Any, examples: list, slots: list, threads: int):
        from postrl.children import scrub_environ
        from postrl.assembly import build_run
        from postrl.placement.worker import passthrough

        scrub_environ(passthrough(cfg), rollout=True)  # first (pool.py blanked the rest in the process's own start)
        torch.set_num_threads(threads)
        self.cfg, self.examples = cfg, examples
        self.weights: ReceivedWeights | None = None
        self.slots = slots
        self.store: Any = None  # the trainer's store under this connection's prefix: replies go there

        def received(run) -> ReceivedWeights:
            self.weights = ReceivedWeights(slots, torch.device("cpu") if run.runtime.device.type == "cpu" else run.runtime.device)
            return self.weights

        wrap = versioned(cfg, examples, received, NeverStop(), os.getppid())
        self.run = build_run(cfg, "rollout-worker", examples=examples, prepare=lambda model: None, wrap=wrap)

    def connect(self, host: str, port: int, prefix: str, backend: str) -> None:
        """Join the trainer's store (where it runs under key 'where') and group (in a thread: the trainer sends
        to it from now on)."""
        import ray
        import torch.distributed as dist

        from postrl.local_cluster import join_store

        self.store = store = dist.PrefixStore(prefix, join_store(host, port, TIMEOUT))  # on loopback: groups over lo
        self._reply("where", json.dumps({"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}).encode())

        def serve():
            self.weights.receive_forever(make_group(backend, store, 1))

        threading.Thread(target=serve, daemon=True, name="postrl-weights").start()

    def _reply(self, key: str, data: bytes) -> None:
        self.store.set(key, data)
        self.store.check([key])  # a round trip: the store holds it before this call returns (the trainer waits for that)

    def generate(self, index: int, gen: int, lo: int, rows: list[int], min_version: int, key: str) -> None:
        """Generate and score prompts `rows` (chunk `lo` of generation batch `gen` of batch `index`) with weights of
        `min_version` or newer; the reply (wire.Chunk, or wire.Failure when it raised) goes to store key `key`."""
        try:
            data = wire.encode_chunk(self._generate(index, gen, lo, rows, min_version), self.examples)
        except Exception as exc:  # noqa: BLE001 - the trainer restarts this replica, or stops on a data error
            data = wire.encode_failure(exc)
        self._reply(key, data)

    def _generate(self, index: int, gen: int, lo: int, rows: list[int], min_version: int) -> dict:
        from postrl.experience import new_failures, sampling_seed
        from postrl.metrics import Timer

        exp = self.run.experience
        idle = exp.engine.wait_for(max(min_version, 0))  # and some weights at all
        start = time.perf_counter()
        timer = Timer()
        failures = new_failures()
        batch = exp.generate_and_score([self.examples[i] for i in rows], sampling_seed(self.cfg, index, gen, lo), timer, failures)
        agent = exp.engine.pop_metrics() if self.cfg.rollout.takes_rows else None  # agent/*: this chunk's rollouts
        load, self.weights.load_seconds = self.weights.load_seconds, 0.0
        return {"batch": batch, "failures": failures, "seconds": dict(timer.seconds), "busy": time.perf_counter() - start,
                "idle": idle, "load_s": load, "checksums": dict(exp.engine.checksums), "tokens": sum(batch.model_tokens),
                "agent": agent}  # fmt: skip

"""Rollout as a service (`rollout.placement: pool`, DESIGN.md section 12): rollout replicas as Ray actors on
their own cores / devices, on any node of the cluster; weights by broadcast (docs/async.md).

    trainer (rank 0)                                      replica r (a Ray actor in its placement group)
    next_batch(s): deal prompt chunks of batch b          | policy copy + engine (vLLM / HF, agents) + rewards
      (b <= newest version + k) to replicas as they free  | receiver thread: version v from the trainer's
      up; a batch is returned once all its groups are in  |   group -> staging buffer, checked by checksum
    publish(model, v): gather once (FSDP2), broadcast ->  | generate(chunk): load the newest version, then
      every replica's group {trainer, replica}            |   Experience.generate_and_score (stamped)

Dealing: batch b's prompts are drawn in the sync loop's order (gen_batch_size prompts, more for dynamic
sampling) and split into `ceil(gen_batch_size / replicas)`-group chunks; a replica that frees up takes the
next chunk whose batch is within the bound (b - k <= the newest published version), so no sequence is more
than k updates old, whichever replica made it. Each chunk carries the seeds of sync step b.

Weights: each replica meets the trainer in a torch.distributed group of two (gloo on CPU, the accelerator
record's backend otherwise) over a TCP store the trainer hosts; a publication is a header (version,
publication number, checksum) and one flat buffer per dtype, gathered from FSDP2 shards once
(transport.SharedWeights packs them). One group per replica rather than one for all: a replica that dies
breaks only its own group (its restart forms a new one), at the cost of one send per replica from the
trainer. The replica checks the publication number (none missed) and the checksum of what it loaded before
it samples; the trainer checks every batch's versions and checksums against what it published.

Replies: a replica writes each chunk's reply (and where it runs) as bytes in a declared shape (wire.py) under a key
of the trainer's store; the trainer waits for the actor's call with `ray.wait` (which fetches nothing) and
decodes the key, so nothing a replica produced is unpickled here. A call done without a reply (the actor died),
or a reply that does not decode, is that replica's failure; a failure reply marked as a data error stops the run.

Faults: a replica that dies (its actor's call fails) is restarted up to `rollout.pool.max_restarts` times
(default rollout.max_worker_restarts), then dropped while the rest go on; the chunks it had are dealt again.
Every batch carries the sampler position after its prompts, as the worker's do (remote.RemoteSource).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import postrl.placement.wire as wire
from postrl.errors import UserError
from postrl.batch import Batch, concat
from postrl.experience import DynamicSampling
from postrl.local_cluster import import_ray, serving_store, start_ray
from postrl.placement.checksums import PublishedChecksums
from postrl.placement.remote import WorkerDied
from postrl.placement.replica import TIMEOUT, Replica, make_group
from postrl.placement.staleness import take_fresh
from postrl.placement.transport import SharedWeights


@dataclass
class _Chunk:
    index: int  # the batch (training step) it is for
    gen: int  # its generation batch within the step (dynamic sampling draws more)
    lo: int  # its first prompt's place in the generation batch
    rows: list[int]  # prompt indices


@dataclass
class _Member:
    """The trainer's handle on one replica."""

    rank: int
    actor: Any = None
    placement: Any = None
    group: Any = None
    where: dict = field(default_factory=dict)
    task: Any = None  # the ObjectRef of its chunk in flight (waited for, never fetched)
    store: Any = None  # the trainer's store under this connection's prefix: the replica's replies
    replies: int = 0  # chunks dealt on this connection (the key of each reply)
    chunk: _Chunk | None = None
    restarts: int = 0
    alive: bool = True
    sent: int = 0  # publications sent to this actor
    keep: list = field(default_factory=list)  # the tensors of the publication being sent
    tokens: float = 0.0
    busy: float = 0.0
    lag: list = field(default_factory=list)
    publish_s: float = 0.0
    load_s: float = 0.0


@dataclass
class _Open:
    """A batch being made: its dynamic sampling (the sync loop's) and its chunks per generation batch."""

    index: int
    sampling: DynamicSampling
    pending: dict = field(default_factory=dict)  # gen -> {lo: Batch or None}
    seconds: dict = field(default_factory=dict)
    closed: bool = False  # no more prompts will be drawn for it
    sampler: dict | None = None


class RolloutPool:
    """The trainer's side of the pool (a remote.Backend, as the worker's AsyncRollout is)."""

    @classmethod
    def open(cls, cfg: Any, run: Any, step: int, log) -> "RolloutPool":
        return cls(cfg, run.policy.model, run.examples, run.sampler.state_dict(), step, log)

    def __init__(self, cfg, model: torch.nn.Module, examples: list, sampler: dict, step: int, log):
        from postrl.data.dataset import PromptSampler

        self.cfg, self.examples, self.log = cfg, examples, log
        self.k, self.G = cfg.rollout.max_staleness, cfg.rollout.n_samples_per_prompt
        self.pool = cfg.rollout.pool
        self.max_restarts = self.pool.max_restarts if self.pool.max_restarts is not None else cfg.rollout.max_worker_restarts
        self.ray = ray = _import_ray(cfg.cluster.ray_address)
        start_ray(cfg.cluster.ray_address, log_to_driver=False)  # a cluster of the run's own on loopback, or the one named
        from postrl.runtime import accelerator

        self.acc = accelerator()
        self.backend = self.acc.backend
        self.host, self.store = serving_store(TIMEOUT)  # on 127.0.0.1 for a local cluster (local_cluster.py)
        self.packer = SharedWeights(model, torch.multiprocessing.get_context("spawn"))
        self.vocab = wire.vocab_size(model)  # every reply's token ids are checked against it
        self.sums = PublishedChecksums(self.k)
        self.version, self.header = -1, (0, 0.0)  # newest published; its publication number and checksum
        self.restarts = 0  # whole-pool restarts (remote.RemoteSource counts them)
        self.sampler = PromptSampler(len(examples), cfg.data.shuffle, cfg.data.seed)
        self.examples_ref = ray.put(examples)
        self.members = [_Member(r) for r in range(self.pool.replicas)]
        self.generation = 0  # group names are unique per start
        self.publish(model, step)
        self._start(sampler, step)

    # ------------------------------------------------------------------------- replicas
    def _launch(self, m: _Member) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = self.pool
        bundle = {"CPU": p.cpus_per_replica, **p.resources}
        if p.devices_per_replica:
            bundle[self.acc.ray_resource] = p.devices_per_replica
        m.placement = placement_group([bundle])
        actor_cls = self.ray.remote(Replica)
        m.actor = actor_cls.options(
            num_cpus=p.cpus_per_replica, resources={self.acc.ray_resource: p.devices_per_replica} if p.devices_per_replica and self.acc.ray_resource != "GPU" else None,
            num_gpus=p.devices_per_replica if self.acc.ray_resource == "GPU" else 0, max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(m.placement), name=None, runtime_env=_runtime_env(self.cfg),
        ).remote(self.cfg, self.examples_ref, self.packer.slots, p.cpus_per_replica)  # fmt: skip

    def _connect(self, m: _Member) -> None:
        """Form the replica's group with the trainer and send it the newest weights."""
        import torch.distributed as dist

        self.generation += 1
        prefix = f"pool/{m.rank}/{self.generation}"
        m.store, m.replies = dist.PrefixStore(prefix, self.store), 0
        self.ray.wait([m.actor.connect.remote(self.host, self.store.port, prefix, self.backend)], num_returns=1, timeout=None)
        try:
            m.where = wire.decode_where(self._pop(m, "where")).model_dump()
        except wire.WireError as exc:
            raise WorkerDied(f"rollout replica {m.rank} did not start: {exc}") from None
        m.group = make_group(self.backend, m.store, 0)
        for work in self._send(m):
            work.wait()

    def _start(self, sampler: dict, step: int) -> None:
        self.sampler.load_state_dict(sampler)
        self.open: list[_Open] = []  # batches being made or made, from `step` on, in order
        self.next_index = self.next_consumed = step
        self.queue: list[_Chunk] = []
        self.step_start = time.perf_counter()
        for m in self.members:
            if m.alive:
                self._launch(m)
        for m in self.members:
            if m.alive:
                self._connect(m)
        self.log(f"rollout: a pool of {self.alive()} replica(s) on Ray, at most {self.k} update(s) behind: "
                 + ", ".join(f"replica {m.rank} on node {m.where['node'][:8]}" for m in self.members if m.alive))  # fmt: skip

    def alive(self) -> int:
        return sum(m.alive for m in self.members)

    def _failed(self, m: _Member, why: str) -> None:
        """Replica `m` died: its chunk goes back to the front of the queue; restart it or drop it."""
        from rich.markup import escape

        why = escape(why)
        if m.chunk is not None and m.chunk.index >= self.next_consumed:
            self.queue.insert(0, m.chunk)
        m.task = m.chunk = None
        self._kill(m)
        if m.restarts >= self.max_restarts:
            m.alive = False
            self.log(f"[yellow]rollout pool: replica {m.rank} failed ({why}) after {m.restarts} restart(s); dropped, "
                     f"{self.alive()} replica(s) go on[/yellow]")  # fmt: skip
            if not self.alive():
                raise WorkerDied(f"every rollout replica failed; the last: {why}")
            return
        m.restarts += 1
        self.log(f"[yellow]rollout pool: replica {m.rank} failed ({why}); restarting it "
                 f"(restart {m.restarts} of {self.max_restarts})[/yellow]")  # fmt: skip
        self._launch(m)
        self._connect(m)

    def _kill(self, m: _Member) -> None:
        for part in ("actor", "placement"):
            try:
                obj = getattr(m, part)
                if obj is not None:
                    self.ray.kill(obj) if part == "actor" else self.ray.util.remove_placement_group(obj)
            except Exception:  # noqa: BLE001 - already gone
                pass
        m.actor = m.placement = m.group = m.store = None
        m.sent = 0

    # --------------------------------------------------------------------------- weights
    def publish(self, model: torch.nn.Module, version: int) -> None:
        total = self.packer.publish(model, version)  # FSDP2: the shards gathered once
        self.sums.add(version, total)
        self.version, self.header = version, (self.header[0] + 1, total)
        self.publish_s = 0.0
        start = time.perf_counter()
        sending = []
        for m in self.members:  # every replica's sends start at once (each group is its own connection) ...
            if m.alive and m.group is not None:
                try:
                    sending.append((m, self._send(m)))
                except Exception as exc:  # noqa: BLE001 - its peer is gone: the replica died
                    self._failed(m, f"the weight broadcast failed: {exc}")
        for m, works in sending:  # ... then are waited for
            try:
                for work in works:
                    work.wait()
                m.publish_s += time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001
                self._failed(m, f"the weight broadcast failed: {exc}")
        self.publish_s = time.perf_counter() - start

    def _send(self, m: _Member) -> list:
        """Start sending the newest publication to `m`; returns the pending works (wait on them)."""
        device = self.acc.current_device() if self.backend != "gloo" else torch.device("cpu")
        m.sent += 1  # the replica counts them: one missed is caught
        head = torch.tensor([self.version, m.sent], dtype=torch.int64, device=device)
        total = torch.tensor([self.header[1]], dtype=torch.float64, device=device)
        m.keep = [head, total] + [buf.to(device) for buf in self.packer.buffers.values()]  # alive until sent
        return [m.group.broadcast(t, 0) for t in m.keep]

    # ---------------------------------------------------------------------------- dealing
    def _draw(self, b: _Open) -> None:
        """The next generation batch of `b`, in chunks on the queue (the sync loop's prompt order)."""
        gen = b.sampling.draw()
        gen_batch = self.cfg.train.gen_batch_size
        rows = self.sampler.next_indices(gen_batch)
        size = math.ceil(gen_batch / max(1, self.alive()))
        b.pending[gen] = {lo: None for lo in range(0, gen_batch, size)}
        self.queue.extend(_Chunk(b.index, gen, lo, rows[lo : lo + size]) for lo in range(0, gen_batch, size))
        if not self.cfg.algorithm.filter_groups.enable:  # no more prompts for it: the next batch may draw
            b.closed, b.sampler = True, self.sampler.state_dict()

    def _open_next(self) -> None:
        """Open the next batch once the last one drew all its prompts and it is within the bound."""
        while (not self.open or self.open[-1].closed) and self.next_index - self.k <= self.version:
            b = _Open(self.next_index, DynamicSampling(self.cfg, self.next_index))
            self.next_index += 1
            self.open.append(b)
            self._draw(b)

    def _deal(self) -> None:
        self._open_next()
        for m in self.members:
            if m.alive and m.task is None and self.queue:
                chunk = self.queue.pop(0)
                m.chunk, m.dealt = chunk, time.perf_counter()
                m.replies += 1
                m.task = m.actor.generate.remote(chunk.index, chunk.gen, chunk.lo, chunk.rows, chunk.index - self.k, f"reply/{m.replies}")

    def _pop(self, m: _Member, key: str) -> bytes:
        """The bytes replica `m` left under `key` (then deleted); WireError when it left none."""
        if not m.store.check([key]):
            raise wire.WireError("no reply (its process exited or its call failed)")
        data = m.store.get(key)
        m.store.delete_key(key)
        return data

    def _reply(self, m: _Member) -> wire.Chunk:
        """The reply of `m`'s chunk, decoded; WireError for none, a bad one or a failure (UserError: a data error)."""
        got = wire.decode(self._pop(m, f"reply/{m.replies}"), len(self.examples), vocab=self.vocab)
        if isinstance(got, wire.Failure):
            if got.user_error:
                raise UserError(*got.problems, title=got.title or "postrl cannot continue")  # it would recur on any replica
            raise wire.WireError(got.message[:300])
        if not isinstance(got, wire.Chunk):
            raise wire.WireError(f"a reply of kind {got.kind!r} where a chunk was due")
        return got

    def _take(self, m: _Member, out: wire.Chunk) -> None:
        chunk, m.task, m.chunk = m.chunk, None, None
        b = next(o for o in self.open if o.index == chunk.index)
        self.sums.verify(out.checksums, f"rollout replica {m.rank}")  # what it sampled with is what was published
        batch = out.batch.to_batch(self.examples)
        b.pending[chunk.gen][chunk.lo] = batch
        b.sampling.count(out.failures)
        if out.agent is not None:
            b.sampling.agent_metrics(batch.size, out.agent)
        for key, s in out.seconds.items():
            b.seconds[key] = b.seconds.get(key, 0.0) + s
        m.tokens += out.tokens
        m.busy += out.busy
        m.load_s += out.load_s
        m.lag.extend(chunk.index - v for v in batch.versions)
        if all(x is not None for x in b.pending[chunk.gen].values()):
            b.sampling.add(concat([b.pending[chunk.gen][lo] for lo in sorted(b.pending[chunk.gen])]))
            del b.pending[chunk.gen]
            if not b.closed:
                if b.sampling.full:
                    b.closed, b.sampler = True, self.sampler.state_dict()
                else:
                    self._draw(b)

    def _done(self, b: _Open) -> bool:
        return b.closed and not b.pending and b.sampling.full

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float], dict[str, float], dict]:
        """The batch of `step`, as soon as all its groups are in; the replicas go on with the next ones."""
        start = time.perf_counter()
        self.next_consumed = step
        while True:
            self._deal()
            if self.open and self.open[0].index == step and self._done(self.open[0]):
                break
            busy = {m.task: m for m in self.members if m.alive and m.task is not None}
            if not busy:
                raise WorkerDied(f"the rollout pool has no work in flight for step {step}")
            ready, _ = self.ray.wait(list(busy), num_returns=1, timeout=1.0)
            for ref in ready:
                m = busy[ref]
                try:
                    out = self._reply(m)  # never ray.get: what the replica returned is not unpickled
                except wire.WireError as exc:
                    self._failed(m, str(exc))
                    continue
                self._take(m, out)
        b = self.open.pop(0)
        self.next_consumed = step + 1
        full, stats = b.sampling.finish()
        stats.update(self._metrics(step, time.perf_counter() - start))
        batch, tail = take_fresh(full, step, self.k, self.G, self.log, time.perf_counter() - start,
                                 sum(o.closed and not o.pending for o in self.open))  # fmt: skip
        stats.update(tail)
        return batch, stats, b.seconds, b.sampler

    def _metrics(self, step: int, waited: float) -> dict[str, float]:
        """rollout_pool/*: per replica (r0, r1, ...) and in total, over the time since the last batch."""
        now = time.perf_counter()
        wall = max(now - self.step_start, 1e-9)
        self.step_start = now
        out: dict[str, float] = {"rollout_pool/replicas_alive": float(self.alive()), "rollout_pool/publish_s": self.publish_s,
                                 "rollout_pool/restarts": float(sum(m.restarts for m in self.members))}  # fmt: skip
        tokens = idle = 0.0
        lags: list[int] = []
        for m in self.members:
            p = f"rollout_pool/r{m.rank}"
            out[f"{p}/tokens_per_s"] = m.tokens / wall
            out[f"{p}/idle_share"] = max(0.0, 1 - m.busy / wall) if m.alive else 1.0
            out[f"{p}/version_lag"] = sum(m.lag) / len(m.lag) if m.lag else 0.0
            out[f"{p}/weight_update_s"] = m.publish_s + m.load_s
            tokens += m.tokens
            idle += out[f"{p}/idle_share"]
            lags += m.lag
            m.tokens = m.busy = m.publish_s = m.load_s = 0.0
            m.lag = []
        out["rollout_pool/tokens_per_s"] = tokens / wall
        out["rollout_pool/idle_share"] = idle / len(self.members)
        out["rollout_pool/version_lag"] = sum(lags) / len(lags) if lags else 0.0
        out["rollout_pool/version_lag_max"] = float(max(lags, default=0))
        return out

    def restart(self, sampler: dict, step: int, why: str) -> None:
        """Every replica failed: start them all again from the trained position."""
        self.restarts += 1
        self.log(f"[yellow]{why}; restarting the pool (restart {self.restarts}) from step {step}[/yellow]")
        for m in self.members:
            self._kill(m)
            m.alive, m.restarts, m.task, m.chunk = True, 0, None, None
        self._start(sampler, step)

    def borrow_in(self, *models: torch.nn.Module) -> None:
        """The replicas have their own cores: nothing to lend."""

    def where(self) -> list[dict]:
        """Each live replica's node and process id."""
        return [dict(m.where, rank=m.rank) for m in self.members if m.alive]

    def close(self) -> None:
        for m in self.members:
            self._kill(m)
        self.members = []


def _runtime_env(cfg: Any) -> dict:
    """The replicas' Ray runtime environment: every name of this process's environment outside the rollout processes'
    allowlist (children.py) set empty, so that the actor's process starts without the trainer's HF_TOKEN,
    WANDB_API_KEY or cloud keys (a Ray worker inherits its raylet's environment, which a local cluster took from this
    process, and Ray cannot unset a name); Replica then removes them and takes the allowlisted HOME and caches."""
    import os

    from postrl.children import child_env
    from postrl.placement.worker import passthrough

    kept = child_env(passthrough(cfg), rollout=True)
    return {"env_vars": {name: "" for name in os.environ if name not in kept}}


def _import_ray(address: str | None):
    try:
        ray = import_ray(address)  # without an address: Ray's servers on 127.0.0.1 (local_cluster.py)
    except ImportError as exc:
        raise UserError(
            f"rollout.placement is 'pool' but Ray cannot be imported ({exc}): the pool's replicas are Ray actors. Fix: "
            "pip install 'postrl[ray]', or use rollout.placement: worker (one rollout process on this machine)."
        ) from None
    return ray


"""Rollout as a service (issue 35): rollout.placement pool puts replicas on their own node of a Ray cluster,
the weights reach them by broadcast with a version, publication number and checksum, every batch is within
the staleness bound, and a SIGKILLed replica is restarted (then dropped) while no prompt is lost or repeated."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_placement_derives_from_mode_and_sets_it():
    from postrl.config import build_config

    def rollout(**kw):
        return build_config({"model": {"path": "builtin:tiny-qwen2"}, "rollout": kw}).rollout

    assert rollout().placement == "colocated" and rollout(mode="async").placement == "worker"
    pool = rollout(placement="pool", max_staleness=1)
    assert pool.mode == "async" and pool.pool.replicas == 2
    with pytest.raises(Exception, match="placement is colocated"):
        rollout(placement="colocated", mode="async")
    with pytest.raises(Exception, match="placement is pool .* but rollout.mode is sync"):
        rollout(placement="pool", mode="sync")
    from postrl.config import config_notes

    def notes(**kw):
        return config_notes(build_config({"model": {"path": "builtin:tiny-qwen2"}, "rollout": kw}))

    # one knob: rollout.mode is an alias that says so, and only when the user set it
    (note,) = notes(mode="async")
    assert "rollout.mode is a deprecated alias of rollout.placement" in note and "rollout.placement: worker" in note
    assert notes(placement="pool", max_staleness=1) == notes(placement="worker") == notes() == []


def _pair(cfg, model):
    """A trainer-side packer and a replica-side ReceivedWeights joined by a gloo group of two (threads)."""
    import torch.distributed as dist

    from postrl.placement.replica import ReceivedWeights, make_group
    from postrl.placement.transport import SharedWeights

    packer = SharedWeights(model, torch.multiprocessing.get_context("spawn"))
    received = ReceivedWeights(packer.slots, torch.device("cpu"))
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, None, False)
    thread = threading.Thread(target=lambda: received.receive_forever(make_group("gloo", dist.PrefixStore("t", client), 1)), daemon=True)
    thread.start()
    group = make_group("gloo", dist.PrefixStore("t", store), 0)

    def send(version, number, total=None):
        total = packer.publish(model, version) if total is None else total
        group.broadcast(torch.tensor([version, number]), 0).wait()
        group.broadcast(torch.tensor([total], dtype=torch.float64), 0).wait()
        for buf in packer.buffers.values():
            group.broadcast(buf, 0).wait()
        return total

    return received, send


def test_broadcast_weights_carry_a_checksum_and_a_missed_publication_is_caught():
    from postrl.config import build_config
    from postrl.models import load_policy

    cfg = build_config({"model": {"path": "builtin:tiny-qwen2"}})
    trainer = load_policy(cfg.model, dtype="float32", device=torch.device("cpu")).model
    replica = load_policy(cfg.model, dtype="float32", device=torch.device("cpu")).model
    with torch.no_grad():
        next(trainer.parameters()).add_(0.5)
    received, send = _pair(cfg, trainer)
    total = send(3, 1)
    assert received.wait_newer(2, 30)
    assert received.load(replica) == (3, total)
    assert all(torch.equal(a, b) for a, b in zip(trainer.parameters(), replica.parameters()))
    send(4, 2, total=total + 1.0)  # a torn copy: the published checksum differs from what arrives
    assert received.wait_newer(3, 30)
    with pytest.raises(RuntimeError, match="version 4 loaded with checksum"):
        received.load(replica)
    send(5, 4)  # publication 3 never arrived
    with pytest.raises(RuntimeError, match="publication 4 arrived after 2: one was missed"):
        received.wait_newer(4, 30)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine: 'trainer' (the head, where this process is the driver) and 'rollout'."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1}, "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"rollout_node": 2})
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.mark.slow
def test_a_pool_on_another_node_survives_sigkills_and_trains_every_prompt_once(tmp_path, cluster):
    """Trainer on the head node, two replicas pinned to the rollout node (asserted). Replica 0 is SIGKILLed
    before versions 1 and 3 reach it: the first time it is restarted, the second time dropped (one restart
    allowed) and replica 1 goes on. The 4 steps finish, every batch is within max_staleness=1, the kills are
    reported, and the prompts trained are exactly the sync loop's, in order: none lost, none twice (partial
    rollout on: a replica's generation runs in 4-token chunks, loading weights between them). ~30-100 s:
    Ray and two replica processes start on a loaded 2-core machine."""
    import os
    import signal

    import ray

    from postrl.checks import load_config
    from postrl.data.dataset import PromptSampler
    from postrl.placement.pool import RolloutPool
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, "rollout.placement=pool", "rollout.pool.replicas=2", "rollout.max_staleness=1",
                                           "rollout.max_worker_restarts=1", "train.total_steps=4",
                                           "rollout.partial_rollout=true", "rollout.partial_rollout_chunk=4"))  # fmt: skip
    cfg.rollout.pool.resources = {"rollout_node": 1}
    logged: list[str] = []
    tr = Trainer(cfg)
    pool = tr.batches.rollout
    assert isinstance(pool, RolloutPool)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
    assert "trainer_node" in nodes[ray.get_runtime_context().get_node_id()]
    assert [("rollout_node" in nodes[w["node"]]) for w in pool.where()] == [True, True]
    pool.log = lambda msg: (logged.append(msg), tr.log(msg))
    trained: list[list[list[int]]] = []
    real_next, real_publish = tr.batches.next_batch, RolloutPool.publish

    def record(step, timer):
        batch, stats = real_next(step, timer)
        trained.append(batch.prompt_ids[:: cfg.rollout.n_samples_per_prompt])
        return batch, stats

    killed: list[int] = []

    def kill_then_publish(self, model, version):
        if version in (1, 3) and self.members[0].alive:
            pid = self.members[0].where["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return real_publish(self, model, version)

    tr.batches.next_batch = record
    pool.publish = kill_then_publish.__get__(pool)
    tr.fit()
    assert tr.step == 4 and len(killed) == 2
    assert [m.alive for m in pool.members or []] in ([], [False, True])
    assert any("replica 0 failed" in m and "restarting it" in m for m in logged)
    assert any("replica 0 failed" in m and "dropped, 1 replica(s) go on" in m for m in logged)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "async/staleness_max" in r]
    assert len(rows) == 4 and all(r["async/staleness_max"] <= 1 for r in rows)
    assert rows[-1]["rollout_pool/replicas_alive"] == 1 and rows[-1]["rollout_pool/restarts"] == 1
    assert all(r["async/dropped_stale_groups"] == 0 for r in rows)
    # tokens are counted as replies arrive: a step whose window took no reply (its batch came in during the previous
    # step's wait, as after a restart under load) logs 0, so only the run as a whole must have generated
    assert all(r["rollout_pool/tokens_per_s"] >= 0 for r in rows) and sum(r["rollout_pool/tokens_per_s"] for r in rows) > 0
    sampler = PromptSampler(len(tr.run.examples), cfg.data.shuffle, cfg.data.seed)
    expected = [[tr.run.examples[i].prompt_ids for i in sampler.next_indices(cfg.train.gen_batch_size)] for _ in range(4)]
    assert trained == expected
    assert tr.sampler.state_dict() == sampler.state_dict()  # the data position of an uninterrupted run (resume)


EDITING_AGENT = '''
def run(client, row):
    """Two requests; the second's history is edited (the question restated), so each trajectory has a second segment."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    client.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
    edited = [{"role": "user", "content": messages[-1]["content"] + " Restated."}]
    client.chat.completions.create(model=client.model, messages=edited, max_tokens=4)
'''


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["loop", "agent"])
def test_a_pool_collects_as_colocated_does_agent_metrics_and_extra_segments(tmp_path, cluster, kind):
    """Issue 47: the pool takes the one dynamic-sampling path. configs/tiny_tool_dapo.yaml with the agent loop,
    and the same recipe with `rollout.agent` (a program that edits its history: one extra segment per
    trajectory), 2 steps colocated and under `placement: pool`: the pool logs the same agent/* metrics, and
    trains the same rows (2 prompts x 2 samples, plus one extra segment row per trajectory pointing at it)."""
    from pathlib import Path

    from postrl.checks import load_config
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    program = tmp_path / "editing_agent.py"
    program.write_text(EDITING_AGENT)
    how = [f"rollout.agent={program}:run", "rollout.agent_concurrency=4"] if kind == "agent" else []

    def train(placement: str):
        out = tmp_path / placement
        cfg = load_config(root / "configs/tiny_tool_dapo.yaml", [
            "model.path=builtin:tiny-qwen2-tools", "rollout.engine=hf", "rollout.n_samples_per_prompt=2", "rollout.max_tokens=16",
            "rollout.multi_turn.enable=" + str(kind == "loop").lower(), *how,
            "algorithm.filter_groups.enable=false", "algorithm.overlong_buffer.len=4", "train.global_batch_size=2",
            "train.gen_batch_size=2", "train.micro_batch_size=4", "train.total_steps=2", "train.warmup_steps=0", "eval.freq=0",
            "eval.before_train=false", "data.tool_arithmetic.train_size=64", "data.tool_arithmetic.val_size=8",
            f"logging.dir={out}", "logging.progress=false", "checkpoint.keep_best=null", "checkpoint.save_final=false",
            *([] if placement == "colocated" else ["rollout.placement=pool", "rollout.pool.replicas=1", "rollout.max_staleness=0"]),
        ])  # fmt: skip
        tr = Trainer(cfg)
        shapes, real_next = [], tr.batches.next_batch

        def record(step, timer):
            batch, stats = real_next(step, timer)
            shapes.append((batch.size, list(batch.owners), [sum(m) > 0 for m in batch.loss_masks]))
            return batch, stats

        tr.batches.next_batch = record
        tr.fit()
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if "response_length/mean" in r]
        return rows, shapes

    colocated, colocated_shapes = train("colocated")
    pool, pool_shapes = train("pool")
    assert len(pool) == len(colocated) == 2
    agent_keys = {k for k in colocated[0] if k.startswith("agent/")}
    assert agent_keys >= ({"agent/turns_mean", "agent/tool_calls_mean"} if kind == "loop" else {"agent/requests_mean", "agent/segments_mean"})
    assert all({k for k in r if k.startswith("agent/")} == agent_keys for r in pool + colocated)
    assert pool_shapes == colocated_shapes
    if kind == "agent":  # 4 trajectories, then their 4 second segments, each trained with its trajectory's row
        assert pool_shapes == [(8, [None] * 4 + [0, 1, 2, 3], [True] * 8)] * 2
        assert all(r["agent/extra_segments"] == 4 and r["agent/segments_mean"] == 2 for r in pool)


@pytest.mark.slow
def test_a_pool_run_stopped_by_sigterm_resumes_and_trains_the_prompts_of_an_uninterrupted_run(tmp_path, cluster):
    """As the worker's resume test (test_async_rollout.py), under SIGTERM: a pool one step off (k = 1, the
    replicas have step 3's prompts in flight) is sent SIGTERM while step 2 of 4 collects its batch; the step is
    abandoned (runtime.StopOnSignal.abandonable), the run stops with step 1's checkpoint, and the same run
    started again resumes there. The prompts trained, step by step across both processes' runs (the abandoned
    batch left out), are the uninterrupted run's (the sync loop's order: none lost, none twice), the abandoned
    step's prompts are the ones trained again, and every checkpoint holds the uninterrupted data position."""
    import os
    import signal

    from postrl.checks import load_config
    from postrl.data.dataset import PromptSampler
    from postrl.errors import Stopped
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, "rollout.placement=pool", "rollout.pool.replicas=1", "rollout.max_staleness=1",
                                           "train.total_steps=4", "checkpoint.save_freq=1", "checkpoint.keep_last=0"))  # fmt: skip
    trained: list[list[list[int]]] = []

    def start():
        tr = Trainer(cfg)
        real_next = tr.batches.next_batch

        def record(step, timer):
            batch, stats = real_next(step, timer)
            trained.append(batch.prompt_ids[:: cfg.rollout.n_samples_per_prompt])
            if step == 1 and len(trained) == 2:  # while step 2 (index 1) collects: as a scheduler preempts
                os.kill(os.getpid(), signal.SIGTERM)
            return batch, stats

        tr.batches.next_batch = record
        return tr

    first = start()
    with pytest.raises(Stopped):
        first.fit()
    assert first.step == 1 and len(trained) == 2
    again = start()
    assert again.step == 1
    again.fit()
    assert again.step == 4 and len(trained) == 5
    abandoned = trained.pop(1)
    assert abandoned == trained[1]  # collected again after the resume, nothing skipped
    sampler = PromptSampler(len(again.run.examples), cfg.data.shuffle, cfg.data.seed)
    positions = {}
    expected = []
    for s in range(1, 5):
        expected.append([again.run.examples[i].prompt_ids for i in sampler.next_indices(cfg.train.gen_batch_size)])
        positions[f"iter_{s:07d}"] = sampler.state_dict()
    assert trained == expected
    saved = {it.name: torch.load(it / "dataloader.pt", weights_only=False) for it in sorted((tmp_path / "run" / "checkpoints").glob("iter_*"))}
    assert saved == {name: {"sampler": state} for name, state in positions.items()}


class _Payload:
    """Unpickling it creates the directory `path` (what a compromised replica's pickle could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


@pytest.mark.slow
def test_a_replica_reply_that_is_a_pickle_is_its_failure_and_never_runs(tmp_path, cluster):
    """A replica's replies come back as bytes under its key of the trainer's store (never ray.get). The first
    chunk reply is overwritten there with a pickle (what a compromised replica could write): the trainer refuses
    it as not in the declared shape, restarts that replica, deals its chunk again, and the 2 steps train the
    sync loop's prompts; the payload never ran. Also prints each reply's size and decode time (the report's)."""
    import pickle
    import time

    from postrl.checks import load_config
    from postrl.data.dataset import PromptSampler
    from postrl.placement import wire
    from postrl.placement.pool import RolloutPool
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, "rollout.placement=pool", "rollout.pool.replicas=2", "rollout.max_staleness=1",
                                           "rollout.max_worker_restarts=1", "train.total_steps=2"))  # fmt: skip
    cfg.rollout.pool.resources = {"rollout_node": 1}
    marker = tmp_path / "pwned"
    sizes: list[tuple[int, float]] = []
    real_pop, real_decode = RolloutPool._pop, wire.decode

    def pop(self, m, key):
        if key.startswith("reply/") and not sizes:
            m.store.set(key, pickle.dumps(_Payload(str(marker))))  # the bytes a compromised replica sends
        data = real_pop(self, m, key)
        if not key.startswith("reply/"):
            return data
        start = time.perf_counter()
        try:
            real_decode(data, len(self.examples))
        except wire.WireError:
            pass
        sizes.append((len(data), time.perf_counter() - start))
        return data

    tr = Trainer(cfg)
    pool = tr.batches.rollout
    logged: list[str] = []
    pool.log = lambda msg: (logged.append(msg), tr.log(msg))
    pool._pop = pop.__get__(pool)
    trained: list[list[list[int]]] = []
    real_next = tr.batches.next_batch

    def record(step, timer):
        batch, stats = real_next(step, timer)
        trained.append(batch.prompt_ids[:: cfg.rollout.n_samples_per_prompt])
        return batch, stats

    tr.batches.next_batch = record
    tr.fit()
    assert tr.step == 2 and not marker.exists()
    assert any("failed (a reply that is not in the declared shape" in m and "restarting it" in m for m in logged), logged
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_pool/restarts"] for r in rows if "rollout_pool/restarts" in r][-1] == 1
    sampler = PromptSampler(len(tr.run.examples), cfg.data.shuffle, cfg.data.seed)
    assert trained == [[tr.run.examples[i].prompt_ids for i in sampler.next_indices(cfg.train.gen_batch_size)] for _ in range(2)]
    chunks = sizes[1:]
    print(f"replies: {len(chunks)} chunks, {min(n for n, _ in chunks)}-{max(n for n, _ in chunks)} bytes, "
          f"decode {1e3 * max(t for _, t in chunks):.2f} ms at most")


def test_a_replicas_error_is_a_declared_failure_reply_and_a_data_error_stops_the_run():
    """Replica.generate and the trainer's RolloutPool._reply over a real TCPStore (no Ray, no model): an error in
    the replica becomes a Failure reply under its key (a data error: UserError in the trainer with its parts;
    another: the replica's failure naming it), a call without a reply is a failure too, and keys read are deleted."""
    import torch.distributed as dist

    from postrl.errors import UserError
    from postrl.placement import wire
    from postrl.placement.pool import RolloutPool, _Member
    from postrl.placement.replica import Replica

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    replica, pool = Replica.__new__(Replica), RolloutPool.__new__(RolloutPool)
    replica.store, replica.examples, pool.examples = dist.PrefixStore("p", dist.TCPStore("127.0.0.1", server.port, None, False)), [], []
    pool.vocab = 10
    m = _Member(0, store=dist.PrefixStore("p", server))

    def raises(exc):
        def generate(*args):
            raise exc

        return generate

    replica._generate = raises(UserError("row 7 has no ground truth", "Fix: add an answer column.", title="bad data"))
    replica.generate(0, 0, 0, [7], 0, "reply/1")
    m.replies = 1
    with pytest.raises(UserError, match="row 7 has no ground truth\nFix: add an answer column.") as info:
        pool._reply(m)
    assert info.value.title == "bad data" and not server.check(["p/reply/1"])
    replica._generate = raises(KeyError("boom"))
    replica.generate(0, 0, 0, [7], 0, "reply/2")
    m.replies = 2
    with pytest.raises(wire.WireError, match="KeyError: 'boom'"):
        pool._reply(m)
    m.replies = 3  # dealt, but the replica died before replying
    with pytest.raises(wire.WireError, match="no reply"):
        pool._reply(m)
    # A chunk in the declared shape with values the trainer cannot use (a NaN log-prob, a mask value of 2): the
    # replica's failure (next_batch restarts it, as for a malformed reply), refused before any tensor.
    from postrl.batch import Batch

    for bad, words in (({"engine_logprobs": [[float("nan")]]}, "engine log-probs must be finite"), ({"loss_masks": [[2]]}, "0 or 1")):
        batch = Batch(**{"prompt_ids": [[1]], "response_ids": [[3]], "loss_masks": [[1]], "turns": [1], "finished": [True], "scores": [1.0],
                         "rewards": [1.0], "verifier_metrics": [{}], "engine_logprobs": [None], "multi_modal": [None], **bad})  # fmt: skip
        replica._generate = lambda *args, b=batch: {"batch": b, "failures": {}, "seconds": {}, "busy": 0.0, "idle": 0.0, "load_s": 0.0,
                                                    "checksums": {}, "tokens": 1, "agent": None}  # fmt: skip
        m.replies += 1
        replica.generate(0, 0, 0, [0], 0, f"reply/{m.replies}")
        with pytest.raises(wire.WireError, match=words):
            pool._reply(m)

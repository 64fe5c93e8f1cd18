"""Async rollout (issue 24): a worker process generates ahead of the trainer within rollout.max_staleness,
the weights travel through shared memory with a version and checksum, partial rollout tags every token
with its version, a dead worker is restarted, and a resumed run trains every prompt once."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_postrl, tiny_train_args, tiny_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, name, *extra):
    tr = tiny_trainer(tmp_path / name, "train.deterministic=true", *extra)
    return tr, tr.fit()


def test_async_at_staleness_0_gives_the_weights_of_sync(tmp_path):
    """Batch b is sampled with the seeds of sync step b, by weights of version b (k = 0): after 3 steps the
    weights are bitwise those of sync mode, and every batch was 0 updates old."""
    sync, _ = _train(tmp_path, "sync")
    asy, _ = _train(tmp_path, "async", "rollout.mode=async")
    for (name, a), b in zip(sync.model.named_parameters(), asy.model.parameters()):
        assert torch.equal(a, b), name
    rows = [r for r in _rows(tmp_path / "async" / "run") if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["async/dropped_stale_groups"] == 0 for r in rows)


def _engine_and_weights(tmp_path, **rollout):
    """A real HF engine on a worker-side copy of the tiny model, fed by SharedWeights from a trainer-side copy."""
    import contextlib
    import threading

    from postrl.placement.versioned import VersionedEngine
    from postrl.config import build_config
    from postrl.models import load_policy
    from postrl.rollout.hf import HFEngine
    from postrl.placement.transport import SharedWeights

    cfg = build_config({"model": {"path": "builtin:tiny-qwen2"}, "rollout": {"mode": "async", **rollout}})
    trainer = load_policy(cfg.model, dtype="float32", device=torch.device("cpu"))
    worker = load_policy(cfg.model, dtype="float32", device=torch.device("cpu"))
    weights = SharedWeights(trainer.model, torch.multiprocessing.get_context("spawn"))
    engine = HFEngine(worker.model, worker.tokenizer)
    versioned = VersionedEngine(engine, worker.model, weights, cfg.rollout, contextlib.nullcontext(), threading.Event(), __import__("os").getppid())
    return trainer, worker, weights, versioned


def _perturb(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_weights_travel_with_a_version_and_a_checksum_that_catches_a_torn_copy(tmp_path):
    from postrl.placement.transport import checksum, trainable

    trainer, worker, weights, _ = _engine_and_weights(tmp_path)
    _perturb(trainer.model, 0.05)
    sent = weights.publish(trainer.model, 3)
    version, got = weights.load(worker.model)
    assert (version, got) == (3, sent)
    for (name, a), (_, b) in zip(trainable(trainer.model), trainable(worker.model)):
        assert torch.equal(a, b), name
    with torch.no_grad():  # one element of one tensor missed: the fingerprint moves
        next(worker.model.parameters()).view(-1)[7] += 1e-3
    assert checksum([p for _, p in trainable(worker.model)]) != sent
    assert not weights.wait_newer(3, timeout=0.01) and weights.latest() == 3


def test_a_version_published_again_is_loaded_again(tmp_path):
    """A mid-run back-off publishes the best weights as the current version again: the worker loads them
    before its next call although the version number did not move, and records their checksum."""
    from postrl.placement.transport import checksum, trainable

    trainer, worker, weights, engine = _engine_and_weights(tmp_path)
    weights.publish(trainer.model, 2)
    engine.refresh()
    assert engine.version == 2
    best = [p.detach().clone() for _, p in trainable(trainer.model)]
    _perturb(trainer.model, 0.05)
    weights.publish(trainer.model, 2)  # the best weights of an earlier step, as version 2 again
    engine.refresh()
    for (name, p), want in zip(trainable(worker.model), [p for _, p in trainable(trainer.model)]):
        assert torch.equal(p, want), name
    assert engine.checksums[2] == checksum([p for _, p in trainable(trainer.model)]) != checksum(best)
    loads = engine.loaded
    engine.refresh()  # nothing new: no copy
    assert engine.loaded == loads


def test_a_waiting_side_lends_its_threads_to_the_other():
    """The trainer and the worker hold one thread each on 2 cores; while one waits the other takes two,
    and drops back to one before it wakes the waiting side. Off: nobody lends."""
    from postrl.placement.cores import TRAINER, WORKER, CoreShare

    ctx = torch.multiprocessing.get_context("spawn")
    share = CoreShare(ctx, 1, enabled=True)
    assert share.threads(TRAINER) == share.threads(WORKER) == 1
    with share.waiting(WORKER):
        assert share.threads(TRAINER) == 2 and share.threads(WORKER) == 1
        share.take(TRAINER)
        assert torch.get_num_threads() == 2
        share.own()  # before publishing the weights the worker waits for
        assert torch.get_num_threads() == 1
    assert share.threads(TRAINER) == 1
    off = CoreShare(ctx, 1, enabled=False)
    with off.waiting(WORKER):
        off.take(TRAINER)
        assert off.threads(TRAINER) == 1 and torch.get_num_threads() == 1


def test_partial_rollout_continues_under_new_weights_and_tags_every_token(tmp_path):
    """Chunks of 4 tokens, 12 at most: weights of version 1 arrive after the first chunk. The unfinished
    sequences continue under them: token_versions read 0 x 4 then 1, the sequence's version is 0 (its
    oldest token), and every log-prob is the sampling log-prob under the weights that drew that token,
    recomputed here by hand with a forward of each version."""
    from postrl.models import build_sequences, response_logprobs
    from postrl.rollout import SamplingParams

    trainer, worker, weights, engine = _engine_and_weights(tmp_path, partial_rollout=True, partial_rollout_chunk=4, max_staleness=1)
    weights.publish(trainer.model, 0)
    v0 = {k: v.clone() for k, v in worker.model.state_dict().items()}
    inner = engine.engine.generate
    calls = []

    def publish_after_first_call(*args, **kw):  # the trainer's update lands while the chunk is generated
        out = inner(*args, **kw)
        if not calls:
            _perturb(trainer.model, 0.2)
            weights.publish(trainer.model, 1)
        calls.append(len(args[0]))
        return out

    engine.engine.generate = publish_after_first_call
    prompts = [worker.tokenizer.encode("Tom has 3 apples"), worker.tokenizer.encode("What is 2+5?")]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=5)
    engine.logprobs = True
    out = engine.generate(prompts, params)
    assert len(calls) >= 2 and calls[0] == 2  # the first chunk: 2 prompts x n; then the unfinished ones, n = 1
    long = [c for c in out if len(c.token_ids) > 4]
    assert long, "the random tiny model stops before 4 tokens: pick another seed"
    for c in out:
        assert c.token_versions[:4] == [0] * min(4, len(c.token_ids)) and set(c.token_versions[4:]) <= {1}
        assert c.version == 0
    v1 = {k: v.clone() for k, v in worker.model.state_dict().items()}
    for state, tokens in ((v0, slice(0, 4)), (v1, slice(4, None))):
        worker.model.load_state_dict(state)
        seq = build_sequences([prompts[c.prompt_index] for c in long], [c.token_ids for c in long], 0)
        with torch.no_grad():
            lp, _ = response_logprobs(worker.model, seq["input_ids"], seq["attention_mask"], seq["position_ids"], seq["response_mask"].shape[1], 1.0)
        for c, row in zip(long, lp.tolist()):
            assert c.logprobs[tokens] == pytest.approx(row[: len(c.token_ids)][tokens], abs=1e-5)


def test_stale_groups_are_dropped_and_counted():
    """At step 6 with max_staleness 1 and G = 2: groups from versions (6, 6), (5, 4), (5, 5) keep the first and
    the last; the middle one has a sequence 2 updates old."""
    from postrl.placement.staleness import split_stale
    from postrl.batch import Batch

    n = 6
    batch = Batch(
        prompt_ids=[[1]] * n, response_ids=[[i] for i in range(n)], loss_masks=[[1]] * n, turns=[1] * n, finished=[True] * n,
        scores=[0.0] * n, rewards=[0.0] * n, verifier_metrics=[{}] * n, engine_logprobs=[None] * n, multi_modal=[None] * n,
        versions=[6, 6, 5, 4, 5, 5],
    )  # fmt: skip
    kept, dropped = split_stale(batch, 6, 1, 2)
    assert dropped == 1 and [r[0] for r in kept.response_ids] == [0, 1, 4, 5]


def test_a_killed_worker_is_restarted_and_past_the_limit_the_run_stops_with_a_checkpoint(tmp_path):
    """The worker is SIGKILLed before step 0's weights reach it (so it cannot have made step 1's batch): with
    one restart allowed the run finishes its 3 steps; with none it stops with a UserError naming the exit
    code and a checkpoint of step 1, and no worker is left running."""
    import os
    import signal

    from postrl.placement.worker import AsyncRollout
    from postrl.errors import UserError

    def run(name, restarts):
        tr = tiny_trainer(tmp_path / name, "rollout.mode=async", f"rollout.max_worker_restarts={restarts}")
        real = AsyncRollout.publish

        def kill_then_publish(self, model, version):
            if version == 1 and self.restarts == 0:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join()
            return real(self, model, version)

        tr.batches.rollout.publish = kill_then_publish.__get__(tr.batches.rollout)
        try:
            return tr, tr.fit()
        finally:
            assert tr.batches.rollout.proc is None  # closed: no worker left running

    tr, _ = run("restarted", 1)
    assert tr.step == 3 and tr.batches.rollout.restarts == 1
    with pytest.raises(UserError, match="(?s)exited with code -9 without a batch for step 1.*max_worker_restarts.*1 step.*saved in"):
        run("stopped", 0)
    assert (tmp_path / "stopped" / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_a_resumed_async_run_trains_every_prompt_once(tmp_path):
    """One step off (k = 1): the worker has step 2's batch in flight when a 2-step run ends. Resumed to 4
    steps, the run regenerates it from the trained position: after every step the data position equals
    an uninterrupted 4-step run's, so no prompt was skipped or trained twice."""

    def positions(name, *steps):
        out = {}
        for total in steps:
            tiny_trainer(tmp_path / name, "rollout.mode=async", "rollout.max_staleness=1", "checkpoint.save_freq=1",
                         "checkpoint.keep_last=0", f"train.total_steps={total}").fit()  # fmt: skip
        for it in sorted((tmp_path / name / "run" / "checkpoints").glob("iter_*")):
            out[it.name] = torch.load(it / "dataloader.pt", weights_only=False)
        return out

    whole = positions("whole", 4)
    resumed = positions("resumed", 2, 4)
    assert list(whole) == [f"iter_{s:07d}" for s in (1, 2, 3, 4)] and whole == resumed


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,extra",
    [
        ("lora", ("model.lora_rank=4", "model.lora_alpha=8")),
        ("agent", ("model.path=builtin:tiny-qwen2-tools", "data.train_files=[builtin:tool_arithmetic:train]",
                   "data.val_files=[builtin:tool_arithmetic:val]", "rollout.multi_turn.enable=true",
                   "rollout.multi_turn.tools=[builtin:calculator]", "rollout.multi_turn.max_turns=2")),
        ("vision", ("model.path=builtin:tiny-qwen2.5-vl", "data.train_files=[builtin:shapes:train]", "data.val_files=[builtin:shapes:val]",
                    "data.shapes.train_size=64", "data.shapes.val_size=8", "rollout.max_tokens=8")),
        ("dapo-partial", ("algorithm.name=dapo", "algorithm.overlong_buffer.len=4",
                          "rollout.partial_rollout=true", "rollout.partial_rollout_chunk=4", "rollout.max_staleness=2")),
    ],
)  # fmt: skip
def test_async_one_step_off_runs_lora_agents_vision_and_dynamic_sampling(tmp_path, kind, extra):
    """Two steps one step off (k = 1 unless set) for each kind of run: the worker serves it, the correction
    is on, every sequence is within the bound, and the trainer's weights moved (LoRA: only the adapters
    travel, and the worker's checksum matched them, or the run would have stopped)."""

    tr = tiny_trainer(tmp_path, "rollout.mode=async", "rollout.max_staleness=1", "train.total_steps=2",
                      "reward.verifiers=[verifiers_for_tests:length_parity]", *extra)  # mixed groups: it learns
    cfg = tr.cfg
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    if kind == "lora":
        assert all(".lora_" in s.name for s in tr.batches.rollout.weights.slots)
    tr.fit()
    assert cfg.algorithm.rollout_correction.enable
    rows = [r for r in _rows(tmp_path / "run") if "async/staleness_max" in r]
    assert len(rows) == 2 and all(r["async/staleness_max"] <= cfg.rollout.max_staleness for r in rows)
    assert all("rollout_corr/weight_mean" in r for r in rows)
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if n in before)


@pytest.mark.slow
def test_two_trainer_ranks_train_on_the_batches_of_rank_0s_worker(tmp_path):
    """`postrl train --nproc 2` in async mode at staleness 0: one rollout worker, beside rank 0, makes every
    batch; both FSDP2 ranks train on it (broadcast), and the worker samples step 2 with the weights gathered
    from both ranks' shards. Batch b uses sync step b's seeds with weights of version b, so the batches
    are a one-process sync run's: the same rewards and response lengths at every step."""

    from postrl.metrics import read_jsonl

    keys = ("response_length/mean", "response_length/max", "grpo/rewards/mean", "prompt_length/mean")
    extra = ("train.total_steps=2", "reward.verifiers=[verifiers_for_tests:length_parity]")  # mixed groups: it learns
    _train(tmp_path, "sync", *extra)
    sync = [r for r in _rows(tmp_path / "sync" / "run") if "timing/all" in r]
    out = run_postrl(*tiny_train_args(tmp_path / "ranks", "train.deterministic=true", "rollout.mode=async", *extra), "--nproc", "2",
                     timeout=600, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert out.stdout.count("its batches broadcast to 2 ranks") == 1  # one worker, rank 0's
    ranks = [r for r in read_jsonl(tmp_path / "ranks" / "run" / "metrics.jsonl") if "timing/all" in r]
    assert [r["step"] for r in ranks] == [1, 2]
    for s, r in zip(sync, ranks):
        assert {k: r[k] for k in keys} == pytest.approx({k: s[k] for k in keys}, abs=1e-9), r["step"]
        assert r["async/staleness_max"] == 0.0


class _Payload:
    """Unpickling it creates the directory `path` (what a compromised worker's pickle could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (self.path,))


def _compromised_serve(spec, weights, out, slots, stop, share):
    """The worker's body in a spawned process: the first worker of the run writes a pickle into the real pipe (as
    a compromised worker could), later ones are the real worker."""
    import os
    import pickle
    from pathlib import Path

    from postrl.placement import worker

    flag = Path(spec.log_dir) / "compromised-once"
    if flag.exists():
        return worker._serve(spec, weights, out, slots, stop, share)
    flag.write_text("")
    out.send_bytes(pickle.dumps(_Payload(os.path.join(spec.log_dir, "pwned"))))
    stop.wait(120)


@pytest.mark.slow
def test_a_worker_that_sends_a_pickle_is_restarted_and_the_payload_never_runs(tmp_path, monkeypatch):
    """The worker's pipe is read with recv_bytes and decoded into a declared shape (placement/wire.py): a pickle
    written into it is a bad reply, the worker is restarted (one restart allowed), the run trains its 2 steps,
    and the payload (a directory it would create) never ran. ~35 s: two worker processes start."""
    from postrl.placement import worker

    monkeypatch.setattr(worker, "_serve", _compromised_serve)  # the spawned process imports it from this module
    tr = tiny_trainer(tmp_path, "rollout.mode=async", "rollout.max_worker_restarts=1", "train.total_steps=2")
    logged: list[str] = []
    tr.batches.rollout.log = lambda msg: (logged.append(msg), tr.log(msg))
    tr.fit()
    assert tr.step == 2 and tr.batches.rollout.restarts == 1
    assert any("sent a bad reply" in m and "declared shape" in m and "restarting it" in m for m in logged), logged
    assert (tmp_path / "run" / "compromised-once").exists() and not (tmp_path / "run" / "pwned").exists()


def test_a_frame_over_the_cap_or_a_closed_pipe_is_the_workers_failure(monkeypatch, tmp_path):
    """The trainer's read of the worker's pipe (AsyncRollout._receive, no worker started): a frame over the cap
    is refused unread (recv_bytes' maxlength), garbage is refused by the decoder, a closed pipe is the worker's
    exit; each is WorkerDied (the worker restarted), never an unpickle."""
    import types

    from postrl.placement import wire
    from postrl.placement.remote import WorkerDied
    from postrl.placement.worker import AsyncRollout

    monkeypatch.setattr(wire, "MAX_REPLY_BYTES", 1000)
    ctx = torch.multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    rollout = AsyncRollout.__new__(AsyncRollout)
    rollout.reader, rollout.examples, rollout.vocab = reader, [], 10
    rollout.proc = types.SimpleNamespace(is_alive=lambda: True, exitcode=None, join=lambda timeout=None: None)
    rollout.cfg = types.SimpleNamespace(logging=types.SimpleNamespace(dir=str(tmp_path)))
    writer.send_bytes(b"[" * 2000)
    with pytest.raises(WorkerDied, match="sent a bad reply: bad message length"):
        rollout._receive(0)
    reader, writer = ctx.Pipe(duplex=False)
    rollout.reader = reader
    writer.send_bytes(b"[" * 500)
    with pytest.raises(WorkerDied, match="sent a bad reply: a reply that is not in the declared shape"):
        rollout._receive(0)
    # A reply in the declared shape whose value the trainer cannot use (an id past the policy's vocabulary):
    # the same failure, refused before any tensor is made.
    from postrl.batch import Batch

    bad = Batch(prompt_ids=[[1]], response_ids=[[10]], loss_masks=[[1]], turns=[1], finished=[True], scores=[1.0], rewards=[1.0],
                verifier_metrics=[{}], engine_logprobs=[None], multi_modal=[None])  # fmt: skip
    writer.send_bytes(wire.encode_batch(0, bad, [], {}, {}, {}, {}))
    with pytest.raises(WorkerDied, match="sent a bad reply: .*response token id outside the vocabulary \\[0, 10\\)"):
        rollout._receive(0)
    writer.close()
    with pytest.raises(WorkerDied, match="exited with code None without a batch for step 0"):
        rollout._receive(0)


def _tampering_serve(spec, weights, out, slots, stop, share):
    """The worker's body in a spawned process: the first worker of the run sends its first batch with a token id
    past the vocabulary (10**30: a device assert on a GPU), later ones are the real worker."""
    from pathlib import Path

    from postrl.placement import wire, worker

    flag = Path(spec.log_dir) / "tampered-once"
    if not flag.exists():
        flag.write_text("")
        real = wire.encode_batch

        def tampered(index, batch, *args, **kwargs):
            batch.response_ids[0][0] = 10**30
            return real(index, batch, *args, **kwargs)

        wire.encode_batch = tampered
    return worker._serve(spec, weights, out, slots, stop, share)


@pytest.mark.slow
def test_a_worker_that_sends_an_id_past_the_vocabulary_is_restarted_and_the_run_goes_on(tmp_path, monkeypatch):
    """A reply in the declared shape with a value the trainer cannot use is the worker's failure, as a malformed one
    is: refused before any tensor, counted in the restarts, the worker restarted, the run trains its 2 steps. ~35 s."""
    from postrl.placement import worker

    monkeypatch.setattr(worker, "_serve", _tampering_serve)
    tr = tiny_trainer(tmp_path, "rollout.mode=async", "rollout.max_worker_restarts=1", "train.total_steps=2")
    logged: list[str] = []
    tr.batches.rollout.log = lambda msg: (logged.append(msg), tr.log(msg))
    tr.fit()
    assert tr.step == 2 and tr.batches.rollout.restarts == 1 and (tmp_path / "run" / "tampered-once").exists()
    assert any("sent a bad reply" in m and "outside the vocabulary" in m and "restarting it" in m for m in logged), logged

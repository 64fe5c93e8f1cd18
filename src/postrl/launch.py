"""Launchers above the trainer: N ranks on this machine, one rank under torchrun, or Ray Train.

- `postrl train --nproc N` (or `cluster.devices_per_node: N`) starts N ranks of `postrl train` on
  this machine, bound to loopback only (a file rendezvous, collectives over `lo`).
- Inside torchrun (multi-node: torchrun on every node) `launch` runs this process's rank.
- `cluster.launcher: ray` (or `--ray-address`) runs the same SPMD loop through Ray Train's
  TorchTrainer: on an existing cluster (`ray start --head` printed its address; `auto` finds the
  local one), or on a single-node cluster started in this process.

Every rank then runs `trainer.train` (SPMD); distributed.py holds the process group and wrapping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from postrl import distributed
from postrl.errors import UserError
from postrl.local_cluster import RAY_ONE_MACHINE_ENV, start_ray
from postrl.runtime import Accelerator, accelerator, cpu_threads
from postrl.storage import unshared_dir_problem
from postrl.trainer import train

if TYPE_CHECKING:
    from postrl.config import Config

# Environment that Ray workers on other machines need to see as the driver does.
_FORWARDED_ENV = (
    "PYTHONPATH", "POSTRL_CACHE", "VLLM_ENABLE_V1_MULTIPROCESSING", "TOKENIZERS_PARALLELISM",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HF_HOME", "HF_HUB_OFFLINE",
    "LD_PRELOAD", "MALLOC_CONF",  # jemalloc (`LD_PRELOAD=libjemalloc.so.2`), as the guides run their workers (docs/distributed.md)
)  # fmt: skip


def check_world(cfg: "Config", world: int) -> None:
    """Batch sizes that do not split over `world` ranks, as one UserError listing every problem."""
    t, n, sp = cfg.train, cfg.rollout.n_samples_per_prompt, cfg.train.sequence_parallel_size
    problems = []
    if world % sp:
        problems.append(
            f"train.sequence_parallel_size ({sp}) must divide the {world} processes: each sequence-parallel group is "
            "that many ranks. Fix: choose a divisor, or change the number of processes."
        )
    dp = world // sp if world % sp == 0 else world  # ranks with distinct rows (a sequence-parallel group shares its rows)
    if (t.mini_batch_size * n) % dp:
        ranks = f"{dp} data-parallel ranks ({world} processes / sequence_parallel_size {sp})" if sp > 1 else f"{world} processes"
        problems.append(
            f"train.mini_batch_size x rollout.n_samples_per_prompt = {t.mini_batch_size} x {n} sequences per optimizer "
            f"step do not split evenly over {ranks}. Fix: make mini_batch_size x n_samples_per_prompt a "
            f"multiple of {dp} (or change the number of processes)."
        )
    if t.gen_batch_size < world:
        problems.append(
            f"train.gen_batch_size ({t.gen_batch_size}) is smaller than the {world} processes: every process "
            f"generates for its share of the prompts. Fix: set train.gen_batch_size >= {world}."
        )
    if problems:
        raise UserError(*problems, title=f"batch sizes do not fit {world} processes")


def _inside_launched_worker() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


def adopt_world(cfg: "Config") -> None:
    """Record the actual process layout in cfg.cluster (throughput per device, checkpoint metadata)."""
    world, local = distributed.world_size(), distributed.local_world_size()
    if world > 1 and world % local == 0:
        cfg.cluster.nnodes, cfg.cluster.devices_per_node = world // local, local


def run_worker(cfg: "Config", console: Any = None) -> dict[str, float]:
    """One rank: join the process group, train, leave it (a group made by Ray Train is left to Ray)."""
    created = distributed.init_process_group(cfg.cluster.collective_timeout_s)
    finished = False
    try:
        adopt_world(cfg)
        check_world(cfg, distributed.world_size())
        if (problem := unshared_dir_problem(cfg.checkpoint.dir)) is not None:  # nodes must share it (storage.py)
            raise UserError(problem, title="checkpoint.dir is not on shared storage")
        metrics = train(cfg, console)
        finished = True
        return metrics
    finally:
        if created:
            distributed.teardown(wait_for_peers=finished)


def launch(args: Any, cfg: "Config") -> int:
    """`postrl train` with --nproc > 1 or cluster.launcher torchrun | ray."""
    if _inside_launched_worker():
        run_worker(cfg)
        return 0
    ray_address = getattr(args, "ray_address", None) or cfg.cluster.ray_address
    if cfg.cluster.launcher == "ray" or ray_address:
        return launch_ray(cfg, ray_address)
    if cfg.cluster.nnodes > 1:
        raise UserError(
            f"cluster.nnodes is {cfg.cluster.nnodes}: a multi-node torchrun job is started on every node, not from "
            "one. Fix: on node i run `torchrun --nnodes $NNODES --nproc-per-node $DEVICES_PER_NODE --node-rank i "
            "--master-addr $MASTER_ADDR --master-port 29500 -m postrl.cli train CONFIG`, or use cluster.launcher: ray "
            "(see docs/distributed.md)."
        )
    nproc = getattr(args, "nproc", 0) or cfg.cluster.devices_per_node
    check_world(cfg, nproc)
    threads = cfg.train.num_threads
    return launch_local(args.config, list(args.overrides), nproc, threads if isinstance(threads, str) else "auto")


def launch_local(config: str, overrides: list[str], nproc: int, thread_policy: str = "auto") -> int:
    """Start `nproc` ranks of `postrl train` on this machine, bound to loopback only.

    torchrun's rendezvous store listens on every interface, which a job on one machine has no reason
    to expose. Here the ranks meet through a file (torch.distributed's FileStore: no TCP store at all)
    and talk over the loopback interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = lo). As with
    torchrun, the first rank that fails stops the others. SIGTERM is forwarded to every rank (each
    saves its step and exits, see trainer.py); Ctrl-C reaches them from the terminal already.
    """
    import signal
    import tempfile
    import time

    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:  # the ranks share the cores: runtime.cpu_threads divides them
        threads, why = cpu_threads(nproc, thread_policy)
        env["OMP_NUM_THREADS"] = str(threads)
        print(f"CPU intra-op threads per rank: {threads} (train.num_threads {thread_policy}: {why})")
    cmd = [sys.executable, "-m", "postrl.cli", "train", config, *overrides]
    with tempfile.TemporaryDirectory(prefix="postrl-rendezvous-") as rendezvous:
        env = distributed.one_machine_env(env, str(Path(rendezvous) / "store"))
        ranks = [
            subprocess.Popen(cmd, env={
                **env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            })  # fmt: skip
            for r in range(nproc)
        ]

        def forward(signum: int, frame: Any) -> None:  # noqa: ARG001
            for p in ranks:
                if p.poll() is None:
                    p.send_signal(signum)

        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward), signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
        try:
            while True:
                codes = [p.poll() for p in ranks]
                failed = next((c for c in codes if c not in (None, 0)), None)
                if failed is not None:  # one rank is gone: the others would wait for it forever
                    for p in ranks:
                        if p.poll() is None:
                            p.kill()
                    return failed
                if all(c == 0 for c in codes):
                    return 0
                time.sleep(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for p in ranks:
                p.wait()


def launch_ray(cfg: "Config", address: str | None) -> int:
    """Run the SPMD loop on a Ray cluster with Ray Train's TorchTrainer.

    Workers = cluster.nnodes x cluster.devices_per_node, one device (GPU / NPU, Ray's resource name of
    the runtime's accelerator) or one CPU each. With an address (`ray start --head` printed it; `auto`
    finds the local one) the driver joins that cluster; without one, Ray starts a single-node cluster in
    this process and stops it at the end. That cluster is this machine alone: its servers bind 127.0.0.1
    and its workers meet through a file rather than Ray Train's TCP store (ray_rendezvous.py), so nothing
    of the job listens beyond loopback.
    """
    ray = _import_ray(one_node=address is None)
    check_world(cfg, cfg.world_size)
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    started_here = start_ray(address, env)  # without an address: a cluster of this job's own, on loopback only
    try:
        acc = worker_accelerator(cfg.train.device, ray.cluster_resources())
        trainer = _torch_trainer(cfg, env, acc, file_rendezvous=started_here and address is None)
        try:
            trainer.fit()
        except Exception as exc:  # a worker's UserError reaches the driver wrapped in Ray's errors
            user_error = _find_user_error(exc)
            if user_error is None:
                raise
            raise user_error from None
    finally:
        if started_here:
            ray.shutdown()
    return 0


def _import_ray(one_node: bool):
    """Ray (with Ray Train), or a UserError saying how to install it."""
    if one_node:  # read when ray is imported (local_cluster.RAY_ONE_MACHINE_ENV): this driver's node is 127.0.0.1
        os.environ[RAY_ONE_MACHINE_ENV] = "0"
    try:
        import ray
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"cluster.launcher is 'ray' but Ray Train cannot be imported ({exc}). Fix: pip install 'postrl[ray]' "
            "(ray[train]), or use --nproc N for N processes on one machine."
        ) from None
    return ray


def worker_accelerator(device: str, resources: dict[str, float]) -> Accelerator:
    """The device kind of each Ray worker: train.device when it names one, else (auto) the first
    accelerator whose resource (runtime.Accelerator.ray_resource: GPU, NPU) the cluster has, else the CPU."""
    if device != "auto":
        return accelerator(device)
    kinds = (accelerator("cuda"), accelerator("npu"))
    return next((a for a in kinds if resources.get(a.ray_resource, 0) > 0), accelerator("cpu"))


def _torch_trainer(cfg: "Config", env: dict[str, str], acc: Accelerator, file_rendezvous: bool):
    """Ray Train's TorchTrainer of this run: one worker per device of kind `acc`, on its process-group backend."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if file_rendezvous:  # ranks meet through a file and talk over lo: no TCP store
        from postrl.ray_rendezvous import FileRendezvousTorchConfig

        torch_config = FileRendezvousTorchConfig(backend=acc.backend, timeout_s=int(cfg.cluster.collective_timeout_s))
    else:
        torch_config = TorchConfig(backend=acc.backend, timeout_s=int(cfg.cluster.collective_timeout_s))
    scaling = ScalingConfig(
        num_workers=cfg.world_size, use_gpu=acc.ray_resource == "GPU", resources_per_worker={acc.ray_resource: 1}
    )
    return TorchTrainer(
        _ray_train_loop,
        train_loop_config={"config": cfg.model_dump(mode="json"), "cwd": os.getcwd(), "env": env},
        scaling_config=scaling,
        torch_config=torch_config,
        run_config=RunConfig(name="postrl", storage_path=str(Path(cfg.logging.dir).resolve() / "ray")),
    )


def _find_user_error(exc: BaseException) -> UserError | None:
    """The UserError a Ray Train worker raised, searched through causes and per-worker failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
    return None


def _ray_train_loop(loop_config: dict) -> None:
    """The body of each Ray Train worker: the same SPMD loop torchrun runs."""
    import ray.train

    from postrl.config import Config
    from postrl.console import quiet_console

    for key, value in loop_config.get("env", {}).items():
        os.environ.setdefault(key, value)
    if os.path.isdir(loop_config["cwd"]):
        os.chdir(loop_config["cwd"])  # relative data / output paths mean what they meant to the driver
    ctx = ray.train.get_context()
    os.environ.update({  # torchrun's variables; on a one-node cluster the group is built from them (ray_rendezvous.py)
        "RANK": str(ctx.get_world_rank()), "WORLD_SIZE": str(ctx.get_world_size()),
        "LOCAL_RANK": str(ctx.get_local_rank()), "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
    })  # fmt: skip
    cfg = Config.model_validate(loop_config["config"])
    quiet_console(cfg.logging)
    run_worker(cfg)

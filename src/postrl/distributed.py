"""Scale-out: one process per device (SPMD), FSDP2 / DDP, per-rank data, torchrun and Ray launch.

Every rank runs the same trainer loop (DESIGN.md section 1). This module holds the machinery so that
the trainer only calls into it at a few clear points:

- Process group: `init_process_group()` joins the group that torchrun (or Ray Train) describes in
  the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); gloo for CPU tensors,
  nccl for CUDA tensors. Every helper below is a no-op (or the identity) when the run is a single
  process.
- Model: `wrap_model` shards the policy with FSDP2 (`fully_shard` per transformer block, then the
  root). FSDP2 runs on CPU over gloo too, so it is the default everywhere; DDP is the alternative
  (`POSTRL_DP_STRATEGY=ddp`: replicated weights, cheaper for small models).
- Gradient semantics: both wrappers AVERAGE gradients over ranks, while the trainer's loss on each
  rank is already that rank's share of the global loss (normalised by the global token / sequence
  counts, see `algorithms.aggregate_loss`). The global gradient is therefore the SUM of the ranks'
  gradients, so the trainer multiplies the loss by `world_size()` before `backward()`; averaging then
  yields exactly the sum. This holds with gradient accumulation over micro-batches too (DDP reduces
  the accumulated gradient at every backward; averaging keeps already-reduced parts unchanged).
- Rollout: each rank owns a colocated engine. With FSDP2 the HF engine generates with the sharded
  policy inside `unsharded(model)`: FSDP all-gathers the full weights once per generate call (the
  guides' resharding_to_infer), keeps them for the whole call so ranks may generate different
  lengths without collectives, and frees them afterwards. The vLLM engine receives the full weights
  streamed tensor by tensor (each DTensor gathered on its own, see `full_state_dict`); nothing is
  written to disk.
- Data: `shard_range` gives each rank a contiguous slice of every generation batch (a group's n
  samples stay on one rank); the trainer gathers the scored slices so that every rank holds the
  whole generation batch and takes the same dynamic-sampling decisions. `rank_rows` then deals each
  mini-batch's sequences to the ranks in equal numbers (token-balanced with dynamic batch size), and
  `token_budget_micro_batches` cuts a rank's rows into micro-batches by token budget with the same
  number of micro-batches on every rank (FSDP's collectives need matching forward calls).
- Launch: `launch()` starts torchrun on this machine (`postrl train --nproc N`), runs a worker when
  already inside torchrun (multi-node: torchrun on every node), or runs the same SPMD loop through
  Ray Train's TorchTrainer (`cluster.launcher: ray`, `--ray-address`).
"""

from __future__ import annotations

import heapq
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from postrl.errors import UserError

if TYPE_CHECKING:
    from postrl.config import Config

# Wrapper prefixes that DDP / FSDP1 / torch.compile put in front of parameter names.
_WRAPPER_PARTS = ("module.", "_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
# Environment that Ray workers on other machines need to see as the driver does.
_FORWARDED_ENV = (
    "PYTHONPATH", "POSTRL_CACHE", "POSTRL_DP_STRATEGY", "VLLM_ENABLE_V1_MULTIPROCESSING", "TOKENIZERS_PARALLELISM",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HF_HOME", "HF_HUB_OFFLINE",
)  # fmt: skip


# ---------------------------------------------------------------------------------- process group


def init_process_group(timeout_s: float = 1800.0) -> bool:
    """Join the process group described by torchrun's environment; True if this call created it.

    False (and nothing done) when the group already exists (Ray Train creates it) or when the
    process was not launched by torchrun / Ray (no RANK and WORLD_SIZE in the environment).
    """
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s))
    return True


def backend() -> str:
    """gloo for CPU tensors, nccl for CUDA tensors (one group with both when GPUs are present)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def is_main() -> bool:
    """Rank 0: the one that prints, logs metrics and writes the tracker file."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64, so counts stay exact)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)  # small host-side reductions go over gloo
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_sum_dict(values: dict[str, float]) -> dict[str, float]:
    """Sum of each key over ranks; every rank must pass the same keys."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([values[k] for k in keys])))


def all_reduce_max(value: int) -> int:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_object(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small Python objects)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------- data per rank


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
    dynamic batch size, so no rank waits for a rank with longer sequences).
    """
    W, r, n = world_size(), rank(), len(lengths)
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


def check_world(cfg: "Config", world: int) -> None:
    """Batch sizes that do not split over `world` ranks, as one UserError listing every problem."""
    t, n = cfg.train, cfg.rollout.n_samples_per_prompt
    problems = []
    if (t.mini_batch_size * n) % world:
        problems.append(
            f"train.mini_batch_size x rollout.n_samples_per_prompt = {t.mini_batch_size} x {n} sequences per optimizer "
            f"step do not split evenly over {world} processes. Fix: make mini_batch_size x n_samples_per_prompt a "
            f"multiple of {world} (or change the number of processes)."
        )
    if t.gen_batch_size < world:
        problems.append(
            f"train.gen_batch_size ({t.gen_batch_size}) is smaller than the {world} processes: every process "
            f"generates for its share of the prompts. Fix: set train.gen_batch_size >= {world}."
        )
    if problems:
        raise UserError(*problems, title=f"batch sizes do not fit {world} processes")


# ------------------------------------------------------------------------------------------ model


def strategy() -> str:
    """`fsdp2` (default) or `ddp`, from $POSTRL_DP_STRATEGY."""
    name = os.environ.get("POSTRL_DP_STRATEGY", "fsdp2").lower()
    if name not in ("fsdp2", "ddp"):
        raise UserError(f"POSTRL_DP_STRATEGY is '{name}'; valid: fsdp2, ddp.")
    return name


def wrap_model(model: torch.nn.Module, how: str | None = None) -> torch.nn.Module:
    """The module the update's forward/backward goes through (the model itself on one process).

    `fsdp2` shards `model` in place (its parameters become DTensor shards; it stays the same Python
    object, with generate() and save helpers) and returns it. `ddp` returns a DistributedDataParallel
    wrapper around the unchanged model. Both average gradients over ranks: see the module docstring
    for why the trainer scales its loss by world_size(). The model stays on the device it was loaded
    on; the device mesh follows it (CPU: gloo, CUDA: nccl).
    """
    if not is_distributed():
        return model
    how = how or strategy()
    device = next(model.parameters()).device
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (the reference) stays a plain replica

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))  # FSDP would otherwise move CPU weights to a GPU
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:  # one FSDP unit per transformer block: only one block is gathered at a time
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    return bool(_fsdp_modules(model))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP / torch.compile wrapper (FSDP2 shards in place)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Hold the full weights of an FSDP2 model for the duration of the block (no-op otherwise).

    Every rank must enter together (the all-gathers are collectives); inside, forward passes run
    without collectives, so ranks may run different numbers of them (generation to EOS).
    """
    units = _fsdp_modules(model)
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # FSDP keeps the root gathered after forward (its backward needs it at once); blocks reshard.
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in Hugging Face naming, one tensor at a time.

    FSDP2 shards are gathered one DTensor at a time (a collective: every rank iterates together), so
    at most one extra full tensor exists at any moment. Wrapper prefixes are stripped.
    """
    for name, tensor in unwrap(model).state_dict().items():
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load full (unsharded) tensors into a plain or FSDP2-sharded model; (missing, unexpected) keys."""
    model = unwrap(model)
    if not is_sharded(model):
        result = model.load_state_dict(state, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return list(result.missing_keys), list(result.unexpected_keys)


def save_pretrained(model: torch.nn.Module, out_dir: Path, write: bool) -> None:
    """Save the full model in Hugging Face format; only the rank with `write` touches the disk.

    A sharded model is gathered tensor by tensor (`full_state_dict`, a collective: every rank calls
    this), kept in host memory by the writing rank only and written as sharded safetensors files.
    """
    model = unwrap(model)
    if not is_sharded(model):
        if write:
            model.save_pretrained(out_dir, safe_serialization=True)
        return
    from huggingface_hub import save_torch_state_dict

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {}
    for name, tensor in full_state_dict(model):  # every rank takes part in each gather
        if write and not (tied and name == "lm_head.weight"):  # a tied head is the embedding: saved once
            state[name] = tensor.to("cpu", copy=True)  # own storage, not a view of the gather buffer
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out_dir)  # config.architectures keeps the plain class name
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)
        save_torch_state_dict(state, out_dir)
    del state


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ returning a plain tensor (the global norm under FSDP2 too)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class _GenerateUnsharded:
    """An engine whose model is FSDP2-sharded: each generate call runs inside `unsharded(model)`."""

    def __init__(self, engine: Any, model: torch.nn.Module):
        self.engine, self.model, self.name = engine, model, engine.name

    def generate(self, prompts, params, multi_modal=None):
        with unsharded(self.model):
            return self.engine.generate(prompts, params, multi_modal)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def colocate(engine: Any, model: torch.nn.Module) -> Any:
    """The rollout engine of this rank, able to generate with a sharded policy.

    The HF engine generates with the policy object itself; when that is FSDP2-sharded, generation is
    bracketed by an unshard / reshard. The vLLM engine keeps its own weights and receives the full
    tensors in `sync_weights`, so it is returned unchanged.
    """
    if is_sharded(model) and getattr(engine, "name", "") == "hf":
        return _GenerateUnsharded(engine, model)
    return engine


# ----------------------------------------------------------------------------------------- launch


def _inside_launched_worker() -> bool:
    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


def adopt_world(cfg: "Config") -> None:
    """Record the actual process layout in cfg.cluster (throughput per device, checkpoint metadata)."""
    world, local = world_size(), local_world_size()
    if world > 1 and world % local == 0:
        cfg.cluster.nnodes, cfg.cluster.devices_per_node = world // local, local


def run_worker(cfg: "Config", console: Any = None) -> dict[str, float]:
    """One rank: join the process group, train, leave it (a group made by Ray Train is left to Ray)."""
    created = init_process_group()
    try:
        adopt_world(cfg)
        check_world(cfg, world_size())
        from postrl.trainer import train

        return train(cfg, console)
    finally:
        if created:
            teardown()


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
    return launch_torchrun(args.config, list(args.overrides), nproc)


def launch_torchrun(config: str, overrides: list[str], nproc: int) -> int:
    """Start `nproc` ranks of `postrl train` on this machine with torchrun (rendezvous on loopback)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--master-addr", "127.0.0.1",
        "-m", "postrl.cli", "train", config, *overrides,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this machine: talk over loopback
    return subprocess.run(cmd, env=env).returncode


def launch_ray(cfg: "Config", address: str | None) -> int:
    """Run the SPMD loop on a Ray cluster with Ray Train's TorchTrainer.

    Workers = cluster.nnodes x cluster.devices_per_node, one device (GPU) or one CPU each. With an
    address (`ray start --head` printed it; `auto` finds the local one) the driver joins that cluster;
    without one, Ray starts a single-node cluster in this process and stops it at the end.
    """
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as exc:
        raise UserError(
            f"cluster.launcher is 'ray' but Ray Train cannot be imported ({exc}). Fix: pip install 'postrl[ray]' "
            "(ray[train]), or use --nproc N for torchrun on one machine."
        ) from None
    check_world(cfg, cfg.world_size)
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False if address is None else None)
    try:
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        workers = cfg.world_size
        log_dir = Path(cfg.logging.dir).resolve()
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config={"config": cfg.model_dump(mode="json"), "cwd": os.getcwd(), "env": env},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpus, resources_per_worker={"GPU": 1} if gpus else {"CPU": 1}),
            torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if gpus else "gloo"),
            run_config=RunConfig(name="postrl", storage_path=str(log_dir / "ray")),
        )
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

    for key, value in loop_config.get("env", {}).items():
        os.environ.setdefault(key, value)
    if os.path.isdir(loop_config["cwd"]):
        os.chdir(loop_config["cwd"])  # relative data / output paths mean what they meant to the driver
    ctx = ray.train.get_context()
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(ctx.get_local_world_size()))
    run_worker(Config.model_validate(loop_config["config"]))

"""Process groups, FSDP2 / DDP wrapping and the few collectives the loop needs.

Every rank runs the same loop (SPMD, docs/architecture.md). The helpers below are no-ops (or the
identity) when the run is a single process, so the loop calls them unconditionally.

- Process group: `init_process_group()` joins the group that torchrun (or Ray Train) describes in
  the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); gloo for CPU tensors,
  nccl for CUDA tensors. launch.py calls it; runtime.py reads rank and world size from it.
- Model: `wrap_model(model, strategy)` with `train.strategy`: `fsdp2` (default) shards the policy
  (`fully_shard` per transformer block, then the root) and runs on CPU over gloo too; `ddp`
  replicates the weights (cheaper for small models).
- Gradient semantics: both wrappers AVERAGE gradients over ranks, while the loss on each rank is
  already that rank's share of the global loss (normalised by the global token / sequence counts,
  see `algorithms.aggregate_loss`). The global gradient is therefore the SUM of the ranks'
  gradients, so the actor multiplies the loss by `world_size()` before `backward()`; averaging then
  yields exactly the sum. This holds with gradient accumulation over micro-batches too (DDP reduces
  the accumulated gradient at every backward; averaging keeps already-reduced parts unchanged).
- Weights out of a sharded model: `unsharded(model)` holds the full weights for a block (the HF
  engine generates inside it: one all-gather per generate call, then no collectives, so ranks may
  generate different lengths); `full_state_dict` streams full tensors one at a time in Hugging
  Face naming (the vLLM engine's weight sync and `save_pretrained`).
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from postrl import lora
from postrl.local_cluster import loopback_env
from postrl.runtime import accelerator

if TYPE_CHECKING:
    from postrl.runtime import Runtime

STRATEGIES = ("fsdp2", "ddp")  # train.strategy
RENDEZVOUS_FILE_ENV = "POSTRL_RENDEZVOUS_FILE"  # set for ranks that all run on this machine (one_machine_env)
# Wrapper prefixes that DDP / FSDP1 / torch.compile put in front of parameter names.
_WRAPPER_PARTS = ("module.", "_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


# ---------------------------------------------------------------------------------- process group


def init_process_group(timeout_s: float = 1800.0) -> bool:
    """Join the process group described by torchrun's environment; True if this call created it.

    False (and nothing done) when the group already exists (Ray Train creates it) or when the
    process was not launched by torchrun / Ray (no RANK and WORLD_SIZE in the environment).
    """
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))  # a no-op on CPU
    timeout = timedelta(seconds=timeout_s)
    if RENDEZVOUS_FILE_ENV in os.environ:  # launch.launch_local: ranks meet through a file, no TCP store
        store = dist.FileStore(os.environ[RENDEZVOUS_FILE_ENV], int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(
            backend(), store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
        )
    else:
        dist.init_process_group(backend(), timeout=timeout)
    return True


def one_machine_env(env: dict[str, str], rendezvous_file: str) -> dict[str, str]:
    """`env` for a rank of a job whose ranks all run on this machine (`--nproc`, a one-node Ray cluster):
    the ranks meet through `rendezvous_file` (a FileStore in a directory of the job's own, no TCP store)
    and their collectives talk over the loopback interface (local_cluster.loopback_env)."""
    return loopback_env({**env, RENDEZVOUS_FILE_ENV: rendezvous_file})


def backend() -> str:
    """gloo for CPU tensors, and nccl / hccl for device tensors where GPUs / NPUs are present (one group)."""
    return accelerator().backend


def teardown(wait_for_peers: bool = False) -> None:
    """Leave the process group.

    wait_for_peers (the success path only: a rank that failed must not wait for the others) first
    frees what still holds the group (a finished run's DDP / FSDP2 model) and meets every rank at a
    barrier, so no rank closes its connections, or exits and takes the rendezvous store with it,
    while a peer is still reading from them: gloo aborts the reading process (SIGABRT) when that
    happens.
    """
    if not dist.is_initialized():
        return
    if wait_for_peers:
        gc.collect()
        dist.barrier()
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


def all_reduce_sum(values: list[float], group: Any = None) -> list[float]:
    """Element-wise sum over ranks (float64, so counts stay exact); over `group` if given (default: all ranks)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)  # small host-side reductions go over gloo
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def all_reduce_sum_dict(values: dict[str, float], group: Any = None) -> dict[str, float]:
    """Sum of each key over ranks (or `group`); every rank must pass the same keys."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([values[k] for k in keys], group)))


# ------------------------------------------------------------------------- sequence parallelism

_SP: dict[str, Any] = {}  # the groups of `init_sequence_parallel`


def init_sequence_parallel(size: int) -> None:
    """Split the ranks into sequence-parallel groups of `size` (train.sequence_parallel_size).

    Ranks [k u, (k + 1) u) form sequence-parallel group k: they train on the same rows, each on a slice of
    every sequence (postrl.sequence_parallel). The ranks at the same place in their groups form a
    data-parallel group: one rank per distinct set of rows, over which row counts and metrics are summed.
    Every rank must call this (creating a group is a collective); size 1 is the plain data-parallel layout.
    """
    _SP.clear()
    if size <= 1:
        return
    from postrl.errors import UserError

    W, me = world_size(), rank()
    if W % size:
        raise UserError(
            f"train.sequence_parallel_size ({size}) must divide the number of ranks ({W}): each sequence-parallel "
            "group is that many ranks. Fix: choose a divisor, or launch a multiple of it (--nproc, cluster.devices_per_node)."
        )
    for k in range(W // size):
        group = dist.new_group(list(range(k * size, (k + 1) * size)))
        if k == me // size:
            _SP["sp"] = group
    for j in range(size):
        group = dist.new_group(list(range(j, W, size)))
        if j == me % size:
            _SP["dp"] = group
    _SP["size"] = size


def sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group, or None without sequence parallelism."""
    return _SP.get("sp")


def data_parallel_group() -> Any:
    """The ranks that hold distinct rows with this one (None: all ranks, without sequence parallelism)."""
    return _SP.get("dp")


def data_parallel_size() -> int:
    """How many distinct sets of rows the ranks train on: the world size over the sequence-parallel size."""
    return world_size() // _SP.get("size", 1)


def data_parallel_rank() -> int:
    """Which set of rows this rank trains on (the same for every rank of a sequence-parallel group)."""
    return rank() // _SP.get("size", 1)


def all_reduce_max(value: float) -> float:
    """The largest `value` over ranks (an int stays an int)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64 if isinstance(value, int) else torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_gather_object(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small Python objects)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (pickled; the others pass anything, e.g. None)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ------------------------------------------------------------------------------------------ model


def wrap_model(
    model: torch.nn.Module,
    strategy: str = "fsdp2",
    compute_dtype: torch.dtype = torch.float32,
    offload: bool = False,
    device: torch.device | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """The module the update's forward/backward goes through (the model itself on one process).

    `fsdp2` shards `model` in place (its parameters become DTensor shards; it stays the same Python
    object, with generate() and save helpers) and returns it. `ddp` returns a DistributedDataParallel
    wrapper around the unchanged model. Both average gradients over ranks: see the module docstring
    for why the actor scales its loss by world_size(). The model stays on the device it was placed
    on (runtime.device); the device mesh follows it (CPU: gloo, CUDA: nccl, NPU: hccl).

    Under FSDP2 a `compute_dtype` other than float32 becomes `MixedPrecisionPolicy(param_dtype=
    compute_dtype, reduce_dtype=float32)`: the fp32 shards are gathered as bf16 for compute and the
    gradients are reduce-scattered in fp32 into fp32 shards (runtime.py: precision). `offload` (a
    frozen model placed on the CPU, e.g. the reference with train.ref_offload) shards it with
    `CPUOffloadPolicy`: its shards stay in host memory and each block is copied to `device` for its
    forward. DDP and single-process runs use autocast instead (runtime.autocast) and ignore both.
    `reshard_after_forward` (train.reshard_after_forward) is FSDP2's: False keeps each block gathered
    from its forward to its backward.
    """
    assert strategy in STRATEGIES, f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}"
    if not is_distributed():
        return model
    here = next(model.parameters()).device
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (the reference) stays a plain replica

        return DistributedDataParallel(model, device_ids=[here.index] if here.type != "cpu" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    target = device or here
    offload = offload and target.type != "cpu"  # on CPU the shards are in host memory already
    mesh = init_device_mesh(target.type, (world_size(),))  # FSDP would otherwise move CPU weights to a GPU
    kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:  # one FSDP unit per transformer block: only one block is gathered at a time
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextmanager
def on_device(model: torch.nn.Module, runtime: "Runtime") -> Iterator[None]:
    """Hold a model that lives in host memory (train.ref_offload) on runtime.device for the block.

    A no-op for a model already there, and for an FSDP2-sharded one (its offload policy copies each
    block in for its forward). Otherwise the whole model moves in, and back out afterwards, and the
    freed blocks go back to the device (`runtime.empty_cache`) for the update that comes next.
    """
    home = next(model.parameters()).device
    if is_sharded(model) or home == runtime.device:
        yield
        return
    model.to(runtime.device)
    try:
        yield
    finally:
        model.to(home)
        runtime.empty_cache()


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


def full_state_dict(model: torch.nn.Module, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in Hugging Face naming, one tensor at a time.

    FSDP2 shards are gathered one DTensor at a time (a collective: every rank iterates together), so
    at most one extra full tensor exists at any moment. Wrapper prefixes are stripped. A model with
    LoRA adapters yields its adapted weights merged (W + s B A, `lora.merged`), a plain model's state;
    `adapters_only`: the adapters' own tensors instead, and nothing else.
    """
    plain = unwrap(model)
    tensors = _full_tensors(plain, (lambda name: ".lora_" in name) if adapters_only else None)
    yield from (tensors if adapters_only or not lora.is_lora(plain) else lora.merged(plain, tensors))


def _full_tensors(model: torch.nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in model.state_dict().items():
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        if keep is not None and not keep(name):
            continue
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
    this), kept in host memory by the writing rank only and written as sharded safetensors files; a
    model with LoRA adapters takes the same path and is saved merged (a plain model for any reader).
    """
    model = unwrap(model)
    if not is_sharded(model) and not lora.is_lora(model):
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


def grad_scaler(model: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for float16 compute; a pass-through (disabled) for any other dtype.

    fp16 has a 5-bit exponent: gradient values below 2^-24 (6e-8) flush to zero in the backward of
    fp16 activations, and RL losses averaged over thousands of tokens make many that small. The loss
    is multiplied by the scale (2^16 to start) before backward and the gradients divided by it before
    clipping; an overflow skips the step and halves the scale, 2,000 clean steps double it. Under
    FSDP2 each rank sees only its shard of the gradients, so `ShardedGradScaler` all-reduces the
    overflow flag and every rank skips together; DDP's gradients are already the same everywhere.
    """
    enabled = compute_dtype == torch.float16
    if enabled and is_sharded(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ returning a plain tensor (the global norm under FSDP2 too)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

"""The process's runtime: one decision, made once, of device, dtype, rank, CPU threads and RNG.

Every entry point (`postrl train`, `sft`, `eval`) calls `init_runtime` once after the config is
loaded and hands the result to whoever builds models or tensors, as nanochat's `compute_init()`:

    rt = init_runtime(cfg.train.device, cfg.model.dtype, cfg.train.strategy)
    model = model.to(rt.device)                          # the policy, the reference, every micro-batch
    with rt.autocast():                                  # every forward pass of a trained model
        out = model(...)

- Device: `train.device: auto` is `cuda:LOCAL_RANK` where CUDA is present, `npu:LOCAL_RANK` where
  torch_npu is, else `cpu`; `cpu`, `cuda` and `npu` force one (a forced accelerator that is absent is a
  user error). LOCAL_RANK comes from torchrun / Ray Train; one process drives one device.
- Accelerator (`accelerator(kind)`, `Runtime.accelerator`): one frozen record per device kind (cpu,
  cuda, npu) holds what differs between them: the process-group backend (gloo / nccl / hccl), Ray's
  resource name (GPU / NPU), vLLM's platform name, and the device calls (set_device, device count,
  RNG state, memory statistics, cache emptying; `torch.accelerator` where it covers them). No other
  module asks torch.cuda or torch.npu (tests/test_accelerator.py).
- Precision (`model.dtype`), verl's recipe: float32 trains and computes in fp32 with no
  cast anywhere. bfloat16 (or float16) is the COMPUTE dtype only: the trained policy keeps fp32 parameters
  (the master weights AdamW updates; a bf16 weight would swallow updates below 2^-8 of its value,
  and lr 1e-6 updates are far below that), gradients and optimizer moments stay fp32, and the forward
  passes compute in bf16. On one device (or DDP) `Runtime.autocast()` runs each forward under
  `torch.autocast(device, bf16)`; under FSDP2 the shards' `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` casts the gathered weights instead (distributed.wrap_model) and autocast is
  off. Log-probs, ratios, advantages and losses are fp32 either way (models.response_logprobs casts
  the logits). Frozen copies (the reference, the vLLM engine, `postrl eval`) hold weights in the
  compute dtype: they never take an update, so a master copy would only cost memory.
  float16 takes the same path, and the loss is scaled dynamically (distributed.grad_scaler): fp16's
  5-bit exponent would flush small gradients to zero.
- Rank and world size come from torch.distributed once the process group exists (launch.py creates
  it); before that a process is rank 0 of 1.
- CPU threads (`threads_for`, docs/performance.md), `train.num_threads`: a number wins, else
  OMP_NUM_THREADS; else the policy it names. `auto` (the default): the cores this process may use
  (`os.sched_getaffinity`) divided among the processes of this job on the machine (LOCAL_WORLD_SIZE,
  `--nproc`), as torch and torchrun divide them, so the same command gets the same count. `load`: no
  more than the cores other processes leave idle (1-minute load average, read once at start): OpenMP
  threads spin-wait between kernels, so a thread that has to share its core with a busy process slows
  a step down 5-10x (measured: update 2.1 s with one thread, 18.9 s with two on a 2-core machine at
  load 6). The start line says which rule decided and why. Rollout engines run with the same count:
  the process decides once, the engines do not.
- RNG: `seed_everything`, and `rng_state` / `set_rng_state` for exact resume.
- Signals: `StopOnSignal` turns SIGTERM / SIGINT into a flag the loop reads after each step, or, while the
  step has not yet changed what a checkpoint holds (`abandonable`, until `commit`: its rollout, log-probs
  and update up to the first optimizer step), abandons the step at once (`StepAbandoned`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import signal
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from postrl.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    """Where this process computes: device, compute dtype, its rank in the job."""

    device: torch.device
    dtype: torch.dtype  # compute dtype (model.dtype); trained parameters stay fp32 (masters)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    amp: bool = False  # forwards run under torch.autocast(device, dtype): bf16/fp16 without FSDP2

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs metrics and writes the tracker file."""
        return self.rank == 0

    @property
    def accelerator(self) -> "Accelerator":
        """The record of this process's device kind (backend, RNG, memory, cache)."""
        return ACCELERATORS[self.device.type]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of a trained model's forward pass: autocast to the compute dtype, or nothing.

        Nothing in float32 (no cast to make) and under FSDP2, whose mixed-precision
        policy already hands the blocks bf16 weights. Backward runs outside it (autocast's rule).
        """
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def empty_cache(self) -> None:
        """Give the caching allocator's free blocks back to the device; a no-op on CPU.

        Only where another allocator needs them next (vLLM waking up) or a large model just left the
        device (the offloaded reference): elsewhere PyTorch reuses its cache faster than it can refill it.
        """
        self.accelerator.empty_cache()


def init_runtime(device: str = "auto", dtype: str = "float32", strategy: str = "fsdp2") -> Runtime:
    """Decide this process's device, dtype and rank (call once, after the process group exists).

    `strategy` (train.strategy) decides who casts to the compute dtype with several processes:
    FSDP2's mixed-precision policy, or autocast (DDP, and any single process).
    """
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    joined = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if joined else (0, 1)
    compute = DTYPES[dtype]
    fsdp_casts = world > 1 and strategy == "fsdp2"
    return Runtime(
        device=resolve_device(device, local_rank), dtype=compute, rank=rank, world_size=world, local_rank=local_rank,
        amp=compute != torch.float32 and not fsdp_casts,
    )  # fmt: skip


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` | `cpu` | `cuda` | `npu` (or an explicit `cuda:N`) -> the torch.device this process uses."""
    if name.startswith(("cuda:", "npu:")):
        name, local_rank = name.split(":")[0], int(name.split(":")[1])
    acc = accelerator() if name == "auto" else ACCELERATORS[name]
    if acc.kind == "cpu":
        return torch.device("cpu")
    if not acc.is_available():
        raise UserError(
            f"train.device is '{name}' but no {acc.kind.upper()} device is visible to this process. "
            "Fix: set train.device: auto (uses an accelerator when there is one, else the CPU) or cpu, "
            f"or run on a machine with {acc.install}."
        )
    device = torch.device(acc.kind, local_rank)
    acc.set_device(local_rank)
    return device


# ---------------------------------------------------------------------------------- accelerator


@dataclass(frozen=True)
class Accelerator:
    """Everything that differs between device kinds, asked in one place: the rest of postrl asks this
    record (`accelerator()`), never torch.cuda / torch.npu.

    The names are data (testable without the hardware); the methods act on the devices of this kind
    through `torch.accelerator` (the current accelerator: the one a process of this kind has) and, for
    what that does not cover (RNG, total memory), the kind's torch device module. On `cpu` every
    method is a no-op or reports nothing.
    """

    kind: str  # torch device type: cpu | cuda | npu
    backend: str  # torch.distributed backend: host tensors over gloo, device tensors over the vendor's library
    ray_resource: str  # Ray's resource name of one worker's device
    vllm_platform: str  # vLLM's platform (device) name; npu is the vllm-ascend plugin's
    flash_attn: bool  # the flash-attn package's kernels run here (attn_implementation auto)
    install: str  # what a machine needs for this kind (error messages)

    @property
    def is_device(self) -> bool:
        """An accelerator rather than the host CPU."""
        return self.kind != "cpu"

    def is_available(self) -> bool:
        if not self.is_device:
            return True
        if self.kind == "npu" and not _import_torch_npu():
            return False
        return torch.get_device_module(self.kind).is_available()

    def device_count(self) -> int:
        return torch.accelerator.device_count() if self._current() else 0

    def set_device(self, index: int) -> None:
        if self._current():
            torch.accelerator.set_device_index(index)

    def current_device(self) -> torch.device:
        """The device this process drives (`set_device`), or the CPU."""
        if not self._current():
            return torch.device("cpu")
        return torch.device(self.kind, torch.accelerator.current_device_index())

    def empty_cache(self) -> None:
        """Give the caching allocator's free blocks back to the device; a no-op on CPU."""
        if self._current():
            torch.accelerator.empty_cache()

    def memory_stats(self) -> dict[str, int]:
        """Bytes of the current device: total, free, allocated and peak allocated by torch; {} on CPU."""
        if not self._current():
            return {}
        free, total = torch.accelerator.get_memory_info()
        return {
            "total": total, "free": free,
            "allocated": torch.accelerator.memory_allocated(), "peak": torch.accelerator.max_memory_allocated(),
        }  # fmt: skip

    def reset_peak_memory_stats(self) -> None:
        if self._current():
            torch.accelerator.reset_peak_memory_stats()

    def rng_state(self) -> list[torch.Tensor] | None:
        """The RNG state of every device of this kind (None on CPU: torch.get_rng_state holds it)."""
        return torch.get_device_module(self.kind).get_rng_state_all() if self._current() else None

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        if self._current():
            torch.get_device_module(self.kind).set_rng_state_all(states)

    def fork_rng(self, all_devices: bool = False) -> contextlib.AbstractContextManager:
        """Restore the CPU's torch RNG state on exit, and the current device's (`all_devices`: every
        visible device's, which creates a context on each) (torch.random.fork_rng)."""
        devices = []
        if self._current():
            devices = list(range(self.device_count())) if all_devices else [torch.accelerator.current_device_index()]
        return torch.random.fork_rng(devices=devices, device_type=self.kind)

    def _current(self) -> bool:
        """This kind is the machine's accelerator: torch.accelerator's calls reach its devices."""
        if not self.is_device or (self.kind == "npu" and not _import_torch_npu()):
            return False
        current = torch.accelerator.current_accelerator(check_available=True)
        return current is not None and current.type == self.kind


ACCELERATORS = {
    "cpu": Accelerator("cpu", "gloo", ray_resource="CPU", vllm_platform="cpu", flash_attn=False, install="a CPU"),
    "cuda": Accelerator(
        "cuda", "cpu:gloo,cuda:nccl", ray_resource="GPU", vllm_platform="cuda", flash_attn=True, install="CUDA GPUs"
    ),
    "npu": Accelerator(
        "npu", "cpu:gloo,npu:hccl", ray_resource="NPU", vllm_platform="npu", flash_attn=False,
        install="Ascend NPUs and torch_npu",
    ),
}


def accelerator(kind: str | None = None) -> Accelerator:
    """The record of device kind `kind` (cpu | cuda | npu), or of this machine's accelerator when None:
    CUDA where a GPU is visible, NPU where torch_npu sees one, else the CPU."""
    if kind is not None:
        return ACCELERATORS[kind]
    return next((a for a in (ACCELERATORS["cuda"], ACCELERATORS["npu"]) if a.is_available()), ACCELERATORS["cpu"])


def pair_group(backend: str, store: Any, rank: int, size: int, timeout: Any) -> Any:
    """A process group of `size` members on `store`, outside the default group (the rollout pool's trainer-replica
    pairs): gloo on host tensors, nccl / hccl (torch_npu registers it) on device tensors."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    if backend == "hccl" and _import_torch_npu():
        return dist.ProcessGroupHCCL(store, rank, size)  # type: ignore[attr-defined]
    raise ValueError(f"no process group for backend {backend!r}")


@functools.cache
def _import_torch_npu() -> bool:
    """Import torch_npu (it registers the `npu` device with torch) when installed."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return True


# -------------------------------------------------------------------------------------- threads

THREAD_POLICIES = ("auto", "load")  # train.num_threads, besides a number


def cpu_threads(processes: int = 1, policy: str = "auto") -> tuple[int, str]:
    """(intra-op threads for each of `processes` processes of this job on this machine, why).

    `auto`: the cores this process may use, split among the job's processes (torch's and torchrun's
    rule). `load` caps that by the cores the rest of the machine leaves idle: cores minus the rounded
    1-minute load average of the other processes (this one's own part is taken out; at least one).
    """
    assert policy in THREAD_POLICIES, f"unknown thread policy {policy!r}; valid: {', '.join(THREAD_POLICIES)}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = max(1, processes)
    share = max(1, cores // processes)
    why = f"{cores} usable cores" + (f" / {processes} processes" if processes > 1 else "")
    if policy == "auto":
        return share, why
    load = max(0.0, os.getloadavg()[0] - _own_load()) if hasattr(os, "getloadavg") else 0.0  # other processes
    idle = max(1, cores - round(load))
    if idle < share:
        why += f", {idle} idle (load {load:.1f}: busy threads would spin against other processes)"
    return min(share, idle), why


def _own_load() -> float:
    """This process's part of the 1-minute load average: its CPU use so far, damped as the kernel damps it."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        with open("/proc/uptime") as f:
            elapsed = float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    if elapsed <= 0:
        return 0.0
    cpu = sum(os.times()[:2])  # user + system seconds of every thread of this process
    return cpu / elapsed * (1 - math.exp(-elapsed / 60))


def threads_for(model: torch.nn.Module, requested: int | str | None = "auto", per_rank: int = 1) -> tuple[int | None, str]:
    """(intra-op threads for this process, why); None keeps torch's own choice.

    `requested` is train.num_threads: a number wins; else OMP_NUM_THREADS, when set; else, on CPU,
    the policy it names (`auto` when None) over the job's processes on this machine (LOCAL_WORLD_SIZE
    ranks, `per_rank` processes each: 2 with an async rollout worker beside the trainer).
    """
    if isinstance(requested, int):
        return requested, f"train.num_threads: {requested}"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:  # an empty or malformed value is ignored, as libgomp ignores it
        return None, f"OMP_NUM_THREADS={omp}"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None, "the model is on an accelerator"
    policy = requested or "auto"
    n, why = cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)) * per_rank, policy)
    return n, f"train.num_threads {policy}: {why}"


def configure_threads(model: torch.nn.Module, requested: int | str | None = "auto", log=None, per_rank: int = 1) -> None:
    """Apply `threads_for` to this process and say what was chosen and why."""
    n, why = threads_for(model, requested, per_rank)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    if log is not None:
        log(f"CPU intra-op threads: {torch.get_num_threads()} ({why})")


# ------------------------------------------------------------------------------------------ RNG


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """python / numpy / torch (and the accelerator's, under its kind: "cuda" / "npu") RNG states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    acc = accelerator()
    if acc.is_device:
        state[acc.kind] = acc.rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    acc = accelerator()
    if acc.is_device and acc.kind in state:
        acc.set_rng_state(state[acc.kind])


# -------------------------------------------------------------------------------------- signals


class StepAbandoned(BaseException):
    """A stop signal came before the step changed what a checkpoint holds (`StopOnSignal.abandonable`). A BaseException,
    as KeyboardInterrupt is: no `except Exception` on the way (a user's program, the rollout) holds it up."""

    def __init__(self, signum: int):
        super().__init__(f"stopped on signal {signum} before the step's first optimizer step")
        self.signum = signum


class StopOnSignal:
    """SIGTERM / SIGINT set a flag that the loop reads after each step; a second one stops at once.

    A scheduler sends SIGTERM before it preempts a job and kills it about 30 s later, while one step of a
    real model on a CPU takes minutes (its rollout, its log-prob passes, its update). So inside
    `abandonable()`, from a step's start until `commit()` (called just before its first optimizer step),
    the signal abandons the step at once by raising `StepAbandoned` in the main thread: nothing a checkpoint
    holds (weights, optimizer, scheduler) has changed yet, and the checkpoint of the last completed step is
    written with the RNG and sampler of the step's start, so a resumed run draws the same step again. A
    signal that came just before the window opens abandons the step as it starts. After `commit()` the step
    in flight finishes (its optimizer steps), a checkpoint is written, and the run exits cleanly. Only the
    main thread can install handlers; elsewhere (a Ray worker thread) signals keep their default meaning.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    abandon = False  # inside `abandonable()`
    signum = 0  # the signal received; 0 outside the `with` too (a test's train_step without fit())

    def __enter__(self) -> "StopOnSignal":
        self.signum = 0
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum:  # asked twice: stop now, the last checkpoint stays the one to resume from
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        if self.abandon:
            self.abandon = False
            raise StepAbandoned(signum)

    @contextlib.contextmanager
    def abandonable(self, enabled: bool = True) -> Any:
        """A stop signal inside, or one that came before, abandons the step (`StepAbandoned`) until `commit()`."""
        if enabled and self.signum:
            raise StepAbandoned(self.signum)
        self.abandon = enabled
        try:
            yield
        finally:
            self.abandon = False

    def commit(self) -> None:
        """The step is about to change what a checkpoint holds (an optimizer step): a signal from here is left to
        the loop, which stops after the step."""
        self.abandon = False

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

"""The device layer: one record per device kind in runtime.py, and nobody else asks torch.cuda / torch.npu."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from postrl.runtime import ACCELERATORS, accelerator

SRC = Path(__file__).resolve().parents[1] / "src" / "postrl"


def test_only_runtime_asks_the_device_modules():
    """Every CUDA / NPU question goes through runtime.accelerator(): an NPU run then gets hccl, Ray's NPU
    resource and vLLM's npu platform from the same table as a GPU run gets nccl, GPU and cuda."""
    pattern = re.compile(r"torch\.cuda|torch\.npu|torch_npu")
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "runtime.py" or path.parent != SRC
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == [], "ask postrl.runtime.accelerator() instead:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "kind, backend, ray_resource, vllm_platform",
    [
        ("cpu", "gloo", "CPU", "cpu"),
        ("cuda", "cpu:gloo,cuda:nccl", "GPU", "cuda"),
        ("npu", "cpu:gloo,npu:hccl", "NPU", "npu"),
    ],
)
def test_each_device_kind_maps_to_its_backend_ray_resource_and_vllm_platform(kind, backend, ray_resource, vllm_platform):
    acc = accelerator(kind)
    assert (acc.kind, acc.backend, acc.ray_resource, acc.vllm_platform) == (kind, backend, ray_resource, vllm_platform)
    assert acc.is_device == (kind != "cpu")
    assert set(ACCELERATORS) == {"cpu", "cuda", "npu"}


def test_the_cpu_record_does_nothing_to_devices():
    """On the CPU the device calls are no-ops and report nothing; fork_rng still restores the CPU stream."""
    cpu = accelerator("cpu")
    assert cpu.is_available() and cpu.device_count() == 0 and cpu.current_device() == torch.device("cpu")
    assert cpu.rng_state() is None and cpu.memory_stats() == {}
    cpu.set_device(0)
    cpu.empty_cache()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with cpu.fork_rng():
        torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)


def test_this_machine_and_the_resolved_device_agree():
    """`accelerator()` names the kind `train.device: auto` resolves to, and the process group's backend."""
    from postrl import distributed
    from postrl.runtime import init_runtime

    here = accelerator()
    assert init_runtime("auto").device.type == here.kind
    assert init_runtime("auto").accelerator is here
    assert distributed.backend() == here.backend
    assert (here.kind == "cuda") == torch.cuda.is_available()


def test_a_forced_absent_accelerator_is_a_user_error():
    from postrl.errors import UserError
    from postrl.runtime import resolve_device

    for kind in ("cuda", "npu"):
        if accelerator(kind).is_available():
            continue
        with pytest.raises(UserError, match=f"train.device is '{kind}' but no {kind.upper()} device"):
            resolve_device(kind)


@pytest.mark.parametrize(
    "device, resources, want",
    [
        ("auto", {"CPU": 8.0}, "cpu"),
        ("auto", {"CPU": 8.0, "GPU": 4.0}, "cuda"),
        ("auto", {"CPU": 8.0, "NPU": 8.0}, "npu"),
        ("cpu", {"CPU": 8.0, "GPU": 4.0}, "cpu"),  # train.device: cpu keeps the workers off the GPUs
        ("npu", {"CPU": 8.0}, "npu"),
    ],
)
def test_ray_workers_ask_for_the_resource_of_their_device_kind(device, resources, want):
    from postrl.launch import worker_accelerator

    assert worker_accelerator(device, resources) is accelerator(want)

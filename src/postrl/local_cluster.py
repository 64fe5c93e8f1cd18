"""Where a run's own servers listen: on loopback, unless the run joins a cluster at an address (DESIGN.md
section 13, docs/reliability.md "Loopback only").

A run is local when all its processes are on this machine: `postrl train --nproc N`, a Ray cluster the run
starts itself (`cluster.launcher: ray` or `rollout.placement: pool` without `cluster.ray_address`), or a Ray
cluster whose node address is 127.0.0.1. Such a run needs no network: its Ray servers bind 127.0.0.1, its
stores are files or bound to 127.0.0.1, and its collectives (gloo, NCCL) talk over the loopback interface.
A run that joins a cluster at an address (cluster.ray_address, `--ray-address`) may span machines: its
stores listen at the node's address and its collectives use the interface the user chose
(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; scripts/ray_cluster.sh's SOCKET_IFNAME). launch.py and the
rollout pool both start Ray through `start_ray`; nothing here imports Ray before it is called.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

from postrl.errors import UserError
from postrl.utils import is_loopback

LOOPBACK = "127.0.0.1"
# Ray's switch for "this machine alone" (its name is historical; each Ray process reads it when it imports
# ray): every Ray process of the cluster then takes 127.0.0.1 as its node's address.
RAY_ONE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# The interfaces gloo's and NCCL's connections use; read when a process group is made.
SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process of a local run: gloo and NCCL connect over the loopback interface (an interface
    the user set is replaced: every peer of a local run is on this machine)."""
    if not Path("/sys/class/net/lo").exists():  # no Linux loopback by that name: the libraries' own choice
        return dict(env)
    return {**env, **dict.fromkeys(SOCKET_IFNAME_ENV, "lo")}


def use_loopback() -> None:
    """Make this process's next process groups connect over the loopback interface (a local run)."""
    os.environ.update(loopback_env({}))


def prepare_local_ray() -> None:
    """Set Ray's switch for "this machine alone" in this process, for a cluster of the run's own that starts later:
    Ray reads it once, when it is first imported (vLLM imports ray as the engine is built)."""
    os.environ[RAY_ONE_MACHINE_ENV] = "0"


def import_ray(address: str | None) -> Any:
    """`import ray`, for a cluster of this run's own when `address` is None: Ray reads its switch for "this
    machine alone" when it is imported (RAY_ONE_MACHINE_ENV), so it is set first. ImportError if not installed."""
    if address is None:
        prepare_local_ray()
    import ray

    return ray


def start_ray(address: str | None, env_vars: dict[str, str] | None = None, **options: Any) -> bool:
    """Connect this process to Ray; True when this call did (launch.py shuts Ray down at the end of its job;
    the pool leaves it to the process's exit, when Ray stops the cluster it started).

    Without an address: a new single-node cluster of this run's own (`address="local"`, never `None`, which
    would join any cluster already running on this machine, another user's too), node address 127.0.0.1 so
    that the GCS, raylets, agents and workers bind loopback, no dashboard, and the workers' collectives on
    the loopback interface. With an address: that cluster (`auto` finds the one on this machine). Nothing
    when this process is connected already (a program that embeds postrl chose its cluster).
    """
    ray = import_ray(address)
    if ray.is_initialized():
        return False
    env = dict(env_vars or {})
    if address is None:
        use_loopback()
        env = loopback_env(env)
        ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, runtime_env={"env_vars": env}, **options)
        if not ray_node_is_local():  # Ray was imported before the switch was set: its servers took the LAN address
            ray.shutdown()
            raise UserError(
                f"postrl started a Ray cluster for this run on 127.0.0.1, but Ray gave it the address "
                f"{ray.util.get_node_ip_address()}: this process imported ray before postrl could set "
                f"{RAY_ONE_MACHINE_ENV}=0, which Ray reads at import. A local cluster must not listen beyond loopback. "
                f"Fix: set {RAY_ONE_MACHINE_ENV}=0 in the environment before ray is imported, or start Ray yourself "
                "before postrl (ray.init(...)), or name a cluster with cluster.ray_address.",
                title="a local Ray cluster would listen beyond loopback",
            )
    else:
        ray.init(address=address, runtime_env={"env_vars": env} if env else None, **options)
    return True


def ray_node_is_local() -> bool:
    """Whether this process's Ray node has the loopback address: then the whole cluster is this machine."""
    import ray

    return is_loopback(ray.util.get_node_ip_address())


def serving_store(timeout: timedelta) -> tuple[str, Any]:
    """(address peers connect to, a torch.distributed TCPStore this process serves) for meeting Ray actors
    (the rollout pool's replicas). On a local node the store listens on 127.0.0.1 only and this process's
    groups use the loopback interface; otherwise at the node's address, on every interface (torch's store)."""
    import ray
    import torch.distributed as dist

    if not ray_node_is_local():
        host = ray.util.get_node_ip_address()
        return host, dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
    use_loopback()
    return LOOPBACK, loopback_store(timeout)


def loopback_store(timeout: timedelta) -> Any:
    """A TCPStore server bound to 127.0.0.1: torch binds its own listening socket to every interface, so
    the socket is made here and handed over (torch takes ownership of the descriptor)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(LOOPBACK, port, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def join_store(host: str, port: int, timeout: timedelta) -> Any:
    """A client of the store at host:port (a Ray actor meeting the process that serves it); a store on
    loopback means a local run, so this process's groups use the loopback interface too."""
    import torch.distributed as dist

    if is_loopback(host):
        use_loopback()
    return dist.TCPStore(host, port, None, False, timeout=timeout)

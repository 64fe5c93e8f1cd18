"""A local run listens on loopback only, whatever its placement (issue 46; docs/reliability.md).

Each test runs `postrl train` as a command of its own and, while it runs, reads the sockets of every process
of the run with psutil: the command's process tree, every process of its session (Ray's servers and workers
stay in it) and every process that inherited the run's marker variable (a process that left the session).
A socket counts as listening when it is a TCP socket in LISTEN or an unconnected UDP socket; every one must
be bound to 127.0.0.1 or ::1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import AGENT_RECIPE, start_postrl, tiny_agent_overrides, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _run_and_watch(args: list[str], cwd: Path, timeout: float, **extra_env: str) -> tuple[int, str, set[tuple[str, int, str]]]:
    """Run `postrl train ARGS` to its end; (exit code, output, every (address, port, process name) that listened)."""
    import psutil

    marker = uuid.uuid4().hex
    unset = dict.fromkeys(("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))  # postrl
    # itself must keep the run on loopback
    env = {**unset, "RAY_USAGE_STATS_ENABLED": "0", "POSTRL_TEST_RUN": marker,
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env}  # fmt: skip
    proc = start_postrl("train", *args, env=env, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    ours: dict[tuple[int, float], bool] = {}  # (pid, start time) -> whether it belongs to the run

    def belongs(p: psutil.Process) -> bool:
        key = (p.pid, p.create_time())
        if key not in ours:
            try:
                ours[key] = os.getsid(p.pid) == proc.pid or p.environ().get("POSTRL_TEST_RUN") == marker
            except (psutil.Error, OSError):
                ours[key] = False
        return ours[key]

    listening: set[tuple[str, int, str]] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                family = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
            except psutil.Error:
                family = set()
            for p in psutil.process_iter():
                try:
                    if p.pid not in family and not belongs(p):
                        continue
                    name = p.name() if p.name() != "python" else " ".join(p.cmdline()[1:4])[:80]  # which python
                    for c in p.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                            listening.add((c.laddr[0], c.laddr[1], name))
                except (psutil.Error, OSError):  # it ended between the listing and the read
                    pass
            time.sleep(0.2)  # a poll of what runs now, not a wait for something to happen
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        out = f"the run did not finish within {timeout} s"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for p in psutil.process_iter():  # whatever of the run is left (Ray's servers), by process id
            try:
                if belongs(p):
                    p.kill()
            except psutil.Error:
                pass
    return proc.returncode, out, listening


def _outside(listening: set[tuple[str, int, str]]) -> str:
    """The listeners beyond loopback, one a line ('' when none)."""
    return "\n".join(f"{host} port {port} ({name})" for host, port, name in sorted(listening) if host not in LOOPBACK)


@pytest.mark.slow
def test_a_pool_run_listens_on_loopback_only(tmp_path):
    """`postrl train configs/tiny_dapo.yaml rollout.placement=pool rollout.pool.replicas=2`, 2 tiny steps: Ray
    (GCS, raylet, agents, the replicas' core workers), the trainer's store and the trainer-replica groups all
    bind loopback; the run starts a cluster of its own rather than join the one RAY_ADDRESS names (only
    cluster.ray_address joins). ~60-150 s: Ray and two replicas start on a loaded 2-core machine."""
    args = [str(ROOT / "configs/tiny_dapo.yaml"), *tiny_overrides(tmp_path, "rollout.placement=pool", "rollout.pool.replicas=2",
            "rollout.max_staleness=1", "train.total_steps=2", "train.gen_batch_size=4", "algorithm.filter_groups.enable=false")]  # fmt: skip
    # Where Ray would find a cluster to join by itself (ray.init(address=None)): a decoy with nothing behind it.
    rc, out, listening = _run_and_watch(args, tmp_path, timeout=400, RAY_ADDRESS="127.0.0.1:9")
    assert rc == 0, out[-4000:]
    assert "a pool of 2 replica(s)" in out, out[-3000:]
    names = {name for *_, name in listening}
    # The scan saw Ray's servers, a replica (its process title names the task it runs) and the trainer's store.
    assert {"gcs_server", "raylet"} <= names, listening
    assert any(name.startswith("ray::Replica") for name in names), listening
    assert any("postrl.cli train" in name for name in names), listening
    assert not _outside(listening), f"listening beyond loopback:\n{_outside(listening)}"


@pytest.mark.slow
def test_an_endpoint_run_listens_on_loopback_only(tmp_path):
    """examples/openai_agent (a plain openai-client program against postrl's endpoint), 2 tiny steps: the
    endpoint and everything else of the run bind loopback."""
    args = [str(AGENT_RECIPE), *tiny_agent_overrides(
        tmp_path / "run", f"{AGENT_RECIPE.parent}/calculator_agent.py:run", "rollout.max_tokens=16", "rollout.agent_concurrency=4",
        "eval.before_train=false", "eval.after_train=false", "data.tool_arithmetic.train_size=64", "data.tool_arithmetic.val_size=8",
    )]  # fmt: skip
    rc, out, listening = _run_and_watch(args, tmp_path, timeout=300)
    assert rc == 0, out[-4000:]
    assert listening, "the endpoint listens: the scan should have seen it"
    assert not _outside(listening), f"listening beyond loopback:\n{_outside(listening)}"


def _listening_here() -> set[tuple[str, int]]:
    import psutil

    return {c.laddr[:2] for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_the_pools_store_listens_on_loopback_only_where_torchs_own_listens_everywhere(monkeypatch):
    """local_cluster.loopback_store (the pool's store on a local cluster) binds 127.0.0.1, and a two-member
    gloo group formed on it (the trainer-replica pair) listens and works over lo; torch's own TCPStore, for
    contrast, listens on every interface: the check sees the difference."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from postrl.local_cluster import join_store, loopback_store
    from postrl.runtime import pair_group

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)  # join_store sets them for this process (restored afterwards)
    timeout = datetime.timedelta(seconds=60)
    before = _listening_here()
    store = loopback_store(timeout)
    got = torch.zeros(3)

    def replica():
        group = pair_group("gloo", dist.PrefixStore("t", join_store("127.0.0.1", store.port, timeout)), 1, 2, timeout)
        group.broadcast(got, 0).wait()

    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    group = pair_group("gloo", dist.PrefixStore("t", store), 0, 2, timeout)
    group.broadcast(torch.arange(3.0), 0).wait()
    thread.join(60)
    assert got.tolist() == [0.0, 1.0, 2.0]
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    ours = _listening_here() - before  # the store and gloo's listener
    assert ("127.0.0.1", store.port) in ours and {host for host, _ in ours} == {"127.0.0.1"}, ours
    everywhere = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    assert ("::", everywhere.port) in _listening_here(), "torch's own store binds every interface"
    del everywhere, group, store


def test_loopback_names_and_the_local_environment():
    from postrl.local_cluster import is_loopback, loopback_env

    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.1.1", "192.0.2.2", "node-1", "")] == [
        True, True, True, True, False, False, False]  # fmt: skip
    env = loopback_env({"GLOO_SOCKET_IFNAME": "eth0", "PATH": "/bin"})  # a local run's peers are all on this machine
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "PATH": "/bin"}


def test_the_cluster_script_refuses_token_authentication_on_a_ray_without_it(tmp_path):
    """scripts/ray_cluster.sh sets RAY_AUTH_MODE=token, which Ray has from 2.52: an older `ray` is refused
    with a message saying how to go on; the installed one (the `ray` extra: >= 2.52) passes the check."""
    (tmp_path / "ray").write_text('#!/bin/sh\necho "ray, version 2.51.1"\n')
    (tmp_path / "ray").chmod(0o755)
    base = dict(os.environ, MASTER_ADDR="10.0.0.1", CURRENT_IP="10.0.0.1", DEVICE="cpu", DRY_RUN="1")
    base.pop("RAY_AUTH_MODE", None)

    def script(path: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "scripts/ray_cluster.sh")], env={**base, "PATH": path, **env},
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    old = script(f"{tmp_path}:{os.environ['PATH']}")
    assert old.returncode == 2 and "needs Ray 2.52 or newer" in old.stderr and "found 2.51.1" in old.stderr, old
    assert script(f"{tmp_path}:{os.environ['PATH']}", RAY_AUTH_MODE="disabled").returncode == 0  # the opt-out
    new = script(f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert new.returncode == 0 and new.stdout.startswith("ray start --head"), new


REFUSED = """
import os
os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
import ray  # imported before postrl could set Ray's one-machine switch
from postrl.errors import UserError
from postrl.local_cluster import start_ray
try:
    start_ray(None, num_cpus=1, object_store_memory=100 * 2**20)
except UserError as exc:
    print("refused:", exc, "| ray still up:", ray.is_initialized())
else:
    print("started at", ray.util.get_node_ip_address())
"""


@pytest.mark.slow
def test_a_local_cluster_that_ray_puts_on_the_lan_address_is_refused(tmp_path):
    """Ray reads its one-machine switch when it is imported: a program that imported ray first would get a
    'local' cluster on the LAN address. start_ray checks the address Ray gave the node, stops that cluster
    and says how to go on. ~20-40 s: one Ray start."""
    from ray._private.services import node_ip_address_from_perspective

    if node_ip_address_from_perspective() in LOOPBACK:
        pytest.skip("this machine has no address beyond loopback: Ray would pick 127.0.0.1 anyway")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", REFUSED], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "refused:" in out.stdout and "imported ray before postrl" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "ray still up: False" in out.stdout, out.stdout

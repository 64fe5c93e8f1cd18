"""Ray Train's torch backend for the one-node cluster postrl starts itself: nothing listens beyond loopback.

Ray Train's TorchConfig sets MASTER_ADDR / MASTER_PORT to the rank-0 worker's node and calls
`init_process_group(env://)` in every worker; the TCP store that this opens in rank 0 binds every
interface, whatever MASTER_ADDR is (torch's store server listens on `::`). On a cluster of this machine
alone the ranks need no network to meet, so `FileRendezvousTorchConfig` replaces that step with the
rendezvous of `postrl train --nproc N` (launch.launch_local): the backend creates a fresh directory,
tells every worker the path of its rendezvous file (distributed.RENDEZVOUS_FILE_ENV) and the loopback
interface for collectives, and each worker builds the group itself from a FileStore in
`distributed.init_process_group` (run_worker) and leaves it at the end. Multi-node clusters keep Ray
Train's own TorchConfig (launch.launch_ray).

Importing this module imports Ray; launch.py imports it only for a Ray run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ray.train.backend import Backend
from ray.train.torch import TorchConfig

from postrl import distributed


class FileRendezvousTorchConfig(TorchConfig):
    """TorchConfig (backend, device context) whose workers meet through a file instead of a TCP store."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _FileRendezvousBackend


class _FileRendezvousBackend(Backend):
    """Creates no process group: it hands each worker a rendezvous file, the worker joins by itself."""

    share_cuda_visible_devices = True  # as Ray's torch backend: LOCAL_RANK picks the worker's GPU
    rendezvous_dir: str | None = None

    def on_start(self, worker_group: Any, backend_config: FileRendezvousTorchConfig) -> None:
        # A fresh directory per worker group: a restarted group must not find an old store file.
        self.rendezvous_dir = tempfile.mkdtemp(prefix="postrl-rendezvous-")
        rendezvous_file = str(Path(self.rendezvous_dir) / "store")
        worker_group.execute(_prepare_worker, rendezvous_file)

    def on_shutdown(self, worker_group: Any, backend_config: FileRendezvousTorchConfig) -> None:
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None


def _prepare_worker(rendezvous_file: str) -> None:
    """Runs in each Ray Train worker before the training loop starts: its rendezvous file, collectives over lo."""
    os.environ.update(distributed.one_machine_env(dict(os.environ), rendezvous_file))

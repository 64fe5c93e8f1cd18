"""The run directory: writable before the model loads, and held by one run at a time."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from postrl.errors import UserError


def check_run_dirs(cfg: Any) -> None:
    """logging.dir and checkpoint.dir must be writable directories: found now, not at the first save."""
    problems = []
    for key, value in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        path = Path(value)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".postrl_write_test_{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            what = "is a file, not a directory" if path.is_file() or any(p.is_file() for p in path.parents) else f"is not writable ({exc.strerror})"
            problems.append(
                f"{key} '{value}' {what}: the run would train and then lose everything at its first save. "
                f"Fix: point {key} at a directory you can write to."
            )
    if problems:
        raise UserError(*problems, title="the run directories cannot be written")


class RunLock:
    """An exclusive lock on a run directory, so that two runs never share checkpoints and metrics.

    flock on <logging.dir>/.postrl.lock: released by the kernel when the process ends, however it ends,
    so a crashed run never leaves a stale lock behind. The file says who holds it. Within one process
    a later Trainer on the same directory takes the lock over (runs in one process are sequential).
    """

    NAME = ".postrl.lock"
    _held: dict[Path, Any] = {}  # run directory -> the open lock file of this process

    def __init__(self, run_dir: str | Path):
        import fcntl

        self.path = (Path(run_dir) / self.NAME).resolve()
        if self.path in RunLock._held and not RunLock._held[self.path].closed:
            self.file = RunLock._held[self.path]
            return
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise UserError(
                f"the run directory {run_dir} is in use by {holder}. Two runs on one directory would overwrite "
                "each other's checkpoints and write every step twice into metrics.jsonl. Fix: wait for that run to "
                "finish (or stop it), or give this run its own logging.dir."
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv[:3])})\n")
        self.file.flush()
        RunLock._held[self.path] = self.file

    def release(self) -> None:
        RunLock._held.pop(self.path, None)
        if not self.file.closed:
            self.file.close()  # closing drops the flock

"""The python tool's sandbox settings and their defaults, in one place: config's rollout.multi_turn.sandbox
(config/schema.py `SandboxConfig`) takes its defaults from here and validates them; the two backends
(agents/sandbox: `run_python`, `run_remote`) read them as a `SandboxLimits`.

Plain standard library on purpose: the sandbox runs under interpreters that lack pydantic (the tests run it
under the system Python), so the values cannot live only in the pydantic model. What each one means is in
`SandboxConfig`'s field descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxLimits:
    """builtin:python's backend and limits (rollout.multi_turn.sandbox); its time limit is the tool call's."""

    backend: str = "local"  # "local" or "sandbox_fusion"
    url: str | None = None
    require_isolation: bool = True
    memory_mb: int = 1024
    cpu_s: int | None = None
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 16_384
    tmpfs_mb: int = 64
    concurrency: int = 8
    retries: int = 3
    retry_after_max_s: float = 30.0
    max_reply_bytes: int = 1 << 20
    connect_timeout_s: float = 5.0
    request_slack_s: float = 10.0


DEFAULT = SandboxLimits()

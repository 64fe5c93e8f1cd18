"""Small shared helpers: cache location, dotted lookups, user objects named 'package.module:name' or kept in a
.py file, whether a host is this machine's loopback."""

from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.util
import ipaddress
import os
import sys
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

from postrl.errors import UserError


def cache_dir() -> Path:
    """Where built artefacts (tiny models, built-in data) are cached: $POSTRL_CACHE or ~/.cache/postrl."""
    path = Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def scratch_path(target: Path) -> Path:
    """A temporary name beside `target` that no other writer uses (pid + random), in the target's directory so
    that the final rename is atomic. Concurrent builders of one artefact (ranks, test workers, two runs on a
    cold cache) each write their own scratch copy and never see each other's half-written files."""
    return target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def publish_dir(tmp: Path, target: Path, done: Callable[[Path], bool] | None = None) -> Path:
    """Rename the finished directory `tmp` to `target` atomically; returns `target`.

    With `done` (a cache): when another builder published a whole `target` first, ours is discarded and
    theirs reused, so a directory a reader may hold open is never deleted; a leftover that `done` does not
    accept is moved aside (itself an atomic rename) and replaced. Without `done`: `target` is replaced.
    """
    for _ in range(5):
        try:
            os.rename(tmp, target)
            return target
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if done is not None and done(target):
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        aside = scratch_path(target)
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            pass  # another writer moved it first
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not publish {tmp} as {target}: other writers kept replacing it")


def get_dotted(row: Any, dotted: str, default: Any = None) -> Any:
    """row['a']['b'] for 'a.b', list items by integer index ('msgs.-1.content'); a literal key 'a.b' wins;
    `default` when any level is missing."""
    if isinstance(row, dict) and dotted in row:
        return row[dotted]
    node = row
    for key in dotted.split("."):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.lstrip("-").isdigit() and -len(node) <= int(key) < len(node):
            node = node[int(key)]
        else:
            return default
    return node


def split_named(spec: str, malformed: str) -> tuple[str, str]:
    """A user's 'module:name' (an agent program, a tool, an environment class) as (module, name); a UserError
    with the message `malformed` (what the name should look like, and how to fix it) when a part is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(malformed)
    return module_name, attr


def import_named(spec: str, kind: str, function: bool = True) -> Any:
    """The object a user names 'package.module:name' (a verifier, a loss, a tool, an environment class).

    A ValueError says what could not be loaded and how to fix it; `kind` names the thing ("verifier 'x'");
    with `function` the object must be callable as a function.
    """
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, or the module's own error on import
        raise ValueError(
            f"{kind} could not be loaded ({type(exc).__name__}: {exc}). It is named 'package.module:name' and the "
            "module must be importable from the current environment. Fix: install the package, or add its "
            "directory to PYTHONPATH, and check the name."
        ) from None
    if function and not callable(obj):
        raise ValueError(f"{kind} is a {type(obj).__name__}, not a function. Fix: name a function.")
    return obj


def load_file_module(path: str | Path, prefix: str) -> Any:
    """The module of the Python file at `path` (a user's agent program, a verl reward file), run once per call.

    It is registered in sys.modules under `prefix` + a digest of the resolved path, so dataclasses, pickling and
    type hints inside the file find their module, and two files of the same name do not collide. A ValueError
    says what is wrong (no such file, not Python, the file's own error on import).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{file} is not a file")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"{prefix}{digest}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the file's own error on import
        sys.modules.pop(spec.name, None)
        raise ValueError(f"{file} raised {type(exc).__name__} on import: {exc}") from None
    return module


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: localhost or a loopback address (127.0.0.0/8, ::1, [::1])."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def host_memory_available() -> int | None:
    """The host's MemAvailable in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

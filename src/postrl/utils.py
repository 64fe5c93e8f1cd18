"""Small shared helpers: cache location, dotted lookups, user objects named 'package.module:name'."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Where built artefacts (tiny models, built-in data) are cached: $POSTRL_CACHE or ~/.cache/postrl."""
    path = Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def get_dotted(row: dict, dotted: str, default: Any = None) -> Any:
    """row['a']['b'] for 'a.b' (a literal key 'a.b' wins); `default` when any level is missing."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


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

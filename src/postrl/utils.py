"""Small shared helpers: cache location, dotted lookups."""

from __future__ import annotations

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

"""Small shared helpers: cache location, dotted lookups, seeding."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def cache_dir() -> Path:
    """Where built artefacts (tiny models, built-in data) are cached: $POSTRL_CACHE or ~/.cache/postrl."""
    path = Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def get_dotted(row: dict, dotted: str, default: Any = None) -> Any:
    """row['a']['b'] for 'a.b'; `default` when any level is missing."""
    node: Any = row
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

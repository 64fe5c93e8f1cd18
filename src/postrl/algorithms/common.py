"""What every part of postrl.algorithms shares: registries by name and the masked mean."""

from __future__ import annotations

from typing import Callable

import torch


def _unknown(kind: str, name: str, valid) -> ValueError:
    return ValueError(f"unknown {kind} '{name}'; valid: {', '.join(valid)}")


def _lookup(table: dict, kind: str, name: str):
    if name not in table:
        raise _unknown(kind, name, table)
    return table[name]


def _register_into(table: dict, kind: str, name: str) -> Callable:
    def deco(fn):
        assert name not in table, f"{kind} '{name}' is registered twice"
        table[name] = fn
        return fn

    return deco


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)

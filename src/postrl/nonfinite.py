"""Non-finite forensics: when a loss, a log-prob or a gradient is NaN / inf, which rows and which layer.

The actor checks what it already has: each micro-batch's loss and log-probs, the old / reference log-probs, the
global gradient norm (a few reductions per optimizer step, no hook). Normal steps pay nothing more. When something
is not finite, the optimizer step is skipped and the offending micro-batch is run once more, padded (one row per
batch row), under hooks registered for that pass only:

- a forward hook on every module: the first module, in execution order, whose output holds a non-finite value on a
  real (attended) position, and in which rows; the largest finite |activation| seen (an overflowing dtype);
- a tensor hook on every module output: the first module, in backward order, whose output gradient is not finite;
- after the backward: the parameters whose gradient is not finite.

Each such step writes `<logging.dir>/nonfinite/step_N.jsonl` (one JSON object per line: the step's summary, then one
line per offending row with its prompt and response text), is counted (actor/nonfinite_steps), and after
train.max_nonfinite_steps such steps in a row the run stops with a message naming the file and the likely causes
seen (an overflowing dtype, a zero-length response, a learning-rate or gradient-norm spike).

Under several ranks every rank re-runs one micro-batch at the same time (FSDP2 and DDP communicate inside forward
and backward), and each writes its own file (step_N.rank<r>.jsonl beside rank 0's step_N.jsonl).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from postrl import distributed
from postrl.errors import UserError

MAX_PARAMS = 20  # parameter names kept per record


def finite(t: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether every value of `t` (where `mask` is non-zero) is finite."""
    bad = ~torch.isfinite(t)
    if mask is not None:
        bad = bad & (mask > 0)
    return not bool(bad.any())


def bad_rows(t_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[int]:
    """Rows of `t_BT` with a non-finite value where `mask_BT` is non-zero."""
    return (((~torch.isfinite(t_BT)) & (mask_BT > 0)).any(-1)).nonzero().flatten().tolist()


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((x for x in out if isinstance(x, torch.Tensor)), None)
    return getattr(out, "logits", None) if not isinstance(out, dict) else out.get("logits")


@dataclass
class Trace:
    """What the hooks saw during one forensic pass."""

    attention_BL: torch.Tensor  # which positions are real (non-finite values on padding mean nothing)
    forward: dict | None = None  # the first module whose output was not finite
    backward: dict | None = None  # the first module whose output gradient was not finite
    largest: tuple[float, str] = (0.0, "")  # the largest finite |output| and where
    handles: list = field(default_factory=list)

    def _rows(self, t: torch.Tensor) -> tuple[list[int], str]:
        bad = ~torch.isfinite(t.detach())
        if t.dim() >= 2 and tuple(t.shape[:2]) == tuple(self.attention_BL.shape):
            bad = bad.flatten(2).any(-1) & (self.attention_BL > 0) if t.dim() > 2 else bad & (self.attention_BL > 0)
        if not bool(bad.any()):
            return [], ""
        rows = bad.flatten(1).any(-1).nonzero().flatten().tolist() if bad.dim() >= 2 else []
        values = t.detach()[~torch.isfinite(t.detach())]
        kind = "nan" if bool(torch.isnan(values).any()) else "inf"
        return rows, kind

    def attach(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str) -> Callable:
        def hook(module, args, out):
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            if self.forward is None:
                rows, kind = self._rows(t)
                if kind:
                    inputs_finite = all(finite(a) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
                    self.forward = {"module": name, "kind": kind, "rows": rows, "inputs_finite": inputs_finite}
                else:
                    big = float(t.detach().abs().max()) if t.numel() else 0.0
                    if big > self.largest[0]:
                        self.largest = (big, name)
            if t.requires_grad:
                t.register_hook(self._backward_hook(name))

        return hook

    def _backward_hook(self, name: str) -> Callable:
        def hook(grad):
            if self.backward is None:
                rows, kind = self._rows(grad)
                if kind:
                    self.backward = {"module": name, "kind": kind, "rows": rows}

        return hook

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def nonfinite_params(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose gradient holds a non-finite value (this rank's shard under FSDP2)."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if not finite(local):
            out.append(name)
    return out


def row_record(tokenizer, mb: dict, row: int) -> dict:
    """Prompt and response text of a micro-batch row (its real tokens), with what the loss read of it."""
    T = mb["response_mask"].shape[1]
    ids, attn = mb["input_ids"][row], mb["attention_mask"][row]
    L = ids.shape[0]
    prompt = ids[: L - T][attn[: L - T] > 0].tolist()
    response = ids[L - T :][attn[L - T :] > 0].tolist()
    adv = mb["adv"][row]
    return {
        "prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response), "prompt_tokens": len(prompt),
        "response_tokens": len(response), "model_tokens": int(mb["response_mask"][row].sum()),
        "advantage": float(adv.float().mean()) if adv.dim() else float(adv),
    }  # fmt: skip


class NonFiniteWatch:
    """The run's non-finite bookkeeping: records, the count and the streak (module docstring)."""

    def __init__(self, cfg: Any, tokenizer: Any, log: Callable[[str], None] = print):
        self.dir = Path(cfg.logging.dir) / "nonfinite"
        self.limit = cfg.train.max_nonfinite_steps
        self.peak_lr = cfg.train.lr
        self.tokenizer, self.log = tokenizer, log
        self.total = self.streak = 0
        self.grad_norms: list[float] = []  # finite global gradient norms of the recent optimizer steps
        self.last_lr: float | None = None
        self.records: list[dict] = []  # this step's
        self.paths: list[Path] = []

    def start_step(self) -> None:
        self.records = []

    def note_grad_norm(self, norm: float) -> None:
        if math.isfinite(norm):
            self.grad_norms = (self.grad_norms + [norm])[-20:]

    def trace(self, model: torch.nn.Module, mb: dict, run_pass: Callable[[dict], torch.Tensor], what: dict) -> None:
        """Run `run_pass(mb)` (forward, loss and backward of the micro-batch; returns its log-probs [B, T]) under the
        hooks and keep what they found, with the offending rows' text."""
        trace = Trace(mb["attention_mask"])
        trace.attach(model)
        try:
            logp = run_pass(mb)
        finally:
            trace.detach()
        rows = set(bad_rows(logp.detach(), mb["response_mask"]))
        for found in (trace.forward, trace.backward):
            rows.update(found["rows"] if found else [])
        params = nonfinite_params(model)
        self.records.append({
            **what, "first_forward": trace.forward, "first_backward": trace.backward,
            "params": params[:MAX_PARAMS], "params_count": len(params),
            "largest_finite_activation": {"value": trace.largest[0], "module": trace.largest[1]},
            "rows": [{"row": r, **row_record(self.tokenizer, mb, r)} for r in sorted(rows)],
        })  # fmt: skip

    def found(self, before: int) -> bool:
        """Whether the passes traced since record `before` found a non-finite value; the empty records are dropped."""
        kept = [r for r in self.records[before:] if r["first_forward"] or r["first_backward"] or r["params_count"] or r["rows"]]
        self.records[before:] = kept
        return bool(kept)

    def causes(self, lr: float, prev_lr: float | None, dtype: torch.dtype) -> list[str]:
        """The likely causes the records show."""
        out = []
        if dtype in (torch.float16, torch.bfloat16):
            limit = torch.finfo(dtype).max
            inf = any((r.get("first_forward") or {}).get("kind") == "inf" for r in self.records)
            big = max((r["largest_finite_activation"]["value"] for r in self.records), default=0.0)
            if inf or big > 0.25 * limit:
                out.append(f"an overflowing dtype ({dtype}: values up to {big:.3g}, the largest is {limit:.3g}; model.dtype: bfloat16 "
                           "has float32's range)")  # fmt: skip
        empty = sum(1 for r in self.records for row in r["rows"] if row["model_tokens"] == 0)
        if empty:
            out.append(f"a zero-length response ({empty} row(s) without a sampled token: a per-sequence mean divides by 0)")
        if lr > 1.5 * self.peak_lr or (prev_lr and lr > 3.0 * prev_lr):  # warmup grows it at most 2x a step
            out.append(f"a learning-rate spike ({lr:.3g}, the step before {prev_lr or 0:.3g}, train.lr {self.peak_lr:.3g})")
        if len(self.grad_norms) >= 3:
            *before, last = self.grad_norms
            median = sorted(before)[len(before) // 2]
            if last > 10 * median:
                out.append(f"a gradient-norm spike before it ({last:.3g}, the median of the steps before {median:.3g})")
        return out

    def end_step(self, step: int, lr: float, dtype: torch.dtype, skipped: bool) -> dict[str, float]:
        """Write this step's records, count it, and stop the run after train.max_nonfinite_steps such steps in a row."""
        bad = int(distributed.all_reduce_max(int(skipped)))
        prev_lr, self.last_lr = self.last_lr, lr
        if not bad:
            self.streak = 0
            return {"actor/nonfinite_steps": float(self.total)}
        self.total += 1
        self.streak += 1
        causes = self.causes(lr, prev_lr, dtype)
        path = self._write(step, lr, causes)
        self.log(f"[yellow]step {step}: a loss, log-prob or gradient was not finite: the optimizer step is skipped "
                 f"({self.streak} such step(s) in a row); rows and parameters: {path}[/yellow]")  # fmt: skip
        if self.limit and self.streak >= self.limit:
            seen = "; ".join(causes) if causes else "none of the usual ones (see the file)"
            raise UserError(
                f"{self.streak} training steps in a row (train.max_nonfinite_steps: {self.limit}) had a non-finite loss, "
                f"log-prob or gradient, so each was skipped and the run is not learning. The offending rows (prompt and "
                f"response) and the layers and parameters where the first non-finite value appeared are in {path}. Likely "
                f"causes seen: {seen}. Fix: train in bfloat16 or float32 rather than float16 (model.dtype), drop or fix "
                "rows without a sampled token, lower train.lr or raise train.warmup_steps, lower train.grad_clip.",
                title="the run stopped on non-finite values",
            )
        return {"actor/nonfinite_steps": float(self.total)}

    def _write(self, step: int, lr: float, causes: list[str]) -> Path:
        """Rank 0 always writes its file (the message names it); another rank only when it found something."""
        rank = distributed.rank()
        path = self.dir / (f"step_{step}.jsonl" if rank == 0 else f"step_{step}.rank{rank}.jsonl")
        if rank != 0 and not self.records:
            return self.dir / f"step_{step}.jsonl"
        self.dir.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps({"step": step, "rank": rank, "lr": lr, "streak": self.streak, "likely_causes": causes,
                                "micro_batches": len(self.records)}) + "\n")  # fmt: skip
            for rec in self.records:
                rows = rec.pop("rows")
                f.write(json.dumps({"kind": "micro_batch", **rec}) + "\n")
                for row in rows:
                    f.write(json.dumps({"kind": "row", "micro_batch": rec.get("micro_batch"), **row}) + "\n")
        self.paths.append(path)
        return path

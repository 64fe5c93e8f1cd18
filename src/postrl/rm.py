"""Reward model training (`postrl rm`): preference pairs (Bradley-Terry) or labelled outcomes (pointwise).

- pairwise, as TRL's RewardTrainer and OpenRLHF train RMs: rows of prompt + chosen + rejected, loss
  -log sigmoid(r_chosen - r_rejected) (Bradley and Terry 1952; Ouyang et al. 2022);
- pointwise, for outcomes that are labelled rather than ranked: rows of prompt + response + label
  (1 good, 0 bad), loss binary cross-entropy of sigmoid(r) against the label.

The model is `model.path` with a one-logit sequence-classification head
(`AutoModelForSequenceClassification`, num_labels=1; the head is new, the body the given model's).
Samples are rendered exactly as `reward.reward_model` renders them at training time
(`postrl.rewards.reward_model.render`: the RM's chat template, cut from the left), and the output is a
plain HF model directory that `reward.reward_model.path` loads. `builtin:arithmetic_pairs:train` /
`:val` are the built-in task's pairs (`postrl.builtin.arithmetic.preference_pairs`), so a CPU user and
the tests have an RM without downloads.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from postrl.config import Config
from postrl.data.dataset import read_rows
from postrl.errors import UserError
from postrl.rewards.reward_model import encode, prompt_messages, render, sequence_scores
from postrl.runtime import configure_threads, init_runtime, seed_everything
from postrl.utils import publish_dir, scratch_path

BUILTIN_PAIRS = "builtin:arithmetic_pairs:"


def read_preference_rows(path: str, cfg: Config) -> list[dict]:
    """Rows of a pair / outcome file, or the built-in pairs of the arithmetic task (data.builtin's knobs)."""
    return [row for _, row in _located_rows(path, cfg)]


def _located_rows(path: str, cfg: Config) -> list[tuple[str, dict]]:
    """(where: file, row and line, row) for every row of `path`; a malformed record is a UserError listing all."""
    if path.startswith(BUILTIN_PAIRS):
        from postrl.builtin.arithmetic import preference_pairs

        split = path[len(BUILTIN_PAIRS) :]
        rows = read_rows(f"builtin:arithmetic:{split}", cfg.data.builtin.model_dump())
        return [(f"{path} row {i + 1}", r) for i, r in enumerate(preference_pairs(rows, seed=cfg.rm.seed))]
    from postrl.data.readers import iter_records

    if not Path(path).is_file():
        raise UserError(f"rm: data file '{path}' does not exist. Fix: correct rm.train_files / rm.val_files.")
    located = list(iter_records(path))
    bad = [r.describe() for r in located if r.row is None]
    if bad:
        raise UserError(*bad[:20], title=f"{path}: {len(bad)} malformed record(s); `postrl rm` stops")
    return [(r.where, r.row) for r in located]


def row_problems(where: str, row: dict, objective: str, prompt_key: str) -> list[str]:
    """What makes one row unusable for `objective` (missing fields, a label that is not 0 / 1, an identical pair)."""
    from postrl.utils import get_dotted

    fields = ("chosen", "rejected") if objective == "pairwise" else ("response", "label")
    missing = [k for k in (prompt_key, *fields) if (get_dotted(row, k) if k == prompt_key else row.get(k)) is None]
    if missing:
        return [f"{where}: no {' / '.join(missing)} (a {objective} row has {prompt_key}, {' and '.join(fields)})"]
    if objective == "pairwise":
        if _text(row["chosen"]).strip() == _text(row["rejected"]).strip():
            return [f"{where}: chosen and rejected are the same text, so the pair prefers nothing"]
        return []
    label = row["label"]
    if isinstance(label, bool) or (isinstance(label, (int, float)) and label in (0, 1)):
        return []
    kind = "text" if isinstance(label, str) else type(label).__name__
    return [f"{where}: label {label!r} ({kind}) is not 0 or 1 (1 good, 0 bad)"]


def _validated(files: list[str], cfg: Config, key: str) -> list[tuple[list[dict], str, str]]:
    """(rows, objective, file) per file, every row checked before anything loads: a UserError lists every bad row."""
    out, problems, objective = [], [], None
    for f in files:
        located = _located_rows(f, cfg)
        obj = objective_of([row for _, row in located], cfg.rm.objective, f)
        if objective is not None and obj != objective:
            raise UserError(f"{f} holds {obj} rows, the files before it {objective} rows. Fix: train on one kind at a time.")
        objective = obj
        for where, row in located:
            problems += row_problems(where, row, obj, cfg.data.prompt_key)
        out.append(([row for _, row in located], obj, f))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        shown.append(
            f"A reward model learns only from whole rows: a pair needs a prompt, a chosen and a different rejected "
            "response; a labelled row a prompt, a response and a label 0 or 1 (a label outside them makes the loss and "
            f"the accuracy meaningless). Fix the rows above in {key}, or drop them."
        )
        raise UserError(*shown, title=f"{key}: {len(problems)} unusable row(s); `postrl rm` stops before loading the model")
    return out


def _text(value: Any) -> str:
    """A response as text: a string, or TRL's conversational form (the last message's content)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    return "" if value is None else str(value)


def objective_of(rows: list[dict], requested: str, source: str) -> str:
    """pairwise or pointwise, from the columns when `requested` is auto; a clear error when they are missing."""
    keys = set(rows[0]) if rows else set()
    pairwise, pointwise = {"chosen", "rejected"} <= keys, {"response", "label"} <= keys
    objective = requested if requested != "auto" else ("pairwise" if pairwise else "pointwise" if pointwise else "")
    if (objective == "pairwise" and not pairwise) or (objective == "pointwise" and not pointwise) or not objective:
        raise UserError(
            f"{source}: columns {sorted(keys)} do not hold {objective or 'pairs or labelled responses'}. A reward model "
            "trains on prompt + chosen + rejected (pairwise) or prompt + response + label (pointwise). Fix: rename "
            "the columns, or set rm.objective to match them."
        )
    return objective


def build_samples(rows: list[dict], tokenizer, cfg: Config, objective: str) -> list[tuple]:
    """(chosen text, rejected text) per pair, or (text, label) per labelled response."""
    out = []
    for row in rows:
        messages = prompt_messages(row, cfg.data.prompt_key)
        if objective == "pairwise":
            out.append((render(tokenizer, messages, _text(row["chosen"])), render(tokenizer, messages, _text(row["rejected"]))))
        else:
            out.append((render(tokenizer, messages, _text(row["response"])), float(row["label"])))
    return out


def load_samples(files: list[str], tokenizer, cfg: Config, key: str = "rm.train_files", validated=None) -> tuple[list[tuple], str]:
    samples, objective = [], None
    for rows, obj, _ in validated if validated is not None else _validated(files, cfg, key):
        objective = obj
        samples += build_samples(rows, tokenizer, cfg, obj)
    return samples, objective or "pairwise"


def _check_output_dir(s: Any) -> None:
    """Refuse to replace what a run before left in rm.output_dir, unless rm.overwrite says so."""
    out = Path(s.output_dir)
    if s.overwrite or not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"rm.output_dir '{out}' is a file. Fix: point rm.output_dir at a directory.")
    if (out / "model").exists():
        raise UserError(
            f"rm.output_dir '{out}' already holds a reward model ({out / 'model'}); this run would replace it. Fix: "
            "choose another rm.output_dir, or set rm.overwrite: true (rm.overwrite=true) to replace it."
        )


def rm_loss(model: torch.nn.Module, samples: list[tuple], tokenizer, max_length: int, objective: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy): pairwise -log sigmoid(r_c - r_r) and r_c > r_r, or pointwise BCE and (r > 0) == label."""
    if objective == "pairwise":
        batch = encode(tokenizer, [c for c, _ in samples] + [r for _, r in samples], max_length)
        r_2B = sequence_scores(model, {k: v.to(device) for k, v in batch.items()})
        margin_B = r_2B[: len(samples)] - r_2B[len(samples) :]
        return -F.logsigmoid(margin_B).mean(), (margin_B > 0).float().mean()
    batch = encode(tokenizer, [t for t, _ in samples], max_length)
    r_B = sequence_scores(model, {k: v.to(device) for k, v in batch.items()})
    label_B = torch.tensor([y for _, y in samples], device=r_B.device)
    return F.binary_cross_entropy_with_logits(r_B, label_B), ((r_B > 0).float() == label_B).float().mean()


@torch.no_grad()
def accuracy(model: torch.nn.Module, samples: list[tuple], tokenizer, max_length: int, objective: str, device, micro: int = 32) -> float:
    """Pairwise accuracy (chosen scored above rejected), or pointwise label accuracy, over `samples`."""
    model.eval()
    hits = 0.0
    for lo in range(0, len(samples), micro):
        part = samples[lo : lo + micro]
        hits += rm_loss(model, part, tokenizer, max_length, objective, device)[1].item() * len(part)
    return hits / max(len(samples), 1)


def load_rm_for_training(path: str, trust_remote_code: bool = False):
    """`path` with a fresh one-logit sequence-classification head, and its tokenizer (pad token set)."""
    from transformers import AutoModelForSequenceClassification

    from postrl.models import load_tokenizer

    tokenizer = load_tokenizer(path, trust_remote_code)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load '{path}' as a sequence-classification model ({exc}). Fix: point model.path at a Hugging "
            "Face decoder model directory (e.g. the output of `postrl sft`)."
        ) from None
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def run_rm(cfg: Config, console: Any = None) -> dict[str, float]:
    """Train the reward model of `cfg.rm` from `model.path`; save it to <rm.output_dir>/model."""
    from rich.console import Console

    from postrl.actor import lr_lambda
    from postrl.models import resolve_model_path

    console = console or Console()
    s = cfg.rm
    _check_output_dir(s)
    train_rows = _validated(s.train_files, cfg, "rm.train_files")  # every row, before the model loads
    val_rows = _validated(s.val_files, cfg, "rm.val_files") if s.eval_pairs and s.val_files else None
    seed_everything(s.seed)
    rt = init_runtime(cfg.train.device, "float32")
    path = resolve_model_path(cfg.model.path, cfg.model.tiny)
    model, tokenizer = load_rm_for_training(path, cfg.model.trust_remote_code)
    model.to(rt.device).train()
    configure_threads(model, cfg.train.num_threads, console.print)
    train, objective = load_samples(s.train_files, tokenizer, cfg, validated=train_rows)
    console.print(f"RM ({objective}) on {len(train)} samples from {', '.join(s.train_files)} (model {path})")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s.warmup_steps, s.steps, s.lr_schedule, 0.0))
    rng = random.Random(s.seed)
    loss_ema = acc_ema = None
    for step in range(s.steps):
        batch = rng.sample(train, min(s.batch_size, len(train)))
        loss, acc = rm_loss(model, batch, tokenizer, s.max_length, objective, rt.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        acc_ema = acc.item() if acc_ema is None else 0.95 * acc_ema + 0.05 * acc.item()
        if cfg.logging.progress and (step + 1) % 50 == 0:
            console.print(f"rm step {step + 1}/{s.steps}: loss {loss_ema:.4f}, train accuracy {acc_ema:.3f}")
    out = Path(s.output_dir) / "model"
    tmp = scratch_path(out)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, out)
    console.print(f"RM done: final loss {loss_ema:.4f}; model saved to {out}")
    result = {"rm/loss": loss_ema or 0.0, "rm/train_accuracy": acc_ema or 0.0}
    if s.eval_pairs and s.val_files:
        held_out, obj = load_samples(s.val_files, tokenizer, cfg, validated=val_rows)
        result["rm/val_accuracy"] = accuracy(model, held_out[: s.eval_pairs], tokenizer, s.max_length, obj, rt.device)
        console.print(f"[bold]held-out {obj} accuracy of the RM:[/bold] {result['rm/val_accuracy'] * 100:.1f}%")
    return result

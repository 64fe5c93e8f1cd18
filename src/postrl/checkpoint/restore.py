"""Reading a checkpoint back: which one `checkpoint.resume` names, what it holds for this rank (and the
run's metrics.jsonl rows, which the trainer replays into its validation history and guards), the
weights or adapters copied into a live model, and what a resumed or stopped run says.

Exact resume. Weights, AdamW state, the scheduler position, the sampler position and the RNG states
are restored, and the step counter continues, so the per-step generation seeds (`Experience._seed`)
line up. The rollout engines keep no RNG between calls (every generate call is seeded), and the
dynamic-sampling loop ends within its step (surplus groups are dropped, as verl does), so the
sampler position is its whole cross-step state. With `train.deterministic: true`, a resumed CPU run
equals an uninterrupted one bit for bit (tests/test_checkpoint.py).
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from postrl import distributed, lora
from postrl.checkpoint.files import STATE_FILE, TRACKER, complete_iters, iter_dir, iter_step, read, read_tracker, torch_load
from postrl.checkpoint.store import batch_settings, lora_settings, optim_settings, rng_from_file
from postrl.errors import UserError
from postrl.metrics import read_jsonl


def find_resume_dir(cfg) -> Path | None:
    """The checkpoint that `checkpoint.resume` names, or None for a fresh start.

    auto:    the iteration in <checkpoint.dir>/latest_checkpointed_iteration.txt, if the file exists.
    none:    a fresh start.
    <path>:  an iter_* checkpoint, or a checkpoint directory (its tracker file names the iteration).
    """
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    root = Path(cfg.checkpoint.dir) if resume == "auto" else Path(resume).expanduser()
    if resume != "auto" and (root / STATE_FILE).is_file():
        return root
    if resume != "auto" and not (root / TRACKER).exists():
        raise UserError(
            f"checkpoint.resume: '{resume}' is neither a checkpoint (an iter_* directory with {STATE_FILE}) nor "
            f"a checkpoint directory with {TRACKER}. Fix: point it at one, or use 'auto' / 'none'."
        )
    if not (root / TRACKER).exists():
        found = complete_iters(root) if root.is_dir() else []
        if found:
            raise UserError(
                f"checkpoint.dir '{root}' holds checkpoints ({', '.join(p.name for p in found)}) but no {TRACKER}, "
                "so it is unclear which one to resume from, and a fresh run would overwrite them. Fix: write the "
                f"step to resume from into {root / TRACKER}, or set checkpoint.resume=none to start over "
                "(or point checkpoint.dir elsewhere)."
            )
        return None
    step = read_tracker(root)
    path = iter_dir(root, step)
    if (path / STATE_FILE).is_file():
        return path
    old = root / f".old_{path.name}"  # a crash between the two renames of a re-save
    if (old / STATE_FILE).is_file():
        return old
    found = complete_iters(root)
    raise UserError(
        f"{root / TRACKER} names iteration {step}, but {path} is not a complete checkpoint. Fix: write the "
        f"step of an existing checkpoint into {root / TRACKER} (found: {', '.join(p.name for p in found) or 'none'})."
    )


def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy the safetensors weights of `model_dir` into `model` in place (the optimizer keeps its params);
    a model with LoRA adapters takes them as its base."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(read(f, lambda p: load_file(str(p))))
    if not state:
        raise UserError(f"{model_dir} holds no *.safetensors weights. Fix: point at a checkpoint written by postrl.")
    plain = distributed.unwrap(model)
    if lora.is_lora(plain):  # the weights become the frozen base; the adapters are left as they are
        state = lora.base_names(plain, state)
    missing, unexpected = distributed.load_full_state_dict(model, state)  # into FSDP2 shards too
    tied = getattr(plain.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight")) and ".lora_" not in k]  # tied: saved once
    if missing or unexpected:
        raise UserError(
            f"the weights in {model_dir} do not fit model.path's architecture (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}). Fix: resume with the model.path (and model.tiny) the checkpoint was trained from."
        )


@dataclass
class Restored:
    """What a checkpoint holds for this rank; the trainer puts each piece in place.

    With `finetune` only `path` (the weights) is meant to be used. `optimizer` / `scheduler` are None
    with checkpoint.load_optimizer false, `rng` is None with checkpoint.load_rng false.
    """

    path: Path
    finetune: bool
    step: int = 0
    optimizer: dict | None = None
    scheduler: dict | None = None
    rng: dict | None = None
    sampler: dict | None = None
    critic_optimizer: dict | None = None  # PPO: the critic's, when the checkpoint has one (critic/)
    critic_scheduler: dict | None = None
    metrics: list[dict] = field(default_factory=list)  # <logging.dir>/metrics.jsonl: validations and rewards to replay

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def critic_dir(self) -> Path:  # PPO's value model: model/, optimizer_rank{r}.pt, scheduler.pt
        return self.path / "critic"


def resume(cfg: Any, train_prompts: int, log=print) -> Restored | None:
    """Read the checkpoint named by `checkpoint.resume` for this rank; None for a fresh start.

    finetune:        weights only; step 0, fresh optimizer, sampler and RNG.
    load_optimizer:  false = fresh AdamW moments (Megatron's --no-load-optim); the LR schedule still
                     continues at the resumed step.
    load_rng:        false = keep the RNG seeded from train.seed (--no-load-rng).
    """
    ck = cfg.checkpoint
    rank, world = distributed.rank(), distributed.world_size()
    path = find_resume_dir(cfg)
    if path is None:
        root = Path(ck.dir)
        if ck.resume == "none" and root.is_dir() and complete_iters(root):
            log(
                f"[yellow]note: checkpoint.resume is 'none' but {root} holds checkpoints; this run starts at step 0 "
                "and will overwrite them when it reaches their steps.[/yellow]"
            )
        return None
    if ck.finetune:
        return Restored(path=path, finetune=True)

    meta = json.loads((path / STATE_FILE).read_text())
    _check_trained_parameters(cfg, meta, path)
    for problem in setting_changes(cfg, meta, world, train_prompts):
        log(f"[yellow]warning (resuming from {path}): {problem}[/yellow]")
    restored = Restored(path=path, finetune=False, step=int(meta["step"]))
    if ck.load_optimizer:
        opt_file = path / "optimizer" / f"rank{rank}.pt"
        if not opt_file.exists():
            raise UserError(
                f"{path} has no optimizer state for rank {rank} ({opt_file.name}); it was written by a run with "
                f"{meta.get('world_size', 1)} rank(s). Fix: resume with the same number of processes, or set "
                "checkpoint.load_optimizer=false to start the optimizer afresh."
            )
        restored.optimizer = read(opt_file, torch_load)
        restored.scheduler = read(path / "scheduler.pt", torch_load)
        if (restored.critic_dir / f"optimizer_rank{rank}.pt").exists():
            restored.critic_optimizer = read(restored.critic_dir / f"optimizer_rank{rank}.pt", torch_load)
            restored.critic_scheduler = read(restored.critic_dir / "scheduler.pt", torch_load)
    rng_file = path / f"rng_rank{rank}.pt"
    if ck.load_rng and rng_file.exists():
        restored.rng = rng_from_file(read(rng_file, torch_load))
    elif ck.load_rng:
        log(f"[yellow]warning: {path} has no RNG state for rank {rank}; keeping the RNG seeded from train.seed.[/yellow]")
    restored.sampler = read(path / "dataloader.pt", torch_load)["sampler"]
    if (metrics := Path(cfg.logging.dir) / "metrics.jsonl").exists():
        restored.metrics = read_jsonl(metrics)

    later = [p.name for p in complete_iters(path.parent) if (iter_step(p) or -1) > restored.step]
    if later:
        log(
            f"[yellow]note: resuming from step {restored.step} although {', '.join(later)} exist(s); this run will "
            "overwrite them when it reaches their steps.[/yellow]"
        )
    return restored


def _check_trained_parameters(cfg: Any, meta: dict, path: Path) -> None:
    """A resume continues the same parameters: LoRA adapters of the same shape, or every weight."""
    then, now = meta.get("lora"), lora_settings(cfg)
    if then == now:
        return

    def said(settings: dict | None) -> str:
        return "every weight" if settings is None else "LoRA adapters ({})".format(", ".join(f"{k} {v}" for k, v in settings.items()))

    back = "model.lora_rank=0" if then is None else f"model.lora_rank={then['rank']} model.lora_alpha={then['alpha']}"
    raise UserError(
        f"{path} trained {said(then)}, but this run trains {said(now)}: its optimizer state and weights do not fit "
        f"these parameters. Fix: resume with the checkpoint's settings ({back}, and its model.target_modules), or set "
        "checkpoint.finetune=true to start a new run from its (merged) weights."
    )


def load_model(model: torch.nn.Module, restored: Restored) -> None:
    """The checkpoint's weights into `model`: the full weights, or on a LoRA resume model.path's base with the
    checkpoint's adapters (a LoRA finetune loads the full weights: they become the frozen base)."""
    if restored.finetune or not lora.is_lora(model):
        load_weights(model, restored.model_dir)
    else:
        load_adapter(model, restored.path / lora.ADAPTER_DIR)


def report(cfg: Any, restored: Restored, log=print) -> None:
    """The resume's lines: where from, and a warning when the checkpoint already holds every step."""
    if restored.finetune:
        log(f"finetune: loaded the weights of {restored.path}; starting a fresh run at step 0")
        return
    log(f"resumed from {restored.path} at step {restored.step}")
    if restored.step >= cfg.train.total_steps:
        log(
            f"[yellow]nothing to train: the checkpoint is at step {restored.step} and train.total_steps is "
            f"{cfg.train.total_steps}. To start over, use a new logging.dir or checkpoint.resume=none; "
            "to train on, raise train.total_steps.[/yellow]"
        )


def stopped_line(cfg: Any, signum: int, step: int, abandoned: str | None = None) -> str:
    """What a run stopped by a signal says: where its steps are saved and how to continue; `abandoned`: what the
    step in flight was doing when the signal abandoned it."""
    name = signal.Signals(signum).name if signum > 0 else "a stop signal"
    done = f"stopped after step {step} with a checkpoint in {cfg.checkpoint.dir}"
    if abandoned is not None:
        done = (done if step else "stopped before any step") + f"; step {step + 1}, which was {abandoned}, was abandoned"
    return f"[yellow]{name} received: {done}; run the same command again to continue (checkpoint.resume: auto).[/yellow]"


def load_adapter(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Copy a checkpoint's LoRA adapters (adapter/) into `model` in place; its base is model.path's."""
    state = read(Path(adapter_dir) / "adapter_model.safetensors", lora.read_adapter)
    missing, unexpected = distributed.load_full_state_dict(model, state)  # into FSDP2 shards too
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected:
        raise UserError(
            f"the adapters in {adapter_dir} do not fit this model (missing {missing[:5]}, unexpected {unexpected[:5]}). "
            "Fix: resume with the model.path and model.target_modules the checkpoint was trained with."
        )


def setting_changes(cfg: Any, state: dict, world: int, train_prompts: int) -> list[str]:
    """Which settings differ from the checkpoint's, and what that does to the run."""
    problems = []
    changed = {k: (state["batch"].get(k), v) for k, v in batch_settings(cfg).items() if state["batch"].get(k) != v}
    if changed:
        keys = ", ".join(f"{_key(k)} {a} -> {b}" for k, (a, b) in changed.items())
        problems.append(
            f"batch settings differ from the checkpoint's ({keys}): the run continues at step {state['step']} with the "
            "new sizes, so it will not match an uninterrupted run. To continue the original run, set them back "
            "(e.g. " + " ".join(f"{_key(k)}={a}" for k, (a, _) in changed.items()) + ")."
        )
    if state.get("world_size", 1) != world:
        problems.append(
            f"the checkpoint was written by {state.get('world_size', 1)} rank(s), this run has {world}: RNG states "
            "per rank no longer line up, so the run will not match an uninterrupted one."
        )
    if "train_prompts" in state and (state["train_prompts"], state.get("data_seed")) != (train_prompts, cfg.data.seed):
        problems.append(
            f"the training data differ from the checkpoint's ({state['train_prompts']} prompts, data.seed "
            f"{state.get('data_seed')} -> {train_prompts} prompts, data.seed {cfg.data.seed}): "
            "the sampler keeps its epoch and position, but the prompt order is not the original one."
        )
    if state.get("total_steps") not in (None, cfg.train.total_steps) and cfg.train.lr_schedule != "constant":
        problems.append(
            f"train.total_steps changed ({state['total_steps']} -> {cfg.train.total_steps}) under a "
            f"{cfg.train.lr_schedule} LR schedule: from step {state['step']} on, the LR follows the new schedule."
        )
    if cfg.checkpoint.load_optimizer:
        old = state.get("optimizer", {})
        diffs = {k: (old[k], v) for k, v in optim_settings(cfg).items() if k in old and old[k] != v}
        if diffs:
            problems.append(
                "optimizer settings differ from the checkpoint's ("
                + ", ".join(f"train.{k} {a} -> {b}" for k, (a, b) in diffs.items())
                + "): the config's values apply from now on; the AdamW moments are kept."
            )
    return problems


def _key(name: str) -> str:
    return f"rollout.{name}" if name == "n_samples_per_prompt" else f"train.{name}"

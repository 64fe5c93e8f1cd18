"""Checkpoints: save, exact resume and export (user guide: docs/checkpoints.md).

    <checkpoint.dir>/
      latest_checkpointed_iteration.txt      "N"; edit it to resume from another iteration
      iter_0000010/
        model/                 Hugging Face format (config, generation config, safetensors, tokenizer); merged with LoRA
        adapter/               model.lora_rank > 0: the LoRA adapters (peft format), what resume loads
        optimizer/rank{r}.pt   AdamW state (moments, step counts, param-group hyperparameters)
        scheduler.pt           LR scheduler state
        rng_rank{r}.pt         python / numpy / torch (and CUDA) RNG states of rank r
        dataloader.pt          prompt sampler position (epoch, offset); dynamic sampling draws from it
        trainer_state.json     step, batch settings, optimizer hyperparameters, data size (written last)
        config.yaml            the resolved config of the run that wrote the checkpoint

Crash safety. A checkpoint is written into `.tmp_iter_N`, every file is fsynced, the directory is
renamed to `iter_N` (atomic), and only then is the tracker file replaced (atomically) to name it.
Resume reads only the tracker, so a crash at any moment leaves the previous checkpoint as the one
`resume: auto` picks up, and a half-written `.tmp_*` directory is never read (the next save removes
it). Rotation renames a checkpoint to `.del_iter_N` before deleting it, so a crash mid-delete never
leaves a half checkpoint under an `iter_*` name either.

What is saved is a state dict the trainer hands over (`Trainer.state_dict`: step, model, tokenizer,
the actor's optimizer and scheduler, the sampler, the RNG); `resume` hands back what was saved
(`Restored`) and the trainer puts it in place. This module imports nothing from the trainer.

Exact resume. Weights, AdamW state, the scheduler position, the sampler position and the RNG states
are restored, and the step counter continues, so the per-step generation seeds (`Experience._seed`)
line up. The rollout engines keep no RNG between calls (every generate call is seeded), and the
dynamic-sampling loop ends within its step (surplus groups are dropped, as verl does), so the
sampler position is its whole cross-step state. With `train.deterministic: true`, a resumed CPU run
equals an uninterrupted one bit for bit (tests/test_checkpoint.py).

Test-only hook: the environment variable POSTRL_TEST_CRASH_IN_SAVE=<step> makes `save` SIGKILL its
own process in the middle of writing the checkpoint of that step (after the weights and optimizer,
before the rest). It exists for the crash-safety test; never set it in a real run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from postrl import distributed, lora
from postrl.errors import UserError
from postrl.runtime import DTYPES

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
CRASH_ENV = "POSTRL_TEST_CRASH_IN_SAVE"  # test-only, see the module docstring
FORMAT_VERSION = 1


def iter_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def _iter_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith("iter_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def _complete_iters(root: Path) -> list[Path]:
    """The complete iter_* checkpoints under `root`, oldest first."""
    found = [(s, p) for p in root.glob("iter_*") if (s := _iter_step(p)) is not None and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


# --------------------------------------------------------------------------------- small pieces


def _batch_settings(cfg) -> dict:
    """Settings that decide what one step is; changing them on resume changes the run."""
    t = cfg.train
    return {
        "global_batch_size": t.global_batch_size,
        "gen_batch_size": t.gen_batch_size,
        "mini_batch_size": t.mini_batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "epochs_per_batch": t.epochs_per_batch,
    }


def _optim_settings(cfg) -> dict:
    t = cfg.train
    return {"lr": t.lr, "weight_decay": t.weight_decay, "betas": list(t.betas)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(d)
    _fsync_dir(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    """Delete a directory so that no reader ever sees it half-deleted under its own name."""
    if not path.exists():
        return
    trash = path.with_name(f".del_{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _test_crash_point(step: int) -> None:
    if os.environ.get(CRASH_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------- save


def save(cfg: Any, state: dict[str, Any]) -> Path:
    """`_save`, with a full disk reported as what it is: the previous checkpoint is untouched."""
    try:
        return _save(cfg, state)
    except Exception as exc:  # safetensors reports a full disk as its own error type, not OSError
        if not _disk_full(exc):
            raise
        root = Path(cfg.checkpoint.dir)
        shutil.rmtree(root / f".tmp_{iter_dir(root, state['step']).name}", ignore_errors=True)
        kept = _complete_iters(root)
        raise UserError(
            f"the disk holding {root} is full ({exc}) while writing the checkpoint of step {state['step']}; "
            f"the partial files were removed and the previous checkpoint ({kept[-1].name if kept else 'none yet'}) is "
            "intact. Fix: free space (or lower checkpoint.keep_last, or point checkpoint.dir at a larger disk), then "
            "run the same command again: checkpoint.resume: auto continues from the last complete checkpoint."
        ) from None


def _save_weights(cfg: Any, model: Any, tokenizer: Any, out: Path, write: bool) -> None:
    """out/model: the Hugging Face model (merged, with LoRA) and its tokenizer; with LoRA also out/adapter
    (peft's format). FSDP2: every rank gathers; only the rank with `write` touches the disk."""
    distributed.save_pretrained(model, out / "model", write=write)
    if write:
        tokenizer.save_pretrained(out / "model")
    if lora.is_lora(distributed.unwrap(model)):
        adapters = lora.adapter_state(distributed.full_state_dict(model, adapters_only=True))
        if write:
            lora.save_adapter(distributed.unwrap(model), adapters, out / lora.ADAPTER_DIR, cfg.model.path)


def _lora_settings(cfg: Any) -> dict | None:
    """What the trained parameters are: None for every weight, else the LoRA adapters' settings."""
    m = cfg.model
    return {"rank": m.lora_rank, "alpha": m.lora_alpha, "target_modules": m.target_modules} if m.lora_rank else None


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "StorageFull" in str(exc)


def _save(cfg: Any, state: dict[str, Any]) -> Path:
    """Write iter_<step> atomically, point the tracker at it, then rotate old checkpoints.

    `state` (from `Trainer.state_dict`): step, model, tokenizer, optimizer and scheduler (this
    rank's), sampler, rng, train_prompts. Every rank writes its own optimizer state and RNG; rank 0
    writes the rest and renames.
    """
    from postrl.config import dump_config

    step = state["step"]
    rank, world = distributed.rank(), distributed.world_size()
    root = Path(cfg.checkpoint.dir)
    final = iter_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "optimizer").mkdir(parents=True)
    distributed.barrier()

    _save_weights(cfg, state["model"], state["tokenizer"], tmp, write=rank == 0)
    torch.save(state["optimizer"], tmp / "optimizer" / f"rank{rank}.pt")
    if "critic" in state:  # PPO's value model: critic/model (HF format), its optimizer per rank, its scheduler
        _save_critic(state["critic"], tmp / "critic", rank)
    _test_crash_point(step)
    torch.save(state["rng"], tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(state["scheduler"], tmp / "scheduler.pt")
        torch.save({"sampler": state["sampler"]}, tmp / "dataloader.pt")
        (tmp / "config.yaml").write_text(dump_config(cfg))
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "algorithm": cfg.algorithm.name,
            "world_size": world,
            "batch": _batch_settings(cfg),
            "optimizer": _optim_settings(cfg),
            "total_steps": cfg.train.total_steps,
            "train_prompts": state["train_prompts"],
            "data_seed": cfg.data.seed,
            "model_path": cfg.model.path,
            "lora": _lora_settings(cfg),
        }
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2))
    distributed.barrier()  # every rank's files are in place

    if rank == 0:
        _fsync_tree(tmp)
        old = root / f".old_{final.name}"
        if final.exists():  # re-saving a step (e.g. after going back to an earlier iteration)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / TRACKER, f"{step}\n")
        shutil.rmtree(old, ignore_errors=True)
        _rotate(root, cfg.checkpoint.keep_last, current=step)
        _clean_leftovers(root)
    distributed.barrier()
    return final


def _save_critic(critic: dict[str, Any], out: Path, rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    distributed.save_pretrained(critic["model"], out / "model", write=rank == 0)
    torch.save(critic["optimizer"], out / f"optimizer_rank{rank}.pt")
    if rank == 0:
        torch.save(critic["scheduler"], out / "scheduler.pt")


def _rotate(root: Path, keep_last: int, current: int) -> None:
    """Keep the newest `keep_last` checkpoints up to the current step; 0 keeps all.

    Checkpoints past the current step belong to an abandoned run (the tracker was edited to go back);
    they are left alone until this run reaches their step and overwrites them.
    """
    if keep_last <= 0:
        return
    done = [p for p in _complete_iters(root) if (_iter_step(p) or 0) <= current]
    for old in done[:-keep_last]:
        _remove(old)


def _clean_leftovers(root: Path) -> None:
    """Remove what crashed saves and deletes left behind (never read by resume)."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((".tmp_iter_", ".del_iter_", ".old_iter_")):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------- resume


def _read_tracker(root: Path) -> int:
    tracker = root / TRACKER
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise UserError(
            f"{tracker} holds '{text}', not an iteration number. "
            "Fix: write the step of an existing iter_* directory into it (e.g. 10 for iter_0000010)."
        )
    return int(text)


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
        found = _complete_iters(root) if root.is_dir() else []
        if found:
            raise UserError(
                f"checkpoint.dir '{root}' holds checkpoints ({', '.join(p.name for p in found)}) but no {TRACKER}, "
                "so it is unclear which one to resume from, and a fresh run would overwrite them. Fix: write the "
                f"step to resume from into {root / TRACKER}, or set checkpoint.resume=none to start over "
                "(or point checkpoint.dir elsewhere)."
            )
        return None
    step = _read_tracker(root)
    path = iter_dir(root, step)
    if (path / STATE_FILE).is_file():
        return path
    old = root / f".old_{path.name}"  # a crash between the two renames of a re-save
    if (old / STATE_FILE).is_file():
        return old
    found = _complete_iters(root)
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
        state.update(_read(f, lambda p: load_file(str(p))))
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

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


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
        if ck.resume == "none" and root.is_dir() and _complete_iters(root):
            log(
                f"[yellow]note: checkpoint.resume is 'none' but {root} holds checkpoints; this run starts at step 0 "
                "and will overwrite them when it reaches their steps.[/yellow]"
            )
        return None
    if ck.finetune:
        return Restored(path=path, finetune=True)

    meta = json.loads((path / STATE_FILE).read_text())
    _check_trained_parameters(cfg, meta, path)
    for problem in _changes(cfg, meta, world, train_prompts):
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
        restored.optimizer = _read(opt_file, _torch_load)
        restored.scheduler = _read(path / "scheduler.pt", _torch_load)
        if (path / "critic" / f"optimizer_rank{rank}.pt").exists():
            restored.critic_optimizer = _read(path / "critic" / f"optimizer_rank{rank}.pt", _torch_load)
            restored.critic_scheduler = _read(path / "critic" / "scheduler.pt", _torch_load)
    rng_file = path / f"rng_rank{rank}.pt"
    if ck.load_rng and rng_file.exists():
        restored.rng = _read(rng_file, _torch_load)
    elif ck.load_rng:
        log(f"[yellow]warning: {path} has no RNG state for rank {rank}; keeping the RNG seeded from train.seed.[/yellow]")
    restored.sampler = _read(path / "dataloader.pt", _torch_load)["sampler"]

    later = [p.name for p in _complete_iters(path.parent) if (_iter_step(p) or -1) > restored.step]
    if later:
        log(
            f"[yellow]note: resuming from step {restored.step} although {', '.join(later)} exist(s); this run will "
            "overwrite them when it reaches their steps.[/yellow]"
        )
    return restored


def _check_trained_parameters(cfg: Any, meta: dict, path: Path) -> None:
    """A resume continues the same parameters: LoRA adapters of the same shape, or every weight."""
    then, now = meta.get("lora"), _lora_settings(cfg)
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


def load_adapter(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Copy a checkpoint's LoRA adapters (adapter/) into `model` in place; its base is model.path's."""
    state = _read(Path(adapter_dir) / "adapter_model.safetensors", lora.read_adapter)
    missing, unexpected = distributed.load_full_state_dict(model, state)  # into FSDP2 shards too
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected:
        raise UserError(
            f"the adapters in {adapter_dir} do not fit this model (missing {missing[:5]}, unexpected {unexpected[:5]}). "
            "Fix: resume with the model.path and model.target_modules the checkpoint was trained with."
        )


def _torch_load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _read(path: Path, load) -> Any:
    """`load(path)`, with a truncated or garbage file reported by name and with the way back."""
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - torch / safetensors / pickle each raise their own types
        ckpt = next((p for p in [path, *path.parents] if _iter_step(p) is not None), None)
        if ckpt is None:  # a model directory, not a checkpoint
            raise UserError(
                f"{path} is damaged and cannot be read ({type(exc).__name__}: {exc}). "
                "Fix: restore the file from its source (re-export or re-download the model)."
            ) from None
        earlier = [p.name for p in _complete_iters(ckpt.parent) if (_iter_step(p) or 0) < (_iter_step(ckpt) or 0)]
        way_back = (
            f"the earlier checkpoint {earlier[-1]} is intact: write {_iter_step(ckpt.parent / earlier[-1])} into "
            f"{ckpt.parent / TRACKER} and run the same command again to resume from it"
            if earlier
            else "no earlier checkpoint exists: set checkpoint.resume=none to start over (or restore the file)"
        )
        raise UserError(
            f"{path} is damaged and cannot be read ({type(exc).__name__}: {str(exc)[:200]}), so checkpoint {ckpt.name} "
            f"cannot be resumed from. Fix: {way_back}."
        ) from None


def _changes(cfg: Any, state: dict, world: int, train_prompts: int) -> list[str]:
    """Which settings differ from the checkpoint's, and what that does to the run."""
    problems = []
    changed = {k: (state["batch"].get(k), v) for k, v in _batch_settings(cfg).items() if state["batch"].get(k) != v}
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
        diffs = {k: (old[k], v) for k, v in _optim_settings(cfg).items() if k in old and old[k] != v}
        if diffs:
            problems.append(
                "optimizer settings differ from the checkpoint's ("
                + ", ".join(f"train.{k} {a} -> {b}" for k, (a, b) in diffs.items())
                + "): the config's values apply from now on; the AdamW moments are kept."
            )
    return problems


def _key(name: str) -> str:
    return f"rollout.{name}" if name == "n_samples_per_prompt" else f"train.{name}"


# --------------------------------------------------------------------------------------- export


def resolve_model_dir(path: str | Path) -> Path:
    """A Hugging Face model directory from a model directory, an iter_* checkpoint or a checkpoint root."""
    p = Path(path).expanduser()
    if (p / TRACKER).exists():
        step = _read_tracker(p)
        p = iter_dir(p, step)
    if (p / "model" / "config.json").exists():
        p = p / "model"
    if not (p / "config.json").exists():
        raise UserError(
            f"'{path}' is not a model directory or a postrl checkpoint (no config.json, no model/config.json, no "
            f"{TRACKER}). Fix: pass a checkpoint directory, one of its iter_* directories, or a model directory."
        )
    return p


def export(checkpoint: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """Copy a checkpoint's model/ (the tracker's iteration, given a checkpoint root) to a plain HF directory.

    The result loads with AutoModelForCausalLM.from_pretrained / AutoTokenizer and with vllm.LLM.
    The copy is made in a temporary directory and renamed, so `out` is either complete or absent.
    Checkpoints hold the fp32 master weights; `dtype` casts the floating weights of the copy:
    `auto` to the run's model.dtype (the iteration's config.yaml), so a bf16 run exports bf16 like
    the published Qwen weights and verl's model merger, while a float32 run (and a directory without
    a run config) is copied as it is; or float32 / bfloat16 / float16 by name.
    """
    src = resolve_model_dir(checkpoint)
    _verify_model_dir(src)
    if dtype == "auto":
        run_config = src.parent / "config.yaml"
        run = _read(run_config, lambda p: yaml.safe_load(p.read_text())) if run_config.exists() else {}
        dtype = (run.get("model") or {}).get("dtype")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export target '{out}' exists and is not empty. Fix: choose a new directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if dtype is not None:
        _cast_model_dir(tmp, dtype)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def model_dtype(model_dir: Path) -> str:
    """The dtype config.json records for the weights of `model_dir`."""
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _cast_model_dir(model_dir: Path, dtype: str) -> None:
    """Cast the floating tensors of every safetensors file in `model_dir` to `dtype` (files already in
    it are left untouched) and record it in config.json (and its sub-configs: a VLM's text config)."""
    from safetensors.torch import load_file, save_file

    target = DTYPES[dtype]
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        if any(t.is_floating_point() and t.dtype != target for t in tensors.values()):
            tensors = {k: t.to(target) if t.is_floating_point() else t for k, t in tensors.items()}
            save_file(tensors, str(f), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(meta, indent=2))
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    before = json.dumps(config)
    for c in [config, *(v for v in config.values() if isinstance(v, dict) and "model_type" in v)]:
        keys = [k for k in ("dtype", "torch_dtype") if k in c] or ["dtype"]
        c.update(dict.fromkeys(keys, dtype))
    if json.dumps(config) != before:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _verify_model_dir(model_dir: Path) -> None:
    """Every weight file of `model_dir` reads back whole and config.json parses (a UserError otherwise)."""
    from safetensors.torch import load_file

    _read(model_dir / "config.json", lambda p: json.loads(p.read_text()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} holds no *.safetensors weights, so there is nothing to export. Fix: export a checkpoint written by postrl.")
    for f in files:
        _read(f, lambda p: load_file(str(p)))


# --------------------------------------------------------------------------------- best weights

BEST = "best"


def best_so_far(cfg: Any) -> dict | None:
    """{"step", "metric", "value"} of the weights in <checkpoint.dir>/best, or None."""
    info = Path(cfg.checkpoint.dir) / BEST / "best.json"
    return json.loads(info.read_text()) if info.is_file() else None


def save_best(cfg: Any, model: Any, tokenizer: Any, step: int, value: float, metric: str) -> Path:
    """Replace <checkpoint.dir>/best with these weights (a Hugging Face model dir in best/model) and the
    run's config.yaml beside them (export reads its model.dtype)."""
    from postrl.config import dump_config

    root = Path(cfg.checkpoint.dir)
    final, tmp = root / BEST, root / f".tmp_{BEST}"
    write = distributed.rank() == 0
    if write:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    _save_weights(cfg, model, tokenizer, tmp, write)
    if write:
        (tmp / "best.json").write_text(json.dumps({"step": step, "metric": metric, "value": value}))
        (tmp / "config.yaml").write_text(dump_config(cfg))
        _fsync_tree(tmp)
        _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    distributed.barrier()
    return final


# ------------------------------------------------------------------------------ the run directory


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


def describe(path: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint (for tools and tests)."""
    return json.loads((Path(path) / STATE_FILE).read_text())

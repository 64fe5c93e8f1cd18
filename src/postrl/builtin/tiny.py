"""The built-in tiny models: `builtin:tiny-qwen2` (text), `builtin:tiny-qwen2-tools` (text with tool calls)
and `builtin:tiny-qwen2.5-vl` (vision-language).

Both are random-initialised from a seed, with a byte-level BPE tokenizer (digits split one by one,
as Qwen's are) trained on the built-in tasks' text and a ChatML chat template, built locally and
cached under <cache>/models/<name>-<key of the spec>; `model.tiny` overrides the spec.

- tiny-qwen2: a Qwen2 causal LM (4 layers, hidden 128), tokenizer trained on the arithmetic task.
- tiny-qwen3-moe: a Qwen3-MoE causal LM (2 layers, hidden 128, 8 experts of width 64, 2 per token), the
  tiny-qwen2 tokenizer: the mixture-of-experts path (router, expert weights, vLLM's fused MoE) on CPU.
- tiny-qwen2-tools: the same Qwen2 with Qwen2.5's tool tokens (<tool_call>, </tool_call>, <tool_response>,
  </tool_response>) and a ChatML template with `tools=` and `role: tool` in Qwen2.5's shape (a short tool
  list instead of the JSON schemas: prompts of the tiny model stay short); tokenizer trained on the
  arithmetic and tool-arithmetic tasks (docs/agents.md).
- tiny-qwen2.5-vl: a Qwen2.5-VL (a 2-block vision tower and a 4-layer language model, about 1.1M
  parameters) plus the PIL image processor, tokenizer trained on the shapes and arithmetic tasks
  with the Qwen vision special tokens, and a template that renders {"type": "image"} parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from postrl.builtin import arithmetic, cache, shapes, tool_arithmetic
from postrl.errors import UserError
from postrl.utils import cache_dir, publish_dir, scratch_path

if TYPE_CHECKING:
    import torch  # imported where a model is built: check-config names the built-in models without it

TINY_VERSION = 2  # tiny-qwen2; bump when the architecture or the tokenizer corpus changes (invalidates the cache)
TINY_VL_VERSION = 3  # tiny-qwen2.5-vl; same rule
TINY_TOOLS_VERSION = 1  # tiny-qwen2-tools; same rule
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
    max_position_embeddings=512, seed=0,
)
TINY_MOE_VERSION = 1  # tiny-qwen3-moe; same rule
TINY_MOE_DEFAULTS: dict[str, Any] = dict(
    {k: v for k, v in TINY_DEFAULTS.items() if k not in ("num_layers", "seed")},
    num_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    router_aux_loss_coef=0.001,  # Qwen3-MoE's published value
    seed=0,
)
TINY_VL_DEFAULTS: dict[str, Any] = dict(  # in the order of postrl_tiny.json of cached builds
    {k: v for k, v in TINY_DEFAULTS.items() if k != "seed"},
    max_position_embeddings=1024,
    vision_depth=2, vision_hidden_size=64, vision_heads=4, vision_intermediate_size=128,
    min_pixels=56 * 56, max_pixels=112 * 112, seed=0,
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with Qwen2-VL's content lists: {"type": "image"} renders as one vision block. No default
# system prompt (prompts of the tiny model stay short); real models bring their own template.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2.5's tool format (Hermes): an assistant turn's calls as <tool_call>{"name", "arguments"}</tool_call>,
# consecutive tool messages in one user turn, each in <tool_response>; with `tools`, a system turn that
# names them. The tool list names the tools only: the tiny model learns their use from SFT traces.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools: {% for tool in tools %}{{ (tool['function'] or tool)['name'] }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ message['content'] }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    "<tool_call>{\"name\": \"{{ f['name'] }}\", \"arguments\": {{ f['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _arithmetic_corpus(seed: int) -> list[str]:
    return arithmetic.tokenizer_corpus(seed=seed)


@dataclass(frozen=True)
class TinyKind:
    """What differs between the tiny models; everything else (tokenizer training, caching) is shared."""

    version: int
    defaults: dict[str, Any]
    build: Callable[[dict, Any], tuple[torch.nn.Module, list[Any]]]  # (spec, tokenizer) -> model, extra savers
    corpus: Callable[[int], list[str]] = _arithmetic_corpus  # seed -> tokenizer training text
    extra_tokens: Sequence[str] = ()  # special tokens after SPECIAL_TOKENS
    chat_template: str = CHATML_TEMPLATE
    done_file: str = "tokenizer.json"  # present once a (cached) build is complete

    @property
    def special_tokens(self) -> list[str]:
        return SPECIAL_TOKENS + list(self.extra_tokens)


def _language_model(spec: dict, tokenizer: Any) -> dict[str, Any]:
    """The Qwen2 language-model settings of a spec (the text config of both tiny models)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _qwen2(spec: dict, tokenizer: Any) -> tuple[torch.nn.Module, list[Any]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_language_model(spec, tokenizer))
    torch.manual_seed(spec["seed"])
    return Qwen2ForCausalLM(config), []


def _qwen3_moe(spec: dict, tokenizer: Any) -> tuple[torch.nn.Module, list[Any]]:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_language_model(spec, tokenizer),
        head_dim=spec["hidden_size"] // spec["num_heads"],
        num_experts=spec["num_experts"],
        num_experts_per_tok=spec["num_experts_per_tok"],
        moe_intermediate_size=spec["moe_intermediate_size"],
        router_aux_loss_coef=spec["router_aux_loss_coef"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )
    torch.manual_seed(spec["seed"])
    return Qwen3MoeForCausalLM(config), []


def _qwen2_5_vl(spec: dict, tokenizer: Any) -> tuple[torch.nn.Module, list[Any]]:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    head_dim = spec["hidden_size"] // spec["num_heads"]
    half = head_dim // 2  # mRoPE splits the rotary half-dimensions into (time, height, width)
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16 -> [4, 6, 6] as Qwen's [16, 24, 24]
    tid = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **_language_model(spec, tokenizer),
            rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0},
        ),
        vision_config=dict(
            depth=spec["vision_depth"],
            hidden_size=spec["vision_hidden_size"],
            intermediate_size=spec["vision_intermediate_size"],
            num_heads=spec["vision_heads"],
            out_hidden_size=spec["hidden_size"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[spec["vision_depth"] - 1],
        ),
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec["seed"])
    model = Qwen2_5_VLForConditionalGeneration(config)
    return model, [Qwen2VLImageProcessorPil(min_pixels=spec["min_pixels"], max_pixels=spec["max_pixels"])]


TINY_MODELS: dict[str, TinyKind] = {
    "tiny-qwen2": TinyKind(TINY_VERSION, TINY_DEFAULTS, _qwen2),
    "tiny-qwen3-moe": TinyKind(TINY_MOE_VERSION, TINY_MOE_DEFAULTS, _qwen3_moe),
    "tiny-qwen2-tools": TinyKind(
        TINY_TOOLS_VERSION, TINY_DEFAULTS, _qwen2,
        corpus=lambda seed: arithmetic.tokenizer_corpus(n=1000, seed=seed) + tool_arithmetic.tokenizer_corpus(seed=seed),
        extra_tokens=TOOL_TOKENS, chat_template=TOOLS_CHAT_TEMPLATE,
    ),
    "tiny-qwen2.5-vl": TinyKind(
        TINY_VL_VERSION, TINY_VL_DEFAULTS, _qwen2_5_vl,
        corpus=lambda seed: shapes.tokenizer_corpus(seed=seed) + arithmetic.tokenizer_corpus(n=1000, seed=seed),
        extra_tokens=VISION_TOKENS, chat_template=VL_CHAT_TEMPLATE, done_file="preprocessor_config.json",
    ),
}  # fmt: skip


def builtin_names() -> list[str]:
    """Every 'builtin:<name>' model: the tiny ones and the pretrained ones (postrl.builtin.pretrained)."""
    from postrl.builtin.pretrained import PRETRAINED

    return [*TINY_MODELS, *PRETRAINED]


def unknown_builtin(name: str) -> str:
    """The error for a 'builtin:<name>' model path that names no built-in model."""
    return (
        f"model.path: 'builtin:{name}' is not a built-in model. Fix: use one of "
        + ", ".join(f"'builtin:{n}'" for n in builtin_names())
        + ", or a Hugging Face model directory, hub id or .gguf file."
    )


def train_tokenizer(vocab_size: int, special_tokens: list[str], chat_template: str, corpus: list[str]):
    """A byte-level BPE tokenizer with single-digit tokens, EOS <|im_end|> and pad <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=4096,
        padding_side="left",
    )


def build_tiny_model(name: str = "tiny-qwen2", out_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Build (or reuse from the cache) the tiny model `name` with its tokenizer; returns its directory."""
    from transformers import GenerationConfig

    kind = TINY_MODELS.get(name)
    if kind is None:
        raise UserError(unknown_builtin(name))
    unknown = set(overrides) - set(kind.defaults)
    if unknown:
        raise UserError(
            f"model.tiny has unknown keys {sorted(unknown)} for builtin:{name}; valid: {', '.join(kind.defaults)}."
        )
    spec = {**kind.defaults, **overrides, "version": kind.version}
    out = Path(out_dir) if out_dir else cache_dir() / "models" / f"{name}-{cache.spec_key(spec)}"
    def done(path: Path) -> bool:
        return (path / "config.json").exists() and (path / kind.done_file).exists()

    if done(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_path(out)
    tokenizer = train_tokenizer(spec["vocab_size"], kind.special_tokens, kind.chat_template, kind.corpus(spec["seed"]))
    model, savers = kind.build(spec, tokenizer)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    # Once torch.distributed is up, transformers writes a model's files on rank 0 only; a cache build is each
    # process's own (every rank that finds the cache cold builds), so this rank writes the whole model.
    model.should_save_on_this_rank = lambda is_main_process: True
    for part in (model, tokenizer, *savers):
        part.save_pretrained(tmp)
    (tmp / "postrl_tiny.json").write_text(json.dumps(spec, indent=2))
    if not (done(tmp) and (tmp / "model.safetensors").is_file()):  # never publish a build that is not whole
        raise RuntimeError(f"building builtin:{name} left an incomplete model in {tmp}: {sorted(p.name for p in tmp.iterdir())}")
    return publish_dir(tmp, out, done)  # a racing builder that published first wins; its build is reused

"""Models: load the policy (model, tokenizer, modality adapter), pack sequences, per-token log-probs.

Any Hugging Face causal LM directory or hub id loads the same way (a real Qwen2.5 config included);
a model with a vision tower loads through its modality adapter (`postrl.modality`), chosen once from
config.json. 'builtin:<name>' paths are the demos' tiny models (`postrl.builtin.tiny`) and the pretrained
built-ins; a '.gguf' path is dequantized once into a cached model directory (`postrl.builtin.pretrained`).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from postrl import lora
from postrl.errors import UserError
from postrl.modality import TEXT, Modality, load_modality, modality_type
from postrl.runtime import DTYPES, accelerator


def resolve_model_path(path: str, tiny: dict | None = None) -> str:
    """`path` itself, or the (cached) model directory of a 'builtin:<name>' or of a '.gguf' file."""
    from postrl.builtin import pretrained

    if path.startswith("builtin:"):
        from postrl.builtin.tiny import build_tiny_model

        name = path.split(":", 1)[1]
        return str(pretrained.builtin_dir(name) if name in pretrained.PRETRAINED else build_tiny_model(name, **(tiny or {})))
    if path.endswith(".gguf"):
        return str(pretrained.gguf_dir(path))
    return path


# ----------------------------------------------------------------------------------------- loading


def model_config(path: str) -> dict:
    """config.json of a model directory or hub id ({} when there is none)."""
    local = Path(path) / "config.json"
    try:
        if local.is_file():
            return json.loads(local.read_text())
        if Path(path).exists():
            return {}
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path).to_dict()  # hub id (downloaded once, then cached)
    except (OSError, ValueError):
        return {}


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str | None = None):
    """The tokenizer of `path`, left-padding, with a pad token (EOS when it has none); the policy's and
    `postrl preprocess`'s. `key`: the config key that named `path`, for the fix of an error (default the policy's)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(path).expanduser()), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers, tokenizers and sentencepiece each raise their own types
        raise UserError(
            f"cannot load a tokenizer from '{path}' ({type(exc).__name__}: {exc}). The directory needs tokenizer.json "
            + (f"or tokenizer_config.json. Fix: point {key} at a full model directory (tokenizer files included)." if key else
               "or tokenizer_config.json. Fix: point model.tokenizer_path (`postrl preprocess`: tokenizer_name_or_path) "
               "at a directory that has them, or model.path at a full model directory.")
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    path: str,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    modality: Modality | None = None,
    attn_implementation: str | None = None,
    key: str = "model.path",
):
    """The model of `path`, with the auto class of its modality (chosen from its config.json when not given),
    and the attention kernels of `attn_implementation` (a name transformers accepts; None: its default)."""
    from safetensors import SafetensorError

    loader = modality or modality_type(model_config(path))
    try:
        model = loader.load_model(path, DTYPES[dtype], trust_remote_code, attn_implementation)
    except ImportError as exc:  # transformers' answer to flash attention or a hub kernel it cannot import
        if attn_implementation in (None, "sdpa", "eager"):
            raise
        raise UserError(
            f"model.attn_implementation '{attn_implementation}' cannot be used on this machine ({exc}). Fix: install "
            "what it needs (flash_attention_2: `pip install flash-attn --no-build-isolation` on a CUDA machine), "
            "or set model.attn_implementation: auto (flash attention where installed, else sdpa)."
        ) from None
    except SafetensorError as exc:  # a truncated or garbage weight file
        raise UserError(
            f"a weight file of '{path}' is damaged and cannot be read ({exc}). Fix: restore the model directory "
            "from its source (re-export the checkpoint with `postrl export`, or copy / download the model again)."
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a causal LM from '{path}' ({exc}). Fix: point {key} at a Hugging Face model "
            "directory (config.json + weights), e.g. the output of `postrl sft` or `postrl export`."
        ) from None
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its floating parameters in `dtype` and its buffers as they are.

    This is how from_pretrained(dtype=bf16) loads a model: RoPE's inverse frequencies stay fp32.
    `model.to(bf16)` would round them to 8 significant bits, a relative error of up to 2^-9, so
    position p would rotate by an angle up to p / 512 radians off: past a few hundred tokens, a
    reference model would score every token as if it sat elsewhere.
    """
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


@dataclass
class Policy:
    """The model being trained, its tokenizer, where it was loaded from, and its modality adapter."""

    model: Any
    tokenizer: Any
    path: str  # resolved: a builtin: name becomes its built directory
    modality: Modality


def attention_implementation(requested: str, device: torch.device, compute_dtype: str) -> str:
    """model.attn_implementation with `auto` decided: flash_attention_2 for bf16 / fp16 compute on a device
    the flash-attn kernels run on (CUDA: `Accelerator.flash_attn`) where the flash-attn package is installed
    (verl's choice: varlen kernels, and packed rows need no mask), else sdpa (flash kernels take no fp32)."""
    if requested != "auto":
        return requested
    half = compute_dtype != "float32"
    if half and accelerator(device.type).flash_attn and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_policy(model_cfg, dtype: str | None = None, device: torch.device | None = None) -> Policy:
    """The policy of a `ModelConfig` for `device` (None: the CPU); its modality adapter is chosen once,
    here, from config.json.

    `dtype` overrides `model.dtype` as the parameter dtype: a model that trains loads in float32 (its
    master weights, runtime.py) and computes in model.dtype under autocast / FSDP2 mixed precision.
    With model.lora_rank the base loads in model.dtype (frozen) and only its fp32 adapters train (lora.py).
    """
    path = resolve_model_path(model_cfg.path, model_cfg.tiny)
    processor_path = model_cfg.tokenizer_path or path
    modality = load_modality(model_config(path), processor_path, model_cfg.trust_remote_code)
    tokenizer = modality.prepare_tokenizer(load_tokenizer(processor_path, model_cfg.trust_remote_code), processor_path)
    attn = attention_implementation(model_cfg.attn_implementation, device or torch.device("cpu"), model_cfg.dtype)
    m = model_cfg
    base_dtype = m.dtype if m.lora_rank else (dtype or m.dtype)  # a LoRA base is frozen: no fp32 master copy
    model = load_model(path, base_dtype, m.trust_remote_code, m.gradient_checkpointing, modality, attn)
    if m.lora_rank:
        tower = modality.vision_tower(model) if m.freeze_vision_tower else None
        lora.apply(model, m.lora_rank, m.lora_alpha, m.target_modules, exclude=lora.exclude_pattern(model, tower))
        if m.gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    if m.freeze_vision_tower:
        modality.freeze_vision_tower(model)  # no-op for text-only models
    return Policy(model=model, tokenizer=tokenizer, path=path, modality=modality)


# --------------------------------------------------------------------------------------- log-probs


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: input_ids and attention_mask [B, P]."""
    P = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1
    return input_ids, attention_mask


def build_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, loss_masks: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """Pack prompt+response pairs: prompts left-padded to P, responses right-padded to T.

    Returns input_ids/attention_mask/position_ids [B, P+T] and response_mask [B, T]. The attention
    mask covers every real token; `response_mask` is the loss mask, 1 only where the policy sampled
    the token: each row's `loss_masks` entry (one per response token; None: all real tokens), so a
    trajectory's tool results are attended to but not trained on. The real extent of a response is
    the attention mask's, never the loss mask's (which has zeros inside a multi-turn response).
    """
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, P]
    T = max(max(len(r) for r in responses), 1)
    response_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    real_BT = torch.zeros((len(prompts), T), dtype=torch.long)
    response_mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, r in enumerate(responses):
        if r:
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            real_BT[i, : len(r)] = 1
            if loss_masks is None:
                response_mask[i, : len(r)] = 1
            else:
                assert len(loss_masks[i]) == len(r), f"row {i}: {len(loss_masks[i])} loss-mask entries for {len(r)} tokens"
                response_mask[i, : len(r)] = torch.tensor(loss_masks[i], dtype=torch.long)
    attention_mask = torch.cat([prompt_mask, real_BT], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }


LOGPROB_CHUNK_TOKENS = 1024  # default of train.logprob_chunk_tokens: fp32 log-softmax rows at a time


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    multi_modal: list[dict | None] | None = None,
    modality: Modality | None = None,
    remove_padding: bool = False,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    sp_group: Any = None,
    logits_fn: Callable | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs [B, T] of the last `response_len` tokens under softmax(logits / temperature), and entropy.

    Inputs are padded rows (prompts left-padded, responses right-padded; `build_sequences`). One
    forward yields both; only the logits of positions that predict a response token are computed
    (`logits_to_keep`), and the log-softmax runs over them in fp32 chunks of `chunk_tokens`
    (`algorithms.token_logprobs`), so [B, T, V] never exists in fp32. Values at padded response
    positions mean nothing (0 with `remove_padding`): callers mask them.

    `remove_padding` (train.use_remove_padding) runs the forward on the sequences packed without
    padding (`_packed_forward`); the result is the same up to float rounding. `multi_modal` holds
    each sequence's image inputs (VLMs), turned into forward arguments by `modality` (None: text);
    with images the model computes its own (mRoPE) positions, and rows stay padded.

    `sp_group` (train.sequence_parallel_size > 1): the rows' columns are split over that group's ranks
    (Ulysses, `_sequence_parallel_forward`); every rank of the group gets the whole [B, T] result.

    `logits_fn(logits_MV, b_M, k_M) -> [M, K]` (on-policy distillation's top-k, `postrl.distill`): applied to the
    logits of the positions predicting response token k_M of row b_M; its result comes back as a third
    output [B, T, K] (not with sequence parallelism).
    """
    from postrl.algorithms import token_logprobs

    T = response_len
    B, L = input_ids.shape
    if sp_group is not None:
        assert logits_fn is None, "logits_fn does not run under sequence parallelism (the config refuses it)"
        images = multi_modal is not None and any(multi_modal)
        return _sequence_parallel_forward(
            model, input_ids, attention_mask, position_ids, T, temperature, with_entropy, remove_padding and not images, chunk_tokens,
            sp_group, (multi_modal, modality or TEXT) if images else None,
        )  # fmt: skip
    if remove_padding and multi_modal is None:
        return _packed_forward(model, input_ids, attention_mask, T, temperature, with_entropy, chunk_tokens, logits_fn)
    mm = (modality or TEXT).forward_kwargs(model, input_ids, multi_modal) if multi_modal is not None else {}
    keep = torch.arange(L - T - 1, L - 1, device=input_ids.device)  # position t predicts token t + 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=None if mm else position_ids,
        logits_to_keep=keep,
        use_cache=False,
        **mm,
    )
    logits_NV = out.logits.view(B * T, -1)  # [B, T, V], contiguous: no copy
    logp_N, entropy_N = token_logprobs(logits_NV, input_ids[:, -T:].reshape(-1), temperature, chunk_tokens, with_entropy)
    result = (logp_N.view(B, T), entropy_N.view(B, T) if with_entropy else None)
    if logits_fn is None:
        return result
    rows, cols = torch.arange(B, device=logits_NV.device), torch.arange(T, device=logits_NV.device)
    b_N, k_N = (x.reshape(-1) for x in torch.meshgrid(rows, cols, indexing="ij"))  # row-major, as logits_NV
    return *result, logits_fn(logits_NV, b_N, k_N).view(B, T, -1)


def _sequence_parallel_forward(
    model, input_ids, attention_mask, position_ids, T, temperature, with_entropy, remove_padding, chunk_tokens, group, images=None
):
    """`response_logprobs` with each row's columns split over `group` (postrl.sequence_parallel.score).

    Padded rows: the full rows, masked causally, within segments and off padding (`full_mask`). With
    `remove_padding` the rows are packed as the sdpa path packs them (a group's prompt once, `_pack`) under
    the same shared-prompt mask, and the packed row is what the ranks split. `images` ((multi_modal,
    modality) of a batch with images): padded rows, widened at the end to a multiple of the group size, so
    that the image inputs (mRoPE positions over the whole rows) are built for the very columns the ranks split.
    """
    from postrl import sequence_parallel as sp

    B, L = input_ids.shape
    image_kwargs = None
    if images is not None:
        input_ids, attention_mask, position_ids, image_kwargs = sp.widen_for_images(model, input_ids, attention_mask, position_ids, images, group)
    if remove_padding:
        p = _pack(input_ids, attention_mask, T, varlen=False)
        mask = _shared_prompt_mask(p, "sdpa", model)
        ids, pos, r_M, c_M, b_M, k_M = p.ids_RC, p.pos_RC, p.r_M, p.pred_M, p.b_M, p.k_M
        targets_M = ids[r_M, p.c_M]
    else:
        ids, pos, mask = input_ids, position_ids, sp.full_mask(attention_mask, position_ids)
        rows, cols = torch.arange(B, device=ids.device), torch.arange(T, device=ids.device)
        b_M, k_M = (x.reshape(-1) for x in torch.meshgrid(rows, cols, indexing="ij"))
        r_M, c_M = b_M, L - T - 1 + k_M  # position t predicts token t + 1
        targets_M = ids[b_M, c_M + 1]
    logp_M, entropy_M = sp.score(model, ids, pos, mask, r_M, c_M, targets_M, group, temperature, with_entropy, chunk_tokens, image_kwargs)
    zeros_BT = torch.zeros((B, T), dtype=torch.float32, device=ids.device)
    logp_BT = zeros_BT.index_put((b_M, k_M), logp_M)
    return logp_BT, zeros_BT.index_put((b_M, k_M), entropy_M) if with_entropy else None


PACK_ROW_FACTOR = 4  # sdpa / eager: a shared-prompt unit holds up to this many times the longest sequence ...
PACK_ROW_TOKENS = 4096  # ... but no more than this (or the longest sequence, when that is longer)


def _packed_forward(model, input_ids, attention_mask, T, temperature, with_entropy, chunk_tokens, logits_fn=None):
    """`response_logprobs` with the micro-batch packed into rows without padding.

    Flash attention (transformers' supported path for packed sequences): every sequence goes whole into
    one row, position ids restart at 0 per sequence and there is no attention mask; transformers turns
    the position ids into variable-length kernel boundaries, so no token attends across sequences.

    sdpa / eager: consecutive samples of the same prompt (a GRPO group) share one copy of it: a row holds
    units `prompt, response_1, ..., response_k`, each response positioned right after the prompt (position
    ids P, P+1, ...) and allowed to attend the prompt and its own earlier tokens only (a 4D mask built
    here; transformers' own packed-sequence mask cannot express a shared prefix). The log-probs are those
    of k separate sequences, while the prompt is computed once instead of k times: with G samples of
    prompt length P and response length R, G (P + R) tokens become P + G R. These kernels compute every
    query-key pair of a row, so rows are kept short: a unit holds up to PACK_ROW_FACTOR times the longest
    sequence and PACK_ROW_TOKENS (`partition.share_prompts`; a longer group is split into units with their
    own prompt copy), and units are packed first-fit decreasing into rows as wide as the widest unit
    (`partition.pack_sequences`).
    """
    attn = getattr(_config(model), "_attn_implementation", None) or "sdpa"
    packed = _pack(input_ids, attention_mask, T, varlen=_varlen_attention(attn))
    mask = None if packed.varlen else _shared_prompt_mask(packed, attn, model)
    return _score_packed(model, packed, mask, input_ids.shape[0], T, temperature, with_entropy, chunk_tokens, logits_fn)


@dataclass
class _Packed:
    """A micro-batch packed into R rows of C slots. Each response token _M is located by its sequence b_M,
    its index k_M in the response, its slot (r_M, c_M) and the column pred_M of the slot predicting it."""

    varlen: bool
    ids_RC: torch.Tensor
    pos_RC: torch.Tensor  # padding: position 0, a sequence of its own
    seg_RC: torch.Tensor  # 0: prompt, b + 1: response of sequence b
    unit_RC: torch.Tensor  # padding: a unit of its own
    b_M: torch.Tensor
    k_M: torch.Tensor
    r_M: torch.Tensor
    c_M: torch.Tensor
    pred_M: torch.Tensor
    one_per_unit: bool  # no prompt shared: each kept slot predicts one target


@dataclass
class _Units:
    """Where each sequence goes: units (a prompt followed by the responses that share it), packed into rows."""

    R: int
    C: int
    start_B: torch.Tensor  # first prompt column: where the left padding ends
    plen_B: torch.Tensor
    leader_B: torch.Tensor  # the sequence whose prompt its unit holds
    unit_B: torch.Tensor
    row_U: torch.Tensor
    off_U: torch.Tensor
    resp_off_B: torch.Tensor  # column of the first response token


def _units(input_ids, attention_mask, T, varlen: bool) -> _Units:
    """The units of a micro-batch (one response each with flash attention) and their place in the rows."""
    from postrl.partition import pack_sequences, share_prompts

    B, L = input_ids.shape
    device = input_ids.device
    prompt_cols = L - T
    start_B = (attention_mask.cumsum(1) == 0).sum(1)  # first token: where the left padding ends
    plen_B = prompt_cols - start_B
    rlen_B = attention_mask[:, prompt_cols:].sum(1)
    assert bool((plen_B > 0).all()), "every sequence needs at least one prompt token"
    same_B = torch.zeros(B, dtype=torch.bool, device=device)
    if not varlen and B > 1:
        same_B[1:] = ((input_ids[1:, :prompt_cols] == input_ids[:-1, :prompt_cols]) & (start_B[1:] == start_B[:-1])[:, None]).all(1)
    plens, rlens = plen_B.tolist(), rlen_B.tolist()
    longest = max(p + r for p, r in zip(plens, rlens))
    capacity = None if varlen else max(longest, min(PACK_ROW_FACTOR * longest, PACK_ROW_TOKENS))
    leaders, unit_lengths = share_prompts(same_B.tolist(), plens, rlens, capacity)
    leader_B = torch.tensor(leaders, device=device)
    unit_B = leader_B.cumsum(0) - 1
    row_of, offset_of, (R, C) = pack_sequences(unit_lengths, None if varlen else max(unit_lengths))
    row_U = torch.tensor(row_of, device=device)
    off_U = torch.tensor(offset_of, device=device)
    # each response starts after its unit's prompt and the responses of the unit before it
    before_B = rlen_B.cumsum(0) - rlen_B
    resp_off_B = off_U[unit_B] + plen_B + before_B - before_B[leader_B][unit_B]
    return _Units(R, C, start_B, plen_B, leader_B, unit_B, row_U, off_U, resp_off_B)


def _pack(input_ids, attention_mask, T, varlen: bool) -> _Packed:
    """The rows: each unit's prompt (from its leader), then every response token after it."""
    u = _units(input_ids, attention_mask, T, varlen)
    R, C, device = u.R, u.C, input_ids.device
    prompt_cols = input_ids.shape[1] - T
    ids_RC = torch.zeros((R, C), dtype=input_ids.dtype, device=device)
    pos_RC = torch.zeros((R, C), dtype=torch.long, device=device)
    seg_RC = torch.zeros((R, C), dtype=torch.long, device=device)
    unit_RC = -1 - torch.arange(R * C, device=device).view(R, C)
    lead = u.leader_B.nonzero().squeeze(1)
    b_P = torch.repeat_interleave(lead, u.plen_B[lead])
    j_P = torch.arange(b_P.numel(), device=device) - torch.repeat_interleave(u.plen_B[lead].cumsum(0) - u.plen_B[lead], u.plen_B[lead])
    r_P, c_P = u.row_U[u.unit_B[b_P]], u.off_U[u.unit_B[b_P]] + j_P
    ids_RC[r_P, c_P] = input_ids[b_P, u.start_B[b_P] + j_P]
    pos_RC[r_P, c_P] = j_P
    unit_RC[r_P, c_P] = u.unit_B[b_P]
    b_M, k_M = attention_mask[:, prompt_cols:].nonzero(as_tuple=True)
    r_M, c_M = u.row_U[u.unit_B[b_M]], u.resp_off_B[b_M] + k_M
    ids_RC[r_M, c_M] = input_ids[b_M, prompt_cols + k_M]
    pos_RC[r_M, c_M] = u.plen_B[b_M] + k_M
    seg_RC[r_M, c_M] = b_M + 1
    unit_RC[r_M, c_M] = u.unit_B[b_M]
    # response token k of sequence b is predicted by the slot before it: the prompt's last for k = 0
    pred_M = torch.where(k_M == 0, u.off_U[u.unit_B[b_M]] + u.plen_B[b_M] - 1, c_M - 1)
    return _Packed(varlen, ids_RC, pos_RC, seg_RC, unit_RC, b_M, k_M, r_M, c_M, pred_M, bool(u.leader_B.all()))


def _shared_prompt_mask(p: _Packed, attn: str, model) -> torch.Tensor:
    """[R, 1, C, C] for sdpa / eager: a slot attends its unit's prompt and its own response, causally."""
    C, device = p.ids_RC.shape[1], p.ids_RC.device
    q, k = (p.seg_RC[:, :, None], p.unit_RC[:, :, None]), (p.seg_RC[:, None, :], p.unit_RC[:, None, :])
    causal_CC = torch.ones((C, C), dtype=torch.bool, device=device).tril()
    allowed_RCC = causal_CC & (q[1] == k[1]) & ((k[0] == 0) | (k[0] == q[0]))
    mask = allowed_RCC[:, None]  # True attends
    if attn == "eager":  # eager adds the mask to the scores
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def _score_packed(model, p: _Packed, mask, B: int, T: int, temperature, with_entropy, chunk_tokens, logits_fn=None):
    """One forward over the rows, keeping only the predicting slots' logits; log-probs back in [B, T]."""
    from postrl.algorithms import token_logprobs

    R, C = p.ids_RC.shape
    device = p.ids_RC.device
    keep_K = torch.unique(p.pred_M)  # sorted columns that hold a predicting slot in some row
    K = keep_K.numel()
    k_of_col = torch.full((C,), -1, dtype=torch.long, device=device)
    k_of_col[keep_K] = torch.arange(K, device=device)
    out = model(input_ids=p.ids_RC, attention_mask=mask, position_ids=p.pos_RC, logits_to_keep=keep_K, use_cache=False)
    logits_NV = out.logits.view(R * K, -1)
    flat_M = p.r_M * K + k_of_col[p.pred_M]
    targets_M = p.ids_RC[p.r_M, p.c_M]
    if p.one_per_unit:  # one target per kept slot: score the kept logits in place
        targets_N = torch.zeros(R * K, dtype=p.ids_RC.dtype, device=device)
        targets_N[flat_M] = targets_M
        logp_N, entropy_N = token_logprobs(logits_NV, targets_N, temperature, chunk_tokens, with_entropy)
        logp_M, entropy_M = logp_N[flat_M], entropy_N[flat_M] if with_entropy else None
    else:  # a shared prompt's last slot predicts the first token of each of its responses
        logp_M, entropy_M = token_logprobs(logits_NV.index_select(0, flat_M), targets_M, temperature, chunk_tokens, with_entropy)
    zeros_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    logp_BT = zeros_BT.index_put((p.b_M, p.k_M), logp_M)
    entropy_BT = zeros_BT.index_put((p.b_M, p.k_M), entropy_M) if with_entropy else None
    if logits_fn is None:
        return logp_BT, entropy_BT
    extra_MK = logits_fn(logits_NV.index_select(0, flat_M), p.b_M, p.k_M)
    extra_BTK = extra_MK.new_zeros((B, T, extra_MK.shape[-1])).index_put((p.b_M, p.k_M), extra_MK)
    return logp_BT, entropy_BT, extra_BTK


def _varlen_attention(attn: str) -> bool:
    """Whether the attention tells packed sequences apart by their position ids alone (no mask): flash
    attention in any flavour transformers names ("flash_attention_2", "kernels-community/flash-attn3"...)."""
    return "flash" in attn


def _config(model):
    """The HF config of a model, or of the model inside a DDP wrapper."""
    return getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)

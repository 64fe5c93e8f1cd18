"""What a rollout process sends back to the trainer, as bytes in a declared shape (DESIGN.md section 13): the
rollout worker's batches (`rollout.placement: worker`) and the pool replicas' chunks (`pool`) are JSON that
the trainer parses into the pydantic models below (strict types, unknown fields refused, at most
MAX_REPLY_BYTES, nesting bounded by the models and by the JSON parser's depth limit) and never unpickles:
a rollout process runs user agent programs and parses model output, so what it sends is untrusted.

    rollout process                                   trainer
    encode_batch / encode_chunk / encode_failure  ->  bytes  ->  decode(data, n_examples) -> Produced | Chunk | Failure
                                                      (a raw byte channel: a Pipe's recv_bytes, a TCPStore key)

Floats round-trip exactly (shortest repr, NaN / inf kept where a field allows them); ints stay ints.

Values are checked as well as shapes (`_check_values`), since a value the trainer cannot use fails later where it
hurts (in `torch.tensor`, or as a device assert on a GPU): every token id lies in [0, vocab) (the policy's input
embedding rows, `vocab_size`), a loss mask has one 0 / 1 per token, log-probs, scores and rewards are finite,
per-token lists are as long as their tokens, a model turn's span lies inside its tokens. A Batch's `multi_modal` entries
(VLM images: PIL images and tensors) are never sent: each is the multi_modal of one of the run's prompt
examples, which the trainer holds already, so the reply names the example by index and `to_batch` puts the
trainer's own object back. A reply that does not decode raises WireError: the sender's failure (counted,
restarted), never the trainer's.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

import pydantic_core
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError,
                      ValidationInfo, model_validator)

from postrl.batch import Batch
from postrl.rollout.base import Completion

# The largest reply the trainer reads: a real batch is far below it (512 sequences of 8K tokens with ids,
# masks, log-probs and versions are ~150 MB of JSON); a reply over it is the sender's failure.
MAX_REPLY_BYTES = 1 << 30
_TEXT = 100_000  # the longest string in a reply (a failure's message, a metric's name)

Num = Union[StrictInt, StrictFloat]  # ints stay ints, floats stay floats (exactly)
Name = Annotated[StrictStr, Field(max_length=_TEXT)]


class WireError(ValueError):
    """A reply that is not one of the declared shapes (or too large): the sender's failure."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=True, ser_json_inf_nan="constants")


class _Segment(_Strict):
    """A trajectory's extra segment (a Completion; segments do not nest)."""

    prompt_index: StrictInt
    token_ids: list[StrictInt]
    finished: StrictBool
    logprobs: list[Num] | None = None
    loss_mask: list[StrictInt] | None = None
    turn_spans: list[tuple[StrictInt, StrictInt]] | None = None
    tool_calls: StrictInt = 0
    env_reward: Num = 0.0
    version: StrictInt | None = None
    token_versions: list[StrictInt] | None = None
    prompt_ids: list[StrictInt] | None = None
    segments: None = None
    top_logprobs: list[tuple[list[StrictInt], list[Num]]] | None = None

    def completion(self) -> Completion:
        return Completion(**{k: getattr(self, k) for k in type(self).model_fields})


class BatchMsg(_Strict):
    """A Batch's fields; `multi_modal` holds the index of the example whose multi_modal each row has (or None)."""

    prompt_ids: list[list[StrictInt]]
    response_ids: list[list[StrictInt]]
    loss_masks: list[list[StrictInt]]
    turns: list[StrictInt]
    finished: list[StrictBool]
    scores: list[Num]
    rewards: list[Num]
    verifier_metrics: list[dict[Name, Num]]
    engine_logprobs: list[list[Num] | None]
    multi_modal: list[StrictInt | None]
    versions: list[StrictInt | None]
    token_versions: list[list[StrictInt] | None]
    segments: list[list[_Segment] | None]
    owners: list[StrictInt | None]

    @model_validator(mode="after")
    def _rows(self, info: ValidationInfo) -> "BatchMsg":
        sizes = {name: len(getattr(self, name)) for name in type(self).model_fields}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the batch's fields have different row counts: {sizes}")
        n = (info.context or {}).get("examples")
        if n is not None and any(i is not None and not 0 <= i < n for i in self.multi_modal):
            raise ValueError(f"a multi_modal entry names no example (the run has {n})")
        _check_values(self, (info.context or {}).get("vocab"))
        return self

    def to_batch(self, examples: list) -> Batch:
        fields = {k: getattr(self, k) for k in type(self).model_fields}
        fields["multi_modal"] = [None if i is None else examples[i].multi_modal for i in self.multi_modal]
        fields["segments"] = [None if s is None else [seg.completion() for seg in s] for s in self.segments]
        return Batch(**fields)


def _check_values(b: BatchMsg, vocab: int | None) -> None:
    """Raise ValueError (naming the row and the field, never the value: it may be 10**30) for a value the trainer
    cannot use; token ids are checked against `vocab` when it is given."""

    def ids(row: int, what: str, xs: list[int]) -> None:
        if xs and (min(xs) < 0 or (vocab is not None and max(xs) >= vocab)):
            raise ValueError(f"row {row}: a {what} token id outside the vocabulary [0, {vocab if vocab is not None else 'inf'})")

    def mask(row: int, what: str, xs: list[int], n: int) -> None:
        if len(xs) != n or not set(xs) <= {0, 1}:
            raise ValueError(f"row {row}: the {what} must hold one 0 or 1 per token ({n}), got {len(xs)} entries of {sorted(set(xs))[:3]}")

    def finite(row: int, what: str, xs: list, n: int | None = None) -> None:
        if n is not None and len(xs) != n:
            raise ValueError(f"row {row}: the {what} must hold one value per token ({n}), got {len(xs)}")
        if not all(map(math.isfinite, xs)):
            raise ValueError(f"row {row}: the {what} must be finite (NaN or inf found)")

    for row, (prompt, response) in enumerate(zip(b.prompt_ids, b.response_ids)):
        ids(row, "prompt", prompt)
        ids(row, "response", response)
        mask(row, "loss mask", b.loss_masks[row], len(response))
        finite(row, "score and reward", [b.scores[row], b.rewards[row]])
        if b.engine_logprobs[row] is not None:
            finite(row, "engine log-probs", b.engine_logprobs[row], len(response))
        if b.token_versions[row] is not None and len(b.token_versions[row]) != len(response):
            raise ValueError(f"row {row}: the token versions must hold one per token ({len(response)})")
        for seg in b.segments[row] or []:
            n = len(seg.token_ids)
            ids(row, "segment", seg.token_ids)
            ids(row, "segment prompt", seg.prompt_ids or [])
            finite(row, "segment's environment reward", [seg.env_reward])
            if seg.loss_mask is not None:
                mask(row, "segment's loss mask", seg.loss_mask, n)
            if seg.logprobs is not None:
                finite(row, "segment's log-probs", seg.logprobs, n)
            if seg.token_versions is not None and len(seg.token_versions) != n:
                raise ValueError(f"row {row}: a segment's token versions must hold one per token ({n})")
            if any(not 0 <= lo <= hi <= n for lo, hi in seg.turn_spans or []):
                raise ValueError(f"row {row}: a segment's turn span lies outside its {n} tokens")
            for top_ids, top_logprobs in seg.top_logprobs or []:
                ids(row, "segment top-k", top_ids)
                finite(row, "segment's top-k log-probs", top_logprobs, len(top_ids))
            if seg.top_logprobs is not None and len(seg.top_logprobs) != n:
                raise ValueError(f"row {row}: a segment's top-k log-probs must hold one entry per token ({n})")


def vocab_size(model: Any) -> int:
    """The rows of `model`'s input embedding: a token id at or past it would index out of range (on a GPU, a device
    assert), so the trainer checks every reply's ids against it."""
    return int(model.get_input_embeddings().num_embeddings)


class Failure(_Strict):
    """A rollout process that failed: a UserError's parts (`user_error`: a data error that would recur on any
    rollout process: the run stops with it), or another error's text."""

    kind: Literal["failure"] = "failure"
    message: Name
    problems: list[Name] = []
    title: Name | None = None
    user_error: StrictBool = False


class Produced(_Strict):
    """One training batch from the rollout worker: batch `index` (the step it is for), the collection's metrics,
    the worker's time split, the sampler position after its prompts, the checksum of every version it sampled with."""

    kind: Literal["batch"] = "batch"
    index: StrictInt
    batch: BatchMsg
    stats: dict[Name, Num]
    seconds: dict[Name, Num]
    sampler: dict[Name, StrictInt | None]
    checksums: dict[StrictInt, Num]


class Chunk(_Strict):
    """One prompt chunk from a pool replica (Replica.generate)."""

    kind: Literal["chunk"] = "chunk"
    batch: BatchMsg
    failures: dict[Name, StrictInt]
    seconds: dict[Name, Num]
    busy: Num
    idle: Num
    load_s: Num
    checksums: dict[StrictInt, Num]
    tokens: StrictInt
    agent: dict[Name, Num] | None


Reply = Annotated[Union[Produced, Chunk, Failure], Field(discriminator="kind")]
_REPLY: TypeAdapter = TypeAdapter(Reply)


class Where(_Strict):
    """Where a pool replica runs (for messages and the placement tests)."""

    node: Annotated[StrictStr, Field(max_length=200)]
    pid: StrictInt


def _batch_fields(batch: Batch, examples: list) -> dict:
    index = {id(e.multi_modal): i for i, e in enumerate(examples) if e.multi_modal is not None}
    refs = []
    for mm in batch.multi_modal:
        if mm is not None and id(mm) not in index:
            raise WireError("a batch row's multi_modal is not one of the run's prompt examples' (the reply names it by index)")
        refs.append(None if mm is None else index[id(mm)])
    out = {name: getattr(batch, name) for name in BatchMsg.model_fields}
    out["multi_modal"] = refs
    return out


def _encode(reply: dict, cap: int) -> bytes:
    data = pydantic_core.to_json(reply, inf_nan_mode="constants")
    if len(data) > cap:
        raise WireError(f"a reply of {len(data)} bytes is over the cap of {cap} bytes (placement/wire.py MAX_REPLY_BYTES)")
    return data


def encode_batch(index: int, batch: Batch, examples: list, stats: dict, seconds: dict, sampler: dict, checksums: dict,
                 cap: int = MAX_REPLY_BYTES) -> bytes:  # fmt: skip
    """The rollout worker's batch `index` as bytes (`Produced`)."""
    return _encode({"kind": "batch", "index": index, "batch": _batch_fields(batch, examples), "stats": stats,
                    "seconds": seconds, "sampler": sampler, "checksums": checksums}, cap)  # fmt: skip


def encode_chunk(reply: dict, examples: list, cap: int = MAX_REPLY_BYTES) -> bytes:
    """A pool replica's chunk (Replica.generate's fields) as bytes (`Chunk`)."""
    return _encode({"kind": "chunk", **reply, "batch": _batch_fields(reply["batch"], examples)}, cap)


def encode_failure(exc: BaseException) -> bytes:
    """A failing rollout process's error as bytes (`Failure`): a UserError's parts, or the error's text."""
    from postrl.errors import UserError

    if isinstance(exc, UserError):
        reply = Failure(message=str(exc)[:_TEXT], problems=[p[:_TEXT] for p in exc.problems], title=exc.title, user_error=True)
    else:
        reply = Failure(message=f"{type(exc).__name__}: {exc}"[:_TEXT])
    return reply.model_dump_json().encode()


def decode(data: Any, n_examples: int, cap: int = MAX_REPLY_BYTES, vocab: int | None = None) -> Produced | Chunk | Failure:
    """`data` (bytes a rollout process sent) parsed into its declared shape, its values checked (token ids against
    `vocab`, the policy's `vocab_size`, when given); WireError when it is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a reply must be bytes, got {type(data).__name__}")
    if len(data) > cap:
        raise WireError(f"a reply of {len(data)} bytes is over the cap of {cap} bytes (placement/wire.py MAX_REPLY_BYTES)")
    try:
        return _REPLY.validate_json(bytes(data), context={"examples": n_examples, "vocab": vocab})
    except ValidationError as exc:
        lines = [": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in exc.errors()[:3]]
        raise WireError(f"a reply that is not in the declared shape ({len(data)} bytes): " + "; ".join(lines)) from None


def decode_where(data: Any) -> Where:
    try:
        return Where.model_validate_json(bytes(data)[:1000])
    except (ValidationError, TypeError) as exc:
        raise WireError(f"a replica's location that is not in the declared shape: {str(exc)[:200]}") from None

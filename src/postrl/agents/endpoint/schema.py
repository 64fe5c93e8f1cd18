"""The request bodies the endpoint takes, as declared models of OpenAI's chat-completions and completions schema.

Every body is parsed here, on the server's thread, before any work starts (as vLLM's `ChatCompletionRequest`
does): JSON, then its nesting depth, then these models, then the run's limits (`Limits`). A body that fails
any of them is answered 400 with the field named (`BadRequest.param`, e.g. `messages.0.content.0.text`), so
what reaches the engine thread is of known shape. Unknown fields are accepted and ignored (OpenAI's clients
send new ones before servers know them); fields of the right name and a wrong type are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, ValidationInfo, field_validator, model_validator

from postrl.untrusted import Unreadable, json_object

Number = StrictFloat | StrictInt


class BadRequest(Exception):
    """A request the endpoint answers with the OpenAI error shape (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    """A part of a message's content; only text parts are rendered (their `text` must be a string)."""

    type: StrictStr = "text"
    text: StrictStr | None = Field(None, validate_default=True)

    @field_validator("text")
    @classmethod
    def _text_part_has_text(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("type") == "text":
            raise ValueError("a text part needs 'text', a string")
        return v


class FunctionCall(_Open):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: StrictStr | None = None
    type: StrictStr = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDef(_Open):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    """`{type: function, function: {name, description, parameters}}`, or the function object itself."""

    type: StrictStr = "function"
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, v: Any) -> Any:
        return {"function": v} if isinstance(v, dict) and "function" not in v and "name" in v else v


class _Sampling(_Open):
    model: StrictStr | None = None
    n: StrictInt | None = Field(None, ge=1)  # None (sent as null by some clients): 1
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    logprobs: StrictBool | StrictInt | None = None
    stream: StrictBool | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


@dataclass(frozen=True)
class Limits:
    """What one request may ask (rollout.agent_* and rollout.n_samples_per_prompt)."""

    max_depth: int = 64
    max_n: int = 8
    max_stop: int = 16
    max_stop_chars: int = 256
    # the most characters of text (messages, tools, prompt) that can fit the context: rendering a longer body's
    # chat would hold the engine thread for nothing (its prompt is refused anyway); None: no context known
    max_text_chars: int | None = None

    @classmethod
    def of(cls, cfg: Any, max_model_len: int | None = None, tokenizer: Any = None) -> "Limits":
        chars = max_model_len * longest_token_chars(tokenizer) if max_model_len and tokenizer is not None else None
        return cls(cfg.agent_max_json_depth, cfg.n_samples_per_prompt, cfg.agent_max_stop, cfg.agent_max_stop_chars, chars)


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry (byte-level BPE
    writes a byte as one character, so no token decodes to more characters than its entry has)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


@dataclass
class Request:
    """A parsed body: its model, and the JSON it came as (messages and tools are rendered as sent)."""

    kind: str  # chat | completions
    model: ChatRequest | CompletionRequest
    body: dict

    @property
    def stop(self) -> list[str]:
        s = self.model.stop
        return [s] if isinstance(s, str) else list(s or [])

    @property
    def n(self) -> int:
        return self.model.n or 1

    @property
    def logprobs(self) -> bool:
        return bool(self.model.logprobs)

    @property
    def max_tokens(self) -> int | None:
        return self.model.max_completion_tokens or self.model.max_tokens


def parse(kind: str, raw: bytes, limits: Limits) -> Request:
    """The body `raw` of a `kind` request, checked against the schema and `limits`; else BadRequest."""
    try:
        body = json_object(raw, limits.max_depth, "rollout.agent_max_json_depth")
    except Unreadable as exc:
        raise BadRequest(str(exc)) from None
    try:
        model = (CompletionRequest if kind == "completions" else ChatRequest).model_validate(body)
    except ValidationError as exc:
        err = max(exc.errors(include_url=False, include_input=False), key=lambda e: len(e["loc"]))  # the innermost
        where = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x)) or None
        raise BadRequest(f"'{where}': {err['msg']}" if where else err["msg"], where) from None
    check(model, limits)
    if limits.max_text_chars is not None:
        chars = text_chars([body.get(k) for k in ("messages", "tools", "prompt")])
        if chars > limits.max_text_chars:
            raise BadRequest(
                f"the request holds {chars} characters of text, more than any prompt this run's context can take "
                f"({limits.max_text_chars}: the context's tokens times the longest token's characters); send a shorter "
                "history, or raise data.max_prompt_length / rollout.max_tokens"
            )
    return Request(kind, model, body)


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON value (keys included), counted without recursion."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(len(k) for k in v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def check(model: _Sampling, limits: Limits) -> None:
    """The run's limits on what one request may ask."""
    if (model.n or 1) > limits.max_n:
        raise BadRequest(f"'n' is {model.n}; this run samples at most {limits.max_n} (rollout.n_samples_per_prompt)", "n")
    stop = [model.stop] if isinstance(model.stop, str) else model.stop or []
    if len(stop) > limits.max_stop:
        raise BadRequest(f"'stop' has {len(stop)} strings; at most {limits.max_stop} (rollout.agent_max_stop)", "stop")
    if any(not s or len(s) > limits.max_stop_chars for s in stop):
        raise BadRequest(f"each 'stop' string must have 1 to {limits.max_stop_chars} characters (rollout.agent_max_stop_chars)", "stop")
    if model.stream:
        raise BadRequest("streaming is not supported by the rollout endpoint; send stream: false", "stream")
    if isinstance(model, CompletionRequest):
        p = model.prompt
        if (isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1) or not p or p == [[]] or p == [""]:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _is_type_tag(x: Any) -> bool:
    """pydantic names the union member it tried in an error's location ('str', 'list[ContentPart]',
    'function-after[...]'): not a field (OpenAI's field names are lower-case words)."""
    return isinstance(x, str) and (not x.replace("_", "").isalnum() or x in ("str", "int", "float", "bool", "dict", "list", "none") or x[:1].isupper())

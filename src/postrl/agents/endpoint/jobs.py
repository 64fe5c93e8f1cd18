"""The requests of the OpenAI-compatible endpoint as engine work: a parsed request's prompt ids and what to sample.

The endpoint (agents/endpoint/server.py: HTTP, limits, parsing into agents/endpoint/schema.py's models) queues each
request for the engine thread (agents/endpoint/scheduler.py), which turns it into a `Job` here: a chat's messages
rendered with the model's chat template (tools as the template renders them), or a completion's text or
token ids. A chat that extends the session's last one reuses that one's ids (agents/session.py), so the
model's sampled ids are never re-tokenised from the text the program sent back.

Sampling follows the run, not the request: the engine samples at `rollout.temperature / top_p / top_k`
(greedy in validation) whatever the program asks, because the trainer's log-probs and the rollout
correction assume that distribution; `max_tokens` is honoured within the trajectory's budget
(`rollout.max_tokens` across all its requests and segments), `n` and `stop` are honoured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from postrl.agents.endpoint.schema import BadRequest
from postrl.agents.endpoint.server import Pending
from postrl.agents.session import Session, norm_content, norm_tool_calls, same_message


@dataclass
class Job:
    """A prepared request: the prompt ids and what to sample."""

    pending: Pending
    prompt: list[int]
    n: int
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    tools: list | None = None
    messages: list[dict] | None = None


# ------------------------------------------------------------------------------------ requests
def template_messages(messages: list[dict], session: Session) -> list[dict]:
    """The program's messages as chat templates take them: text content, tool calls with JSON-object
    arguments, tool results named after their call (Hermes templates ignore the id)."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        t: dict = {"role": role, "content": norm_content(m.get("content"))}
        if m.get("tool_calls"):
            t["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in norm_tool_calls(m["tool_calls"])]
        if role == "tool":
            t["name"] = m.get("name") or session.tool_names.get(m.get("tool_call_id", ""), "tool")
        out.append(t)
    return out


def prepare(p: Pending, renderer: Any, tokenizer: Any, cache: dict | None = None) -> Job:
    """The request's prompt ids; a chat that extends the session's last one reuses that one's ids (session.py).
    `cache` (the template's ids of whole chats, by their messages and tools) spares rendering the same first
    request again: the n samples of a prompt all start with it (~1 ms each for a chat with tools)."""
    r, s = p.request, p.session
    n, max_tokens, stop, logprobs = r.n, r.max_tokens, r.stop, r.logprobs
    if r.kind == "completions":
        prompt = r.model.prompt
        prompt = prompt[0] if isinstance(prompt, list) and not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif min(prompt) >= 0 and max(prompt) < len(tokenizer):
            ids = list(prompt)
        else:
            raise BadRequest(f"'prompt' has token ids outside the vocabulary (0 to {len(tokenizer) - 1})", "prompt")
        if not ids:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")
        return Job(p, ids, n, max_tokens, stop, logprobs)
    # the JSON as sent (its shape checked by the models): templates render what the program wrote
    messages = r.body["messages"]
    tools = r.body.get("tools") if r.model.tools and r.model.tool_choice != "none" else None
    ids = _continuation(s, messages, tools, renderer)
    if ids is None:
        shown = template_messages(messages, s)
        key = json.dumps([shown, tools], sort_keys=True, default=str) if cache is not None else None
        ids = cache.get(key) if cache is not None else None
        if ids is None:
            try:
                ids = tokenizer.apply_chat_template(shown, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as exc:  # the template refused these messages (its own raise_exception, a bad shape)
                raise BadRequest(f"the model's chat template cannot render these messages: {exc}", "messages") from None
            if cache is not None:
                if len(cache) >= 4096:
                    cache.clear()
                cache[key] = list(ids)
    return Job(p, list(ids), n, max_tokens, stop, logprobs, tools=tools, messages=messages)


def _continuation(s: Session, messages: list[dict], tools: list | None, renderer: Any) -> list[int] | None:
    """Ids of a chat that is the last one + an assistant message returned + new messages: the last ids, then
    only the new messages rendered (never the assistant's text re-tokenised); None when it is not."""
    last = s.last_messages
    if last is None or tools != s.last_tools or len(messages) <= len(last) + 1:
        return None
    if not all(same_message(a, b) for a, b in zip(messages, last)):
        return None
    for choice in s.tips:
        if choice.message is not None and same_message(messages[len(last)], choice.message):
            new = template_messages(messages[len(last) + 1 :], s)
            if new[-1]["role"] == "assistant":
                return None  # a prefilled assistant turn: rendered whole
            try:
                return choice.full + renderer.after_turn(new, choice.full[-1])
            except Exception:
                return None
    return None



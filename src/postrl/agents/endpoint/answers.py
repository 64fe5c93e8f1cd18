"""Answer shaping: sampled ids as the session's record and as the OpenAI response body the program gets.

`Shaper.answer` is called on the engine thread for each sampled request: it cuts each choice at the
request's budget and `stop` strings, sets its finish reason, records it in the session by the segment
rule (agents/session.py) and replies. `respond` builds the body: the text, the model's `<tool_call>`
blocks as OpenAI `tool_calls` (`finish_reason: "tool_calls"`), log-probs if asked, usage.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from postrl.agents.endpoint.jobs import Job
from postrl.toolcall import BLOCK, ParseError, parse_tool_calls
from postrl.rollout.base import Completion, cut_at_stop
from postrl.untrusted import AGENT_UNREADABLE


@dataclass(frozen=True)
class Shaper:
    """What answering needs of the model: its tokenizer, end-of-sequence ids, the tool-call end token, its name."""

    tokenizer: Any
    eos_ids: frozenset[int]
    call_end_id: int | None
    model_name: str

    def answer(self, job: Job, room: int, outs: list[Completion], stops: set[int], stats: dict[str, float]) -> None:
        """Record `outs` (the request's choices, at most `room` tokens each) in the session and reply; tool calls
        a reader's limit refused are counted in `stats` (agent/unreadable)."""
        s, tok = job.pending.session, self.tokenizer
        choices, finishes = [], []
        for out in outs:
            ids, lps = list(out.token_ids), out.logprobs
            finish = "stop" if ids and (ids[-1] in self.eos_ids or ids[-1] in stops) and len(ids) <= room else "length"
            ids = ids[:room]
            if job.stop:
                ids, hit = cut_at_stop(tok, ids, job.stop)
                finish = "stop" if hit else finish
            lps = None if lps is None else list(lps[: len(ids)])
            finished = finish == "stop" and not (ids and ids[-1] == self.call_end_id)
            choices.append((ids, lps, finished))
            finishes.append(finish)
        tips = s.record(job.prompt, choices, outs[0].version if outs else None)
        body = respond(job, [(c[0], c[1], f) for c, f in zip(choices, finishes)], tok, self.eos_ids, self.model_name, stats)
        if job.messages is not None:
            for tip, choice in zip(tips, body["choices"]):
                tip.message = choice["message"]
            s.last_messages, s.last_tools = job.messages, job.tools
        else:
            s.last_messages = None
        s.tool_calls = len(s.tool_names)
        job.pending.reply(200, body)

    def empty(self, job: Job) -> None:
        """The trajectory's budget is spent: nothing sampled, nothing recorded, `finish_reason: length`."""
        job.pending.reply(200, respond(job, [([], [], "length")] * job.n, self.tokenizer, self.eos_ids, self.model_name))


def respond(job: Job, choices: list[tuple[list[int], list[float] | None, str]], tokenizer: Any, eos_ids: set[int], model: str,
            stats: dict[str, float] | None = None) -> dict:
    """The OpenAI response body for sampled choices [(ids, log-probs, finish_reason)]; records tool call ids and
    counts in `stats` the tool calls a reader's limit refused (agent/unreadable, as the agent loop does)."""
    created = int(time.time())
    out = []
    prompt_tokens, completion_tokens = len(job.prompt), 0
    for k, (ids, lps, finish) in enumerate(choices):
        completion_tokens += len(ids)
        text = tokenizer.decode([t for t in ids if t not in eos_ids], skip_special_tokens=False)
        for s in job.stop:
            if s in text:
                text = text[: text.index(s)]
        entry: dict = {"index": k, "finish_reason": finish, "logprobs": None}
        if job.logprobs and lps is not None:
            entry["logprobs"] = {"content": [
                {"token": tokenizer.decode([t]), "logprob": float(lp), "bytes": None, "top_logprobs": []} for t, lp in zip(ids, lps)
            ]}  # fmt: skip
        if job.pending.kind == "completions":
            entry["text"] = text
        else:
            message: dict = {"role": "assistant", "content": text}
            if job.tools:
                parsed = parse_tool_calls(text, None)
                if isinstance(parsed, ParseError) and stats is not None:
                    stats[AGENT_UNREADABLE] += parsed.unreadable  # past a reader's limit (postrl/untrusted.py)
                if not isinstance(parsed, ParseError) and parsed:
                    calls = []
                    for c in parsed:
                        cid = f"call_{uuid.uuid4().hex[:16]}"
                        job.pending.session.tool_names[cid] = c.name
                        calls.append({"id": cid, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
                    content = _outside_calls(text)
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    if finish == "stop":
                        entry["finish_reason"] = "tool_calls"
            entry["message"] = message
        out.append(entry)
    kind = "text_completion" if job.pending.kind == "completions" else "chat.completion"
    return {
        "id": f"postrl-{uuid.uuid4().hex[:24]}", "object": kind, "created": created, "model": model, "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip


def _outside_calls(text: str) -> str:
    return BLOCK.sub("", text).strip()

"""What the endpoint records per session: requests as token ids, grouped into segments by the segment rule.

Each request a session's program sends is recorded as (prompt_ids, sampled_ids, sampled_logprobs,
version) for each of its choices. The segment rule (DESIGN.md section 12), on ids, never text:

    request k continues the trajectory iff its prompt ids start with the prompt ids + sampled ids of a
    choice of request k - 1; otherwise it opens a new segment.

A continued segment appends what lies between (the tool results, the next assistant header: loss
mask 0) and the new sampled ids (mask 1), exactly as the agent loop builds a trajectory. A new segment
starts from the request's whole prompt. A segment's loss mask is 1 exactly on its sampled ids; every
segment of a session shares the session's reward and advantage.

The chat renderer keeps this append-only on ids where the program's messages are: when a request's
messages are the previous request's messages plus the assistant message the endpoint returned plus
new ones, only the new ones are rendered (agents/loop/render.py) after the ids already sampled, so the
model's ids are reused, never re-tokenised from the text the program sent back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrl.rollout.base import Completion
from postrl.untrusted import load_json


def append_tokens(t: Any, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
    """Append `ids` to a token-level trajectory `t` (ids, mask, logprobs, spans: a Segment here, the agent
    loop's Trajectory): sampled ids get mask 1, a span and their log-probs (the log-probs are dropped for
    the whole trajectory once a sampled turn comes without them); rendered ids get mask 0."""
    if sampled:
        t.spans.append((len(t.ids), len(t.ids) + len(ids)))
    t.ids += ids
    t.mask += [int(sampled)] * len(ids)
    if t.logprobs is not None:
        if sampled and logprobs is None:
            t.logprobs = None
        else:
            t.logprobs += list(logprobs[: len(ids)]) if sampled else [0.0] * len(ids)


@dataclass
class Segment:
    """One token-level trajectory: a prompt, then sampled (mask 1) and rendered (mask 0) ids."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    finished: bool = False
    version: int | None = None

    @property
    def full(self) -> list[int]:
        return self.prompt + self.ids

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        append_tokens(self, ids, sampled, logprobs)

    def completion(self, prompt_index: int) -> Completion:
        return Completion(
            prompt_index=prompt_index, token_ids=list(self.ids), finished=self.finished, logprobs=self.logprobs,
            loss_mask=list(self.mask), turn_spans=list(self.spans), version=self.version, prompt_ids=list(self.prompt),
        )  # fmt: skip


@dataclass
class Choice:
    """One sampled choice of a request: its segment, and what the program got back (for the next render)."""

    segment: Segment
    full: list[int]  # prompt ids + sampled ids
    message: dict | None = None  # the assistant message returned (chat requests)


@dataclass
class Session:
    """One rollout sample: the program's requests, their segments, and how the program ended."""

    key: str
    prompt_index: int
    row: Any = None
    segments: list[Segment] = field(default_factory=list)
    tips: list[Choice] = field(default_factory=list)  # the previous request's choices
    last_messages: list[dict] | None = None  # the previous chat request's messages
    last_tools: Any = None
    tool_names: dict[str, str] = field(default_factory=dict)  # tool_call id -> tool name
    requests: int = 0
    bad_requests: int = 0  # this sample's requests the endpoint refused (its 4xx / 5xx): the all-fail stop names them
    asked: bool = False  # a request of this session has reached the engine thread
    tool_calls: int = 0  # tool calls the endpoint returned
    closed: bool = False  # the program ended (or timed out): later requests are refused
    outcome: str = "running"  # running | ok | error | timeout
    reward: float | None = None
    error: str = ""

    def record(self, prompt: list[int], choices: list[tuple[list[int], list[float] | None, bool]], version: int | None) -> list[Choice]:
        """Record one request's choices [(sampled ids, log-probs, finished)] by the segment rule."""
        self.requests += 1
        target = next((c for c in self.tips if prompt[: len(c.full)] == c.full), None)
        tips = []
        for k, (ids, lps, finished) in enumerate(choices):
            if k == 0 and target is not None:
                seg = target.segment
                seg.append(prompt[len(target.full) :], sampled=False)
            else:
                seg = Segment(list(prompt), version=version)
                self.segments.append(seg)
            seg.append(list(ids), sampled=True, logprobs=lps)
            seg.finished = finished
            tips.append(Choice(seg, list(prompt) + list(ids)))
        self.tips = tips
        return tips

    def main_segment(self) -> Segment | None:
        """The segment the last request's first choice extended: the one that holds the program's final answer."""
        return self.tips[0].segment if self.tips else None


def norm_content(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError(f"content must be a string or a list of content parts, got {type(content).__name__}")


def norm_tool_calls(calls: Any) -> list[tuple[str, Any]]:
    out = []
    for c in calls or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = load_json(args) if args.strip() else {}
            except ValueError:  # not JSON, or past the limits (too long, too deep): compared as the text it is
                pass
        out.append((fn.get("name"), args))
    return out


def same_message(a: dict, b: dict) -> bool:
    """Two chat messages that render the same: role, text (stripped) and tool calls (arguments as JSON values)."""
    return (
        a.get("role") == b.get("role")
        and norm_content(a.get("content")).strip() == norm_content(b.get("content")).strip()
        and norm_tool_calls(a.get("tool_calls")) == norm_tool_calls(b.get("tool_calls"))
    )

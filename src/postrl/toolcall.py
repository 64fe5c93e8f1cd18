"""Tool calls in a model turn, in the Hermes format that Qwen2.5 / Qwen3 chat templates teach:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

`parse_tool_calls(text)` returns the calls in order (several per turn are allowed), `[]` when the
turn has none, or a `ParseError` whose message is written for the model (it is rendered back as
the tool's answer, so the policy can learn the format); it never raises. Leniencies, each seen in
real models' output: `arguments` given as a JSON string is decoded; a missing `arguments` means
`{}`; the last block may lack its `</tool_call>` (a stop string at `</tool_call>` may cut it off).

The text is the policy's, so it is read under limits (postrl/untrusted.py): each call's JSON under a size
and depth cap with finite numbers only, at most `MAX_CALLS` blocks, names and messages cut short. A turn
that trips a limit is a ParseError like any malformed call, marked `unreadable` (the agent loop counts it
in agent/unreadable).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Collection

from postrl.untrusted import Unreadable, guarded, load_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def call_end_id(tokenizer: Any) -> int | None:
    """The one token id of `</tool_call>` in this vocabulary (Qwen2.5, the tiny tools model), None where the text
    takes several tokens: engines stop on the id; otherwise a turn is cut after the token that completes the text."""
    end = tokenizer.convert_tokens_to_ids(CLOSE)
    return end if isinstance(end, int) and end != tokenizer.unk_token_id else None


MAX_CALLS = 64  # <tool_call> blocks read in one turn; past it the turn is one error (no model calls more honestly)
MAX_NAME_CHARS = 80  # of a tool name quoted back to the model
FORMAT_HINT = f'Write each call as {OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as a JSON object>}}}}\n{CLOSE}'


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParseError:
    """The turn tried to call tools but some call is malformed; `message` is shown to the model. `unreadable`:
    some call tripped a limit (too deep, too long, too many calls), not only a typo."""

    message: str
    unreadable: bool = False


def _one(body: str, closed: bool, tool_names: Collection[str] | None) -> ToolCall | str:
    """The call in one <tool_call> block, or what is wrong with it; Unreadable past a limit."""
    body = body.strip()
    if not body:
        return "it is empty" if closed else f"it is empty and has no closing {CLOSE}"
    try:
        obj = load_json(body)
    except Unreadable:
        raise
    except ValueError as exc:
        unclosed = "" if closed else f" (and it has no closing {CLOSE})"
        return f"it is not valid JSON: {exc}{unclosed}"
    if not isinstance(obj, dict):
        return f'it must be a JSON object with "name" and "arguments", got a JSON {type(obj).__name__}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'it has no "name" (a string naming the tool)'
    name = name.strip()
    if tool_names is not None and name not in tool_names:
        return f"there is no tool named '{name[:MAX_NAME_CHARS]}' (available tools: {', '.join(tool_names) or 'none'})"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = load_json(args) if args.strip() else {}
        except Unreadable:
            raise
        except ValueError as exc:
            return f'its "arguments" is a string that is not valid JSON: {exc}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'its "arguments" must be a JSON object, got a JSON {type(args).__name__}'
    return ToolCall(name, args)


def _unreadable(exc: BaseException) -> ParseError:
    return ParseError(f"Your tool call could not be run: it cannot be read ({type(exc).__name__}). {FORMAT_HINT}", True)


@guarded(_unreadable)
def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> list[ToolCall] | ParseError:
    """The tool calls in `text`, in order; `tool_names` (when given) makes an unknown tool an error."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    blocks, unreadable = [], False
    for match in BLOCK.finditer(text):
        if len(blocks) == MAX_CALLS:
            return ParseError(f"Your tool call could not be run: more than {MAX_CALLS} tool calls in one turn. {FORMAT_HINT}", True)
        blocks.append(match)
    for i, match in enumerate(blocks, 1):
        try:
            out = _one(match.group(1), match.group(0).endswith(CLOSE), tool_names)
        except Unreadable as exc:
            out, unreadable = f"it cannot be read: {exc}", True
        if isinstance(out, ToolCall):
            calls.append(out)
        else:
            problems.append(f"tool call {i}: {out}" if len(blocks) > 1 else f"the tool call: {out}")
    outside = BLOCK.sub("", text)
    if CLOSE in outside:
        problems.append(f"found {CLOSE} without a matching {OPEN} before it")
    if problems:
        return ParseError("Your tool call could not be run: " + "; ".join(problems) + f". {FORMAT_HINT}", unreadable)
    return calls

"""Tools the policy may call: a name, an OpenAI-format JSON schema, and a callable.

Specs name them as in `agent.tools`: `builtin:python` (model-written code in the sandbox),
`builtin:calculator` (arithmetic, parsed with `ast`, never `eval`), or a user's
`package.module:function`, whose schema comes from its type hints and Google-style docstring
through `transformers.utils.get_json_schema` (the same schema chat templates render).

`call_tool` never raises: an unknown tool, bad arguments, a tool that raises or one that overruns
its time limit all come back as a `ToolResult` whose text is shown to the model.

User tools run in a daemon thread, joined with the time limit, and not in a subprocess: a user
tool is the user's own trusted code (like a verifier), it may hold state worth keeping between
calls (a client, an index) that a subprocess would lose or copy, and a thread costs microseconds
where a process costs ~100 ms per call. The price: Python cannot kill a thread, so a tool that
hangs keeps its (daemon) thread until it returns; the call still ends at the limit, stuck threads
are counted and warned about. Code that may be hostile (the model's) goes through `builtin:python`,
whose sandbox is a separate, killable process tree.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal

from postrl.agents.results import error_text, show
from postrl.agents.sandbox.sandbox import (
    CallStats,
    SandboxResult,
    isolation,
    refusal,
    run_python,
    sandbox_description,
    unisolated_warning,
)
from postrl.errors import UserError
from postrl.sandbox_limits import SandboxLimits
from postrl.untrusted import load_json
from postrl.utils import import_named, split_named

log = logging.getLogger("postrl.agents")

MAX_RESULT_CHARS = 16_384  # text shown to the model per call; the rest is cut with a note

Status = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class ToolResult:
    """What a call returns to the model: `text` (the tool's output or the error), and how it ended."""

    text: str
    status: Status


@dataclass(frozen=True)
class Tool:
    """One tool: `schema` is {"type": "function", "function": {name, description, parameters}}."""

    name: str
    schema: dict
    fn: Callable[..., Any]
    spec: str  # how it was named: "builtin:python", "my_pkg.tools:search"
    builtin: bool = False  # built-ins bound their own time (sandbox, calculator) and run inline
    sandbox_limits: dict = field(default_factory=dict)  # builtin:python only: SandboxLimits' fields


# ---------------------------------------------------------------------------------------- built-ins


SANDBOX_LIMITS = tuple(f.name for f in fields(SandboxLimits))  # the python tool's settings (rollout.multi_turn.sandbox)


def run_sandboxed(code: str, timeout_s: float, settings: dict | None = None) -> SandboxResult:
    """Run `code` on the backend `settings["backend"]` names (local, sandbox_fusion): the same result either way.
    `settings` are SandboxLimits' fields; those not given keep their defaults."""
    limits = SandboxLimits(**(settings or {}))
    if limits.backend == "sandbox_fusion":
        from postrl.agents.sandbox.fusion import run_remote

        return run_remote(code, limits, timeout_s=timeout_s)
    return run_python(code, limits, timeout_s=timeout_s)


def start_python_tool(settings: dict, say: Callable[[str], Any] | None = None) -> None:
    """At the start of a run with builtin:python: a UserError where its code cannot be fenced (what, why, fix);
    else one line on how it is fenced, through `say` (and a warning to the log at every run that is not fenced)."""
    limits = SandboxLimits(**settings)
    if limits.backend == "sandbox_fusion":
        from postrl.agents.sandbox.fusion import plain_http_warning

        line = f"sandbox: the python tool's code runs on the SandboxFusion service at {limits.url} (its isolation)"
        if (warning := plain_http_warning(limits.url or "")) is not None:
            log.warning(warning)
            line += f"\n{warning}"
    else:
        why = refusal(limits.require_isolation)
        if why is not None:
            raise UserError(why)
        line = sandbox_description()
        if not isolation().namespaces:
            line = unisolated_warning()
            log.warning(line)
    if say is not None:
        say(line)


def python(code: str, timeout_s: float = 10.0, limits: dict | None = None) -> ToolResult:
    """Run Python code in a sandbox and return what it prints. No network; files written vanish after the call.

    Args:
        code: A complete Python program. Print the values you want to see.
        timeout_s: The wall-clock limit (set by the agent loop, not shown to the model).
        limits: The sandbox's backend and limits, rollout.multi_turn.sandbox (set by the loop, not shown to the model).
    """
    res = run_sandboxed(code, timeout_s, limits)
    if res.error is None:
        return ToolResult(res.stdout, "ok")
    if res.error == "timeout":
        return ToolResult(f"{res.stdout}\n[timed out after {timeout_s:g} s]".lstrip("\n"), "timeout")
    if res.error == "isolation":  # nothing ran: the machine cannot fence it
        log.error("the python tool refused to run code: %s", res.stderr)
        return ToolResult(f"the python tool is unavailable: {res.stderr}", "error")
    if res.error == "setup":  # our fault, not the model's: say so plainly
        log.warning("the python tool's sandbox failed to start: %s", res.stderr.strip()[-300:])
    return ToolResult("\n".join(s for s in (res.stdout, res.stderr.strip()) if s), "error")


MAX_INT_BITS = 4096  # ~1233 decimal digits: far past any honest arithmetic, far below a slow one
MAX_EXPR_CHARS = 1000

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _CalcError(ValueError):
    pass


def _bits(x: int | float) -> float:
    return x.bit_length() if isinstance(x, int) else math.log2(abs(x)) + 1 if x else 0.0


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
            # Bound the result's size before computing it: 2**99999999 would take minutes and gigabytes.
            if right > 0 and abs(left) > 1 and right * _bits(left) > MAX_INT_BITS:
                raise _CalcError(f"the result of {left}**{right} is too large (limit: {MAX_INT_BITS} bits)")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise _CalcError("the result is a complex number")
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise _CalcError(f"the result is too large (limit: {MAX_INT_BITS} bits)")
        if isinstance(result, float) and not math.isfinite(result):
            raise _CalcError("the result is not a finite number")
        return result
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name '{node.id}'"
    elif isinstance(node, ast.Call):
        what = "a function call"
    elif isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    raise _CalcError(f"{what} is not allowed: use numbers, + - * / // % **, and parentheses")


MAX_EXPR_DEPTH = 200  # nested operations an expression may have


def _depth(tree: ast.AST) -> int:
    """How deeply the nodes of `tree` nest, counted without recursion."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def calculator(expression: str) -> ToolResult:
    """Evaluate an arithmetic expression exactly (integers stay exact) and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10 / 7".
    """
    if not isinstance(expression, str):
        return ToolResult(f"expression must be a string, got {type(expression).__name__}", "error")
    if len(expression) > MAX_EXPR_CHARS:
        return ToolResult(f"the expression is too long ({len(expression)} characters; limit {MAX_EXPR_CHARS})", "error")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        if _depth(tree) > MAX_EXPR_DEPTH:  # explicit: a RecursionError depends on the caller's stack and limit
            raise RecursionError
        value = _eval(tree)
    except SyntaxError as exc:
        return ToolResult(f"not an arithmetic expression: {exc.msg}", "error")
    except (_CalcError, ArithmeticError, ValueError) as exc:  # ZeroDivisionError, OverflowError, ...
        return ToolResult(f"{type(exc).__name__ if not isinstance(exc, _CalcError) else 'error'}: {exc}", "error")
    except (RecursionError, MemoryError):
        return ToolResult("the expression is nested too deeply", "error")
    return ToolResult(repr(value) if isinstance(value, float) else str(value), "ok")


BUILTINS: dict[str, Callable[..., ToolResult]] = {"python": python, "calculator": calculator}


# ------------------------------------------------------------------------------------------ loading


def _schema(fn: Callable[..., Any], spec: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UserError(
            f"tool '{spec}': no JSON schema could be built from it ({exc}). The schema comes from "
            "transformers.utils.get_json_schema, which needs a type hint on every argument and a Google-style "
            "docstring: a one-line description, then an 'Args:' section with one 'name: description' line per "
            "argument. Fix: add them, e.g.\n"
            "    def search(query: str, k: int = 3) -> str:\n"
            '        """Search the notes.\n\n        Args:\n            query: what to look for\n'
            '            k: how many hits to return\n        """'
        ) from None
    schema["function"].pop("return", None)  # chat templates render parameters, not the return type
    return schema


def _builtin_schema(name: str) -> dict:
    fn = BUILTINS[name]
    sig_free = {"python": ("code",), "calculator": ("expression",)}[name]
    schema = _schema(fn, f"builtin:{name}")
    params = schema["function"]["parameters"]
    params["properties"] = {k: v for k, v in params["properties"].items() if k in sig_free}  # the loop's, not the model's
    params["required"] = [k for k in params.get("required", []) if k in sig_free]
    return schema


def load_tool(spec: str, sandbox_limits: dict | None = None) -> Tool:
    """One tool from 'builtin:<name>' or 'package.module:function' (a UserError says how to fix a bad one)."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTINS:
            raise UserError(
                f"unknown built-in tool '{spec}'. Built-in tools: {', '.join('builtin:' + n for n in BUILTINS)}. "
                "Fix: use one of those, or name your own function as 'package.module:function'."
            )
        limits = dict(sandbox_limits or {}) if name == "python" else {}
        return Tool(name, _builtin_schema(name), BUILTINS[name], spec, builtin=True, sandbox_limits=limits)
    split_named(spec, f"tool '{spec}' is not a tool name. A tool is a built-in ({', '.join('builtin:' + n for n in BUILTINS)}) "
                "or your own Python function named 'package.module:function' (for example 'my_tools:search'). "
                "Fix: use one of those forms.")
    try:
        fn = import_named(spec, f"tool '{spec}'")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    schema = _schema(fn, spec)
    return Tool(schema["function"]["name"], schema, fn, spec)


def load_tools(specs: list[str], *, sandbox_limits: dict | None = None) -> dict[str, Tool]:
    """Tools by the name the model calls them (the function's name; 'python', 'calculator' for built-ins).

    `sandbox_limits` (rollout.multi_turn.sandbox: backend, url, limits) sets builtin:python's sandbox; its time
    limit is call_tool's.
    """
    unknown = sorted(set(sandbox_limits or {}) - set(SANDBOX_LIMITS))
    if unknown:
        raise UserError(
            f"unknown sandbox limit(s) {', '.join(unknown)}. The python tool's sandbox takes: {', '.join(SANDBOX_LIMITS)} "
            "(its time limit is the tool call's timeout). Fix: remove or rename them (rollout.multi_turn.sandbox)."
        )
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, sandbox_limits)
        if tool.name in tools:
            raise UserError(
                f"two tools are named '{tool.name}' ('{tools[tool.name].spec}' and '{spec}'); the model calls tools "
                "by name, so names must be unique. Fix: rename one of the functions, or list it once."
            )
        tools[tool.name] = tool
    return tools


# ------------------------------------------------------------------------------------------ calling

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _argument_problems(tool: Tool, arguments: dict) -> list[str]:
    params = tool.schema["function"].get("parameters", {})
    props = params.get("properties", {})
    problems = [f"missing required argument '{k}'" for k in params.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        if key not in props:
            problems.append(f"unknown argument '{key}' (arguments: {', '.join(props) or 'none'})")
            continue
        want = props[key].get("type")
        types = [want] if isinstance(want, str) else want if isinstance(want, list) else []
        if props[key].get("nullable"):  # get_json_schema's spelling of `X | None`
            types = [*types, "null"]
        allowed = tuple(t for name in types for t in _JSON_TYPES.get(name, ()))
        is_bool = isinstance(value, bool)
        if allowed and (not isinstance(value, allowed) or (is_bool and bool not in allowed)):
            problems.append(f"argument '{key}' must be {' or '.join(types)}, got {type(value).__name__} {value!r:.40}")
    return problems


def _text_of(value: Any) -> str:
    """A user tool's return as text the tokenizer takes (a lone surrogate, which no tokenizer encodes, becomes '?')."""
    if isinstance(value, ToolResult):
        text = value.text
    elif value is None:
        text = ""
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    text = str.__str__(text) if isinstance(text, str) else show(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


_stuck_lock = threading.Lock()
_stuck_threads = 0  # user tools still running past their limit (threads cannot be killed)


def _run_in_thread(tool: Tool, arguments: dict, timeout_s: float) -> ToolResult:
    global _stuck_threads
    box: list[ToolResult] = []

    def target() -> None:
        try:
            box.append(ToolResult(_text_of(tool.fn(**arguments)), "ok"))
        except BaseException as exc:  # noqa: BLE001 - a tool's bug costs its call only
            box.append(ToolResult(error_text(exc), "error"))  # its message is user code too

    thread = threading.Thread(target=target, name=f"postrl-tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _stuck_lock:
            _stuck_threads += 1
            stuck = _stuck_threads
        log.warning("tool '%s' is still running after its %g s limit (%d stuck tool threads so far); "
                    "threads cannot be killed, so it keeps running in the background", tool.name, timeout_s, stuck)
        return ToolResult(f"tool '{tool.name}' timed out after {timeout_s:g} s", "timeout")
    return box[0] if box else ToolResult(f"tool '{tool.name}' failed and its error cannot be shown", "error")


def call_tool(tools: dict[str, Tool], name: str, arguments: dict | str | None, timeout_s: float = 10.0,
              *, stats: CallStats | None = None, max_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """Call tool `name` with keyword `arguments` under a time limit; never raises (errors come back as text)."""
    result = _call(tools, name, arguments, timeout_s)
    if len(result.text) > max_chars:
        result = ToolResult(result.text[:max_chars] + f"\n[output cut at {max_chars} characters]", result.status)
    if stats is not None:
        stats.record(result.status)
    return result


def _call(tools: dict[str, Tool], name: str, arguments: dict | str | None, timeout_s: float) -> ToolResult:
    tool = tools.get(name)
    if tool is None:
        return ToolResult(f"unknown tool '{name}'; available tools: {', '.join(tools) or 'none'}", "error")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = load_json(arguments)  # model-written: size, depth and numbers capped
        except ValueError as exc:
            return ToolResult(f"the arguments of '{name}' are not valid JSON ({exc})", "error")
    if not isinstance(arguments, dict):
        return ToolResult(f"the arguments of '{name}' must be a JSON object, got {type(arguments).__name__}", "error")
    problems = _argument_problems(tool, arguments)
    if problems:
        return ToolResult(f"cannot call '{name}': " + "; ".join(problems), "error")
    if tool.builtin:
        try:
            if tool.fn is python:
                return python(timeout_s=timeout_s, limits=tool.sandbox_limits, **arguments)
            return tool.fn(**arguments)
        except Exception as exc:  # noqa: BLE001 - defensive: built-ins return errors, but never raise into the loop
            return ToolResult(error_text(exc), "error")
    return _run_in_thread(tool, arguments, timeout_s)

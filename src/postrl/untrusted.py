"""Reading text a model wrote: bounded in size, nesting depth and time, and never raising into the run.

An RL policy explores, so degenerate text is something it writes on its own: a thousand brackets, a
number with a billion digits, a megabyte of one character, invalid UTF-8 (decoded to U+FFFD) or, from a
client that relays it, lone surrogates. Every reader of such text (tool-call parsing, answer extraction,
the verifiers' fast paths, stop cutting, the judge's and reward model's inputs) goes through this module,
so such a sample costs that sample only, counted, never the run (DESIGN.md section 13):

- `load_json(text)`: JSON under a size and a depth cap with finite numbers only; `Unreadable` (a
  ValueError) otherwise, whatever the parser would have raised (RecursionError, MemoryError).
- `json_object(raw, max_depth)`: a client's request body (the rollout endpoint's, the Tinker server's) as
  a JSON object under a depth cap; `Unreadable` with the message the server answers otherwise.
- `exact_value(d)`: the Fraction of a Decimal, or None past `MAX_EXPONENT`: `Fraction(Decimal("1e-999999999"))`
  builds a billion-digit integer (hours); a size check first costs nothing.
- `wide_decimal()`: a decimal context in which comparing and subtracting `1e999999999` neither overflows
  nor expands it.
- `clean_text(text, max_chars)`: lone surrogates replaced (tokenizers and JSON encoders refuse them),
  and the text cut to a size, keeping its head or its end.
- `guarded(fallback)`: a reader whose input trips a limit anyway (RecursionError, MemoryError, an
  arithmetic or value error) returns `fallback(exc)` (that sample's error) instead of raising.

A refused input is counted: the agent loop counts the tool calls it could not read (`agent/unreadable`,
from `ParseError.unreadable`); a verifier's reader, deep inside a verdict, calls `trip(REWARD_UNREADABLE)`
and `RewardFunction` pops the count of its call into the step's `reward/unreadable` (`pop_tripped`).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import Counter
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, localcontext
from fractions import Fraction
from typing import Any, Callable, ContextManager, TypeVar

from postrl.ipc import json_depth  # in ipc.py, which a child without postrl loads by path; readers of model text take it from here

MAX_JSON_CHARS = 1 << 20  # one tool call's JSON: a megabyte of arguments is far past any honest call
MAX_JSON_DEPTH = 64  # as rollout.agent_max_json_depth's default: deeper than any tool schema nests
MAX_EXPONENT = 1000  # a number whose decimal exponent is larger than this is compared, never expanded
MAX_MATH_DEPTH = 48  # brackets nested deeper than any honest answer: math-verify's parser takes ~10 ms a level

AGENT_UNREADABLE = "agent/unreadable"  # model turns whose tool calls a limit refused (counted by the agent loop)
REWARD_UNREADABLE = "reward/unreadable"  # verifier inputs refused by a limit, scored wrong (counted per step)


class Unreadable(ValueError):
    """Model-written text that a reader refuses: too large, too deep, or not a finite number."""


# ------------------------------------------------------------------------------------------ counts
_lock = threading.Lock()
_tripped: Counter[str] = Counter()


def trip(metric: str) -> None:
    """Count one refused input under `metric` (a lock: a verdict may be reached from more than one thread)."""
    with _lock:
        _tripped[metric] += 1


def pop_tripped(metric: str) -> int:
    """The count under `metric` since the last pop (then zero)."""
    with _lock:
        return _tripped.pop(metric, 0)


T = TypeVar("T")


def guarded(fallback: Callable[[BaseException], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a reader of model-written text: an input that trips a limit inside it anyway (RecursionError,
    MemoryError, an arithmetic or value error) is answered with `fallback(exc)`, that sample's error, which
    its caller counts. The readers are bounded by construction; this is the line behind them, never the plan."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def reader(*args: Any, **kwargs: Any) -> T:
            try:
                return fn(*args, **kwargs)
            except (RecursionError, MemoryError, ArithmeticError, ValueError) as exc:
                return fallback(exc)

        return reader

    return wrap


# ------------------------------------------------------------------------------------------- JSON
def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Unreadable(f"the number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise Unreadable(f"{name} is not a JSON number")


def bracket_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} in `text` (unbalanced closers ignored), in one linear pass."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def load_json(text: str, max_chars: int = MAX_JSON_CHARS, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)` for model-written text: `Unreadable` when it is longer than `max_chars`, nests deeper
    than `max_depth`, or holds NaN / Infinity / a float that overflows; json's own ValueError when it is not
    JSON. Integers past Python's 4300 digits are json's ValueError too."""
    if len(text) > max_chars:
        raise Unreadable(f"it is {len(text)} characters long, more than {max_chars}")
    try:
        value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (RecursionError, MemoryError):
        raise Unreadable(f"it nests deeper than {max_depth} levels") from None
    if json_depth(value, max_depth) > max_depth:
        raise Unreadable(f"it nests deeper than {max_depth} levels")
    return value


def json_object(raw: bytes | str, max_depth: int, setting: str = "") -> dict:
    """A request body (a client's JSON, the rollout endpoint's and the Tinker server's): `raw` as a JSON object
    nesting at most `max_depth` levels; else `Unreadable` saying which of those it is not (`setting`, when
    given, names the limit: its message ends "(<setting>)")."""
    deep = f"the body nests deeper than {max_depth} levels" + (f" ({setting})" if setting else "")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Unreadable(deep) from None
    except ValueError as exc:
        raise Unreadable(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Unreadable("the body must be a JSON object")
    if json_depth(body, max_depth) > max_depth:
        raise Unreadable(deep)
    return body


# ---------------------------------------------------------------------------------------- numbers
def wide_decimal() -> ContextManager[Context]:
    """A decimal context for comparing numbers a model wrote: the widest exponents (so `1e999999999 - 5`
    rounds instead of raising Overflow), 28 digits (so nothing is ever expanded to its full length)."""
    return localcontext(Context(prec=28, Emax=MAX_EMAX, Emin=MIN_EMIN))


def exact_value(d: Decimal) -> Fraction | None:
    """The exact value of a finite Decimal, or None when its exponent is past `MAX_EXPONENT` either way (the
    Fraction would hold an integer of that many digits) or it has more digits than that."""
    if not d.is_finite():
        return None
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    if abs(exponent) > MAX_EXPONENT or len(digits) > MAX_EXPONENT:
        return None
    return Fraction(d)


# ------------------------------------------------------------------------------------------- text
def clean_text(text: str, max_chars: int | None = None, keep: str = "head") -> str:
    """`text` with lone surrogates replaced by U+FFFD (a client's JSON can carry them; a tokenizer or a JSON
    encoder raises on them), cut to `max_chars` keeping its `head` or its `end`."""
    assert keep in ("head", "end"), f"keep is 'head' or 'end', not {keep!r}"
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] if keep == "head" else text[len(text) - max_chars :]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text

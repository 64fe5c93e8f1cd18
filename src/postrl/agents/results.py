"""What users' agent programs and environments hand back, checked before anything of ours uses it.

Every place such a value enters goes through these functions: a program's return in process
(agents/endpoint/scheduler.py `finish`) and from a worker process (agents/programs/workers.py, both ends), an
environment's step (agents/loop/env.py `checked_step`), a verifiers rollout's reward and metrics
(agents/verifiers/env.py). Each returns the value as postrl's own type or raises `BadResult`, whose
message says what was wrong; the caller makes that the sample's error, counted (agent/errors,
agent/env_invalid, rubric/failed), never an exception in a shared thread.

- `reward`: an int or float (any `numbers.Real`, not a bool) that fits a float, finite, within
  +-MAX_REWARD (rewards are summed, normalised and cast to float32 downstream: 1e300 is an inf there).
- `metrics`: a dict of at most MAX_METRICS names (str, at most MAX_NAME_CHARS) to such numbers.
- `flag`: a bool (numpy's too).
- `text`: a str (None is "") of at most MAX_TEXT_CHARS characters that encodes as UTF-8 (no lone
  surrogates, which no tokenizer takes).

A bad value is described without calling its own `repr` (user code; an int of a million digits has no
`repr` at all past Python's int-to-str limit).
"""

from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any

MAX_REWARD = 1e6
MAX_METRICS = 256
MAX_NAME_CHARS = 128
MAX_TEXT_CHARS = 2**20
MAX_ERROR_CHARS = 2000


class BadResult(ValueError):
    """A value from user code that is not of the declared type, size or range."""


class _Show(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if x.bit_length() <= 64 else f"<an int of {x.bit_length()} bits>"

    def repr_instance(self, x: Any, level: int) -> str:  # a user's class: its type, not its __repr__
        return f"<{type(x).__module__}.{type(x).__qualname__}>"


_SHOW = _Show()
_SHOW.maxstring = _SHOW.maxother = 60


def show(value: Any) -> str:
    """A short description of `value` that runs none of its code."""
    if type(value) in (bool, int, float, str, bytes, list, tuple, dict, set, frozenset) or value is None:
        return f"{type(value).__name__} {_SHOW.repr(value)}"
    return _SHOW.repr_instance(value, 0)


def number(value: Any, what: str, bound: float = MAX_REWARD) -> float:
    """`value` as a finite float within +-bound; BadResult naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadResult(f"{what} is {show(value)}; it must be a number")
    try:
        x = float(value)
    except Exception:  # noqa: BLE001 - an int past float's range (OverflowError), or a Real of the user's own
        raise BadResult(f"{what} is {show(value)}, which does not fit a float") from None
    if not math.isfinite(x) or abs(x) > bound:
        raise BadResult(f"{what} is {x!r}; it must be a finite number within +-{bound:g}")
    return x


def reward(value: Any, what: str = "the reward") -> float:
    return number(value, what)


def metrics(value: Any, what: str = "the metrics") -> dict[str, float]:
    """`value` as {name: finite float}, at most MAX_METRICS names."""
    if not isinstance(value, dict):
        raise BadResult(f"{what} is {show(value)}; it must be a dict of names to numbers")
    if len(value) > MAX_METRICS:
        raise BadResult(f"{what} has {len(value)} names; at most {MAX_METRICS} are taken")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k or len(k) > MAX_NAME_CHARS:
            raise BadResult(f"{what}: the name {show(k)} is not a str of 1 to {MAX_NAME_CHARS} characters")
        out[k] = number(v, f"{what}['{k}']")
    return out


def flag(value: Any, what: str) -> bool:
    """`value` as a bool: a bool, or numpy's."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise BadResult(f"{what} is {show(value)}; it must be a bool")


def text(value: Any, what: str) -> str:
    """`value` as a str of at most MAX_TEXT_CHARS characters that encodes as UTF-8; None is ""."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadResult(f"{what} is {show(value)}; it must be a str")
    if len(value) > MAX_TEXT_CHARS:
        raise BadResult(f"{what} has {len(value)} characters; at most {MAX_TEXT_CHARS} are taken")
    try:
        str.encode(value, "utf-8")
    except UnicodeEncodeError as exc:
        raise BadResult(f"{what} does not encode as UTF-8 ({exc.reason} at {exc.start})") from None
    return str.__str__(value)  # a str subclass of the user's: a plain str from here


def error_text(exc: BaseException) -> str:
    """An exception the user's code raised as `Type: message`, at most MAX_ERROR_CHARS; its `str` is user code."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that raises, an int argument past the int-to-str limit
        message = "<its message cannot be shown>"
    return f"{type(exc).__name__}: {message}"[:MAX_ERROR_CHARS]

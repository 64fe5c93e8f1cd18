"""User tools for tests, named as 'tools_for_tests:<fn>' (a user's 'package.module:function')."""

from __future__ import annotations

import time


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def lookup(city: str, units: list[str] | None = None) -> dict:
    """Look a city's weather up.

    Args:
        city: The city's name.
        units: Units to report, e.g. ["celsius"].
    """
    return {"city": city, "temperature": 21, "units": units or ["celsius"]}


def fails(x: int) -> int:
    """Always raises, as a buggy tool would.

    Args:
        x: Any number.
    """
    raise RuntimeError(f"no luck with {x}")


def hangs(seconds: float) -> str:
    """Sleeps past any test's time limit, as a tool stuck on the network would.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def undocumented(x: int) -> int:
    return x


NOT_A_FUNCTION = 3

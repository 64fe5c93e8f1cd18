"""User-facing errors.

A `UserError` is a problem the user can fix (bad config, malformed data, missing model). The CLI
prints its message (what is wrong, why it matters, how to fix it) without a traceback and exits
non-zero. Internal invariants use `assert` instead.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input; `problems` holds one message per problem."""

    def __init__(self, *problems: str, title: str = "postrl cannot continue"):
        self.problems = [p for p in problems if p]
        self.title = title
        super().__init__("\n".join(self.problems))


class Stopped(Exception):
    """The run stopped on a signal (SIGTERM, SIGINT) after saving a checkpoint; the CLI exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"stopped on signal {signum}")
        self.signum = signum

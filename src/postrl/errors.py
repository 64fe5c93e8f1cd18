"""User-facing errors.

A `UserError` is a problem the user can fix (bad config, malformed data, missing model). The CLI
prints its message (what is wrong, why it matters, how to fix it) without a traceback and exits
non-zero. Internal invariants use `assert` instead.

The all-fail rule lives here too, below every package that applies it (rewards/, agents/): a source that
fails on nearly every call of a batch stops the run with a UserError of its own words.
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


# One rule for every reward source (verifiers, environments, the reward model, the judge): a source that fails
# on this share of its calls in one batch stops the run, when the batch gave it at least this many calls.
FAIL_ALL_SHARE = 0.95
FAIL_ALL_MIN_CALLS = 4


def fails_nearly_always(n_calls: int, n_failed: int) -> bool:
    """Whether `n_failed` of `n_calls` in one batch is past the rule above (too few calls: never)."""
    return n_calls >= FAIL_ALL_MIN_CALLS and n_failed >= FAIL_ALL_SHARE * n_calls

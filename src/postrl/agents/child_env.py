"""The environment variables a process postrl starts for user code gets: an allowlist, not the trainer's whole set.

Agent program workers (agents/program_workers.py) and verifiers environment processes (agents/verifiers_env.py)
run code postrl does not control. They start from `child_env(passthrough)`: the names below, which say where
things are and how to run (the search path, the home directory, the locale, the time zone, the scratch
directory, Python's own PYTHON* settings, where the Hugging Face caches live and whether to stay offline),
plus the names the user lists in `rollout.agent_env_passthrough` (an API key the program needs, a proxy, a CA
bundle). Everything else of the trainer's environment (HF_TOKEN, WANDB_API_KEY, cloud credentials, proxies)
stays behind. Nothing here is needed to reach postrl's endpoint: each program gets its session's URL and key
in its `openai` client.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# Where things are and how to run; no name here holds a credential.
ALLOWED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "TMPDIR", "LANG", "LANGUAGE",
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
})  # fmt: skip
ALLOWED_PREFIXES = ("LC_", "PYTHON")  # the locale's categories; Python's own variables (PYTHONPATH, PYTHONHASHSEED...)


def child_env(passthrough: Iterable[str] = (), extra: Mapping[str, str] | None = None, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted names of `source` (default: this process's environment), the `passthrough` names it has,
    then `extra` (values postrl sets for the child) over them."""
    source = os.environ if source is None else source
    keep = set(passthrough)
    env = {k: v for k, v in source.items() if k in ALLOWED or k.startswith(ALLOWED_PREFIXES) or k in keep}
    env.update(extra or {})
    return env

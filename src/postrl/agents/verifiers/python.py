"""Which interpreter runs a `verifiers` environment (rollout.environment_python), and what keeps one from it.

A leaf module (the standard library only): the machine checks (postrl/checks.py) and the environment's bridge
(agents/verifiers/env.py) both use it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CHECK = (
    "import importlib.metadata as m, importlib.util as u, sys\n"
    "print(m.version('verifiers') if u.find_spec('verifiers') else '')"
)
_FIX = (
    "Fix: pip install 'postrl[verifiers]' (verifiers>=0.1.14,<0.2) into this environment, or point "
    "rollout.environment_python at an interpreter of a venv that has it (python -m venv .venv-verifiers && "
    ".venv-verifiers/bin/pip install 'verifiers==0.1.14' plus your environment's package; `make setup` builds "
    "that venv for this repository)."
)


def interpreter_problems(python: str | None) -> list[str]:
    """What keeps `python` (None: this interpreter) from running a verifiers environment: missing, or without
    verifiers 0.1.x. One subprocess that does not import verifiers (a few tens of ms)."""
    exe = python or sys.executable
    if python is not None and not Path(python).expanduser().exists():
        return [f"rollout.environment_python '{python}' does not exist. {_FIX}"]
    try:
        out = subprocess.run([str(Path(exe).expanduser()), "-c", _CHECK], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"rollout.environment_python '{exe}' does not run ({type(exc).__name__}: {exc}). {_FIX}"]
    version = out.stdout.strip()
    where = f"rollout.environment_python '{python}'" if python else f"this interpreter ({exe}; rollout.environment_python unset)"
    if out.returncode != 0 or not version:
        return [f"rollout.environment runs a verifiers environment, but {where} cannot import verifiers. {_FIX}"]
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor != (0, 1):
        return [
            f"rollout.environment: {where} has verifiers {version}; postrl runs the classic API of verifiers 0.1.x "
            "(load_environment, ToolEnv, MultiTurnEnv, Rubric), which verifiers 0.2+ replaced (0.4: verifiers.v1). "
            f"{_FIX}"
        ]
    return []

"""The environment variables a process postrl starts gets: an allowlist, not the trainer's whole set.

Every child process starts from it (DESIGN.md section 13): agent program workers (agents/programs/workers.py) and
verifiers environments (agents/verifiers/env.py), which run code postrl does not control; the verifier pool
(rewards/pool.py), whose sympy evaluates model-written text; the rollout worker (placement/worker.py) and the pool
replicas (placement/pool.py, replica.py), which parse model output and run agents in-process. The sandbox's code
gets less still (agents/sandbox/sandbox.py: PATH, the locale, its own working directory as HOME).

What passes, and why:
- ALLOWED: where things are and how to run (the search path, the locale, the time zone, the scratch directory,
  Python's own PYTHON* settings, whether Hugging Face stays offline); no name here holds a credential;
- THREADS_AND_DEVICES: how many threads a child may spin (the trainer's thread policy sets these) and which
  accelerators it sees; without them a child oversubscribes the cores or grabs another rank's device;
- caches by their resolved paths (`cache_env`): the Hugging Face hub and datasets caches (HF_HUB_CACHE,
  HF_DATASETS_CACHE), postrl's own (POSTRL_CACHE) and Python's user base (PYTHONUSERBASE), so a child finds the
  models and data the trainer downloaded and the packages installed with `pip install --user`, but never
  HF_HOME itself: its `token` file is the one credential a cache directory holds;
- HOME: a fresh empty directory (`empty_home`), so `~/.cache/huggingface/token`, `~/.netrc`, `~/.aws` and the
  like are not where a child's libraries look for them;
- for postrl's own rollout processes only (`rollout=True`), the engines' settings: VLLM_*, NCCL_*, TORCH*, CUDA_*,
  TRITON_*, ... (ENGINE_PREFIXES), except any name that looks like a credential (…KEY, …TOKEN, …SECRET), and
  Ray's own RAY_* whole (a Ray worker needs its cluster's settings, an auth token included, to start);
- the names the user lists: `rollout.agent_env_passthrough` (an API key the program needs, a proxy, a CA bundle)
  and `reward.env_passthrough` (a verifier that calls a service).
Everything else of the trainer's environment (HF_TOKEN, WANDB_API_KEY, OPENAI_API_KEY, AWS_*, ...) stays behind.
Nothing here is needed to reach postrl's endpoint: each program gets its session's URL and key in its `openai` client.

What this does not do: a process of the same uid can still read another's /proc/PID/environ (the trainer's
included) and any file the uid may read. The allowlist keeps credentials out of what libraries pick up by
themselves; keeping code that is hostile away from them is the sandbox's job (agents/sandbox/sandbox.py: its own
PID namespace, uid and file system).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path

ALLOWED = frozenset({
    "PATH", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "TMPDIR", "LANG", "LANGUAGE",
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
})  # fmt: skip
ALLOWED_PREFIXES = ("LC_", "PYTHON")  # the locale's categories; Python's own variables (PYTHONPATH, PYTHONHASHSEED...)
THREADS_AND_DEVICES = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD", "MALLOC_CONF",
})  # fmt: skip
# Settings of the engines and collectives that postrl's own rollout processes run (vLLM, NCCL / Gloo / HCCL, torch,
# Triton, CUDA, Ray's own): these tune how they run, and a rollout worker without them behaves unlike the trainer.
ENGINE_PREFIXES = ("VLLM_", "NCCL_", "GLOO_", "TP_", "HCCL_", "ASCEND_", "TORCH", "PYTORCH_", "TRITON_", "CUDA_",
                   "NVIDIA_", "HIP_", "ROCM_", "POSTRL_")  # fmt: skip
# Ray's own settings, kept whole for the rollout processes: a Ray worker process needs them to join its cluster
# (RAY_AUTH_MODE and its token among them: without them the replica's process dies at start).
RAY_PREFIX = "RAY_"
_CREDENTIAL = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a passthrough entry must look like (config/schema.py checks it)


@lru_cache(maxsize=1)
def empty_home() -> str:
    """A fresh empty directory, one per process, that its children get as HOME (removed when the process exits)."""
    path = tempfile.mkdtemp(prefix="postrl-home-")
    atexit.register(shutil.rmtree, path, True)
    return path


def cache_env(source: Mapping[str, str]) -> dict[str, str]:
    """The caches a child needs, by their resolved paths (as `source`'s HOME and HF_HOME place them): the Hugging
    Face hub and datasets caches and postrl's own; never HF_HOME, whose `token` file is a credential."""
    home = Path(source.get("HOME") or Path.home())
    hf_home = Path(source.get("HF_HOME") or Path(source.get("XDG_CACHE_HOME") or home / ".cache") / "huggingface")
    return {
        "HF_HUB_CACHE": source.get("HF_HUB_CACHE") or source.get("HUGGINGFACE_HUB_CACHE") or str(hf_home / "hub"),
        "HF_DATASETS_CACHE": source.get("HF_DATASETS_CACHE") or str(hf_home / "datasets"),
        "POSTRL_CACHE": source.get("POSTRL_CACHE") or str(home / ".cache" / "postrl"),
        "PYTHONUSERBASE": source.get("PYTHONUSERBASE") or str(home / ".local"),  # `pip install --user` packages stay found
    }


def child_env(passthrough: Iterable[str] = (), extra: Mapping[str, str] | None = None, source: Mapping[str, str] | None = None,
              rollout: bool = False) -> dict[str, str]:  # fmt: skip
    """The environment of a child process: the allowlisted names of `source` (default: this process's environment),
    the caches by path, HOME an empty directory, the engines' settings when `rollout` (postrl's own rollout
    processes), the `passthrough` names `source` has (HOME too, if listed), then `extra` (values postrl sets) over them."""
    source = os.environ if source is None else source
    keep = set(passthrough)

    def allowed(name: str) -> bool:
        if name in ALLOWED or name in THREADS_AND_DEVICES or name.startswith(ALLOWED_PREFIXES):
            return True
        return rollout and (name.startswith(RAY_PREFIX) or name.startswith(ENGINE_PREFIXES) and not _CREDENTIAL.search(name))

    env = {k: v for k, v in source.items() if allowed(k)}
    env.update(cache_env(source))
    env["HOME"] = empty_home()
    env.update({k: v for k, v in source.items() if k in keep})
    env.update(extra or {})
    return env


def scrub_environ(passthrough: Iterable[str] = (), rollout: bool = False) -> None:
    """Make this process's own environment `child_env`'s: the first act of a child that `multiprocessing` or Ray
    started with its parent's whole environment (neither lets the parent choose it), before it reads any model
    output. Children it starts in turn then inherit only this."""
    import sys

    env = child_env(passthrough, rollout=rollout)
    os.environ.clear()
    os.environ.update(env)
    hub = sys.modules.get("huggingface_hub.constants")  # imported before the scrub: it placed the token under the old HF_HOME
    if hub is not None:
        hub.HF_TOKEN_PATH = os.path.join(env["HOME"], "token")
        hub.HF_STORED_TOKENS_PATH = os.path.join(env["HOME"], "stored_tokens")

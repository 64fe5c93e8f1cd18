"""A verl reward file as a postrl verifier, unchanged: `custom_reward_function.path` + `.name`.

verl users keep their scoring in a file with verl's signature
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict` (a dict holds
"score" and other values). postrl names it `verl:<path>:<name>` in `reward.verifiers` (convert-config writes
that from the two keys) and calls it as verl's naive reward manager does, with keyword arguments:

- data_source: the row's `data_source`;
- solution_str: the completion text (what the policy wrote, special tokens skipped);
- ground_truth: the row's `reward_model.ground_truth` as stored (not made a string), else postrl's ground truth;
- extra_info: a copy of the row's `extra_info` dict with `num_turns` and `rollout_reward_scores` added as verl adds
  them (`num_turns` is None: postrl does not hand turn counts to verifiers; `rollout_reward_scores` {});
- and `custom_reward_function.reward_kwargs` as further keywords (the verifier's `kwargs` in reward.verifiers),
  as verl binds them with functools.partial.

The file may also be `pkg://package.module` (verl's form for an importable module). The verifier runs in the
verifier worker pool under `reward.timeout_s` like any user verifier: `VerlScore` pickles as (path, name) and
loads the file once in each worker. A coroutine function is run to completion in the worker.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from pathlib import Path
from typing import Any, Callable

from postrl.utils import load_file_module

PREFIX = "verl:"
_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}  # per process: (path, name) -> the function


def _load(path: str, name: str) -> Callable[..., Any]:
    """The function `name` of the file (or pkg:// module) at `path`; a ValueError says what is wrong."""
    key = (path, name)
    if key in _LOADED:
        return _LOADED[key]
    if path.startswith("pkg://"):
        try:
            module = importlib.import_module(path.removeprefix("pkg://").replace("/", "."))
        except Exception as exc:  # noqa: BLE001 - ImportError, or the module's own error on import
            raise ValueError(f"could not import {path} ({type(exc).__name__}: {exc})") from None
    else:
        module = load_file_module(path.removeprefix("file://"), "postrl_verl_reward_")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function '{name}'")
    _LOADED[key] = fn
    return fn


class VerlScore:
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` as a postrl verifier
    `(completion, ground_truth, row)`; pickled as (path, name), so it runs in the verifier worker pool."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name

    def __reduce__(self):
        return (VerlScore, (self.path, self.name))

    def function(self) -> Callable[..., Any]:
        return _load(self.path, self.name)

    def __call__(self, completion: str, ground_truth: str, row: dict, **reward_kwargs: Any) -> Any:
        fn = _load(self.path, self.name)
        reward_model = row.get("reward_model")
        truth = reward_model["ground_truth"] if isinstance(reward_model, dict) and "ground_truth" in reward_model else ground_truth
        extra_info = dict(row.get("extra_info") or {})
        extra_info["num_turns"] = None
        extra_info["rollout_reward_scores"] = {}
        out = fn(data_source=row.get("data_source"), solution_str=completion, ground_truth=truth, extra_info=extra_info, **reward_kwargs)
        return asyncio.run(out) if inspect.isawaitable(out) else out


def parse(spec: str) -> tuple[str, str]:
    """(path, function name) of 'verl:<path>:<name>' (the name defaults to verl's compute_score)."""
    rest = spec.removeprefix(PREFIX)
    path, sep, name = rest.rpartition(":")
    if not sep or "/" in name or name.endswith(".py"):
        path, name = rest, "compute_score"
    return path, name


def verl_verifier(spec: str) -> VerlScore:
    """The verifier a 'verl:<path>:<name>' spec names, loaded once here so that a wrong path or name is reported
    with the config's other problems (ValueError: what, why, how to fix)."""
    path, name = parse(spec)
    if not path.startswith("pkg://"):
        path = str(Path(path.removeprefix("file://")).resolve())  # the worker processes resolve it the same way
    try:
        fn = _load(path, name)
    except ValueError as exc:
        raise ValueError(
            f"verifier '{spec}' (verl's custom_reward_function) could not be loaded: {exc}. It names a Python file and "
            "a function with verl's signature compute_score(data_source, solution_str, ground_truth, extra_info=None). "
            "Fix: correct the path (relative to the directory you run postrl from) or the function name."
        ) from None
    params = inspect.signature(fn).parameters
    wanted = ("data_source", "solution_str", "ground_truth", "extra_info")
    missing = [p for p in wanted if p not in params and not any(v.kind is v.VAR_KEYWORD for v in params.values())]
    if missing:
        raise ValueError(
            f"verifier '{spec}': {name}{inspect.signature(fn)} does not take {', '.join(missing)}, and verl calls it "
            f"with the keywords {', '.join(wanted)}. Fix: give it verl's signature, or name it as a postrl verifier "
            "'package.module:function' taking (completion, ground_truth, row)."
        )
    return VerlScore(path, name)

"""What this machine lacks for a run, checked before anything starts: input files and model directories
(postrl.preflight), the logging sinks' packages, the agent loop's tools and environment, isolation for
builtin:python, an interpreter for a verifiers environment.

`load_config` is the config as `postrl train` and `check-config` take it: read and validated by
postrl.config (which knows nothing of this machine), then checked here, every problem at once as one
UserError; the guides' verl-style overrides on a command line are translated here (postrl.guides). It
stands above postrl.config, postrl.guides, postrl.agents, postrl.rewards and postrl.preflight, so the
config that every module reads stands on none of them; it hands the config the rewards registry's
verifier-name resolver, so a typo in reward.verifiers is reported with the config's other problems.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from postrl.agents.loop.env import load_environment
from postrl.agents.sandbox.sandbox import refusal
from postrl.agents.tools.tools import load_tools
from postrl.agents.verifiers.python import interpreter_problems
from postrl.config import Config, build_config, is_config_key, read_config
from postrl.config.schema import VERIFIER_CHECK
from postrl.errors import UserError
from postrl.guides import convert_verl, split_overrides
from postrl.preflight import looks_like_hub_id, run_model_problems
from postrl.rewards.registry import verifier_problems


def load_config(path: str | Path | None, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Load a YAML file, apply dotted overrides (the guides' verl-style ones translated), validate
    (`postrl.config.read_config`); optionally check this machine (`environment_problems`: input paths exist,
    the logging sinks' packages are installed, ...)."""
    verl, native = guides_overrides(overrides or [])
    cfg = read_config(path, native, context={VERIFIER_CHECK: verifier_problems}, translated=verl)
    if check_paths:
        problems = environment_problems(cfg)
        if problems:
            source = str(path) if path else "command line"
            raise UserError(*problems, title=f"{source}: {len(problems)} problem(s) in the configuration")
    return cfg


def validate_tree(tree: dict, source: str = "config") -> Config:
    """`config.build_config` with the verifier names resolved by the rewards registry (a typo or a function
    that does not take its kwargs is reported with the config's other problems); nothing of this machine."""
    return build_config(tree, source, {VERIFIER_CHECK: verifier_problems})


def guides_overrides(overrides: list[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """verl-style overrides (`actor_rollout_ref.rollout.n=8`, `data.train_batch_size=4`) translated through
    postrl.guides' table, and the postrl overrides left as they are. A verl key with no postrl counterpart
    is reported as a warning with what postrl offers instead, so a guide's command line still runs."""
    verl, native = split_overrides(overrides, is_config_key)
    if not verl:
        return [], native
    conv = convert_verl(verl)
    for u in conv.unmapped:
        logging.getLogger("postrl.config").warning("override %s=%r not applied: %s", u.source, u.value, u.instead)
    return list(conv.flat().items()), native


def path_problems(cfg: Config) -> list[str]:
    """Input files and model paths that do not exist (checked before anything starts)."""
    problems = []
    mp = cfg.model.path
    if not mp.startswith("builtin:") and not mp.endswith(".gguf") and not Path(mp).expanduser().exists() and not looks_like_hub_id(mp):
        problems.append(
            f"model.path: '{mp}' does not exist. The policy is loaded from a Hugging Face model directory. "
            "Fix: point model.path at a directory with config.json (for the tiny default, run "
            "`postrl sft configs/tiny_sft.yaml` first, as `make run` does), or use 'builtin:tiny-qwen2'."
        )
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for f in files:
            if not f.startswith(("builtin:", "verifiers:")) and not Path(f).expanduser().exists():
                problems.append(f"{key}: file '{f}' does not exist. Fix: run `postrl preprocess` or correct the path.")
    # every model the run loads: kind, tokenizer, vocab fit
    return problems + [p for p in run_model_problems(cfg) if not (problems and p.startswith(f"model.path: '{mp}' does not"))]


def agent_problems(cfg: Config) -> list[str]:
    """The agent loop's tools and environment imported and shape-checked (a tool's schema from its hints and
    docstring; an environment's reset and step), as the verifiers are at validation."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return []
    problems = []
    for check, arg in ((load_tools, list(mt.tools)), (load_environment, mt.interaction)):
        try:
            if arg:
                check(arg)
        except UserError as exc:
            problems += [p if p.startswith("rollout.") else f"rollout.multi_turn: {p}" for p in exc.problems]
    return problems


def environment_problems(cfg: Config) -> list[str]:
    """What this machine lacks for the run: missing input paths and models, uninstalled sink packages, tools and
    environments that do not import, isolation for builtin:python, an interpreter for a verifiers environment."""
    return path_problems(cfg) + missing_packages(cfg.logging) + agent_problems(cfg) + sandbox_problems(cfg) + verifiers_problems(cfg)


def verifiers_problems(cfg: Config) -> list[str]:
    """rollout.environment: an interpreter that imports verifiers 0.1.x (the environment itself loads at start)."""
    if not cfg.rollout.environment:
        return []
    return interpreter_problems(cfg.rollout.environment_python)


def missing_packages(logging_cfg: Any) -> list[str]:
    """One problem per logging sink whose optional package is not installed on this machine."""
    # find_spec, not import: wandb / swanlab take seconds to import and start threads.
    # Each optional sink's package and the pip extra that installs it carry the sink's name.
    return [
        f"logging.sinks: the '{sink}' sink needs the {sink} package, which is not installed here; the run "
        f"would stop with ModuleNotFoundError after loading the model. Fix: pip install 'postrl[{sink}]', "
        f"or remove {sink} from logging.sinks."
        for sink in dict.fromkeys(logging_cfg.sinks)
        if sink in ("tensorboard", "wandb", "swanlab") and importlib.util.find_spec(sink) is None
    ]


def sandbox_problems(cfg: Config) -> list[str]:
    """builtin:python on the local backend where this machine cannot isolate it (postrl.agents.sandbox.sandbox.refusal)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or "builtin:python" not in mt.tools or mt.sandbox.backend != "local":
        return []
    why = refusal(mt.sandbox.require_isolation)
    return [f"rollout.multi_turn.tools: {why}"] if why else []

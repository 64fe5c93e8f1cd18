"""Reading the run configuration: a YAML file, dotted overrides, validation with every problem reported at
once as a UserError (what, why, how to fix), the notes on keys without effect. The guides' verl-style
overrides are translated by postrl.guides, and what this machine lacks for the run is checked, in
postrl.checks (it stands above both).
"""

from __future__ import annotations

import difflib
import logging
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from postrl.config.rules import _needs_critic
from postrl.config.schema import Config
from postrl.errors import UserError
from postrl.yaml_bounded import FIX, TooLarge, load


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`a.b=1` pairs; values are parsed as YAML (so 0.3 is a float, [a,b] a list, null None)."""
    out, bad = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            bad.append(
                f"override '{item}' is not of the form section.key=value. "
                "Fix: write it like algorithm.clip_ratio_high=0.3."
            )
            continue
        try:
            value = load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        except TooLarge as exc:
            bad.append(f"override '{key}=...': {exc}. {FIX}")
            continue
        out.append((key, value))
    if bad:
        raise UserError(*bad, title="bad command-line overrides")
    return out


def _describe_error(err: dict, cfg_cls: type[BaseModel]) -> list[str]:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        section_cls = _section_at(cfg_cls, err["loc"][:-1])
        valid = sorted(section_cls.model_fields) if section_cls else []
        key = str(err["loc"][-1])
        guess = difflib.get_close_matches(key, valid, n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        where = ".".join(str(p) for p in err["loc"][:-1]) or "the top level"
        return [
            f"{loc}: unknown key '{key}' in {where}; a misspelt key would be silently ignored, so it is refused."
            f"{hint} Valid keys: {', '.join(valid)}."
        ]
    if kind == "missing":
        return [f"{loc}: required but missing. Fix: set {loc} in the YAML or as {loc}=... on the command line."]
    if kind in ("value_error", "assertion_error"):
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        prefix = f"{loc}: " if loc else ""
        return [prefix + line for line in msg.split("\n") if line]
    got = err.get("input")
    got_s = repr(got) if not isinstance(got, dict) else "a mapping"
    field = _field_at(cfg_cls, err["loc"])
    why = f" {field.description.rstrip('.')}." if field is not None and field.description else ""
    return [f"{loc}: {err['msg'].rstrip('.')} (got {got_s}).{why} Fix: set {loc} to a valid value."]


def _field_at(cls: type[BaseModel], loc: tuple):
    section = _section_at(cls, loc[:-1])
    return section.model_fields.get(str(loc[-1])) if section is not None and loc else None


def _section_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        ann = next((a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)  # X | None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return None
    return cls


def build_config(tree: dict, source: str = "config", context: dict | None = None) -> Config:
    """Validate a config tree; raise a UserError that lists every problem. `context` is pydantic's validation
    context: what the layers above hand the schema (VERIFIER_CHECK, the rewards registry's name resolver)."""
    try:
        return Config.model_validate(tree, context=context)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            problems.extend(_describe_error(err, Config))
        problems += [p for p in _cross_section_problems(tree, exc, context) if p not in problems]
        raise UserError(*problems, title=f"{source}: {len(problems)} problem(s) in the configuration") from None


def _cross_section_problems(tree: dict, exc: ValidationError, context: dict | None) -> list[str]:
    """The checks of a section or across sections (model validators such as Config._derive), which pydantic
    skips while a field below them is bad: run again on the tree with the bad keys at their defaults, keeping
    the problems that do not mention a key that was reset."""
    import copy

    trial, reset, found = copy.deepcopy(tree), [], []
    for _ in range(3):
        for err in exc.errors():
            node, loc = trial, [str(p) for p in err["loc"]]
            for depth, part in enumerate(loc):  # drop the deepest key of the error's path that the tree has
                if not isinstance(node, dict) or part not in node:
                    break
                if depth == len(loc) - 1 or not isinstance(node[part], dict) or loc[depth + 1] not in node[part]:
                    del node[part]
                    reset.append(".".join(loc[: depth + 1]))
                    break
                node = node[part]
        trial.setdefault("model", {}).setdefault("path", "builtin:tiny-qwen2")
        try:
            Config.model_validate(trial, context=context)
            break
        except ValidationError as again:
            exc = again
            found += [p for err in exc.errors() for p in _describe_error(err, Config) if not any(k in p for k in reset)]
    return list(dict.fromkeys(found))


def read_yaml_mapping(path: str | Path, example: str, keys: str) -> dict:
    """The mapping at the top of a YAML file; a missing file, bad YAML, one past the bounds of postrl.yaml_bounded
    (an alias bomb, deep nesting) or a non-mapping is a UserError."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist. Fix: pass the path of a YAML file, e.g. {example}.")
    try:
        tree = load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    except TooLarge as exc:
        raise UserError(f"{path}: {exc}. {FIX}") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path} must hold a mapping of {keys}, not {type(tree).__name__}.")
    return tree


def is_config_key(dotted: str) -> bool:
    """Whether a dotted key names a field of the config (`train.lr`), not a section or an unknown key."""
    loc = tuple(dotted.split("."))
    return _section_at(Config, loc[:-1]) is not None and loc[-1] in _section_at(Config, loc[:-1]).model_fields


def read_config(path: str | Path | None, overrides: list[str] | None = None, context: dict | None = None,
                translated: list[tuple[str, Any]] = ()) -> Config:
    """Load a YAML file, apply `translated` (dotted key, value) pairs then the dotted overrides, validate
    (`context`: see build_config), log the notes on keys without effect. Nothing of this machine is checked
    here: `postrl.checks.load_config` adds that (paths, models, packages, tools), translates the guides'
    verl-style overrides and hands down the verifier-name resolver."""
    tree: dict = {}
    source = str(path) if path else "command line"
    if path is not None:
        tree = read_yaml_mapping(path, example="configs/tiny_dapo.yaml", keys="sections (model:, data:, ...)")
    for key, value in translated:
        _set_dotted(tree, key, value)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    cfg = build_config(tree, source, context)
    for note in config_notes(cfg):
        logging.getLogger("postrl.config").warning("note: %s", note)
    return cfg


def config_notes(cfg: Config) -> list[str]:
    """Keys that are set but have no effect on this run (said once, not refused: an override may switch a part off)."""
    notes, mt = [], cfg.rollout.multi_turn
    if not mt.enable and (mt.tools or mt.interaction):
        what = " and ".join(k for k, v in (("tools", mt.tools), ("interaction", mt.interaction)) if v)
        notes.append(
            f"rollout.multi_turn.{what} is set but rollout.multi_turn.enable is false, so the run is single-turn and "
            "never offers them; set rollout.multi_turn.enable: true to use them."
        )
    if "mode" in cfg.rollout.model_fields_set:
        notes.append(
            f"rollout.mode is a deprecated alias of rollout.placement: mode {cfg.rollout.mode} runs as "
            f"rollout.placement: {cfg.rollout.placement}. Set rollout.placement instead (colocated, worker or pool)."
        )
    if cfg.critic.model_fields_set and not _needs_critic(cfg.algorithm.adv_estimator):
        keys = ", ".join(f"critic.{k}" for k in sorted(cfg.critic.model_fields_set))
        notes.append(
            f"{keys} is set but adv_estimator '{cfg.algorithm.adv_estimator}' uses no critic, so it has no effect; "
            "set algorithm.adv_estimator: gae for PPO with a critic."
        )
    return notes


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

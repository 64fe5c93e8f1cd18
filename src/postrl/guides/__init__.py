"""The guides' configurations in postrl's names: verl override lists and MindSpeed-RL YAMLs.

Users of the MindSpeed-RL / verl guides carry settings such as `actor_rollout_ref.rollout.n=16` or
`rl_config.clip_higher_enable: true`. One table per dialect says, for every key the guides use,
which postrl key it becomes (and how its value is translated) or why it has no postrl counterpart
and what postrl offers instead. `postrl convert-config` writes the translated YAML, and `postrl
train` accepts verl-style dotted overrides through the same table (`config.load_config`).

A conversion returns a `Conversion`: the postrl tree, one `Mapped` record per source key that was
translated, and one `Unmapped` record per key that was not, so that no key is silently lost. The
table is documented in docs/guides.md.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from postrl.errors import UserError
from postrl.guides.rules import (
    Conversion,
    Mapped,
    Rule,
    Unmapped,
    VERIFIERS,
    _as_list,
    _bool,
)
from postrl.guides.verl import VERL, VERL_HEADS, VERL_PREFIXES  # noqa: F401
from postrl.guides.mindspeed import MINDSPEED, MINDSPEED_PREFIXES, MINDSPEED_SECTIONS  # noqa: F401


# ------------------------------------------------------------------------------------------- engine
def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _apply(conv: Conversion, table: dict[str, Rule], prefixes: dict[str, str], key: str, value: Any, source: str | None = None) -> None:
    source = source or key
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string; the guides write it so
    rule = table.get(key)
    if rule is None:
        why = next((w for p, w in prefixes.items() if key == p.rstrip(".") or key.startswith(p)), None)
        conv.unmapped.append(Unmapped(source, value, why or f"not in postrl's table of {conv.dialect} keys (docs/guides.md); nothing was set"))
        return
    if rule.to is None:
        conv.unmapped.append(Unmapped(source, value, rule.note))
        return
    try:
        targets = {rule.to: value} if isinstance(rule.to, str) else rule.to(value)
    except (KeyError, TypeError, ValueError):
        targets = None
    if targets is None:
        conv.unmapped.append(Unmapped(source, value, f"the value {value!r} has no postrl counterpart: {rule.note}"))
    else:
        conv.mapped.append(Mapped(source, value, targets, rule.note))


def _build_tree(conv: Conversion) -> None:
    conv.tree = {}
    for key, value in conv.flat().items():
        node = conv.tree
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value


def _parse(items: list[str]) -> list[tuple[str, Any]]:
    """`key=value` pairs, values read as YAML (so True is a bool, 0.28 a float, [a,b] a list)."""
    pairs, bad = [], []
    for item in items:
        key, sep, raw = item.lstrip("+").partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            bad.append(f"'{item}' is not of the form key=value. Fix: write it like actor_rollout_ref.rollout.n=8.")
            continue
        try:
            pairs.append((key, yaml.safe_load(raw) if raw != "" else ""))
        except yaml.YAMLError:
            pairs.append((key, raw))
    if bad:
        raise UserError(*bad, title="bad verl overrides")
    return pairs


def _unmapped_to_mapped(conv: Conversion, source: str, targets: dict, note: str) -> None:
    """A key listed as unmapped whose meaning a combination gave after all."""
    for i, u in enumerate(conv.unmapped):
        if u.source == source:
            del conv.unmapped[i]
            conv.mapped.append(Mapped(source, u.value, targets, note))
            return


def convert_verl(overrides: list[str] | dict[str, Any]) -> Conversion:
    """A verl override list (`key=value` items, Hydra's `+` / `++` prefixes allowed) in postrl's names."""
    pairs = list(overrides.items()) if isinstance(overrides, dict) else _parse(overrides)
    conv = Conversion("verl")
    given = dict(pairs)
    for key, value in pairs:
        _apply(conv, VERL, VERL_PREFIXES, key, value)
    flat = conv.flat()
    # verl's clip_ratio fills only the sides that are not given; use_kl_loss=true keeps verl's default coefficient.
    for m in conv.mapped:
        if m.source == "actor_rollout_ref.actor.clip_ratio":
            m.targets = {k: v for k, v in m.targets.items() if k.rsplit(".", 1)[1] not in {s.rsplit(".", 1)[1] for s in given}}
        if m.source == "actor_rollout_ref.actor.use_kl_loss" and _bool(m.value) and "actor_rollout_ref.actor.kl_loss_coef" not in given:
            m.targets = {"algorithm.kl.coef": 0.001}
        if m.source == "actor_rollout_ref.actor.kl_loss_coef" and "actor_rollout_ref.actor.use_kl_loss" in given and not _bool(given["actor_rollout_ref.actor.use_kl_loss"]):
            m.targets = {}
            m.note = "ignored: use_kl_loss is false"
    if "trainer.total_training_steps" in given:  # verl: total_training_steps wins over total_epochs
        for m in conv.mapped:
            if m.source == "trainer.total_epochs":
                m.targets, m.note = {}, "ignored: trainer.total_training_steps is given and wins, as in verl"
    ratio = given.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    if ratio is not None and "train.total_steps" in flat and int(given.get("actor_rollout_ref.actor.optim.lr_warmup_steps", -1)) < 0:
        _unmapped_to_mapped(conv, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
                            {"train.warmup_steps": int(float(ratio) * int(flat["train.total_steps"]))}, "ratio x trainer.total_training_steps")  # fmt: skip
    _build_tree(conv)
    return conv


def convert_mindspeed(tree: dict) -> Conversion:
    """A MindSpeed-RL YAML (its four sections, or the flat keys) in postrl's names."""
    conv = Conversion("MindSpeed-RL")
    items: list[tuple[str, str, Any]] = []  # (key, source path, value); a key may stand in two sections
    for top, value in tree.items():
        if top in MINDSPEED_SECTIONS and isinstance(value, dict):
            items += [(k, f"{top}.{k}", v) for k, v in _flatten(value).items()]
        else:
            items += [(k, k, v) for k, v in (_flatten({top: value}) if isinstance(value, dict) else {top: value}).items()]
    for key, source, value in items:
        _apply(conv, MINDSPEED, MINDSPEED_PREFIXES, key, value, source)
    got = {k: v for k, _, v in items}
    src = {k: s for k, s, _ in items}

    def combine(key: str, targets: dict, note: str) -> None:
        _unmapped_to_mapped(conv, src[key], targets, note)

    if _bool(got.get("clip_higher_enable", False)):
        clip = {f"algorithm.{k}": got[k] for k in ("clip_ratio_low", "clip_ratio_high") if k in got}
        for m in conv.mapped:  # clip_higher's two sides win over clip_ratio
            if m.source == src.get("clip_ratio"):
                m.targets = {k: v for k, v in m.targets.items() if k not in clip}
            if m.source in (src.get("clip_ratio_low"), src.get("clip_ratio_high")):
                m.targets = {f"algorithm.{m.source.rsplit('.', 1)[1]}": m.value}
    if "filter_groups_train_batch_size" in got and _bool(got.get("filter_groups_enable", False)):
        combine("filter_groups_train_batch_size", {"train.global_batch_size": int(got["filter_groups_train_batch_size"])},
                "groups trained per step; the generation batch is global_batch_size (train.gen_batch_size)")  # fmt: skip
        for m in conv.mapped:
            if m.source == src.get("global_batch_size"):
                m.targets = {"train.gen_batch_size": m.value}
                m.note = "prompts per generation batch (dynamic sampling keeps filter_groups_train_batch_size of them)"
    if "min_lr" in got and got.get("lr"):
        combine("min_lr", {"train.min_lr_ratio": float(got["min_lr"]) / float(got["lr"])}, "min_lr / lr")
    if "lr_warmup_fraction" in got and "train_iters" in got:
        combine("lr_warmup_fraction", {"train.warmup_steps": int(math.floor(float(got["lr_warmup_fraction"]) * int(got["train_iters"])))}, "fraction x train_iters")  # fmt: skip
    if "adam_beta1" in got or "adam_beta2" in got:
        betas = [float(got.get("adam_beta1", 0.9)), float(got.get("adam_beta2", 0.999))]
        for k in ("adam_beta1", "adam_beta2"):
            if k in got:
                combine(k, {"train.betas": betas}, "train.betas")
    names = got.get("verifier_function")
    if names is not None:
        weights = _as_list(got.get("verifier_weight", [1.0] * len(_as_list(names))))
        known = [(VERIFIERS[n], float(w)) for n, w in zip(_as_list(names), weights) if n in VERIFIERS]
        unknown = [n for n in _as_list(names) if n not in VERIFIERS]
        if known:
            combine("verifier_function", {"reward.verifiers": [{"name": n, "weight": w} for n, w in known]}, "with verifier_weight")
            if "verifier_weight" in got:
                combine("verifier_weight", {}, "in reward.verifiers")
        for n in unknown:
            conv.unmapped.append(Unmapped(f"{src['verifier_function']}[{n}]", n, f"no postrl verifier of that name; registered: {', '.join(sorted(set(VERIFIERS.values())))}, or your own package.module:function"))
    sinks = ["console", "jsonl"] + [s for s, k in (("tensorboard", "use_tensorboard"), ("wandb", "use_wandb")) if _bool(got.get(k, False))]
    for m in conv.mapped:
        if m.source in (src.get("use_tensorboard"), src.get("use_wandb")):
            m.targets = {"logging.sinks": sinks}
    _build_tree(conv)
    return conv


def read_verl_overrides(text: str) -> list[str]:
    """The `key=value` items of a verl command line or override file (one or more a line; `\\`, comments,
    `python3 -m verl.trainer.main_ppo` and shell variables' quotes tolerated)."""
    import shlex

    items = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for tok in shlex.split(line, posix=True):
            if "=" in tok and not tok.startswith("-"):
                key = tok.split("=", 1)[0].lstrip("+")
                if "." in key or key in ("data", "trainer"):
                    items.append(tok)
    return items


def convert_file(path: str | Path) -> Conversion:
    """Detect the dialect of a file: a YAML mapping with MindSpeed-RL's sections, else a verl override list."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"'{path}' does not exist. Fix: pass a MindSpeed-RL YAML or a file of verl overrides (key=value).")
    text = p.read_text()
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        tree = None
    if isinstance(tree, dict) and (set(tree) & set(MINDSPEED_SECTIONS) or "rl_config" in tree):
        return convert_mindspeed(tree)
    items = read_verl_overrides(text)
    if not items:
        raise UserError(
            f"{path} is neither a MindSpeed-RL YAML (megatron_training / actor_config / rl_config / generate_config "
            "sections) nor a list of verl overrides (key=value). Fix: pass one of those."
        )
    return convert_verl(items)


def split_overrides(overrides: list[str], is_postrl_key: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """(verl-style overrides, postrl overrides) of a command line: a key under a verl-only head, or a
    key the verl table names that is not a postrl key (data.train_batch_size, algorithm.use_kl_in_reward)."""
    verl, native = [], []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+")
        known = key in VERL or key.startswith(tuple(VERL_PREFIXES))
        is_verl = (key.startswith(VERL_HEADS) or known) and not is_postrl_key(key)  # postrl has a critic section too
        (verl if is_verl else native).append(item)
    return verl, native


# ------------------------------------------------------------------------------------------- output
def render_yaml(conv: Conversion, source: str) -> str:
    """The postrl YAML: one comment per mapped key (its source), then the keys not mapped with what postrl offers."""
    origin: dict[str, list[str]] = {}
    for m in conv.mapped:
        for k in m.targets:
            origin.setdefault(k, []).append(m.source + (f" ({m.note})" if m.note else ""))
    lines = [f"# postrl configuration converted from {source} ({conv.dialect}) by `postrl convert-config`.",
             "# Check it with `postrl check-config` (the keys postrl did not map are listed at the end)."]  # fmt: skip

    def emit(node: dict, path: str, indent: int) -> None:
        for k, v in node.items():
            key = f"{path}{k}"
            pad = "  " * indent
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{k}:")
                emit(v, key + ".", indent + 1)
            else:
                text = yaml.safe_dump(v, default_flow_style=True, width=10_000).strip()
                text = text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").rstrip()
                comment = f"  # from {'; '.join(origin[key])}" if key in origin else ""
                lines.append(f"{pad}{k}: {text}{comment}")

    emit(conv.tree, "", 0)
    silent = [m for m in conv.mapped if not m.targets]
    if silent:
        lines.append("")
        lines.append(f"# Mapped with nothing to set ({len(silent)} keys): postrl's behaviour already is what they ask.")
        for m in silent:
            lines.append(f"#   {m.source} = {m.value!r}" + (f": {m.note}" if m.note else ""))
    if conv.unmapped:
        lines.append("")
        lines.append(f"# Not mapped ({len(conv.unmapped)} keys): what postrl offers instead.")
        for u in conv.unmapped:
            lines.append(f"#   {u.source} = {u.value!r}: {u.instead}")
    return "\n".join(lines) + "\n"

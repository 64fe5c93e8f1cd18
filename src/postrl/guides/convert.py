"""The conversion engine: a verl override list, a verl launch script or a MindSpeed-RL YAML in postrl's
names, through the tables of verl.py and mindspeed.py (rules.py: the records and value rules; script.py
and shell.py: reading a launch script as data; reading.py: the YAML and items with their lines), then
checked (keys that write files, run code or send the model away) and rendered as a postrl YAML.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from postrl.errors import UserError
from postrl.guides.rules import (
    BadValue,
    Conversion,
    Mapped,
    Rule,
    Unmapped,
    VERIFIERS,
    _as_list,
    _bool,
)
from postrl.guides.reading import Item, Reading, dedupe, load_yaml_lines, strip_annotation, yaml_value
from postrl.yaml_bounded import FIX, TooLarge
import postrl.guides.fully_async as fully_async
import postrl.guides.verl_tools as verl_tools
from postrl.guides.script import read_script
from postrl.guides.verl import VERL, VERL_HEADS, VERL_PREFIXES
from postrl.guides.mindspeed import MINDSPEED, MINDSPEED_PREFIXES, MINDSPEED_SECTIONS


# ------------------------------------------------------------------------------------------- engine
def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (an empty mapping stays a leaf)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _where(conv: Conversion, source: str) -> str:
    line = conv.lines.get(source)
    return f"line {line}: {source}" if line else source


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
    except BadValue as exc:
        conv.refused.append(f"{_where(conv, source)} = {value!r}: {exc}, so what it asks for is unclear. Fix: write the value alone.")
        return
    except (KeyError, TypeError, ValueError):
        targets = None
    if targets is None and rule.strict:
        conv.refused.append(
            f"{_where(conv, source)} = {value!r}: postrl cannot train what this value asks for ({rule.note}), and running "
            "something else under its name would be wrong. Fix: pick one of those values."
        )
    elif targets is None:
        conv.unmapped.append(Unmapped(source, value, f"the value {value!r} has no postrl counterpart: {rule.note}"))
    else:
        conv.mapped.append(Mapped(source, value, targets, rule.note))


# postrl keys whose value is a place the run writes to (metrics, samples, checkpoints, the converted YAML).
WRITTEN = ("logging.dir", "checkpoint.dir")
# verl / MindSpeed-RL keys whose value becomes one component of such a path (trainer.experiment_name -> runs/<name>).
NAME_KEYS = ("trainer.experiment_name",)


def _not_plain(value: Any, component: bool) -> str | None:
    """Why `value` is not a plain path (one name when `component`), or None: printable text, no `..` part, and
    for a name no `/` or `\\` and not `.`. A converted file decides only names and places under its own words;
    where the run writes must read as what the user sees."""
    text = str(value)
    if not text.strip():
        return "it is empty"
    odd = sorted({repr(c)[1:-1] for c in text if not c.isprintable()})
    if odd:
        return f"it holds characters that are not printable ({', '.join(odd)}), so the directory's name is not what is shown"
    parts = text.replace("\\", "/").split("/")
    if component and (len(parts) > 1 or text in (".", "..")):
        return "it is a name postrl makes into one directory, runs/<name>, and this one is a path"
    if ".." in parts:
        return "a `..` in it leads out of the directory it names"
    if any(len(p.encode()) > 255 for p in parts):
        return "a part of it is longer than a file name may be (255 bytes)"
    return None


def _check_written(conv: Conversion) -> None:
    """Refuse a value of the file that would make the run write somewhere other than a plain place (one rule for
    every key that becomes a written path: NAME_KEYS as one name, the others as a path)."""
    for m in conv.mapped:
        key = m.source.split(" ", 1)[0]
        checks = [(m.value, True)] if key in NAME_KEYS else [(v, False) for k, v in m.targets.items() if k in WRITTEN]
        for value, component in checks:
            why = _not_plain(value, component)
            if why:
                conv.refused.append(
                    f"{_where(conv, m.source)} = {str(value)!r}: the run would write to a place named by it, and {why}. "
                    f"Fix: give {key} a plain {'name (letters, digits, - _ .)' if component else 'path with no `..`'}, "
                    "or choose the place yourself on the command line (logging.dir=... / checkpoint.dir=...)."
                )


def _finish(conv: Conversion, where: str) -> Conversion:
    _check_written(conv)
    if conv.refused:
        raise UserError(*conv.refused, title=f"{where}: {len(conv.refused)} value(s) postrl cannot convert as written")
    build_tree(conv)
    return conv


def build_tree(conv: Conversion) -> None:
    """conv.tree from conv's mapped keys (dotted keys -> nested sections; a later key wins)."""
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
            pairs.append((key, yaml_value(raw)))
        except TooLarge as exc:
            bad.append(f"'{key}=...': {exc}. {FIX}")
    if bad:
        raise UserError(*bad, title="bad verl overrides")
    return pairs


def _reward_kwargs(given: dict[str, Any]) -> dict[str, Any]:
    """verl's custom_reward_function.reward_kwargs, given whole (a mapping) or key by key (dotted: nested)."""
    whole = given.get("custom_reward_function.reward_kwargs")
    out: dict[str, Any] = dict(whole) if isinstance(whole, dict) else {}
    head = "custom_reward_function.reward_kwargs."
    for key, value in given.items():
        if key.startswith(head):
            *parents, leaf = key.removeprefix(head).split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return out


def _unmapped_to_mapped(conv: Conversion, source: str, targets: dict, note: str) -> None:
    """A key listed as unmapped whose meaning a combination gave after all."""
    for i, u in enumerate(conv.unmapped):
        if u.source == source:
            del conv.unmapped[i]
            conv.mapped.append(Mapped(source, u.value, targets, note))
            return


def convert_verl(overrides: list[str] | dict[str, Any] | list[Item], where: str = "the verl overrides", entry: str | None = None,
                 script_dir: Path | None = None) -> Conversion:
    """A verl override list (`key=value` items, Hydra's `+` / `++` prefixes allowed) in postrl's names; `entry`
    is the module the script runs (verl's fully_async entry point reads keys of its own); `script_dir` is where
    a relative tool config is looked for after the working directory (verl_tools)."""
    if isinstance(overrides, dict):
        reading = Reading([Item(k, v) for k, v in overrides.items()])
    elif overrides and isinstance(overrides[0], Item):
        reading = Reading(list(overrides))  # type: ignore[arg-type]
    else:
        reading = Reading([Item(k, v, n) for n, (k, v) in enumerate(_parse(overrides), 1)])  # type: ignore[arg-type]
    dedupe(reading, "item" if all(isinstance(o, str) for o in overrides) else "line")
    reading.check(where)
    conv = Conversion("verl")
    conv.lines = {it.key: it.line for it in reading.items if it.line is not None}
    given = {it.key: it.value for it in reading.items}
    for key, value in given.items():
        if fully_async.is_key(key) and not fully_async.is_fully_async(entry):
            conv.unmapped.append(Unmapped(key, value, fully_async.elsewhere(entry)))
            continue
        _apply(conv, VERL, VERL_PREFIXES, key, value)
    try:
        _verl_combinations(conv, given)
        verl_tools.carry(conv, given, script_dir)
        if fully_async.is_fully_async(entry):
            fully_async.combine(conv, given)
    except (BadValue, ValueError, TypeError) as exc:
        conv.refused.append(f"{exc}. Fix: write the value alone.")
    return _finish(conv, where)


# verl's losses that aggregate per sequence whatever actor.loss_agg_mode says (verl/trainer/ppo/core_algos.py):
# postrl's follow algorithm.loss_agg_mode, so a converted run sets the mode verl uses.
SEQUENCE_AGGREGATED = {
    "sapo": "verl's compute_policy_loss_sapo always aggregates seq-mean-token-mean",
    "geo_mean": "verl's compute_policy_loss_geo_mean always takes the mean over sequences of its per-sequence loss, "
    "which is postrl's seq-mean-token-mean",
}


def _verl_combinations(conv: Conversion, given: dict[str, Any]) -> None:
    """The verl keys whose meaning depends on others (clip_ratio, use_kl_loss, total_training_steps, ...)."""
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
        if m.source == "reward_model.model.path" and not _bool(given.get("reward_model.enable", False)):
            m.targets, m.note = {}, "ignored: reward_model.enable is not true (as in verl)"
    for key in [k for k in given if k.startswith("data.custom_cls.")]:
        conv.unmapped = [u for u in conv.unmapped if u.source != key]
        if key == "data.custom_cls.path" and given[key] not in (None, "", "null", "None"):
            conv.refused.append(
                f"{_where(conv, key)} = {given[key]!r}: verl builds the prompts with this dataset class (data.custom_cls.name), "
                "code postrl does not run; training on postrl's reading of the files instead would train other prompts. "
                "Fix: write the rows the class makes into parquet / JSONL in the verl schema (prompt as chat messages, "
                "reward_model.ground_truth; `postrl preprocess` has handlers) and drop data.custom_cls.*."
            )
        elif key != "data.custom_cls.path":
            conv.mapped.append(Mapped(key, given[key], {}, "see data.custom_cls.path"))
    loss_mode = given.get("actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss_mode in SEQUENCE_AGGREGATED:  # verl aggregates these per sequence whatever loss_agg_mode says
        why = SEQUENCE_AGGREGATED[loss_mode]
        for m in conv.mapped:
            if m.source == "actor_rollout_ref.actor.loss_agg_mode":
                m.targets, m.note = {}, f"ignored, as in verl: {why}"
        conv.mapped.append(Mapped(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} (its aggregation)", loss_mode,
                                  {"algorithm.loss_agg_mode": "seq-mean-token-mean"}, why))  # fmt: skip
    if "trainer.total_training_steps" in given:  # verl: total_training_steps wins over total_epochs
        for m in conv.mapped:
            if m.source == "trainer.total_epochs":
                m.targets, m.note = {}, "ignored: trainer.total_training_steps is given and wins, as in verl"
    path = given.get("custom_reward_function.path")
    if path not in (None, "", "null", "None"):  # the user's reward file, called as verl calls it
        name = given.get("custom_reward_function.name") or "compute_score"
        verifiers = [{"name": f"verl:{path}:{name}", "weight": 1.0}]
        kwargs = _reward_kwargs(given)
        if kwargs:
            verifiers[0]["kwargs"] = kwargs
            for key in given:
                if key.startswith("custom_reward_function.reward_kwargs"):
                    _unmapped_to_mapped(conv, key, {}, "passed to the reward function as a keyword argument, as verl binds it (reward.verifiers kwargs)")
        _unmapped_to_mapped(conv, "custom_reward_function.path", {"reward.verifiers": verifiers},
                            "the file's function with verl's signature, in the verifier worker pool (a relative path is read from the directory postrl runs in)")  # fmt: skip
        _unmapped_to_mapped(conv, "custom_reward_function.name", {}, "in reward.verifiers (verl:<path>:<name>)")
        for m in conv.mapped:
            if m.source in ("reward_model.reward_manager", "reward_model.reward_manager.name"):
                m.targets, m.note = {"reward.verifiers": verifiers}, "the manager scores with custom_reward_function, as in verl"
    ratio = given.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    if ratio is not None and "train.total_steps" in flat and int(given.get("actor_rollout_ref.actor.optim.lr_warmup_steps", -1)) < 0:
        _unmapped_to_mapped(conv, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
                            {"train.warmup_steps": int(float(ratio) * int(flat["train.total_steps"]))}, "ratio x trainer.total_training_steps")  # fmt: skip


def _mindspeed_items(tree: dict, lines: dict[tuple, int], conv: Conversion) -> list[tuple[str, str, Any]]:
    """(key, source path, value) of every leaf (a key may stand in two sections), annotations stripped with a note."""
    items: list[tuple[str, str, Any]] = []
    for top, value in tree.items():
        if top in MINDSPEED_SECTIONS and isinstance(value, dict):
            items += [(k, f"{top}.{k}", v) for k, v in flatten(value).items()]
        else:
            items += [(k, k, v) for k, v in (flatten({top: value}) if isinstance(value, dict) else {top: value}).items()]
    out = []
    for key, source, value in items:
        line = lines.get(tuple(source.split(".")))
        if line:
            conv.lines[source] = line
        value, note = strip_annotation(value)
        if note is not None:
            conv.notes.append(f"{_where(conv, source)}: '{note}' after the value is read as the guide's annotation and dropped (value {value!r})")
        out.append((key, source, value))
    return out


def convert_mindspeed(tree: dict, lines: dict[tuple, int] | None = None, where: str = "the MindSpeed-RL YAML") -> Conversion:
    """A MindSpeed-RL YAML (its four sections, or the flat keys) in postrl's names."""
    conv = Conversion("MindSpeed-RL")
    items = _mindspeed_items(tree, lines or {}, conv)
    for key, source, value in items:
        _apply(conv, MINDSPEED, MINDSPEED_PREFIXES, key, value, source)
    got = {k: v for k, _, v in items}
    src = {k: s for k, s, _ in items}

    def combine(key: str, targets: dict, note: str) -> None:
        _unmapped_to_mapped(conv, src[key], targets, note)

    def retarget(key: str, targets: dict, note: str) -> None:
        for m in conv.mapped:
            if m.source == src.get(key):
                m.targets, m.note = targets, note

    try:
        combinations(got, src, conv, combine, retarget)
    except (BadValue, ValueError, TypeError) as exc:
        conv.refused.append(f"{exc}. Fix: write the value alone.")
    return _finish(conv, where)


def combinations(got: dict, src: dict, conv: Conversion, combine: Callable, retarget: Callable) -> None:
    """The MindSpeed-RL keys whose meaning depends on others (clip_higher, filter_groups, min_lr, betas, ...)."""
    if _bool(got.get("clip_higher_enable", False)):
        clip = {f"algorithm.{k}": got[k] for k in ("clip_ratio_low", "clip_ratio_high") if k in got}
        for m in conv.mapped:  # clip_higher's two sides win over clip_ratio
            if m.source == src.get("clip_ratio"):
                m.targets = {k: v for k, v in m.targets.items() if k not in clip}
            if m.source in (src.get("clip_ratio_low"), src.get("clip_ratio_high")):
                m.targets = {f"algorithm.{m.source.rsplit('.', 1)[-1]}": m.value}
    if "filter_groups_train_batch_size" in got and _bool(got.get("filter_groups_enable", False)):
        combine("filter_groups_train_batch_size", {"train.global_batch_size": int(got["filter_groups_train_batch_size"])},
                "groups trained per step; the generation batch is global_batch_size (train.gen_batch_size)")  # fmt: skip
        retarget("global_batch_size", {"train.gen_batch_size": got.get("global_batch_size")},
                 "prompts per generation batch (dynamic sampling keeps filter_groups_train_batch_size of them)")  # fmt: skip
    if "min_lr" in got and got.get("lr"):
        combine("min_lr", {"train.min_lr_ratio": float(got["min_lr"]) / float(got["lr"])}, "min_lr / lr")
    if "lr_warmup_fraction" in got and "train_iters" in got:
        combine("lr_warmup_fraction", {"train.warmup_steps": int(math.floor(float(got["lr_warmup_fraction"]) * int(got["train_iters"])))}, "fraction x train_iters")  # fmt: skip
    if "adam_beta1" in got or "adam_beta2" in got:
        betas = [float(got.get("adam_beta1", 0.9)), float(got.get("adam_beta2", 0.999))]
        for k in ("adam_beta1", "adam_beta2"):
            if k in got:
                combine(k, {"train.betas": betas}, "train.betas")
    if _bool(got.get("use_kl_in_reward", False)) and "init_kl_coef" in got:  # the coefficient of the KL in the reward
        retarget("init_kl_coef", {"algorithm.kl_ctrl.kl_coef": got["init_kl_coef"]}, "use_kl_in_reward: the KL-in-reward coefficient")
    if "load" in got and _bool(got.get("finetune", False)):
        retarget("load", {}, "with finetune: true, `load` holds the converted Megatron weights to start from: postrl starts from "
                 "the Hugging Face weights at model.path (tokenizer_name_or_path)")  # fmt: skip
        retarget("finetune", {}, "finetune from Megatron weights = postrl's start from model.path")
    cp_algo = str(got.get("context_parallel_algo", "ulysses_cp_algo"))
    if "context_parallel_size" in got and cp_algo != "ulysses_cp_algo":
        m = next(m for m in conv.mapped if m.source == src["context_parallel_size"])
        conv.mapped.remove(m)
        conv.unmapped.append(Unmapped(m.source, m.value, f"{cp_algo} (ring attention) is not offered: postrl's sequence parallelism "
                                      "is Ulysses (train.sequence_parallel_size, with context_parallel_algo: ulysses_cp_algo)"))  # fmt: skip
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
            conv.refused.append(
                f"{_where(conv, src['verifier_function'])}: no postrl verifier is named '{n}', and scoring with another one would "
                f"train something else. Fix: one of {', '.join(sorted(set(VERIFIERS.values())))}, or your own package.module:function "
                "in reward.verifiers."
            )
    sinks = ["console", "jsonl"] + [s for s, k in (("tensorboard", "use_tensorboard"), ("wandb", "use_wandb")) if _bool(got.get(k, False))]
    for m in conv.mapped:
        if m.source in (src.get("use_tensorboard"), src.get("use_wandb")):
            m.targets = {"logging.sinks": sinks}


def _is_mindspeed(tree: Any) -> bool:
    """MindSpeed-RL's sections, or its flat keys (the guides' snippets): most leaf names in its table."""
    if not isinstance(tree, dict):
        return False
    if set(tree) & set(MINDSPEED_SECTIONS) or "rl_config" in tree:
        return True
    leaves = [k.rsplit(".", 1)[-1] for k in flatten(tree)]
    return bool(leaves) and sum(k in MINDSPEED or k.split(".")[0] in MINDSPEED for k in leaves) * 2 >= len(leaves)


def read_verl_overrides(text: str, env: dict[str, str] | None = None) -> list[str]:
    """The `key=value` items of a verl command line or override file (kept for callers that want strings)."""
    reading = read_script(text, env)
    reading.check("the verl script")
    return [f"{it.key}={it.value}" for it in reading.items]


def _mindspeed_override(tree: dict, key: str, value: Any) -> bool:
    """Set a MindSpeed-RL key (flat, or under its section) in the file's tree where it stands; False if not one."""
    head, _, rest = key.partition(".")
    if head in MINDSPEED_SECTIONS and rest:
        tree.setdefault(head, {})
        node = tree[head]
        *parents, leaf = rest.split(".")
    elif key.split(".")[0] in MINDSPEED or key in MINDSPEED or key.startswith(tuple(MINDSPEED_PREFIXES)):
        node = next((tree[s] for s in MINDSPEED_SECTIONS if isinstance(tree.get(s), dict) and key.split(".")[0] in tree[s]), tree)
        *parents, leaf = key.split(".")
    else:
        return False
    for k in parents:
        node = node.setdefault(k, {})
    node[leaf] = value
    return True


MAX_SOURCE_BYTES = 8 << 20  # a launch script or config is kilobytes; a file past this is not one


def convert_file(path: str | Path, env: dict[str, str] | None = None, overrides: list[str] | None = None) -> Conversion:
    """Detect the dialect of a file: a YAML mapping of MindSpeed-RL's keys, else a verl script or override list.

    `overrides` (key=value) in the file's dialect replace the file's values before the conversion; the
    others are left in `Conversion.rest` for the caller (postrl's own keys)."""
    extra = [Item(k, v, None, o.split("=", 1)[1]) for (k, v), o in zip(_parse(overrides or []), overrides or [])]
    p = Path(path)
    if p.is_dir():
        raise UserError(f"'{path}' is a directory. Fix: pass the MindSpeed-RL YAML or the verl script inside it.")
    if not p.exists():
        raise UserError(f"'{path}' does not exist. Fix: pass a MindSpeed-RL YAML or a file of verl overrides (key=value).")
    if p.stat().st_size > MAX_SOURCE_BYTES:
        raise UserError(f"{path} is larger than {MAX_SOURCE_BYTES >> 20} MB, more than a launch script or config postrl reads. Fix: pass the script or YAML itself.")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise UserError(f"{path} is not a text file (it is not UTF-8 text). Fix: pass the MindSpeed-RL YAML or the verl script itself.")
    try:
        tree, lines, dups = load_yaml_lines(text, str(path))
    except UserError:
        if p.suffix in (".yaml", ".yml"):
            raise
        tree, lines, dups = None, {}, []
    if _is_mindspeed(tree):
        if dups:
            raise UserError(*dups, title=f"{path}: {len(dups)} key(s) given twice")
        rest = [f"{it.key}={it.raw}" for it in extra if not _mindspeed_override(tree, it.key, it.value)]
        conv = convert_mindspeed(tree, lines, str(path))
        conv.rest = rest
        return conv
    if isinstance(tree, dict) and {"actor_rollout_ref", "trainer", "reward_model"} & set(tree):  # verl's config as YAML
        if dups:
            raise UserError(*dups, title=f"{path}: {len(dups)} key(s) given twice")
        items = [Item(k, v, lines.get(tuple(k.split(".")))) for k, v in flatten(tree).items()]
        return _with_verl_overrides(items, extra, str(path), script_dir=p.parent)
    if isinstance(tree, list):  # a YAML list of overrides (Hydra's override file)
        bad = [f"line {lines.get((i,), '?')}: item {v!r} is not of the form key=value. Fix: write it like actor_rollout_ref.rollout.n=8."
               for i, v in enumerate(tree) if not (isinstance(v, str) and "=" in v)]  # fmt: skip
        if bad:
            raise UserError(*bad, title=f"{path}: {len(bad)} list item(s) are not verl overrides")
        items = [Item(k.lstrip("+"), yaml_value(v), lines.get((i,))) for i, (k, _, v) in enumerate(x.partition("=") for x in tree)]
        return _with_verl_overrides(items, extra, str(path), script_dir=p.parent)
    reading = read_script(text, env)
    reading.check(str(path))
    base = hydra_base(reading, str(path))
    if not reading.items:
        raise UserError(
            f"{path} is neither a MindSpeed-RL YAML (megatron_training / actor_config / rl_config / generate_config "
            "sections, or their keys) nor a list of verl overrides (key=value). Fix: pass one of those."
        )
    given = {it.key for it in reading.items}
    conv = _with_verl_overrides([it for it in base.items if it.key not in given] + reading.items, extra, str(path), reading.entry, p.parent)
    conv.notes[:0] = reading.notes + base.notes
    return conv


# verl's own configs whose defaults postrl knows (VERL_DEFAULTS): a script may name them with --config-name.
VERL_CONFIGS = {
    "ppo_trainer": "verl's default config",
    "ppo_megatron_trainer": "verl's Megatron config: the same defaults as ppo_trainer for the keys postrl fills in when a script leaves them out (loss_agg_mode, clip ratios, reward manager)",
}


def hydra_base(reading: Reading, where: str) -> Reading:
    """The items of the config a script starts verl from (`--config-path DIR --config-name NAME`): none for verl's own
    configs (VERL_CONFIGS); a file DIR/NAME.yaml whose `defaults` are one of those then `_self_` is read as verl's
    config YAML (the script's keys replace its values, as Hydra's overrides do). Anything else is refused naming the
    flag: read against the wrong defaults, the script would train something other than what verl runs."""
    flags = {flag: (value, n) for flag, value, n in reading.hydra}
    out = Reading()
    if not flags:
        return out
    name, n = flags.get("--config-name", ("ppo_trainer", None))
    name = name.removesuffix(".yaml")
    if "--config-dir" in flags:
        value, n = flags["--config-dir"]
        raise UserError(f"{where}: line {n}: --config-dir {value!r} adds a directory of configs for Hydra to search, which postrl does "
                        "not read, so verl's defaults for the run are unknown. Fix: remove the flag and give the keys it changes "
                        "on the command line, or convert the YAML with `postrl convert-config`.")  # fmt: skip
    if "--config-path" not in flags:
        if name in VERL_CONFIGS:
            out.notes.append(f"line {n}: --config-name {name}: {VERL_CONFIGS[name]}")
            return out
        raise UserError(f"{where}: line {n}: --config-name {name!r} is not one of verl's configs postrl knows ({', '.join(VERL_CONFIGS)}), "
                        "so the defaults the script's keys change are unknown and training against postrl's would train something "
                        "else. Fix: pass verl's config as --config-path DIR --config-name NAME (postrl reads DIR/NAME.yaml when it "
                        "starts from ppo_trainer), or give its keys in the script.")  # fmt: skip
    value, n = flags["--config-path"]
    file = Path(value) / f"{name}.yaml"
    if not Path(value).is_absolute():
        here = Path(*reading.entry.split(".")[:-1]) if reading.entry else Path()
        file = here / value / f"{name}.yaml"  # Hydra: relative to the module that declares @hydra.main
    if name in VERL_CONFIGS and Path(os.path.normpath(file.parent)).parts[-3:] == ("verl", "trainer", "config"):
        out.notes.append(f"line {n}: --config-path {value} --config-name {name}: {VERL_CONFIGS[name]} ({file})")
        return out  # `-m verl.trainer.main_ppo --config-path=config`: verl's own directory, read or not from here
    if not file.is_file():
        raise UserError(f"{where}: line {n}: --config-path {value!r} --config-name {name!r}: {file} does not exist (Hydra reads a "
                        "relative --config-path from the directory of the module the script runs), so the defaults the script's "
                        "keys change are unknown. Fix: run from verl's checkout, or give the absolute path.")  # fmt: skip
    if file.stat().st_size > MAX_SOURCE_BYTES:
        raise UserError(f"{where}: line {n}: {file} is larger than {MAX_SOURCE_BYTES >> 20} MB, more than a config postrl reads. Fix: pass verl's config itself.")
    tree, lines, dups = load_yaml_lines(file.read_text(encoding="utf-8", errors="replace"), str(file))
    if dups:
        raise UserError(*dups, title=f"{file}: {len(dups)} key(s) given twice")
    tree = tree if isinstance(tree, dict) else {}
    defaults = tree.pop("defaults", None)
    first = defaults[0] if isinstance(defaults, list) and defaults else None
    if not (isinstance(defaults, list) and first in VERL_CONFIGS and defaults[1:] in ([], ["_self_"])):
        raise UserError(f"{where}: line {n}: {file} starts from defaults {defaults!r}; postrl knows the defaults of "
                        f"[{' or '.join(VERL_CONFIGS)}, _self_] only, so what the file's keys change is unknown. Fix: give its keys "
                        "in the script and drop --config-path / --config-name.")  # fmt: skip
    if tree.pop("hydra", None) is not None:
        out.notes.append(f"{file}: hydra: Hydra's own settings (its search path), nothing to convert")
    for key, v in flatten(tree).items():
        if isinstance(v, str) and "${" in v:
            out.refused.append(f"{file} line {lines.get(tuple(key.split('.')), '?')}: {key} = {v!r} is an OmegaConf interpolation, which "
                               "postrl does not resolve. Fix: write the value.")  # fmt: skip
        out.items.append(Item(key, v, None))
    out.check(str(file))
    out.notes.append(f"line {n}: --config-path / --config-name: {file} read ({len(out.items)} keys, from verl's {first}); the script's keys replace its values")
    return out


# verl's defaults (ppo_trainer.yaml) for the keys that decide what is trained, where postrl's default differs
# (GRPO's seq-mean-token-mean, the math_17k_acc verifier) or could: a converted script trains what verl would.
VERL_DEFAULTS: dict[str, tuple[str, Any]] = {
    "actor_rollout_ref.actor.loss_agg_mode": ("algorithm.loss_agg_mode", "token-mean"),
    "actor_rollout_ref.actor.clip_ratio": ("algorithm.clip_ratio_low", 0.2),
    "actor_rollout_ref.actor.clip_ratio_high": ("algorithm.clip_ratio_high", 0.2),
    "reward_model.reward_manager": ("reward.verifiers", [{"name": "verl_default", "weight": 1.0}]),
}


def _with_verl_overrides(items: list[Item], extra: list[Item], where: str, entry: str | None = None, script_dir: Path | None = None) -> Conversion:
    """The file's items with the command line's verl keys replacing theirs; postrl keys left in `rest`."""
    dedupe_file = Reading(list(items))
    dedupe(dedupe_file)
    dedupe_file.check(where)
    items, rest = dedupe_file.items, []
    notes = dedupe_file.notes
    for it in extra:
        if it.key in VERL or it.key.startswith(VERL_HEADS + tuple(VERL_PREFIXES)) or any(i.key == it.key for i in items):
            items = [i for i in items if i.key != it.key] + [it]
        else:
            rest.append(f"{it.key}={it.raw}")
    conv = convert_verl(items, where, entry, script_dir)
    flat = conv.flat()
    for verl_key, (key, value) in VERL_DEFAULTS.items():  # a whole script: what verl runs when it names nothing
        if key == "reward.verifiers" and "custom_reward_function.path" in {i.key for i in items}:
            continue  # the user's own function: listed as not mapped, with how to name it in reward.verifiers
        if key not in flat and verl_key not in {i.key for i in items}:
            conv.mapped.append(Mapped(f"{verl_key} (not given)", value, {key: value}, "verl's default, where postrl's differs or decides what is trained"))
    build_tree(conv)
    conv.notes += notes + [f"{it.key}={it.value!r}: given on the command line (replaces the file's value, if any)" for it in extra if f"{it.key}={it.raw}" not in rest]
    conv.rest = rest
    return conv


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
def code_keys(tree: dict) -> list[tuple[str, Any, str]]:
    """(postrl key, value, what it runs) of every setting in `tree` that imports or runs code other than postrl's:
    `postrl train SCRIPT.sh` asks for --allow-code before it trains with them, convert-config lists them apart."""
    flat = flatten(tree)
    out: list[tuple[str, Any, str]] = []
    if flat.get("model.trust_remote_code") is True:
        out.append(("model.trust_remote_code", True, "runs the Python files of the model's repository (from_pretrained)"))
    for i, v in enumerate(flat.get("reward.verifiers") or []):
        name = v.get("name") if isinstance(v, dict) else v
        if isinstance(name, str) and ":" in name:
            out.append((f"reward.verifiers[{i}]", name, "imports and calls this reward function"))
    for i, tool in enumerate(flat.get("rollout.multi_turn.tools") or []):
        if isinstance(tool, str) and not tool.startswith("builtin:"):
            out.append((f"rollout.multi_turn.tools[{i}]", tool, "imports and calls this tool"))
    for key, what in (("rollout.multi_turn.interaction", "imports this environment class"), ("rollout.agent", "runs this agent program"),
                      ("rollout.environment", "imports this environment")):  # fmt: skip
        if flat.get(key):
            out.append((key, flat[key], what))
    for key in ("algorithm.policy_loss", "algorithm.adv_estimator"):
        if isinstance(flat.get(key), str) and ":" in flat[key]:
            out.append((key, flat[key], "imports this function"))
    return out


def _leaves_machine(url: str) -> bool:
    """True unless `url`'s host is this machine (localhost or a loopback address)."""
    from urllib.parse import urlsplit

    from postrl.utils import is_loopback

    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return True
    return not is_loopback(host)


def sends_keys(tree: dict) -> list[tuple[str, Any, str, bool]]:
    """(postrl key, value, what it sends, whether `postrl train SCRIPT.sh` asks for --allow-code) of every setting
    in `tree` that sends data away from the run: what the model writes (code to a SandboxFusion service) is gated
    like code, since another machine runs it; the trackers (W&B, SwanLab) get the configuration and metrics, which
    the user's own login to them decides, and are listed."""
    flat = flatten(tree)
    out: list[tuple[str, Any, str, bool]] = []
    url = flat.get("rollout.multi_turn.sandbox.url")
    if flat.get("rollout.multi_turn.sandbox.backend") == "sandbox_fusion" and url:
        where = "another machine (not loopback)" if _leaves_machine(str(url)) else "this machine (loopback)"
        out.append(("rollout.multi_turn.sandbox.url", url, f"sends the code the model writes to this SandboxFusion service, on {where}, which runs it", True))
    for sink in flat.get("logging.sinks") or []:
        if sink in ("wandb", "swanlab"):
            out.append(("logging.sinks", sink, f"sends the run's configuration and metrics to {sink} (the host your {sink} login names)", False))
    return out


def inert(tree: dict) -> dict:
    """A copy of `tree` without the settings that import code (`code_keys`; the user's tools stand as
    builtin:calculator), for validating a conversion without running anything of the user's."""
    import copy

    out = copy.deepcopy(tree)
    for key, _, _ in code_keys(tree):
        *parents, leaf = key.split("[")[0].split(".")
        node = out
        for k in parents:
            node = node[k]
        if node.pop(leaf, None) is not None and leaf == "tools":
            node[leaf] = ["builtin:calculator"]
    return out


def same_tree(a: Any, b: Any) -> bool:
    """Equal as data (NaN equals NaN; 1 and 1.0 and True differ)."""
    return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)


def _comment(text: Any) -> str:
    """Text safe inside a YAML comment: every line break and other unprintable character written as an escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


class _Dumper(yaml.SafeDumper):
    """One-line YAML values: a string with a line break or another unprintable character is double-quoted with escapes."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style='"' if not v.isprintable() else None))


def _one_line(v: Any) -> str:
    text = yaml.dump(v, Dumper=_Dumper, default_flow_style=True, width=10**9, allow_unicode=True).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").rstrip()


def render_yaml(conv: Conversion, source: str) -> str:
    """The postrl YAML: one comment per mapped key (its source), the settings that run code apart, then the keys
    not mapped with what postrl offers. Read back, its data is exactly `conv.tree` (checked here)."""
    origin: dict[str, list[str]] = {}
    for m in conv.mapped:
        for k in m.targets:
            origin.setdefault(k, []).append(m.source + (f" ({m.note})" if m.note else ""))
    lines = [f"# postrl configuration converted from {_comment(source)} ({conv.dialect}) by `postrl convert-config`.",
             "# Check it with `postrl check-config` (the keys postrl did not map are listed at the end)."]  # fmt: skip

    def emit(node: dict, path: str, indent: int) -> None:
        for k, v in node.items():
            key = f"{path}{k}"
            pad = "  " * indent
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{_one_line(k)}:")
                emit(v, key + ".", indent + 1)
            else:
                comment = f"  # from {_comment('; '.join(origin[key]))}" if key in origin else ""
                lines.append(f"{pad}{_one_line(k)}: {_one_line(v)}{comment}")

    emit(conv.tree, "", 0)
    code = code_keys(conv.tree)
    if code:
        lines.append("")
        lines.append(f"# Settings that run code other than postrl's ({len(code)}): `postrl train SCRIPT.sh` asks for --allow-code.")
        lines += [f"#   {key} = {_comment(repr(value))}: {what}" for key, value, what in code]
    sends = sends_keys(conv.tree)
    if sends:
        lines.append("")
        lines.append(f"# Sends data to ({len(sends)}): `postrl train SCRIPT.sh` asks for --allow-code for those marked so.")
        lines += [f"#   {key} = {_comment(repr(value))}: {what}" + (" (asks for --allow-code)" if gated else "") for key, value, what, gated in sends]
    written = [(k, v) for k, v in flatten(conv.tree).items() if k in WRITTEN]
    if written:
        lines.append("")
        lines.append(f"# Writes to ({len(written)}): the places the run creates and fills.")
        lines += [f"#   {key} = {_comment(repr(value))}" for key, value in written]
    silent = [m for m in conv.mapped if not m.targets]
    if silent:
        lines.append("")
        lines.append(f"# Mapped with nothing to set ({len(silent)} keys): postrl's behaviour already is what they ask.")
        for m in silent:
            lines.append(f"#   {_comment(m.source)} = {_comment(repr(m.value))}" + (f": {_comment(m.note)}" if m.note else ""))
    if conv.unmapped:
        lines.append("")
        lines.append(f"# Not mapped ({len(conv.unmapped)} keys): what postrl offers instead.")
        for u in conv.unmapped:
            lines.append(f"#   {_comment(u.source)} = {_comment(repr(u.value))}: {_comment(u.instead)}")
    if conv.notes:
        lines.append("")
        lines.append(f"# Read, with nothing to convert ({len(conv.notes)} notes).")
        lines += [f"#   {_comment(n)}" for n in conv.notes]
    text = "\n".join(lines) + "\n"
    assert same_tree(yaml.safe_load(text) or {}, conv.tree), "the rendered YAML does not read back as the converted tree"
    return text

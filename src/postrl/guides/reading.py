"""Reading the guides' files as printed: verl shell scripts and MindSpeed-RL YAMLs, every key with its line.

Users paste the guides' text as it stands: scripts with `\\` continuations followed by a comment
(`trainer.total_training_steps=150 \\ # 原代码`), `${VAR}` references, their own shell variables;
YAML values followed by an annotation (`token_level_loss: true <------- 默认关闭`). Each line of
such a file ends as an `Item` (a key to convert), a note (read, nothing to convert, said so) or a
refusal that names the line; nothing is dropped without a word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from postrl.errors import UserError


@dataclass
class Item:
    key: str
    value: Any
    line: int | None = None
    raw: str = ""  # the value as written (overrides passed on to postrl's own parser)


@dataclass
class Reading:
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    entry: str | None = None  # the module a script runs (`python3 -m verl.trainer.main_ppo`)

    def check(self, where: str) -> None:
        if self.refused:
            raise UserError(*self.refused, title=f"{where}: {len(self.refused)} line(s) postrl cannot read as the guide means")


# A value followed by the guides' annotation: whitespace, then an arrow or `#`, then free text.
_ANNOTATION = re.compile(r"^(?P<value>\S(?:.*?\S)?)\s+(?:<-|<=|←|#)(?P<note>.*)$", re.S)


def yaml_value(raw: str) -> Any:
    """A `key=value` value as YAML reads it (True a bool, 0.28 a float, [a,b] a list), else the text."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def strip_annotation(value: Any) -> tuple[Any, str | None]:
    """(value, annotation) of a string value written with the guides' trailing annotation."""
    if not isinstance(value, str):
        return value, None
    m = _ANNOTATION.match(value.strip())
    if not m:
        return value, None
    return yaml_value(m["value"]), value.strip()[len(m["value"]) :].strip()


# ------------------------------------------------------------------------------------------- shell
def _logical_lines(text: str) -> tuple[list[list[tuple[int, str]]], list[str]]:
    """Each command as its (line number, text) pieces, with comments removed and continuations joined."""
    out: list[list[tuple[int, str]]] = []
    notes: list[str] = []
    buf: list[tuple[int, str]] = []
    quote = None
    for n, line in enumerate(text.splitlines(), 1):
        kept, i = [], 0
        while i < len(line):
            c = line[i]
            if quote:
                if c == quote:
                    quote = None
                elif c == "\\" and quote == '"' and i + 1 < len(line):
                    kept.append(c)
                    i += 1
                    c = line[i]
            elif c in "'\"":
                quote = c
            elif c == "\\" and i + 1 < len(line):
                kept.append(c)
                i += 1
                c = line[i]
            elif c == "#" and (i == 0 or line[i - 1].isspace()):
                break
            kept.append(c)
            i += 1
        body = "".join(kept).rstrip()
        cut = len(body) < len(line.rstrip()) and not line.lstrip().startswith("#")
        if quote:  # a quoted value runs on to the next line
            buf.append((n, body + "\n"))
            continue
        if body.endswith("\\") and not body.endswith("\\\\"):
            if cut and body[:-1].rstrip() != body[:-1]:
                notes.append(
                    f"line {n}: `\\` followed by a comment: a shell ends the command there (the lines after it would not "
                    "reach the trainer); read as the continuation the guide means"
                )
            buf.append((n, body[:-1] + " "))
            continue
        buf.append((n, body))
        if "".join(t for _, t in buf).strip():
            out.append(buf)
        buf = []
    if "".join(t for _, t in buf).strip():
        out.append(buf)
    return out, notes


def dedupe(reading: Reading, label: str = "line") -> None:
    """A key given twice: the same value is noted; two different values are refused (which one is meant?)."""
    first: dict[str, Item] = {}
    kept = []
    for it in reading.items:
        prev = first.get(it.key)
        if prev is None:
            first[it.key] = it
            kept.append(it)
        elif prev.value == it.value:
            reading.notes.append(f"{label} {it.line}: {it.key} repeats {label} {prev.line} with the same value")
        else:
            reading.refused.append(
                f"{label}s {prev.line} and {it.line}: {it.key} is given twice with different values ({prev.value!r}, then "
                f"{it.value!r}); a command line keeps the last silently, so which one is meant is unclear. Fix: keep one."
            )
    reading.items = kept


# -------------------------------------------------------------------------------------------- YAML
def load_yaml_lines(text: str, where: str) -> tuple[Any, dict[tuple, int], list[str]]:
    """(the YAML as safe_load reads it, line of every mapping key by its path, refusals for duplicate keys)."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise UserError(f"{where} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if node is None:
        return None, {}, []
    lines: dict[tuple, int] = {}
    refused: list[str] = []

    def walk(n: yaml.Node, path: tuple) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                key = str(k.value)
                line = k.start_mark.line + 1
                if key in seen:
                    refused.append(
                        f"lines {seen[key]} and {line}: '{'.'.join((*path, key))}' appears twice in one mapping; YAML readers "
                        "keep the last silently, so which one is meant is unclear. Fix: keep one."
                    )
                seen[key] = line
                lines[(*path, key)] = line
                walk(v, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[(*path, i)] = v.start_mark.line + 1
                walk(v, (*path, i))

    walk(node, ())
    return yaml.safe_load(text), lines, refused

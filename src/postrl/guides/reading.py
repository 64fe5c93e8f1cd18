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
from postrl.yaml_bounded import FIX, MAX_NODES, TooLarge, compose, load


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
    hydra: list[tuple[str, str, int]] = field(default_factory=list)  # (flag, value, line) of --config-name / -path / -dir

    def check(self, where: str) -> None:
        if self.refused:
            raise UserError(*self.refused, title=f"{where}: {len(self.refused)} line(s) postrl cannot read as the guide means")


# A value followed by the guides' annotation: whitespace, then an arrow or `#`, then free text.
_ANNOTATION = re.compile(r"^(?P<value>\S(?:.*?\S)?)\s+(?:<-|<=|←|#)(?P<note>.*)$", re.S)


MAX_YAML_NODES = MAX_NODES  # kept under the name the guides' tests use


def compose_bounded(text: str) -> yaml.Node | None:
    """The YAML node graph of `text`, refused (TooLarge) past postrl.yaml_bounded's bounds."""
    return compose(text)


def safe_load_bounded(text: str) -> Any:
    """yaml.safe_load within postrl.yaml_bounded's bounds (aliases expanded, nesting)."""
    return load(text)


def yaml_value(raw: str) -> Any:
    """A `key=value` value as YAML reads it (True a bool, 0.28 a float, [a,b] a list), else the text; TooLarge
    for a value whose aliases expand past MAX_YAML_NODES."""
    if raw == "":
        return ""
    try:
        return safe_load_bounded(raw)
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
MAX_OPEN_LINES = 1000  # lines one quote or substitution may span (each new line rescans it)


def _logical_lines(text: str) -> tuple[list[list[tuple[int, str]]], list[str]]:
    """Each command as its (line number, text) pieces, with comments removed and continuations joined; a quote or
    substitution left open runs on to the next line (postrl.guides.shell.skip decides what is quoted)."""
    from postrl.guides.shell import ShellError, skip

    out: list[list[tuple[int, str]]] = []
    notes: list[str] = []
    buf: list[tuple[int, str]] = []
    resume, opened = 0, None  # where the scan of the pending text goes on; the line a construct opened on
    for n, line in enumerate(text.splitlines(), 1):
        pending = "".join(t for _, t in buf)
        full, start, i, comment = pending + line, len(pending), resume, None
        while i < len(full):
            if full[i] == "#" and i >= start and (i == 0 or full[i - 1].isspace()):
                comment = i
                break
            try:
                i = skip(full, i)
            except ShellError as exc:
                if "unterminated" not in str(exc) or (opened is not None and n - opened > MAX_OPEN_LINES):
                    i = len(full)  # read as written: the expansion says what is wrong
                    continue
                break
        if i < len(full) and comment is None:  # a quote or substitution runs on to the next line
            buf.append((n, line + "\n"))
            resume, opened = i, opened or n
            continue
        resume, opened = 0, None
        body = (full[:comment] if comment is not None else full)[start:].rstrip()
        cut = comment is not None and not line.lstrip().startswith("#")
        if body.endswith("\\") and not body.endswith("\\\\"):
            if cut and body[:-1].rstrip() != body[:-1]:
                notes.append(
                    f"line {n}: `\\` followed by a comment: a shell ends the command there (the lines after it would not "
                    "reach the trainer); read as the continuation the guide means"
                )
            buf.append((n, body[:-1] + " "))
            resume = len(pending) + len(body) - 1 + 1
            continue
        buf.append((n, body))
        if "".join(t for _, t in buf).strip():
            out.append(buf)
        buf, resume = [], 0
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
        node = compose_bounded(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{where} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    except TooLarge as exc:
        raise UserError(f"{where}: {exc}. {FIX}") from None
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

    walk(node, ())  # nesting is bounded (MAX_DEPTH) and so are the nodes, aliases expanded (MAX_NODES)
    return load(text), lines, refused

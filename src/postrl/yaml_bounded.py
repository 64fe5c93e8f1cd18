"""The one YAML loader for files and values a user gives postrl: yaml.SafeLoader with bounds.

PyYAML shares the object an alias (`*name`) points to, so an alias bomb (each level a list of nine aliases of
the one before) loads in microseconds and then expands exponentially in whatever walks it next: a
validation, a deep copy, a JSON dump. A document nested 10,000 levels deep makes PyYAML's recursive
composer raise RecursionError. `BoundedLoader` refuses both before anything is built: nesting past
MAX_DEPTH while composing, a tree whose aliases expand past MAX_NODES (or point into themselves) once
composed. Every refusal is a `TooLarge` (a ValueError) whose message says what and how far; callers turn
it into their one-paragraph UserError. Files postrl wrote itself (a run's config.yaml) may use yaml.safe_load.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 100_000  # values of one document, aliases expanded; a config or launch script holds hundreds
MAX_DEPTH = 100  # nesting levels; postrl's and verl's configs nest fewer than ten


class TooLarge(ValueError):
    """A YAML text past MAX_NODES / MAX_DEPTH, or with an alias inside itself (the message says which)."""


def expanded_size(node: yaml.Node) -> int:
    """Values of the tree `node` stands for with every alias expanded, in time linear in the node graph
    (memoised by node, no recursion; capped at MAX_NODES + 1). TooLarge for an alias inside its own anchor."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being sized: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        kids = [c for kv in n.value for c in kv] if isinstance(n, yaml.MappingNode) else n.value if isinstance(n, yaml.SequenceNode) else []
        if done:
            sizes[id(n)] = min(1 + sum(sizes[id(c)] for c in kids), MAX_NODES + 1)
            open_.discard(id(n))
            continue
        if id(n) in sizes:
            continue
        if id(n) in open_:
            raise TooLarge("an alias (*name) stands inside the anchor it names, so the value never ends")
        open_.add(id(n))
        stack.append((n, True))
        stack += [(c, False) for c in kids if id(c) not in sizes]
    return sizes[id(node)]


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses (TooLarge) nesting past MAX_DEPTH and documents whose aliases expand past MAX_NODES."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise TooLarge(f"it nests more than {MAX_DEPTH} levels deep, more than postrl reads")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None and expanded_size(node) > MAX_NODES:
            raise TooLarge(f"its YAML aliases (*name) expand to more than {MAX_NODES:,} values, more than postrl reads")
        return node


def compose(text: str) -> yaml.Node | None:
    """The checked node graph of `text` (yaml.YAMLError for bad syntax, TooLarge past the bounds)."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def load(text: str) -> Any:
    """yaml.safe_load of `text` within the bounds (yaml.YAMLError for bad syntax, TooLarge past the bounds)."""
    return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 -- a SafeLoader subclass


FIX = "Fix: write the values out (no anchors / aliases, no deep nesting)."

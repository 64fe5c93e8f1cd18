"""The package's shape and the device layer: no import cycles between modules or between packages, a house
of at most 16 floors, every tensor on runtime.device."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from postrl.checks import load_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "postrl"


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (function-level imports too)."""
    top = root.name
    mods = {".".join((top,) + f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                # `from pkg import mod` imports pkg.mod, as `from pkg.mod import x` does: not pkg's __init__
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `from pkg.mod import name` -> pkg.mod
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t not in (m, top):
                    graph[m].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_inside_the_package():
    graph = import_graph(PACKAGE)
    assert len(graph) > 30 and "postrl.trainer" in graph["postrl.launch"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the packages it imports: a package is a directory under src/postrl, a top-level module
    counts as itself (postrl.config.schema -> postrl.config; postrl.trainer stays postrl.trainer)."""
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(top(m), set()).update(top(t) for t in targets if top(t) != top(m))
    return out


# Imports that still run up from the core into agents/ (empty since issue 62's split of agents/: child-process
# supervision, the token helpers, the tool-call format and the all-fail rule stand below both): named here so that
# nothing else may join them, and each must still exist.
UPWARD_UNTIL_AGENTS_SPLIT: set[tuple[str, str]] = set()
CORE_INTO_AGENTS_UNTIL_SPLIT: set[str] = set()
MAX_FLOORS, MAX_UPWARD = 16, 3


def test_no_import_cycles_between_packages():
    """Imports run downwards between packages too (config near the ground, cli at the top): a cycle through
    two packages (config.schema -> rewards.registry -> ... -> config) is not caught by the module check."""
    packages = package_graph(import_graph(PACKAGE))
    assert {"postrl.config", "postrl.rewards", "postrl.data", "postrl.guides", "postrl.cli"} <= set(packages)
    stale = sorted(e for e in UPWARD_UNTIL_AGENTS_SPLIT if e[1] not in packages[e[0]])
    assert not stale, f"no longer imported, remove from UPWARD_UNTIL_AGENTS_SPLIT: {stale}"
    assert len(UPWARD_UNTIL_AGENTS_SPLIT) <= MAX_UPWARD
    for low, high in UPWARD_UNTIL_AGENTS_SPLIT:
        packages[low].discard(high)
    cycle = find_cycle(packages)
    assert cycle is None, " -> ".join(cycle)


def test_the_house_has_at_most_16_floors():
    """Floor 1 imports no other package; a package stands one floor above the highest it imports."""
    packages = package_graph(import_graph(PACKAGE))
    for low, high in UPWARD_UNTIL_AGENTS_SPLIT:
        packages[low].discard(high)

    @cache
    def floor(p: str) -> int:
        return 1 + max((floor(q) for q in packages[p]), default=0)

    floors = {p: floor(p) for p in packages}
    assert floors["postrl.errors"] == 1 and floors["postrl.cli"] > floors["postrl.trainer"] > floors["postrl.config"]
    assert max(floors.values()) <= MAX_FLOORS, sorted(floors.items(), key=lambda kv: -kv[1])[:MAX_FLOORS + 1]


def test_the_core_does_not_import_agents():
    packages = package_graph(import_graph(PACKAGE))
    core = {"postrl.config", "postrl.rewards", "postrl.data", "postrl.experience", "postrl.evaluate", "postrl.algorithms",
            "postrl.rollout", "postrl.batch", "postrl.actor", "postrl.runtime", "postrl.checkpoint"}  # fmt: skip
    into = {p for p in core if "postrl.agents" in packages[p]}
    assert into <= CORE_INTO_AGENTS_UNTIL_SPLIT, sorted(into - CORE_INTO_AGENTS_UNTIL_SPLIT)
    assert not CORE_INTO_AGENTS_UNTIL_SPLIT - into, f"no longer import agents, remove from CORE_INTO_AGENTS_UNTIL_SPLIT: {sorted(CORE_INTO_AGENTS_UNTIL_SPLIT - into)}"


def test_the_package_check_finds_a_cycle_through_two_packages():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.b.z"}, "p.b.z": {"p.a.w"}, "p.a.w": set(), "p.c": {"p.a.x"}}
    assert find_cycle(graph) is None  # no cycle between modules ...
    assert package_graph(graph) == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert find_cycle(package_graph(graph)) == ["p.a", "p.b", "p.a"]  # ... but one between packages


def test_checkpoint_and_the_layers_below_the_loop_do_not_import_the_trainer():
    graph = import_graph(PACKAGE)
    for low in ("postrl.checkpoint", "postrl.actor", "postrl.experience", "postrl.distributed", "postrl.runtime"):
        assert "postrl.trainer" not in graph[low], low


def test_test_modules_are_imported_under_one_name():
    """pytest imports tests/*.py under their bare names (conftest puts tests/ on sys.path); importing one as
    `tests.x` as well would load it twice, with two copies of its classes and fixtures."""
    tests = Path(__file__).parent
    twice = [f"{path.name}:{n}" for path in sorted(tests.glob("*.py")) for n, line in enumerate(path.read_text().splitlines(), 1)
             if line.lstrip().startswith(("from tests.", "import tests."))]  # fmt: skip
    assert not twice, twice


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_the_model_and_every_micro_batch_tensor_sit_on_the_runtime_device(tmp_path, device):
    """train.device decides where the policy, the reference and each micro-batch live; a hook on the
    model's forward sees every input the update and the log-prob passes feed it."""
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, f"train.device={device}", "algorithm.kl.coef=0.01", "train.total_steps=1",
                                           "train.mini_batch_size=2", "reward.verifiers=[verifiers_for_tests:length_parity]"))  # fmt: skip
    tr = Trainer(cfg)
    want = torch.device(device, 0) if device != "cpu" else torch.device("cpu")
    assert tr.runtime.device == want
    seen: list[torch.device] = []

    def check(module, args, kwargs):
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor):
                seen.append(value.device)

    hooks = [m.register_forward_pre_hook(check, with_kwargs=True) for m in (tr.model, tr.ref_model)]
    batch, _ = tr.experience.collect(tr.step, tr.timer)
    packed = tr.actor.pack(batch, torch.zeros(batch.size))
    assert {t.device for t in packed.tensors.values()} == {want}
    for _idx, mb in tr.actor.micro_batches(range(packed.size), packed):
        assert {t.device for t in mb.values() if isinstance(t, torch.Tensor)} == {want}
    seen.clear()  # only the training passes from here on (generation ran on the same model above)
    tr.train_step()
    for h in hooks:
        h.remove()
    tr.close()
    assert len(seen) >= 4 and set(seen) == {want}  # old log-probs, reference, update forward passes
    assert {p.device for p in tr.model.parameters()} == {want}
    assert {p.device for p in tr.ref_model.parameters()} == {want}

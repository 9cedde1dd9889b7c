"""The package's shape: no import circle among fastpack's modules, and the import paths
users already have keep working when a module is split."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "fastpack"


def _modules() -> dict[str, Path | None]:
    """Every module of the package by dotted name (compiled ones, known by their stub,
    with no source to read: None)."""
    found: dict[str, Path | None] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted(PACKAGE.rglob("*.pyi")):
        found.setdefault(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts), None)
    return found


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs (or type-checks) when it is loaded: at its top level and
    under ``if`` / ``try`` (``TYPE_CHECKING`` included), not inside functions or classes
    (there an import is deferred on purpose)."""
    found: list[ast.Import | ast.ImportFrom] = []
    body: list[ast.stmt] = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                body += handler.body
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the fastpack modules it imports at module level. ``from .x import name``
    depends on the submodule ``x.name`` when there is one, on ``x`` otherwise."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        if path is None:
            continue
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                           else source for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, nexts = stack[-1]
            step = next(nexts, None)
            if step is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif step in on_path:
                return path[path.index(step):] + [step]
            elif step not in done:
                stack.append((step, iter(sorted(graph[step]))))
                path.append(step)
                on_path.add(step)
    return None


def test_find_cycle_finds_one() -> None:
    """The checker itself: a circle through three modules and one through TYPE_CHECKING
    are found, a diamond is not a circle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None
    tree = ast.parse("if TYPE_CHECKING:\n    from .x import y\ndef f():\n    import z\n")
    assert [ast.unparse(n) for n in _module_level_imports(tree)] == ["from .x import y"]


def test_no_import_circle() -> None:
    graph = import_graph()
    assert {"fastpack._plan", "fastpack._context_parallel", "fastpack._core"} <= graph.keys()
    assert "fastpack._context_parallel" in graph["fastpack._plan"]  # the graph sees imports
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


#: Names that moved out of a module, by their old module: where they live now.
MOVED = {
    "fastpack.torch.hf": {
        "register_hf_attention": "fastpack.torch.hf_attention",
        "check_model_batch": "fastpack.torch.hf_check",
        "PackedTrainerMixin": "fastpack.torch.trainer",
        "StepBatches": "fastpack.torch.trainer",
        "StepLoader": "fastpack.torch.trainer",
        "STEP_KEYS": "fastpack.torch.trainer",
    },
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_paths_still_work(old: str) -> None:
    """A user's ``from fastpack.torch.hf import PackedTrainerMixin`` gets the very object
    the new module defines (not a copy that would drift)."""
    pytest.importorskip("torch")
    module = importlib.import_module(old)
    assert sorted(module.__all__) == sorted(MOVED[old])
    for name, new in MOVED[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(new), name), name

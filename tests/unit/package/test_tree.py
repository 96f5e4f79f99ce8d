"""The package tree is the pipeline: a module imports only from its own stage or the ones below."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "hyperckpt"

#: The stages in pipeline order; a module may import from its own stage and those before it.
STAGES = [
    "hyperckpt.errors",
    "hyperckpt._storage",  # the seam: the only code that opens, creates or stats a file
    "hyperckpt._arguments",  # checks of the options callers pass
    "hyperckpt._format",
    "hyperckpt._layout",
    "hyperckpt._torch_internals",  # torch's private names, behind one fence
    "hyperckpt._dist",  # across ranks (agreement, headers once, spawning), below the planner
    "hyperckpt._planner",
    "hyperckpt._read",
    "hyperckpt._exchange",
    "hyperckpt._load",  # the public entry points: options, readers, describe, load
    "hyperckpt._verify",
    "hyperckpt._consolidate",
    "hyperckpt._save",  # writing: reuses the consolidation's file planning
    "hyperckpt._sample",
    "hyperckpt._cli",
]

#: Stages that promise not to import torch, directly or through what they import.
TORCH_FREE = {
    "hyperckpt.errors",
    "hyperckpt._storage",
    "hyperckpt._arguments",
    "hyperckpt._format",
    "hyperckpt._layout",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stage(module: str) -> int | None:
    for index, stage in enumerate(STAGES):
        if module == stage or module.startswith(stage + "."):
            return index
    return None


def _imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_stage_or_is_the_public_top() -> None:
    unplaced = [
        name
        for name in MODULES
        if _stage(name) is None
        and name not in {"hyperckpt", "hyperckpt.__main__", "hyperckpt.types", "hyperckpt.mapping"}
        and not name.startswith("hyperckpt.testing")
    ]
    assert unplaced == [], "add these modules to a stage folder, or the stage to STAGES"


@pytest.mark.parametrize("module", [name for name in MODULES if _stage(name) is not None])
def test_no_module_imports_from_a_later_stage(module: str) -> None:
    own = _stage(module)
    assert own is not None
    later = [
        name
        for name in _imports(MODULES[module])
        if name.startswith("hyperckpt") and (_stage(name) or 0) > own
    ]
    assert later == [], f"{module} (stage {STAGES[own]}) imports from a later stage: {later}"


def test_the_root_package_is_not_imported_from_inside_a_stage() -> None:
    for module, path in MODULES.items():
        if _stage(module) is None:
            continue
        roots = [
            node.lineno
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom)
            and node.module == "hyperckpt"
            and not all(alias.name.startswith("_") for alias in node.names)
        ]
        assert roots == [], f"{module} imports public names from the package root"


@pytest.mark.parametrize(
    "module",
    [
        name
        for name in MODULES
        if _stage(name) is not None and STAGES[_stage(name) or 0] in TORCH_FREE
    ],
)
def test_the_parsing_stages_never_import_torch(module: str) -> None:
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen or current not in MODULES:
            continue
        seen.add(current)
        for name in _imports(MODULES[current]):
            assert name.split(".")[0] != "torch", f"{module} reaches torch through {current}"
            if name in MODULES:
                todo.append(name)


def _runtime_imports(path: Path) -> set[str]:
    """The hyperckpt modules ``path`` imports when it runs (at any depth of its code; those
    under ``if TYPE_CHECKING:`` left out, since they never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for child in ast.walk(statement)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in MODULES}
    return found


def test_no_modules_import_each_other() -> None:
    """No import circle, direct or through others: each module can be read (and changed)
    knowing only those below it.  A function-level import counts: it hides a circle."""
    edges = {module: _runtime_imports(path) - {module} for module, path in MODULES.items()}
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert circles == [], f"import circles: {circles}"

"""torch's private names live behind one fence, :mod:`hyperckpt._torch_internals`.

The scan reads the package's code (not its docstrings, whose prose names ``_StridedShard``
for users) and finds every private torch name it uses: an import of a private name or from a
private torch module, an attribute or an attribute-name string that is private on the torch
objects hyperckpt handles, a write of an object's ``__dict__``, a look at a class's
``__mro__``.  Only the fence may hold them.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

import hyperckpt._torch_internals as fence
from hyperckpt import CheckpointError

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "hyperckpt"

#: The modules allowed to hold torch's private names (the issue allows two; one is used).
FENCED = {"hyperckpt/_torch_internals.py"}

#: The torch modules and classes whose private attributes hyperckpt could reach for.
_TORCH_SOURCES = (
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.default_planner",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.planner_helpers",
    "torch.distributed.checkpoint.state_dict_loader",
    "torch.distributed.checkpoint.storage",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
)
_TORCH_CLASSES = (
    ("torch", "Tensor"),
    ("torch.nn", "Parameter"),
    ("torch.distributed", "ProcessGroup"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.planner", "ReadItem"),
    ("torch.distributed.checkpoint.planner", "LoadPlan"),
    ("torch.distributed.checkpoint.planner", "LoadPlanner"),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner"),
    ("torch.distributed.checkpoint.storage", "StorageReader"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
)


def _torch_private_names() -> frozenset[str]:
    """Every single-underscore name of those torch modules and classes."""
    names: set[str] = set()
    for module in _TORCH_SOURCES:
        names.update(dir(importlib.import_module(module)))
    for module, name in _TORCH_CLASSES:
        names.update(dir(getattr(importlib.import_module(module), name)))
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


TORCH_PRIVATE = _torch_private_names()


def _defined_here(tree: ast.Module) -> set[str]:
    """The names a module defines itself (its own private attributes may share a name with
    one of torch's: ``self._lock``, ``rule._apply``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return names


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def private_uses(source: str, ours: set[str] | None = None) -> Iterator[tuple[int, str]]:
    """Each use of a private torch name in ``source``: (line, what).

    ``ours``: names the package defines itself, never counted as torch's (by default,
    the names ``source`` defines).
    """
    tree = ast.parse(source)
    ours = _defined_here(tree) if ours is None else ours
    docstrings = _docstrings(tree)
    private = TORCH_PRIVATE - ours
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _is_torch(node.module):
            if any(part.startswith("_") for part in node.module.split(".")):
                yield node.lineno, f"from {node.module} import"
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if _is_torch(alias.name) and any(part.startswith("_") for part in parts):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Attribute):
            if node.attr in private:
                yield node.lineno, f".{node.attr}"
            elif node.attr == "__mro__":
                yield node.lineno, ".__mro__"
            elif (
                node.attr == "__dict__" and isinstance(node.ctx, ast.Load) and _written(tree, node)
            ):
                yield node.lineno, ".__dict__ written"
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            if node.value == "__dict__":
                yield node.lineno, "'__dict__' set"
            elif re.fullmatch(r"[\w.]+", node.value) and any(
                part in private for part in node.value.split(".")
            ):
                yield node.lineno, f"{node.value!r}"


def _written(tree: ast.Module, attribute: ast.Attribute) -> bool:
    """Whether ``x.__dict__`` is the target of a subscript assignment or deletion."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and node.value is attribute
            and isinstance(node.ctx, ast.Store | ast.Del)
        ):
            return True
    return False


def _package_names() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names |= _defined_here(ast.parse(path.read_text()))
    return names


def _uses_by_module() -> dict[str, list[tuple[int, str]]]:
    ours = _package_names()
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = list(private_uses(path.read_text(), ours))
        if uses:
            found[str(path.relative_to(ROOT))] = uses
    return found


def test_torchs_private_names_are_used_behind_the_fence_only() -> None:
    found = _uses_by_module()
    outside = {module: uses for module, uses in found.items() if module not in FENCED}
    assert outside == {}, (
        "torch's private names outside hyperckpt/_torch_internals.py: add the name there, "
        "with its public spelling, and import it from there"
    )
    assert set(found) == FENCED  # the fence itself is seen by the scan


@pytest.mark.parametrize(
    ("snippet", "what"),
    [
        ("from torch.distributed.tensor.placement_types import _StridedShard", "_StridedShard"),
        ("from torch.distributed.tensor._utils import f", "tensor._utils"),
        ("import torch.distributed._shard._utils", "import torch.distributed._shard"),
        ("def f(value):\n    return value._local_tensor", "._local_tensor"),
        ("def f(value):\n    return value._spec.mesh", "._spec"),
        ("from operator import attrgetter\nget = attrgetter('_spec.placements')", "'_spec"),
        ("def f(item):\n    object.__setattr__(item, '__dict__', {})", "'__dict__' set"),
        ("def f(item):\n    item.__dict__['fqn'] = 'x'", "__dict__ written"),
        ("def f(cls):\n    return cls.__mro__[1]", "__mro__"),
        ("def f(pg):\n    return c10d._get_process_group_store(pg)", "_get_process_group"),
    ],
)
def test_the_scan_finds_each_kind_of_private_use(snippet: str, what: str) -> None:
    uses = list(private_uses(snippet))
    assert any(what in found for _, found in uses), uses


def test_the_scan_leaves_our_own_private_names_and_docstrings_alone() -> None:
    snippet = (
        '"""Loads ``_StridedShard`` DTensors (``value._local_tensor``)."""\n'
        "class Rule:\n"
        "    __slots__ = ('_lock',)\n"
        "    def _apply(self):\n"
        "        return self._lock\n"
        "def f(rule, reader):\n"
        "    state = reader.__dict__\n"
        "    return rule._apply(), state.get('x')\n"
    )
    assert list(private_uses(snippet)) == []


def test_the_declared_torch_range_is_the_tested_range() -> None:
    oldest, newest = fence.TESTED_TORCH
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_spec = next(d for d in project["dependencies"] if re.match(r"torch\b", d))
    major, minor, _ = newest.split(".")
    assert torch_spec == f"torch>={oldest.rsplit('.', 1)[0]},<{major}.{int(minor) + 1}"
    ci = (ROOT / ".ci" / "run").read_text()
    for version in (oldest, newest):
        assert f"torch=={version}" in ci, f".ci/run does not install torch {version}"


def test_an_unknown_value_of_the_switch_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(CheckpointError, match=r"HYPERCKPT_TORCH_INTERNALS='yes'.*0.*1"):
        fence._chosen({fence.INTERNALS_ENV: "yes"})
    assert fence._chosen({}) is True
    assert fence._chosen({fence.INTERNALS_ENV: "0"}) is False


def test_the_module_level_names_are_the_chosen_sets() -> None:
    chosen = fence.INTERNAL if os.environ.get(fence.INTERNALS_ENV, "1") == "1" else fence.PUBLIC
    assert fence.USE_INTERNALS is (chosen is fence.INTERNAL)
    for field in fence.TorchFunctions.__dataclass_fields__:
        if field != "name":
            assert getattr(fence, field) is getattr(chosen, field), field

"""Every code reference in the docs resolves: dotted names import, repository paths exist.

A rename (a module moved to ``tests/``, a type moved to ``hyperckpt.types``) that leaves a
page pointing at what is gone fails here, not in a reader's hands.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: ``hyperckpt.x.y`` inside backticks: a module, or an attribute of one, at any depth.
_DOTTED = re.compile(r"`(hyperckpt(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
#: A path in the repository inside backticks; one followed by ``{`` or ``.{`` is a stem
#: (``results.{json,md}``) and one with ``*`` a pattern, neither a file.
_PATH = re.compile(r"`((?:hyperckpt|tests|benchmarks|docs|\.ci)/[A-Za-z0-9_./-]+)")

#: A module of the package by its path inside it (``_read/engine.py``).
_MODULE_PATH = re.compile(r"`(_[a-z_]+/[A-Za-z0-9_/]+\.py)`")


def _paths(text: str) -> list[str]:
    return [
        m.group(1).rstrip(".,:;")
        for m in _PATH.finditer(text)
        if text[m.end() : m.end() + 1] not in ("{", "*")
    ] + [f"hyperckpt/{m}" for m in _MODULE_PATH.findall(text)]


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(value, part):
                return False
            value = getattr(value, part)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_and_path_a_page_names_exists(page: Path) -> None:
    text = page.read_text()
    missing = [m for m in sorted(set(_DOTTED.findall(text))) if not _resolves(m)]
    for path in sorted(set(_paths(text))):
        where = ROOT / path
        if not where.exists() and not list(where.parent.glob(where.name + ".*")):  # or a stem
            missing.append(path)
    assert not missing, f"{page.name} names what does not exist: {missing}"


def test_the_check_itself_sees_a_missing_name_and_a_missing_path() -> None:
    assert _resolves("hyperckpt.types.LoadReport")
    assert _resolves("hyperckpt.mapping.Fuse")
    assert not _resolves("hyperckpt.LoadReport")
    assert not _resolves("hyperckpt.testing.rules")
    assert _paths("`tests/rule_catalogue.py` and `docs/x.{json,md}`") == ["tests/rule_catalogue.py"]

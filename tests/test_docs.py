"""The code in README.md and docs/*.md runs as written.

Each page's ```python blocks run in order in one namespace, in a fresh working directory,
so a later block may use what an earlier one made.  A block fenced ```python notest is
shown only (it needs GPUs, a model download or a real cluster); one fenced
```python torchrun=N is saved as a script and run with ``torchrun --nproc-per-node N``
in the same directory, as the page tells the reader to.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced python block: where it starts, its options and its code."""

    page: Path
    line: int
    options: tuple[str, ...]
    code: str

    @property
    def ranks(self) -> int:
        """Ranks to run it on with torchrun; 0 for an in-process block."""
        for option in self.options:
            if option.startswith("torchrun="):
                return int(option.removeprefix("torchrun="))
        return 0


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        options = tuple(match.group(1).split())
        unknown = [o for o in options if o != "notest" and not o.startswith("torchrun=")]
        assert not unknown, f"{page.name}:{line}: unknown fence options {unknown}"
        found.append(Block(page, line, options, match.group(2)))
    return found


RUNNABLE = [page for page in PAGES if any("notest" not in b.options for b in blocks(page))]


def test_the_readme_and_the_quickstart_have_code_that_runs() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in RUNNABLE}
    assert {"README.md", "docs/quickstart.md"} <= names


def test_every_relative_link_in_the_docs_points_at_a_file() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken


@pytest.mark.distributed
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_code_blocks_of_a_page_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if "notest" in block.options:
            compile(block.code, where, "exec")  # shown code must at least parse
        elif block.ranks:
            run_torchrun(block, where, tmp_path)
        else:
            exec(compile(block.code, where, "exec"), namespace)


# torch 2.13 sometimes aborts a rank as the interpreter exits, after all of the script ran
# ("terminate called without an active exception": a native thread still joinable at exit),
# about one run in ten on a loaded machine, with or without hyperckpt.  A rank that printed
# the marker below finished every statement of the block, assertions included.
_DONE = "__doc_block_done__"
_EXIT_ABORT = "terminate called without an active exception"


def run_torchrun(block: Block, where: str, cwd: Path) -> None:
    script = cwd / f"block_{block.line}.py"
    script.write_text(f"{block.code}\nprint({_DONE!r}, flush=True)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={block.ranks}", script.name]
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=150, env=env, check=False
    )
    finished = done.stdout.count(_DONE) == block.ranks
    if done.returncode != 0 and finished and _EXIT_ABORT in done.stderr:
        return  # every rank ran the whole block; torch aborted one on the way out
    errors = done.stderr
    if len(errors) > 8000:
        errors = errors[:4000] + "\n...\n" + errors[-4000:]
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{errors}"
    assert finished, f"{where}: not every rank reached the end:\n{done.stdout}"

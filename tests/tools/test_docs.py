"""Every ```python block of README.md and docs/*.md runs, on the CPU device, so
that the documentation cannot drift from the code.

Each block runs as a script of its own in a fresh subprocess (``ASYNCGPU_API=cpu``,
the checkout first on ``PYTHONPATH``, ``tmp_path`` as the working directory for
blocks that write files) under a timeout, so no block can hang the suite or see
another's state. A block that cannot run on the CPU device (it needs a GPU or
another library, or it is a fragment) is marked in the markdown by an HTML
comment on the line just before its fence::

    <!-- no-run: why -->
    ```python

and ``NO_RUN`` below counts those marks, so that they cannot silently grow. A
block that imports Ray or PyTorch runs where that library is installed and is
skipped elsewhere (Ray's blocks are marked ``ray`` too). A
block that only includes a file (``--8<-- "examples/x.py"``, pymdownx.snippets)
shows that file verbatim; the test checks that the file exists (the examples
themselves run in tests/tools/test_examples.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT_S = 60

# The blocks marked <!-- no-run: ... -->. Change it only with the marks.
NO_RUN = 11

_FENCE = re.compile(r"^(?P<indent>\s*)```python\b.*$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<why>\S.*?)\s*-->\s*$")
_SNIPPET = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"$')


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    no_run: str | None  # the reason, if marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def extract(path: Path) -> list[Block]:
    """The ```python blocks of one markdown file (indented ones too, as in tabs)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = m.group("indent")
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: the ```python fence is never closed")
        mark = _NO_RUN.match(lines[start - 1]) if start > 0 else None
        blocks.append(
            Block(path, start + 1, "\n".join(body) + "\n", mark.group("why") if mark else None)
        )
        i += 1
    return blocks


ALL = [b for p in SOURCES for b in extract(p)]
SNIPPETS = [b for b in ALL if _SNIPPET.match(b.code.strip())]
RUNNABLE = [b for b in ALL if b.no_run is None and b not in SNIPPETS]
MARKED = [b for b in ALL if b.no_run is not None]


def test_the_no_run_marks_are_counted():
    where = "\n".join(f"  {b.id}: {b.no_run}" for b in MARKED)
    assert len(MARKED) == NO_RUN, (
        f"{len(MARKED)} blocks are marked no-run, NO_RUN says {NO_RUN}; make the new ones "
        f"run on the CPU device, or change NO_RUN with a reason:\n{where}"
    )


def test_every_mark_stands_before_a_python_block():
    """A no-run mark that precedes no ```python fence is a typo: it marks nothing."""
    for path in SOURCES:
        lines = path.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines):
            if _NO_RUN.match(line):
                nxt = lines[n + 1] if n + 1 < len(lines) else ""
                assert _FENCE.match(nxt), f"{path.name}:{n + 1}: no-run mark before {nxt!r}"


def test_there_are_blocks_to_run():
    assert len(RUNNABLE) >= 10
    assert any(b.path.name == "README.md" for b in RUNNABLE)


@pytest.mark.parametrize("block", SNIPPETS, ids=lambda b: b.id)
def test_included_files_exist(block: Block):
    m = _SNIPPET.match(block.code.strip())
    assert m is not None
    assert (REPO / m.group("path")).is_file(), f"{block.id} includes a missing file"


try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

# Blocks that use Ray (docs/ray.md) are marked ``ray`` and need it installed.
_USES_RAY = re.compile(r"^\s*(import ray\b|from ray\b)", re.MULTILINE)
_RAY_MARKS = (
    pytest.mark.ray,
    pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed (pip install asyncgpu[ray])"),
)


# Blocks that use PyTorch on the CPU (Ray's tensor transports) need it installed.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
_USES_TORCH = re.compile(r"^\s*(import torch\b|from torch\b)", re.MULTILINE)
_TORCH_MARK = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")


def _marks(b: Block) -> list[pytest.MarkDecorator]:
    marks = list(_RAY_MARKS) if _USES_RAY.search(b.code) else []
    if _USES_TORCH.search(b.code):
        marks.append(_TORCH_MARK)
    return marks


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=_marks(b)) for b in RUNNABLE],
    ids=lambda b: b.id,
)
def test_block_runs_on_the_cpu_device(block: Block, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {
        **os.environ,
        "ASYNCGPU_API": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "MPLBACKEND": "Agg",
    }
    env.pop("ASYNCGPU_TRACE", None)
    try:
        r = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id} did not finish in {TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, (
        f"{block.id} failed ({r.returncode}):\n--- code\n{block.code}--- stdout\n{r.stdout}"
        f"--- stderr\n{r.stderr}"
    )

"""Every ```python block of README.md and docs/*.md, run as its own 2-rank MPI job.

The blocks are the documentation's examples, so they must run as written: each is saved as a
script and run with ``mpiexec -n 2 python -m tensorplay_p2p.run block.py`` under a time limit,
and must exit with status 0 (the blocks assert their own results).  Blocks in other languages
(bash, text, diff) are not run.  Like the other job tests, this module runs outside mpiexec:
``python -m pytest tests/jobs/test_docs.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from launch import bounded, launch_flags

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MPIEXEC = shutil.which("mpiexec")
RANKS = 2
LIMIT = 60  # seconds per block; a block that hangs fails instead of stalling the suite
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*?)\s*$")

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python fenced blocks of a Markdown text: (line number of the opening fence, code)."""
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        language = opening["info"].split()[0].lower() if opening["info"] else ""
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and not closing["info"] and closing["fence"].startswith(fence):  # same char, at least as long
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])  # the fence's indentation
            i += 1
        i += 1
        if language == "python":
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


def _collect() -> list[pytest.ParameterSet]:
    params = []
    for document in DOCUMENTS:
        name = document.relative_to(ROOT).as_posix()
        for n, (line, code) in enumerate(python_blocks(document.read_text(encoding="utf-8")), start=1):
            params.append(pytest.param(name, line, code, id=f"{name}:{n}"))
    return params


BLOCKS = _collect()


def run_block(tmp_path: Path, code: str) -> tuple[int | None, str]:
    """Run ``code`` on RANKS ranks; returns (exit status or None if it ran past LIMIT, output)."""
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", str(RANKS), sys.executable, "-m", "tensorplay_p2p.run"]
    # The blocks set what they need themselves; a variable from the caller's shell must not change them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORPLAY_P2P_")}
    status, output, _ = bounded([*command, str(script)], tmp_path, env, LIMIT)
    return status, output


def test_the_documents_have_python_blocks() -> None:
    assert (ROOT / "docs").is_dir()
    assert len(python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))) >= 1  # the usage example
    assert len(python_blocks((ROOT / "docs" / "guide.md").read_text(encoding="utf-8"))) >= 4
    assert len(BLOCKS) > len(DOCUMENTS)


def test_the_extractor_finds_fenced_python_only() -> None:
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "```bash",
            "echo no",
            "```",
            "````markdown",
            "```python",
            "not = a block",
            "```",
            "````",
            "- item:",
            "",
            "  ```python",
            "  if a:",
            "      b = 2",
            "  ```",
        ]
    )
    assert python_blocks(text) == [(1, "a = 1\n"), (14, "if a:\n    b = 2\n")]


@pytest.mark.parametrize(("document", "line", "code"), BLOCKS)
def test_block_runs(tmp_path: Path, document: str, line: int, code: str) -> None:
    status, output = run_block(tmp_path, code)
    where = f"{document}, the ```python block at line {line}"
    assert status is not None, f"{where} ran past {LIMIT} s under mpiexec -n {RANKS}:\n{output}"
    assert status == 0, f"{where} exited with status {status} under mpiexec -n {RANKS}:\n{output}"

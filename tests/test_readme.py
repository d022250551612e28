"""Every ```python block of README.md runs as pasted: alone, in a fresh interpreter, in an empty
directory, on a CPU, without the Hub, and exits with code 0.

Each block is its own test (ids name its README section), so a block that relies on an earlier one
fails here as it would for a reader. Most of a block's 10-25 s is importing torch and transformers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT = 300  # seconds per block; the slowest (the tools example) takes ~25 s on 2 shared cores
ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TAIL = 4000  # characters of a failing block's output shown

# A fenced block (any language, so a `#` line inside one is no heading) or a Markdown heading.
_PARTS = re.compile(r"^```(?P<lang>\S*)\n(?P<code>.*?)^```|^#{1,6} (?P<title>.+?)$", re.MULTILINE | re.DOTALL)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def readme_blocks(text: str) -> list[pytest.param]:
    """One param per ```python block, id = the slug of the nearest heading above it (numbered when
    a section has several)."""
    blocks, section, seen = [], "top", {}
    for part in _PARTS.finditer(text):
        if part["title"] is not None:
            section = _slug(part["title"])
        elif part["lang"] == "python":
            seen[section] = seen.get(section, 0) + 1
            name = section if seen[section] == 1 else f"{section}-{seen[section]}"
            blocks.append(pytest.param(part["code"], id=name))
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, f"expected the README's Python examples, found {len(BLOCKS)} ```python blocks"


@pytest.mark.slow
@pytest.mark.parametrize("code", BLOCKS)
def test_readme_block_runs(code: str, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            check=False,
            cwd=tmp_path,
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        output = (err.stderr or b"")[-TAIL:]
        pytest.fail(f"the block ran past {TIMEOUT} s; stderr tail:\n{output.decode(errors='replace')}")
    assert done.returncode == 0, (
        f"the block exited with code {done.returncode}; stderr tail:\n{done.stderr[-TAIL:]}\n"
        f"stdout tail:\n{done.stdout[-TAIL:]}"
    )

"""Runs ``fla_interpreter_cases.py`` (our Triton kernels, fla's conv kernels, and the fla backend
chosen through the registry) in Triton's CPU interpreter, in a subprocess: TRITON_INTERPRET must
be set before triton is imported, and the rest of the suite must not import triton at all
(transformers would send hybrid layers to fla's GPU-only kernels). The README's test command installs triton into
``.triton/`` (``pip install --target``), outside the venv, for this subprocess only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_SITE = Path(__file__).parents[1] / ".triton"


@pytest.mark.slow
@pytest.mark.skipif(not (TRITON_SITE / "triton").is_dir(), reason="needs triton in .triton/ (README test command)")
def test_triton_interpreter_cases() -> None:
    here = Path(__file__).parent
    path = os.pathsep.join(p for p in (str(TRITON_SITE), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "fla_interpreter_cases.py")],
        check=False,
        cwd=here.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout

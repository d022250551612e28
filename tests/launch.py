"""Multi-process tests: run a test file's worker under ``torchrun`` on CPU (gloo), one thread each."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, world: int, *args: str, timeout: int = 900) -> None:
    """``torchrun --nproc_per_node world script *args`` from the tests folder; fails the test with the
    workers' output when a worker fails."""
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
    run = subprocess.run(
        [*cmd, "--master_port", str(_free_port()), script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parent,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

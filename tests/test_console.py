"""What ``harts-hf train`` and the recipe script print: an opening line, one line per step, a closing
summary; no raw metrics dict (unless ``--verbose``), no third-party noise, one console under several
processes; and a real warning still shows."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from launch import _free_port

from harts_hf.app.console import quiet_third_party

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
RECIPE = ROOT / "recipes" / "configs" / "qwen3_5_quick_agentic"


def test_only_the_named_messages_are_filtered(caplog):
    quiet_third_party()
    hub_kernels = logging.getLogger("transformers.integrations.hub_kernels")
    with caplog.at_level(logging.WARNING, logger=hub_kernels.name):
        hub_kernels.warning("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because ...")
        hub_kernels.warning("a kernel failed to load")
    assert [r.getMessage() for r in caplog.records] == ["a kernel failed to load"]  # CPU: the GPU advice goes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party()  # after simplefilter: the filters go in front again
        warnings.warn("`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
        warnings.warn("something the user must see", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something the user must see"]


def _train(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harts_hf", "train", "--max-steps", "1", "--output-dir", str(tmp_path / "run"), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)


@pytest.mark.slow
def test_train_console_reads_as_a_run(tmp_path):
    run = _train(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    opening, step, summary, saved = lines
    assert opening.startswith("HARTS GRPO (loss dapo): builtin:qwen3_5-quick on the built-in ledger tool environment")
    assert (
        "1 process on cpu, 1 thread each (OMP_NUM_THREADS)" in opening
        and "one plan per step, 65,536 tokens per slot" in opening
    )
    assert step.startswith("step   1/1") and "compression" in step
    assert summary.startswith("done: 1 steps") and "reward" in summary and "compression" in summary
    assert saved == f"model saved to {tmp_path / 'run'}"
    for noise in ("{'loss'", "falling back", "FutureWarning", "rollout_func", "Writing model shards"):
        assert noise not in run.stdout + run.stderr, noise


@pytest.mark.slow
def test_verbose_adds_trls_metrics(tmp_path):
    run = _train(tmp_path, "--verbose")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'harts/compression'" in run.stdout + run.stderr


@pytest.mark.slow
def test_two_processes_print_one_console(tmp_path):
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/cpu_ddp.yaml"),
        "--main_process_port", str(_free_port()),  # not the config's 29500: another launch at once would share it
        str(ROOT / "recipes/grpo_agentic.py"), "--config", str(RECIPE), "--max_steps", "1", "--num_tasks", "4",
        "--per_device_train_batch_size", "12", "--output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert out.count("HARTS GRPO (loss dapo):") == 1 and "2 processes on cpu" in out
    assert sum(line.startswith("step   1/1") for line in out.splitlines()) == 1
    assert out.count("done: 1 steps") == 1
    assert "find_unused_parameters=True" not in out  # the recipe turns DDP's unused-parameter search off

"""``end_distributed``: the gloo group's threads are joined before a script ends, although the DDP
wrapper of a finished trainer (garbage in a reference cycle) still holds the group; left to
interpreter shutdown, they abort the exit ("terminate called without an active exception")."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from launch import _free_port

from harts_hf.trainers.teardown import end_distributed


def _gloo_threads() -> list[str]:
    """The names of this process's gloo threads (its I/O loop and the group's workers)."""
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return [name for name in names if "gloo" in name]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_end_distributed_joins_gloo_threads(monkeypatch):
    before = len(_gloo_threads())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    trainer = {"model": torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))}
    trainer["self"] = trainer  # a reference cycle, as a finished trainer's objects are
    del trainer
    assert len(_gloo_threads()) > before
    end_distributed()
    assert not torch.distributed.is_initialized()
    assert len(_gloo_threads()) == before  # destroy_process_group alone leaves them running
    end_distributed()  # without a group: nothing to do

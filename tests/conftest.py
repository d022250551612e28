"""Shared test settings: hypothesis runs derandomised (fixed examples) and without deadlines;
torch uses one thread (tiny shapes gain nothing from more and stall on shared cores); the heap a
test module starts with is frozen for the module (``_frozen_heap``)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import settings

settings.register_profile("harts", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("harts")
torch.set_num_threads(1)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed generator, fresh for every test."""
    return np.random.default_rng(0)


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """Every ``Trainer.train()`` runs full ``gc.collect()`` passes (accelerate's ``free_memory``) over
    the session's heap, hundreds of thousands of objects (torch, transformers, TRL): about a second
    each on a 2-core machine. Frozen while a module runs, what existed before it is skipped and only
    what its tests allocate is scanned; unfrozen after it, so nothing is kept for good. Its own garbage
    is collected before the unfreeze (a pass over its objects only): left to the next module's
    freeze, a dropped patched model in a reference cycle would stay frozen, keeping its family's
    kernels wrapped in whichever file an xdist worker runs next (test_modeling_patch)."""
    gc.freeze()
    yield
    gc.collect()
    gc.unfreeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a ``slow`` test first, the rest in their order. CI's xdist workers take whole
    files in collection order (``--dist loadfile --no-loadscope-reorder``): the long files start at
    once, and the many short ones left for the end even the two workers out."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)

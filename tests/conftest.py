"""Shared test settings: hypothesis runs derandomised (fixed examples) and without deadlines;
torch uses one thread (tiny shapes gain nothing from more and stall on shared cores)."""

from __future__ import annotations

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

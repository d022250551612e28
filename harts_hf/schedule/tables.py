"""A unit's tree tables, built on the host before the model runs and moved to the device once.

The op modules build their index tables (attention blocks, conv gathers, linear-attention rounds,
ragged layouts, fla waves) through :meth:`TreeBatch.cached`, which keeps each
builder. The builders a model's layers use (``harts_hf.modeling.tables.model_tables`` finds them
once per model) are replayed here on a host copy of every new batch, so the layers only read
ready device tensors: no table is built, and no index pulled back to the host, while the model runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import torch

from ..ops.conv import CONV_HALO_KEY
from ..ops.rounds import REPLAY_KEY, ROUNDS_KEY
from ..ops.tree_batch import TreeBatch

__all__ = ["Builders", "build_tables", "chunk_sizes", "context_subsets"]

Builders = Mapping[Hashable, Callable[[TreeBatch], object]]


def chunk_sizes(builders: Builders) -> list[int]:
    """The chunk sizes of the model's linear-attention layers (the grids their states live on)."""
    return sorted({key[1] for key in builders if isinstance(key, tuple) and key[0] == ROUNDS_KEY})


def context_subsets(builders: Builders) -> list[tuple[str, int]]:
    """The tables naming the context subsets the model's layers read: each conv width's halo, each
    linear-attention chunk grid's replayed tokens (attention reads every context row)."""
    return sorted(key for key in builders if isinstance(key, tuple) and key[0] in (CONV_HALO_KEY, REPLAY_KEY))


def build_tables(batch: TreeBatch, builders: Builders, device: torch.device | str) -> TreeBatch:
    """``batch`` (on the host) with every table of ``builders`` built, moved to ``device``."""
    for key, build in builders.items():
        batch.cached(key, build)
    return batch.to(device)

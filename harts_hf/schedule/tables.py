"""A unit's tree tables, built on the host before the model runs and moved to the device once.

The op modules read their index tables (attention blocks, conv gathers, linear-attention rounds,
ragged layouts, fla waves) through :meth:`TreeBatch.cached`, each named by a typed
:class:`~harts_hf.ops.tree_batch.Table`. The tables a model's layers read (their layer kinds
declare them: ``harts_hf.modeling.tables.model_tables``) are built here on a host copy of every
new batch, so the layers only read ready device tensors: no table is built, and no index pulled
back to the host, while the model runs (a layer reading another table fails).
"""

from __future__ import annotations

import torch

from ..ops.rounds import RoundsTable
from ..ops.tree_batch import Table, TreeBatch

__all__ = ["Tables", "build_tables", "chunk_sizes", "context_subsets"]

Tables = frozenset[Table]


def chunk_sizes(tables: Tables) -> list[int]:
    """The chunk sizes of the model's linear-attention layers (the grids their states live on)."""
    return sorted({table.chunk_size for table in tables if isinstance(table, RoundsTable)})


def context_subsets(tables: Tables) -> list[Table]:
    """The tables naming the context subsets the model's layers read: each conv width's halo, each
    linear-attention chunk grid's replayed tokens (attention reads every context row)."""
    return sorted((table for table in tables if table.context_subset), key=repr)


def build_tables(batch: TreeBatch, tables: Tables, device: torch.device | str) -> TreeBatch:
    """``batch`` (on the host) with every one of ``tables`` built, moved to ``device``; a layer
    reading another fails (``TreeBatch.built_ahead``)."""
    for table in tables:
        batch.cached(table)
    moved = batch.to(device)
    moved.built_ahead = True
    return moved

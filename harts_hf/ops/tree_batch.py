"""TreeBatch: the tree metadata one microbatch of compact tokens needs, derived once.

A microbatch is either a whole forest or a *piece* of one (a subset of its compact tokens that
the planner cut out). A piece's tokens may descend from tokens that ran in an earlier
microbatch: those ancestors are its *context*. Layers read context through explicit inputs
(ancestor K/V, recurrent states plus replay inputs, conv halos) passed next to the piece's own.

Index spaces: "combined" = ``cat([context, piece])`` (context first, both in DFS order);
``num_context`` = len(context). For a whole forest the context is empty and combined == piece.
Per-kind structures (attention blocks, linear-attention rounds, conv gather tables) are derived
lazily by the op modules through :meth:`TreeBatch.cached`, once per batch, not once per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..forest import RolloutForest

__all__ = ["TreeBatch"]


@dataclass(eq=False)
class TreeBatch:
    """Tree metadata of one microbatch (combined index space, see module docstring).

    Args:
        position: [Nc + N] absolute depth of each token (its RoPE position and chunk-grid index).
        prev: [Nc + N] combined index of the previous token on the root path, -1 at a root.
        global_index: [Nc + N] compact index in the forest (DFS pre-order).
        global_end: [Nc + N] exclusive end of the token's subtree, in forest indices: k is an
            ancestor-or-self of q iff ``global_index[k] <= global_index[q] < global_end[k]``.
        num_context: Nc, the leading tokens that ran in earlier microbatches.
        handoff: for a piece run by ``harts_hf.engine``, the object that gives each layer call its
            context inputs and keeps the boundary outputs later pieces read (the modeling kinds
            call it); None for a whole forest.
    """

    position: torch.Tensor
    prev: torch.Tensor
    global_index: torch.Tensor
    global_end: torch.Tensor
    num_context: int = 0
    handoff: Any = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_forest(
        cls,
        forest: RolloutForest,
        tokens: np.ndarray | None = None,
        device: torch.device | str | None = None,
    ) -> TreeBatch:
        """The batch of a whole forest, or of the piece made of the compact indices ``tokens``."""
        n = forest.num_compact_tokens
        if tokens is None:
            combined = np.arange(n)
            num_context = 0
        else:
            tokens = np.unique(np.asarray(tokens, dtype=np.int64))
            if tokens.size == 0 or tokens[0] < 0 or tokens[-1] >= n:
                raise ValueError(f"piece tokens must be non-empty compact indices in [0, {n})")
            in_piece = np.zeros(n, dtype=bool)
            in_piece[tokens] = True
            # A token is context iff it is outside the piece and its subtree holds a piece token.
            count = np.concatenate(([0], np.cumsum(in_piece)))
            holds = count[forest.subtree_end] - count[np.arange(n)] > 0
            context = np.flatnonzero(holds & ~in_piece)
            combined = np.concatenate((context, tokens))
            num_context = int(context.size)
        local = np.full(n, -1, dtype=np.int64)
        local[combined] = np.arange(combined.size)
        parent = forest.prev[combined]
        prev = np.where(parent >= 0, local[np.maximum(parent, 0)], -1)
        as_t = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)
        return cls(
            position=as_t(forest.position[combined]),
            prev=as_t(prev),
            global_index=as_t(combined),
            global_end=as_t(forest.subtree_end[combined]),
            num_context=num_context,
        )

    @property
    def num_tokens(self) -> int:
        """N, the piece's own tokens (context excluded)."""
        return self.position.numel() - self.num_context

    @property
    def device(self) -> torch.device:
        return self.position.device

    def cached(self, key: Hashable, build: Callable[[TreeBatch], Any]) -> Any:
        """``build(self)`` computed once per batch and key (e.g. ``("rounds", chunk_size)``)."""
        if key not in self._cache:
            self._cache[key] = build(self)
        return self._cache[key]

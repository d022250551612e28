"""Trajectory rows: where each column of TRL's per-trajectory layout comes from among the pairs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..forest import RolloutForest

__all__ = ["TrajectoryRows"]


@dataclass(frozen=True)
class TrajectoryRows:
    """Where each column of TRL's ``[B, max_len - 1]`` layout comes from: ``pair`` [B, L - 1] the pair
    (non-root compact token, forest order) whose target is token t + 1, where ``valid``."""

    pair: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, forest: RolloutForest, device: torch.device | str | None = None) -> TrajectoryRows:
        target, valid = forest.logprob_targets
        pair = np.maximum(forest.pair_number(target), 0)  # columns past a row's end read pair 0, masked
        return cls(torch.as_tensor(pair, device=device), torch.as_tensor(valid, device=device))

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """[P] pair values -> [B, max_len - 1], exactly 0 past each row's end."""
        if values.numel() == 0:  # nothing to predict: zeros still on the graph (zero gradients, as stock)
            return values.new_zeros(self.pair.shape) + values.sum()
        return torch.where(self.valid, values[self.pair], 0.0)

    def pair_grads(self, row_grads: torch.Tensor, num_pairs: int, owned: torch.Tensor) -> torch.Tensor:
        """The adjoint of the rows of the ``owned`` [B] trajectories: gradients w.r.t. the
        [B, max_len - 1] rows -> w.r.t. the [P] pair values (a pair feeds every row through it)."""
        if num_pairs == 0:  # nothing to predict: every column is past its row's end
            return row_grads.new_zeros(0)
        kept = torch.where(self.valid & owned[:, None], row_grads, 0.0)  # no boolean indexing: no device sync
        return row_grads.new_zeros(num_pairs).index_add_(0, self.pair.flatten(), kept.flatten())

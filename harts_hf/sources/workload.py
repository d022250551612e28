"""Workload: a batch of rollout trajectories with the per-trajectory data an RL step needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..forest import RolloutForest

__all__ = ["Workload"]


@dataclass(frozen=True, eq=False)
class Workload:
    """Token ids, loss masks, rewards and advantage groups of B trajectories.

    Args:
        name: the generator's registry name (e.g. ``"swe-like"``).
        sequences: B int64 arrays of token ids.
        loss_masks: B bool arrays, one value per token: True for model-generated tokens that
            are trained; prompts, tool observations and context are False.
        rewards: [B] float reward of each trajectory.
        groups: [B] int64 advantage (GRPO) group of each trajectory.
    """

    name: str
    sequences: list[np.ndarray]
    loss_masks: list[np.ndarray]
    rewards: np.ndarray
    groups: np.ndarray

    def __post_init__(self) -> None:
        b = len(self.sequences)
        if not b:
            raise ValueError(f"workload {self.name!r} has no trajectories")
        if len(self.loss_masks) != b or self.rewards.shape != (b,) or self.groups.shape != (b,):
            raise ValueError(
                f"workload {self.name!r}: {b} sequences but {len(self.loss_masks)} loss masks, "
                f"rewards of shape {self.rewards.shape}, groups of shape {self.groups.shape}"
            )
        for i, (seq, mask) in enumerate(zip(self.sequences, self.loss_masks)):
            if seq.dtype != np.int64 or mask.dtype != np.bool_ or seq.shape != mask.shape:
                raise ValueError(
                    f"workload {self.name!r}, trajectory {i}: want int64 ids and a bool mask of "
                    f"the same length, got {seq.dtype}{seq.shape} and {mask.dtype}{mask.shape}"
                )

    @property
    def num_trajectories(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        """Total trajectory tokens (what trajectory-wise training computes)."""
        return sum(s.size for s in self.sequences)

    def forest(self) -> RolloutForest:
        """The prefix forest of the trajectories, loss masks attached (built on every call)."""
        return RolloutForest.from_sequences(self.sequences, self.loss_masks)

"""Summary statistics of a rollout forest: what the sharing saves and how deep the trees are."""

from __future__ import annotations

import numpy as np

from ..forest import RolloutForest

__all__ = ["forest_stats"]


def forest_stats(forest: RolloutForest) -> dict[str, int | float]:
    """Sizes, compression, tree height and trajectory-length (depth) percentiles of ``forest``."""
    p50, p90, p99 = np.percentile(forest.lengths, [50, 90, 99])
    return {
        "trajectories": forest.num_trajectories,
        "trajectory_tokens": forest.num_trajectory_tokens,
        "compact_tokens": forest.num_compact_tokens,
        "compression": forest.compression,
        "height": forest.height,
        "leaves": forest.num_leaves,
        "nodes": forest.num_nodes,
        "depth_p50": float(p50),
        "depth_p90": float(p90),
        "depth_p99": float(p99),
        "depth_max": forest.max_length,
    }

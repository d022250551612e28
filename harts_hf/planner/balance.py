"""Balance of a slot-cost table: the two numbers every plan and baseline reports."""

from __future__ import annotations

import numpy as np

__all__ = ["FORWARD_SHARE", "rank_imbalance", "rank_seconds", "slot_imbalance", "step_seconds"]

FORWARD_SHARE = 1 / 3
"""A microbatch's forward as a share of its forward + backward (the backward costs about twice the
forward): what rerunning a recorded microbatch costs again. A step of several slots records every
slot without grad but the last and reruns each in the backward (``harts_hf.engine``)."""


def slot_imbalance(cost: np.ndarray) -> float:
    """max over slots of (max rank cost in the slot / mean rank cost in the slot), for ``cost``
    [R, S]. Ranks synchronise at every microbatch (FSDP gathers, MoE all-to-alls, lockstep
    backward), so each slot lasts as long as its slowest rank. Empty slots (all zero) are skipped."""
    mean = cost.mean(axis=0)
    busy = mean > 0
    return float((cost.max(axis=0)[busy] / mean[busy]).max()) if busy.any() else 1.0


def rank_imbalance(cost: np.ndarray) -> float:
    """max rank total / mean rank total, for ``cost`` [R, S]."""
    total = cost.sum(axis=1)
    return float(total.max() / total.mean()) if total.mean() > 0 else 1.0


def step_seconds(cost: np.ndarray) -> float:
    """Predicted step time in lockstep: the sum over slots of the slowest rank's cost, every slot
    but the last once more at :data:`FORWARD_SHARE` (its replay)."""
    slowest = cost.max(axis=0)  # [S]
    return float(slowest.sum() + FORWARD_SHARE * slowest[:-1].sum())


def rank_seconds(cost: np.ndarray) -> np.ndarray:
    """[R] predicted forward + backward seconds of each rank on its own (no lockstep waits): its
    slots, every slot but the last once more at :data:`FORWARD_SHARE` (its replay), as
    :func:`step_seconds` counts them. What a rank's measured engine step compares with."""
    return cost.sum(axis=1) + FORWARD_SHARE * cost[:, :-1].sum(axis=1)

"""Balance of a slot-cost table: the two numbers every plan and baseline reports."""

from __future__ import annotations

import numpy as np

__all__ = ["FORWARD_SHARE", "rank_imbalance", "rank_seconds", "slot_imbalance", "step_seconds"]

FORWARD_SHARE = 1 / 3
"""A microbatch's forward as a share of its forward + backward (the backward costs about twice the
forward): what rerunning a recorded microbatch costs again, where the cost model has no measured
share (``CostModel.forward_share``, fitted by ``harts-hf calibrate``). A step of several slots
records every slot once and reruns in the backward each whose graph it did not keep
(``graphs.py``, ``harts_hf.engine``)."""


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


def _replays(cost: np.ndarray, rerun: np.ndarray | None, share: float, host: np.ndarray | None) -> np.ndarray:
    """[R, S] seconds of the reruns: ``share`` of every slot ``rerun`` [R, S] marks (default: all
    but the last, no graph kept but the last one's), plus ``host`` [R, S] (the copies of graphs kept
    in host memory that their passes do not hide; default none)."""
    if rerun is None:
        rerun = np.arange(cost.shape[1]) < cost.shape[1] - 1
    return share * np.where(rerun, cost, 0.0) + (0.0 if host is None else host)


def step_seconds(
    cost: np.ndarray, rerun: np.ndarray | None = None, share: float = FORWARD_SHARE, host: np.ndarray | None = None
) -> float:
    """Predicted step time in lockstep: per slot the slowest rank's cost, and per slot the slowest
    rank's rerun (``share`` of the cost of every slot ``rerun`` [R, S] marks; default all but the
    last) or host copies (``host`` [R, S] seconds) in the backward."""
    return float(cost.max(axis=0).sum() + _replays(cost, rerun, share, host).max(axis=0).sum())


def rank_seconds(
    cost: np.ndarray, rerun: np.ndarray | None = None, share: float = FORWARD_SHARE, host: np.ndarray | None = None
) -> np.ndarray:
    """[R] predicted forward + backward seconds of each rank on its own (no lockstep waits): its
    slots, its reruns and host copies, as :func:`step_seconds` counts them. What a rank's measured
    engine step compares with."""
    return cost.sum(axis=1) + _replays(cost, rerun, share, host).sum(axis=1)

"""The plan's PNG: every rank's slots on a lockstep timeline, pieces coloured by tree."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plan import Plan

__all__ = ["plot_plan"]


def plot_plan(plan: Plan, path: str | Path) -> None:
    """One row per rank; slot s starts when the slowest rank finished slot s - 1 (ranks run in
    lockstep), so idle time shows as gaps. A microbatch's width is its predicted cost, shared among
    its pieces by tokens; colour = the tree (or, when one tree spans ranks, the subtree unit) a
    piece belongs to; dark grey = shared chains, hatched = recomputed replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = np.concatenate(([0.0], np.cumsum(plan.cost.max(axis=0))))[:-1]  # [S] lockstep slot starts
    mb = plan.piece_rank * plan.num_slots + plan.piece_slot
    size = (plan.piece_end - plan.piece_start).astype(np.float64)
    mb_tokens = np.bincount(mb, weights=size, minlength=plan.cost.size)
    width = plan.cost.ravel()[mb] * size / mb_tokens[mb]
    before = np.cumsum(width) - width  # pieces run in (rank, slot, DFS) order
    first = np.searchsorted(mb, mb)  # first piece of each piece's microbatch
    left = start[plan.piece_slot] + before - before[first]
    palette = [plt.get_cmap("tab20")(i) for i in range(20) if i not in (14, 15)]  # greys mark shared chains
    color = [palette[u % len(palette)] if u >= 0 else (0.35, 0.35, 0.35, 1.0) for u in plan.piece_unit.tolist()]

    fig, ax = plt.subplots(figsize=(11, 0.5 * plan.world_size + 1.8), dpi=120)
    ax.barh(plan.piece_rank, width, left=left, height=0.8, color=color, edgecolor="white", linewidth=0.2)
    rep = plan.piece_replica
    ax.barh(plan.piece_rank[rep], width[rep], left=left[rep], height=0.8, fill=False, hatch="///", linewidth=0)
    for x in start[1:]:
        ax.axvline(x, color="black", linewidth=0.3, alpha=0.4)
    ax.set_yticks(range(plan.world_size), [f"rank {r}" for r in range(plan.world_size)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds (slots in lockstep)")
    ax.set_title(
        f"{plan.world_size} ranks x {plan.num_slots} slots, {plan.num_pieces} pieces: slot imbalance "
        f"{plan.slot_imbalance:.4f}, rank imbalance {plan.rank_imbalance:.4f}, redundancy {plan.redundancy:.4f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

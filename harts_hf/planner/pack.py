"""Whole trees into slots: trees that fit one microbatch stay whole where balance allows.

Legend: I intervals, R ranks, S slots.
"""

from __future__ import annotations

import numpy as np

from .assign import RankIntervals
from .geometry import Geometry
from .pieces import Pieces

__all__ = ["pack_whole_trees"]


def pack_whole_trees(
    geo: Geometry, iv: RankIntervals, world_size: int, num_slots: int
) -> tuple[RankIntervals, Pieces, np.ndarray]:
    """Keep whole trees whole where balance allows: every rank's whole trees go, largest first,
    onto its lightest slot if they fit under the slot's share (LPT with capacity, one vectorised
    step per tree rank); a tree that does not fit joins the rest, whose quantile cuts then fill
    every slot to the share (a slack above the share would leave too little to fill with). Slots
    are ordered heaviest first so that ranks line up. Returns the rest of the intervals, the packed
    trees as pieces and their cost per slot [R, S]."""
    cost = geo.prefix(iv.hi) - geo.prefix(iv.lo)
    share = np.bincount(iv.rank, weights=cost, minlength=world_size) / num_slots
    whole = np.flatnonzero(iv.atomic)
    whole = whole[np.lexsort((-cost[whole], iv.rank[whole]))]
    rank = iv.rank[whole]
    first = np.searchsorted(rank, np.arange(world_size))
    step = np.arange(whole.size) - first[rank]  # position among the rank's trees, largest first
    bins = np.zeros((world_size, num_slots))
    slot = np.full(whole.size, -1)
    for k in range(int(step.max(initial=-1)) + 1):
        sel = np.flatnonzero(step == k)
        b = np.argmin(bins[rank[sel]], axis=1)
        fit = bins[rank[sel], b] + cost[whole[sel]] <= share[rank[sel]] * (1 + 1e-9)
        slot[sel[fit]] = b[fit]
        bins[rank[sel[fit]], b[fit]] += cost[whole[sel[fit]]]
    packed, rank, slot = whole[slot >= 0], rank[slot >= 0], slot[slot >= 0]
    order = np.argsort(-bins, axis=1, kind="stable")  # [R, S] bins, heaviest first
    new_slot = np.empty_like(order)
    np.put_along_axis(new_slot, order, np.arange(num_slots)[None].repeat(world_size, 0), axis=1)
    trees = Pieces(
        rank, new_slot[rank, slot], iv.lo[packed], iv.hi[packed], iv.branch[packed], iv.replica[packed], num_slots
    )
    keep = np.ones(iv.rank.size, dtype=bool)
    keep[packed] = False
    fields = (iv.rank, iv.lo, iv.hi, iv.branch, iv.replica)
    rest = RankIntervals(*(f[keep] for f in fields), np.zeros(int(keep.sum()), dtype=bool))  # the rest is cut
    return rest, trees, np.take_along_axis(bins, order, axis=1)

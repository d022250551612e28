"""How many slots, and which pieces in each: the same S on every rank, every microbatch in budget.

Legend: R ranks, S slots.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .assign import RankIntervals
from .cost import CostModel
from .geometry import Geometry
from .memory import Budget
from .node_parts import node_parts_of
from .pack import pack_whole_trees
from .pieces import Pieces, merge
from .split import budget_cuts, capped_cuts, equal_cost_cuts

__all__ = ["footprint", "slot_pieces"]


def _packed(
    geo: Geometry, iv: RankIntervals, world_size: int, slots: int, chunk: int, overhead: np.ndarray | None
) -> Pieces:
    """Whole trees packed into the slots, the rest cut at the quantiles that fill every slot to its
    rank's share (trees and ``overhead`` [R, S] counted in)."""
    rest, trees, tree_cost = pack_whole_trees(geo, iv, world_size, slots)
    extra = tree_cost if overhead is None else tree_cost + overhead
    return merge(equal_cost_cuts(geo, rest, world_size, slots, chunk, extra), trees)


def slot_pieces(
    geo: Geometry, iv: RankIntervals, world_size: int, budget: Budget, chunk: int, cost: CostModel
) -> Pieces:
    """The fewest equal-cost slots whose microbatches all fit the budget (from the greedy count,
    the fewest that can fit, up to twice that), the cuts then tuned once with each microbatch's
    rounds and launch overhead; when quantile cuts never fit, budget-capped cuts in the greedy
    count of slots, or the greedy cuts themselves (they always fit)."""
    greedy = budget_cuts(geo, iv, world_size, budget)
    fewest = greedy.num_slots

    def fits(pieces: Pieces) -> bool:
        return bool((footprint(geo, pieces, world_size, budget) <= budget.tokens).all())

    for slots in range(fewest, 2 * fewest + 1):
        pieces = _packed(geo, iv, world_size, slots, chunk, None)
        if fits(pieces):
            num_mb = world_size * slots
            parts = node_parts_of(geo, pieces.microbatch, pieces.lo, pieces.hi, num_mb)
            busy = np.bincount(pieces.microbatch, minlength=num_mb) > 0
            overhead = (cost.round * parts.rounds + cost.microbatch * busy).reshape(world_size, slots)
            tuned = _packed(geo, iv, world_size, slots, chunk, overhead)
            return _without_idle_slots(tuned if fits(tuned) else pieces)
    capped = capped_cuts(geo, iv, world_size, fewest, chunk, budget)
    return _without_idle_slots(capped if fits(capped) else greedy)


def _without_idle_slots(pieces: Pieces) -> Pieces:
    """``pieces`` without the slots no rank uses (quantile cuts that snap to the same boundary leave
    one): an idle slot would be a step of nothing on every rank."""
    used = np.unique(pieces.slot)
    if used.size == pieces.num_slots:
        return pieces
    return dataclasses.replace(pieces, slot=np.searchsorted(used, pieces.slot), num_slots=int(used.size))


def footprint(geo: Geometry, pieces: Pieces, world_size: int, budget: Budget) -> np.ndarray:
    """[R * S] own-token equivalents of every microbatch (0 when empty): its tokens plus the
    weighted depth of its first token (a microbatch's first piece carries its context)."""
    mb = pieces.microbatch
    tokens = np.bincount(mb, weights=pieces.hi - pieces.lo, minlength=world_size * pieces.num_slots)
    context = np.zeros_like(tokens)
    first_mb, first = np.unique(mb, return_index=True)
    context[first_mb] = geo.token_depth(pieces.lo[first])
    return budget.footprint(tokens, context)

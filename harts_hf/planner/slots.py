"""How many slots, and which pieces in each: the same S on every rank, every microbatch in budget.

Legend: R ranks, S slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .assign import RankIntervals
from .balance import step_seconds
from .cost import CostModel
from .geometry import Geometry
from .graphs import graph_slots, unkept
from .memory import Budget, MemoryModel
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


LAST_SLOT_FILLS = (0.95, 0.85, 0.7)
"""Fractions of its room in the budget the last slot is asked to fill, largest first (:func:`_fill_last_slot`)."""


def slot_pieces(
    geo: Geometry,
    iv: RankIntervals,
    world_size: int,
    budget: Budget,
    chunk: int,
    cost: CostModel,
    memory: MemoryModel,
    graphs: str = "budget",
) -> Pieces:
    """The cut with the lowest predicted step (``balance.step_seconds``, charging a rerun to the
    slots whose graphs the byte budget does not keep under ``memory`` and ``graphs``: ``graphs.py``;
    so a cut whose last slots keep more graphs wins where that lowers the step) among the ones that
    fit the budget: for every slot count from the greedy one (the fewest that can fit) up to the first whose
    equal-cost cuts fit (at most twice the greedy count), the equal-cost cuts, those cuts tuned once
    with each microbatch's rounds and launch overhead, and the cuts whose last slot is filled towards
    the budget (:func:`_fill_last_slot`: a count whose equal cuts overflow, the context of a later
    slot pushing it over, often fits with a full first slot and a last slot that carries the
    context); then the greedy cuts themselves (they always fit) and, where no equal cut fits,
    budget-capped cuts in the greedy count of slots. Then more slots, equal and tuned, one more at a
    time while more, smaller slots could keep more graphs than any cut so far (:func:`_more_graphs`)
    and rerun fewer slots: the graphs the byte budget holds alive together may hold more own tokens
    than one full microbatch (its transient phases count once; under gradient checkpointing they
    outweigh the saved activations), and a slot that keeps its graph is not rerun."""
    greedy = budget_cuts(geo, iv, world_size, budget)
    fewest = greedy.num_slots

    def fits(pieces: Pieces) -> bool:
        return bool((footprint(geo, pieces, world_size, budget) <= budget.tokens).all())

    def equal_cuts(slots: int) -> tuple[Pieces, Pieces, np.ndarray]:
        """The equal-cost cuts in ``slots`` slots, those tuned with overhead, and the overhead [R, S]."""
        pieces = _packed(geo, iv, world_size, slots, chunk, None)
        _, _, parts = slot_costs(geo, pieces, world_size, cost)
        busy = np.bincount(pieces.microbatch, minlength=world_size * slots) > 0
        overhead = (cost.round * parts.rounds + cost.microbatch * busy).reshape(world_size, slots)
        return pieces, _packed(geo, iv, world_size, slots, chunk, overhead), overhead

    found = []
    for slots in range(fewest, 2 * fewest + 1):
        pieces, tuned, overhead = equal_cuts(slots)
        equal = [c for c in (pieces, tuned) if fits(c)]
        found += equal + _fill_last_slot(geo, iv, world_size, budget, chunk, pieces, overhead, fits)
        if equal:
            break
    else:
        capped = capped_cuts(geo, iv, world_size, fewest, chunk, budget)
        found += [capped] if fits(capped) else []
    found.append(greedy)
    scored = [_predicted(geo, c, world_size, cost, budget, memory, graphs) for c in found]
    own = np.bincount(iv.rank, weights=iv.hi - iv.lo, minlength=world_size).max()  # the busiest rank's tokens
    more = max(c.num_slots for c in found) + 1
    while more <= 2 * fewest and _more_graphs(memory, budget, graphs, own, more, max(k for _, k in scored)):
        cuts = [c for c in equal_cuts(more)[:2] if fits(c)]
        if not cuts:
            break
        found += cuts
        scored += [_predicted(geo, c, world_size, cost, budget, memory, graphs) for c in cuts]
        more += 1
    best = int(np.argmin([step for step, _ in scored]))  # ties: the earliest
    return _without_idle_slots(found[best])


def _fill_last_slot(
    geo: Geometry,
    iv: RankIntervals,
    world_size: int,
    budget: Budget,
    chunk: int,
    pieces: Pieces,
    overhead: np.ndarray,
    fits: Callable[[Pieces], bool],
) -> list[Pieces]:
    """``pieces``' slots with every rank's last one holding a :data:`LAST_SLOT_FILLS` share of the
    budget's room beside its context (the largest share that fits), the other slots sharing the rest
    equally; none with one slot. A step of several slots records every microbatch but its last
    without grad and reruns it in the backward (``harts_hf.engine``): the tokens the last slot takes
    are the tokens not run twice. Two targets: each rank's own room, and the smallest room of any
    rank on every rank (the last slot then costs the same on every rank: lockstep waits for the
    slowest). The last slot may end up smaller than an equal share: where the context of the last
    slot's start pushes equal cuts over the budget."""
    slots = pieces.num_slots
    if slots == 1:
        return []
    interval_cost = geo.prefix(iv.hi) - geo.prefix(iv.lo)  # [I]
    total = np.bincount(iv.rank, weights=interval_cost, minlength=world_size)  # [R]
    tokens = np.bincount(iv.rank, weights=iv.hi - iv.lo, minlength=world_size)
    per_token = np.divide(total, tokens, out=np.zeros_like(total), where=tokens > 0)
    # the room the budget leaves the last slot beside the context its current start reads
    last_mb = np.arange(world_size) * slots + slots - 1
    own = np.bincount(pieces.microbatch, weights=pieces.hi - pieces.lo, minlength=world_size * slots)[last_mb]
    room = budget.tokens - (footprint(geo, pieces, world_size, budget)[last_mb] - own)
    out = []
    for even in (False, True):
        for fill in LAST_SLOT_FILLS:
            want = fill * room * per_token  # [R] the last slot's cost
            last = np.minimum(want.min(initial=np.inf, where=tokens > 0) if even else want, total)
            # equal quantiles of (cost + overhead) with `lift` added to every slot but the last leave
            # the last slot `last` and split the rest equally (a negative lift: a smaller last slot)
            lift = (slots * last - total) / (slots - 1)
            extra = overhead + np.where(np.arange(slots) < slots - 1, lift[:, None], 0.0)
            filled = _packed(geo, iv, world_size, slots, chunk, extra)
            if fits(filled):
                out.append(filled)
                break
    return out


def slot_costs(geo: Geometry, pieces: Pieces, world_size: int, cost: CostModel):
    """(cost [R * S] seconds of every microbatch, its compact tokens [R * S], its node parts): the
    cost model over each microbatch's tokens, attended pairs, rounds and launch."""
    num_mb = world_size * pieces.num_slots
    mb = pieces.microbatch
    parts = node_parts_of(geo, mb, pieces.lo, pieces.hi, num_mb)
    tokens = np.bincount(mb, weights=pieces.hi - pieces.lo, minlength=num_mb).astype(np.int64)
    token_cost = np.bincount(mb, weights=geo.prefix(pieces.hi) - geo.prefix(pieces.lo), minlength=num_mb)
    return token_cost + cost.round * parts.rounds + cost.microbatch * (tokens > 0), tokens, parts


def _predicted(
    geo: Geometry, pieces: Pieces, world_size: int, cost: CostModel, budget: Budget, memory: MemoryModel, graphs: str
) -> tuple[float, int]:
    """The predicted step of ``pieces`` (``balance.step_seconds``: lockstep slots and the reruns of
    those whose graphs are not kept, with each microbatch's context taken as its first token's depth,
    as :func:`footprint` does), and the fewest graphs a rank keeps."""
    table, tokens, _ = slot_costs(geo, pieces, world_size, cost)
    shape = (world_size, pieces.num_slots)
    tokens, context = tokens.reshape(shape), _first_depth(geo, pieces, world_size).reshape(shape)
    kept = graph_slots(memory, budget, tokens, context, graphs)
    seconds = table.reshape(shape)
    rerun, _, copies = unkept(memory, cost, budget, tokens, context, seconds, kept, graphs)
    return step_seconds(seconds, rerun, cost.forward_share, copies), int(kept.min())


def _more_graphs(memory: MemoryModel, budget: Budget, graphs: str, own: float, slots: int, kept: int) -> bool:
    """Whether ``own`` tokens cut into ``slots`` equal slots could keep more than ``kept`` graphs (and
    rerun any fewer slots) under ``graphs``: ``kept + 1`` such slots, their context left out, held alive
    together within the byte budget (``graphs.py``)."""
    if kept >= slots - 1 or graphs == "last":
        return False
    n = own / slots
    return bool(memory.token * n * kept + memory(n) <= memory(budget.tokens))


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
    tokens = np.bincount(pieces.microbatch, weights=pieces.hi - pieces.lo, minlength=world_size * pieces.num_slots)
    return budget.footprint(tokens, _first_depth(geo, pieces, world_size))


def _first_depth(geo: Geometry, pieces: Pieces, world_size: int) -> np.ndarray:
    """[R * S] the depth of every microbatch's first token (0 when empty): the context it reads, as
    the slot cuts count it (a microbatch's first piece carries its context)."""
    context = np.zeros(world_size * pieces.num_slots)
    first_mb, first = np.unique(pieces.microbatch, return_index=True)
    context[first_mb] = geo.token_depth(pieces.lo[first])
    return context

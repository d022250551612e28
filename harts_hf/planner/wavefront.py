"""The DFS order cut into one span per (slot, rank): every token once, each slot a context-parallel group.

Why: a tree far deeper than the budget (a chain of branches, an agent's long trunk with side
leaves) leaves the rank-wise plan two choices, both slow: recompute the chain above every rank's
leaves (the deep chain 8x the budget on 8 ranks: redundancy 2.2) or run its pieces in sequence on
one rank while the others wait. Cut in DFS order, every token runs once and every rank gets an
equal share. A span's ancestors outside it are the root path of its first token (an ancestor of a
later token that lies before the span is one of those), read across ranks: from earlier slots as
handoffs, from lower ranks of its own slot streamed layer call by layer call
(``harts_hf.engine.stream``: a group's wavefront).

Layout: at most ``R * S`` spans: the DFS order cut at equal cost, then again wherever a span holds
more than its room (the budget less its context, the root path of its first token: a trajectory's
shallow tokens are cheap, so equal cost alone would overfill the first spans), cuts moved down to
the chunk grid where their node reaches it (no replay there); span j runs on rank j % R in slot
j // R, so a slot is one stretch of the DFS order over the ranks in rank order and every read inside
a slot goes from a lower rank to a higher one (no cycle). S runs up from the fewest slots the budget
allows while the predicted step drops.

Pricing (``crossreads.py``): a span reading spans of its own slot waits for them layer by layer;
every cross-rank read moves values there and gradients back. ``plan`` keeps the cut only where it
predicts a lower step and every microbatch fits.

Legend: R ranks, S slots, k spans.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from . import crossreads
from .geometry import Geometry
from .memory import Budget
from .pieces import Pieces
from .planned import Plan

__all__ = ["wavefront_cut"]

SLOT_TRIES = 8  # slot counts tried at most, from the fewest the budget allows
PATIENCE = 2  # tries in a row that predict no lower step end the search


def _fitting(geo: Geometry, budget: Budget, starts: np.ndarray, chunk: int) -> np.ndarray:
    """``starts`` with every span longer than its room cut again, until each fits the budget: a DFS
    range's context is the root path of its first token (every ancestor of a later token that lies
    before the range is one of its), so span [lo, hi) fits when hi - lo <= room(depth(lo))."""
    while True:
        ends = np.r_[starts[1:], geo.num_tokens]
        room = np.maximum(budget.room(geo.token_depth(starts)), 1)
        over = ends - starts > room
        if not over.any():
            return starts
        cut = geo.on_grid((starts + room)[over], chunk)
        starts = np.unique(np.r_[starts, np.where(cut > starts[over], cut, (starts + room)[over])])


def _span_starts(geo: Geometry, budget: Budget, count: int, chunk: int) -> np.ndarray:
    """Sorted first tokens of spans that fit ``budget``: the DFS order cut into as many spans of
    equal cost as leave, after :func:`_fitting`, at most ``count`` (more only where the budget alone
    needs more); cuts on the chunk grid where the node allows."""
    equal = lambda k: _fitting(geo, budget, np.unique(np.r_[0, geo.on_grid(_equal_cost(geo, k), chunk)]), chunk)
    k = count
    fitted = equal(k)
    while fitted.size > count and k > 1:  # fewer equal-cost spans by the ones the budget added
        k -= max(1, min(fitted.size - count, k // 2))
        fitted = equal(k)
    return fitted


def _equal_cost(geo: Geometry, count: int) -> np.ndarray:
    """[count - 1] first tokens of spans 1.. of ``count`` spans of equal cost."""
    t = np.floor(geo.token_at(geo.total_cost * np.arange(1, count) / count)).astype(np.int64)
    return np.clip(t, 1, geo.num_tokens - 1)


def _pieces(geo: Geometry, starts: np.ndarray, world_size: int) -> Pieces:
    """Span j (``starts[j]`` to the next start) on rank j % R in slot j // R, split at tree roots."""
    bounds = np.unique(np.r_[starts, geo.start[geo.parent < 0], geo.num_tokens])
    span = np.searchsorted(starts, bounds[:-1], side="right") - 1
    rank, slot = span % world_size, span // world_size
    order = np.lexsort((bounds[:-1], slot, rank))
    return Pieces(
        rank[order],
        slot[order],
        bounds[:-1][order],
        bounds[1:][order],
        span[order],
        np.zeros(span.size, dtype=bool),
        -(-starts.size // world_size),
    )


def wavefront_cut(
    geo: Geometry, budget: Budget, world_size: int, chunk: int, build: Callable[[Pieces], Plan], layers: int
) -> Plan | None:
    """The forests' DFS order cut into spans over ``world_size`` ranks, slot-major (module
    docstring), in the fewest slots the budget allows or more, whichever predicts the lowest step
    (smaller spans even out the ones the budget cuts short; at most :data:`SLOT_TRIES`, ending after
    :data:`PATIENCE` tries without a lower step); None if none fits or its reads cannot stream."""
    fewest = math.ceil(_fitting(geo, budget, np.zeros(1, dtype=np.int64), chunk).size / world_size)
    best, worse = None, 0
    for slots in range(fewest, fewest + SLOT_TRIES):
        starts = _span_starts(geo, budget, world_size * slots, chunk)
        pieces = _pieces(geo, starts, world_size)
        made = build(pieces)
        priced = crossreads.priced(made, geo, pieces, layers) if made.fits_budget else None
        if priced is not None and (best is None or priced.step_seconds < best.step_seconds):
            best, worse = priced, 0
        elif (worse := worse + 1) == PATIENCE:
            break
    return best

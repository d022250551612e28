"""A shared root split over ranks: the system prompt every rank reads, computed once as a CP group.

Without exchange every rank that holds trajectories of a tree recomputes the chain at its root (a
system prompt, tool definitions) before its own work: the plan's largest redundancy on agent
batches. A handoff (``handoffs.py``) cannot remove it, since every reader would wait for the one
rank computing it. Here the root chain is cut into ``w`` spans of equal cost at chunk-aligned
depths, one per rank, run at once in a new first slot as a context-parallel group (a wavefront over
the decoder layers: ``groups.py``, streamed by ``harts_hf.engine.stream``); every later piece keeps
its rank and slot, one slot later, less the root's tokens, which it now reads across ranks (K/V
rows from every span and the root's last state, cross-rank handoffs). So the balance of the plan
is kept and each rank sheds the same work.

Pricing: the group as in :func:`groups.with_groups`, plus per (span rank, reader rank) pair one
message of the span's rows, and one state from the last span's rank to each reader, values there and
gradients back (:meth:`CostModel.transfer`), charged to the last slot as handoffs are. ``plan``
keeps the plan only when its predicted step is lower and every microbatch fits.

Legend: R ranks, S slots, P pieces, w ranks in the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .geometry import Geometry
from .groups import joined_pieces, path_spans, plan_pieces, with_groups
from .handoffs import Transfers
from .pieces import Pieces
from .planned import Plan

__all__ = ["root_grouped"]


def _widest_root(geo: Geometry, base: Pieces) -> int | None:
    """The root node whose chain the most work recomputes (copies beyond the first times its cost);
    None if no root chain is held by two ranks."""
    roots = np.flatnonzero(geo.parent < 0)
    node = geo.node_of(base.lo)
    at_root = np.isin(node, roots) & (base.lo == geo.start[node])
    holders = np.unique(base.rank[at_root] * geo.num_nodes + node[at_root]) % geo.num_nodes
    copies = np.bincount(holders, minlength=geo.num_nodes)[roots]
    waste = (copies - 1) * geo.node_cost[roots]
    best = int(np.argmax(waste))
    return int(roots[best]) if copies[best] > 1 else None


def _root_pieces(p: Plan, geo: Geometry, base: Pieces, root: int) -> tuple[Pieces, list[int], np.ndarray] | None:
    """The plan's pieces (``base``) with ``root``'s chain cut over ranks in a new slot 0 and cut off
    every later piece, the group's ranks (span order) and its span bounds; None if the chain is too
    short."""
    lo, hi = int(geo.start[root]), int(geo.start[root] + geo.length[root])
    width = min(p.world_size, (hi - lo) // p.chunk_size)
    bounds = path_spans(geo, p.budget, lo, hi, width, p.chunk_size) if width > 1 else None
    if bounds is None:
        return None
    later = dataclasses.replace(  # the root's tokens leave every piece, one slot later
        base, lo=np.where((base.lo >= lo) & (base.lo < hi), hi, base.lo), slot=base.slot + 1
    )
    keep = later.lo < later.hi
    ranks = list(range(width))
    spans = np.c_[ranks, np.zeros(width), bounds[:-1], bounds[1:], np.full(width, -1)].astype(np.int64)
    rank, slot = np.r_[later.rank[keep], spans[:, 0]], np.r_[later.slot[keep], spans[:, 1]]
    order = np.lexsort((np.arange(rank.size), slot, rank))  # a microbatch keeps its piece order
    return joined_pieces(later, keep, spans, rank, slot, order, p.num_slots + 1), ranks, bounds


def _root_transfers(p: Plan, geo: Geometry, root: int, ranks: list[int], bounds: np.ndarray) -> Plan:
    """``p`` with the reads of the root's spans by later slots priced and counted as handoffs: each
    rank holding tokens under the root reads every other rank's span rows and the last span's state."""
    forest = int(geo.forest_of(np.array([geo.start[root]]))[0])
    local = np.array([geo.start[root], geo.end[root]]) - geo.forest_tokens[forest]  # the root's tree
    under = (p.piece_forest == forest) & (p.piece_slot > 0) & (p.piece_start >= local[0]) & (p.piece_start < local[1])
    readers = np.unique(p.piece_rank[under])
    span_rows = np.zeros(p.world_size)
    span_rows[ranks] = np.diff(bounds)
    rows = np.zeros((p.world_size, p.world_size))  # [producer, reader]
    rows[:, readers] = span_rows[:, None]
    np.fill_diagonal(rows, 0.0)
    states = np.zeros_like(rows)
    states[ranks[-1], readers] = 1.0
    states[ranks[-1], ranks[-1]] = 0.0
    return Transfers.of_pairs(rows, states, p.cost_model).onto(p)


def root_grouped(p: Plan, geo: Geometry, build: Callable[[Pieces], Plan], layers: int) -> Plan | None:
    """The plan with its most recomputed root chain run once as a CP group in a new first slot, if it
    predicts a lower step than ``p`` and every microbatch fits; else None."""
    if p.groups or p.handoffs:  # one exchange per plan: the others' pieces assume their own slots
        return None
    base = plan_pieces(p, geo)
    root = _widest_root(geo, base)
    made = None if root is None else _root_pieces(p, geo, base, root)
    if made is None:
        return None
    pieces, ranks, bounds = made
    out = with_groups(build(pieces), [(0, ranks)], layers)
    if out is None:
        return None
    out = _root_transfers(out, geo, root, ranks, bounds)
    return out if out.step_seconds < p.step_seconds else None

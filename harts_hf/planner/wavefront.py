"""The DFS order cut into one span per (slot, rank): every token once, each slot a context-parallel group.

Why: a tree far deeper than the budget (a chain of branches, an agent's long trunk with side
leaves) leaves the rank-wise plan two choices, both slow: recompute the chain above every rank's
leaves (the deep chain 8x the budget on 8 ranks: redundancy 2.2) or run its pieces in sequence on
one rank while the others wait. Cut in DFS order, every token runs once and every rank gets an
equal share. A span's ancestors outside it are the root path of its entries (its first token and
every node part whose parent lies before the span), read across ranks: from earlier slots as
handoffs, from lower ranks of its own slot streamed layer call by layer call
(``harts_hf.engine.stream``: a group's wavefront).

Layout: ``R * S`` spans of equal cost (S the fewest slots whose spans fit the budget with their
context), each cut moved to the nearest chunk-aligned depth its node holds (no replay there); span
j runs on rank j % R in slot j // R, so a slot is one stretch of the DFS order over the ranks in
rank order and every read inside a slot goes from a lower rank to a higher one (no cycle).

Pricing: a span reading spans of its own slot waits for them layer by layer (:func:`_wavefront`);
every cross-rank read, values there and gradients back, one message per (producer rank, reader
rank) pair (:class:`~.handoffs.Transfers`): inside a slot counted with the groups, between slots
with the handoffs. ``plan`` keeps the cut only where it predicts a lower step and every
microbatch fits.

Legend: R ranks, S slots, k spans, P pieces, E entries, A their ancestor intervals split at span
starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from .geometry import Geometry
from .handoffs import Transfers
from .memory import Budget
from .node_parts import node_parts_of
from .pieces import Pieces
from .planned import Plan

__all__ = ["wavefront_cut"]

SLOT_TRIES = 8  # slot counts tried, from the fewest the tokens need, each about a quarter more


def _span_starts(geo: Geometry, count: int, chunk: int) -> np.ndarray:
    """[k <= count] sorted first tokens of ``count`` spans of equal cost (0 first), each cut moved to
    the nearest chunk-aligned depth inside its node where the node reaches it."""
    t = np.floor(geo.token_at(geo.total_cost * np.arange(1, count) / count)).astype(np.int64)
    t = np.clip(t, 0, geo.num_tokens - 1)
    node, depth = geo.node_of(t), geo.token_depth(t)
    aligned = t + np.round(depth / chunk).astype(np.int64) * chunk - depth
    inside = (aligned >= geo.start[node]) & (aligned < geo.start[node] + geo.length[node])
    return np.unique(np.r_[0, np.where(inside, aligned, t)])


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


def _wavefront(cost: np.ndarray, edges: np.ndarray, layers: int) -> np.ndarray:
    """[k] seconds each span takes in its slot, waits included, for spans of ``cost`` [k] and
    same-slot reads ``edges`` [2, e] (producer, reader; producer < reader). Layer l of a reader
    needs layer l of its producers: it starts a layer after the latest of them started and ends no
    earlier than one of its layers after the last of them ends (L layers of equal time each)."""
    start, finish = np.zeros_like(cost), cost.copy()
    for reader in np.unique(edges[1]):
        prod = edges[0, edges[1] == reader]
        start[reader] = (start[prod] + cost[prod] / layers).max()
        finish[reader] = max(start[reader] + cost[reader], finish[prod].max() + cost[reader] / layers)
    return finish


Reads = tuple[np.ndarray, ...]


def _reads(geo: Geometry, pieces: Pieces, starts: np.ndarray, world_size: int, chunk: int) -> tuple[Reads, Reads]:
    """Every cross-rank read of the spans: (producer span, reader span, rows, forest) [A] of context
    rows, distinct per (reader rank, producer span, node), and (producer span, reader span, forest)
    [E'] of the path-start states, one per (reader rank, state): an entry at depth d reads the state
    after its ancestor at depth a - 1, a = floor(d / C) * C, the chunk grid (``ops.rounds``)."""
    num_slots = pieces.num_slots
    parts = node_parts_of(geo, pieces.microbatch, pieces.lo, pieces.hi, world_size * num_slots)
    ext = parts.external
    entry = parts.lo[ext]
    reader = pieces.branch[parts.piece[ext]]  # [E] the entry's span
    span_of = lambda t: np.searchsorted(starts, t, side="right") - 1
    which, lo, hi = geo.path_intervals(entry)
    grid = geo.token_depth(entry)[which] // chunk * chunk - 1  # [A] depth of the state's token, -1: none
    below = geo.token_depth(lo)
    on = (below <= grid) & (grid < below + hi - lo)
    state = lo[on] + grid[on] - below[on]  # [E'] the token after which each entry's state is read
    first, last = span_of(lo), span_of(hi - 1)
    count = last - first + 1
    at = np.repeat(np.arange(lo.size), count)
    producer = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    ends = np.r_[starts[1:], geo.num_tokens]
    a_lo, a_hi = np.maximum(lo[at], starts[producer]), np.minimum(hi[at], ends[producer])
    read_by = reader[which[at]]
    far = producer % world_size != read_by % world_size
    key = ((read_by % world_size) * starts.size + producer) * geo.num_nodes + geo.node_of(a_lo)
    _, first_of, inverse = np.unique(key[far], return_index=True, return_inverse=True)
    top = np.full(first_of.size, -1, dtype=np.int64)
    np.maximum.at(top, inverse.ravel(), a_hi[far])
    kept = lambda a: a[far][first_of]
    rows = (kept(producer), kept(read_by), top - kept(a_lo), geo.forest_of(kept(a_lo)))
    state_from, state_by = span_of(state), reader[which[on]]
    state_far = state_from % world_size != state_by % world_size
    _, one = np.unique(((state_by % world_size) * geo.num_tokens + state)[state_far], return_index=True)
    pick = lambda a: a[state_far][one]
    return rows, (pick(state_from), pick(state_by), geo.forest_of(pick(state)))


def _pair_table(producer: np.ndarray, reader: np.ndarray, weight: np.ndarray, world_size: int) -> np.ndarray:
    """[R, R] (producer rank, reader rank) sums of ``weight`` over reads between spans."""
    pair = (producer % world_size) * world_size + reader % world_size
    return np.bincount(pair, weights=weight, minlength=world_size * world_size).reshape(world_size, world_size)


def _calls_align(p: Plan, pieces: Pieces, producer: np.ndarray, reader: np.ndarray, forest: np.ndarray) -> bool:
    """Whether each read inside a slot, of ``forest``'s rows, joins units at the same call position
    on both ranks (a rank runs a slot's forests in order, one call each): the engine streams only
    between those (``harts_hf.schedule.check_groups``)."""
    nf = int(p.piece_forest.max()) + 1
    held = np.unique(pieces.microbatch * nf + p.piece_forest)  # (microbatch, forest) calls, in call order
    mb = held // nf
    position = np.arange(held.size) - np.searchsorted(mb, mb)
    R, S = p.world_size, p.num_slots
    call = lambda span: position[np.searchsorted(held, ((span % R) * S + span // R) * nf + forest)]
    return bool((call(producer) == call(reader)).all())


def _priced(p: Plan, geo: Geometry, pieces: Pieces, starts: np.ndarray, layers: int) -> Plan | None:
    """``p`` (built from the cut) with its wavefronts and cross-rank reads priced; None if a read
    inside a slot would join units at different call positions."""
    R, S = p.world_size, p.num_slots
    (producer, reader, rows, forest), (s_producer, s_reader, s_forest) = _reads(geo, pieces, starts, R, p.chunk_size)
    inside = producer // R == reader // R
    s_inside = s_producer // R == s_reader // R
    edges = np.c_[np.r_[producer[inside], s_producer[s_inside]], np.r_[reader[inside], s_reader[s_inside]]]
    if not _calls_align(p, pieces, *edges.T, np.r_[forest[inside], s_forest[s_inside]]):
        return None
    edges = np.unique(edges[:, 0] * starts.size + edges[:, 1])
    edges = np.stack([edges // starts.size, edges % starts.size])
    span = np.arange(starts.size)
    cost = p.cost.copy()
    cost[span % R, span // R] = _wavefront(p.cost[span % R, span // R], edges, layers)
    table = lambda m, sm: (
        _pair_table(producer[m], reader[m], rows[m], R),
        _pair_table(s_producer[sm], s_reader[sm], np.ones(int(sm.sum())), R),
    )
    group = Transfers.of_pairs(*table(inside, s_inside), p.cost_model)
    cost[:, -1] += group.seconds
    members = np.bincount(np.unique(edges) // R, minlength=S)  # [S] ranks joined by reads inside each slot
    out = dataclasses.replace(
        p,
        cost=cost,
        groups=int((members > 0).sum()),
        group_ranks=int(members.max()),
        group_bytes=group.bytes,
        group_layers=layers if members.any() else 0,
    )
    return Transfers.of_pairs(*table(~inside, ~s_inside), p.cost_model).onto(out)


def wavefront_cut(
    geo: Geometry, budget: Budget, world_size: int, chunk: int, build: Callable[[Pieces], Plan], layers: int
) -> Plan | None:
    """The forests' DFS order cut into equal-cost spans over ``world_size`` ranks, slot-major (module
    docstring), in the fewest slots of :data:`SLOT_TRIES` whose microbatches fit ``budget``, priced;
    None if none fits or its reads cannot stream."""
    slots = max(1, math.ceil(geo.num_tokens / (world_size * budget.tokens)))
    for _ in range(SLOT_TRIES):
        starts = _span_starts(geo, world_size * slots, chunk)
        pieces = _pieces(geo, starts, world_size)
        made = build(pieces)
        if made.fits_budget:
            return _priced(made, geo, pieces, starts, layers)
        slots += max(1, slots // 4)
    return None

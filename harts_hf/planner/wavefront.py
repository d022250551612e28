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

Pricing: a span reading spans of its own slot waits for them layer by layer (:func:`_wavefront`);
every cross-rank read, values there and gradients back (:class:`~.handoffs.Transfers`): inside a
slot counted with the groups, streamed in :data:`~.groups.STREAM_MESSAGES` messages a layer per (producer
rank, reader rank) pair, between slots with the handoffs, one message a pair. ``plan`` keeps the cut only where it predicts a lower step and every
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
from .groups import STREAM_MESSAGES
from .handoffs import Transfers, pair_table
from .memory import Budget
from .node_parts import node_parts_of
from .pieces import Pieces
from .planned import Plan

__all__ = ["wavefront_cut"]

SLOT_TRIES = 8  # slot counts tried at most, from the fewest the budget allows
PATIENCE = 2  # tries in a row that predict no lower step end the search


def _aligned(geo: Geometry, t: np.ndarray, chunk: int) -> np.ndarray:
    """Cuts ``t`` moved down to the chunk grid (depth a multiple of ``chunk``) where their node
    reaches it (no replay there), else left as they are."""
    node, depth = geo.node_of(t), geo.token_depth(t)
    down = t - depth % chunk
    return np.where((down >= geo.start[node]) & (down > 0), down, t)


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
        cut = _aligned(geo, (starts + room)[over], chunk)
        starts = np.unique(np.r_[starts, np.where(cut > starts[over], cut, (starts + room)[over])])


def _span_starts(geo: Geometry, budget: Budget, count: int, chunk: int) -> np.ndarray:
    """Sorted first tokens of spans that fit ``budget``: the DFS order cut into as many spans of
    equal cost as leave, after :func:`_fitting`, at most ``count`` (more only where the budget alone
    needs more); cuts on the chunk grid where the node allows."""
    equal = lambda k: _fitting(geo, budget, np.unique(np.r_[0, _aligned(geo, _equal_cost(geo, k), chunk)]), chunk)
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


def _wavefront(cost: np.ndarray, edges: np.ndarray, layers: int) -> np.ndarray:
    """[k] seconds each span takes in its slot, waits included, for spans of ``cost`` [k] and
    same-slot reads ``edges`` [2, e] (producer, reader; producer < reader). Layer l of a reader
    needs layer l of its producers: it starts a layer after the latest of them started and ends no
    earlier than one of its layers after the last of them ends (L layers of equal time each)."""
    start, finish = np.zeros_like(cost), cost.copy()
    order = np.argsort(edges[1], kind="stable")
    producers, readers = edges[0, order], edges[1, order]
    bounds = np.r_[np.unique(readers, return_index=True)[1], readers.size]  # each reader's edges
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # readers in span order: producers done
        reader, prod = readers[a], producers[a:b]
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
    table = lambda m, sm: (  # span j runs on rank j % R
        pair_table(producer[m] % R, reader[m] % R, rows[m], R),
        pair_table(s_producer[sm] % R, s_reader[sm] % R, np.ones(int(sm.sum())), R),
    )
    group = Transfers.of_pairs(*table(inside, s_inside), p.cost_model, STREAM_MESSAGES * layers)
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
        priced = _priced(made, geo, pieces, starts, layers) if made.fits_budget else None
        if priced is not None and (best is None or priced.step_seconds < best.step_seconds):
            best, worse = priced, 0
        elif (worse := worse + 1) == PATIENCE:
            break
    return best

"""Pricing a plan whose every token runs once: its cross-rank reads, and the waits of reads inside a slot.

A plan without replicas (the DFS cut, ``wavefront.py``; the relay, ``relay.py``) reads every
ancestor it does not hold from the one piece that computes it: from an earlier slot as a handoff
(``harts_hf.engine.exchange``), from another rank of its own slot streamed layer call by layer call
(``harts_hf.engine.stream``: a context-parallel group's wavefront). Here both are priced:

- a microbatch reading microbatches of its own slot waits for them layer by layer
  (:func:`_wavefront`); the engine streams only from a lower rank to a higher one at the same call
  position (``harts_hf.schedule.check_groups``), so a plan with any other read inside a slot is
  refused (None);
- every cross-rank read, values there and gradients back (:class:`~.handoffs.Transfers`): inside a
  slot counted with the groups, streamed in :data:`~.groups.STREAM_MESSAGES` messages a layer per
  (producer rank, reader rank) pair; between slots with the handoffs, one message a pair. Context
  rows count once per (reader rank, producer piece, node), states once per (reader rank, state) on
  the chunk grid (``ops.rounds``: an entry at depth d reads the state after its ancestor at depth
  a - 1, a = floor(d / C) * C).

Legend: R ranks, S slots, P pieces, E entries, A their ancestor intervals split at piece starts;
microbatches indexed slot-major (``slot * R + rank``), the order a slot's wavefront runs in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .geometry import Geometry
from .groups import STREAM_MESSAGES
from .handoffs import Transfers, pair_table
from .node_parts import node_parts_of
from .pieces import Pieces
from .planned import Plan

__all__ = ["priced"]

Reads = tuple[np.ndarray, ...]


def _reads(geo: Geometry, pieces: Pieces, world_size: int, chunk: int) -> tuple[Reads, Reads]:
    """Every cross-rank read of ``pieces`` (each token in one piece): (producer microbatch, reader
    microbatch, rows, forest) [A'] of context rows, distinct per (reader rank, producer piece, node),
    and (producer microbatch, reader microbatch, forest) [E'] of the path-start states, one per
    (reader rank, state). Microbatches as ``Pieces.microbatch`` (rank-major)."""
    num_slots = pieces.num_slots
    order = np.argsort(pieces.lo, kind="stable")
    starts, owner = pieces.lo[order], pieces.microbatch[order]  # [P] the pieces in DFS order
    rank_of = lambda mb: mb // num_slots
    parts = node_parts_of(geo, pieces.microbatch, pieces.lo, pieces.hi, world_size * num_slots)
    ext = parts.external
    entry, reader = parts.lo[ext], parts.mb[ext]  # [E]
    piece_of = lambda t: np.searchsorted(starts, t, side="right") - 1
    which, lo, hi = geo.path_intervals(entry)
    grid = geo.token_depth(entry)[which] // chunk * chunk - 1  # [A] depth of the state's token, -1: none
    below = geo.token_depth(lo)
    on = (below <= grid) & (grid < below + hi - lo)
    state = lo[on] + grid[on] - below[on]  # [E'] the token after which each entry's state is read
    first, last = piece_of(lo), piece_of(hi - 1)
    count = last - first + 1
    at = np.repeat(np.arange(lo.size), count)
    producer = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    ends = np.r_[starts[1:], geo.num_tokens]
    a_lo, a_hi = np.maximum(lo[at], starts[producer]), np.minimum(hi[at], ends[producer])
    read_by = reader[which[at]]
    far = rank_of(owner[producer]) != rank_of(read_by)
    key = (rank_of(read_by) * starts.size + producer) * geo.num_nodes + geo.node_of(a_lo)
    _, first_of, inverse = np.unique(key[far], return_index=True, return_inverse=True)
    top = np.full(first_of.size, -1, dtype=np.int64)
    np.maximum.at(top, inverse.ravel(), a_hi[far])
    kept = lambda a: a[far][first_of]
    rows = (owner[kept(producer)], kept(read_by), top - kept(a_lo), geo.forest_of(kept(a_lo)))
    state_from, state_by = owner[piece_of(state)], reader[which[on]]
    state_far = rank_of(state_from) != rank_of(state_by)
    _, one = np.unique((rank_of(state_by) * geo.num_tokens + state)[state_far], return_index=True)
    pick = lambda a: a[state_far][one]
    return rows, (pick(state_from), pick(state_by), geo.forest_of(pick(state)))


def _wavefront(cost: np.ndarray, edges: np.ndarray, layers: int) -> np.ndarray:
    """[k] seconds each microbatch takes in its slot, waits included, for microbatches of ``cost`` [k]
    and same-slot reads ``edges`` [2, e] (producer, reader; producer < reader). Layer l of a reader
    needs layer l of its producers: it starts a layer after the latest of them started and ends no
    earlier than one of its layers after the last of them ends (L layers of equal time each)."""
    start, finish = np.zeros_like(cost), cost.copy()
    order = np.argsort(edges[1], kind="stable")
    producers, readers = edges[0, order], edges[1, order]
    bounds = np.r_[np.unique(readers, return_index=True)[1], readers.size]  # each reader's edges
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # readers in order: producers done
        reader, prod = readers[a], producers[a:b]
        start[reader] = (start[prod] + cost[prod] / layers).max()
        finish[reader] = max(start[reader] + cost[reader], finish[prod].max() + cost[reader] / layers)
    return finish


def _calls_align(p: Plan, pieces: Pieces, producer: np.ndarray, reader: np.ndarray, forest: np.ndarray) -> bool:
    """Whether each read inside a slot, of ``forest``'s rows, joins units at the same call position
    on both ranks (a rank runs a slot's forests in order, one call each): the engine streams only
    between those (``harts_hf.schedule.check_groups``)."""
    nf = int(p.piece_forest.max()) + 1
    held = np.unique(pieces.microbatch * nf + p.piece_forest)  # (microbatch, forest) calls, in call order
    mb = held // nf
    position = np.arange(held.size) - np.searchsorted(mb, mb)
    call = lambda m: position[np.searchsorted(held, m * nf + forest)]
    return bool((call(producer) == call(reader)).all())


def priced(p: Plan, geo: Geometry, pieces: Pieces, layers: int) -> Plan | None:
    """``p`` (built from ``pieces``, every token in one of them) with its wavefronts and cross-rank
    reads priced (module docstring); None if a read inside a slot goes to a lower rank or joins
    units at different call positions (the engine would wait on itself)."""
    R, S = p.world_size, p.num_slots
    (producer, reader, rows, forest), (s_producer, s_reader, s_forest) = _reads(geo, pieces, R, p.chunk_size)
    inside = producer % S == reader % S
    s_inside = s_producer % S == s_reader % S
    edges = np.c_[np.r_[producer[inside], s_producer[s_inside]], np.r_[reader[inside], s_reader[s_inside]]]
    if (edges[:, 0] > edges[:, 1]).any() or not _calls_align(
        p, pieces, *edges.T, np.r_[forest[inside], s_forest[s_inside]]
    ):
        return None
    slot_major = lambda mb: (mb % S) * R + mb // S
    edges = np.unique(slot_major(edges[:, 0]) * (R * S) + slot_major(edges[:, 1]))
    edges = np.stack([edges // (R * S), edges % (R * S)])
    cost = _wavefront(p.cost.T.ravel(), edges, layers).reshape(S, R).T.copy()
    rank_of = lambda mb: mb // S
    table = lambda m, sm: (
        pair_table(rank_of(producer[m]), rank_of(reader[m]), rows[m], R),
        pair_table(rank_of(s_producer[sm]), rank_of(s_reader[sm]), np.ones(int(sm.sum())), R),
    )
    group = Transfers.of_pairs(*table(inside, s_inside), p.cost_model, STREAM_MESSAGES * layers)
    cost[:, -1] += group.seconds
    members = np.bincount(np.unique(edges) // R, minlength=S)  # [S] microbatches joined by reads inside each slot
    out = dataclasses.replace(
        p,
        cost=cost,
        groups=int((members > 0).sum()),
        group_ranks=int(members.max()),
        group_bytes=group.bytes,
        group_layers=layers if members.any() else 0,
    )
    return Transfers.of_pairs(*table(~inside, ~s_inside), p.cost_model).onto(out)

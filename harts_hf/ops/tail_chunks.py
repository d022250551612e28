"""Ragged rounds: the torch driver's layout, where no chunk computes a replayed ancestor or much padding.

A round of :func:`rounds_of` packs every chunk right-padded to C slots, and a child path branching at
depth d off the chunk grid replays its parent's tokens at depths [a, d), a = floor(d / C) * C. Here:

- *Exact starts.* A child path whose parent token is a piece token starts at d itself, from its
  parent's state after depth d - 1. The parent's round computes that mid-chunk state from the chunk
  holding depth d - 1 (:class:`StateRequests`, the kernel's ``state_at``). The child's first chunk
  covers [d, a + C) only; its later chunks stay on the trajectory's chunk grid. External paths (parent
  token in the context) keep starting at a and replaying context tokens: their state comes from the
  caller at a chunk boundary.
- *Ragged chunks.* A chunk runs at its true length rounded up to a multiple of :data:`BUCKET`
  (capped at C): chunks of equal length form a *stream*, stream 0 holds the full chunks. Only a path's
  first and last chunks can be short.

A chunk of fewer tokens is the same computation as the trajectory's grid chunk split at d (or cut at the
path's end): the same values up to fp32 rounding, no replay and < BUCKET padding slots per short chunk.

The inter-chunk scan (``linear_attention.scan_ragged``) walks the round's chunk steps; at step m the
continuing paths (ranks < n_{m+1}) and the paths ending at m are visited in groups, one per stream.
States keep :class:`~harts_hf.ops.rounds.Round`'s layout: ``h_start`` in step-major rank order (row 0
of a child starting at d is its state at d), ``h_final`` in rank order, then the round's requested
mid-chunk states; ``Rounds.state_index`` applies unchanged. The driver materialises only the rows of
these a later use reads (:class:`~harts_hf.ops.scan_plan.ScanPlan`, derived once per batch and
``batch.state_out``).

Legend: Tc chunks of a round, C chunk size, L a stream's chunk length, P paths of the round, R requested
mid-chunk states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .rounds import Round, Rounds, rounds_of
from .tree_batch import TreeBatch

__all__ = [
    "BUCKET",
    "RaggedRound",
    "ScanStep",
    "StateRequests",
    "ragged_rounds_of",
]

BUCKET = 8  # chunk lengths round up to a multiple of this (KDA / GLA sub-chunks are 8 rows)


class ScanStep(NamedTuple):
    """The visits of one chunk step, in *visiting order*: the step's states are kept in the order its
    visits take them, so every visit is a contiguous block (a view, no gather).

    Args:
        visits: (stream, paths) per visit; the first ``following`` visits hold the paths that go on to
            the next step (ranks [0, n_{m+1}), grouped by stream), the others the paths ending at this
            step (their end states go to ``h_final``).
        following: how many visits continue.
        order: [n_{m+1}] row of ``cat(end states of the continuing visits)`` at each of the next step's
            visiting positions (None: the same order).
    """

    visits: list[tuple[int, int]]
    following: int
    order: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class StateRequests:
    """Mid-chunk states of one stream's chunks a later round's child paths start from.

    Args:
        stream: the stream holding the chunks.
        chunk: [R] chunk of the stream (index into its per-chunk tensors).
        row: [R] the state after this row of the chunk is asked for.
        start: [R] row of the round's ``h_start`` holding the chunk's start state.
        tokens: [R, L] combined index of the chunks' tokens (-1: padding).
    """

    stream: int
    chunk: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True, eq=False)
class RaggedRound:
    """One round's chunks as streams of equal-length chunks, and the scan's visiting order.

    Args:
        lengths: [S] chunk length of each stream (stream 0: C).
        chunks: [S] chunks of each stream (T_s).
        gather: [sum_s T_s * L_s] combined index of the token in each slot, stream after stream
            (-1 = padding): one gather per round, whose backward is one scatter, not one per stream.
        sections: S x [rows of the stream used by each visit, in visiting order].
        steps: one :class:`ScanStep` per chunk step.
        visit_rank: per step, [n_m] rank of the path at each visiting position (numpy).
        final_order: [P] row of ``cat(end states in visiting order)`` holding rank p's final state.
        own_slot: [n] slot (index into ``gather``; the scan's outputs use the same layout) of each own
            token of the round, in ``Round.own_slot`` order.
        h0_index: [P] row of each path's initial state: round 0, of ``cat([zeros(1), initial_states])``;
            later rounds, of the previous round's ``cat([h_start, h_final, requested states])``.
        requests: the mid-chunk states the next round's paths start from, stream by stream (their
            concatenation follows ``h_final``).
    """

    lengths: list[int]
    chunks: list[int]
    gather: torch.Tensor
    sections: list[list[int]]
    steps: list[ScanStep]
    visit_rank: list[np.ndarray]
    final_order: torch.Tensor
    own_slot: torch.Tensor
    h0_index: torch.Tensor
    requests: list[StateRequests]


@dataclass
class _Streams:
    """A round's streams before the next round's requests are known (numpy)."""

    rows: np.ndarray  # [Tc, C] combined index per slot of each step-major chunk, shifted to slot 0
    lengths: list[int]
    members: list[np.ndarray]  # per stream, its chunks (step-major indices) in visiting order
    where: np.ndarray  # [Tc] (stream, position in stream) of each chunk, as stream * Tc + position
    sections: list[list[int]]
    steps: list[ScanStep]
    visit_rank: list[np.ndarray]
    final_order: np.ndarray
    own_slot: np.ndarray
    skip: np.ndarray  # [P] by rank: replayed slots dropped from the path's first chunk


def _streams(rnd: Round, skip: np.ndarray, C: int, bucket: int) -> _Streams:
    """Streams and visiting order of one round whose paths drop their first ``skip`` slots (by rank)."""
    device = rnd.gather.device
    rows = rnd.gather.cpu().numpy().reshape(-1, C).copy()  # [Tc, C]
    n0 = rnd.step_counts[0]
    cols = np.arange(C)[None, :] + skip[:, None]  # [P, C]: first chunks shifted left by skip
    rows[:n0] = np.where(cols < C, np.take_along_axis(rows[:n0], np.minimum(cols, C - 1), 1), -1)
    valid = rows >= 0
    length = np.where(valid.any(1), C - np.argmax(valid[:, ::-1], axis=1), 1)  # last valid slot + 1
    chunk_len = np.minimum(-(-length // bucket) * bucket, C)  # [Tc]
    lengths = sorted(set(chunk_len.tolist()) | {C}, reverse=True)
    stream = np.searchsorted(-np.asarray(lengths), -chunk_len)  # [Tc] stream of each chunk (lengths descend)
    counts = np.asarray(rnd.step_counts, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)

    # Visiting order: per step, the paths going on (ranks < n_{m+1}) before the ending ones, each part
    # grouped by stream, ranks ascending in a group; a visit is one (step, part, stream) group.
    tc, num_streams = rows.shape[0], len(lengths)
    step = np.repeat(np.arange(counts.size), counts)  # [Tc]
    rank = np.arange(tc) - offsets[step]
    ends = rank >= np.append(counts[1:], 0)[step]
    order = np.lexsort((rank, stream, ends, step))  # [Tc] chunks in visiting order (step-major)
    group = (step * 2 + ends)[order] * num_streams + stream[order]
    first = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # each visit's first position
    size = np.diff(np.r_[first, tc])
    visit_step, visit_ends, visit_stream = step[order][first], ends[order][first], stream[order][first]
    members = [order[stream[order] == s] for s in range(num_streams)]
    sections = [size[visit_stream == s].tolist() for s in range(num_streams)]
    visit_rank = np.split(rank[order], offsets[1:-1]) if counts.size else []
    position = np.empty(tc, dtype=np.int64)
    position[order] = np.arange(tc) - offsets[step[order]]  # each chunk's place in its step's visits
    bounds = np.searchsorted(visit_step, np.arange(counts.size + 1)).tolist()
    pairs, going = list(zip(visit_stream.tolist(), size.tolist())), (~visit_ends).tolist()
    steps = []
    for m in range(counts.size):
        # The next step's visiting order as rows of this step's continuing end states.
        o = position[offsets[m] + visit_rank[m + 1]] if m + 1 < counts.size else None
        keep = o is None or np.array_equal(o, np.arange(o.size))
        steps.append(
            ScanStep(pairs[bounds[m] : bounds[m + 1]], sum(going[bounds[m] : bounds[m + 1]]), None if keep else as_t(o))
        )
    final_ranks = rank[order][ends[order]]

    chunks = members
    where = np.empty(rows.shape[0], dtype=np.int64)
    for s, c in enumerate(chunks):
        where[c] = s * rows.shape[0] + np.arange(c.size)
    slot = rnd.own_slot.cpu().numpy()
    chunk, col = slot // C, slot % C
    col = col - np.where(chunk < n0, skip[np.minimum(chunk, n0 - 1)], 0)
    sizes = np.asarray([c.size * L for c, L in zip(chunks, lengths)])
    stream_off = np.concatenate(([0], np.cumsum(sizes)))
    s_own, pos_own = np.divmod(where[chunk], rows.shape[0])
    own = stream_off[s_own] + pos_own * np.asarray(lengths)[s_own] + col
    return _Streams(
        rows=rows,
        lengths=lengths,
        members=chunks,
        where=where,
        sections=sections,
        steps=steps,
        visit_rank=visit_rank,
        final_order=np.argsort(final_ranks, kind="stable"),
        own_slot=own,
        skip=skip,
    )


def _paths_by_rank(rounds: Rounds, r: int) -> np.ndarray:
    paths = np.flatnonzero(rounds.path_round == r)
    return paths[np.argsort(rounds.path_rank[paths])]


def _requests(rounds: Rounds, r: int, lay: _Streams, prev: _Streams) -> tuple[np.ndarray, list[tuple[np.ndarray, ...]]]:
    """Round r's h0 rows and the mid-chunk states round r - 1 computes for it: one per branch point
    (siblings share it), grouped by stream as (stream, position in stream, row, h_start row)."""
    C = rounds.chunk_size
    h0 = rounds.rounds[r].h0_index.cpu().numpy().copy()
    mid = lay.skip > 0  # [P] by rank: paths starting at a mid-chunk state
    if not mid.any():
        return h0, []
    child = _paths_by_rank(rounds, r)[mid]
    parent = rounds.path_parent[child]
    rank = rounds.path_rank[parent]
    step = (rounds.path_start[child] - rounds.path_start[parent]) // C  # the parent's chunk holding d - 1
    counts = rounds.rounds[r - 1].step_counts
    chunk = np.concatenate(([0], np.cumsum(counts)))[step] + rank  # step-major chunk of round r - 1
    row = lay.skip[mid] - 1 - np.where(step == 0, prev.skip[rank], 0)  # rows of the parent's own first chunk
    tc = prev.rows.shape[0]
    unique, inverse = np.unique(prev.where[chunk] * C + row, return_inverse=True)  # by stream, position, row
    h0[mid] = tc + counts[0] + inverse  # after the round's h_start [Tc] and h_final [P]
    at, row = np.divmod(unique, C)
    stream, pos = np.divmod(at, tc)
    return h0, [
        (s, pos[stream == s], row[stream == s], prev.members[s][pos[stream == s]]) for s in np.unique(stream).tolist()
    ]


def build_ragged_rounds(batch: TreeBatch, chunk_size: int, bucket: int = BUCKET) -> list[RaggedRound]:
    """The ragged layout of every round of ``rounds_of(batch, chunk_size)`` (module docstring)."""
    C = chunk_size
    rounds = rounds_of(batch, C)
    device = batch.device
    internal = np.where(rounds.path_parent >= 0, rounds.path_replay, 0)  # [P] replay an exact start drops
    layouts = [_streams(rnd, internal[_paths_by_rank(rounds, r)], C, bucket) for r, rnd in enumerate(rounds.rounds)]
    h0s, asked = [rounds.rounds[0].h0_index.cpu().numpy()], []
    for r in range(1, len(layouts)):
        h0, req = _requests(rounds, r, layouts[r], layouts[r - 1])
        h0s.append(h0)
        asked.append(req)
    asked.append([])  # the last round has no children

    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
    out = []
    for lay, h0, req in zip(layouts, h0s, asked):
        streams = [lay.rows[c, :L] for c, L in zip(lay.members, lay.lengths)]  # [T_s, L_s]
        out.append(
            RaggedRound(
                lengths=lay.lengths,
                chunks=[int(c.size) for c in lay.members],
                gather=as_t(np.concatenate([x.reshape(-1) for x in streams])),
                sections=lay.sections,
                steps=lay.steps,
                visit_rank=lay.visit_rank,
                final_order=as_t(lay.final_order),
                own_slot=as_t(lay.own_slot),
                h0_index=as_t(h0),
                requests=[
                    StateRequests(s, as_t(pos), as_t(row), as_t(start), as_t(streams[s][pos]))
                    for s, pos, row, start in req
                ],
            )
        )
    return out


def ragged_rounds_of(batch: TreeBatch, chunk_size: int, bucket: int = BUCKET) -> list[RaggedRound]:
    """The :class:`RaggedRound` of every round of ``rounds_of(batch, chunk_size)``, derived once per batch."""
    return batch.cached(("ragged_rounds", chunk_size, bucket), lambda b: build_ragged_rounds(b, chunk_size, bucket))

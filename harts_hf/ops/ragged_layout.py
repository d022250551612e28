"""The torch driver's linear-attention layout, built directly from the paths of :func:`rounds_of`.

Every path runs on the chunk grid of trajectory-wise training, and:

- *Exact starts.* A child path whose parent token is a piece token starts at its first own depth
  d, from its parent's state after depth d - 1. The parent's round computes that mid-chunk state
  from the chunk holding d - 1 (:class:`MidStates`, the kernel's ``state_at``). The child's first
  chunk covers [d, a + C) only; its later chunks stay on the grid. External paths (parent token in
  the context) start at a and replay context tokens: the caller's state sits at a boundary.
- *Ragged chunks.* A chunk runs at its true length rounded up to a multiple of :data:`BUCKET`
  (capped at C); only a path's first and last chunks can be short. The same values as the grid
  chunk split at d (or cut at the path's end) up to fp32 rounding, with < BUCKET padding slots.
- *One gather, intra per length.* The intra-chunk half of a kernel does not depend on states, so
  it runs once per chunk length for the whole run: slots are ordered by length, then round, then
  visiting order, and one gather per input fills them.
- *Visiting order.* A round's scan walks its chunk steps (ranks [0, n_m) run at step m). At every
  step the paths going on to the next step are visited before those ending there, each part in
  groups of one chunk length: a *visit* is a contiguous block of the step's states (a view).
- *Kept states.* Only the states a later use reads are materialised: the chunk-start states the
  next round's paths or the round's mid-chunk states start from, or ``batch.state_out`` asks for,
  and the paths' end states only where one is read. A round's *kept states* are ``cat([kept
  chunk-start states (visiting order), h_final (by rank, if computed), mid-chunk states])``; the
  next round's ``h0`` and the picks are rows of it.

Legend: X chunks of the run, C chunk size, L a chunk length, P paths of a round, R mid-chunk states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .rounds import Rounds, rounds_of
from .tree_batch import Table, TreeBatch

__all__ = [
    "BUCKET",
    "MidStates",
    "RaggedLayout",
    "RaggedLayoutTable",
    "ScanRound",
    "ScanStep",
    "build_ragged_layout",
    "ragged_layout_of",
]

BUCKET = 8  # chunk lengths round up to a multiple of this (KDA / GLA sub-chunks are 8 rows)


class ScanStep(NamedTuple):
    """One chunk step of a round's scan, its states in visiting order.

    Args:
        visits: (length index, paths) per visit; the first ``following`` visits hold the paths that
            go on to the next step (their end states become its states), the others those ending here.
        following: how many visits continue.
        order: [n_{m+1}] row of ``cat(end states of the continuing visits)`` at each of the next
            step's visiting positions (None: the same order).
        keep: the visiting positions whose start states are kept (None: none; a slice: all).
    """

    visits: list[tuple[int, int]]
    following: int
    order: torch.Tensor | None
    keep: torch.Tensor | slice | None


@dataclass(frozen=True, eq=False)
class MidStates:
    """States after a row of chunks of one length, which the next round's child paths start from
    (one per branch point: siblings share it).

    Args:
        length: index of the chunks' length in :attr:`RaggedLayout.lengths`.
        local: [R] the chunks among the round's chunks of that length (rows of its ``step`` values).
        chunk: [R] the chunks among the run's chunks of that length (rows of its inputs).
        row: [R] the state after this row of the chunk is asked for.
        start: [R] row of the round's kept chunk-start states holding the chunk's start state.
    """

    length: int
    local: torch.Tensor
    chunk: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor


@dataclass(frozen=True, eq=False)
class ScanRound:
    """One round's scan.

    Args:
        steps: one :class:`ScanStep` per chunk step.
        h0: [n_0] row of the previous round's kept states (round 0: of ``cat([zeros(1),
            initial_states])``) at each visiting position of step 0.
        finals: whether the paths' end states are computed (a later use reads one).
        final_order: [P] row of ``cat(end states in visiting order)`` holding rank p's.
        mids: the mid-chunk states the next round starts from, by length.
        picks: rows of the kept states returned for ``batch.state_out`` (None: none).
    """

    steps: list[ScanStep]
    h0: torch.Tensor
    finals: bool
    final_order: torch.Tensor
    mids: list[MidStates]
    picks: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class RaggedLayout:
    """Every round's scan and the index maps of the whole run (module docstring).

    Args:
        rounds: one :class:`ScanRound` per round.
        lengths: the run's chunk lengths, descending.
        chunks: per length, the run's chunks of that length.
        sections: per length, the chunks of each of its visits, round after round: ONE split of each
            intra output per length serves every round, and its backward is one concatenation.
        gather: [slots] input row (:meth:`Rounds.input_rows`; padding: the zero row) of every slot.
        output: [N] slot of each piece token's output.
        pick_order: [S] row of ``cat(picks of every round)`` holding each ``batch.state_out`` state.
    """

    rounds: list[ScanRound]
    lengths: list[int]
    chunks: list[int]
    sections: list[list[int]]
    gather: torch.Tensor
    output: torch.Tensor
    pick_order: torch.Tensor | None


def _block_starts(*keys: np.ndarray) -> np.ndarray:
    """Indices where any of the (sorted-order) ``keys`` changes: the first entry of every block."""
    change = np.zeros(keys[0].size, dtype=bool)
    change[:1] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change)


class _Chunks(NamedTuple):
    """Every chunk of the run (path-major, numpy [X]) and where the layout puts it."""

    path: np.ndarray
    step: np.ndarray
    lo: np.ndarray  # the first path offset it computes
    length_class: np.ndarray  # index of its length
    order: np.ndarray  # [X] the chunks in visiting order (round, step, ending, length, rank)
    position: np.ndarray  # its place among its step's visiting positions
    local: np.ndarray  # its place among its round's chunks of its length (visiting order)
    chunk: np.ndarray  # its place among the run's chunks of its length
    slot: np.ndarray  # its first slot


def _chunks(rounds: Rounds, skip: np.ndarray, bucket: int) -> tuple[_Chunks, np.ndarray, np.ndarray]:
    """The run's chunks (skipping ``skip`` [P] replayed offsets at each path's head), the lengths and
    the chunks of each."""
    C, counts = rounds.chunk_size, rounds.path_chunks
    first = np.cumsum(counts) - counts
    path = np.repeat(np.arange(counts.size), counts)
    step = np.arange(path.size) - first[path]
    lo = np.maximum(step * C, skip[path])
    size = np.minimum(step * C + C, rounds.path_length[path]) - lo
    length = np.minimum(-(-size // bucket) * bucket, C)
    lengths = np.unique(length)[::-1]
    length_class = np.searchsorted(-lengths, -length)
    rnd, ends = rounds.path_round[path], step == counts[path] - 1
    order = np.lexsort((rounds.path_rank[path], length_class, ends, step, rnd))
    starts = _block_starts(rnd[order], step[order])
    position = np.empty_like(order)
    position[order] = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
    by_length = order[np.argsort(length_class[order], kind="stable")]  # per length: round, then visiting order
    per_length = np.bincount(length_class, minlength=lengths.size)
    chunk = np.empty_like(order)
    chunk[by_length] = np.arange(order.size) - np.repeat(np.cumsum(per_length) - per_length, per_length)
    blocks = _block_starts(length_class[by_length], rnd[by_length])
    local = np.empty_like(order)
    local[by_length] = np.arange(order.size) - np.repeat(blocks, np.diff(np.r_[blocks, order.size]))
    offsets = np.cumsum(lengths * per_length) - lengths * per_length
    slot = offsets[length_class] + lengths[length_class] * chunk
    return _Chunks(path, step, lo, length_class, order, position, local, chunk, slot), lengths, per_length


class _Reads(NamedTuple):
    """Where the states later uses read sit: rows of a round's kept states (module docstring)."""

    keep: np.ndarray  # [X] whether each chunk's start state is kept
    kept_row: np.ndarray  # [X] its row
    finals: np.ndarray  # [rounds] whether the round computes its paths' end states
    mids: np.ndarray  # [4, R] every mid-chunk state as (round, length, local, row), sorted
    mid_chunk: np.ndarray  # [R] its chunk
    mid_bounds: list[int]  # [rounds + 1] each round's first mid-chunk state
    source: np.ndarray  # [P] row holding each path's initial state
    out_round: np.ndarray  # [S] round of each state_out state
    out_row: np.ndarray  # [S] its row


def _reads(rounds: Rounds, ch: _Chunks, skip: np.ndarray, state_out: np.ndarray | None) -> _Reads:
    """The states every child path starts from and ``state_out`` asks for, as rows of kept states."""
    C, parent, start, counts = rounds.chunk_size, rounds.path_parent, rounds.path_start, rounds.path_chunks
    first = np.cumsum(counts) - counts
    rnd = rounds.path_round[ch.path]
    child = np.flatnonzero(parent >= 0)
    q = parent[child]
    at = first[q] + (start[child] - start[q]) // C  # the parent's chunk holding depth a of the child
    mid = skip[child] > 0  # starts after depth d - 1 of that chunk
    mid_chunk = at[mid]
    mid_row = start[child][mid] + skip[child][mid] - 1 - start[q][mid] - ch.lo[mid_chunk]
    on_grid = ~mid & (at < first[q] + counts[q])  # at a chunk-start state; else at the parent's end
    at_end = ~mid & ~on_grid
    out_path, out_m = (np.zeros(0, dtype=np.int64),) * 2 if state_out is None else rounds.boundary_of(state_out)
    out_start = out_m < counts[out_path]
    out_chunk = np.minimum(first[out_path] + out_m, ch.path.size - 1)  # unused where out_start is False
    keep = np.zeros(ch.path.size, dtype=bool)
    keep[np.r_[mid_chunk, at[on_grid], out_chunk[out_start]]] = True
    final = np.zeros(counts.size, dtype=bool)
    final[np.r_[q[at_end], out_path[~out_start]]] = True

    num_rounds = rounds.num_rounds
    kept = ch.order[keep[ch.order]]  # visiting order
    num_kept = np.bincount(rnd[kept], minlength=num_rounds)
    kept_row = np.zeros(ch.path.size, dtype=np.int64)
    kept_row[kept] = np.arange(kept.size) - np.repeat(np.cumsum(num_kept) - num_kept, num_kept)
    finals = np.bincount(rounds.path_round[final], minlength=num_rounds) > 0
    final_row = num_kept[rounds.path_round] + rounds.path_rank
    key = np.stack([rnd[mid_chunk], ch.length_class[mid_chunk], ch.local[mid_chunk], mid_row])
    mids, mid_of = np.unique(key, axis=1, return_inverse=True)  # siblings share one
    unique_chunk = np.empty(mids.shape[1], dtype=np.int64)
    unique_chunk[mid_of] = mid_chunk
    bounds = np.searchsorted(mids[0], np.arange(num_rounds + 1))
    mid_row_of = num_kept + np.where(finals, np.bincount(rounds.path_round), 0) - bounds[:-1]

    source = rounds.path_h0.copy()
    source[child[mid]] = mid_row_of[mids[0][mid_of]] + mid_of
    source[child[on_grid]] = kept_row[at[on_grid]]
    source[child[at_end]] = final_row[q[at_end]]
    out_row = np.where(out_start, kept_row[out_chunk], final_row[out_path])
    return _Reads(
        keep, kept_row, finals, mids, unique_chunk, bounds.tolist(), source, rounds.path_round[out_path], out_row
    )


def build_ragged_layout(
    batch: TreeBatch, chunk_size: int, state_out: np.ndarray | None, bucket: int = BUCKET
) -> RaggedLayout:
    """The :class:`RaggedLayout` of ``batch`` returning the states after the combined tokens
    ``state_out`` (None: none)."""
    C = chunk_size
    rounds = rounds_of(batch, C)
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=batch.device)
    counts = rounds.path_chunks
    skip = np.where(rounds.path_parent >= 0, rounds.path_replay, 0)  # the replayed piece tokens an exact start drops
    ch, lengths, per_length = _chunks(rounds, skip, bucket)
    reads = _reads(rounds, ch, skip, state_out)

    # One gather of every computed token; each own token's output slot.
    grid = rounds.grid
    run = grid.offset >= skip[grid.path]
    x = (np.cumsum(counts) - counts)[grid.path[run]] + grid.offset[run] // C
    slots = ch.slot[x] + grid.offset[run] - ch.lo[x]
    gather = np.full(int((lengths * per_length).sum()), -1, dtype=np.int64)
    gather[slots] = grid.token[run]
    output = np.empty(rounds.token_path.size, dtype=np.int64)
    own = grid.own[run]
    output[grid.token[run][own] - rounds.num_context] = slots[own]

    # Each round's steps and visits, from the visiting order.
    order = ch.order
    rnd, step, ends = rounds.path_round[ch.path[order]], ch.step[order], ch.step[order] == counts[ch.path[order]] - 1
    visits = _block_starts(rnd, step, ends, ch.length_class[order])
    visit_size = np.diff(np.r_[visits, order.size])
    visit_class = ch.length_class[order][visits]
    steps = _block_starts(rnd, step)
    step_visits = np.searchsorted(visits, np.r_[steps, order.size]).tolist()
    round_steps = np.searchsorted(rnd[steps], np.arange(rounds.num_rounds + 1)).tolist()
    pairs, going = list(zip(visit_class.tolist(), visit_size.tolist())), (~ends[visits]).tolist()
    bounds = np.r_[steps, order.size].tolist()
    out = []
    for r in range(rounds.num_rounds):
        scan = []
        for i in range(round_steps[r], round_steps[r + 1]):
            here = order[bounds[i] : bounds[i + 1]]
            follow = ch.position[order[bounds[i + 1] : bounds[i + 2]] - 1] if i + 1 < round_steps[r + 1] else None
            keep = np.flatnonzero(reads.keep[here])
            a, b = step_visits[i], step_visits[i + 1]
            scan.append(
                ScanStep(
                    visits=pairs[a:b],
                    following=sum(going[a:b]),
                    order=None if follow is None or np.array_equal(follow, np.arange(follow.size)) else as_t(follow),
                    keep=None if not keep.size else slice(None) if keep.size == here.size else as_t(keep),
                )
            )
        head = order[bounds[round_steps[r]] : bounds[round_steps[r] + 1]]
        ending = order[bounds[round_steps[r]] : bounds[round_steps[r + 1]]]
        ending = ending[ch.step[ending] == counts[ch.path[ending]] - 1]
        mids = slice(reads.mid_bounds[r], reads.mid_bounds[r + 1])
        (_, length_class, local, row), chunk = reads.mids[:, mids], reads.mid_chunk[mids]
        picks = reads.out_row[reads.out_round == r]
        out.append(
            ScanRound(
                steps=scan,
                h0=as_t(reads.source[ch.path[head]]),
                finals=bool(reads.finals[r]),
                final_order=as_t(np.argsort(rounds.path_rank[ch.path[ending]])),
                mids=[
                    MidStates(
                        length=j,
                        local=as_t(local[length_class == j]),
                        chunk=as_t(ch.chunk[chunk[length_class == j]]),
                        row=as_t(row[length_class == j]),
                        start=as_t(reads.kept_row[chunk[length_class == j]]),
                    )
                    for j in np.unique(length_class).tolist()
                ],
                picks=as_t(picks) if picks.size else None,
            )
        )
    return RaggedLayout(
        rounds=out,
        lengths=lengths.tolist(),
        chunks=per_length.tolist(),
        sections=[visit_size[visit_class == j].tolist() for j in range(lengths.size)],
        gather=as_t(rounds.input_rows(gather)),
        output=as_t(output),
        pick_order=None if state_out is None else as_t(np.argsort(np.argsort(reads.out_round, kind="stable"))),
    )


@dataclass(frozen=True)
class RaggedLayoutTable(Table):
    """The torch driver's :class:`RaggedLayout` of a batch on the chunk grid ``chunk_size``."""

    chunk_size: int
    state_dependent = True

    def build(self, batch: TreeBatch) -> RaggedLayout:
        return build_ragged_layout(batch, self.chunk_size, batch.state_out.get(self.chunk_size))


def ragged_layout_of(batch: TreeBatch, chunk_size: int) -> RaggedLayout:
    """The :class:`RaggedLayout` of ``batch`` returning the states after ``batch.state_out[chunk_size]``,
    derived once per batch."""
    return batch.cached(RaggedLayoutTable(chunk_size))

"""Path-major varlen layout of a tree batch's rounds, for fla's ``cu_seqlens`` calls.

fla wants each sequence contiguous. Here every path of :func:`rounds_of` (``Rounds``: the path
decomposition, every path on its aligned chunk grid, replay included) becomes one or more
*segments* (contiguous runs of its whole C-chunks, tails padded with the zero row of the input
tables, :meth:`Rounds.input_rows`), and segments run in *waves*: one packed fla call per wave.

Two layouts:
- ``cut=False``: one segment per path, waves <= rounds. The per-chunk states of a wave's call
  feed children that start mid-parent; their gradients must enter the parent's backward at
  interior chunk boundaries (a backward that can do that: ``gla.py``, ``gated_delta.py``).
- ``cut=True`` (exact fallback for any kind): a path is cut at every interior boundary whose
  state a child or the caller needs, so every needed state is a segment's initial or final
  state, where fla's public ops take and return gradients (``dh0``, ``dht``). Each cut on a
  chain adds a sequential wave: rounds go up.

States are addressed as rows of a *bank*: source 0 = ``cat([zeros(1), initial_states])``;
source 1 + 2w = the chunk-start states of wave w (path-major, ``cut=False`` only); source
2 + 2w = the final states of wave w's segments.

Legend: P paths, S segments, W waves, C chunk size, N piece tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from ..rounds import Rounds, rounds_of
from ..tree_batch import Table, TreeBatch
from .common import BT

__all__ = ["BankRows", "ChunkSteps", "Wave", "Waves", "WavesTable", "waves_of"]


@dataclass(frozen=True, eq=False)
class BankRows:
    """States at bank addresses (module docstring), device-ready: ``rows[i]`` of bank entry
    ``sources[i]``, concatenated, then reordered by ``order`` into the addresses' order."""

    sources: tuple[int, ...]
    rows: list[torch.Tensor]
    order: torch.Tensor

    @classmethod
    def of(cls, source: np.ndarray, row: np.ndarray, device: torch.device) -> BankRows:
        sources = np.unique(source)
        grouped = np.argsort(source, kind="stable")
        order = np.empty_like(grouped)
        order[grouped] = np.arange(grouped.size)
        as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
        return cls(tuple(int(s) for s in sources), [as_t(row[source == s]) for s in sources], as_t(order))

    def take(self, bank: dict[int, torch.Tensor]) -> torch.Tensor:
        """[len(addresses), H, K, V] the addressed states of ``bank``."""
        parts = [bank[s].index_select(0, rows) for s, rows in zip(self.sources, self.rows)]
        return torch.cat(parts).index_select(0, self.order)


@dataclass(frozen=True, eq=False)
class ChunkSteps:
    """A wave's fla chunk rows in step-major order, for the diagonal kinds' reverse scan of state
    gradients (``diagonal.inject_state_grads``): local chunk 0 of every sequence, then chunk 1 of
    those that have one, ..., longest sequences first within each step, so a step's successors
    are the leading rows of the next step.

    Args:
        order: [NT] fla row of each step-major row.
        last: [NT] packed index of each step-major chunk's last token.
        offsets: [max chunks + 1] step-major start of each local chunk index.
        first_rank: [offsets[1]] the sequence of each step-0 row (longest first).
    """

    order: torch.Tensor
    last: torch.Tensor
    offsets: tuple[int, ...]
    first_rank: torch.Tensor

    @classmethod
    def of(cls, cu: np.ndarray, chunk: int, device: torch.device) -> ChunkSteps:
        cu = np.asarray(cu, dtype=np.int64)
        lengths = np.diff(cu)
        counts = -(-lengths // chunk)
        rank = np.argsort(-counts, kind="stable")
        active = counts.size - np.searchsorted(np.sort(counts), np.arange(counts.max(initial=0)), side="right")
        offsets = np.concatenate(([0], np.cumsum(active)))
        step = np.repeat(np.arange(active.size), active)  # local chunk index of each step-major row
        seq = rank[np.arange(step.size) - offsets[step]]
        order = np.cumsum(counts)[seq] - counts[seq] + step
        last = cu[seq] + np.minimum((step + 1) * chunk, lengths[seq]) - 1
        as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
        return cls(as_t(order), as_t(last), tuple(int(o) for o in offsets), as_t(rank[: offsets[1]]))


@dataclass(frozen=True, eq=False)
class Wave:
    """One packed fla call.

    Args:
        gather: [T] input row (``Rounds.input_rows``) of each token slot (padding: the zero row),
            segments contiguous.
        cu_seqlens: [S_w + 1] int32 segment boundaries (every length a multiple of C).
        cu_seqlens_cpu: the same on the CPU (fla's index helpers read it without a device sync).
        h0: [S_w] each segment's initial state in the bank.
        steps: its fla chunks step-major (state-gradient injection of the diagonal kinds).
    """

    gather: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    h0: BankRows
    steps: ChunkSteps


@dataclass(frozen=True, eq=False)
class Waves:
    """The waves of one batch, chunk size and layout (module docstring).

    Args:
        waves: in execution order.
        own_index: [N] row of ``cat([wave outputs])`` (flat token slots) holding each piece token's output.
        rounds: the :class:`Rounds` this layout was derived from.
        state_source, state_row: [P, max chunks + 1] bank address of path p's state at chunk
            boundary m (m = 0: its initial state, m = its chunk count: its final state); -1 where
            the layout holds no such state (an interior boundary nobody needs, when cutting).
        state_out: the states after ``batch.state_out[C]`` in the bank (None: none asked).
    """

    waves: list[Wave]
    own_index: torch.Tensor
    rounds: Rounds
    state_source: np.ndarray
    state_row: np.ndarray
    state_out: BankRows | None

    @property
    def num_waves(self) -> int:
        return len(self.waves)


def _by_round(rounds: Rounds) -> list[np.ndarray]:
    """The paths of every round, in round order (a path's parent path is in the previous one)."""
    order = np.argsort(rounds.path_round, kind="stable")
    bounds = np.searchsorted(rounds.path_round[order], np.arange(rounds.num_rounds + 1))
    return [order[lo:hi] for lo, hi in pairwise(bounds)]


def _group(key: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Elements grouped by key in [0, num), in index order within a group: (the order, [num + 1]
    group offsets in it, each element's rank within its group)."""
    order = np.argsort(key, kind="stable")
    off = np.searchsorted(key[order], np.arange(num + 1))
    rank = np.empty(key.size, dtype=np.int64)
    rank[order] = np.arange(key.size) - off[key[order]]
    return order, off, rank


def build_waves(batch: TreeBatch, chunk_size: int, cut: bool) -> Waves:
    """Segments and waves of ``batch`` (module docstring); with ``cut``, the boundaries of the
    states ``batch.state_out[chunk_size]`` asks for are cut too.

    Chunks are path-major: chunk (p, m), the C tokens of path p at offsets [mC, (m + 1)C) from its
    aligned start, is chunk ``first[p] + m``. A wave's tokens are its chunks in that order, so its
    segments are contiguous and in (path, start) order."""
    C = chunk_size
    rounds = rounds_of(batch, C)
    num_paths, chunks, grid = rounds.num_paths, rounds.path_chunks, rounds.grid
    width = int(chunks.max()) + 1
    first = np.cumsum(chunks) - chunks
    chunk_path = np.repeat(np.arange(num_paths), chunks)
    chunk_m = np.arange(chunk_path.size) - first[chunk_path]

    # Where every path's initial state comes from: its parent's boundary, or path_h0 of the inputs.
    parent = rounds.path_parent
    has_parent = parent >= 0
    q = np.maximum(parent, 0)
    parent_boundary = np.where(has_parent, (rounds.path_start - rounds.path_start[q]) // C, 0)
    state_out = batch.state_out.get(C)
    out_path, out_m = rounds.boundary_of(np.zeros(0, dtype=np.int64) if state_out is None else state_out)

    # Segments start at every path's chunk 0 and, with ``cut``, at every needed interior boundary.
    starts = np.zeros(chunk_path.size, dtype=bool)
    starts[first] = True
    if cut:
        need_p = np.concatenate((parent[has_parent], out_path))
        need_m = np.concatenate((parent_boundary[has_parent], out_m))
        inner = (need_m > 0) & (need_m < chunks[need_p])
        starts[first[need_p[inner]] + need_m[inner]] = True
    chunk_seg = np.cumsum(starts) - 1
    seg_index = chunk_seg - chunk_seg[first[chunk_path]]  # of each chunk's segment within its path

    # A path starts in the wave after the one yielding its initial state (the wave of the parent's
    # chunk ending at that boundary; at the parent's boundary 0, the parent's own start wave), and
    # its segments run one wave apart.
    before = np.maximum(first[q] + parent_boundary - 1, 0)  # the parent's chunk ending there
    delay = np.where(has_parent & (parent_boundary > 0), 1 + seg_index[before], 0)
    start_wave = np.zeros(num_paths, dtype=np.int64)
    for paths in _by_round(rounds):
        start_wave[paths] = np.where(has_parent[paths], start_wave[q[paths]] + delay[paths], 0)
    chunk_wave = start_wave[chunk_path] + seg_index
    num_waves = int(chunk_wave.max()) + 1

    seg_first = np.flatnonzero(starts)
    seg_path, seg_start, seg_wave = chunk_path[seg_first], chunk_m[seg_first], chunk_wave[seg_first]
    seg_end = seg_start + np.diff(np.append(seg_first, chunk_path.size))
    seg_order, seg_off, seg_rank = _group(seg_wave, num_waves)  # a wave's segments: by path, then start
    chunk_order, chunk_off, chunk_rank = _group(chunk_wave, num_waves)  # its chunks, as its call packs them

    # Token slots: the grid's tokens at chunk first[p] + offset // C, slot offset % C.
    combined = np.full(chunk_path.size * C, -1, dtype=np.int64)
    combined[first[grid.path] * C + grid.offset] = grid.token
    gather = rounds.input_rows(combined).reshape(-1, C)[chunk_order].reshape(-1)  # cat(waves) slots
    chunk_slot = (chunk_off[chunk_wave] + chunk_rank) * C  # first slot of each chunk in cat(waves)
    own_path, own_offset = grid.path[grid.own], grid.offset[grid.own]
    own_index = np.empty(rounds.token_path.size, dtype=np.int64)
    own_index[grid.token[grid.own] - rounds.num_context] = (
        chunk_slot[first[own_path] + own_offset // C] + own_offset % C
    )

    # Bank address of every state (p, m): a segment's final state, a chunk-start state (uncut),
    # or the initial state, resolved round by round so that parents are known first.
    source = np.full((num_paths, width), -1, dtype=np.int64)
    row = np.full((num_paths, width), -1, dtype=np.int64)
    source[seg_path, seg_end] = 2 + 2 * seg_wave
    row[seg_path, seg_end] = seg_rank
    if not cut:
        inner = chunk_m > 0
        source[chunk_path[inner], chunk_m[inner]] = 1 + 2 * chunk_wave[inner]
        row[chunk_path[inner], chunk_m[inner]] = chunk_rank[inner]
    for paths in _by_round(rounds):
        p, b = q[paths], parent_boundary[paths]
        source[paths, 0] = np.where(has_parent[paths], source[p, b], 0)
        row[paths, 0] = np.where(has_parent[paths], row[p, b], rounds.path_h0[paths])

    device = batch.device
    waves = []
    for w in range(num_waves):
        segs = seg_order[seg_off[w] : seg_off[w + 1]]
        cu = torch.as_tensor(np.concatenate(([0], np.cumsum(seg_end[segs] - seg_start[segs]) * C)), dtype=torch.int32)
        slots = torch.as_tensor(gather[chunk_off[w] * C : chunk_off[w + 1] * C], dtype=torch.long, device=device)
        h0 = BankRows.of(source[seg_path[segs], seg_start[segs]], row[seg_path[segs], seg_start[segs]], device)
        waves.append(Wave(slots, cu.to(device), cu, h0, ChunkSteps.of(cu.numpy(), BT, device)))
    out = None if state_out is None else BankRows.of(source[out_path, out_m], row[out_path, out_m], device)
    return Waves(waves, torch.as_tensor(own_index, device=device), rounds, source, row, out)


@dataclass(frozen=True)
class WavesTable(Table):
    """The fla backend's :class:`Waves` of a batch on the chunk grid ``chunk_size`` (``cut``: the cut layout)."""

    chunk_size: int
    cut: bool
    state_dependent = True

    def build(self, batch: TreeBatch) -> Waves:
        return build_waves(batch, self.chunk_size, self.cut)


def waves_of(batch: TreeBatch, chunk_size: int, cut: bool) -> Waves:
    """The waves of ``batch`` (module docstring), derived once per batch and layout."""
    return batch.cached(WavesTable(chunk_size, cut))

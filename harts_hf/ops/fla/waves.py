"""Path-major varlen layout of a tree batch's rounds, for fla's ``cu_seqlens`` calls.

``rounds.py`` packs a round step-major (chunk 0 of every path, then chunk 1, ...) for the torch
kernels; fla wants each sequence contiguous. Here every path of :func:`rounds_of` becomes one or
more *segments* (contiguous runs of its chunks, each a multiple of C tokens long, tails padded
with the neutral token), and segments run in *waves*: one packed fla call per wave.

Two layouts:
- ``cut=False``: one segment per path, waves == rounds. The per-chunk states of a wave's call
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

import numpy as np
import torch

from ..rounds import Rounds, rounds_of
from ..tree_batch import TreeBatch
from .common import BT

__all__ = ["BankRows", "ChunkSteps", "Wave", "Waves", "waves_of"]


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


def _path_ids(rounds: Rounds) -> np.ndarray:
    """[R, max paths per round] global path index of (round, rank)."""
    width = np.bincount(rounds.path_round).max()
    table = np.full((rounds.num_rounds, width), -1, dtype=np.int64)
    table[rounds.path_round, rounds.path_rank] = np.arange(rounds.num_paths)
    return table


def _row_to_boundary(rounds: Rounds, r: int, rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(path, chunk boundary) of rows of round r's ``cat([h_start, h_final])``."""
    steps = rounds.rounds[r].step_counts
    offsets = np.concatenate(([0], np.cumsum(steps)))
    total = offsets[-1]
    inner = rows < total
    step = np.searchsorted(offsets, np.minimum(rows, total - 1), side="right") - 1
    rank = np.where(inner, rows - offsets[step], rows - total)
    path = ids[r, rank]
    return path, np.where(inner, step, rounds.path_chunks[path])


def _boundary_of(rounds: Rounds, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(path, chunk boundary) of the state after each piece token (``Rounds.state_index`` rows)."""
    rnd, row = rounds.state_index(tokens)
    ids = _path_ids(rounds)
    path = np.empty(tokens.size, dtype=np.int64)
    boundary = np.empty(tokens.size, dtype=np.int64)
    for r in np.unique(rnd):
        sel = rnd == r
        path[sel], boundary[sel] = _row_to_boundary(rounds, int(r), row[sel], ids)
    return path, boundary


def build_waves(batch: TreeBatch, chunk_size: int, cut: bool) -> Waves:
    """Segments and waves of ``batch`` (module docstring); with ``cut``, the boundaries of the
    states ``batch.state_out[chunk_size]`` asks for are cut too."""
    C = chunk_size
    state_out = batch.state_out.get(C)
    rounds = rounds_of(batch, C)
    num_paths, chunks = rounds.num_paths, rounds.path_chunks
    ids = _path_ids(rounds)
    width = int(chunks.max()) + 1
    all_paths = np.arange(num_paths)

    # Where every path's initial state comes from: (parent path, boundary) or an input bank row.
    parent = np.full(num_paths, -1, dtype=np.int64)
    parent_boundary = np.zeros(num_paths, dtype=np.int64)
    input_row = np.zeros(num_paths, dtype=np.int64)
    for r, rnd in enumerate(rounds.rounds):
        paths = ids[r, : rnd.step_counts[0]]
        h0 = rnd.h0_index.cpu().numpy()
        if r == 0:
            input_row[paths] = h0
        else:
            parent[paths], parent_boundary[paths] = _row_to_boundary(rounds, r - 1, h0, ids)

    # Cut points (a segment ends at every cut): 0, the path's end, and needed interior boundaries.
    cuts = np.zeros((num_paths, width), dtype=bool)
    cuts[all_paths, 0] = cuts[all_paths, chunks] = True
    if cut:
        has_parent = parent >= 0
        cuts[parent[has_parent], parent_boundary[has_parent]] = True
        if state_out is not None and state_out.size:
            p, m = _boundary_of(rounds, state_out)
            cuts[p, m] = True
    cuts &= np.arange(width) <= chunks[:, None]
    seg_path, seg_start = np.nonzero(cuts & (np.arange(width) < chunks[:, None]))  # path order, then chunk
    later = np.where(cuts, np.arange(width), width)
    next_cut = np.minimum.accumulate(later[:, ::-1], axis=1)[:, ::-1]  # first cut at or after m
    seg_end = next_cut[seg_path, seg_start + 1]
    seg_index = np.arange(seg_path.size) - np.searchsorted(seg_path, seg_path)  # within its path

    # Waves, one round at a time (parents ran in the previous round): a path starts one wave after
    # the wave that yields its initial state; its segments follow one wave apart.
    avail = np.full((num_paths, width), -1, dtype=np.int64)  # wave after which state (p, m) exists
    start_wave = np.zeros(num_paths, dtype=np.int64)
    seg_wave = np.zeros(seg_path.size, dtype=np.int64)
    for r in range(rounds.num_rounds):
        paths = ids[r][ids[r] >= 0]
        has_parent = parent[paths] >= 0
        start_wave[paths] = np.where(has_parent, avail[parent[paths], parent_boundary[paths]] + 1, 0)
        avail[paths, 0] = start_wave[paths] - 1
        sel = np.isin(seg_path, paths)
        seg_wave[sel] = start_wave[seg_path[sel]] + seg_index[sel]
        avail[seg_path[sel], seg_end[sel]] = seg_wave[sel]
        if not cut:
            inner = paths[:, None], np.arange(1, width)[None, :]
            avail[inner] = np.where(np.arange(1, width) < chunks[paths, None], start_wave[paths, None], avail[inner])
    return _assemble(
        batch, rounds, ids, C, cut, seg_path, seg_start, seg_end, seg_wave, parent, parent_boundary, input_row, width
    )


def _assemble(
    batch, rounds, ids, C, cut, seg_path, seg_start, seg_end, seg_wave, parent, parent_boundary, input_row, width
) -> Waves:
    """Token gathers, cu_seqlens, output index and state bank addresses of the waves."""
    num_paths = rounds.num_paths
    num_waves = int(seg_wave.max()) + 1
    order = np.lexsort((seg_start, seg_path, seg_wave))  # segments by wave, then path order
    wave_off = np.searchsorted(seg_wave[order], np.arange(num_waves + 1))
    seg_rank = np.empty(order.size, dtype=np.int64)
    seg_rank[order] = np.arange(order.size) - wave_off[seg_wave[order]]

    # Chunks of every segment, in wave order: their rows in the rounds' step-major chunk tables.
    seg_chunks = (seg_end - seg_start)[order]
    chunk_seg = np.repeat(order, seg_chunks)
    chunk_m = (
        seg_start[chunk_seg] + np.arange(chunk_seg.size) - np.repeat(np.cumsum(seg_chunks) - seg_chunks, seg_chunks)
    )
    path = seg_path[chunk_seg]
    rnd = rounds.path_round[path]
    step_off = np.zeros((rounds.num_rounds, width + 1), dtype=np.int64)
    round_chunk_off = np.zeros(rounds.num_rounds + 1, dtype=np.int64)
    for r, rd in enumerate(rounds.rounds):
        off = np.cumsum(rd.step_counts)
        step_off[r, 1 : off.size + 1] = off
        round_chunk_off[r + 1] = round_chunk_off[r] + off[-1]
    chunk_row = round_chunk_off[rnd] + step_off[rnd, chunk_m] + rounds.path_rank[path]  # [chunks]
    chunk_pos = np.empty(chunk_row.size, dtype=np.int64)  # flat token slot of each step-major chunk
    chunk_pos[chunk_row] = np.arange(chunk_row.size) * C
    wave_chunk_off = np.searchsorted(seg_wave[chunk_seg], np.arange(num_waves + 1))
    seg_chunk_pos = np.empty(order.size, dtype=np.int64)  # first chunk of each segment, within its wave
    seg_chunk_pos[order] = np.cumsum(seg_chunks) - seg_chunks - wave_chunk_off[seg_wave[order]]

    device = batch.device
    table = rounds.input_rows(torch.cat([rd.gather for rd in rounds.rounds])).view(-1, C)  # [all chunks, C]
    rows = torch.as_tensor(chunk_row, device=device)
    packed = []  # per wave: (token gather, cu_seqlens on the CPU)
    for w in range(num_waves):
        segs = order[wave_off[w] : wave_off[w + 1]]
        cu = np.concatenate(([0], np.cumsum(seg_end[segs] - seg_start[segs]) * C))
        packed.append(
            (table[rows[wave_chunk_off[w] : wave_chunk_off[w + 1]]].flatten(), torch.as_tensor(cu, dtype=torch.int32))
        )

    # Own outputs: token -> its step-major slot -> its wave slot.
    slot_off = round_chunk_off * C
    own_slot = np.concatenate([slot_off[r] + rd.own_slot.cpu().numpy() for r, rd in enumerate(rounds.rounds)])
    slot = own_slot[rounds.restore.cpu().numpy()]
    own_index = chunk_pos[slot // C] + slot % C

    # Bank address of every state (p, m), rounds in order so parents are known first.
    source = np.full((num_paths, width), -1, dtype=np.int64)
    row = np.full((num_paths, width), -1, dtype=np.int64)
    source[seg_path, seg_end] = 2 + 2 * seg_wave
    row[seg_path, seg_end] = seg_rank
    if not cut:
        p, m = np.nonzero((np.arange(width) > 0) & (np.arange(width) < rounds.path_chunks[:, None]))
        s = np.searchsorted(seg_path, p)  # the path's only segment
        source[p, m] = 1 + 2 * seg_wave[s]
        row[p, m] = seg_chunk_pos[s] + m
    for r in range(rounds.num_rounds):
        paths = ids[r][ids[r] >= 0]
        has = parent[paths] >= 0
        source[paths, 0] = np.where(has, source[parent[paths], parent_boundary[paths]], 0)
        row[paths, 0] = np.where(has, row[parent[paths], parent_boundary[paths]], input_row[paths])
    waves = []
    for w, (gather, cu_cpu) in enumerate(packed):
        segs = order[wave_off[w] : wave_off[w + 1]]
        h0 = BankRows.of(source[seg_path[segs], seg_start[segs]], row[seg_path[segs], seg_start[segs]], device)
        waves.append(Wave(gather, cu_cpu.to(device), cu_cpu, h0, ChunkSteps.of(cu_cpu.numpy(), BT, device)))
    out, state_out = None, batch.state_out.get(C)
    if state_out is not None:
        path, boundary = _boundary_of(rounds, state_out)
        out = BankRows.of(source[path, boundary], row[path, boundary], device)
    return Waves(waves, torch.as_tensor(own_index, device=device), rounds, source, row, out)


def waves_of(batch: TreeBatch, chunk_size: int, cut: bool) -> Waves:
    """The waves of ``batch`` (module docstring), derived once per batch and layout."""
    return batch.cached(("fla_waves", chunk_size, cut), lambda b: build_waves(b, chunk_size, cut))

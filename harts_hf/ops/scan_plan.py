"""Scan plans: which states the torch driver's ragged scan keeps, and one input gather per run.

A round of the ragged layout (:mod:`harts_hf.ops.tail_chunks`) could keep every chunk's start
state; only those a later use reads are materialised here: the next round's path starts, the
round's mid-chunk state requests and ``batch.state_out``. The intra-chunk half of the kernels
runs once per chunk length for all rounds, so the run's slots are ordered by length, then round.
Derived once per batch and ``batch.state_out`` with numpy.

Legend: Tc chunks of a round, P paths of the round, R requested mid-chunk states, S states asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .rounds import rounds_of
from .tail_chunks import BUCKET, RaggedRound, ragged_rounds_of
from .tree_batch import TreeBatch

__all__ = ["RoundPlan", "ScanPlan", "build_scan_plan", "scan_plan_of"]


@dataclass(frozen=True, eq=False)
class RoundPlan:
    """Which states one round's scan keeps: only those a later use reads, not every chunk's start state.

    A round's *kept states* are ``cat([kept chunk-start states, h_final (if computed), requested
    mid-chunk states])``; the next round's paths, the round's requests and ``batch.state_out`` read rows
    of it.

    Args:
        keep: per step, the visiting positions whose start states are kept (None: none; a slice: all).
        finals: whether the paths' end states are computed (the next round or ``batch.state_out`` reads one).
        h0: [n_0] row of the previous round's kept states (round 0: of ``cat([zeros(1), initial_states])``)
            at each visiting position of step 0.
        request_start: per :class:`StateRequests` of the round, [R_s] rows of the kept chunk-start states.
        request_chunk: per :class:`StateRequests`, [R_s] its chunks among every round's chunks of their length.
        picks: [S_r] rows of the kept states returned for ``batch.state_out`` (None: none).
    """

    keep: list[torch.Tensor | slice | None]
    finals: bool
    h0: torch.Tensor
    request_start: list[torch.Tensor]
    request_chunk: list[torch.Tensor]
    picks: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class ScanPlan:
    """Every round's :class:`RoundPlan` and the index maps of the whole run.

    The intra-chunk half does not depend on states, so it runs once per chunk length for every round
    together: the run's slots are ordered by chunk length, then round (a round's stream of length L is a
    block of length L's chunks).

    Args:
        rounds: one :class:`RoundPlan` per round.
        lengths: the chunk lengths of every round, descending.
        counts: per length, the chunks of each round (0 where the round has no stream of that length).
        sections: per length, the chunks of each visit, round after round (a round's visits of that
            length in visiting order): ONE split of each intra output per length serves every round,
            and its backward is one concatenation.
        gather: [slots] input row (``Rounds.input_rows``) of every slot (``RaggedRound.gather``
            reordered by length, then round; padding becomes the zero row): one gather per input
            for the whole run.
        output: [N] slot of each piece token's output.
        pick_order: [S] row of ``cat(picks of every round)`` holding each ``batch.state_out`` state.
    """

    rounds: list[RoundPlan]
    lengths: list[int]
    counts: list[list[int]]
    sections: list[list[int]]
    gather: torch.Tensor
    output: torch.Tensor
    pick_order: torch.Tensor | None


def _round_plan(
    rag: RaggedRound,
    want: np.ndarray,
    h0_rows: np.ndarray,
    picks: np.ndarray | None,
    chunk_offset: list[int],
    device: torch.device,
) -> tuple[RoundPlan, np.ndarray]:
    """The :class:`RoundPlan` of ``rag`` keeping the rows ``want`` [Tc + P] of ``cat([h_start, h_final])``,
    and the row of the kept states holding each row of ``cat([h_start, h_final, requested states])``;
    ``chunk_offset``: per stream, its first chunk among every round's chunks of its length."""
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)
    counts = [ranks.size for ranks in rag.visit_rank]
    tc, paths = sum(counts), counts[0]
    mids = sum(req.row.numel() for req in rag.requests)
    new = np.full(tc + paths + mids, -1, dtype=np.int64)
    keep, kept, offset = [], 0, 0
    for ranks in rag.visit_rank:
        at = np.flatnonzero(want[offset + ranks])  # visiting positions kept, ascending
        new[offset + ranks[at]] = kept + np.arange(at.size)
        keep.append(None if not at.size else slice(None) if at.size == ranks.size else as_t(at))
        kept, offset = kept + at.size, offset + ranks.size
    finals = bool(want[tc:].any())
    if finals:
        new[tc : tc + paths] = kept + np.arange(paths)
    new[tc + paths :] = kept + (paths if finals else 0) + np.arange(mids)
    starts = [new[req.start.cpu().numpy()] for req in rag.requests]
    plan = RoundPlan(
        keep=keep,
        finals=finals,
        h0=as_t(h0_rows[rag.visit_rank[0]]),
        request_start=[as_t(x) for x in starts],
        request_chunk=[req.chunk + chunk_offset[req.stream] for req in rag.requests],
        picks=None if picks is None or not picks.size else as_t(new[picks]),
    )
    return plan, new


def build_scan_plan(batch: TreeBatch, chunk_size: int, state_out: np.ndarray | None, bucket: int = BUCKET) -> ScanPlan:
    """The :class:`ScanPlan` of ``ragged_rounds_of(batch, chunk_size, bucket)`` returning the states after
    the combined tokens ``state_out`` (None: none)."""
    rounds = rounds_of(batch, chunk_size)
    layout = ragged_rounds_of(batch, chunk_size, bucket)
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=batch.device)
    out_round, out_row = (np.zeros(0, dtype=np.int64),) * 2 if state_out is None else rounds.state_index(state_out)
    h0_rows = layout[0].h0_index.cpu().numpy()  # round 0: rows of cat([zeros(1), initial_states])
    gather, output, lengths, counts = _by_length(layout)
    plans = []
    for r, rag in enumerate(layout):
        size = sum(ranks.size for ranks in rag.visit_rank) + rag.visit_rank[0].size  # Tc + P
        want = np.zeros(size, dtype=bool)
        for req in rag.requests:
            want[req.start.cpu().numpy()] = True
        following = layout[r + 1].h0_index.cpu().numpy() if r + 1 < len(layout) else np.zeros(0, dtype=np.int64)
        want[following[following < size]] = True
        want[out_row[out_round == r]] = True
        offset = [sum(counts[lengths.index(L)][:r]) for L in rag.lengths]
        plan, new = _round_plan(rag, want, h0_rows, out_row[out_round == r], offset, batch.device)
        plans.append(plan)
        h0_rows = new[following]
    by_round = np.argsort(out_round, kind="stable")
    return ScanPlan(
        rounds=plans,
        lengths=lengths,
        counts=counts,
        sections=[
            [n for rag in layout for size, sec in zip(rag.lengths, rag.sections) if size == length for n in sec]
            for length in lengths
        ],
        gather=rounds.input_rows(as_t(gather)),
        output=as_t(output[rounds.restore.cpu().numpy()]),
        pick_order=None if state_out is None else as_t(np.argsort(by_round)),
    )


def _by_length(layout: list[RaggedRound]) -> tuple[np.ndarray, np.ndarray, list[int], list[list[int]]]:
    """Every round's slots ordered by chunk length, then round: (gather, slot of each own token in
    ``cat(own tokens of round 0, round 1, ...)`` order, the lengths, per length the chunks of each round)."""
    lengths = sorted({L for rag in layout for L in rag.lengths}, reverse=True)
    counts = [[0] * len(layout) for _ in lengths]
    parts: list[list[np.ndarray]] = [[] for _ in lengths]
    where = []  # per round: global slot of each of its slots
    for r, rag in enumerate(layout):
        for L, c in zip(rag.lengths, rag.chunks):
            counts[lengths.index(L)][r] = c
    offsets = np.cumsum([0] + [L * sum(c) for L, c in zip(lengths, counts)])
    for r, rag in enumerate(layout):
        gather = rag.gather.cpu().numpy()
        at, slots = 0, []
        for L, c in zip(rag.lengths, rag.chunks):
            j = lengths.index(L)
            parts[j].append(gather[at : at + c * L])
            slots.append(offsets[j] + L * sum(counts[j][:r]) + np.arange(c * L))
            at += c * L
        where.append(np.concatenate(slots))
    own = np.concatenate([w[rag.own_slot.cpu().numpy()] for w, rag in zip(where, layout)])
    return np.concatenate([x for p in parts for x in p]), own, lengths, counts


def scan_plan_of(batch: TreeBatch, chunk_size: int) -> ScanPlan:
    """The :class:`ScanPlan` of ``batch`` (ragged layout with :data:`BUCKET`) returning the states
    after ``batch.state_out[chunk_size]``, derived once per batch."""
    return batch.cached(
        ("scan_plan", chunk_size), lambda b: build_scan_plan(b, chunk_size, b.state_out.get(chunk_size))
    )

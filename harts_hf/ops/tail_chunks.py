"""Ragged rounds: every path's last (partial) chunk runs at its true length, rounded up to a bucket.

A round of :func:`rounds_of` packs every chunk right-padded to C slots. On short paths (a side leaf of
tens of tokens replaying < C parent tokens) most of those slots are padding, and a chunk's cost grows
with its length. Here each round's chunks are split into *streams* of equal length: stream C holds
every full chunk, the other streams hold the last chunks of paths whose valid length rounds up to
L = 8, 16, ... (multiples of :data:`BUCKET`). A truncated chunk is the same prefix of its
trajectory's chunk, minus neutral padding, so the kernels' arithmetic is unchanged.

The inter-chunk scan (``linear_attention.scan_ragged``) walks the round's steps as before; at step m
the continuing paths (ranks < n_{m+1}) take full chunks, and the paths ending at m are split into
one group per stream. States keep :class:`~harts_hf.ops.rounds.Round`'s layout: ``h_start`` is in
step-major rank order, ``h_final`` in rank order, so ``Round.h0_index`` and
``Rounds.state_index`` apply unchanged.

Legend: Tc chunks of a round, C chunk size, L a stream's chunk length, P paths of the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .rounds import Round, rounds_of
from .tree_batch import TreeBatch

__all__ = ["BUCKET", "RaggedRound", "ragged_rounds_of"]

BUCKET = 8  # tail lengths round up to a multiple of this (KDA / GLA sub-chunks are 8 rows)


@dataclass(frozen=True, eq=False)
class RaggedRound:
    """One round's chunks as streams of equal-length chunks, and the scan's visiting order.

    Args:
        lengths: [S] chunk length of each stream.
        chunks: [S] chunks of each stream (T_s).
        gather: [sum_s T_s * L_s] combined index of the token in each slot, stream after stream
            (-1 = padding): one gather per round, whose backward is one scatter, not one per stream.
        sections: S x [rows of the stream used by each visit, in visiting order].
        steps: per chunk step m, its visits: (stream, rows) with rows None for the continuing
            paths (ranks [0, n_{m+1}): the next state) or a [e] tensor of ending ranks minus
            n_{m+1} (their end states go to ``h_final``).
        final_order: [P] row of ``cat(end states in visiting order)`` holding rank p's final state.
        own_slot: [n] slot (index into ``gather``; the scan's outputs use the same layout) of each own
            token of the round, in ``Round.own_slot`` order.
    """

    lengths: list[int]
    chunks: list[int]
    gather: torch.Tensor
    sections: list[list[int]]
    steps: list[list[tuple[int, torch.Tensor | None]]]
    final_order: torch.Tensor
    own_slot: torch.Tensor


def _ragged(rnd: Round, C: int, bucket: int) -> RaggedRound:
    """Split one round into streams (module docstring); numpy index work, one loop per chunk step."""
    gather = rnd.gather.cpu().numpy().reshape(-1, C)  # [Tc, C]
    valid = gather >= 0
    length = np.where(valid.any(1), C - np.argmax(valid[:, ::-1], axis=1), 1)  # last valid slot + 1
    chunk_len = np.minimum(-(-length // bucket) * bucket, C)  # [Tc]
    lengths = sorted(set(chunk_len.tolist()) | {C}, reverse=True)  # stream 0 is C
    counts = rnd.step_counts
    offsets = np.concatenate(([0], np.cumsum(counts)))

    members: list[list[np.ndarray]] = [[] for _ in lengths]  # chunks of each stream, visiting order
    sections: list[list[int]] = [[] for _ in lengths]
    steps, final_ranks = [], []
    for m, n in enumerate(counts):
        n_next = counts[m + 1] if m + 1 < len(counts) else 0
        visits: list[tuple[int, torch.Tensor | None]] = []
        if n_next:
            members[0].append(offsets[m] + np.arange(n_next))
            sections[0].append(n_next)
            visits.append((0, None))
        ending = np.arange(n_next, n)
        tail_len = chunk_len[offsets[m] + ending]
        for s, L in enumerate(lengths):
            ranks = ending[tail_len == L]
            if ranks.size:
                members[s].append(offsets[m] + ranks)
                sections[s].append(int(ranks.size))
                visits.append((s, torch.as_tensor(ranks - n_next, device=rnd.gather.device)))
                final_ranks.append(ranks)
        steps.append(visits)

    chunks = [np.concatenate(x) if x else np.zeros(0, dtype=np.int64) for x in members]
    sizes = [c.size * L for c, L in zip(chunks, lengths)]
    stream_off = np.concatenate(([0], np.cumsum(sizes)))
    where_stream = np.empty(gather.shape[0], dtype=np.int64)
    where_pos = np.empty(gather.shape[0], dtype=np.int64)
    for s, c in enumerate(chunks):
        where_stream[c] = s
        where_pos[c] = np.arange(c.size)
    slot = rnd.own_slot.cpu().numpy()
    chunk, row = slot // C, slot % C
    lens = np.asarray(lengths)
    own = stream_off[where_stream[chunk]] + where_pos[chunk] * lens[where_stream[chunk]] + row

    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=rnd.gather.device)
    return RaggedRound(
        lengths=lengths,
        chunks=[int(c.size) for c in chunks],
        gather=as_t(np.concatenate([gather[c, :L].reshape(-1) for c, L in zip(chunks, lengths)])),
        sections=sections,
        steps=steps,
        final_order=as_t(np.argsort(np.concatenate(final_ranks), kind="stable")),
        own_slot=as_t(own),
    )


def ragged_rounds_of(batch: TreeBatch, chunk_size: int, bucket: int = BUCKET) -> list[RaggedRound]:
    """The :class:`RaggedRound` of every round of ``rounds_of(batch, chunk_size)``, derived once per batch."""

    def build(b: TreeBatch) -> list[RaggedRound]:
        return [_ragged(r, chunk_size, bucket) for r in rounds_of(b, chunk_size).rounds]

    return batch.cached(("ragged_rounds", chunk_size, bucket), build)

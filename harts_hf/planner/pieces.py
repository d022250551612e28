"""Pieces: token ranges of the rank sequences, each placed in one microbatch slot.

A rank's *sequence* is its intervals (``assign.RankIntervals``) end to end, in DFS order; the
sequences of all ranks are concatenated, so a cut is one position in that concatenation.

Legend: I intervals, R ranks, S slots, P pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..runs import covered, group_firsts
from .assign import RankIntervals
from .node_parts import find_in

__all__ = ["Pieces", "merge", "pieces_of", "sequence"]


@dataclass(frozen=True, eq=False)
class Pieces:
    """Intervals split at the cuts: one piece per (interval, microbatch), ordered by (rank, slot);
    in a microbatch, pieces of the rank's cut sequence (DFS order) come before packed whole trees,
    so its first piece carries its context.

    Args:
        rank, slot, lo, hi, branch, replica: [P]; ``lo:hi`` global tokens.
        num_slots: S, the same on every rank.
    """

    rank: np.ndarray
    slot: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    branch: np.ndarray
    replica: np.ndarray
    num_slots: int

    @property
    def microbatch(self) -> np.ndarray:
        """[P] microbatch id rank * S + slot."""
        return self.rank * self.num_slots + self.slot

    @cached_property
    def by_token(self) -> np.ndarray:
        """[P] piece indices sorted by (rank, lo): a rank's pieces are disjoint token ranges."""
        return np.lexsort((self.lo, self.rank))

    @cached_property
    def keys(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(lo, hi) of the pieces in ``by_token`` order as keys ``rank * stride + token``, and stride
        (kept: ``locate`` reads them more than once)."""
        stride = int(self.hi.max(initial=0)) + 1
        o = self.by_token
        return self.rank[o] * stride + self.lo[o], self.rank[o] * stride + self.hi[o], stride

    def locate(self, rank: np.ndarray, token: np.ndarray) -> np.ndarray:
        """The piece of ``rank`` holding each global ``token``, -1 if none."""
        lo, hi, stride = self.keys
        i = find_in(lo, hi, rank * stride + token)
        return np.where(i >= 0, self.by_token[np.maximum(i, 0)], -1)

    @cached_property
    def _holders(self) -> tuple[np.ndarray, np.ndarray]:
        """(bounds, piece): the token line cut at every piece's ends, and per segment the piece of
        the lowest rank holding it (-1: none)."""
        bounds = np.unique(np.r_[self.lo, self.hi])
        seg, which = covered(bounds, self.lo, self.hi)
        head = group_firsts(np.lexsort((self.rank[which], seg)), seg)
        piece = np.full(max(bounds.size - 1, 0), -1, dtype=np.int64)
        piece[seg[head]] = which[head]
        return bounds, piece

    def lowest_holder(self, token: np.ndarray) -> np.ndarray:
        """The piece of the lowest rank holding each global ``token``, -1 if none."""
        bounds, piece = self._holders
        s = np.searchsorted(bounds, token, side="right") - 1
        return np.r_[piece, -1][np.where((s >= 0) & (s < piece.size), s, piece.size)]


def sequence(iv: RankIntervals, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(start of each interval in the concatenated sequences [I], start of each rank [R + 1])."""
    length = iv.hi - iv.lo
    start = np.concatenate(([0], np.cumsum(length)))
    rank_start = start[np.searchsorted(iv.rank, np.arange(world_size + 1))]
    return start[:-1], rank_start


def pieces_of(iv: RankIntervals, world_size: int, cut_pos: np.ndarray, cut_rank: np.ndarray, num_slots: int) -> Pieces:
    """Split the intervals at cuts (positions in the concatenated sequences, sorted)."""
    iv_start, rank_start = sequence(iv, world_size)
    bounds = np.unique(np.concatenate((iv_start, cut_pos, rank_start[-1:])))
    lo_pos, hi_pos = bounds[:-1], bounds[1:]
    i = np.searchsorted(iv_start, lo_pos, side="right") - 1
    rank = iv.rank[i]
    cuts_before = np.searchsorted(cut_rank, rank)  # cuts of earlier ranks
    slot = np.searchsorted(cut_pos, lo_pos, side="right") - cuts_before
    lo = iv.lo[i] + lo_pos - iv_start[i]
    hi = lo + hi_pos - lo_pos
    return Pieces(rank, slot, lo, hi, iv.branch[i], iv.replica[i], num_slots)


def merge(a: Pieces, b: Pieces) -> Pieces:
    """Pieces of both, ordered by (rank, slot), ``a``'s before ``b``'s in a microbatch, then DFS:
    a microbatch's first piece then carries its context (``a`` holds the cut sequences)."""
    cat = {f: np.concatenate((getattr(a, f), getattr(b, f))) for f in ("rank", "slot", "lo", "hi", "branch", "replica")}
    second = np.r_[np.zeros(a.rank.size, dtype=bool), np.ones(b.rank.size, dtype=bool)]
    order = np.lexsort((cat["lo"], second, cat["slot"], cat["rank"]))
    return Pieces(**{f: v[order] for f, v in cat.items()}, num_slots=a.num_slots)

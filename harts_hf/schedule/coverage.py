"""Who computes each token of a step, as runs: the step's units (:class:`StepUnits`, from a plan's
pieces, which are ranges) cut at every run boundary into *segments* that the same units compute
whole (:class:`Coverage`). A read resolves per segment: to the reading rank's own unit computing
it, else to the first unit by slot, then rank (``units`` module docstring). So the whole step's
handoff graph costs its runs, a few per unit, where its tokens are millions; a rank expands to
tokens only what its own units read and what others read of them (``units.compile_rank``).

Legend: U the step's units, Q runs, S segments, K (rank, segment) pairs computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..forest import RolloutForest
from ..planner.plan import Plan
from ..runs import Runs, aranges, covered, group_firsts

__all__ = ["Coverage", "Reads", "StepUnits"]


@dataclass(frozen=True, eq=False)
class StepUnits:
    """Every model call of a step: [U] ``rank``, ``slot``, ``forest`` (rank by rank, each rank's in
    call order: slots, forests in order within one) and ``own``, their tokens as runs (group: the
    unit)."""

    rank: np.ndarray
    slot: np.ndarray
    forest: np.ndarray
    own: Runs

    @classmethod
    def of(cls, plan: Plan) -> StepUnits:
        """The units of ``plan``; refuses a plan that computes a token twice on one rank."""
        keep = plan.piece_end > plan.piece_start
        rank, slot, forest = plan.piece_rank[keep], plan.piece_slot[keep], plan.piece_forest[keep]
        start, end = plan.piece_start[keep], plan.piece_end[keep]
        order = np.lexsort((start, forest, rank))
        overlap = np.flatnonzero(
            (rank[order][1:] == rank[order][:-1])
            & (forest[order][1:] == forest[order][:-1])
            & (start[order][1:] < end[order][:-1])
        )
        if overlap.size:
            at = order[overlap[0]]
            raise ValueError(f"the plan computes some tokens of forest {forest[at]} twice on rank {rank[at]}")
        keys, unit = np.unique(np.stack((rank, slot, forest)), axis=1, return_inverse=True)
        return cls(keys[0], keys[1], keys[2], Runs.of(unit.reshape(-1), start, end))

    @property
    def size(self) -> int:
        return int(self.rank.size)

    def tokens_of(self, unit: int) -> np.ndarray:
        """The own tokens of ``unit`` (sorted)."""
        lo, hi = np.searchsorted(self.own.group, [unit, unit + 1])
        return Runs(self.own.group[lo:hi], self.own.lo[lo:hi], self.own.hi[lo:hi]).tokens()

    def of_forest(self, f: int) -> Runs:
        """The runs of forest ``f``'s units."""
        return self.own.select(self.forest[self.own.group] == f)


@dataclass(frozen=True, eq=False)
class Reads:
    """Reads of context tokens, flat: [n] the ``reader`` unit, the ``token`` and the ``producer``
    unit it resolves to."""

    reader: np.ndarray
    token: np.ndarray
    producer: np.ndarray

    @classmethod
    def concat(cls, parts: list[Reads]) -> Reads:
        none = np.zeros(0, dtype=np.int64)
        return cls(*(np.concatenate([none, *(getattr(p, k) for p in parts)]) for k in ("reader", "token", "producer")))

    def select(self, keep: np.ndarray) -> Reads:
        return Reads(self.reader[keep], self.token[keep], self.producer[keep])


@dataclass(frozen=True, eq=False)
class Coverage:
    """One forest's segments: [S + 1] ``bounds`` (segment s is tokens ``bounds[s]:bounds[s + 1]``,
    from 0 to N), [S] ``first`` (the first unit by slot, then rank, computing it; -1: none), and
    the (rank, segment) pairs computed: [K] ``key`` (rank * S + s, sorted) and the ``unit`` of that
    rank computing it (a rank computes a token once: ``StepUnits.of``)."""

    bounds: np.ndarray
    first: np.ndarray
    key: np.ndarray
    unit: np.ndarray

    @classmethod
    def of(cls, forest: RolloutForest, own: Runs, ranks: np.ndarray, slots: np.ndarray) -> Coverage:
        """The segments of ``own`` (one forest's units' runs; ``ranks``, ``slots`` [U] per unit)."""
        bounds = np.unique(np.concatenate(([0, forest.num_compact_tokens], own.lo, own.hi)))
        segments = bounds.size - 1
        seg, run = covered(bounds, own.lo, own.hi)
        unit = own.group[run]
        key = ranks[unit] * segments + seg
        by_key = np.argsort(key, kind="stable")
        by_order = np.lexsort((ranks[unit], slots[unit], seg))
        first = np.full(segments, -1, dtype=np.int64)
        head = group_firsts(by_order, seg)
        first[seg[head]] = unit[head]
        return cls(bounds, first, key[by_key], unit[by_key])

    @property
    def num_segments(self) -> int:
        return int(self.first.size)

    def segment(self, x: np.ndarray) -> np.ndarray:
        """[n] the segment of each token."""
        return np.searchsorted(self.bounds, x, side="right") - 1

    def _resolve_segments(self, seg: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The unit a read of segment ``seg`` from rank ``rank`` resolves to (-1: none computes it)."""
        query = rank * self.num_segments + seg
        at = np.minimum(np.searchsorted(self.key, query), max(self.key.size - 1, 0))
        local = np.where(self.key[at] == query, self.unit[at], -1) if self.key.size else np.full(seg.size, -1)
        return np.where(local >= 0, local, self.first[seg])

    def resolve(self, x: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """[n] the unit each token ``x`` read from rank ``rank`` ([n] or one) resolves to, -1 if none
        computes it."""
        return self._resolve_segments(self.segment(x), np.broadcast_to(rank, np.shape(x)))

    def resolve_runs(self, runs: Runs, ranks: np.ndarray) -> tuple[Runs, np.ndarray]:
        """``runs`` (group: the reading unit, ``ranks`` [U] where each runs) cut at the segments:
        the pieces as runs (not merged) and [q] the unit each resolves to."""
        first_seg = self.segment(runs.lo)
        count = self.segment(runs.hi - 1) + 1 - first_seg
        seg = aranges(first_seg, count)
        group, lo, hi = (np.repeat(x, count) for x in (runs.group, runs.lo, runs.hi))
        pieces = Runs(group, np.maximum(lo, self.bounds[seg]), np.minimum(hi, self.bounds[seg + 1]))
        return pieces, self._resolve_segments(seg, ranks[group])

    def ranks_computing(self, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which, rank): every rank computing each of the segments ``seg`` [n]."""
        ranks, segs = self.key // self.num_segments, self.key % self.num_segments
        order = np.argsort(segs, kind="stable")
        lo = np.searchsorted(segs[order], seg, side="left")
        hi = np.searchsorted(segs[order], seg, side="right")
        count = hi - lo
        at = aranges(lo, count)
        return np.repeat(np.arange(seg.size), count), ranks[order][at]

"""Token runs: sets of compact indices as sorted, disjoint ``[lo, hi)`` ranges, one set per group.

A plan's pieces are ranges of compact indices and a piece's context is root paths (each a few
node ranges), so the sets a step's compile handles hold millions of tokens in a few runs: set
operations on runs cost the runs, and only the sets a rank needs token by token are expanded.
Several groups (a step's units) share one array: each run is ``group * stride + token`` on one
line, so one sort serves every group.

Legend: Q runs, G groups, N compact tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .forest import RolloutForest
from .trees import path_intervals

__all__ = ["Runs", "aranges", "context_runs", "covered", "entry_tokens", "group_firsts"]


def aranges(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``start[i], ..., start[i] + count[i] - 1`` for every i, concatenated."""
    return np.repeat(start - np.cumsum(count) + count, count) + np.arange(count.sum())


def group_firsts(order: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """The entries of ``order`` (indices sorted by ``keys`` first) where the ``keys`` change: the
    first of each group of equal keys, in the order's tie-break."""
    change = np.zeros(order.size, dtype=bool)
    change[:1] = True
    for key in keys:
        sorted_key = key[order]
        change[1:] |= sorted_key[1:] != sorted_key[:-1]
    return order[change]


def covered(bounds: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment, range): every segment of the line cut at ``bounds`` (sorted, holding every ``lo``
    and ``hi``) that each range ``[lo, hi)`` covers, range by range."""
    first = np.searchsorted(bounds, lo)
    count = np.searchsorted(bounds, hi) - first
    return aranges(first, count), np.repeat(np.arange(lo.size), count)


@dataclass(frozen=True, eq=False)
class Runs:
    """Per group, a set of tokens as runs: [Q] ``group``, ``lo``, ``hi``, sorted by (group, lo),
    disjoint and not touching within a group (touching runs are merged), none empty."""

    group: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def of(cls, group: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> Runs:
        """The union, per group, of the ranges ``[lo, hi)`` (any order, overlapping or empty)."""
        group, lo, hi = (np.asarray(x, dtype=np.int64) for x in (group, lo, hi))
        keep = hi > lo
        group, lo, hi = group[keep], lo[keep], hi[keep]
        if not lo.size:
            return cls(group, lo, hi)
        stride = int(hi.max()) + 1
        order = np.lexsort((lo, group))
        start, end = group[order] * stride + lo[order], group[order] * stride + hi[order]
        reach = np.maximum.accumulate(end)  # the furthest end so far: a run starting past it is new
        new = np.r_[True, start[1:] > reach[:-1]]
        first = np.flatnonzero(new)
        merged_end = np.maximum.reduceat(end, first)
        return cls(group[order][first], lo[order][first], merged_end - group[order][first] * stride)

    @classmethod
    def of_tokens(cls, tokens: np.ndarray, group: int = 0) -> Runs:
        """The runs of sorted, distinct ``tokens`` (one group)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        cut = np.flatnonzero(np.diff(tokens) != 1) + 1
        lo, hi = (
            tokens[np.r_[0, cut]] if tokens.size else tokens,
            tokens[np.r_[cut - 1, -1]] + 1 if tokens.size else tokens,
        )
        return cls(np.full(lo.size, group, dtype=np.int64), lo, hi)

    @property
    def size(self) -> np.ndarray:
        """[Q] tokens of each run."""
        return self.hi - self.lo

    def tokens(self) -> np.ndarray:
        """Every token of every run, in run order (sorted within a group)."""
        return aranges(self.lo, self.size)

    def groups(self) -> np.ndarray:
        """The group of each of :meth:`tokens`."""
        return np.repeat(self.group, self.size)

    def counts(self, num_groups: int) -> np.ndarray:
        """[G] tokens per group."""
        return np.bincount(self.group, weights=self.size, minlength=num_groups).astype(np.int64)

    def select(self, keep: np.ndarray) -> Runs:
        """The runs where ``keep`` [Q] holds."""
        return Runs(self.group[keep], self.lo[keep], self.hi[keep])

    def find(self, group: np.ndarray, x: np.ndarray) -> np.ndarray:
        """[n] the run of ``group``'s set holding each token ``x``, -1 where none does."""
        if not self.lo.size:
            return np.full(np.shape(x), -1, dtype=np.int64)
        stride = max(int(self.hi.max()), int(np.max(x, initial=0)) + 1) + 1
        at = np.searchsorted(self.group * stride + self.lo, group * stride + x, side="right") - 1
        inside = (at >= 0) & (self.group[np.maximum(at, 0)] == group) & (x < self.hi[np.maximum(at, 0)])
        return np.where(inside, at, -1)

    def minus(self, other: Runs) -> Runs:
        """Per group, the tokens of this set outside ``other``'s set of the same group."""
        if not self.lo.size or not other.lo.size:
            return self
        cuts = np.concatenate((self.lo, self.hi, other.lo, other.hi))
        group = np.concatenate((self.group, self.group, other.group, other.group))
        stride = int(cuts.max()) + 1
        points = np.unique(group * stride + cuts)
        lo, hi = points[:-1], points[1:]  # elementary ranges on the line (some span two groups: dropped)
        g, lo, hi = lo // stride, lo % stride, hi - lo // stride * stride
        keep = (hi <= stride - 1) & (self.find(g, lo) >= 0) & (other.find(g, lo) < 0)
        return Runs.of(g[keep], lo[keep], hi[keep])


def context_runs(forest: RolloutForest, own: Runs) -> Runs:
    """Per group of ``own`` (a unit's tokens), its context: the ancestors of its tokens outside it,
    the root paths above its *entry* tokens (those whose parent it lacks: a run's first token or a
    node's first within a run; others follow their predecessor), each ancestor node climbed once
    per group (``trees.path_intervals``)."""
    entry, group = entry_tokens(forest, own)
    parent = forest.prev[entry]
    node = forest.node_of[parent]
    order = np.lexsort((-parent, node, group))  # per (group, node) the deepest parent first: its path holds the others'
    first = group_firsts(order, group, node)
    group, parent, node = group[first], parent[first], node[first]
    which, lo, hi = path_intervals(
        forest.node_start, forest.node_len, forest.node_parent, node, parent + 1, once_per=group
    )
    return Runs.of(group[which], lo, hi).minus(own)


def entry_tokens(forest: RolloutForest, own: Runs) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, group) of every token of ``own`` whose parent is outside its group's set (its
    parent then is context): those a group's handoffs enter at."""
    # Node starts inside each run: a node's tokens are consecutive, so only they and run starts
    # may have a parent elsewhere.
    first = np.searchsorted(forest.node_start, own.lo, side="right")
    last = np.searchsorted(forest.node_start, own.hi, side="left")
    count = np.maximum(last - first, 0)
    inner = forest.node_start[aranges(first, count)]
    tokens = np.concatenate((own.lo, inner))
    group = np.concatenate((own.group, np.repeat(own.group, count)))
    parent = forest.prev[tokens]
    outside = (parent >= 0) & (own.find(group, np.maximum(parent, 0)) < 0)
    order = np.lexsort((tokens[outside], group[outside]))
    return tokens[outside][order], group[outside][order]

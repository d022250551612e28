"""Facts of a tree's shape that the forest, the planner and the ops all read, computed in one place
from parent arrays (``parent[i]``: i's parent, -1 at a root): depths, chains, the min-rounds rule
of linear-attention paths and the replay bound of a path off the chunk grid. Vectorised: one step
per level or per pointer jump."""

from __future__ import annotations

import numpy as np

__all__ = ["chain_starts", "min_rounds", "replay_length", "tree_levels"]


def tree_levels(parent: np.ndarray) -> np.ndarray:
    """Depth of every element of a forest given by ``parent`` (-1 at roots: depth 0), by pointer
    jumping (list ranking): O(n log height), no per-element loop."""
    level = (parent >= 0).astype(np.int64)
    jump = parent.copy()
    while (active := jump >= 0).any():
        up = jump[active]
        level[active] += level[up]
        jump[active] = jump[up]
    return level


def chain_starts(prev: np.ndarray) -> np.ndarray:
    """[N] whether each token (``prev``: its parent, -1 at a root) starts a chain, the maximal
    unbranched runs the trie's nodes are: a root, or a child of a token without exactly one child."""
    children = np.bincount(prev[prev >= 0], minlength=prev.size)
    return (prev < 0) | (children[np.maximum(prev, 0)] != 1)


def min_rounds(parent: np.ndarray, depth: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, deepest) of the subtree under every element: ``rounds`` is the fewest sequential
    rounds its linear-attention paths need (``ops/rounds.py``: a leaf 1; else the largest child
    count, plus one when two children reach it), ``deepest`` the largest ``depth`` in it (the
    tie-break that keeps long trunks in one path; ``depth`` defaults to zeros)."""
    q = parent.size
    r = np.ones(q, dtype=np.int64)
    deep = np.zeros(q, dtype=np.int64) if depth is None else depth.astype(np.int64, copy=True)
    if not q:
        return r, deep
    level = tree_levels(parent)
    by_level = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[by_level], np.arange(level.max() + 2))
    best = np.zeros(q, dtype=np.int64)  # largest child round count
    ties = np.zeros(q, dtype=np.int64)  # children reaching it
    for lvl in range(int(level.max()), 0, -1):
        ch = by_level[bounds[lvl] : bounds[lvl + 1]]
        par = parent[ch]
        np.maximum.at(best, par, r[ch])
        np.add.at(ties, par, r[ch] == best[par])
        r[par] = np.where(ties[par] >= 2, best[par] + 1, best[par])
        np.maximum.at(deep, par, deep[ch])
    return r, deep


def replay_length(depth: np.ndarray, chunk: int) -> np.ndarray:
    """Ancestors a linear-attention path whose first own token sits at ``depth`` replays: it starts
    at the chunk grid below, ``floor(depth / chunk) * chunk``, so fewer than ``chunk`` (the bounded
    replay: what a cut off the grid costs the planner, what the ops compute)."""
    return depth % chunk

"""Facts of a tree's shape that the forest, the planner and the ops all read, computed in one place
from parent arrays (``parent[i]``: i's parent, -1 at a root): depths, chains, root paths as node
intervals, the min-rounds rule of linear-attention paths and the replay bound of a path off the
chunk grid. Vectorised: one step per level or per pointer jump."""

from __future__ import annotations

import numpy as np

__all__ = ["by_level", "chains", "min_rounds", "path_intervals", "replay_length", "tree_levels"]


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


def by_level(level: np.ndarray) -> list[np.ndarray]:
    """The elements of every level (``level``: each element's, e.g. ``tree_levels``), root level
    first, each in index order: the steps of a walk down (or, reversed, up) a tree, one per level."""
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(level.max(initial=-1) + 2))
    return [order[bounds[k] : bounds[k + 1]] for k in range(bounds.size - 1)]


def _chain_starts(prev: np.ndarray) -> np.ndarray:
    """[N] whether each token (``prev``: its parent, -1 at a root) starts a chain, the maximal
    unbranched runs the trie's nodes are: a root, or a child of a token without exactly one child."""
    up = prev + 1  # one index array for the count and the gather (0: a root's, read by no child);
    # at 50M tokens every [N] temporary is fresh memory the kernel faults in, as costly as the work
    children = np.bincount(up, minlength=prev.size + 1)
    return (children[up] != 1) | (prev < 0)


def chains(prev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node_of [N], start [M], node_parent [M]): the chain (node) of every token, the first token of
    every chain and the chain holding its parent (-1 at a root), chains numbered by first token.
    A chain's tokens need not be contiguous (in a piece, a subtree hanging under context may sit in
    between), so they are found by pointer jumping, unless they are (a forest in DFS order): then
    one cumulative sum."""
    starts = _chain_starts(prev)
    start = np.flatnonzero(starts)
    node_id = np.cumsum(starts)
    node_id -= 1
    before = np.arange(-1, prev.size - 1)
    if (starts | (prev == before)).all():  # every chain a contiguous run
        node_of = node_id
    else:  # link: the token before each in its chain, a start itself
        node_of = node_id[_chain_heads(np.where(starts, before + 1, prev))]
    parent_tok = prev[start]
    node_parent = np.where(parent_tok >= 0, node_of[np.maximum(parent_tok, 0)], -1)
    return node_of, start, node_parent


def _chain_heads(link: np.ndarray) -> np.ndarray:
    """The head of every element of chains given by ``link`` (a head links to itself), by pointer
    jumping: O(n log length) vectorised steps."""
    head = link.copy()
    while not np.array_equal(nxt := head[head], head):
        head = nxt
    return head


def path_intervals(
    start: np.ndarray,
    length: np.ndarray,
    parent: np.ndarray,
    node: np.ndarray,
    tip: np.ndarray,
    *,
    once_per: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Root paths as token intervals, one per node, climbed one node per vectorised step.

    Nodes are contiguous token ranges ``start:start + length`` under ``parent`` (-1 at a root);
    query i is the path of node ``node[i]``'s tokens before ``tip[i]`` and every ancestor node
    whole. Returns ``(which, lo, hi)``: query ``which[j]`` holds tokens ``lo[j]:hi[j]``, in climbing
    order (the queries' own nodes first), empty intervals dropped. ``once_per`` [n] (each query's
    group) asks for each group's union only: an ancestor node is climbed once per group, by one
    of its queries that reaches it, so the work is the unions' size, not the sum of the paths (a
    piece's context costs its own size, not the forest's).
    """
    idx, v = np.arange(node.size), node
    which, lo, hi = [idx], [start[node]], [tip]
    visited = np.zeros(0, dtype=np.int64)  # group * nodes + node, sorted
    while idx.size:
        up = parent[v] >= 0
        idx, v = idx[up], parent[v[up]]
        if once_per is not None:
            key, first = np.unique(once_per[idx] * start.size + v, return_index=True)
            fresh = ~np.isin(key, visited, assume_unique=True)
            idx, v = idx[first[fresh]], v[first[fresh]]
            visited = np.union1d(visited, key[fresh])
        which.append(idx)
        lo.append(start[v])
        hi.append(start[v] + length[v])
    which, lo, hi = (np.concatenate(x) for x in (which, lo, hi))
    keep = hi > lo
    return which[keep], lo[keep], hi[keep]


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
    best = np.zeros(q, dtype=np.int64)  # largest child round count
    ties = np.zeros(q, dtype=np.int64)  # children reaching it
    for ch in by_level(tree_levels(parent))[:0:-1]:
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

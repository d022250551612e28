"""Assemble trajectories from *spans*: ranges of a token pool that trajectories share.

Generators describe every trajectory as an ordered list of spans (system prompt, task text,
tool call, tree node, ...). Two trajectories that list the same span share its tokens, which
is how a generator says "these prefixes are identical" without copying token arrays by hand.

Legend: S spans, B trajectories, T total trajectory tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["assemble", "node_pool", "tree_paths"]


def assemble(
    pool: np.ndarray,
    traj: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    trained: np.ndarray,
    num_traj: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and loss masks of ``num_traj`` trajectories.

    Args:
        pool: [pool size] int64 token ids.
        traj: [S] trajectory of each span; a trajectory's spans appear in order (a stable sort
            by ``traj`` keeps them in order).
        start, length: [S] pool range of each span (zero-length spans are allowed).
        trained: [S] loss-mask value of each span's tokens.
    """
    order = np.argsort(traj, kind="stable")
    traj, start, length, trained = traj[order], start[order], length[order], trained[order]
    total = int(length.sum())
    span_off = np.cumsum(length) - length  # [S] offset of each span in the flat layout
    flat = np.repeat(start - span_off, length) + np.arange(total)  # [T] pool index
    ids = pool[flat]
    mask = np.repeat(trained.astype(bool), length)
    lengths = np.bincount(traj, weights=length, minlength=num_traj).astype(np.int64)
    if (lengths == 0).any():
        raise ValueError(f"trajectory {int(np.flatnonzero(lengths == 0)[0])} has no tokens")
    cuts = np.cumsum(lengths)[:-1]
    return np.split(ids, cuts), np.split(mask, cuts)


def tree_paths(parent: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Root-to-end node paths of a tree given by ``parent`` (-1 at roots).

    Returns ``(traj, node)`` [sum of path lengths]: path i lists its nodes root first. One
    vectorised step per tree level.
    """
    chain = [ends]
    while (chain[-1] >= 0).any():
        cur = chain[-1]
        chain.append(np.where(cur >= 0, parent[np.maximum(cur, 0)], -1))  # -1 past the root
    nodes = np.stack(chain[-2::-1], axis=1)  # [num ends, levels], left-padded with -1
    keep = nodes >= 0
    traj = np.broadcast_to(np.arange(ends.size)[:, None], nodes.shape)[keep]
    return traj, nodes[keep]


def node_pool(
    rng: np.random.Generator, parent: np.ndarray, node_len: np.ndarray, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens for tree nodes whose siblings start with distinct tokens.

    Distinct first tokens make the tree exactly the given one (siblings never merge in the
    prefix forest). Returns ``(pool, start)``: node v owns ``pool[start[v] : start[v] + node_len[v]]``.
    """
    order = np.argsort(parent, kind="stable")
    group_first = np.flatnonzero(np.r_[True, parent[order][1:] != parent[order][:-1]])
    group_size = np.diff(np.r_[group_first, order.size])
    if group_size.max() > vocab:
        raise ValueError(f"{group_size.max()} siblings cannot start with distinct tokens of a vocab of {vocab}")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size) - np.repeat(group_first, group_size)
    base = np.repeat(rng.integers(0, vocab, group_first.size), group_size)
    first = np.empty(order.size, dtype=np.int64)
    first[order] = (base + rank[order]) % vocab
    start = np.cumsum(node_len) - node_len
    pool = rng.integers(0, vocab, int(node_len.sum()))
    pool[start] = first
    return pool, start

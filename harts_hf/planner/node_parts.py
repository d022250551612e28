"""Microbatches as node parts: their linear-attention rounds, entries and handoff replay.

A *node part* is the part of one node inside one piece. Inside a microbatch a node part hangs
under the node part holding its parent token; when that token lies in an earlier microbatch the
node part starts an *external* path (an entry): its state and context come from earlier slots.

Rounds follow ``harts_hf.ops.rounds``: r(leaf) = 1 and r(x) = the largest child round count, plus
one when two children reach it; a microbatch needs the maximum over its node parts.

Legend: P pieces, Q node parts, B microbatches, C chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trees import min_rounds
from .geometry import Geometry

__all__ = ["NodeParts", "node_parts_of"]


@dataclass(frozen=True, eq=False)
class NodeParts:
    """Node parts of a set of pieces.

    Args:
        piece, mb, lo, hi: [Q] piece, microbatch and global token range of every node part.
        parent: [Q] node part holding the parent token in the same microbatch, -1 if none.
        parent_token: [Q] global parent token of the node part's first token (-1 at a tree root).
        rounds: [B] rounds of every microbatch (0 when empty).
    """

    piece: np.ndarray
    mb: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    parent: np.ndarray
    parent_token: np.ndarray
    rounds: np.ndarray

    @property
    def external(self) -> np.ndarray:
        """[Q] node parts whose first token is an entry (parent token in an earlier microbatch)."""
        return (self.parent < 0) & (self.parent_token >= 0)


def find_in(keys_lo: np.ndarray, keys_hi: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Index of the sorted, disjoint key range [lo, hi) holding each query, -1 if none."""
    i = np.searchsorted(keys_lo, query, side="right") - 1
    ok = (i >= 0) & (query < keys_hi[np.maximum(i, 0)])
    return np.where(ok, i, -1)


def node_parts_of(geo: Geometry, mb: np.ndarray, lo: np.ndarray, hi: np.ndarray, num_mb: int) -> NodeParts:
    """Node parts of pieces ``lo:hi`` (global tokens) in microbatches ``mb``, sorted by (mb, lo)."""
    first, last = geo.node_of(lo), geo.node_of(hi - 1)
    count = last - first + 1
    piece = np.repeat(np.arange(lo.size), count)
    v = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    s_lo = np.maximum(geo.start[v], lo[piece])
    s_hi = np.minimum(geo.start[v] + geo.length[v], hi[piece])
    s_mb = mb[piece]
    pt = geo.parent_token(s_lo)
    stride = geo.num_tokens + 1
    key = s_mb * stride + s_lo
    order = np.argsort(key, kind="stable")
    piece, v, s_lo, s_hi, s_mb, pt, key = (a[order] for a in (piece, v, s_lo, s_hi, s_mb, pt, key))
    parent = find_in(key, s_mb * stride + s_hi, s_mb * stride + pt)
    parent = np.where(pt >= 0, parent, -1)
    r, _ = min_rounds(parent)
    rounds = np.zeros(num_mb, dtype=np.int64)
    np.maximum.at(rounds, s_mb, r)
    return NodeParts(piece, s_mb, s_lo, s_hi, parent, pt, rounds)

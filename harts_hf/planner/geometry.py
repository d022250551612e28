"""Node-level geometry of one or more forests in one global DFS index space.

The planner never reads per-token arrays: a node's tokens are consecutive in DFS order with
depths rising by one, so a token's node and depth, the cost of any DFS range, the token where a
cost is reached and a token's root path (as node intervals) all follow from the node arrays in
O(log M) per query. Planning time therefore grows with nodes, not with compact tokens.

Global indices: forest f's token k is ``forest_tokens[f] + k``; its node v is
``forest_nodes[f] + v``. The concatenation keeps every forest's DFS pre-order, so subtree
intervals stay intervals.

Legend: F forests, M nodes (all forests), N compact tokens (all forests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..forest import RolloutForest
from ..trees import path_intervals
from .cost import CostModel

__all__ = ["Geometry"]


@dataclass(frozen=True, eq=False)
class Geometry:
    """Node arrays of the concatenated forests and the token weights of a cost model.

    A token at depth p weighs ``a + b * (p + 1)``: one compact token plus the p + 1 keys its
    attention query reads (ancestors and itself), whatever piece it lands in.

    Args:
        forest_tokens, forest_nodes: [F + 1] global offsets of each forest's tokens and nodes.
        start, length, depth: [M] first global token, token count and depth of each node's chain.
        parent: [M] global parent node, -1 at a root. end: [M] exclusive end of the node's subtree.
        level: [M] node depth (0 at roots). root: [M] root node of each node's tree.
        cum: [M + 1] cost of the tokens of nodes before each node (DFS order).
        a, b: the cost model's per-token and per-attended-pair coefficients.
    """

    forest_tokens: np.ndarray
    forest_nodes: np.ndarray
    start: np.ndarray
    length: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    end: np.ndarray
    level: np.ndarray
    root: np.ndarray
    cum: np.ndarray
    a: float
    b: float

    @classmethod
    def of(cls, forests: Sequence[RolloutForest], cost: CostModel) -> Geometry:
        tok_off = np.concatenate(([0], np.cumsum([f.num_compact_tokens for f in forests])))
        node_off = np.concatenate(([0], np.cumsum([f.num_nodes for f in forests])))

        def cat(get, shift):
            return np.concatenate([get(f) + s for f, s in zip(forests, shift)])

        zeros = np.zeros(len(forests), dtype=np.int64)
        start = cat(lambda f: f.node_start, tok_off[:-1])
        parent = cat(lambda f: f.node_parent, zeros)
        parent = np.where(parent >= 0, parent + np.repeat(node_off[:-1], np.diff(node_off)), -1)
        depth = cat(lambda f: f.position[f.node_start], zeros)
        end = cat(lambda f: f.subtree_end[f.node_start], tok_off[:-1])
        level = cat(lambda f: f.node_level, zeros)
        length = cat(lambda f: f.node_len, zeros)
        roots = np.flatnonzero(parent < 0)
        root = roots[np.searchsorted(roots, np.arange(start.size), side="right") - 1]
        a, b = float(cost.token), float(cost.pair)
        own = a * length + b * (length * (depth + 1) + length * (length - 1) / 2)  # [M]
        cum = np.concatenate(([0.0], np.cumsum(own)))
        return cls(tok_off, node_off, start, length, depth, parent, end, level, root, cum, a, b)

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return int(self.forest_tokens[-1])

    @property
    def num_nodes(self) -> int:
        return int(self.start.size)

    @property
    def total_cost(self) -> float:
        return float(self.cum[-1])

    @property
    def node_cost(self) -> np.ndarray:
        """[M] cost of each node's own chain."""
        return np.diff(self.cum)

    # ------------------------------------------------------------------ tokens
    def node_of(self, t: np.ndarray) -> np.ndarray:
        """Node holding each global token t (t < N)."""
        return np.searchsorted(self.start, t, side="right") - 1

    def token_depth(self, t: np.ndarray) -> np.ndarray:
        v = self.node_of(t)
        return self.depth[v] + t - self.start[v]

    def parent_token(self, t: np.ndarray) -> np.ndarray:
        """Previous token on each token's root path, -1 at a root."""
        v = self.node_of(t)
        pv = self.parent[v]
        last = self.start[np.maximum(pv, 0)] + self.length[np.maximum(pv, 0)] - 1
        return np.where(t > self.start[v], t - 1, np.where(pv >= 0, last, -1))

    def _partial(self, v: np.ndarray, k) -> np.ndarray:
        """Cost of the first k tokens of node v."""
        return self.a * k + self.b * (k * (self.depth[v] + 1) + k * (k - 1) / 2)

    def prefix(self, t: np.ndarray) -> np.ndarray:
        """Cost of global tokens [0, t), for 0 <= t <= N."""
        t = np.asarray(t, dtype=np.int64)
        v = np.clip(self.node_of(t), 0, self.num_nodes - 1)
        k = np.minimum(t - self.start[v], self.length[v])
        return self.cum[v] + self._partial(v, k)

    def token_at(self, x: np.ndarray) -> np.ndarray:
        """Fractional global token index where the prefix cost reaches x (inverse of prefix)."""
        x = np.asarray(x, dtype=np.float64)
        v = np.clip(np.searchsorted(self.cum, x, side="right") - 1, 0, self.num_nodes - 1)
        rem = np.maximum(x - self.cum[v], 0.0)
        beta = self.a + self.b * (self.depth[v] + 0.5)  # f(k) = b/2 k^2 + beta k
        k = 2 * rem / (beta + np.sqrt(beta * beta + 2 * self.b * rem))  # stable root of f(k) = rem
        return self.start[v] + np.minimum(k, self.length[v])

    def on_grid(self, t: np.ndarray, chunk: int) -> np.ndarray:
        """Cuts ``t`` moved down to the chunk grid (depth a multiple of ``chunk``) where their node
        reaches it, else left as they are: a path starting there replays nothing (``ops.rounds``)."""
        node, depth = self.node_of(t), self.token_depth(t)
        down = t - depth % chunk
        return np.where((down >= self.start[node]) & (down > 0), down, t)

    def path_cost(self, d: np.ndarray) -> np.ndarray:
        """Cost of a root path of d tokens (depths 0 .. d - 1): what replicating a context costs."""
        d = np.asarray(d, dtype=np.float64)
        return self.a * d + self.b * d * (d + 1) / 2

    def path_intervals(self, t: np.ndarray, *, inclusive: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The strict ancestors (or ancestors-or-self) of each token t as node-chain intervals.

        Returns ``(which, lo, hi)``: token ``t[which[i]]`` has ancestors ``lo[i]:hi[i]`` (global
        tokens); one interval per node on its root path, empty ones dropped (``trees.path_intervals``).
        """
        t = np.asarray(t, dtype=np.int64)
        return path_intervals(self.start, self.length, self.parent, self.node_of(t), t + inclusive)

    def common_prefix(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Length of the common prefix of the root paths of tokens x and y (ancestor-or-self):
        lift the deeper node until both meet, tracking the last shared token of each side."""
        vx, vy = self.node_of(x), self.node_of(y)
        tx, ty = np.array(x, dtype=np.int64), np.array(y, dtype=np.int64)
        same_tree = self.root[vx] == self.root[vy]
        while (diff := same_tree & (vx != vy)).any():
            lx, ly = self.level[vx], self.level[vy]
            mx, my = diff & (lx >= ly), diff & (ly >= lx)
            px, py = self.parent[vx], self.parent[vy]
            tx = np.where(mx, self.start[px] + self.length[px] - 1, tx)
            ty = np.where(my, self.start[py] + self.length[py] - 1, ty)
            vx, vy = np.where(mx, px, vx), np.where(my, py, vy)
        return np.where(same_tree, np.minimum(tx, ty) - self.start[vx] + self.depth[vx] + 1, 0)

    def paths_union(self, t: np.ndarray, group: np.ndarray, count: int) -> np.ndarray:
        """[count] tokens on the union of the root paths (each token ``t`` [E] itself excluded) of
        every ``group`` [E]: a microbatch's context where ``t`` are its entries (a node part's first
        token whose parent lies outside it; for DFS ranges their first tokens do: every ancestor
        outside a range lies on its first token's root path). Taken in DFS order, a path adds what
        lies past its common prefix with the one before (root paths part once and never meet
        again), so the work is the entries', not their paths' (the square of a deep chain)."""
        order = np.lexsort((t, group))
        t, group = t[order], group[order]
        depth = self.token_depth(t)  # [E] tokens on each root path, the token excluded
        after = np.flatnonzero(group[1:] == group[:-1]) + 1  # entries after another of their group
        shared = np.minimum(self.common_prefix(t[after - 1], t[after]), np.minimum(depth[after - 1], depth[after]))
        return np.bincount(group, weights=depth, minlength=count).astype(np.int64) - np.bincount(
            group[after], weights=shared, minlength=count
        ).astype(np.int64)

    # ------------------------------------------------------------------ forests
    def forest_of(self, t: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.forest_tokens, t, side="right") - 1

    def local(self, t: np.ndarray) -> np.ndarray:
        """Forest-local compact index of global token t."""
        return t - self.forest_tokens[self.forest_of(t)]

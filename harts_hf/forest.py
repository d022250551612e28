"""RolloutForest: a prefix forest (radix trie) of rollout token sequences.

Every distinct non-empty prefix of the input trajectories is one *compact token*. Compact
tokens are laid out in DFS pre-order (children in increasing token order), which is exactly
the order in which the new suffixes of the lexicographically sorted trajectories appear. That
observation makes the build a sort plus one longest-common-prefix pass, all vectorised.

Legend: N compact tokens, M nodes (maximal unbranched chains), B trajectories,
T total trajectory tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from hashlib import blake2b

import numpy as np

from .trees import by_level, tree_levels

__all__ = ["RolloutForest", "sorted_unique", "trie_order"]


def trie_order(seqs: Sequence[np.ndarray]) -> np.ndarray:
    """Indices of ``seqs`` (non-negative ids) in lexicographic order, a prefix before its
    extensions: the order of their leaves in the trie's DFS pre-order."""
    keys = _trie_keys([np.asarray(s, dtype=np.int64) for s in seqs])
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def _trie_keys(arrays: list[np.ndarray]) -> list[bytes]:
    """Big-endian bytes of every array (non-negative int64 ids): they compare like the ids. The fewest
    bytes a token that every id fits (2, 4 or 8) shrink the copies; one buffer takes every byteswap."""
    top = max((int(a.max()) for a in arrays if a.size), default=0)
    width = next(w for w in (">u2", ">u4", ">u8") if top < 1 << 8 * int(w[-1]))
    buf = np.empty(max(a.size for a in arrays), dtype=width)
    keys = []
    for a in arrays:
        np.copyto(buf[: a.size], a, casting="unsafe")
        keys.append(buf[: a.size].tobytes())
    return keys


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` (int64) by a sort, skipped where ``x`` is already strictly increasing (a plan's
    compact indices: ranges in DFS order): numpy 2.4's ``np.unique`` hashes first, about 6x slower
    on the millions of keys of a step's cross-rank handoffs."""
    x = np.asarray(x, dtype=np.int64)
    if x.size < 2 or bool((x[1:] > x[:-1]).all()):
        return x
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]]


def _as_ids(seq, i: int) -> np.ndarray:
    """One trajectory as a 1-D int64 array; refuses what is not a sequence of token ids."""
    try:
        arr = np.asarray(seq)
    except (ValueError, OverflowError) as err:  # ragged nesting
        raise ValueError(f"trajectory {i}: expected a flat sequence of token ids ({err})") from err
    if arr.ndim != 1:
        hint = ": pass a list of trajectories, e.g. [seq], not one flat list of ids" if arr.ndim == 0 else ""
        raise ValueError(f"trajectory {i}: expected a 1-D sequence of token ids, got shape {arr.shape}{hint}")
    if arr.dtype == object and all(isinstance(t, int) for t in arr):
        raise ValueError(f"trajectory {i}: token id {max(arr)} does not fit in int64")
    if arr.size == 0:
        raise ValueError(f"trajectory {i} is empty: every trajectory needs at least one token")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"trajectory {i}: token ids must be integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:  # a reduction, no [len] temporary
        neg = np.flatnonzero(arr < 0)
        raise ValueError(f"trajectory {i}, position {neg[0]}: negative token id {arr[neg[0]]}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"trajectory {i}: token id {arr.max()} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def _as_mask(mask, i: int, length: int) -> np.ndarray:
    arr = np.asarray(mask)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(
            f"loss mask {i} has shape {arr.shape} but trajectory {i} has {length} tokens: give one mask value per token"
        )
    if arr.dtype != bool and not (arr.dtype.kind in "iuf" and np.isin(arr, (0, 1)).all()):
        raise ValueError(
            f"loss mask {i} must hold booleans or 0/1 (got {arr.dtype} values such as {arr[~np.isin(arr, (0, 1))][:3]}): "
            "give a token mask, not labels"
        )
    return arr.astype(bool, copy=False)


def _common_prefix(a: bytes, b: bytes, width: int) -> int:
    """Tokens two trie keys (``_trie_keys``, ``width`` bytes a token) share: equality needs no byteswap,
    so they are compared as native unsigned words."""
    n = min(len(a), len(b)) // width
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    diff = np.flatnonzero(np.frombuffer(a, kind, n) != np.frombuffer(b, kind, n))
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True, eq=False)
class RolloutForest:
    """Prefix forest of trajectories; build it with :meth:`from_sequences`.

    Token arrays (length N, DFS pre-order): ``tokens``, ``position`` (depth, the position the
    token has in every trajectory through it), ``prev`` (previous token on the root path, -1 at
    a root), ``multiplicity`` (trajectories through the token), ``subtree_end`` (exclusive end of
    the token's subtree: k is an ancestor-or-self of q iff ``k <= q < subtree_end[k]``),
    ``node_of`` (node index of each token).

    Node arrays (length M, DFS pre-order): ``node_start``, ``node_len``, ``node_parent``,
    ``node_level`` (0 for roots), and the DFS interval ``node_tin``/``node_tout`` (node indices:
    node a is an ancestor-or-self of node b iff ``node_tin[a] <= b < node_tout[a]``).

    Trajectory arrays: ``traj_offsets`` [B + 1] (CSR offsets into the restore index) and
    ``restore`` [T]: the compact index of trajectory i's token t is
    ``restore[traj_offsets[i] + t]``. ``loss_mask`` [T] (bool) is carried along when given.
    """

    tokens: np.ndarray
    position: np.ndarray
    prev: np.ndarray
    multiplicity: np.ndarray
    subtree_end: np.ndarray
    node_of: np.ndarray
    node_start: np.ndarray
    node_len: np.ndarray
    node_parent: np.ndarray
    node_level: np.ndarray
    node_tin: np.ndarray
    node_tout: np.ndarray
    traj_offsets: np.ndarray
    restore: np.ndarray
    loss_mask: np.ndarray | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls,
        seqs: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[bool]] | None = None,
        *,
        share_prefixes: bool = True,
    ) -> RolloutForest:
        """Build the forest of ``seqs`` (token id sequences) in time linear in their total length.

        ``loss_masks`` (optional, one per trajectory, same lengths) is stored per trajectory
        token: the trie is keyed by token ids only. ``share_prefixes=False`` makes every
        trajectory its own root (trajectory-wise training on the same kernels: the baseline).
        """
        if isinstance(seqs, np.ndarray) and seqs.ndim == 2 or not isinstance(seqs, Sequence | np.ndarray):
            seqs = list(seqs)  # rows of a 2-D array; an iterator
        if len(seqs) == 0:
            raise ValueError("no sequences: a RolloutForest needs at least one trajectory")
        arrays = [_as_ids(s, i) for i, s in enumerate(seqs)]
        masks = None
        if loss_masks is not None:
            if len(loss_masks) != len(arrays):
                raise ValueError(f"got {len(loss_masks)} loss masks for {len(arrays)} trajectories")
            masks = [_as_mask(m, i, a.size) for i, (m, a) in enumerate(zip(loss_masks, arrays))]

        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        lcp = np.zeros(len(arrays), dtype=np.int64)
        if share_prefixes:
            keys = _trie_keys(arrays)
            width = len(keys[0]) // arrays[0].size
            order = np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
            for r in range(1, len(order)):
                lcp[r] = _common_prefix(keys[order[r - 1]], keys[order[r]], width)
            del keys
        else:
            order = np.arange(len(arrays))

        new_count = lengths[order] - lcp  # compact tokens each sorted trajectory adds
        new_offset = np.concatenate(([0], np.cumsum(new_count)))
        num_compact = int(new_offset[-1])
        traj_offsets = np.concatenate(([0], np.cumsum(lengths)))

        # Sorted row r is trajectory order[r]; it adds compact tokens new_offset[r]:new_offset[r + 1]
        # (its depths from lcp[r] on) and its first lcp[r] tokens are those of row r - 1: the restore
        # index is written in the caller's order, a slice copy and a ramp per row. At 50M compact
        # tokens every [N] or [T] array is fresh memory the kernel faults in, as costly as the work:
        # each is written once, in place, and no temporary of that size is made.
        restore = np.empty(int(traj_offsets[-1]), dtype=np.int64)  # [T]
        tokens = np.empty(num_compact, dtype=np.int64)
        position = np.empty(num_compact, dtype=np.int64)
        ramp = np.arange(int(lengths.max()), dtype=np.int64)
        src = 0
        for i, k, lo, n in zip(order.tolist(), lcp.tolist(), new_offset.tolist(), lengths[order].tolist()):
            dst = int(traj_offsets[i])
            restore[dst : dst + k] = restore[src : src + k]
            np.add(ramp[: n - k], lo, out=restore[dst + k : dst + n])
            tokens[lo : lo + n - k] = arrays[i][k:]
            position[lo : lo + n - k] = ramp[k:n]
            src = dst
        # A new token's parent is the compact token before it, except at a row's first new
        # token: its parent is the row's last shared token (none at depth 0).
        prev = np.arange(-1, num_compact - 1)
        adds = np.flatnonzero(new_count > 0)
        first = new_offset[adds]  # [A] each adding row's first new token, increasing
        last_shared = restore[traj_offsets[order[adds]] + np.maximum(lcp[adds] - 1, 0)]
        prev[first] = np.where(lcp[adds] > 0, last_shared, -1)

        nodes = cls._nodes(prev, first)
        node_len = nodes["node_len"]
        # A chain's tokens share their subtree; a trajectory passes through a token iff it ends in
        # the token's subtree: one value per run of a chain between trajectory ends, then repeated.
        node_end = np.append(nodes["node_start"], num_compact)[nodes["node_tout"]]  # [M]
        subtree_end = np.repeat(node_end, node_len)
        ends = np.sort(restore[traj_offsets[1:] - 1])  # [B] each trajectory's last compact token
        runs = np.union1d(nodes["node_start"], ends[ends < num_compact - 1] + 1)
        run_node = np.searchsorted(nodes["node_start"], runs, side="right") - 1
        through = np.searchsorted(ends, node_end[run_node]) - np.searchsorted(ends, runs)
        multiplicity = np.repeat(through, np.diff(np.append(runs, num_compact)))
        loss_mask = np.concatenate(masks) if masks is not None else None
        return cls(
            tokens=tokens,
            position=position,
            prev=prev,
            multiplicity=multiplicity,
            subtree_end=subtree_end,
            node_of=np.repeat(np.arange(node_len.size), node_len),
            **nodes,
            traj_offsets=traj_offsets,
            restore=restore,
            loss_mask=loss_mask,
        )

    @staticmethod
    def _nodes(prev: np.ndarray, first: np.ndarray) -> dict:
        """The trie's nodes (chains: contiguous in DFS order) with their lengths, levels and DFS
        intervals (``node_tout``: one past the last node of the subtree, bottom-up by level).

        ``first`` (increasing): the roots and the first new token of each sorted trajectory. Every
        other token's parent is the token before it, so only the parents of ``first`` can branch,
        and the chains follow from those few tokens (``trees.chains`` reads every token, with [N]
        temporaries)."""
        up = prev[first]
        hub, hung = np.unique(up[up >= 0], return_counts=True)  # parents of ``first``, children there
        runs_on = ~np.isin(hub + 1, first)  # the token after a hub is its child too, unless in ``first``
        fork = hung + runs_on >= 2
        node_start = np.union1d(first[(up < 0) | np.isin(up, hub[fork])], hub[fork & runs_on] + 1)
        node_len = np.diff(np.append(node_start, prev.size))
        parent_tok = prev[node_start]
        node_parent = np.searchsorted(node_start, parent_tok, side="right") - 1
        node_parent[parent_tok < 0] = -1
        level = tree_levels(node_parent)
        node_tout = np.arange(1, node_start.size + 1)
        for ch in by_level(level)[:0:-1]:  # deepest first
            np.maximum.at(node_tout, node_parent[ch], node_tout[ch])
        return {
            "node_start": node_start,
            "node_len": node_len,
            "node_parent": node_parent,
            "node_level": level,
            "node_tin": np.arange(node_start.size),
            "node_tout": node_tout,
        }

    # ------------------------------------------------------------------ statistics
    @property
    def num_trajectories(self) -> int:
        return self.traj_offsets.size - 1

    @property
    def num_trajectory_tokens(self) -> int:
        return int(self.traj_offsets[-1])

    @property
    def num_compact_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def compression(self) -> float:
        """Trajectory tokens per compact token: the work prefix sharing saves, at best."""
        return self.num_trajectory_tokens / self.num_compact_tokens

    @property
    def height(self) -> int:
        """Number of node levels on the deepest root-to-leaf path."""
        return int(self.node_level.max()) + 1

    @cached_property
    def lengths(self) -> np.ndarray:
        """[B] length of each trajectory."""
        return np.diff(self.traj_offsets)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    @cached_property
    def shape_digest(self) -> str:
        """A fingerprint of the forest's shape (parent links and trajectories, not token ids): what a
        plan is valid for, so that a plan made for another forest is refused instead of misapplied.
        The nodes (start, parent) fix every parent link and a trajectory is the root path to its last
        compact token, so those few arrays say it all (hashing every token took seconds at 50M)."""
        digest = blake2b(digest_size=16)
        last = self.restore[self.traj_offsets[1:] - 1]  # [B] each trajectory's last compact token
        for arr in (self.node_start, self.node_parent, self.traj_offsets, last):
            digest.update(np.ascontiguousarray(arr, dtype=np.int64))
        return digest.hexdigest()

    @property
    def num_leaves(self) -> int:
        """Nodes without children (every trajectory ends in a leaf or inside a chain)."""
        has_child = np.zeros(self.num_nodes, dtype=bool)
        has_child[self.node_parent[self.node_parent >= 0]] = True
        return int((~has_child).sum())

    @cached_property
    def roots(self) -> np.ndarray:
        """Compact indices of the root tokens (depth 0): the root nodes' first tokens."""
        return self.node_start[self.node_parent < 0]

    @property
    def num_pairs(self) -> int:
        """(predictor, target) pairs: every non-root token is one's target."""
        return self.num_compact_tokens - int(self.roots.size)

    # ------------------------------------------------------------------ trajectories back
    def multiplicity_of(self, trajectories: np.ndarray) -> np.ndarray:
        """[N] how many of ``trajectories`` (indices; one repeated counts as often) pass through each
        compact token (``multiplicity`` counts them all once)."""
        copies = np.bincount(trajectories, minlength=self.num_trajectories)[self._traj_row]  # [T]
        return np.bincount(self.restore, weights=copies, minlength=self.num_compact_tokens).astype(np.int64)

    def trajectory_index(self, i: int) -> np.ndarray:
        """[len_i] compact index of each token of trajectory i."""
        if not 0 <= i < self.num_trajectories:
            raise IndexError(f"trajectory {i} out of range for {self.num_trajectories} trajectories")
        return self.restore[self.traj_offsets[i] : self.traj_offsets[i + 1]]

    def trajectory(self, i: int) -> np.ndarray:
        """Token ids of trajectory i, exactly as given to :meth:`from_sequences`."""
        return self.tokens[self.trajectory_index(i)]

    def trajectories(self) -> list[np.ndarray]:
        tok = self.tokens[self.restore]
        return np.split(tok, self.traj_offsets[1:-1])

    def padded(self, values: np.ndarray, fill=0) -> np.ndarray:
        """[B, max_len] a per-trajectory-token array (length T) in padded trajectory layout."""
        values = np.asarray(values)
        if values.shape[:1] != (self.num_trajectory_tokens,):
            raise ValueError(
                f"padded takes one value per trajectory token ({self.num_trajectory_tokens}), got shape {values.shape}"
            )
        out = np.full((self.num_trajectories, self.max_length), fill, dtype=values.dtype)
        out[self._traj_row, self._traj_col] = values
        return out

    @cached_property
    def _traj_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_trajectories), self.lengths)

    @cached_property
    def _traj_col(self) -> np.ndarray:
        return np.arange(self.num_trajectory_tokens) - self.traj_offsets[self._traj_row]

    def pair_number(self, tokens: np.ndarray) -> np.ndarray:
        """The number of the (predictor, target) pair whose target is each of ``tokens``, pairs
        numbered in forest order (every non-root token is one; at a root, the number of the pair
        before it, -1 before the first). From the roots, not a pass over the forest: a rank asks
        for its own tokens' pairs."""
        return tokens - np.searchsorted(self.roots, tokens, side="right")

    @cached_property
    def logprob_targets(self) -> tuple[np.ndarray, np.ndarray]:
        """``(target, valid)`` [B, max_len - 1]: column t of row i is the log-prob of the compact
        token ``target[i, t]`` (the trajectory's token t + 1, predicted by ``prev`` of it) where
        ``valid[i, t]``; 0 elsewhere."""
        target = self.padded(self.restore, fill=0)[:, 1:]
        valid = self.padded(np.ones(self.num_trajectory_tokens, dtype=bool), fill=False)[:, 1:]
        return np.where(valid, target, 0), valid

    @cached_property
    def logprob_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where per-trajectory log-probs come from, in the ``[B, max_len - 1]`` layout.

        Returns ``(predictor, target, valid)``: column t of row i is
        ``log_softmax(logits[predictor[i, t]])[target[i, t]]`` where ``valid[i, t]``. A branch
        point's last token predicts a different next token for each child: the same compact
        predictor index appears once per child, never a duplicated compact token.
        """
        target, valid = self.logprob_targets
        return np.where(valid, self.prev[target], 0), np.where(valid, self.tokens[target], 0), valid

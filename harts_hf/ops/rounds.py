"""Path decomposition of a tree batch into rounds: the one source of the linear-attention layouts.

A tree is cut into *paths*: at every token with several children, ONE child continues the
parent's path and the others start new paths one round later. Continuing the child whose
subtree needs the most rounds gives the minimum number of rounds (sequential kernel calls):
r(leaf) = 1, r(x) = max(r(c*), max_{c != c*} r(c) + 1) with c* = argmax r(c), i.e. the largest
child round count, plus one when two children tie for it. A chain needs 1 round; a GRPO group,
a caterpillar of any length, 2.

Chunkwise kernels keep states at chunk boundaries, so every path lives on the chunk grid of
trajectory-wise training: a path whose first own token sits at depth d has the aligned start
a = floor(d / C) * C, and its < C ancestors at depths [a, d) are its *replay*. Within a round,
paths are ranked by chunk count, descending, so the paths still running at chunk step m are
ranks [0, n_m). :class:`Rounds` holds these facts as numpy arrays, and every token each path
computes on its grid (:class:`GridTokens`); each backend builds its layout directly from them:
``ragged_layout.py`` (torch: a child starts exactly at d from its parent's mid-chunk state, no
piece token replayed, chunks at their true length) and ``fla/waves.py`` (fla: whole C-chunks,
replay included).

In a piece (``batch.num_context > 0``), tokens whose parent is a context token start *external*
root paths: their state at boundary a is the state after the context token at depth a - 1, which
the caller passes (``external_tokens``); replayed context tokens need the caller's inputs
(``context_replay``: fewer than C per external path, all a linear layer holds of the context).
The kernels' input tables hold the rows ``[replayed context tokens, piece tokens, zero row]``
(:meth:`Rounds.input_rows`).

Legend: Nc context tokens, N piece tokens, M piece nodes, P paths, C chunk size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..trees import by_level, chains, min_rounds, replay_length, tree_levels
from .tree_batch import Table, TreeBatch

__all__ = [
    "GridTokens",
    "ReplayTable",
    "Rounds",
    "RoundsTable",
    "build_rounds",
    "context_replay_of",
    "input_table",
    "rounds_of",
]


class GridTokens(NamedTuple):
    """Every token each path computes on its chunk grid: replayed ancestors, then own tokens
    (numpy, one entry per computed token).

    Args:
        path: the path computing it.
        offset: its depth minus the path's aligned start (``Rounds.path_start``).
        token: its combined index (context tokens first, then piece tokens).
        own: whether it is the path's own token (not a replayed ancestor).
    """

    path: np.ndarray
    offset: np.ndarray
    token: np.ndarray
    own: np.ndarray


@dataclass(frozen=True, eq=False)
class Rounds:
    """The paths and rounds of one batch and chunk size; build with :func:`rounds_of`.

    Args:
        chunk_size: C.
        external_tokens: [E] combined indices of the context tokens after which the caller
            provides the boundary state (``initial_states``), in that order.
        context_replay: [R] combined indices (ascending) of the context tokens replayed by
            external paths: the context rows the inputs take (``context``).
        num_context: Nc; position: [Nc + N] absolute depth of every combined token.
        token_path: [N] the path owning each piece token.
        path_round, path_rank: [P] each path's round and rank within it (by chunk count, descending).
        path_start: [P] aligned start depth a; path_replay: [P] replayed tokens at its head (its
            first own depth minus a); path_length: [P] replayed plus own tokens;
            path_chunks: [P] its chunks on the grid.
        path_parent: [P] the path holding each path's parent token (in the previous round), -1 for a
            root or external path.
        path_h0: [P] row of ``cat([zeros(1), initial_states])`` holding the initial state of a path
            without a parent path (0 for a root; ignored where ``path_parent >= 0``).
        grid: every token each path computes (:class:`GridTokens`).
    """

    chunk_size: int
    external_tokens: torch.Tensor
    context_replay: torch.Tensor
    num_context: int
    position: np.ndarray
    token_path: np.ndarray
    path_round: np.ndarray
    path_rank: np.ndarray
    path_start: np.ndarray
    path_replay: np.ndarray
    path_length: np.ndarray
    path_chunks: np.ndarray
    path_parent: np.ndarray
    path_h0: np.ndarray
    grid: GridTokens

    @property
    def num_rounds(self) -> int:
        return int(self.path_round.max()) + 1

    @property
    def num_paths(self) -> int:
        return int(self.path_round.size)

    def check_inputs(
        self,
        own: Mapping[str, torch.Tensor],
        context: Mapping[str, torch.Tensor] | None,
        initial_states: torch.Tensor | None,
    ) -> None:
        """Refuse a piece's inputs that do not fit it (every backend calls this first): ``own`` the
        per-token inputs by name (q, k [N, Hk, K], v [N, H, V], g, beta), ``context`` the same names
        but q for the R replayed context tokens (``context_replay``), ``initial_states`` [E, H, K, V]."""
        n = self.token_path.size
        for name, x in own.items():
            if x.shape[0] != n:
                raise ValueError(f"input {name} has {x.shape[0]} tokens but the batch has {n} piece tokens")
        if self.context_replay.numel() and context is None:
            raise ValueError(
                f"this piece replays {self.context_replay.numel()} context tokens: pass their inputs as `context`"
            )
        for name in () if context is None else [name for name in own if name != "q"]:
            if name not in context:
                raise ValueError(f"context lacks {name!r}: give {sorted(set(own) - {'q'})} of the context tokens")
            replayed = self.context_replay.numel()
            if context[name].shape[0] != replayed:
                raise ValueError(
                    f"context {name} has {context[name].shape[0]} tokens but the piece replays {replayed} context "
                    "tokens: give the inputs of Rounds.context_replay"
                )
            if context[name].shape[1:] != own[name].shape[1:]:
                raise ValueError(
                    f"context {name} is [{replayed}, {', '.join(map(str, context[name].shape[1:]))}] per token "
                    f"but the piece's {name} is [N, {', '.join(map(str, own[name].shape[1:]))}]"
                )
        num_ext = self.external_tokens.numel()
        if (0 if initial_states is None else initial_states.shape[0]) != num_ext:
            raise ValueError(
                f"this piece needs initial_states for its {num_ext} external boundary states (Rounds.external_tokens)"
            )
        state = (own["v"].shape[1], own["k"].shape[-1], own["v"].shape[-1])
        if initial_states is not None and tuple(initial_states.shape[1:]) != state:
            raise ValueError(f"initial_states must be [E, H, K, V] = [{num_ext}, {', '.join(map(str, state))}]")

    def input_rows(self, combined: np.ndarray) -> np.ndarray:
        """Combined indices (replayed context tokens, piece tokens; -1 for padding) as rows of the
        kernels' input tables ``[replayed context, piece tokens, zero row]`` (numpy, on the host)."""
        replay = self.context_replay.cpu().numpy()
        nc, n, r = self.num_context, self.token_path.size, replay.size
        ctx = (combined >= 0) & (combined < nc)
        at = np.minimum(np.searchsorted(replay, combined), max(r - 1, 0))
        if ctx.any() and (r == 0 or (replay[at[ctx]] != combined[ctx]).any()):
            raise RuntimeError("a linear-attention table reads a context token its paths do not replay")
        rows = np.where(ctx, at, combined - nc + r)
        return np.where((combined < 0) | (combined >= nc + n), r + n, rows)

    def boundary_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(path, chunk boundary m) of the state after each of ``tokens`` (combined indices of piece
        tokens t with (position[t] + 1) % C == 0): m = 0 is a path's initial state, m =
        ``path_chunks`` its final state."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        local = tokens - self.num_context
        if ((local < 0) | (local >= self.token_path.size)).any():
            raise ValueError("state_out tokens must be piece tokens (combined indices >= num_context)")
        after = self.position[tokens] + 1
        if (after % self.chunk_size).any():
            raise ValueError(
                f"state_out tokens must sit just before a chunk boundary ((position + 1) % {self.chunk_size} == 0)"
            )
        path = self.token_path[local]
        return path, (after - self.path_start[path]) // self.chunk_size


def _nodes(local_prev: np.ndarray, position: np.ndarray):
    """Maximal chains of the piece forest (``trees.chains``: a piece's chains need not be
    contiguous): (node_of [N], node_parent [M], node_end_depth [M])."""
    node_of, start, node_parent = chains(local_prev)
    end_depth = np.zeros(start.size, dtype=np.int64)
    np.maximum.at(end_depth, node_of, position)
    return node_of, node_parent, end_depth


def _decompose(node_parent: np.ndarray, end_depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(path head node, round) of every node under the min-rounds choice of continued child."""
    m = node_parent.size
    r, deep = min_rounds(node_parent, end_depth)
    # c* per parent: largest r, then deepest subtree, then first in DFS order.
    child = np.flatnonzero(node_parent >= 0)
    order = np.lexsort((child, -deep[child], -r[child], node_parent[child]))
    first = np.ones(order.size, dtype=bool)
    first[1:] = node_parent[child[order[1:]]] != node_parent[child[order[:-1]]]
    chosen = np.full(m, -1, dtype=np.int64)
    chosen[node_parent[child[order[first]]]] = child[order[first]]

    head = np.arange(m)
    rnd = np.zeros(m, dtype=np.int64)
    for ch in by_level(tree_levels(node_parent))[1:]:  # root level first
        par = node_parent[ch]
        cont = chosen[par] == ch
        head[ch] = np.where(cont, head[par], ch)
        rnd[ch] = rnd[par] + ~cont
    return head, rnd


def _replay(prev: np.ndarray, first: np.ndarray, replay_len: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """Walk up from each path's first own token (combined index ``first``): the replayed
    ancestors [P, C - 1] (column u = depth a + u, -1 past ``replay_len``) and the token at
    depth a - 1 [P] (-1 at a root), after which the path's initial state sits. One vectorised
    step per depth, at most C."""
    replay = np.full((first.size, C - 1), -1, dtype=np.int64)
    state_tok = np.full(first.size, -1, dtype=np.int64)
    cur = prev[first]
    for s in range(1, C + 1):
        live = (cur >= 0) & (s <= replay_len + 1)
        if not live.any():
            break
        rows = np.flatnonzero(live)
        at_state = s == replay_len[rows] + 1
        replay[rows[~at_state], replay_len[rows[~at_state]] - s] = cur[rows[~at_state]]
        state_tok[rows[at_state]] = cur[rows[at_state]]
        cur = np.where(live, prev[np.maximum(cur, 0)], -1)
    return replay, state_tok


def build_rounds(batch: TreeBatch, chunk_size: int) -> Rounds:
    """Decompose ``batch`` into min-rounds paths on the chunk grid (see module docstring)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    C = chunk_size
    nc = batch.num_context
    position = batch.position.cpu().numpy()
    prev = batch.prev.cpu().numpy()
    n = position.size - nc
    if n <= 0:
        raise ValueError("a tree batch needs at least one piece token")
    pos = position[nc:]
    local_prev = np.where(prev[nc:] >= nc, prev[nc:] - nc, -1)

    node_of, node_parent, end_depth = _nodes(local_prev, pos)
    head, node_round = _decompose(node_parent, end_depth)
    heads, path_of_head = np.unique(head, return_inverse=True)
    token_path = path_of_head[node_of]  # [N]
    num_paths = heads.size

    # Own tokens of every path, by depth.
    own_order = np.lexsort((pos, token_path))
    own_len = np.bincount(token_path, minlength=num_paths)
    own_off = np.concatenate(([0], np.cumsum(own_len)))
    start = own_order[own_off[:-1]]  # [P] piece index of each path's first own token
    replay_len = replay_length(pos[start], C)
    a = pos[start] - replay_len  # [P] aligned start depth
    chunks = -(-(replay_len + own_len) // C)
    path_round = node_round[node_of[start]]
    replay, state_tok = _replay(prev, nc + start, replay_len, C)

    parent_tok = local_prev[start]
    external = (parent_tok < 0) & (prev[nc + start] >= 0)
    needs_state = external & (a > 0)
    if (state_tok[needs_state] >= nc).any():
        raise ValueError(
            "a piece path starts below another piece token across a context gap: pieces must "
            "be connected subtrees (their external boundary states come from context tokens)"
        )
    external_tokens, ext_id = np.unique(state_tok[needs_state], return_inverse=True)
    root_h0 = np.zeros(num_paths, dtype=np.int64)  # row of cat([zeros(1), initial_states])
    root_h0[needs_state] = 1 + ext_id
    rep = replay[external]
    context_replay = np.unique(rep[(rep >= 0) & (rep < nc)])

    # Rank of each path within its round: by chunk count, descending.
    num_rounds = int(path_round.max()) + 1
    order = np.lexsort((np.arange(num_paths), -chunks, path_round))
    round_off = np.searchsorted(path_round[order], np.arange(num_rounds + 1))
    path_rank = np.empty(num_paths, dtype=np.int64)
    path_rank[order] = np.arange(num_paths) - round_off[path_round[order]]

    # Every computed token as (path, offset = depth - a), replayed ones first.
    rp, ru = np.nonzero(replay >= 0)
    own_path = token_path[own_order]
    grid = GridTokens(
        path=np.concatenate((rp, own_path)),
        offset=np.concatenate((ru, replay_len[own_path] + np.arange(n) - own_off[own_path])),
        token=np.concatenate((replay[rp, ru], nc + own_order)),
        own=np.arange(rp.size + n) >= rp.size,
    )
    as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=batch.device)
    return Rounds(
        chunk_size=C,
        external_tokens=as_t(external_tokens),
        context_replay=as_t(context_replay),
        num_context=nc,
        position=position,
        token_path=token_path,
        path_round=path_round,
        path_rank=path_rank,
        path_start=a,
        path_replay=replay_len,
        path_length=replay_len + own_len,
        path_chunks=chunks,
        path_parent=np.where(parent_tok >= 0, token_path[np.maximum(parent_tok, 0)], -1),
        path_h0=root_h0,
        grid=grid,
    )


@dataclass(frozen=True)
class RoundsTable(Table):
    """The rounds of a batch on the chunk grid ``chunk_size``: the grid its linear layers' states
    live on (``harts_hf.schedule`` hands states over on it)."""

    chunk_size: int

    def build(self, batch: TreeBatch) -> Rounds:
        return build_rounds(batch, self.chunk_size)

    @property
    def reach(self) -> int:
        return self.chunk_size  # an external path's state sits after the token at its aligned start - 1


@dataclass(frozen=True)
class ReplayTable(Table):
    """The context tokens the paths on the chunk grid ``chunk_size`` replay (``Rounds.context_replay``)."""

    chunk_size: int
    context_subset = True

    def build(self, batch: TreeBatch) -> torch.Tensor:
        return rounds_of(batch, self.chunk_size).context_replay

    @property
    def reach(self) -> int:
        return self.chunk_size - 1  # the replayed tokens lie between the aligned start and the path


def rounds_of(batch: TreeBatch, chunk_size: int) -> Rounds:
    """The rounds of ``batch`` for ``chunk_size``, derived once per batch."""
    return batch.cached(RoundsTable(chunk_size))


def context_replay_of(batch: TreeBatch, chunk_size: int) -> torch.Tensor:
    """[R] the context tokens ``batch``'s paths replay (``Rounds.context_replay``), as a table of
    its own: the context subset a linear layer's handoff delivers."""
    return batch.cached(ReplayTable(chunk_size))


def input_table(own: torch.Tensor, ctx: torch.Tensor | None, num_replayed: int) -> torch.Tensor:
    """[R + N + 1, ...] the replayed context tokens' rows, own rows, and a zero row for padding
    (``Rounds.input_rows`` addresses them). Without ``ctx`` the context rows are zeros: the q of
    replayed tokens (their outputs are dropped), or every input of a piece that replays none."""
    if ctx is None:
        ctx = own.new_zeros((num_replayed, *own.shape[1:]))
    return torch.cat((ctx.to(own), own, own.new_zeros((1, *own.shape[1:]))))

"""Exact starts: a child path branching off the chunk grid starts from its parent's mid-chunk state.

The kernels' ``state_at`` gives the state after every row of a chunk (checked against fla's recurrent
references, values and gradients); on trees whose children branch at every offset of a chunk (several
at the same offset, offset 0 included, grandchildren inside a child's first partial chunk) the layout
asks exactly for those states, and every kind equals its oracle run trajectory by trajectory, whole and
as a piece whose external paths replay context tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import assert_close, check_piece, check_tree, fla_naive
from test_ops_ragged_layout import CHUNK, KINDS, NAMES, forest_of, leaves_of, oracle, tree_op, walk

from harts_hf.forest import RolloutForest
from harts_hf.ops.gated_delta import GDN_KERNEL
from harts_hf.ops.gla import GLA_KERNEL, SIMPLE_GLA_KERNEL
from harts_hf.ops.kda import KDA_KERNEL
from harts_hf.ops.ragged_layout import ragged_layout_of
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch

H, K, V = 2, 8, 6
KERNELS = {"gated_delta": GDN_KERNEL, "kda": KDA_KERNEL, "gla": GLA_KERNEL, "simple_gla": SIMPLE_GLA_KERNEL}


def recurrent_state(kind: str, x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """fla's recurrent reference: the state after all tokens of x ([T, ...] each), from ``state``."""
    q, k, v, g = (x[n][None] for n in ("q", "k", "v", "g"))
    if kind == "gated_delta":
        ref = fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule
        return ref(q, k, v, x["beta"][None], g, initial_state=state[None], output_final_state=True)[1][0]
    if kind == "kda":
        ref = fla_naive("kda").naive_recurrent_kda
        return ref(q, k, v, g, x["beta"][None], initial_state=state[None], output_final_state=True)[1][0]
    if kind == "gla":
        ref = fla_naive("gla").naive_recurrent_gla
        return ref(q, k, v, g, initial_state=state[None], output_final_state=True)[1][0]
    ref = fla_naive("simple_gla").naive_recurrent_simple_gla
    return ref(q, k, v, g, initial_state=state[None], output_final_state=True)[1][0]


@pytest.mark.parametrize("length", [12, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_state_at_every_row_matches_the_recurrent_reference(kind: str, length: int) -> None:
    """One chunk asked for its state after every row 0..L-1, from a random start state."""
    x = leaves_of(kind, length, seed=11)
    with torch.no_grad():
        x["k"].copy_(F.normalize(x["k"], dim=-1))
    state = (torch.randn(H, K, V, generator=torch.Generator().manual_seed(12)) * 0.5).requires_grad_()
    kernel = KERNELS[kind]
    chunk = {n: t[None] for n, t in x.items()}  # [1, L, ...]
    rows = kernel.intra(*(chunk.get(n) for n in NAMES), scale=K**-0.5)
    values = kernel.step(state[None], *rows)[2]  # [1, H, L, V] or None
    upto = torch.arange(length)
    many = lambda t: t.expand(length, *t.shape[1:])  # the same chunk once per asked row
    got = kernel.state_at(
        many(state[None]),
        None if values is None else many(values),
        lambda name: many(chunk[name].transpose(1, 2)),
        upto,
    )  # [L, H, K, V]
    ref = torch.stack([recurrent_state(kind, {n: t[: i + 1] for n, t in x.items()}, state) for i in range(length)])
    assert_close("states", ref, got)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(13))
    names = [n for n in x if n != "q"]  # states do not depend on q
    leaves = [state, *(x[n] for n in names)]
    ref_grads = torch.autograd.grad((weight * ref).sum(), leaves)
    got_grads = torch.autograd.grad((weight * got).sum(), leaves)
    for name, r, g in zip(["state", *names], ref_grads, got_grads):
        assert_close(f"grad {name}", r, g)


def every_offset(chunk: int) -> list[list[int]]:
    """A trunk of 3 chunks and a leaf branching at every depth d = C + o of its second chunk and at the
    third's start (o = 0..C), of 1 to C + 2 tokens; every third offset has a second leaf, every fourth a
    long leaf (2C tokens) with children inside its first partial chunk, at its next boundary and after."""
    rng = np.random.default_rng(chunk)
    seg = lambda n: rng.integers(0, 1 << 20, size=n).tolist()
    trunk = seg(3 * chunk + 3)
    seqs = [trunk]
    for o in range(chunk + 1):
        d = chunk + o
        seqs.append(trunk[:d] + seg(1 + (5 * o) % (chunk + 2)))
        if o % 3 == 0:
            seqs.append(trunk[:d] + seg(2 + o % 4))
        if o % 4 == 1:
            long = trunk[:d] + seg(2 * chunk)
            seqs += [long] + [long[:e] + seg(3) for e in sorted({d + 1 + o % 3, 2 * chunk, 2 * chunk + 1}) if e > d]
    return seqs


@pytest.mark.parametrize("chunk", [12, 16])
def test_children_start_from_the_mid_chunk_state_of_their_branch_point(chunk: int) -> None:
    """A path branching at depth d > a starts from the mid-chunk state after depth d - 1 that its
    parent's round computes (one per branch point, shared by siblings, each read); a path starting on
    the grid takes a chunk-start state. The walk checks that every chunk starts after its first
    token's parent."""
    forest = RolloutForest.from_sequences(every_offset(chunk))
    batch = TreeBatch.from_forest(forest)
    rs, layout, seen = rounds_of(batch, chunk), ragged_layout_of(batch, chunk), walk(batch, chunk)
    offsets = set()
    for r in range(1, rs.num_rounds):
        mids = seen.mids[r - 1]
        assert len(set(mids)) == len(mids), "one mid-chunk state per branch point"
        base = len(seen.kept[r - 1]) + len(seen.finals[r - 1])
        h0 = layout.rounds[r].h0.numpy()
        paths = np.flatnonzero(rs.path_round == r)
        first_depth = {int(rs.path_rank[p]): int(rs.path_start[p] + rs.path_replay[p]) for p in paths}
        head = [s for s in layout.rounds[r].steps[0].visits]  # step 0's visits: every path of the round
        assert sum(n for _, n in head) == paths.size == h0.size
        mid = h0 >= base
        assert set(h0[mid] - base) == set(range(len(mids))), "every mid-chunk state is read"
        depths = np.asarray(sorted(first_depth.values()))
        assert mid.sum() == (depths % chunk > 0).sum(), "off the grid: a mid-chunk state; on it: a boundary state"
        offsets |= set((depths[depths % chunk > 0] % chunk).tolist())
    assert offsets == set(range(1, chunk)), "children start at every offset of a chunk"


@pytest.mark.parametrize("chunk", [12, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_with_children_at_every_offset_matches_trajectories(kind: str, chunk: int) -> None:
    forest = RolloutForest.from_sequences(every_offset(chunk))
    leaves = leaves_of(kind, forest.num_compact_tokens, 1)
    check_tree(
        forest,
        leaves,
        lambda batch: tree_op(kind, leaves, lambda x: x, batch, chunk)[0],
        lambda per_traj: oracle(kind, leaves, per_traj, chunk),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_piece_with_mid_chunk_children_equals_whole_forest(kind: str) -> None:
    """A piece cut 3 tokens into the trunk's second chunk: external paths replay context tokens, the
    piece's own children start at mid-chunk states of its paths."""
    chunk = 16
    forest = RolloutForest.from_sequences(every_offset(chunk))
    leaves = leaves_of(kind, forest.num_compact_tokens, 2)
    piece = np.flatnonzero(forest.position >= chunk + 3)

    def run(batch, own, ctx, initial_states):
        context = None if ctx is None else {n: leaves[n][ctx] for n in NAMES[1:] if n in leaves}
        kwargs = {"context": context, "initial_states": initial_states}
        return tree_op(kind, leaves, lambda x: x[own], batch, chunk, **kwargs)

    assert any(
        mid.row.numel()
        for rnd in ragged_layout_of(TreeBatch.from_forest(forest, piece), chunk).rounds
        for mid in rnd.mids
    )
    check_piece(forest, piece, chunk, leaves, run)


@pytest.mark.parametrize("name", ["short_leaves", "every_offset"])
def test_piece_layout_replays_context_only_on_external_paths(name: str) -> None:
    """In a piece cut 7 tokens into the second chunk, every piece token is computed once; the only
    replayed tokens are context tokens, at the head of the external paths, which start from the
    caller's states (the walk checks every chunk's start)."""
    forest = forest_of("short_leaves") if name == "short_leaves" else RolloutForest.from_sequences(every_offset(16))
    chunk = CHUNK if name == "short_leaves" else 16
    batch = TreeBatch.from_forest(forest, np.flatnonzero(forest.position >= chunk + 7))
    rows, nc = walk(batch, chunk).chunks, batch.num_context
    own = sorted(t for row in rows for t in row if t >= nc)
    assert own == list(range(nc, nc + batch.num_tokens)), "every piece token computed once"
    for row in rows:
        replayed = sum(t < nc for t in row)
        assert all(t < nc for t in row[:replayed]), "context tokens only at a chunk's head"
    replayed = {t for row in rows for t in row if t < nc}
    assert sorted(replayed) == rounds_of(batch, chunk).context_replay.tolist() and replayed

"""Ragged rounds (exact starts, every chunk at its length bucket): the layout computes every token once,
in chunks that stay inside the trajectory chunk grid, and every linear kind on trees of short paths,
whose first and last chunks take every length, equals its oracle run trajectory by trajectory
(outputs and gradients), whole and as a piece with external states (which replay context tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import check_piece, check_tree, fla_naive
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.qwen3_5 import modeling_qwen3_5
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.ops.gated_delta import tree_gated_delta_rule
from harts_hf.ops.gla import tree_gla, tree_simple_gla
from harts_hf.ops.kda import tree_kda
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.scan_plan import scan_plan_of
from harts_hf.ops.tail_chunks import BUCKET, ragged_rounds_of
from harts_hf.ops.tree_batch import TreeBatch

CHUNK = 20  # not a power of two: tails round up to 8, 16 or (capped) 20
H, K, V = 2, 8, 6
NAMES = ("q", "k", "v", "g", "beta")
chunk_gdn_torch = modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
chunk_kda_torch = modeling_kimi_linear.chunk_kimi_delta_attention.__wrapped__
naive_gla = fla_naive("gla")
naive_simple_gla = fla_naive("simple_gla")


def short_leaves(rng: np.random.Generator) -> list[list[int]]:
    """A trunk of 3 chunks shedding, every 3 tokens, a leaf of 1 to CHUNK + 2 tokens (so the last
    chunks of the paths take every length, replays of every length included) and, on every fourth
    leaf, a leaf of that leaf right after its first (1-token) node."""
    trunk = [int(x) for x in rng.integers(0, 50, 3 * CHUNK + 5)]
    seqs = [trunk]
    for i, depth in enumerate(range(1, len(trunk), 3)):
        leaf = trunk[:depth] + [1000 + i] + [int(x) for x in rng.integers(0, 50, i % (CHUNK + 2))]
        seqs.append(leaf)
        if i % 4 == 0:
            seqs.append(leaf[: depth + 1] + [5000 + i] + [1] * (i % 5))
    return seqs


TREES = {"short_leaves": short_leaves} | NASTY_TREES


def forest_of(name: str) -> RolloutForest:
    return RolloutForest.from_sequences(TREES[name](np.random.default_rng(0)))


def chunk_rows(rag) -> list[list[int]]:
    """Every chunk of a ragged round as its combined token indices, padding stripped."""
    streams = rag.gather.split([c * length for c, length in zip(rag.chunks, rag.lengths)])
    rows = [row for s, length in zip(streams, rag.lengths) for row in s.view(-1, length).tolist()]
    return [[t for t in row if t >= 0] for row in rows]


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("chunk", [16, CHUNK, 64])
def test_layout_computes_every_token_once_in_grid_chunks(name: str, chunk: int) -> None:
    """No replayed ancestor, no chunk across the trajectory chunk grid, < BUCKET padding per short chunk."""
    forest = forest_of(name)
    batch = TreeBatch.from_forest(forest)
    pos, prev = forest.position, forest.prev
    computed = []
    for rnd, rag in zip(rounds_of(batch, chunk).rounds, ragged_rounds_of(batch, chunk), strict=True):
        assert rag.lengths[0] == chunk and rag.lengths == sorted(set(rag.lengths), reverse=True)
        assert all(length % BUCKET == 0 for length in rag.lengths[1:])
        streams = rag.gather.split([c * length for c, length in zip(rag.chunks, rag.lengths)])
        for s, length in zip(streams, rag.lengths):  # valid slots first, then < BUCKET padding slots
            valid = s.view(-1, length) >= 0
            assert (valid.sum(1) > length - BUCKET).all()
            assert torch.equal(valid, valid.sum(1, keepdim=True) > torch.arange(length))
        for row in chunk_rows(rag):
            assert (prev[row[1:]] == row[:-1]).all(), "a chunk is a root-ward chain"
            assert pos[row[0]] // chunk == pos[row[-1]] // chunk, "a chunk stays inside one grid chunk"
        assert torch.equal(rag.gather[rag.own_slot], rnd.gather[rnd.own_slot])
        assert [sum(sec) for sec in rag.sections] == rag.chunks
        assert sorted(rag.final_order.tolist()) == list(range(rnd.step_counts[0]))
        computed += [t for row in chunk_rows(rag) for t in row]
    assert sorted(computed) == list(range(forest.num_compact_tokens)), "every token computed exactly once"


@pytest.mark.parametrize("name", ["short_leaves", "caterpillar", "deep_chain", "wide_fanout"])
def test_scan_plan_gathers_every_token_once_and_keeps_only_read_states(name: str) -> None:
    """One gather for the run puts every own token in one slot, chunks grouped by length; the scan keeps
    the chunk-start states a request or a later round reads, and none in the last round unless a
    ``batch.state_out`` state is asked for."""
    forest = forest_of(name)
    batch = TreeBatch.from_forest(forest)
    plan = scan_plan_of(batch, CHUNK)
    n = forest.num_compact_tokens
    assert plan.lengths == sorted(plan.lengths, reverse=True)
    assert plan.gather.numel() == sum(length * sum(c) for length, c in zip(plan.lengths, plan.counts))
    assert torch.equal(plan.gather[plan.output], torch.arange(n)), "each token's output slot holds the token"
    padding = torch.ones(plan.gather.numel(), dtype=torch.bool)
    padding[plan.output] = False
    assert (plan.gather[padding] == n).all(), "every other slot reads the zero row"
    layout = ragged_rounds_of(batch, CHUNK)
    for r, (rag, rp) in enumerate(zip(layout, plan.rounds)):
        kept = sum(
            0 if k is None else len(ranks) if isinstance(k, slice) else k.numel()
            for k, ranks in zip(rp.keep, rag.visit_rank)
        )
        starts = set(torch.cat([req.start for req in rag.requests]).tolist()) if rag.requests else set()
        following = layout[r + 1].h0_index.tolist() if r + 1 < len(layout) else []
        tc = sum(len(ranks) for ranks in rag.visit_rank)
        assert kept == len(starts | {row for row in following if row < tc}), f"round {r} keeps unread states"
    assert all(k is None for k in plan.rounds[-1].keep) and not plan.rounds[-1].finals
    ends = np.flatnonzero((forest.position + 1) % CHUNK == 0)
    asked = scan_plan_of(batch.with_state_out({CHUNK: ends}), CHUNK)
    assert sum(0 if rp.picks is None else rp.picks.numel() for rp in asked.rounds) == ends.size


def leaves_of(kind: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    per_channel = kind in ("kda", "gla")
    leaves = {
        "q": torch.randn(n, H, K, generator=gen),
        "k": torch.randn(n, H, K, generator=gen) * 0.5,
        "v": torch.randn(n, H, V, generator=gen),
        "g": -F.softplus(torch.randn((n, H, K) if per_channel else (n, H), generator=gen)) * 0.1,
    }
    if kind in ("gated_delta", "kda"):
        leaves["beta"] = torch.rand(n, H, generator=gen)
    return {name: x.requires_grad_() for name, x in leaves.items()}


def tree_op(kind: str, leaves: dict[str, torch.Tensor], take, batch: TreeBatch, chunk: int = CHUNK, **kwargs) -> tuple:
    """``kind``'s tree op on the rows ``take`` of every leaf (l2-normalised q/k for the delta kinds)."""
    args = [take(leaves[n]) for n in NAMES if n in leaves]
    if kind == "gated_delta":
        return tree_gated_delta_rule(*args, batch, use_qk_l2norm=True, chunk_size=chunk, **kwargs)
    if kind == "kda":
        return tree_kda(*args, batch, use_qk_l2norm=True, chunk_size=chunk, **kwargs)
    fn = tree_gla if kind == "gla" else tree_simple_gla
    return fn(*args, batch, chunk_size=chunk, **kwargs)


def oracle(kind: str, leaves: dict[str, torch.Tensor], per_traj, chunk: int = CHUNK) -> torch.Tensor:
    """[B, T, H, V] every trajectory alone: transformers' torch kernels (delta kinds), fla's naive refs."""
    q, k, v, g, *beta = (per_traj(leaves[n]) for n in NAMES if n in leaves)
    if kind == "gated_delta":
        return chunk_gdn_torch(q, k, v, g, beta[0], chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]
    if kind == "kda":
        return chunk_kda_torch(q, k, v, g=g, beta=beta[0], chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]
    if kind == "gla":
        return naive_gla.naive_recurrent_gla(q, k, v, g)[0]
    return naive_simple_gla.naive_chunk_simple_gla(q, k, v, g, chunk_size=chunk)[0]


KINDS = ["gated_delta", "kda", "gla", "simple_gla"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["short_leaves", "one_token_nodes", "wide_fanout"])
def test_short_paths_match_trajectories(kind: str, name: str) -> None:
    forest = forest_of(name)
    leaves = leaves_of(kind, forest.num_compact_tokens, 1)
    check_tree(
        forest,
        leaves,
        lambda batch: tree_op(kind, leaves, lambda x: x, batch)[0],
        lambda per_traj: oracle(kind, leaves, per_traj),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_short_paths_piece_with_context_equals_whole_forest(kind: str) -> None:
    """A piece cut below the trunk's second chunk: its leaves replay context tokens from external states."""
    forest = forest_of("short_leaves")
    leaves = leaves_of(kind, forest.num_compact_tokens, 2)
    piece = np.flatnonzero(forest.position >= CHUNK + 7)

    def run(batch, own, ctx, initial_states):
        context = None if ctx is None else {n: leaves[n][ctx] for n in NAMES[1:] if n in leaves}
        return tree_op(
            kind,
            leaves,
            lambda x: x[own],
            batch,
            context=context,
            initial_states=initial_states,
        )

    check_piece(forest, piece, CHUNK, leaves, run)

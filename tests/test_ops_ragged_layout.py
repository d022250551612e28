"""The ragged layout (exact starts, every chunk at its length bucket): walked as the driver walks it, every
chunk is a root-ward chain inside one grid chunk that starts from the state after its first token's parent,
every token is computed once, and only states a later use reads are kept; every linear kind on trees of
short paths, whose first and last chunks take every length, equals its oracle run trajectory by trajectory
(outputs and gradients), whole and as a piece with external states (which replay context tokens)."""

from __future__ import annotations

from typing import NamedTuple

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
from harts_hf.ops.ragged_layout import BUCKET, RaggedLayout, ragged_layout_of
from harts_hf.ops.rounds import rounds_of
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


class Walk(NamedTuple):
    """What a walk of the layout saw: every chunk's tokens and, per round, its kept chunk-start, final
    and mid-chunk states, each as the combined token after which it sits (-1: the zero state), and
    the states returned for ``batch.state_out``."""

    chunks: list[list[int]]
    kept: list[list[int]]
    finals: list[list[int]]
    mids: list[list[int]]
    picks: list[int]


def slot_tokens(batch: TreeBatch, layout: RaggedLayout, chunk: int) -> np.ndarray:
    """[slots] the combined token each slot reads (-1: the zero row)."""
    replay = rounds_of(batch, chunk).context_replay.numpy()
    rows, r, n = layout.gather.numpy(), replay.size, batch.num_tokens
    ctx = replay[np.minimum(rows, max(r - 1, 0))] if r else rows
    return np.where(rows < r, ctx, np.where(rows < r + n, batch.num_context + rows - r, -1))


def walk(batch: TreeBatch, chunk: int) -> Walk:
    """Walk ``batch``'s layout visit by visit as ``run_tree_linear_attention`` does, checking that every
    chunk is a valid-slots-first root-ward chain that starts from the state after its first token's parent."""
    layout = ragged_layout_of(batch, chunk)
    rounds = rounds_of(batch, chunk)
    prev = batch.prev.numpy()
    tokens = slot_tokens(batch, layout, chunk)
    offsets = np.cumsum([0] + [L * c for L, c in zip(layout.lengths, layout.chunks)])
    used = [0] * len(layout.lengths)
    h_in = [-1] + rounds.external_tokens.tolist()  # cat([zeros(1), initial_states])
    seen: list[list[int]] = []
    kept_all, finals_all, mids_all, picks = [], [], [], []
    for rnd in layout.rounds:
        state = [h_in[i] for i in rnd.h0.tolist()]
        kept, ends, local = [], [], [[] for _ in layout.lengths]
        for step in rnd.steps:
            if step.keep is not None:
                kept += state if isinstance(step.keep, slice) else [state[i] for i in step.keep.tolist()]
            going, position = [], 0
            for v, (j, size) in enumerate(step.visits):
                for _ in range(size):
                    L = layout.lengths[j]
                    row = tokens[offsets[j] + used[j] * L : offsets[j] + (used[j] + 1) * L]
                    valid = row >= 0
                    assert valid.any() and (valid == (np.arange(L) < valid.sum())).all(), "valid slots first"
                    assert valid.sum() > L - BUCKET, "< BUCKET padding slots"
                    toks = row[valid]
                    assert (prev[toks[1:]] == toks[:-1]).all(), "a chunk is a root-ward chain"
                    assert prev[toks[0]] == state[position], "a chunk starts after its first token's parent"
                    local[j].append(used[j])
                    used[j] += 1
                    seen.append(toks.tolist())
                    (going if v < step.following else ends).append(int(toks[-1]))
                    position += 1
            state = going if step.order is None else [going[i] for i in step.order.tolist()]
        assert not state, "every path ends"
        finals = [ends[i] for i in rnd.final_order.tolist()] if rnd.finals else []
        mids = []
        for mid in rnd.mids:
            for at, c, r, start in zip(mid.local.tolist(), mid.chunk.tolist(), mid.row.tolist(), mid.start.tolist()):
                assert local[mid.length][at] == c, "a mid-chunk state's two chunk indices name one chunk"
                L = layout.lengths[mid.length]
                toks = tokens[offsets[mid.length] + c * L : offsets[mid.length] + (c + 1) * L]
                assert kept[start] == prev[toks[0]], "from the start state of its chunk"
                mids.append(int(toks[r]))
        h_in = kept + finals + mids
        kept_all.append(kept)
        finals_all.append(finals)
        mids_all.append(mids)
        if rnd.picks is not None:
            picks += [h_in[i] for i in rnd.picks.tolist()]
    assert used == layout.chunks, "every chunk visited once"
    order = layout.pick_order.tolist() if layout.pick_order is not None else []
    return Walk(seen, kept_all, finals_all, mids_all, [picks[i] for i in order])


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("chunk", [16, CHUNK, 64])
def test_layout_computes_every_token_once_in_grid_chunks(name: str, chunk: int) -> None:
    """No replayed ancestor, no chunk across the trajectory chunk grid, < BUCKET padding per short chunk,
    and every state the scan hands on is the state after the parent of the token it feeds."""
    forest = forest_of(name)
    batch = TreeBatch.from_forest(forest)
    layout = ragged_layout_of(batch, chunk)
    assert layout.lengths == sorted(set(layout.lengths), reverse=True)
    assert all(length % BUCKET == 0 or length == chunk for length in layout.lengths)
    assert [sum(sec) for sec in layout.sections] == layout.chunks
    seen = walk(batch, chunk).chunks
    for row in seen:
        assert forest.position[row[0]] // chunk == forest.position[row[-1]] // chunk, "one grid chunk"
    assert sorted(t for row in seen for t in row) == list(range(forest.num_compact_tokens)), "each token once"
    tokens = slot_tokens(batch, layout, chunk)
    assert np.array_equal(tokens[layout.output.numpy()], np.arange(forest.num_compact_tokens))


@pytest.mark.parametrize("name", ["short_leaves", "caterpillar", "deep_chain", "wide_fanout"])
def test_layout_keeps_only_the_states_later_uses_read(name: str) -> None:
    """The scan keeps the chunk-start states a mid-chunk state or a later round reads, and none in the
    last round unless a ``batch.state_out`` state is asked for; the asked states come back in order."""
    forest = forest_of(name)
    batch = TreeBatch.from_forest(forest)
    layout, seen = ragged_layout_of(batch, CHUNK), walk(batch, CHUNK)
    for r, rnd in enumerate(layout.rounds):
        read = set(layout.rounds[r + 1].h0.tolist()) if r + 1 < len(layout.rounds) else set()
        read |= {s for mid in rnd.mids for s in mid.start.tolist()}
        kept, finals, mids = (len(x[r]) for x in (seen.kept, seen.finals, seen.mids))
        assert {row for row in read if row < kept} == set(range(kept)), f"round {r} keeps what is read, only"
        assert not finals or read & set(range(kept, kept + finals)), "end states only where one is read"
        assert set(range(kept + finals, kept + finals + mids)) <= read, "every mid-chunk state is read"
    assert all(step.keep is None for step in layout.rounds[-1].steps) and not layout.rounds[-1].finals
    ends = np.flatnonzero((forest.position + 1) % CHUNK == 0)
    assert walk(batch.with_state_out({CHUNK: ends}), CHUNK).picks == ends.tolist()


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

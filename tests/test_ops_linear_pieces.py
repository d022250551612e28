"""A tree cut into pieces, run piece by piece with boundary handoffs, equals the unsplit run.

Pieces run in dependency order the way the engine runs microbatches: each piece asks for the
states after its chunk-boundary tokens (``batch.state_out``), later pieces get them as
``initial_states`` (detached copies, as across microbatches) plus the inputs of their replayed
context tokens. Backward runs in reverse order, each piece once, feeding the gradients of the
handed-over states back into the piece that produced them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from chunk_scan_cases import assert_close
from test_ops_gated_delta import H, K, V, gdn_inputs
from trees import NASTY_TREES

from harts_hf.forest import RolloutForest
from harts_hf.ops.gated_delta import tree_gated_delta_rule
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch


def cut_subtree(forest: RolloutForest, chunk: int) -> list[np.ndarray]:
    """The largest subtree hanging off a branch point below the first chunk, and the rest."""
    start = forest.node_start[forest.node_parent >= 0]
    start = start[forest.position[start] >= chunk]
    top = start[np.argmax(forest.subtree_end[start] - start)]
    inside = np.arange(top, forest.subtree_end[top])
    return [np.setdiff1d(np.arange(forest.num_compact_tokens), inside), inside]


def cut_mid_node(forest: RolloutForest, chunk: int) -> list[np.ndarray]:
    """The longest chain below the first chunk cut in its middle, off the chunk grid."""
    node = np.argmax(np.where(forest.position[forest.node_start] >= chunk, forest.node_len, 0))
    cut = forest.node_start[node] + forest.node_len[node] // 2
    cut += forest.position[cut] % chunk == 0
    inside = np.arange(cut, forest.subtree_end[cut])
    return [np.setdiff1d(np.arange(forest.num_compact_tokens), inside), inside]


def cut_depths(*depths: int):
    """Three pieces by depth bands (several subtrees each; handoffs from both earlier pieces)."""

    def cut(forest: RolloutForest, chunk: int) -> list[np.ndarray]:
        band = np.searchsorted(np.asarray(depths), forest.position, side="right")
        return [np.flatnonzero(band == b) for b in range(len(depths) + 1) if (band == b).any()]

    return cut


def run_pieces(forest, inputs, pieces, chunk):
    """[N, H, V] outputs of the piece-by-piece run, a backward that runs piece by piece, and the
    number of states handed over."""
    out = torch.zeros(forest.num_compact_tokens, *inputs["v"].shape[1:])
    states: dict[int, torch.Tensor] = {}  # global token -> detached state after it
    runs = []
    handoffs = 0
    for piece in pieces:
        batch = TreeBatch.from_forest(forest, piece)
        rs = rounds_of(batch, chunk)
        gi = batch.global_index.numpy()
        ext = gi[rs.external_tokens.numpy()]
        init = torch.stack([states[t] for t in ext]).requires_grad_() if ext.size else None
        nc = batch.num_context
        context = {n: inputs[n][gi[rs.context_replay.numpy()]] for n in ("k", "v", "g", "beta")}
        boundary = nc + np.flatnonzero((forest.position[gi[nc:]] + 1) % chunk == 0)
        o, st = tree_gated_delta_rule(
            *(inputs[n][gi[nc:]] for n in ("q", "k", "v", "g", "beta")),
            batch.with_state_out({chunk: boundary}),
            chunk_size=chunk,
            use_qk_l2norm=True,
            context=context,
            initial_states=init,
        )
        handoffs += ext.size
        states.update({t: s.detach() for t, s in zip(gi[boundary], st)})
        out[gi[nc:]] = o.detach()
        runs.append((gi[nc:], gi[boundary], ext, o, st, init))

    def backward(weight: torch.Tensor) -> None:
        state_grads: dict[int, torch.Tensor] = {}
        for own, boundary, ext, o, st, init in reversed(runs):
            tensors, grads = [o], [weight[own]]
            if boundary.size:
                tensors.append(st)
                grads.append(torch.stack([state_grads.get(t, torch.zeros_like(s)) for t, s in zip(boundary, st)]))
            torch.autograd.backward(tensors, grads)
            for t, gr in zip(ext, init.grad if init is not None else []):
                state_grads[t] = state_grads.get(t, 0) + gr

    return out, backward, handoffs


CUTS = [
    pytest.param("caterpillar", cut_subtree, 16, id="caterpillar-subtree"),
    pytest.param("caterpillar", cut_mid_node, 16, id="caterpillar-mid_node"),
    pytest.param("caterpillar", cut_depths(21, 45), 16, id="caterpillar-depths"),
    pytest.param("grpo_group", cut_depths(37, 50), 16, id="grpo_group-depths"),
    pytest.param("grpo_group", cut_depths(40), 16, id="grpo_group-shared_state"),
    pytest.param("deep_chain", cut_depths(30, 64), 16, id="deep_chain-depths"),
    pytest.param("wide_fanout", cut_depths(10), 4, id="wide_fanout-shared_state"),
    pytest.param("one_token_nodes", cut_depths(3, 6), 4, id="one_token_nodes-depths"),
    pytest.param("branch_at_65", cut_mid_node, 64, id="branch_at_65-mid_node"),
    pytest.param("branch_at_64", cut_depths(64, 100), 64, id="branch_at_64-on_grid"),
]


@pytest.mark.parametrize("tree, cut, chunk", CUTS)
def test_pieces_equal_unsplit(tree: str, cut, chunk: int) -> None:
    forest = RolloutForest.from_sequences(NASTY_TREES[tree](np.random.default_rng(0)))
    pieces = cut(forest, chunk)
    assert len(pieces) >= 2 and np.array_equal(np.sort(np.concatenate(pieces)), np.arange(forest.num_compact_tokens))
    gen = torch.Generator().manual_seed(2)
    inputs = {n: x.requires_grad_() for n, x in gdn_inputs(forest.num_compact_tokens, gen).items()}

    batch = TreeBatch.from_forest(forest)
    ref, _ = tree_gated_delta_rule(*inputs.values(), batch, chunk_size=chunk, use_qk_l2norm=True)
    weight = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad((weight * ref).sum(), list(inputs.values()))

    got, backward, handoffs = run_pieces(forest, inputs, pieces, chunk)
    assert handoffs > 0, "the cut must hand states over"
    assert_close("o", ref, got)
    backward(weight)
    for (name, x), r in zip(inputs.items(), ref_grads):
        assert_close(f"grad {name}", r, x.grad)


def test_missing_handoffs_are_refused() -> None:
    forest = RolloutForest.from_sequences(NASTY_TREES["grpo_group"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest, np.flatnonzero(forest.position >= 37))
    x = gdn_inputs(batch.num_tokens, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="context"):
        tree_gated_delta_rule(*x.values(), batch, chunk_size=16)


def test_inputs_that_do_not_fit_the_piece_are_refused() -> None:
    """Rows, context rows, context keys, state shapes and chunk sizes that do not fit: a clear error,
    never a shifted (silently wrong) run."""
    forest = RolloutForest.from_sequences(NASTY_TREES["grpo_group"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest, np.flatnonzero(forest.position >= 37))
    gen = torch.Generator().manual_seed(0)
    x, ctx = gdn_inputs(batch.num_tokens, gen), gdn_inputs(rounds_of(batch, 16).context_replay.numel(), gen)
    context = {n: ctx[n] for n in ("k", "v", "g", "beta")}
    fits = {"context": context, "initial_states": torch.zeros(rounds_of(batch, 16).external_tokens.numel(), H, K, V)}
    run = lambda x, **kw: tree_gated_delta_rule(*x.values(), batch, chunk_size=16, **(fits | kw))
    run(x)  # fits
    with pytest.raises(ValueError, match="input v has"):
        run({**x, "v": x["v"][:-1]})
    whole = gdn_inputs(forest.num_compact_tokens, gen)
    with pytest.raises(ValueError, match="context k has"):
        run(x, context={n: whole[n] for n in context})
    with pytest.raises(ValueError, match="context lacks 'beta'"):
        run(x, context={n: context[n] for n in ("k", "v", "g")})
    with pytest.raises(ValueError, match=r"initial_states must be \[E, H, K, V\]"):
        run(x, initial_states=fits["initial_states"].transpose(-1, -2))
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        tree_gated_delta_rule(*x.values(), batch, chunk_size=0, **fits)
